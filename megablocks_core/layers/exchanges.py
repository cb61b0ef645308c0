"""The exchanges of expert parallelism (:mod:`megablocks_core.layers.parallel` describes the
design): the differentiable ``all_to_all``; the ``"alltoall"`` dispatch, one row per (token, rank)
pipelined over token chunks (:class:`_ExpertParallelMoE`, with its plan, routing layout and
per-chunk expert state); and the ``"allgather"`` dispatch (:class:`_AllGatherMoE`)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .. import ops

# ops.route's padded_bins are not used here; any block size will do.
_BLOCK = 128
_NAME = "megablocks_core.layers.parallel.expert_parallel_moe"

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
