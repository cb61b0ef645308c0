"""Megatron-Core / Transformer Engine permutation (``moe_permute`` and its family) in plain torch.

The row map format is the contract's (``megablocks_core.contracts.ROW_MAP_FORMAT``): int32
(tokens, slots), each slot's permuted row or -1. Every function here is sync-free (output sizes
come from shapes and ints) and masks each entry of a row map to its tensor, so data that breaks
the checked rules gives the documented safe result, never an indexing error.
"""

from __future__ import annotations

import torch
from torch import Tensor

#: Elements of a (tokens, slots, hidden) block gathered at once by unpermute: bounds the
#: transient memory of a mask-form row map with many experts.
_BLOCK_ELEMENTS = 1 << 24


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def moe_permute_map(
    routing_map: Tensor, num_experts: int, num_out_tokens: int, align_size: int
) -> tuple[Tensor, Tensor]:
    tokens, slots = routing_map.shape
    device = routing_map.device
    if routing_map.dtype == torch.bool:
        column = torch.arange(slots, device=device).expand(tokens, slots)
        keys = torch.where(routing_map, column, num_experts)
    else:
        ids = routing_map.long()
        keys = torch.where((ids >= 0) & (ids < num_experts), ids, num_experts)
    keys = keys.reshape(-1)  # row-major: token ascending, then slot
    # A stable sort by expert gives each slot its rank among its expert's slots.
    sorted_keys, order = torch.sort(keys, stable=True)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, keys, torch.ones_like(keys))  # bincount would sync on CUDA
    first = torch.cumsum(counts, 0) - counts
    rank = torch.empty_like(keys)
    rank[order] = torch.arange(keys.numel(), device=device) - first[sorted_keys]
    padded = (counts[:num_experts] + align_size - 1) // align_size * align_size
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    routed = keys < num_experts
    dest = starts[keys.clamp(max=num_experts - 1)] + rank
    kept = routed & (dest < num_out_tokens)
    row_map = torch.where(kept, dest, -1).to(torch.int32).view(tokens, slots)
    owned = ends.clamp(max=num_out_tokens) - starts.clamp(max=num_out_tokens)
    return row_map, owned.to(torch.int32)


def _sources(row_map: Tensor, rows: int) -> Tensor:
    """For each of ``rows`` permuted rows, the flat slot (t * slots + j) naming it, or -1 (the
    last such slot where several do: bad data, deterministic)."""
    dest = row_map.reshape(-1).long()
    valid = (dest >= 0) & (dest < rows)
    target = torch.where(valid, dest, rows)  # slots going nowhere land in a slot cut off
    source = torch.full((rows + 1,), -1, dtype=torch.int64, device=row_map.device)
    flat = torch.arange(dest.numel(), device=row_map.device)
    return source.scatter_reduce_(0, target, flat, reduce="amax")[:rows]


def _rows_of(x: Tensor, index: Tensor, keep: Tensor) -> Tensor:
    """x[index] where keep, zero rows elsewhere."""
    if x.shape[0] == 0:
        return x.new_zeros(index.shape[0], *x.shape[1:])
    picked = x.index_select(0, torch.where(keep, index, 0))
    return torch.where(keep.view(-1, *([1] * (x.dim() - 1))), picked, 0)


