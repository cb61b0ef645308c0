"""Every op in plain, vectorised PyTorch: the oracle the other backends are checked against.

Inputs arrive validated (the core checks them against the contracts), so these
functions only compute. They run on any torch device and read nothing back to
the host except where an output's size depends on data (padded_gather) or the
per-expert loop of the grouped GEMM needs the group sizes.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def _acc(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: float32, or float64 for float64 data."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _starts(ends: Tensor) -> Tensor:
    """Exclusive starts of segments given their inclusive end offsets."""
    return torch.cat([ends.new_zeros(1), ends[:-1]]).long()


def _segment_of(ends: Tensor, count: int) -> Tensor:
    """For positions 0..count-1, the segment whose [start, end) range holds each one."""
    positions = torch.arange(count, device=ends.device, dtype=torch.int64)
    return torch.searchsorted(ends.long().contiguous(), positions, right=True)


# --- routing -------------------------------------------------------------------


def sort(x: Tensor, end_bit: int | None) -> tuple[Tensor, Tensor]:
    values, order = torch.sort(x, stable=True)
    return values, order.to(x.dtype)


def histogram(x: Tensor, num_bins: int) -> Tensor:
    rows = x.reshape(math.prod(x.shape[:-1]), x.shape[-1]).long()
    counts = torch.zeros(rows.shape[0], num_bins + 1, dtype=torch.int32, device=x.device)
    # Out-of-range keys go to the extra last bin, which is cut off: no host sync, no masking copy.
    valid = (rows >= 0) & (rows < num_bins)
    target = torch.where(valid, rows, num_bins)
    counts.scatter_add_(1, target, torch.ones_like(target, dtype=torch.int32))
    return counts[:, :num_bins].reshape(*x.shape[:-1], num_bins).contiguous()


def inclusive_cumsum(x: Tensor, dim: int) -> Tensor:
    return x.long().cumsum(dim).to(x.dtype)


def exclusive_cumsum(x: Tensor, dim: int) -> Tensor:
    wide = x.long()
    return (wide.cumsum(dim) - wide).to(x.dtype)


def topology(padded_bins: Tensor, block_size: int, output_block_rows: int,
             output_block_columns: int) -> Tensor:
    expert = _segment_of(padded_bins.long() // block_size, output_block_rows)
    columns = torch.arange(output_block_columns, device=padded_bins.device)
    return (expert[:, None] * output_block_columns + columns).to(torch.int16).reshape(-1)


def replicate(x: Tensor, bins: Tensor, num_outputs: int) -> Tensor:
    num_bins = x.shape[1]
    expert = _segment_of(bins, num_outputs)
    # Columns past bins[-1] belong to no bin: read a zero column appended at the end.
    padded = torch.cat([x, x.new_zeros(x.shape[0], 1)], dim=1)
    return padded.index_select(1, expert.clamp(max=num_bins))


def replicate_backward(grad: Tensor, bins: Tensor) -> Tensor:
    num_bins = bins.shape[0]
    expert = _segment_of(bins, grad.shape[1])
    sums = torch.zeros(grad.shape[0], num_bins + 1, dtype=_acc(grad.dtype), device=grad.device)
    sums.index_add_(1, expert, grad.to(sums.dtype))
    return sums[:, :num_bins].to(grad.dtype).contiguous()


def route(top_experts: Tensor, num_experts: int,
          block_size: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    # Composed from the *dispatched* primitives, so on a device whose backend provides sort,
    # histogram and cumsum (but no fused route) those kernels do the work.
    from megablocks_core import ops

    end_bit = max((num_experts - 1).bit_length(), 1)
    bin_ids, indices = ops.sort(top_experts, end_bit)
    counts = ops.histogram(top_experts, num_experts)
    padded = ops.inclusive_cumsum(ops.round_up(counts, block_size), 0)
    return indices, bin_ids, counts, ops.inclusive_cumsum(counts, 0), padded


# --- permutation -------------------------------------------------------------------


def _inverse(indices: Tensor) -> Tensor:
    """position[f] = i where indices[i] = f: the sorted row of each flat (token, k) id."""
    flat = indices.long()
    order = torch.arange(flat.shape[0], device=flat.device)
    return torch.empty_like(flat).scatter_(0, flat, order)


def gather(x: Tensor, indices: Tensor, bin_ids: Tensor, weights: Tensor | None, bins: Tensor,
           top_k: int) -> Tensor:
    flat = indices.long()
    rows = x.index_select(0, flat // top_k)
    if weights is None:
        return rows
    scale = weights.index_select(0, flat).to(_acc(x.dtype))
    return (rows.to(scale.dtype) * scale[:, None]).to(x.dtype)


def scatter(x: Tensor, indices: Tensor, bin_ids: Tensor, weights: Tensor | None, bins: Tensor,
            top_k: int) -> Tensor:
    rows, hidden = x.shape
    # Token-major order: row f is the (token, k) pair f = token * top_k + k.
    by_token = x.index_select(0, _inverse(indices)).to(_acc(x.dtype))
    if weights is not None:
        by_token = by_token * weights.to(by_token.dtype)[:, None]
    return by_token.view(rows // top_k, top_k, hidden).sum(1).to(x.dtype)


def scatter_wgrad(x: Tensor, grad: Tensor, indices: Tensor, bin_ids: Tensor, bins: Tensor,
                  top_k: int) -> Tensor:
    flat = indices.long()
    acc = _acc(x.dtype)
    dots = (x.to(acc) * grad.index_select(0, flat // top_k).to(acc)).sum(1)
    return torch.empty_like(dots).scatter_(0, flat, dots).to(x.dtype)


def _padded_rows(bin_ids: Tensor, bins: Tensor, padded_bins: Tensor) -> Tensor:
    """Row in the padded layout of each sorted row."""
    expert = bin_ids.long()
    position = torch.arange(expert.shape[0], device=expert.device)
    return position - _starts(bins)[expert] + _starts(padded_bins)[expert]


def padded_gather(x: Tensor, indices: Tensor, bin_ids: Tensor, weights: Tensor | None, bins: Tensor,
                  padded_bins: Tensor, top_k: int) -> Tensor:
    total = int(padded_bins[-1]) if padded_bins.numel() else 0  # output size: a host read
    out = x.new_zeros(total, x.shape[1])
    rows = gather(x, indices, bin_ids, weights, bins, top_k)
    return out.index_copy_(0, _padded_rows(bin_ids, bins, padded_bins), rows)


def padded_scatter(x: Tensor, indices: Tensor, bin_ids: Tensor, weights: Tensor | None, bins: Tensor,
                   padded_bins: Tensor, top_k: int) -> Tensor:
    rows = x.index_select(0, _padded_rows(bin_ids, bins, padded_bins))
    return scatter(rows, indices, bin_ids, weights, bins, top_k)


def padded_scatter_wgrad(x: Tensor, grad: Tensor, indices: Tensor, bin_ids: Tensor, bins: Tensor,
                         padded_bins: Tensor, top_k: int) -> Tensor:
    rows = x.index_select(0, _padded_rows(bin_ids, bins, padded_bins))
    return scatter_wgrad(rows, grad, indices, bin_ids, bins, top_k)


def _binned_rows(indices: Tensor, bins: Tensor, bin_size: int) -> Tensor:
    """Row of each sorted row in the flattened (experts * bin_size) layout; dropped rows get
    experts * bin_size, one past the end."""
    expert = _segment_of(bins, indices.shape[0])
    slot = torch.arange(indices.shape[0], device=indices.device) - _starts(bins)[expert.clamp(max=bins.shape[0] - 1)]
    drop = bins.shape[0] * bin_size
    return torch.where(slot < bin_size, expert * bin_size + slot, drop)


def binned_gather(x: Tensor, indices: Tensor, weights: Tensor | None, bins: Tensor, bin_size: int,
                  top_k: int) -> Tensor:
    experts = bins.shape[0]
    out = x.new_zeros(experts * bin_size + 1, x.shape[1])  # the last row absorbs dropped rows
    if indices.numel():
        rows = gather(x, indices, None, weights, bins, top_k)
        out.index_copy_(0, _binned_rows(indices, bins, bin_size), rows)
    return out[:-1].view(experts, bin_size, x.shape[1])


def _binned_sorted_rows(x: Tensor, indices: Tensor, bins: Tensor) -> Tensor:
    """x's rows in sorted order, zero for rows that were dropped."""
    experts, bin_size, hidden = x.shape
    flat = torch.cat([x.reshape(experts * bin_size, hidden), x.new_zeros(1, hidden)])
    if not indices.numel():
        return x.new_zeros(0, hidden)
    return flat.index_select(0, _binned_rows(indices, bins, bin_size))


