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
only its autograd wrapper is ours (in :mod:`megablocks_core.layers.exchanges`), because
``torch.distributed.nn.functional.all_to_all_single`` is deprecated (a ``FutureWarning`` on every
call in current torch) and its suggested replacement lives in the private
``torch.distributed._functional_collectives``.

This module is the layer's glue (the checked entry point, the baseline);
:mod:`megablocks_core.layers.exchanges` holds the exchanges and the two dispatches' autograd
Functions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .. import ops
from ..policy import overrides
from .exchanges import (
    _NAME,
    FusedExperts,
    _AllGatherMoE,
    _check_same_tokens,
    _ExpertParallelMoE,
    all_to_all,
)

# Reached here by the tests (_InFlight) and the benchmarks (_RoutingLayout).
from .exchanges import _InFlight as _InFlight
from .exchanges import _RoutingLayout as _RoutingLayout

#: Token chunks of :func:`expert_parallel_moe` when the caller gives none. One: on 2 H200s
#: (qwen3 and dsv3 shapes) two chunks were slower than one (11.3–12.1 vs 10.6–10.9 ms, 70.0 vs
#: 55.7–57.1 ms): each chunk repeats the collectives, the launches and the expert weights'
#: gradient GEMMs, which costs more than the overlap gains (docs/performance.md).
DEFAULT_CHUNKS = 1

#: ``experts(rows, tokens_per_expert)``: this rank's experts over rows grouped by local expert
#: (``DroplessMoE.experts``), as :func:`expert_parallel_apply` takes them.
Experts = Callable[[Tensor, Tensor], Tensor]


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


__all__ = [
    "DEFAULT_CHUNKS",
    "all_to_all",
    "expert_parallel_apply",
    "expert_parallel_moe",
]
