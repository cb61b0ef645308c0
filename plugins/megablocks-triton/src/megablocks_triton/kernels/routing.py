"""Triton routing kernels: the counting-sort passes, router top-k, histogram, cumsum, topology,
replicate.

Kernels only; the host side (launch shapes, per-call-shape plans, the op functions) is
:mod:`megablocks_triton.routing`. The central piece is a two-launch stable counting sort:

1. ``_tile_histogram_kernel``: one program per tile of keys writes that tile's
   bin counts to a small ``(tiles, bins)`` table (no memset needed: every entry
   is written).
2. ``_counting_scatter_kernel``: each program re-reads the whole table from L2
   (tens of KB), derives the global start of every bin plus the keys of the same
   bin in earlier tiles, then ranks its own keys stably (chunk-wise compare
   matrix + running per-bin counts) and scatters them. Program 0 also writes the
   routing metadata (counts, bins, padded bins).

With many bins (E >= 64) re-reading the whole table in every program costs more
than a third launch: ``_tile_scan_kernel`` then scans the table once (per bin,
down the tiles) and each scatter program reads only its own row, which also
allows smaller tiles (a shorter serial in-tile rank chain). With few keys (up to 256 by
default, e.g. a decode step) a single program counts them itself and ranks them: one launch,
no table. With a few thousand keys (up to 2048 by default) every tile's program counts all
keys itself (a few in-register histograms) instead of reading a table that a first launch
wrote: one launch again, the rank chain still split over the tiles.
"""

from __future__ import annotations

import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

# --------------------------------------------------------------------------- helpers


@triton.jit
def _count_le(ptr, n, target, mask, LOG: tl.constexpr):
    """For each lane: #{i < n : ptr[i] <= target}, for ptr sorted ascending.

    A branchless binary search of LOG = bit_length(n) steps; the loads hit L1,
    so it costs a few cycles per step instead of an O(n) compare.
    """
    pos = tl.zeros_like(target)
    for s in tl.static_range(LOG):
        cand = pos + (1 << (LOG - 1 - s))
        ok = mask & (cand <= n)
        v = tl.load(ptr + (cand - 1), mask=ok, other=0)
        pos = tl.where(ok & (v <= target), cand, pos)
    return pos


@triton.jit
def _digits(raw, inb, num_bins, shift, digit_mask, USE_MASK: tl.constexpr):
    """Bin of each key and whether it takes part.

    USE_MASK (radix pass): the bin is ``(key >> shift) & digit_mask``, like a
    radix sort over bits [shift, shift + bits). Otherwise (route/histogram) the
    key itself is the bin and keys outside [0, num_bins) are dropped; that test
    happens before any narrowing cast so a huge int64 cannot wrap into range.
    """
    if USE_MASK:
        digit = (raw.to(tl.int64) >> shift).to(tl.int32) & digit_mask
        valid = inb
    else:
        valid = inb & (raw >= 0) & (raw < num_bins)
        digit = tl.where(valid, raw, 0).to(tl.int32)
    return digit, valid


# --------------------------------------------------------------------------- counting sort


