"""Expert parallelism for :class:`megablocks_core.layers.DroplessMoE` over ``torch.distributed``.

Each rank of the expert-parallel group owns ``E / W`` consecutive experts (rank r: experts
``[r * E/W, (r + 1) * E/W)``). The layer routes and gathers its own tokens as usual (rows sorted by
*global* expert, so the rows for each rank are contiguous), then :func:`expert_parallel_apply`:

1. exchanges the per-expert row counts (``all_to_all_single`` of a ``(W, E/W)`` integer tensor);
2. reads the send/receive split sizes on the host, the one device→host sync of a layer call
   (``all_to_all_single`` with uneven splits needs Python ints);
3. sends the rows to their experts' ranks (``all_to_all_single``, uneven splits);
4. regroups the received rows (source rank major, local expert minor) by local expert with
   ``ops.sort``/``ops.gather``, runs the local experts with ``ops.gmm``, and undoes the regrouping
   with ``ops.scatter``;
5. returns the results by the reverse ``all_to_all_single``.

Backward runs the same two row all-to-alls in reverse order (the adjoint of an all-to-all is the
all-to-all with the splits swapped); the counts exchange and the host read are not repeated.

The transport is torch.distributed's own ``all_to_all_single`` (gloo on CPU, NCCL/RCCL on GPUs);
only its autograd wrapper is here, because ``torch.distributed.nn.functional.all_to_all_single``
is deprecated (a ``FutureWarning`` on every call in current torch) and its suggested
replacement lives in the private ``torch.distributed._functional_collectives``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .. import ops


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


def expert_parallel_apply(
    rows: Tensor,
    tokens_per_expert: Tensor,
    experts: Callable[[Tensor, Tensor], Tensor],
    group: dist.ProcessGroup,
) -> Tensor:
    """Run each row through its expert when the experts are sharded over ``group``.

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
    # int64 so that no backend has to support a narrower integer collective.
    send_counts = tokens_per_expert.detach().to(torch.int64).reshape(world, local)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    # The one host read of the layer call: the row all-to-alls take their split sizes as ints.
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


__all__ = ["all_to_all", "expert_parallel_apply"]
