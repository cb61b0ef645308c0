"""Expert parallelism for :class:`megablocks_core.layers.DroplessMoE` over ``torch.distributed``.

Each rank of the expert-parallel group owns ``E / W`` consecutive experts (rank r: experts
``[r * E/W, (r + 1) * E/W)``). :func:`expert_parallel_moe` runs a layer call's experts and combines
their outputs; it moves each token once per rank that holds at least one of its top-k experts:

1. **Plan** (this rank's tokens). Every (token, rank) pair is a *slot*; a slot is used when the
   token has an expert on that rank. ``ops.route`` sorts the slots by (chunk, rank) with the unused
   ones in a last bin, and each slot's routing for its destination is written: the token's
   top-k expert ids as that rank's local ids (``E/W``, a sentinel, for experts elsewhere) and
   its top-k weights (0 for those). The per-(chunk, rank) token counts, and the (token, k) pairs
   among them that the destination's experts serve, go to their ranks in one small
   ``all_to_all_single``, and the counts sent and received are read on the host with one
   ``.tolist()``: the one device→host sync of a layer call (``all_to_all_single`` takes its split
   sizes as Python ints).
2. **Dispatch** (per chunk, asynchronous). Each used slot sends the token's row once, and, in a
   second exchange, its routing (:class:`_RoutingLayout`: one row of bytes per token).
3. **Experts** (per chunk, on the receiving rank). ``ops.route`` sorts the received (token, k)
   pairs by their local expert keys,
   the sentinel ones last, and the sentinel's bin is dropped (``bins[:E/W]``): the sorted rows
   past ``bins[-1]`` belong to no expert, which the fused ops' contracts allow. The layer's
   fused experts then run on the received tokens as they came, with this rank's pair count as
   their row count (no row at all for the sentinel pairs): ``ops.gather_gmm`` reads each pair's
   token row through the indices (no copy of the pairs' rows), and ``ops.gmm_scatter`` sums
   each token's weighted outputs into
   **one partial row per (token, rank)** (the sentinel pairs have weight 0 and add nothing).
4. **Combine** (per chunk, asynchronous). The partial rows go back by the reverse exchange; the
   source rank sums the partials of each token over the ranks with ``ops.scatter`` (no weights).

The token chunks (``chunks``, contiguous ranges of this rank's tokens, the same count on every
rank) form a pipeline: every chunk's dispatch is started at once (``async_op=True``), chunk i's
experts run as soon as its rows arrive, while the following chunks' rows are still on the link,
and its partials are sent back while chunk i + 1 computes. Backward mirrors it: the output
gradient of each chunk's partials goes out at once; as each chunk's arrives, its experts'
backward runs and the gradients of the token rows and of the top-k weights go back while the next
chunk computes.

Streams and lifetimes: the exchanges run where the process group runs them (NCCL: its own
communication stream, ordered after the current stream's work when started; ``Work.wait()`` makes
the current stream wait for the exchange). All computation stays on the current stream, so no
side stream of ours is needed for the overlap. Every tensor an exchange reads or writes is kept
referenced until its ``wait()``, so the caching allocator cannot hand its memory to other work
while the exchange still uses it.

Backward is exact: :class:`_ExpertParallelMoE` is one autograd Function whose backward returns the
gradients of the tokens, of the top-k weights (they are applied on the receiving rank, so their
gradient comes back through the exchange) and of the local expert parameters (the experts' own
autograd graph, recorded per chunk in forward from the received tokens and weights, is
differentiated with ``torch.autograd.grad``: the fused ops' own backward, with no copy of the
pairs' rows and no zero padding of the rows the sentinel pairs would fill).

``dispatch="allgather"`` (:class:`_AllGatherMoE`) is the other way: all-gather every rank's
tokens and routing, run the local experts on all of them (other ranks' choices as the sentinel),
reduce-scatter the partial rows; no split sizes, so no host sync, at the price of every token
reaching every rank (W - 1 rows per token on the link).

:func:`expert_parallel_apply` is the earlier exchange, kept as a baseline for benchmarks: it moves
one row per (token, expert) pair, so a token crosses the link up to top_k times.

The transport is torch.distributed's own ``all_to_all_single`` (gloo on CPU, NCCL/RCCL on GPUs);
only its autograd wrapper is here, because ``torch.distributed.nn.functional.all_to_all_single``
is deprecated (a ``FutureWarning`` on every call in current torch) and its suggested
replacement lives in the private ``torch.distributed._functional_collectives``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from .. import ops
from ..policy import overrides

if TYPE_CHECKING:  # moe imports this module lazily; only the annotations need the layer
    from .moe import DroplessMoE

#: Token chunks of :func:`expert_parallel_moe` when the caller gives none. One: on 2 H200s
#: (qwen3 and dsv3 shapes) two chunks were slower than one (11.3–12.1 vs 10.6–10.9 ms, 70.0 vs
#: 55.7–57.1 ms): each chunk repeats the collectives, the launches and the expert weights'
#: gradient GEMMs, which costs more than the overlap gains (docs/performance.md).
DEFAULT_CHUNKS = 1

# ops.route's padded_bins are not used here; any block size will do.
_BLOCK = 128
_NAME = "megablocks_core.layers.parallel.expert_parallel_moe"

#: ``experts(rows, tokens_per_expert)``: this rank's experts over rows grouped by local expert
#: (``DroplessMoE.experts``), as :func:`expert_parallel_apply` takes them.
Experts = Callable[[Tensor, Tensor], Tensor]
#: ``experts(x, weights, indices, bin_ids, bins, rows)``: this rank's experts applied to tokens x
#: through the routing and summed back into one row per token with the flat top-k weights, for
#: the first ``rows`` sorted pairs (None: all) (``DroplessMoE._fused_experts``), as
#: :func:`expert_parallel_moe` takes them.
FusedExperts = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, int | None], Tensor]


class _AllToAll(torch.autograd.Function):
    """``dist.all_to_all_single`` with uneven splits; backward is the same exchange reversed."""

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        send_splits: list[int],
        recv_splits: list[int],
        group: dist.ProcessGroup,
    ) -> Tensor:
        ctx.send_splits, ctx.recv_splits, ctx.group = send_splits, recv_splits, group
        out = x.new_empty((sum(recv_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None, None, None]:
        # Every rank must take part even when it needs no input gradient, so always exchange.
        out = grad.new_empty((sum(ctx.send_splits), *grad.shape[1:]))
        dist.all_to_all_single(
            out, grad.contiguous(), ctx.send_splits, ctx.recv_splits, group=ctx.group
        )
        return out, None, None, None


def all_to_all(
    x: Tensor, send_splits: list[int], recv_splits: list[int], group: dist.ProcessGroup
) -> Tensor:
    """Differentiable ``all_to_all_single`` along dim 0: ``send_splits[r]`` rows go to rank r,
    ``recv_splits[r]`` rows come from rank r (concatenated in rank order)."""
    return _AllToAll.apply(x, send_splits, recv_splits, group)


# ---------------------------------------------------------------------------
# One token per (token, rank), pipelined over chunks


class _InFlight:
    """An ``all_to_all_single`` started with ``async_op=True``, holding the tensors it reads and
    writes until :meth:`wait`: dropping them earlier would let the allocator reuse their memory
    while the exchange (on the process group's own stream) still uses it. ``out`` is read only
    after :meth:`wait` (on CUDA the exchange runs on NCCL's stream: only ``wait`` orders the
    current stream after it)."""

    __slots__ = ("tensors", "work")

    def __init__(
        self,
        out: Tensor,
        inp: Tensor,
        out_splits: list[int],
        in_splits: list[int],
        group: dist.ProcessGroup,
    ) -> None:
        # NCCL takes dense tensors only (it reads and writes raw pointers); every output here is
        # a row range of a contiguous buffer, and a provider's output may come in any layout.
        if not out.is_contiguous():
            raise RuntimeError(f"{_NAME}: internal error: an exchange output is not contiguous")
        inp = inp.contiguous()
        self.tensors: tuple[Tensor, ...] = (out, inp)
        self.work = dist.all_to_all_single(
            out, inp, out_splits, in_splits, group=group, async_op=True
        )

    def wait(self) -> Tensor:
        """Block until the exchange is done (on CUDA: order the current stream after it)."""
        assert self.work is not None
        self.work.wait()
        out = self.tensors[0]
        self.tensors = ()
        return out


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class _RoutingLayout:
    """A dispatched token's routing as one row of bytes: its top-k keys (int32), its top-k weights.

    The keys are local expert ids on the destination rank, ``E/W`` (a sentinel that sorts last)
    for the token's experts elsewhere, whose weights are 0: the receiver routes them as they
    come. The weights start at a multiple of 8 bytes and rows are padded to 8, so both parts view
    as their dtype in place (no copy)."""

    top_k: int
    weights_dtype: torch.dtype

    @property
    def weights_offset(self) -> int:
        return _round_up(4 * self.top_k, 8)

    @property
    def row_bytes(self) -> int:
        return _round_up(self.weights_offset + self.top_k * self.weights_dtype.itemsize, 8)

    def keys(self, buffer: Tensor) -> Tensor:
        return buffer[..., : 4 * self.top_k].view(torch.int32)

    def weights(self, buffer: Tensor) -> Tensor:
        start = self.weights_offset
        return buffer[..., start : start + self.top_k * self.weights_dtype.itemsize].view(
            self.weights_dtype
        )


def _as_received(
    ids: Tensor, weights: Tensor, local: int, rank: Tensor | int
) -> tuple[Tensor, Tensor, Tensor]:
    """Top-k expert ``ids`` (global) and ``weights`` as ``rank`` routes them: (which choices are
    its experts, their local ids with ``local`` for the others, weights with 0 for the others).
    ``local`` is a sentinel expert that sorts past the rank's last one; ``rank`` may be a tensor
    of ranks that broadcasts against ``ids``."""
    mine = torch.div(ids, local, rounding_mode="floor") == rank
    return mine, torch.where(mine, ids.remainder(local), local), torch.where(mine, weights, 0)


@dataclass
class _Plan:
    """Split sizes (host ints) and slot routing (device) of one call, shared by forward and backward.

    Slots are (token, rank) pairs with flat id ``token * world + rank``, sorted by (chunk, rank);
    the first ``sent`` sorted slots are the rows sent, chunk c's at ``offsets[c]``.
    """

    world: int
    send_splits: list[list[int]]  # [chunk][rank]: tokens sent to rank
    recv_splits: list[list[int]]  # [chunk][rank]: tokens received from rank
    recv_pairs: list[int]  # [chunk]: (token, k) pairs of this rank's experts among those received
    offsets: list[int]  # [chunk]: first sorted slot of the chunk
    sent: int
    slot_indices: Tensor
    slot_bin_ids: Tensor
    slot_bins: Tensor
    slot_tokens: Tensor  # token of each sorted slot (the first `sent` are the rows sent)
    slot_routing: Tensor  # (tokens * world, _RoutingLayout.row_bytes): each slot's routing

    def send_slice(self, chunk: int) -> slice:
        start = self.offsets[chunk]
        return slice(start, start + sum(self.send_splits[chunk]))

    def combine(self, slots: Tensor) -> Tensor:
        """Sum each token's sorted slots (``slots`` has ``tokens * world`` rows, unused ones 0)."""
        return ops.scatter(
            slots, self.slot_indices, self.slot_bin_ids, None, self.slot_bins, self.world
        )


@functools.lru_cache(maxsize=16)
def _slot_keys_base(
    tokens: int, chunks: int, world: int, device: torch.device
) -> tuple[Tensor, Tensor]:
    """(tokens, world) sort keys ``chunk(t) * world + r`` of the slots, and the ranks (1, W, 1).

    Chunk c holds tokens [c*T//C, (c+1)*T//C): the largest c with c*T//C <= t. Cached: the same
    few token counts recur call after call, and these are several small kernels each."""
    t = torch.arange(tokens, device=device)
    chunk = torch.div((t + 1) * chunks + tokens - 1, max(tokens, 1), rounding_mode="floor") - 1
    ranks = torch.arange(world, device=device)
    return (chunk.unsqueeze(1) * world + ranks).int(), ranks.int().view(1, world, 1)


def _plan(
    top_experts: Tensor,
    weights: Tensor,
    num_experts: int,
    chunks: int,
    layout: _RoutingLayout,
    group: dist.ProcessGroup,
) -> _Plan:
    world = dist.get_world_size(group)
    local = num_experts // world
    tokens = top_experts.shape[0]
    slot_base, all_ranks = _slot_keys_base(tokens, chunks, world, top_experts.device)
    # mine[t, r, k]: token t's k-th expert lives on rank r. Each slot's routing (the keys and
    # weights its destination receives) is written for every slot now, before the host sync,
    # so that only row copies remain between the sync and the exchange.
    mine, slot_keys, slot_weights = _as_received(
        top_experts.unsqueeze(1), weights.unsqueeze(1), local, all_ranks
    )
    routing = top_experts.new_empty((tokens, world, layout.row_bytes), dtype=torch.uint8)
    layout.keys(routing).copy_(slot_keys)
    layout.weights(routing).copy_(slot_weights)
    keys = torch.where(mine.any(2), slot_base, chunks * world).flatten()
    indices, bin_ids, slots_per_bin, bins, _ = ops.route(keys, chunks * world + 1, _BLOCK)

    # send_counts[r, c] = tokens of chunk c for rank r, and [r, chunks + c] the (token, k) pairs
    # among them that rank r's experts serve (so the receiver computes only those pairs); int64
    # so that no backend has to support a narrower integer collective.
    pairs = torch.zeros(chunks * world + 1, dtype=torch.int64, device=keys.device)
    pairs.scatter_add_(0, keys.long(), mine.sum(2, dtype=torch.int64).flatten())
    per_chunk = slots_per_bin[:-1].view(chunks, world)
    send_counts = per_chunk.new_empty((world, 2 * chunks), dtype=torch.int64)
    send_counts[:, :chunks].copy_(per_chunk.t())
    send_counts[:, chunks:].copy_(pairs[:-1].view(chunks, world).t())
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    slot_tokens = torch.div(indices, world, rounding_mode="floor")
    # The one host read of the layer call: all chunks' split sizes and pair counts at once.
    sent_to, received_from = torch.stack([send_counts, recv_counts]).tolist()

    send_splits = [[sent_to[r][c] for r in range(world)] for c in range(chunks)]
    offsets, total = [], 0
    for split in send_splits:
        offsets.append(total)
        total += sum(split)
    return _Plan(
        world=world,
        send_splits=send_splits,
        recv_splits=[[received_from[r][c] for r in range(world)] for c in range(chunks)],
        recv_pairs=[sum(received_from[r][chunks + c] for r in range(world)) for c in range(chunks)],
        offsets=offsets,
        sent=total,
        slot_indices=indices,
        slot_bin_ids=bin_ids,
        slot_bins=bins,
        slot_tokens=slot_tokens,
        slot_routing=routing.view(tokens * world, layout.row_bytes),
    )


class _LocalChunk:
    """One chunk's received tokens through this rank's experts: one partial row per token.

    The fused experts read the received rows in place (``ops.gather_gmm``) and sum each token's
    weighted outputs (``ops.gmm_scatter``); the (token, k) pairs of other ranks' experts came
    with the sentinel key ``local`` and weight 0, so they sort past the last local bin, where
    they belong to no expert. Given their count (``pairs``, this rank's pairs), the fused ops
    compute, keep and differentiate only those sorted rows. With ``record``, the forward records
    that graph from two leaves, the received rows and the received weights, and backward
    differentiates it with ``torch.autograd.grad``."""

    def __init__(
        self,
        rows: Tensor,
        keys: Tensor,
        weights: Tensor,
        local: int,
        experts: FusedExperts,
        record: bool,
        pairs: int | None = None,
    ) -> None:
        """``keys``: (rows, K) local expert ids, ``local`` for other ranks' experts, whose
        ``weights`` (rows, K) are 0; ``pairs``: how many keys are not ``local`` (None: unknown)."""
        indices, bin_ids, _, bins, _ = ops.route(keys.flatten(), local + 1, _BLOCK)
        with torch.enable_grad() if record else torch.no_grad():
            if record:
                rows = rows.detach().requires_grad_()
                weights = weights.detach().requires_grad_()
            # Dropping the sentinel's bin leaves its pairs past bins[-1] (= pairs): no expert's
            # rows, so they are neither gathered nor multiplied (nor, given pairs, allocated);
            # weight 0 besides, so they add nothing.
            partial = experts(rows, weights.flatten(), indices, bin_ids, bins[:local], pairs)
        self.received, self.weights = rows, weights
        self.graph: Tensor | None = partial if record else None
        self.partial: Tensor | None = partial.detach()

    def take_partial(self) -> Tensor:
        """The partial rows (once: the exchange that sends them keeps them until it is done)."""
        partial, self.partial = self.partial, None
        assert partial is not None
        return partial

    def backward(
        self, grad_partial: Tensor, parameters: Sequence[Tensor]
    ) -> tuple[Tensor, Tensor, tuple[Tensor | None, ...]]:
        """Gradients of the received rows, of the received weights (rows, K) and of ``parameters``."""
        assert self.graph is not None
        wanted = [p for p in parameters if p.requires_grad]
        grads = torch.autograd.grad(
            self.graph, [self.received, self.weights, *wanted], grad_partial, allow_unused=True
        )
        self.graph = None
        grad_received = grads[0] if grads[0] is not None else torch.zeros_like(self.received)
        grad_weights = grads[1] if grads[1] is not None else torch.zeros_like(self.weights)
        by_parameter = iter(grads[2:])
        parameter_grads = tuple(next(by_parameter) if p.requires_grad else None for p in parameters)
        return grad_received, grad_weights, parameter_grads


class _ExpertParallelMoE(torch.autograd.Function):
    """x, top-k weights and expert parameters → combined expert outputs; see the module docstring."""

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        weights: Tensor,
        top_experts: Tensor,
        num_experts: int,
        experts: FusedExperts,
        group: dist.ProcessGroup,
        chunks: int,
        record: bool,
        *parameters: Tensor,
    ) -> Tensor:
        world, top_k, hidden = dist.get_world_size(group), top_experts.shape[1], x.shape[1]
        layout = _RoutingLayout(top_k, weights.dtype)
        plan = _plan(top_experts, weights, num_experts, chunks, layout, group)
        local = num_experts // world

        sent = slice(0, plan.sent)
        send_rows = x.index_select(0, plan.slot_tokens[sent])
        send_routing = plan.slot_routing.index_select(0, plan.slot_indices[sent])
        dispatches = []
        for c in range(chunks):  # every chunk's rows are ready: start all their exchanges now
            rows = sum(plan.recv_splits[c])
            part = plan.send_slice(c)
            split_in, split_out = plan.send_splits[c], plan.recv_splits[c]
            dispatches.append(
                (
                    _InFlight(
                        x.new_empty(rows, hidden), send_rows[part], split_out, split_in, group
                    ),
                    _InFlight(
                        send_routing.new_empty(rows, layout.row_bytes),
                        send_routing[part],
                        split_out,
                        split_in,
                        group,
                    ),
                )
            )
        del send_rows, send_routing  # the exchanges hold them until they are done

        slots = x.new_empty(x.shape[0] * world, hidden)  # partials back, by sorted slot
        slots[plan.sent :].zero_()
        chunk_states, returns = [], []
        for c, (rows_in, routing_in) in enumerate(dispatches):
            routing = routing_in.wait()
            state = _LocalChunk(
                rows_in.wait(),
                layout.keys(routing),
                layout.weights(routing),
                local,
                experts,
                record,
                plan.recv_pairs[c],
            )
            returns.append(
                _InFlight(
                    slots[plan.send_slice(c)],
                    state.take_partial(),
                    plan.send_splits[c],
                    plan.recv_splits[c],
                    group,
                )
            )
            chunk_states.append(state if record else None)
        for exchange in returns:
            exchange.wait()
        ctx.plan, ctx.chunk_states, ctx.group = plan, chunk_states, group
        ctx.top_k, ctx.weights_dtype, ctx.parameters = top_k, weights.dtype, parameters
        return plan.combine(slots)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        plan: _Plan = ctx.plan
        states: list[_LocalChunk | None] = ctx.chunk_states
        if any(state is None for state in states):
            raise RuntimeError(
                f"{_NAME}: backward ran twice through one call (retain_graph is not supported), "
                "or the forward recorded no graph"
            )
        group, world, hidden = ctx.group, plan.world, grad_out.shape[1]
        tokens = grad_out.shape[0]
        # Every chunk's output gradient is known: start all of their exchanges now. (The gradient
        # of a partial row is its token's output gradient: the source sums the partials.)
        grad_partials = grad_out.index_select(0, plan.slot_tokens[: plan.sent])
        arriving = []
        for c in range(len(states)):
            out = grad_out.new_empty(sum(plan.recv_splits[c]), hidden)
            arriving.append(
                _InFlight(
                    out,
                    grad_partials[plan.send_slice(c)],
                    plan.recv_splits[c],
                    plan.send_splits[c],
                    group,
                )
            )
        del grad_partials

        grad_slots = grad_out.new_empty(tokens * world, hidden)
        grad_slots[plan.sent :].zero_()
        wgrad_slots = grad_out.new_empty(tokens * world, ctx.top_k, dtype=ctx.weights_dtype)
        wgrad_slots[plan.sent :].zero_()
        parameter_grads: list[Tensor | None] = [None] * len(ctx.parameters)
        returns = []
        for c, exchange in enumerate(arriving):
            state = states[c]
            assert state is not None
            grad_received, grad_weights, grads = state.backward(exchange.wait(), ctx.parameters)
            states[c] = None  # its graph and saved rows are no longer needed
            for i, grad in enumerate(grads):
                if grad is not None:
                    acc = parameter_grads[i]
                    parameter_grads[i] = grad if acc is None else acc.add_(grad)
            part = plan.send_slice(c)
            split_in, split_out = plan.recv_splits[c], plan.send_splits[c]
            returns.append(_InFlight(grad_slots[part], grad_received, split_out, split_in, group))
            returns.append(
                _InFlight(
                    wgrad_slots[part],
                    grad_weights.to(ctx.weights_dtype),
                    split_out,
                    split_in,
                    group,
                )
            )
        for exchange in returns:
            exchange.wait()
        grad_x = plan.combine(grad_slots) if ctx.needs_input_grad[0] else None
        grad_w = plan.combine(wgrad_slots) if ctx.needs_input_grad[1] else None
        return (grad_x, grad_w, None, None, None, None, None, None, *parameter_grads)


