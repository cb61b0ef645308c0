"""Triton kernels for the Megatron-Core / Transformer Engine permutation ops (``moe_permute``).

The row map is the contract's format (``megablocks_core.contracts.ROW_MAP_FORMAT``): int32
(tokens, slots), each slot's permuted row or -1. So a row map written here is read by any
backend's ``moe_unpermute``, and ours reads theirs.

* ``moe_permute_map``: one program per expert scans the routing map in token order, twice: a
  count (then the padded starts, a few per-expert torch ops on the device), then the ranks
  (a running offset plus an in-block cumsum) written as rows. In the mask form a program owns
  its expert's column and writes all of it; in the index form program 0 also writes -1 for
  ids outside [0, experts), so every slot is written without a memset.
* ``moe_permute``: one program per token (and hidden block) reads its row once and writes it
  to each of its slots' rows; the output starts zeroed because the rows no slot names
  (padding, rows past the real count) are known only through the row map.
* ``moe_unpermute``: one program per token (and hidden block) sums its slots' rows in float32
  and writes its row once; ``moe_unpermute_wgrad`` dots them with the token's gradient.
* ``moe_sort_chunks``: each output row's source row (a few sync-free torch ops over the chunk
  sizes), then a row copy.

Past ``COMPACT_ABOVE_SLOTS`` slots (the mask form: one slot per expert, only top_k used), a
pre-pass (``_compact_slots_kernel``) first lists each token's valid slots in order, so that the
per-token kernels loop over those few instead of loading every slot one by one; the sums keep
their slot order.

No kernel reads a size on the host. Every row map entry is range-checked before it is used
as an address (bad data writes and reads nothing), and offsets are int64 (no size limit of
their own; moe_permute_map's routing map is held below 2**31 entries by its contract).
"""

from __future__ import annotations

import torch
import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

from .config import launch_configs
from .launch import cdiv, launch, next_power_of_2

__all__ = [
    "moe_permute",
    "moe_permute_map",
    "moe_permute_probs",
    "moe_sort_chunks",
    "moe_unpermute",
    "moe_unpermute_wgrad",
]

#: Routing-map entries one expert's program reads per step.
SCAN_BLOCK = 256
#: Widest hidden block one program handles (wider rows take several programs).
MAX_HIDDEN_BLOCK = 1024
#: Row maps with more slots than this go through the compaction pre-pass first.
COMPACT_ABOVE_SLOTS = 16
#: Widest slot chunk the pre-pass reads per step, and its tile (tokens x slots) size.
COMPACT_BLOCK_S = 128
COMPACT_TILE = 2048


def _options() -> dict[str, object]:
    return dict(launch_configs().launch_options("permutation"))


def _hidden_block(hidden: int) -> int:
    return min(next_power_of_2(max(hidden, 1)), MAX_HIDDEN_BLOCK)


@triton.jit
def _slot_hits(routing_ptr, t, e, tokens, slots, num_experts, IS_MASK: tl.constexpr):
    """For the tokens t of one block: whether each routes to expert e, and its flat slot.

    Mask form: slot (t, e) of column e. Index form: the token's slots t * slots + j, flattened
    into the block (t then holds flat slot numbers)."""
    if IS_MASK:
        valid = t < tokens
        flat = t.to(tl.int64) * slots + e
        hit = tl.load(routing_ptr + flat, mask=valid, other=0) != 0
    else:
        valid = t < tokens * slots
        flat = t.to(tl.int64)
        ids = tl.load(routing_ptr + flat, mask=valid, other=-1)
        hit = ids == e
    return hit & valid, flat, valid


@triton.jit
def _slot_row(row_map_ptr, cols_ptr, t, i, slots, rows, COMPACT: tl.constexpr):
    """Token t's i-th slot to visit (its i-th listed valid slot when compacted), that slot's row
    in the row map (int64), and whether the row lies in [0, rows)."""
    j = tl.load(cols_ptr + t * slots + i) if COMPACT else i
    row = tl.load(row_map_ptr + t * slots + j).to(tl.int64)
    return j, row, (row >= 0) & (row < rows)