def moe_permute(x: Tensor, row_map: Tensor, probs: Tensor | None, num_out_tokens: int) -> Tensor:
    slots = row_map.shape[1]
    source = _sources(row_map, num_out_tokens)
    named = source >= 0
    out = _rows_of(x, source // max(slots, 1), named)
    if probs is None:
        return out
    scale = _per_row(probs, source).to(_acc(x.dtype))
    return (out.to(scale.dtype) * scale[:, None]).to(x.dtype)


def _per_row(probs: Tensor, source: Tensor) -> Tensor:
    """probs of the slot each permuted row comes from; 0 for rows no slot names."""
    if probs.numel() == 0:
        return probs.new_zeros(source.shape[0])
    return torch.where(source >= 0, probs.reshape(-1)[source.clamp(min=0)], 0)


def moe_permute_probs(probs: Tensor, row_map: Tensor, num_out_tokens: int) -> Tensor:
    return _per_row(probs, _sources(row_map, num_out_tokens))


def _slot_blocks(tokens: int, slots: int, hidden: int) -> range:
    block = max(1, _BLOCK_ELEMENTS // max(tokens * hidden, 1))
    return range(0, slots, block)


def _slot_rows(x: Tensor, row_map: Tensor, j0: int, j1: int) -> tuple[Tensor, Tensor]:
    """(x[row_map[:, j0:j1]] as (tokens, j1 - j0, hidden) in the accumulation dtype, zero for
    slots going nowhere; whether each slot goes somewhere)."""
    dest = row_map[:, j0:j1].long()
    valid = (dest >= 0) & (dest < x.shape[0])
    rows = _rows_of(x, dest.reshape(-1), valid.reshape(-1)).to(_acc(x.dtype))
    return rows.view(*dest.shape, x.shape[1]), valid


def moe_unpermute(x: Tensor, row_map: Tensor, probs: Tensor | None) -> Tensor:
    tokens, slots = row_map.shape
    out = torch.zeros(tokens, x.shape[1], dtype=_acc(x.dtype), device=x.device)
    blocks = _slot_blocks(tokens, slots, x.shape[1])
    for j0 in blocks:
        j1 = min(j0 + blocks.step, slots)
        rows, valid = _slot_rows(x, row_map, j0, j1)
        if probs is not None:
            rows = rows * torch.where(valid, probs[:, j0:j1].to(rows.dtype), 0)[..., None]
        for j in range(j1 - j0):  # slot order: a fixed summation order
            out += rows[:, j]
    return out.to(x.dtype)


def moe_unpermute_wgrad(x: Tensor, grad: Tensor, row_map: Tensor) -> Tensor:
    tokens, slots = row_map.shape
    out = torch.zeros(tokens, slots, dtype=_acc(x.dtype), device=x.device)
    blocks = _slot_blocks(tokens, slots, x.shape[1])
    for j0 in blocks:
        j1 = min(j0 + blocks.step, slots)
        rows, _ = _slot_rows(x, row_map, j0, j1)
        out[:, j0:j1] = (rows * grad.to(rows.dtype)[:, None, :]).sum(-1)
    return out.to(x.dtype)


def chunk_sources(split_sizes: Tensor, sorted_index: Tensor, rows: int) -> Tensor:
    """For each output row of moe_sort_chunks, its source row in x, or -1 (rows past the
    chunks). On ``split_sizes``' device; sync-free."""
    device = split_sizes.device
    chunks = split_sizes.shape[0]
    if chunks == 0 or rows == 0:
        return torch.full((rows,), -1, dtype=torch.int64, device=device)
    sizes = split_sizes.long().clamp(0, rows)  # bounded first: the sums below cannot wrap
    src_ends = torch.cumsum(sizes, 0).clamp(max=rows)  # chunks past the rows of x are cut
    src_starts = torch.cat([src_ends.new_zeros(1), src_ends[:-1]])
    sizes = src_ends - src_starts
    index = sorted_index.to(device).long()
    valid = (index >= 0) & (index < chunks)
    index = torch.where(valid, index, 0)
    out_sizes = torch.where(valid, sizes[index], 0)
    out_ends = torch.cumsum(out_sizes, 0)
    position = torch.arange(rows, device=device)
    chunk = torch.searchsorted(out_ends, position, right=True)
    inside = chunk < chunks
    chunk = chunk.clamp(max=chunks - 1)
    source = src_starts[index[chunk]] + position - (out_ends[chunk] - out_sizes[chunk])
    return torch.where(inside, source, -1)


def moe_sort_chunks(x: Tensor, split_sizes: Tensor, sorted_index: Tensor) -> Tensor:
    source = chunk_sources(split_sizes.to(x.device), sorted_index, x.shape[0])
    inside = (source >= 0) & (source < x.shape[0])
    return _rows_of(x, torch.where(inside, source, 0), inside)