# ---------------------------------------------------------------------------
# Every token to every rank: all-gather in, reduce-scatter out (no host sync)


def _all_gather(out: Tensor, inp: Tensor, group: dist.ProcessGroup, async_op: bool = False) -> Any:
    """``out`` = every rank's ``inp`` stacked in rank order (equal sizes on every rank)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(out, inp.contiguous(), group=group, async_op=async_op)


def _reduce_scatter(inp: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Rank r's ``1/W`` share of ``inp`` (rows ``[r*n, (r+1)*n)``) summed over the ranks."""
    world = dist.get_world_size(group)
    out = inp.new_empty((inp.shape[0] // world, *inp.shape[1:]))
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    scatter(out, inp.contiguous(), group=group)
    return out


def _check_same_tokens(tokens: int, group: dist.ProcessGroup, device: torch.device) -> None:
    """Checked mode only (a host read): every rank passes the same number of tokens."""
    counts = torch.zeros(dist.get_world_size(group), dtype=torch.int64, device=device)
    _all_gather(counts, torch.tensor([tokens], dtype=torch.int64, device=device), group)
    seen = counts.tolist()
    if len(set(seen)) > 1:
        raise ValueError(
            f"{_NAME}: dispatch='allgather' needs the same number of tokens on every rank of "
            f"the group; got {seen}"
        )


class _AllGatherMoE(torch.autograd.Function):
    """x, top-k weights and expert parameters → expert outputs, every token on every rank.

    Forward: all-gather the tokens and their routing; each rank runs its experts on every
    rank's tokens (the choices of other ranks' experts are the sentinel bin ``E/W`` with weight
    0: sorted rows past ``bins[-1]``, no expert's) and sums each token's outputs into one
    partial row; a reduce-scatter sums the partials over the ranks into each rank's tokens.
    Backward: all-gather the output gradient, differentiate the recorded experts' graph, and
    reduce-scatter the gradients of the tokens and of the weights. No split sizes, so no host
    read."""

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        weights: Tensor,
        top_experts: Tensor,
        num_experts: int,
        experts: FusedExperts,
        group: dist.ProcessGroup,
        record: bool,
        *parameters: Tensor,
    ) -> Tensor:
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        tokens, top_k = top_experts.shape
        local = num_experts // world
        all_x = x.new_empty(world * tokens, x.shape[1])
        rows_in = _all_gather(all_x, x, group, async_op=True)
        layout = _RoutingLayout(top_k, weights.dtype)
        routing = top_experts.new_empty((tokens, layout.row_bytes), dtype=torch.uint8)
        layout.keys(routing).copy_(top_experts)
        layout.weights(routing).copy_(weights)
        all_routing = routing.new_empty(world * tokens, layout.row_bytes)
        _all_gather(all_routing, routing, group)
        _, keys, all_weights = _as_received(
            layout.keys(all_routing), layout.weights(all_routing), local, rank
        )
        rows_in.wait()
        state = _LocalChunk(all_x, keys, all_weights, local, experts, record)
        ctx.state = state if record else None
        ctx.group, ctx.parameters = group, parameters
        return _reduce_scatter(state.take_partial(), group)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        state: _LocalChunk | None = ctx.state
        if state is None or state.graph is None:
            raise RuntimeError(
                f"{_NAME}: backward ran twice through one call (retain_graph is not supported), "
                "or the forward recorded no graph"
            )
        group = ctx.group
        grad_all = grad_out.new_empty(state.received.shape)
        _all_gather(grad_all, grad_out, group)
        grad_rows, grad_weights, parameter_grads = state.backward(grad_all, ctx.parameters)
        ctx.state = None
        # Every rank takes part in both exchanges, whatever it needs.
        grad_x = _reduce_scatter(grad_rows, group)
        grad_w = _reduce_scatter(grad_weights, group)
        return (
            grad_x if ctx.needs_input_grad[0] else None,
            grad_w if ctx.needs_input_grad[1] else None,
            *(None,) * 5,
            *parameter_grads,
        )


#: The two ways :func:`expert_parallel_moe` moves tokens.
DISPATCHES = ("alltoall", "allgather")


def expert_parallel_moe(
    x: Tensor,
    weights: Tensor,
    top_experts: Tensor,
    num_experts: int,
    experts: FusedExperts,
    expert_parameters: Sequence[Tensor],
    group: dist.ProcessGroup,
    *,
    chunks: int = DEFAULT_CHUNKS,
    dispatch: str = "alltoall",
) -> Tensor:
    """The MoE output of this rank's tokens when the experts are sharded over ``group``.

    ``out[t] = sum_k weights[t, k] * expert_{top_experts[t, k]}(x[t])``, where each expert runs on
    the rank that holds it. Each token crosses to a rank once, however many of its top-k experts
    that rank holds (see the module docstring).

    Args:
        x: this rank's tokens, ``(tokens, hidden)`` (possibly no tokens).
        weights: their top-k weights, ``(tokens, top_k)`` floating point; differentiable.
        top_experts: their top-k global expert ids, ``(tokens, top_k)`` integer in ``[0, E)``.
        num_experts: E, a multiple of the group's size W; rank r holds experts
            ``[r * E/W, (r + 1) * E/W)``.
        experts: ``experts(x, weights, indices, bin_ids, bins, rows)`` applies this rank's E/W
            experts to tokens ``x`` (tokens, hidden) through the routing of their (token, k)
            pairs by local expert (``ops.route``'s ``indices`` and ``bin_ids``, ``bins`` of
            length E/W) and returns, per token, the sum of its pairs' outputs times ``weights``
            (flat, tokens * top_k): ``DroplessMoE._fused_experts`` (``ops.gather_gmm``,
            activation, ``ops.gmm_scatter``). Sorted pairs past ``bins[-1]`` (those of other
            ranks' experts, with weight 0) belong to no expert and must add nothing, as the fused
            ops' contracts say; ``rows`` (an int, = ``bins[-1]``, or None where unknown) is the
            number of pairs before them: the fused ops' row count, so that nothing is computed
            or kept for the others.
        expert_parameters: the tensors ``experts`` uses that may need a gradient (they receive
            the gradient of every rank's tokens that reached them).
        group: the expert-parallel process group.
        chunks: token chunks pipelined against each other (>= 1, the same on every rank;
            1: no overlap). Chunks may be empty (more chunks than tokens). ``"alltoall"`` only.
        dispatch: ``"alltoall"`` (each token once to each rank holding one of its experts; see
            the module docstring) or ``"allgather"`` (:class:`_AllGatherMoE`: every rank's tokens
            to every rank, the outputs summed back by a reduce-scatter; no host sync; every rank
            must pass the same number of tokens, which ``MEGABLOCKS_CHECK=1`` checks).

    Returns ``(tokens, hidden)`` in x's dtype. Collective: every rank of the group calls it, once
    per layer call, in the same order, and runs its backward. ``"alltoall"``: one device→host
    sync (all split sizes at once); ``"allgather"``: none.
    """
    if x.dim() != 2 or weights.dim() != 2 or top_experts.shape != weights.shape:
        raise ValueError(
            f"{_NAME}: expected x (tokens, hidden), weights and top_experts (tokens, top_k); got "
            f"x {tuple(x.shape)}, weights {tuple(weights.shape)}, "
            f"top_experts {tuple(top_experts.shape)}"
        )
    if weights.shape[0] != x.shape[0]:
        raise ValueError(f"{_NAME}: weights has {weights.shape[0]} rows, x has {x.shape[0]} tokens")
    if not weights.is_floating_point() or top_experts.is_floating_point():
        raise TypeError(
            f"{_NAME}: expected floating-point weights and integer top_experts, got "
            f"{weights.dtype} and {top_experts.dtype}"
        )
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"{_NAME}: chunks must be an int >= 1, got {chunks!r}")
    if dispatch not in DISPATCHES:
        raise ValueError(f"{_NAME}: dispatch must be one of {DISPATCHES}, got {dispatch!r}")
    if dispatch == "allgather" and chunks != 1:
        raise ValueError(f"{_NAME}: dispatch='allgather' runs in one piece (chunks=1)")
    world = dist.get_world_size(group)
    if num_experts % world:
        raise ValueError(f"{_NAME}: {num_experts} experts do not divide over {world} ranks")
    return _expert_parallel_moe(
        x,
        weights,
        top_experts,
        num_experts,
        experts,
        expert_parameters,
        group,
        chunks=chunks,
        dispatch=dispatch,
    )


