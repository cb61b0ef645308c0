"""Every op in plain, vectorised PyTorch: the oracle the other backends are checked against.

Inputs arrive validated (the core checks them against the contracts), so these
functions only compute. Outside checked mode the data rules are not checked, so
data that breaks them (indices that are not a permutation, bins that are not a
cumulative sum, expert ids out of range) reaches these functions: they mask every
index to its tensor and return the documented safe result of each op (the
contracts' edge cases), never torch's IndexError or unwritten memory. They run on any torch device and read nothing back to
the host except where an output's size depends on data (padded_gather) or the
per-expert loop of the grouped GEMM needs the group sizes.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from megablocks_core.plugin import (
    ContractError,
    activation_backward_definition,
    call_op,
    glu_backward_definition,
    glu_definition,
)

# Megatron-Core / Transformer Engine permutation: its own module, served from here by name.
from .moe_permute import (  # noqa: F401
    moe_permute,
    moe_permute_map,
    moe_permute_probs,
    moe_sort_chunks,
    moe_unpermute,
    moe_unpermute_wgrad,
)


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


def topology(
    padded_bins: Tensor, block_size: int, output_block_rows: int, output_block_columns: int
) -> Tensor:
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


def route(
    top_experts: Tensor, num_experts: int, block_size: int
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    # Composed from the *dispatched* primitives, so on a device whose backend provides sort,
    # histogram and cumsum (but no fused route) those kernels do the work.
    from megablocks_core import ops

    # Ids outside [0, num_experts) sort after every valid one, in input order (as if they were
    # expert num_experts): indices stays a permutation and bins counts only valid ids.
    # Compared as int64: num_experts may not fit the ids' dtype (torch would wrap the bound).
    wide = top_experts.long()
    valid = (wide >= 0) & (wide < num_experts)
    key_dtype = (
        top_experts.dtype if num_experts <= torch.iinfo(top_experts.dtype).max else torch.int32
    )
    keys = torch.where(valid, wide, num_experts).to(key_dtype)
    _, order = ops.sort(keys, max(num_experts.bit_length(), 1))
    indices = order.to(top_experts.dtype)
    bin_ids = top_experts.index_select(0, order.long())
    counts = ops.histogram(top_experts, num_experts)
    padded = ops.inclusive_cumsum(ops.round_up(counts, block_size), 0)
    return indices, bin_ids, counts, ops.inclusive_cumsum(counts, 0), padded


def router_topk(scores: Tensor, top_k: int, softmax: bool) -> tuple[Tensor, Tensor]:
    # Two stable descending sorts give the contract's order on every device: by value with NaN
    # and -0.0 as 0.0, then NaN first; equal keys keep the lower id first. (torch.sort alone did
    # not put a bf16 NaN first on CUDA; where NaN and -0.0 go is left to the ranks here.)
    nan = torch.isnan(scores)
    values = torch.where(nan | (scores == 0), 0, scores)
    by_value = torch.sort(values, dim=1, descending=True, stable=True).indices
    nan_first = torch.sort(nan.gather(1, by_value).byte(), dim=1, descending=True, stable=True)
    order = by_value.gather(1, nan_first.indices[:, :top_k])
    if softmax:
        scores = scores.to(_acc(scores.dtype)).softmax(dim=1).to(scores.dtype)
    return scores.gather(1, order), order.to(torch.int32)


# --- permutation -------------------------------------------------------------------


def _named(indices: Tensor) -> tuple[Tensor, Tensor]:
    """(flat ids clamped into range, whether each was in [0, rows) to begin with)."""
    flat = indices.long()
    valid = (flat >= 0) & (flat < flat.shape[0])
    return torch.where(valid, flat, 0), valid


def _inverse(indices: Tensor) -> Tensor:
    """position[f] = i where indices[i] = f: the sorted row of each flat (token, k) id.

    -1 for an id no row names; the last such row for an id several rows name (deterministic)."""
    flat, valid = _named(indices)
    n = flat.shape[0]
    order = torch.arange(n, device=flat.device)
    target = torch.where(valid, flat, n)  # out-of-range ids land in a slot that is cut off
    inv = torch.full((n + 1,), -1, dtype=torch.int64, device=flat.device)
    return inv.scatter_reduce_(0, target, order, reduce="amax")[:n]


def _select_rows(x: Tensor, rows: Tensor, keep: Tensor) -> Tensor:
    """x[rows] where keep, zero rows elsewhere (rows need only be valid where keep)."""
    picked = (
        x.index_select(0, torch.where(keep, rows, 0))
        if x.shape[0]
        else x.new_zeros(rows.shape[0], *x.shape[1:])
    )
    return torch.where(keep.view(-1, *([1] * (x.dim() - 1))), picked, 0)


def gather(
    x: Tensor,
    indices: Tensor,
    bin_ids: Tensor,
    weights: Tensor | None,
    bins: Tensor,
    top_k: int,
    rows: int | None = None,
) -> Tensor:
    return _gather_rows(x, indices, weights, top_k, rows)


def _gather_rows(
    x: Tensor, indices: Tensor, weights: Tensor | None, top_k: int, rows: int | None = None
) -> Tensor:
    """gather's rows (the first ``rows``; all when None): only the indices, weights and top_k
    decide them (not bin_ids or bins)."""
    flat, valid = _named(indices)
    if rows is not None:  # ids range over all sorted rows still
        flat, valid = flat[:rows], valid[:rows]
    picked = _select_rows(x, flat // top_k, valid)  # an id out of range gives a zero row
    if weights is None:
        return picked
    scale = torch.where(valid, weights.index_select(0, flat), 0).to(_acc(x.dtype))
    return (picked.to(scale.dtype) * scale[:, None]).to(x.dtype)


def _token_major(x: Tensor, indices: Tensor) -> Tensor:
    """Row f = the sorted row naming flat id f (zero if none), in the accumulation dtype."""
    inv = _inverse(indices)
    return _select_rows(x, inv, inv >= 0).to(_acc(x.dtype))


def scatter(
    x: Tensor, indices: Tensor, bin_ids: Tensor, weights: Tensor | None, bins: Tensor, top_k: int
) -> Tensor:
    rows, hidden = x.shape
    # Token-major order: row f is the (token, k) pair f = token * top_k + k.
    by_token = _token_major(x, indices)
    if weights is not None:
        by_token = by_token * weights.to(by_token.dtype)[:, None]
    return by_token.view(rows // top_k, top_k, hidden).sum(1).to(x.dtype)


def scatter_wgrad(
    x: Tensor, grad: Tensor, indices: Tensor, bin_ids: Tensor, bins: Tensor, top_k: int
) -> Tensor:
    by_token = _token_major(x, indices)
    tokens = torch.arange(by_token.shape[0], device=x.device) // top_k
    return (by_token * grad.index_select(0, tokens).to(by_token.dtype)).sum(1).to(x.dtype)


def _padded_rows(
    bins: Tensor, padded_bins: Tensor, count: int, total: int
) -> tuple[Tensor, Tensor]:
    """Row in the padded layout of each sorted row, and whether it lies inside the layout.

    The expert of a sorted row comes from bins (bin_ids must agree with bins)."""
    expert = _segment_of(bins, count)
    in_bins = expert < bins.shape[0]
    expert = torch.where(in_bins, expert, 0)
    slot = torch.arange(count, device=bins.device) - _starts(bins)[expert]
    rows = _starts(padded_bins)[expert] + slot
    return rows, in_bins & (slot >= 0) & (rows >= 0) & (rows < total)


def _padded_total(padded_bins: Tensor) -> int:
    total = int(padded_bins[-1]) if padded_bins.numel() else 0  # output size: a host read
    if total < 0:
        raise ContractError(
            f"megablocks_core.ops.padded_gather: argument 'padded_bins' ends at {total}, "
            "but its last entry is the output's row count (expected >= 0)"
        )
    return total


def padded_gather(
    x: Tensor,
    indices: Tensor,
    bin_ids: Tensor,
    weights: Tensor | None,
    bins: Tensor,
    padded_bins: Tensor,
    top_k: int,
) -> Tensor:
    total = _padded_total(padded_bins)
    out = x.new_zeros(total, x.shape[1])
    rows = gather(x, indices, bin_ids, weights, bins, top_k)
    dest, keep = _padded_rows(bins, padded_bins, indices.shape[0], total)
    return out.index_copy_(0, dest[keep], rows[keep])


def padded_scatter(
    x: Tensor,
    indices: Tensor,
    bin_ids: Tensor,
    weights: Tensor | None,
    bins: Tensor,
    padded_bins: Tensor,
    top_k: int,
) -> Tensor:
    rows = _select_rows(x, *_padded_rows(bins, padded_bins, indices.shape[0], x.shape[0]))
    return scatter(rows, indices, bin_ids, weights, bins, top_k)


def padded_scatter_wgrad(
    x: Tensor,
    grad: Tensor,
    indices: Tensor,
    bin_ids: Tensor,
    bins: Tensor,
    padded_bins: Tensor,
    top_k: int,
) -> Tensor:
    rows = _select_rows(x, *_padded_rows(bins, padded_bins, indices.shape[0], x.shape[0]))
    return scatter_wgrad(rows, grad, indices, bin_ids, bins, top_k)


def _binned_rows(indices: Tensor, bins: Tensor, bin_size: int) -> Tensor:
    """Row of each sorted row in the flattened (experts * bin_size) layout; dropped rows (past
    their bin's capacity, or placed by bins outside every bin) get experts * bin_size, one past
    the end."""
    experts = bins.shape[0]
    expert = _segment_of(bins, indices.shape[0])
    in_bins = expert < experts
    slot = (
        torch.arange(indices.shape[0], device=indices.device)
        - _starts(bins)[expert.clamp(max=max(experts - 1, 0))]
    )
    keep = in_bins & (slot >= 0) & (slot < bin_size)
    return torch.where(keep, expert * bin_size + slot, experts * bin_size)


def binned_gather(
    x: Tensor, indices: Tensor, weights: Tensor | None, bins: Tensor, bin_size: int, top_k: int
) -> Tensor:
    experts = bins.shape[0]
    out = x.new_zeros(experts * bin_size + 1, x.shape[1])  # the last row absorbs dropped rows
    if indices.numel():
        rows = _gather_rows(x, indices, weights, top_k)
        out.index_copy_(0, _binned_rows(indices, bins, bin_size), rows)
    return out[:-1].view(experts, bin_size, x.shape[1])


def _binned_sorted_rows(x: Tensor, indices: Tensor, bins: Tensor) -> Tensor:
    """x's rows in sorted order, zero for rows that were dropped."""
    experts, bin_size, hidden = x.shape
    flat = torch.cat([x.reshape(experts * bin_size, hidden), x.new_zeros(1, hidden)])
    if not indices.numel():
        return x.new_zeros(0, hidden)
    return flat.index_select(0, _binned_rows(indices, bins, bin_size))


def binned_scatter(
    x: Tensor, indices: Tensor, weights: Tensor | None, bins: Tensor, top_k: int
) -> Tensor:
    return scatter(_binned_sorted_rows(x, indices, bins), indices, indices, weights, bins, top_k)


def binned_scatter_wgrad(
    x: Tensor, grad: Tensor, indices: Tensor, bins: Tensor, top_k: int
) -> Tensor:
    return scatter_wgrad(_binned_sorted_rows(x, indices, bins), grad, indices, indices, bins, top_k)


# --- grouped GEMM -----------------------------------------------------------------


def _groups(batch_sizes: Tensor, rows: int) -> list[tuple[int, int]]:
    """(first row, rows) of each group. Device-side sizes are not checked outside checked mode:
    a negative size counts as 0 and groups are cut at the last row of a (the rest is empty)."""
    groups, start = [], 0
    for size in batch_sizes.tolist():  # host copy of the group sizes
        size = min(max(int(size), 0), rows - start)
        groups.append((start, size))
        start += size
    return groups


def gmm(a: Tensor, b: Tensor, batch_sizes: Tensor, trans_b: bool) -> Tensor:
    acc = _acc(a.dtype)
    out = a.new_zeros(a.shape[0], b.shape[1] if trans_b else b.shape[2])  # rows no group covers: 0
    for expert, (start, size) in enumerate(_groups(batch_sizes, a.shape[0])):
        weight = b[expert].t() if trans_b else b[expert]
        out[start : start + size] = (a[start : start + size].to(acc) @ weight.to(acc)).to(a.dtype)
    return out


def gmm_weight_grad(a: Tensor, grad: Tensor, batch_sizes: Tensor) -> Tensor:
    acc = _acc(a.dtype)
    out = a.new_zeros(batch_sizes.shape[0], a.shape[1], grad.shape[1])
    for expert, (start, size) in enumerate(_groups(batch_sizes, a.shape[0])):
        if size:  # an empty expert keeps its exact zeros
            rows = slice(start, start + size)
            out[expert] = (a[rows].to(acc).t() @ grad[rows].to(acc)).to(a.dtype)
    return out


def gmm_weight_grad_accumulate(a: Tensor, grad: Tensor, batch_sizes: Tensor, out: Tensor) -> None:
    # The defining composition, through the *dispatched* gmm_weight_grad (a backend that provides
    # it but no fused kernel serves this op with its own GEMM). Taken at out's precision where out
    # is wider (16-bit a with a float32 main_grad): the gradient is not rounded to 16 bits first.
    if out.dtype.itemsize > a.dtype.itemsize:
        a, grad = a.to(out.dtype), grad.to(out.dtype)
    out.add_(call_op("gmm_weight_grad", a, grad, batch_sizes))


# --- fused permutation + grouped GEMM: their defining compositions ------------------


def _sizes_from_bins(bins: Tensor, rows: int) -> Tensor:
    """Group sizes from cumulative bins, safe for any bins, as the fused kernels read them: a
    negative group counts as 0 and groups are cut at row ``rows``. No host sync."""
    sizes = torch.diff(bins.long(), prepend=bins.new_zeros(1, dtype=torch.int64)).clamp_(min=0)
    return torch.diff(sizes.cumsum(0).clamp_(max=rows), prepend=sizes.new_zeros(1))


def _gmm_by_bins(a: Tensor, b: Tensor, bins: Tensor, trans_b: bool) -> Tensor:
    """ops.gmm with expert e's rows at bins[e-1]:bins[e] (:func:`_sizes_from_bins`). Rows past
    the last group (sorted rows routed to no expert) are 0: gmm's contract gives them so."""
    from megablocks_core import ops

    return ops.gmm(a, b, _sizes_from_bins(bins, a.shape[0]), trans_b)


def gather_gmm(
    x: Tensor,
    b: Tensor,
    indices: Tensor,
    bin_ids: Tensor,
    bins: Tensor,
    top_k: int,
    trans_b: bool,
    rows: int | None = None,
) -> Tensor:
    # Composed from the *dispatched* gather and gmm (as route is), so a backend that provides
    # those but no fused kernel serves it with its own kernels.
    from megablocks_core import ops

    return _gmm_by_bins(ops.gather(x, indices, bin_ids, bins, top_k, rows), b, bins, trans_b)


def gmm_scatter(
    x: Tensor,
    b: Tensor,
    indices: Tensor,
    bin_ids: Tensor,
    weights: Tensor | None,
    bins: Tensor,
    top_k: int,
    trans_b: bool,
) -> Tensor:
    from megablocks_core import ops

    return ops.scatter(_gmm_by_bins(x, b, bins, trans_b), indices, bin_ids, weights, bins, top_k)


def glu(
    x: Tensor, activation: str | None, alpha: float | None = None, limit: float | None = None
) -> Tensor:
    return glu_definition(x, activation, alpha, limit)


def glu_backward(
    grad: Tensor,
    x: Tensor,
    activation: str | None,
    alpha: float | None = None,
    limit: float | None = None,
) -> Tensor:
    return glu_backward_definition(grad, x, activation, alpha, limit)


def activation_backward(
    grad: Tensor,
    x: Tensor,
    scale: Tensor | None,
    activation: str | None,
    alpha: float | None = None,
    limit: float | None = None,
) -> tuple[Tensor, Tensor]:
    return activation_backward_definition(grad, x, scale, activation, alpha, limit)
