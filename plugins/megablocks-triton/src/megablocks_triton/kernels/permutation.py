"""Token-major Triton permutation kernels (gather/scatter, their padded/binned forms, the weight
gradient), and their device helpers.

Kernels only; the host side (launch shapes, per-call-shape plans, the contract functions) is
:mod:`megablocks_triton.permutation`, whose docstring describes the layouts and the bad-data rules.
"""

from __future__ import annotations

import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

from .gmm import _group_sizes


@triton.jit
def _inverse_kernel(indices_ptr, inv_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    f = tl.load(indices_ptr + i, mask=m, other=0)
    # Range test before the narrowing cast, so a huge int64 id cannot wrap into [0, n).
    ok = m & (f >= 0) & (f < n)
    tl.store(inv_ptr + tl.where(ok, f, 0).to(tl.int32), i, mask=ok)


@triton.jit
def _reached(indices_ptr, inv_ptr, f, n, mask):
    """Sorted row p = inv[f] of flat id f, and whether some row names f (then p is one of them).

    inv[f] was written iff some row names f, and then indices[inv[f]] == f; an unwritten slot
    holds garbage that is range-checked before it is used as an address."""
    p = tl.load(inv_ptr + f, mask=mask, other=0)
    ok = mask & (p >= 0) & (p < n)
    p = tl.where(ok, p, 0)
    back = tl.load(indices_ptr + p, mask=ok, other=-1)
    return p, ok & (back == f)


@triton.jit
def _bin_of(bins_ptr, num_bins, p, mask, LOG: tl.constexpr):
    """#{e : bins[e] <= p}: the expert whose [bins[e-1], bins[e]) holds sorted row p.

    Only reads bins[0:num_bins], whatever bins holds; for bins that are not a cumulative sum
    the result is some e in [0, num_bins] with bins[e-1] <= p."""
    pos = tl.zeros_like(p)
    for s in tl.static_range(LOG):
        cand = pos + (1 << (LOG - 1 - s))
        ok = mask & (cand <= num_bins)
        v = tl.load(bins_ptr + (cand - 1), mask=ok, other=0)
        pos = tl.where(ok & (v <= p), cand, pos)
    return pos


@triton.jit
def _hint_wrong(p, e, bins_ptr, num_bins, mask):
    """Whether bins contradict e as the expert of sorted row p (bins[e-1] <= p < bins[e])."""
    e = tl.minimum(tl.maximum(e, 0), num_bins)
    lo = tl.load(bins_ptr + e - 1, mask=mask & (e > 0), other=0)
    hi = tl.load(bins_ptr + e, mask=mask & (e < num_bins), other=0)
    return mask & ((e >= num_bins) | (lo > p) | (hi <= p))


@triton.jit
def _placement(
    p,
    keep,
    hint_ptr,
    bins_ptr,
    padded_ptr,
    num_bins,
    bin_size,
    num_rows,
    MODE: tl.constexpr,
    LOG: tl.constexpr,
    SEARCH: tl.constexpr,
):
    """Row (int64) of the output layout that sorted row p maps to, and whether it has one
    inside the layout (never an address outside it, whatever bins/padded_bins hold). In the
    plain layout the rows are the first num_rows sorted rows (fewer than n with a row count)."""
    if MODE == 0:
        dest = p.to(tl.int64)
        keep = keep & (dest < num_rows)
    else:
        # The expert comes from bins. In the padded layout the token programs take it from
        # bin_ids[p] (hint_ptr) and keep a copy only where bins confirm it: no search and no
        # branch on the hot path. Rows that this drops are placed by binary search in bins
        # (SEARCH) by the gather's fix-up; in a scatter such a copy contributes 0.
        if MODE == 1 and not SEARCH:
            e = tl.load(hint_ptr + p, mask=keep, other=0).to(tl.int32)
            keep = keep & ~_hint_wrong(p, e, bins_ptr, num_bins, keep)
        else:
            e = _bin_of(bins_ptr, num_bins, p, keep, LOG)
        has_prev = keep & (e > 0)
        start = tl.load(bins_ptr + e - 1, mask=has_prev, other=0).to(tl.int64)
        j = p.to(tl.int64) - start
        keep = keep & (e < num_bins) & (j >= 0)
        if MODE == 1:
            dest = tl.load(padded_ptr + e - 1, mask=has_prev, other=0).to(tl.int64) + j
            keep = keep & (dest >= 0) & (dest < num_rows)
        else:
            keep = keep & (j < bin_size)
            dest = e.to(tl.int64) * bin_size + j
    return dest, keep


@triton.jit
def _destinations(
    t,
    k,
    indices_ptr,
    inv_ptr,
    hint_ptr,
    bins_ptr,
    padded_ptr,
    n,
    num_bins,
    bin_size,
    num_rows,
    TOP_K: tl.constexpr,
    MODE: tl.constexpr,
    LOG: tl.constexpr,
    SEARCH: tl.constexpr,
):
    """Flat ids, destination rows (int64) and keep-mask of token t's copies k (a vector of
    copies, or one copy when k is a scalar). A copy no row names is not kept."""
    f = t * TOP_K + k
    p, reached = _reached(indices_ptr, inv_ptr, f, n, k < TOP_K)
    dest, keep = _placement(
        p, reached, hint_ptr, bins_ptr, padded_ptr, num_bins, bin_size, num_rows, MODE, LOG, SEARCH
    )
    return f, dest, keep


@triton.jit
def _rows_naming(indices_ptr, first, n, copies, SEARCH: tl.constexpr):
    """For each flat id ``first + copies[k]``: the last sorted row p < n with indices[p] equal to
    it, or -1 where no row names it. Scans all n ids (SEARCH per step): for few rows only."""
    found = tl.full(copies.shape, -1, tl.int32)
    for s0 in range(0, n, SEARCH):
        q = s0 + tl.arange(0, SEARCH)
        ids = tl.load(indices_ptr + q, mask=q < n, other=-1)  # -1 names no copy
        hit = (ids - first)[None, :] == copies[:, None]
        found = tl.maximum(found, tl.max(tl.where(hit, q[None, :], -1), axis=1))
    return found


@triton.jit
def _gather_rows_kernel(
    x_ptr,
    indices_ptr,
    weights_ptr,
    out_ptr,
    n,
    hidden,
    TOP_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
    SPLIT_H: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
):
    """Plain gather by output row (few rows): sorted row p = x[indices[p] // TOP_K], weighted by
    weights[indices[p]]; 0 for an id outside [0, n). No inverse permutation needed; each row of x
    is read top_k times (from L2 while x is small)."""
    p = tl.program_id(0)
    g = tl.load(indices_ptr + p)
    named = (g >= 0) & (g < n)
    g = tl.where(named, g, 0)
    src = x_ptr + (g // TOP_K).to(tl.int64) * hidden
    dst = out_ptr + p.to(tl.int64) * hidden
    if HAS_WEIGHTS:
        w = tl.load(weights_ptr + g, mask=named, other=0).to(tl.float32)
    for h0 in range(tl.program_id(1) * BLOCK_H, hidden, BLOCK_H * SPLIT_H):
        h = h0 + tl.arange(0, BLOCK_H)
        hm = h < hidden
        row = tl.load(src + h, mask=hm & named, other=0)
        if HAS_WEIGHTS:
            row = (row.to(tl.float32) * w).to(out_ptr.dtype.element_ty)
        tl.store(dst + h, row, mask=hm)


@triton.jit
def _is_cumulative(ptr, count, BLOCK: tl.constexpr):
    """ptr[0:count] is nondecreasing and starts at >= 0 (a cumulative sum of counts)."""
    bad = tl.zeros([BLOCK], dtype=tl.int32)
    for c0 in range(0, count, BLOCK):
        i = c0 + tl.arange(0, BLOCK)
        m = i < count
        cur = tl.load(ptr + i, mask=m, other=0)
        prev = tl.load(ptr + i - 1, mask=m & (i > 0), other=0)
        bad += (m & (cur < prev)).to(tl.int32)
    return tl.sum(bad, axis=0) == 0


@triton.jit
def _zero_padding(
    pid,
    out_ptr,
    bins_ptr,
    padded_ptr,
    hidden,
    bin_size,
    num_tokens,
    n,
    num_bins,
    num_rows,
    BLOCK_H: tl.constexpr,
    ZERO_ROWS: tl.constexpr,
    MODE: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """Programs past the tokens: zero expert e's padding rows (ZERO_ROWS programs per expert).

    With cumulative bins (and padded_bins), the token programs and their fix-ups write exactly
    rows [first row of e, + rows of e) and these programs the rest of e's rows. With any other
    bins nothing says which rows the tokens reach, so e's whole segment is zeroed (tokens may
    overwrite it): every output row is still written, and none outside the output."""
    q = pid - num_tokens
    e = q // ZERO_ROWS
    lane = q % ZERO_ROWS
    sane = _is_cumulative(bins_ptr, num_bins, BLOCK_E)
    if MODE == 1:
        sane = sane & _is_cumulative(padded_ptr, num_bins, BLOCK_E)
    start = tl.load(bins_ptr + e - 1, mask=e > 0, other=0).to(tl.int64)
    end = tl.load(bins_ptr + e).to(tl.int64)
    # Rows of e that exist (sorted rows past n do not); none when bins are not cumulative.
    count = tl.where(sane, tl.maximum(tl.minimum(end, n) - start, 0), 0)
    if MODE == 1:
        first = tl.load(padded_ptr + e - 1, mask=e > 0, other=0).to(tl.int64)
        row_lo = tl.minimum(tl.maximum(first + count, 0), num_rows)
        row_hi = tl.minimum(tl.maximum(tl.load(padded_ptr + e).to(tl.int64), 0), num_rows)
    else:
        row_lo = e.to(tl.int64) * bin_size + tl.minimum(count, bin_size)
        row_hi = (e + 1).to(tl.int64) * bin_size
    zeros = tl.zeros([BLOCK_H], dtype=out_ptr.dtype.element_ty)
    # int64 rows: row * hidden may pass 2**31 on large padded outputs.
    for r in range(row_lo + lane, row_hi, ZERO_ROWS):
        for h0 in range(0, hidden, BLOCK_H):
            h = h0 + tl.arange(0, BLOCK_H)
            tl.store(out_ptr + r * hidden + h, zeros, mask=h < hidden)


@triton.jit
def _fix_unreached(
    pid,
    x_ptr,
    indices_ptr,
    inv_ptr,
    hint_ptr,
    weights_ptr,
    bins_ptr,
    padded_ptr,
    out_ptr,
    hidden,
    n,
    num_bins,
    bin_size,
    num_rows,
    TOP_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
    SPLIT_H: tl.constexpr,
    MODE: tl.constexpr,
    LOG: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
):
    """Write the sorted rows pid*TOP_K + k that no token program writes.

    Sorted row q is written by a token program iff inv[indices[q]] == q (and, in the padded
    layout, bins confirm bin_ids[q]). Otherwise (indices is not a permutation: q's id is out
    of range, or another row names the same id; or bin_ids disagrees with bins) this program
    writes q's row: x[indices[q] // TOP_K] (weighted) for an id in range, else zeros.
    On a permutation this is one int compare per row and no data traffic."""
    for k in tl.static_range(TOP_K):
        q = pid * TOP_K + k
        g = tl.load(indices_ptr + q)
        named = (g >= 0) & (g < n)
        g = tl.where(named, g, 0).to(tl.int32)
        owner = tl.load(inv_ptr + g, mask=named, other=-1)
        unplaced = owner != q
        if MODE == 1:  # the token program also dropped q if bins contradict bin_ids[q]
            hint = tl.load(hint_ptr + q).to(tl.int32)
            unplaced = unplaced | _hint_wrong(q, hint, bins_ptr, num_bins, q >= 0)
        if unplaced:
            dest, keep = _placement(
                q,
                q >= 0,
                hint_ptr,
                bins_ptr,
                padded_ptr,
                num_bins,
                bin_size,
                num_rows,
                MODE,
                LOG,
                True,
            )
            if keep:
                src = x_ptr + (g // TOP_K).to(tl.int64) * hidden
                if HAS_WEIGHTS:
                    w = tl.load(weights_ptr + g, mask=named, other=0).to(tl.float32)
                for h0 in range(tl.program_id(1) * BLOCK_H, hidden, BLOCK_H * SPLIT_H):
                    h = h0 + tl.arange(0, BLOCK_H)
                    hm = h < hidden
                    row = tl.load(src + h, mask=hm & named, other=0)
                    if HAS_WEIGHTS:
                        row = (row.to(tl.float32) * w).to(out_ptr.dtype.element_ty)
                    tl.store(out_ptr + dest * hidden + h, row, mask=hm)


@triton.jit
def _gather_kernel(
    x_ptr,
    indices_ptr,
    inv_ptr,
    hint_ptr,
    weights_ptr,
    bins_ptr,
    padded_ptr,
    out_ptr,
    num_tokens,
    hidden,
    n,
    num_bins,
    bin_size,
    num_rows,
    TOP_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
    SPLIT_H: tl.constexpr,
    ZERO_ROWS: tl.constexpr,
    MODE: tl.constexpr,
    LOG: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    pid = tl.program_id(0)
    if pid >= num_tokens:
        if tl.program_id(1) == 0:
            _zero_padding(
                pid,
                out_ptr,
                bins_ptr,
                padded_ptr,
                hidden,
                bin_size,
                num_tokens,
                n,
                num_bins,
                num_rows,
                BLOCK_H,
                ZERO_ROWS,
                MODE,
                BLOCK_E,
            )
    else:
        x_row = x_ptr + pid.to(tl.int64) * hidden
        # BLOCK_H usually covers the whole row, so each copy's destination is computed once.
        for h0 in range(tl.program_id(1) * BLOCK_H, hidden, BLOCK_H * SPLIT_H):
            h = h0 + tl.arange(0, BLOCK_H)
            hm = h < hidden
            v = tl.load(x_row + h, mask=hm, other=0)  # read once, written top_k times
            for k in tl.static_range(TOP_K):
                f, dest, keep = _destinations(
                    pid,
                    tl.full([], k, tl.int32),
                    indices_ptr,
                    inv_ptr,
                    hint_ptr,
                    bins_ptr,
                    padded_ptr,
                    n,
                    num_bins,
                    bin_size,
                    num_rows,
                    TOP_K,
                    MODE,
                    LOG,
                    False,
                )
                if HAS_WEIGHTS:
                    w = tl.load(weights_ptr + f).to(tl.float32)
                    row = (v.to(tl.float32) * w).to(out_ptr.dtype.element_ty)
                else:
                    row = v
                tl.store(out_ptr + dest * hidden + h, row, mask=keep & hm)
        _fix_unreached(
            pid,
            x_ptr,
            indices_ptr,
            inv_ptr,
            hint_ptr,
            weights_ptr,
            bins_ptr,
            padded_ptr,
            out_ptr,
            hidden,
            n,
            num_bins,
            bin_size,
            num_rows,
            TOP_K,
            BLOCK_H,
            SPLIT_H,
            MODE,
            LOG,
            HAS_WEIGHTS,
        )


@triton.jit
def _scatter_kernel(
    x_ptr,
    indices_ptr,
    inv_ptr,
    hint_ptr,
    weights_ptr,
    bins_ptr,
    padded_ptr,
    out_ptr,
    hidden,
    n,
    num_bins,
    bin_size,
    num_rows,
    TOP_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
    SPLIT_H: tl.constexpr,
    MODE: tl.constexpr,
    LOG: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    SEARCH: tl.constexpr,
    K_PAD: tl.constexpr,
    GROUPED_ROWS: tl.constexpr = False,
    BLOCK_E: tl.constexpr = 1,
):
    # GROUPED_ROWS (gmm_scatter's reduction of its own GEMM's rows, plain layout): only the rows
    # bins' groups cover hold products (the GEMM, reading bins the same way, leaves the rest
    # unwritten); a copy in a row past them contributes 0 and is never read.
    pid = tl.program_id(0)
    out_row = out_ptr + pid.to(tl.int64) * hidden
    if GROUPED_ROWS:
        _, covered = _group_sizes(bins_ptr, num_bins, n, BLOCK_E, True)
    if SEARCH > 0:  # few rows (plain layout): no inverse permutation, scan indices instead
        copies = tl.arange(0, K_PAD)
        found = _rows_naming(indices_ptr, pid * TOP_K, n, copies, SEARCH)
    for h0 in range(tl.program_id(1) * BLOCK_H, hidden, BLOCK_H * SPLIT_H):
        h = h0 + tl.arange(0, BLOCK_H)
        hm = h < hidden
        # The top-k sum is elementwise in registers (one copy at a time), never a
        # cross-thread reduction over a (k, H) tile.
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for k in tl.static_range(TOP_K):
            if SEARCH > 0:
                p = tl.max(tl.where(copies == k, found, -1), axis=0)
                keep = (p >= 0) & (p < num_rows)
                if GROUPED_ROWS:
                    keep = keep & (p < covered)
                f = pid * TOP_K + k
                src = tl.where(keep, p, 0).to(tl.int64)
            else:
                f, src, keep = _destinations(
                    pid,
                    tl.full([], k, tl.int32),
                    indices_ptr,
                    inv_ptr,
                    hint_ptr,
                    bins_ptr,
                    padded_ptr,
                    n,
                    num_bins,
                    bin_size,
                    num_rows,
                    TOP_K,
                    MODE,
                    LOG,
                    False,
                )
                if GROUPED_ROWS:
                    keep = keep & (src < covered)
            row = tl.load(x_ptr + src * hidden + h, mask=keep & hm, other=0).to(tl.float32)
            if HAS_WEIGHTS:
                row = row * tl.load(weights_ptr + f).to(tl.float32)
            acc += row
        tl.store(out_row + h, acc.to(out_ptr.dtype.element_ty), mask=hm)


@triton.jit
def _wgrad_kernel(
    x_ptr,
    grad_ptr,
    indices_ptr,
    inv_ptr,
    hint_ptr,
    bins_ptr,
    padded_ptr,
    out_ptr,
    hidden,
    n,
    num_bins,
    bin_size,
    num_rows,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    MODE: tl.constexpr,
    LOG: tl.constexpr,
):
    pid = tl.program_id(0)
    f, src, keep = _destinations(
        pid,
        tl.arange(0, K_PAD),
        indices_ptr,
        inv_ptr,
        hint_ptr,
        bins_ptr,
        padded_ptr,
        n,
        num_bins,
        bin_size,
        num_rows,
        TOP_K,
        MODE,
        LOG,
        False,
    )
    g_row = grad_ptr + pid.to(tl.int64) * hidden
    acc = tl.zeros([K_PAD, BLOCK_H], dtype=tl.float32)
    for h0 in range(0, hidden, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        hm = h < hidden
        g = tl.load(g_row + h, mask=hm, other=0).to(tl.float32)  # read once for all k
        rows = tl.load(
            x_ptr + src[:, None] * hidden + h[None, :], mask=keep[:, None] & hm[None, :], other=0
        )
        acc += rows.to(tl.float32) * g[None, :]
    dot = tl.sum(acc, axis=1)  # dropped copies stay exactly 0
    tl.store(out_ptr + f, dot.to(out_ptr.dtype.element_ty), mask=f < (pid + 1) * TOP_K)