def _expert_parallel_moe(
    x: Tensor,
    weights: Tensor,
    top_experts: Tensor,
    num_experts: int,
    experts: FusedExperts,
    expert_parameters: Sequence[Tensor],
    group: dist.ProcessGroup,
    *,
    chunks: int,
    dispatch: str,
) -> Tensor:
    """:func:`expert_parallel_moe` without its argument checks, for callers that have made them:
    :class:`DroplessMoE` checks its expert-parallel arguments in its constructor and its input in
    ``forward``, and routes the tokens itself."""
    record = torch.is_grad_enabled() and any(
        t.requires_grad for t in (x, weights, *expert_parameters)
    )
    if dispatch == "allgather":
        if overrides.checked:  # MEGABLOCKS_CHECK=1
            _check_same_tokens(x.shape[0], group, x.device)
        return _AllGatherMoE.apply(
            x,
            weights,
            top_experts.int(),
            num_experts,
            experts,
            group,
            record,
            *expert_parameters,
        )
    return _ExpertParallelMoE.apply(
        x,
        weights,
        top_experts.int(),
        num_experts,
        experts,
        group,
        chunks,
        record,
        *expert_parameters,
    )


# ---------------------------------------------------------------------------
# The per-(token, expert) exchange: a baseline


def expert_parallel_apply(
    rows: Tensor,
    tokens_per_expert: Tensor,
    experts: Experts,
    group: dist.ProcessGroup,
) -> Tensor:
    """Run each (token, expert) row through its expert, one row per pair on the link.

    The exchange :class:`DroplessMoE` used before :func:`expert_parallel_moe`, kept as a baseline
    (``benchmarks/expert_parallel_nccl.py`` times both): the caller routes and gathers its tokens
    as usual (rows sorted by *global* expert, so the rows for each rank are contiguous); the
    per-expert counts are exchanged, the split sizes read on the host (one sync), the rows sent
    to their experts' ranks, regrouped there by local expert (``ops.sort``/``ops.gather``), run
    through the experts, ungrouped (``ops.scatter``) and sent back. Backward runs the two row
    exchanges in reverse. No overlap.

    Args:
        rows: this rank's rows sorted by global expert id, ``(sum(tokens_per_expert), hidden)``
            (``ops.gather``'s output).
        tokens_per_expert: global per-expert row counts of ``rows``, ``(E,)`` integer.
        experts: ``experts(local_rows, local_tokens_per_expert)`` runs this rank's ``E / W``
            experts over rows grouped by local expert (``DroplessMoE.experts`` with local weights).
        group: the expert-parallel process group (world size W, ``E % W == 0``).

    Returns the expert outputs of ``rows``, in ``rows``' order. Collective: every rank of the
    group must call it, once per layer call, in the same order. One device→host sync (the split
    sizes).
    """
    world = dist.get_world_size(group)
    num_experts = tokens_per_expert.shape[0]
    if num_experts % world:
        raise ValueError(
            f"expert parallelism: {num_experts} experts do not divide over {world} ranks"
        )
    local = num_experts // world

    # send_counts[r, e]: my rows for rank r's local expert e; recv_counts[r, e]: rank r's rows for mine.
    send_counts = tokens_per_expert.detach().to(torch.int64).reshape(world, local)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    send_splits, recv_splits = torch.stack([send_counts.sum(1), recv_counts.sum(1)]).tolist()

    received = all_to_all(rows, send_splits, recv_splits, group)

    # Received rows are grouped by source rank, then by local expert; group them by local expert
    # (a stable sort keeps each expert's rows in source-rank order). output_size avoids a sync.
    with torch.no_grad():
        ids = torch.arange(local, dtype=torch.int64, device=rows.device).repeat(world)
        local_ids = torch.repeat_interleave(
            ids, recv_counts.flatten(), output_size=received.shape[0]
        ).int()
        bin_ids, order = ops.sort(local_ids, max(local - 1, 1).bit_length())
        local_counts = recv_counts.sum(0)  # stays on the device for ops.gmm
        bins = ops.inclusive_cumsum(local_counts.int(), 0)
    grouped = ops.gather(received, order, bin_ids, bins, 1)
    out = experts(grouped, local_counts)
    # scatter with top_k=1 and no weights is the inverse permutation of the gather above.
    out = ops.scatter(out, order, bin_ids, None, bins, 1)

    return all_to_all(out, recv_splits, send_splits, group)