@triton.jit
def _tile_histogram_kernel(
    keys_ptr,
    counts_ptr,
    n,
    num_tiles,
    num_bins,
    shift,
    digit_mask,
    NB: tl.constexpr,
    TILE: tl.constexpr,
    USE_MASK: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = pid * TILE + tl.arange(0, TILE)
    inb = offs < n
    raw = tl.load(keys_ptr + offs, mask=inb, other=0)
    digit, valid = _digits(raw, inb, num_bins, shift, digit_mask, USE_MASK)
    hist = tl.histogram(digit, NB, mask=valid)
    tl.store(counts_ptr + pid * NB + tl.arange(0, NB), hist)
    if not USE_MASK:  # route: this tile's out-of-range ids, after the (tiles x bins) table
        tl.store(counts_ptr + num_tiles * NB + pid, tl.sum((inb & ~valid).to(tl.int32), axis=0))


@triton.jit
def _tile_scan_kernel(
    counts_ptr,
    before_ptr,
    total_ptr,
    num_tiles,
    NB: tl.constexpr,
    COLS: tl.constexpr,
    ROWS: tl.constexpr,
):
    """Per bin: keys of that bin in all earlier tiles (exclusive scan down the tiles) and in all."""
    cols = tl.program_id(0) * COLS + tl.arange(0, COLS)
    running = tl.zeros([COLS], dtype=tl.int32)
    for r0 in range(0, num_tiles, ROWS):
        rows = r0 + tl.arange(0, ROWS)
        at = rows[:, None] * NB + cols[None, :]
        live = (rows < num_tiles)[:, None]
        blk = tl.load(counts_ptr + at, mask=live, other=0)
        tl.store(before_ptr + at, tl.cumsum(blk, axis=0) - blk + running[None, :], mask=live)
        running += tl.sum(blk, axis=0)
    tl.store(total_ptr + cols, running)


@triton.jit
def _counting_scatter_kernel(
    keys_ptr,
    payload_ptr,
    counts_ptr,
    before_ptr,
    total_ptr,
    values_ptr,
    index_ptr,
    tpe_ptr,
    bins_ptr,
    padded_ptr,
    n,
    num_tiles,
    num_bins,
    shift,
    digit_mask,
    block_size,
    NB: tl.constexpr,
    TILE: tl.constexpr,
    CHUNK: tl.constexpr,
    TILE_ROWS: tl.constexpr,
    USE_MASK: tl.constexpr,
    HAS_PAYLOAD: tl.constexpr,
    WRITE_META: tl.constexpr,
    PRESCANNED: tl.constexpr,
    SINGLE: tl.constexpr,
    RECOUNT: tl.constexpr = False,
    COUNT_BLOCK: tl.constexpr = 1,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, NB)

    # Global count of each bin, and of each bin in tiles before this one.
    if SINGLE:  # one program, one tile holding every key: its own histogram is the global count
        every = tl.arange(0, TILE)
        every_inb = every < n
        every_key = tl.load(keys_ptr + every, mask=every_inb, other=0)
        every_bin, every_valid = _digits(
            every_key, every_inb, num_bins, shift, digit_mask, USE_MASK
        )
        total = tl.histogram(every_bin, NB, mask=every_valid)
        before = tl.zeros([NB], dtype=tl.int32)
        strays = tl.sum((every_inb & ~every_valid).to(tl.int32), axis=0)
        stray_base = tl.sum(total, axis=0)
    elif RECOUNT:  # few keys, several tiles: every program counts every key itself (no table)
        total = tl.zeros([NB], dtype=tl.int32)
        before = tl.zeros([NB], dtype=tl.int32)
        strays = tl.zeros([], dtype=tl.int32)  # route: out-of-range ids in this tile
        strays_before = tl.zeros([], dtype=tl.int32)  # ... and in earlier tiles
        first = pid * TILE
        count_lane = tl.arange(0, COUNT_BLOCK)
        for start in range(0, n, COUNT_BLOCK):
            offs = start + count_lane
            inb = offs < n
            raw = tl.load(keys_ptr + offs, mask=inb, other=0)
            digit, valid = _digits(raw, inb, num_bins, shift, digit_mask, USE_MASK)
            total += tl.histogram(digit, NB, mask=valid)
            if start < first:  # this block holds keys of earlier tiles
                before += tl.histogram(digit, NB, mask=valid & (offs < first))
            if not USE_MASK:
                stray = inb & ~valid
                strays_before += tl.sum((stray & (offs < first)).to(tl.int32), axis=0)
                mine = (offs >= first) & (offs < first + TILE)
                strays += tl.sum((stray & mine).to(tl.int32), axis=0)
        stray_base = tl.sum(total, axis=0) + strays_before
    elif PRESCANNED:  # many bins/tiles: _tile_scan_kernel did the column scans once for all
        total = tl.load(total_ptr + cols)
        before = tl.load(before_ptr + pid * NB + cols)
    else:  # few: every program scans the small (tiles x bins) table itself
        total = tl.zeros([NB], dtype=tl.int32)
        before = tl.zeros([NB], dtype=tl.int32)
        for r0 in range(0, num_tiles, TILE_ROWS):
            rows = r0 + tl.arange(0, TILE_ROWS)
            blk = tl.load(
                counts_ptr + rows[:, None] * NB + cols[None, :],
                mask=(rows < num_tiles)[:, None],
                other=0,
            )
            total += tl.sum(blk, axis=0)
            before += tl.sum(tl.where((rows < pid)[:, None], blk, 0), axis=0)
    ends = tl.cumsum(total, axis=0)
    base = ends - total + before  # where this tile's first key of each bin goes

    if WRITE_META and pid == 0:
        real = cols < num_bins
        padded = (total + block_size - 1) // block_size * block_size
        tl.store(tpe_ptr + cols, total, mask=real)
        tl.store(bins_ptr + cols, ends, mask=real)
        tl.store(padded_ptr + cols, tl.cumsum(padded, axis=0), mask=real)

    # Stable rank inside the tile, CHUNK keys at a time: rank among equal keys
    # of the chunk (compare matrix) + running per-bin count (base).
    lane = tl.arange(0, CHUNK)
    for c in range(0, TILE, CHUNK):
        offs = pid * TILE + c + lane
        inb = offs < n
        raw = tl.load(keys_ptr + offs, mask=inb, other=0)
        digit, valid = _digits(raw, inb, num_bins, shift, digit_mask, USE_MASK)
        same = (digit[:, None] == digit[None, :]) & (lane[None, :] < lane[:, None]) & valid[None, :]
        rank = tl.sum(same.to(tl.int32), axis=1)
        pos = tl.gather(base, digit, 0) + rank
        tl.store(values_ptr + pos, raw, mask=valid)
        payload = tl.load(payload_ptr + offs, mask=inb, other=0) if HAS_PAYLOAD else offs
        tl.store(index_ptr + pos, payload.to(index_ptr.dtype.element_ty), mask=valid)
        base += tl.histogram(digit, NB, mask=valid)

    # A radix pass places every key; route places its out-of-range ids too (bad data), after
    # every valid id and in input order, in a second pass over the tile that runs only where the
    # histogram kernel (or, SINGLE and RECOUNT, this program's own count) found some: valid ids
    # pay one scalar load.
    if not USE_MASK:
        if not (SINGLE or RECOUNT):
            strays = tl.load(counts_ptr + num_tiles * NB + pid)
        if strays > 0:
            # Where this tile's first stray goes: every valid id, then earlier tiles' strays
            # (SINGLE and RECOUNT counted them above).
            if not (SINGLE or RECOUNT):
                stray_base = tl.zeros([], dtype=tl.int32)
                for r0 in range(0, num_tiles, TILE_ROWS):
                    rows = r0 + tl.arange(0, TILE_ROWS)
                    live = rows < num_tiles
                    blk = tl.load(
                        counts_ptr + rows[:, None] * NB + cols[None, :],
                        mask=live[:, None],
                        other=0,
                    )
                    earlier = tl.load(
                        counts_ptr + num_tiles * NB + rows, mask=live & (rows < pid), other=0
                    )
                    stray_base += tl.sum(tl.sum(blk, axis=1), axis=0) + tl.sum(earlier, axis=0)
            for c in range(0, TILE, CHUNK):
                offs = pid * TILE + c + lane
                inb = offs < n
                raw = tl.load(keys_ptr + offs, mask=inb, other=0)
                _, valid = _digits(raw, inb, num_bins, shift, digit_mask, USE_MASK)
                stray = inb & ~valid
                stray_pos = stray_base + tl.cumsum(stray.to(tl.int32), axis=0) - 1
                payload = tl.load(payload_ptr + offs, mask=inb, other=0) if HAS_PAYLOAD else offs
                tl.store(values_ptr + stray_pos, raw, mask=stray)
                tl.store(index_ptr + stray_pos, payload.to(index_ptr.dtype.element_ty), mask=stray)
                stray_base += tl.sum(stray.to(tl.int32), axis=0)


# --------------------------------------------------------------------------- router top-k


@triton.jit
def _router_topk_kernel(
    scores_ptr,
    weights_ptr,
    experts_ptr,
    tokens,
    num_experts,
    stride_t,
    stride_e,
    top_k,
    ROWS: tl.constexpr,
    BLOCK_E: tl.constexpr,
    SOFTMAX: tl.constexpr,
):
    # ROWS whole rows per program, in registers; top_k rounds of (max, lowest id holding it).
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < tokens
    ok = row_ok[:, None] & (cols < num_experts)[None, :]
    ptrs = scores_ptr + rows[:, None].to(tl.int64) * stride_t + cols[None, :] * stride_e
    raw = tl.load(ptrs, mask=ok, other=0.0).to(tl.float32)
    # Order-preserving int32 keys: flip the magnitude bits of negative floats; -0.0 is 0.0, every
    # NaN ranks above +inf, lanes past the experts rank below -inf (never picked: top_k <= E).
    v = tl.where(raw == 0.0, 0.0, raw)
    bits = v.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    key = tl.where(v != v, 0x7FFFFFFF, key)
    lowest = tl.full([ROWS, BLOCK_E], -2147483648, tl.int32)
    key = tl.where(ok, key, lowest)
    if SOFTMAX:  # a NaN anywhere, or a row of -inf only, makes the row's probabilities NaN
        x = tl.where(ok, raw, float("-inf"))
        e = tl.where(ok, tl.exp(x - tl.max(x, axis=1)[:, None]), 0.0)
        raw = e / tl.sum(e, axis=1)[:, None]
    out = rows.to(tl.int64) * top_k
    for j in range(0, top_k):
        best = tl.max(key, axis=1)
        pick = tl.min(tl.where(key == best[:, None], cols[None, :], BLOCK_E), axis=1)
        hit = cols[None, :] == pick[:, None]
        weight = tl.sum(tl.where(hit, raw, 0.0), axis=1)
        tl.store(weights_ptr + out + j, weight.to(weights_ptr.dtype.element_ty), mask=row_ok)
        tl.store(experts_ptr + out + j, pick, mask=row_ok)
        key = tl.where(hit, lowest, key)


# --------------------------------------------------------------------------- histogram


@triton.jit
def _histogram_kernel(
    x_ptr,
    out_ptr,
    n,
    num_bins,
    NB: tl.constexpr,
    BLOCK: tl.constexpr,
    PER_KEY: tl.constexpr,
    WHOLE_ROW: tl.constexpr,
):
    pid = tl.program_id(0)
    row = tl.program_id(1)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    inb = offs < n
    raw = tl.load(x_ptr + row.to(tl.int64) * n + offs, mask=inb, other=0)
    digit, valid = _digits(raw, inb, num_bins, 0, 0, False)
    out_row = out_ptr + row.to(tl.int64) * num_bins
    if PER_KEY:
        tl.atomic_add(out_row + digit, tl.full([BLOCK], 1, tl.int32), mask=valid)
    else:
        # One in-register histogram per block, then one atomic per bin.
        hist = tl.histogram(digit, NB, mask=valid)
        cols = tl.arange(0, NB)
        if WHOLE_ROW:  # this program counts the whole row: it writes every bin (out not zeroed)
            tl.store(out_row + cols, hist, mask=cols < num_bins)
        else:
            tl.atomic_add(out_row + cols, hist, mask=(cols < num_bins) & (hist != 0))


# --------------------------------------------------------------------------- cumsum


@triton.jit
def _cumsum_kernel(
    x_ptr,
    out_ptr,
    length,
    line_stride,
    elem_stride,
    BLOCK: tl.constexpr,
    EXCLUSIVE: tl.constexpr,
    WIDE: tl.constexpr,
):
    line = tl.program_id(0)
    acc_ty = tl.int64 if WIDE else tl.int32
    carry = tl.zeros([1], dtype=acc_ty)
    for start in range(0, length, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        m = offs < length
        ptr_off = line.to(tl.int64) * line_stride + offs.to(tl.int64) * elem_stride
        v = tl.load(x_ptr + ptr_off, mask=m, other=0).to(acc_ty)
        inc = tl.cumsum(v, axis=0) + carry
        res = inc - v if EXCLUSIVE else inc
        # Narrow dtypes wrap like the same-dtype sum would (two's complement).
        tl.store(out_ptr + ptr_off, res.to(out_ptr.dtype.element_ty), mask=m)
        carry += tl.sum(v, axis=0)


# --------------------------------------------------------------------------- topology


@triton.jit
def _topology_kernel(
    padded_ptr,
    out_ptr,
    num_bins,
    block_size,
    rows,
    cols,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    LOG: tl.constexpr,
):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r < rows
    # Expert of block-row r = #{e : padded_bins[e] // bs <= r}; for the
    # non-negative padded_bins that is padded_bins[e] <= (r + 1) * bs - 1.
    e = _count_le(padded_ptr, num_bins, (r + 1) * block_size - 1, rmask, LOG)
    for c0 in range(0, cols, BLOCK_C):
        j = c0 + tl.arange(0, BLOCK_C)
        val = e[:, None] * cols + j[None, :]
        tl.store(
            out_ptr + r[:, None].to(tl.int64) * cols + j[None, :],
            val.to(tl.int16),
            mask=rmask[:, None] & (j < cols)[None, :],
        )


# --------------------------------------------------------------------------- replicate


@triton.jit
def _replicate_kernel(
    x_ptr,
    bins_ptr,
    out_ptr,
    num_bins,
    num_outputs,
    BLOCK: tl.constexpr,
    LOG: tl.constexpr,
):
    b = tl.program_id(1).to(tl.int64)
    j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = j < num_outputs
    e = _count_le(bins_ptr, num_bins, j, m, LOG)  # bins[e-1] <= j < bins[e]
    keep = m & (e < num_bins)
    v = tl.load(x_ptr + b * num_bins + e, mask=keep, other=0)
    tl.store(out_ptr + b * num_outputs + j, v, mask=m)


@triton.jit
def _replicate_backward_kernel(
    grad_ptr,
    bins_ptr,
    out_ptr,
    num_bins,
    num_cols,
    BLOCK: tl.constexpr,
):
    e = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    end = tl.minimum(tl.load(bins_ptr + e).to(tl.int32), num_cols)
    start = tl.load(bins_ptr + e - 1, mask=e > 0, other=0).to(tl.int32)
    start = tl.minimum(tl.maximum(start, 0), end)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j0 in range(start, end, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        acc += tl.load(grad_ptr + b * num_cols + j, mask=j < end, other=0).to(tl.float32)
    tl.store(out_ptr + b * num_bins + e, tl.sum(acc, axis=0).to(out_ptr.dtype.element_ty))