@triton.jit
def _count_kernel(
    routing_ptr,
    counts_ptr,
    tokens,
    slots,
    num_experts,
    IS_MASK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    e = tl.program_id(0)
    n = tokens if IS_MASK else tokens * slots
    total = tl.zeros((), dtype=tl.int32)
    for start in range(0, n, BLOCK):
        t = start + tl.arange(0, BLOCK)
        hit, _, _ = _slot_hits(routing_ptr, t, e, tokens, slots, num_experts, IS_MASK)
        total += tl.sum(hit.to(tl.int32), axis=0)
    tl.store(counts_ptr + e, total)


@triton.jit
def _rows_kernel(
    routing_ptr,
    starts_ptr,
    row_map_ptr,
    tokens,
    slots,
    num_experts,
    num_out,
    IS_MASK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    e = tl.program_id(0)
    start_row = tl.load(starts_ptr + e)
    n = tokens if IS_MASK else tokens * slots
    seen = tl.zeros((), dtype=tl.int64)
    for start in range(0, n, BLOCK):
        t = start + tl.arange(0, BLOCK)
        hit, flat, valid = _slot_hits(routing_ptr, t, e, tokens, slots, num_experts, IS_MASK)
        hits = hit.to(tl.int32)
        rank = seen + tl.cumsum(hits, axis=0) - 1
        row = start_row + rank
        kept = hit & (row < num_out)
        dest = tl.where(kept, row, -1).to(tl.int32)
        if IS_MASK:
            tl.store(row_map_ptr + flat, dest, mask=valid)  # the whole column is this program's
        else:
            tl.store(row_map_ptr + flat, dest, mask=hit)
            if e == 0:  # ids that name no expert: written once, by program 0
                ids = tl.load(routing_ptr + flat, mask=valid, other=0)
                nowhere = valid & ((ids < 0) | (ids >= num_experts))
                tl.store(row_map_ptr + flat, tl.full(flat.shape, -1, tl.int32), mask=nowhere)
        seen += tl.sum(hits, axis=0)


def moe_permute_map(
    routing_map: torch.Tensor, num_experts: int, num_out_tokens: int, align_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, slots = routing_map.shape
    device = routing_map.device
    row_map = torch.empty(tokens, slots, dtype=torch.int32, device=device)
    counts = torch.empty(num_experts, dtype=torch.int32, device=device)
    is_mask = routing_map.dtype == torch.bool
    # Bools are read as bytes (Triton has no pointer to bool in every version).
    routing = routing_map.view(torch.uint8) if is_mask else routing_map
    scalars = (tokens, slots, num_experts)
    kw = {"IS_MASK": is_mask, "BLOCK": SCAN_BLOCK, **_options()}
    launch(_count_kernel, (num_experts,), routing, counts, *scalars, **kw)
    # Padded ends and starts: a few per-expert ops on the device (int64: no wrap).
    padded = (counts.long() + align_size - 1) // align_size * align_size
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    launch(_rows_kernel, (num_experts,), routing, starts, row_map, *scalars, num_out_tokens, **kw)
    owned = ends.clamp(max=num_out_tokens) - starts.clamp(max=num_out_tokens)
    return row_map, owned.to(torch.int32)


@triton.jit
def _compact_slots_kernel(
    row_map_ptr,
    cols_ptr,
    count_ptr,
    tokens,
    slots,
    rows,
    BLOCK_T: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """For each token of the block: the slots j whose entry is a row in [0, rows), ascending,
    in cols[t, :count[t]] (the rest of cols is not written), and their number in count[t]."""
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    in_t = t < tokens
    seen = tl.zeros((BLOCK_T,), dtype=tl.int32)
    for s0 in range(0, slots, BLOCK_S):
        j = s0 + tl.arange(0, BLOCK_S)
        inside = in_t[:, None] & (j < slots)[None, :]
        base = t[:, None] * slots
        entry = tl.load(row_map_ptr + base + j[None, :], mask=inside, other=-1).to(tl.int64)
        hit = inside & (entry >= 0) & (entry < rows)
        hits = hit.to(tl.int32)
        pos = seen[:, None] + tl.cumsum(hits, axis=1) - 1
        cols = tl.broadcast_to(j[None, :], (BLOCK_T, BLOCK_S)).to(tl.int32)
        tl.store(cols_ptr + base + tl.where(hit, pos, 0), cols, mask=hit)
        seen += tl.sum(hits, axis=1)
    tl.store(count_ptr + t, seen, mask=in_t)


def _compact_slots(row_map: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """The pre-pass's (cols, count) where the row map has many slots, else two unread
    placeholders; and whether it ran (the kernels' COMPACT)."""
    tokens, slots = row_map.shape
    if slots <= COMPACT_ABOVE_SLOTS:
        return row_map, row_map, False
    cols = torch.empty(tokens, slots, dtype=torch.int32, device=row_map.device)
    count = torch.empty(tokens, dtype=torch.int32, device=row_map.device)
    block_s = min(next_power_of_2(slots), COMPACT_BLOCK_S)
    block_t = max(COMPACT_TILE // block_s, 1)
    launch(
        _compact_slots_kernel,
        (cdiv(tokens, block_t),),
        row_map,
        cols,
        count,
        tokens,
        slots,
        rows,
        BLOCK_T=block_t,
        BLOCK_S=block_s,
        **_options(),
    )
    return cols, count, True


@triton.jit
def _permute_kernel(
    x_ptr,
    row_map_ptr,
    probs_ptr,
    out_ptr,
    cols_ptr,
    count_ptr,
    slots,
    hidden,
    num_out,
    HAS_PROBS: tl.constexpr,
    COMPACT: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    in_row = h < hidden
    row = tl.load(x_ptr + t * hidden + h, mask=in_row, other=0.0)
    n = tl.load(count_ptr + t) if COMPACT else slots
    for i in range(n):
        j, dest, ok = _slot_row(row_map_ptr, cols_ptr, t, i, slots, num_out, COMPACT)
        if ok:
            value = row
            if HAS_PROBS:
                scale = tl.load(probs_ptr + t * slots + j).to(tl.float32)
                value = (row.to(tl.float32) * scale).to(row.dtype)
            tl.store(out_ptr + dest * hidden + h, value, mask=in_row)


def moe_permute(
    x: torch.Tensor, row_map: torch.Tensor, probs: torch.Tensor | None, num_out_tokens: int
) -> torch.Tensor:
    tokens, hidden = x.shape
    out = torch.zeros(num_out_tokens, hidden, dtype=x.dtype, device=x.device)
    if tokens == 0 or hidden == 0 or num_out_tokens == 0:
        return out
    block = _hidden_block(hidden)
    cols, count, compact = _compact_slots(row_map, num_out_tokens)
    launch(
        _permute_kernel,
        (tokens, cdiv(hidden, block)),
        x,
        row_map,
        row_map if probs is None else probs,  # an unread placeholder without probs
        out,
        cols,
        count,
        row_map.shape[1],
        hidden,
        num_out_tokens,
        HAS_PROBS=probs is not None,
        COMPACT=compact,
        BLOCK_H=block,
        **_options(),
    )
    return out


@triton.jit
def _permute_probs_kernel(probs_ptr, row_map_ptr, out_ptr, n, num_out, BLOCK: tl.constexpr):
    f = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = f < n
    dest = tl.load(row_map_ptr + f, mask=inside, other=-1).to(tl.int64)
    ok = inside & (dest >= 0) & (dest < num_out)
    value = tl.load(probs_ptr + f, mask=ok, other=0.0)
    tl.store(out_ptr + tl.where(ok, dest, 0), value, mask=ok)


def moe_permute_probs(
    probs: torch.Tensor, row_map: torch.Tensor, num_out_tokens: int
) -> torch.Tensor:
    out = torch.zeros(num_out_tokens, dtype=probs.dtype, device=probs.device)
    n = probs.numel()
    if n == 0 or num_out_tokens == 0:
        return out
    block = launch_configs().elementwise_block(n)
    launch(
        _permute_probs_kernel,
        (cdiv(n, block),),
        probs,
        row_map,
        out,
        n,
        num_out_tokens,
        BLOCK=block,
        **_options(),
    )
    return out


@triton.jit
def _unpermute_kernel(
    x_ptr,
    row_map_ptr,
    probs_ptr,
    out_ptr,
    cols_ptr,
    count_ptr,
    slots,
    hidden,
    rows,
    HAS_PROBS: tl.constexpr,
    COMPACT: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    in_row = h < hidden
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    n = tl.load(count_ptr + t) if COMPACT else slots
    for i in range(n):
        j, src, ok = _slot_row(row_map_ptr, cols_ptr, t, i, slots, rows, COMPACT)
        value = tl.load(x_ptr + tl.where(ok, src, 0) * hidden + h, mask=in_row & ok, other=0.0)
        value = value.to(tl.float32)
        if HAS_PROBS:
            value = value * tl.load(probs_ptr + t * slots + j, mask=ok, other=0.0).to(tl.float32)
        acc += value
    tl.store(out_ptr + t * hidden + h, acc.to(out_ptr.dtype.element_ty), mask=in_row)


def moe_unpermute(
    x: torch.Tensor, row_map: torch.Tensor, probs: torch.Tensor | None
) -> torch.Tensor:
    tokens, slots = row_map.shape
    hidden = x.shape[1]
    out = torch.empty(tokens, hidden, dtype=x.dtype, device=x.device)
    if tokens == 0 or hidden == 0:
        return out
    block = _hidden_block(hidden)
    cols, count, compact = _compact_slots(row_map, x.shape[0])
    launch(
        _unpermute_kernel,
        (tokens, cdiv(hidden, block)),
        x,
        row_map,
        row_map if probs is None else probs,  # an unread placeholder without probs
        out,
        cols,
        count,
        slots,
        hidden,
        x.shape[0],
        HAS_PROBS=probs is not None,
        COMPACT=compact,
        BLOCK_H=block,
        **_options(),
    )
    return out


@triton.jit
def _unpermute_wgrad_kernel(
    x_ptr,
    grad_ptr,
    row_map_ptr,
    out_ptr,
    cols_ptr,
    count_ptr,
    slots,
    hidden,
    rows,
    COMPACT: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Compact: only the listed slots are written (out starts zeroed); else every slot."""
    t = tl.program_id(0).to(tl.int64)
    n = tl.load(count_ptr + t) if COMPACT else slots
    for i in range(n):
        j, src, ok = _slot_row(row_map_ptr, cols_ptr, t, i, slots, rows, COMPACT)
        acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
        for h0 in range(0, hidden, BLOCK_H):
            h = h0 + tl.arange(0, BLOCK_H)
            in_row = h < hidden
            a = tl.load(x_ptr + tl.where(ok, src, 0) * hidden + h, mask=in_row & ok, other=0.0)
            g = tl.load(grad_ptr + t * hidden + h, mask=in_row & ok, other=0.0)
            acc += a.to(tl.float32) * g.to(tl.float32)
        tl.store(out_ptr + t * slots + j, tl.sum(acc, axis=0).to(out_ptr.dtype.element_ty))


def moe_unpermute_wgrad(x: torch.Tensor, grad: torch.Tensor, row_map: torch.Tensor) -> torch.Tensor:
    tokens, slots = row_map.shape
    if tokens * slots == 0:
        return torch.empty(tokens, slots, dtype=x.dtype, device=x.device)
    hidden = x.shape[1]
    cols, count, compact = _compact_slots(row_map, x.shape[0])
    # The compact path writes only the valid slots: the others are 0 from the start.
    out = (torch.zeros if compact else torch.empty)(tokens, slots, dtype=x.dtype, device=x.device)
    launch(
        _unpermute_wgrad_kernel,
        (tokens,),
        x,
        grad,
        row_map,
        out,
        cols,
        count,
        slots,
        hidden,
        x.shape[0],
        COMPACT=compact,
        BLOCK_H=_hidden_block(hidden),
        **_options(),
    )
    return out


def _chunk_sources(
    split_sizes: torch.Tensor, sorted_index: torch.Tensor, rows: int
) -> torch.Tensor:
    """Each output row's source row in x (-1 past the chunks), on the sizes' device, sync-free."""
    device = split_sizes.device
    chunks = split_sizes.shape[0]
    if chunks == 0:
        return torch.full((rows,), -1, dtype=torch.int64, device=device)
    # Sizes bounded first, so that their sums cannot wrap; chunks past the rows are cut.
    src_ends = torch.cumsum(split_sizes.long().clamp(0, rows), 0).clamp(max=rows)
    src_starts = torch.cat([src_ends.new_zeros(1), src_ends[:-1]])
    index = sorted_index.to(device).long()
    valid = (index >= 0) & (index < chunks)
    index = torch.where(valid, index, 0)
    out_sizes = torch.where(valid, (src_ends - src_starts)[index], 0)
    out_ends = torch.cumsum(out_sizes, 0)
    position = torch.arange(rows, device=device)
    chunk = torch.searchsorted(out_ends, position, right=True)
    inside = chunk < chunks
    chunk = chunk.clamp(max=chunks - 1)
    source = src_starts[index[chunk]] + position - (out_ends[chunk] - out_sizes[chunk])
    return torch.where(inside, source, -1)


@triton.jit
def _copy_rows_kernel(x_ptr, source_ptr, out_ptr, hidden, rows, BLOCK_H: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    in_row = h < hidden
    src = tl.load(source_ptr + i)
    ok = (src >= 0) & (src < rows)
    value = tl.load(x_ptr + tl.where(ok, src, 0) * hidden + h, mask=in_row & ok, other=0.0)
    tl.store(out_ptr + i * hidden + h, value, mask=in_row)


def moe_sort_chunks(
    x: torch.Tensor, split_sizes: torch.Tensor, sorted_index: torch.Tensor
) -> torch.Tensor:
    rows, hidden = x.shape
    out = torch.empty_like(x)
    if out.numel() == 0:
        return out
    source = _chunk_sources(split_sizes.to(x.device), sorted_index, rows)
    block = _hidden_block(hidden)
    launch(
        _copy_rows_kernel,
        (rows, cdiv(hidden, block)),
        x,
        source,
        out,
        hidden,
        rows,
        BLOCK_H=block,
        **_options(),
    )
    return out