def expert_parallel_baseline(layer: DroplessMoE, x: Tensor) -> tuple[Tensor, Tensor]:
    """``layer``'s forward (output, load-balancing loss) with :func:`expert_parallel_apply`'s
    exchange (one row per (token, expert) pair on the link) instead of
    :func:`expert_parallel_moe`'s: the baseline the benchmark times, exact like the layer.
    ``x`` is (tokens, hidden); ``layer`` has an ``expert_parallel_group``."""
    from .moe import load_balancing_loss

    if layer.expert_parallel_group is None:
        raise ValueError("expert_parallel_baseline: the layer has no expert_parallel_group")
    probs, weights, top_experts = layer.route(x)
    with torch.no_grad():
        indices, bin_ids, counts, bins, _ = ops.route(
            top_experts.flatten(), layer.num_experts, layer.block_size
        )
    rows = ops.gather(x, indices, bin_ids, bins, layer.top_k)
    rows = expert_parallel_apply(rows, counts, layer.experts, layer.expert_parallel_group)
    out = ops.scatter(rows, indices, bin_ids, weights.flatten(), bins, layer.top_k)
    coefficient = layer.load_balancing_loss_coefficient
    return out, load_balancing_loss(counts, probs, layer.top_k, coefficient)


__all__ = [
    "DEFAULT_CHUNKS",
    "all_to_all",
    "expert_parallel_apply",
    "expert_parallel_baseline",
    "expert_parallel_moe",
]