def binned_scatter(x: Tensor, indices: Tensor, weights: Tensor | None, bins: Tensor, top_k: int) -> Tensor:
    return scatter(_binned_sorted_rows(x, indices, bins), indices, indices, weights, bins, top_k)


def binned_scatter_wgrad(x: Tensor, grad: Tensor, indices: Tensor, bins: Tensor, top_k: int) -> Tensor:
    return scatter_wgrad(_binned_sorted_rows(x, indices, bins), grad, indices, indices, bins, top_k)


# --- grouped GEMM -----------------------------------------------------------------


def gmm(a: Tensor, b: Tensor, batch_sizes: Tensor, trans_b: bool) -> Tensor:
    acc = _acc(a.dtype)
    out = a.new_zeros(a.shape[0], b.shape[1] if trans_b else b.shape[2])
    start = 0
    for expert, size in enumerate(batch_sizes.tolist()):  # host copy of the group sizes
        weight = b[expert].t() if trans_b else b[expert]
        out[start:start + size] = (a[start:start + size].to(acc) @ weight.to(acc)).to(a.dtype)
        start += size
    return out


def gmm_weight_grad(a: Tensor, grad: Tensor, batch_sizes: Tensor) -> Tensor:
    acc = _acc(a.dtype)
    out = a.new_zeros(batch_sizes.shape[0], a.shape[1], grad.shape[1])
    start = 0
    for expert, size in enumerate(batch_sizes.tolist()):
        if size:  # an empty expert keeps its exact zeros
            rows = slice(start, start + size)
            out[expert] = (a[rows].to(acc).t() @ grad[rows].to(acc)).to(a.dtype)
        start += size
    return out
