"""Token-major Triton permutation kernels (gather/scatter and their padded/binned forms).

Every data kernel runs one program per token (optionally a few per token when
there are few tokens, splitting the hidden dim) and handles all of that
token's top_k copies at once as a (k, BLOCK_H) tile:

* gather reads the token's row once and writes its top_k destinations;
* scatter reads the top_k rows, weights them, sums in fp32 and writes once;
* *_wgrad reads the token's grad row once and dots it with its top_k rows.

So each moves only the ideal bytes (T*H + T*K*H elements), with no (T, K, H)
intermediate. The token-major order needs, for each flat id f = t*K + k, its
row in sorted order: the inverse permutation of ``indices``, built by one tiny
scatter launch (``_inverse_kernel``), never a host sync. Only padded_gather
reads one value on the host (``padded_bins[-1]``, the output size).

Few rows (the launch policy decides: ``LaunchConfigs.gather_by_rows`` and
``scatter_search``), the plain gather and scatter skip that launch, whose host
cost then exceeds the work: gather runs one program per output row that copies
its token's row (``_gather_rows_kernel``: x is read top_k times, from L2), and
scatter's token programs find their rows by scanning ``indices`` (``_rows_naming``).
Their launches are prepared once per call shape (``megablocks_triton.launch.bind``).

Destinations by layout (``MODE``):
  0 plain:  row p = inv[f]
  1 padded: row p - bins_start(e) + padded_start(e), e = bin_ids[p] where bins confirm it
            (bins[e-1] <= p < bins[e]); other rows are placed by the gather's fix-up (binary
            search in bins) and contribute 0 to a scatter
  2 binned: row e * bin_size + (p - bins_start(e)), e found by binary search in
            bins; dropped when p - bins_start(e) >= bin_size.
The padded/binned gathers also zero their padding rows in the same launch
(extra programs after the token programs), so the output is never memset.

Bad data (inputs that pass the always-on checks but break the data rules) never
makes a kernel address memory outside its tensors, and every output element is
written: ``inv`` is trusted only where it points back at a row naming that flat
id (an int compare), destinations are masked to the layout, and each token
program also writes the sorted rows no token reaches (``_fix_unreached``); the
row-by-row gather masks each row's source to x and writes every row, and the scan
reads only ``indices``. The results are documented per op in the contracts' edge
cases and are the same on every path.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

from megablocks_core.plugin import ContractError

from .config import LaunchConfigs, launch_configs
from .gmm import _group_sizes
from .launch import bind, cdiv, launch, next_power_of_2, remember

__all__ = [
    "binned_gather",
    "binned_scatter",
    "binned_scatter_wgrad",
    "gather",
    "padded_gather",
    "padded_scatter",
    "padded_scatter_wgrad",
    "scatter",
    "scatter_wgrad",
]

PLAIN, PADDED, BINNED = 0, 1, 2


@triton.jit
def _inverse_kernel(indices_ptr, inv_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    f = tl.load(indices_ptr + i, mask=m, other=0)
    # Range test before the narrowing cast, so a huge int64 id cannot wrap into [0, n).
    ok = m & (f >= 0) & (f < n)
    tl.store(inv_ptr + tl.where(ok, f, 0).to(tl.int32), i, mask=ok)


def _inverse_launch(
    configs: LaunchConfigs, n: int
) -> tuple[tuple[int], tuple[int], dict[str, Any]]:
    """Grid, scalars and keywords of the ``_inverse_kernel`` launch over ``n`` ids."""
    block = configs.elementwise_block(n)
    return (cdiv(n, block),), (n,), {"BLOCK": block, **_options(configs)}


def _inverse(indices: torch.Tensor) -> torch.Tensor:
    """inv[indices[i]] = i (int32): the sorted row of each flat id.

    Not initialised: a flat id that no row names keeps whatever the allocator gave, and one that
    several rows name keeps one of them. Readers trust inv[f] only after checking that it points
    back at a row naming f (:func:`_reached`), which costs one int load and no memset.
    """
    n = indices.numel()
    inv = torch.empty(n, dtype=torch.int32, device=indices.device)
    grid, scalars, kw = _inverse_launch(launch_configs(), n)
    launch(_inverse_kernel, grid, indices, inv, *scalars, **kw)
    return inv


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


# --------------------------------------------------------------------------- launchers


def _options(configs: LaunchConfigs | None = None) -> Mapping[str, Any]:
    """Backend-specific launch keywords (empty unless a vendor policy such as megablocks-rocm's
    is in use; see config.LaunchConfigs.launch_options)."""
    return (configs or launch_configs()).launch_options("permutation")


def _meta(top_k: int, num_bins: int) -> dict[str, int]:
    return {"TOP_K": top_k, "LOG": max(num_bins.bit_length(), 1)}


def _rows(x: torch.Tensor, mode: int) -> int:
    """Rows of the plain or padded layout (the bound every destination is checked against)."""
    return x.shape[0] if mode in (PLAIN, PADDED) else 0


Launch = tuple[tuple[int, ...], tuple[int, ...], dict[str, Any]]


def _gather_launch(
    configs: LaunchConfigs,
    on_cpu: bool,
    element_size: int,
    num_tokens: int,
    hidden: int,
    n: int,
    num_bins: int,
    top_k: int,
    mode: int,
    bin_size: int,
    num_rows: int,
    has_weights: bool,
) -> Launch:
    """Grid, scalars and keywords of a ``_gather_kernel`` launch (its tensors come first)."""
    cfg = configs.permutation(num_tokens, hidden, top_k, element_size)
    pad_programs = 0 if mode == PLAIN else num_bins
    # The CPU runs programs one by one (TRITON_INTERPRET=1): two padding programs per expert
    # still exercise the lane split, at an eighth of the cost.
    zero_rows = min(cfg.zero_rows, 2) if on_cpu else cfg.zero_rows
    grid = (num_tokens + pad_programs * zero_rows, cfg.split_h)
    scalars = (num_tokens, hidden, n, num_bins, bin_size, num_rows)
    kw = {
        "BLOCK_H": cfg.block_h,
        "SPLIT_H": cfg.split_h,
        "ZERO_ROWS": zero_rows,
        "MODE": mode,
        "HAS_WEIGHTS": has_weights,
        "num_warps": cfg.num_warps,
        "BLOCK_E": min(next_power_of_2(max(num_bins, 1)), 256),
        **_meta(top_k, num_bins),
        **_options(configs),
    }
    return grid, scalars, kw


def _scatter_launch(
    configs: LaunchConfigs,
    element_size: int,
    num_tokens: int,
    hidden: int,
    n: int,
    num_bins: int,
    top_k: int,
    mode: int,
    bin_size: int,
    num_rows: int,
    has_weights: bool,
    search: int = 0,
    grouped_rows: bool = False,
) -> Launch:
    """Grid, scalars and keywords of a ``_scatter_kernel`` launch (its tensors come first);
    ``search`` > 0: the token programs scan ``indices`` for their rows (no ``inv``);
    ``grouped_rows``: rows past those bins' groups cover are never read (count as 0)."""
    cfg = configs.permutation(num_tokens, hidden, top_k, element_size)
    grouped = {"GROUPED_ROWS": True, "BLOCK_E": next_power_of_2(num_bins)} if grouped_rows else {}
    kw = {
        "BLOCK_H": cfg.block_h,
        "SPLIT_H": cfg.split_h,
        "MODE": mode,
        "HAS_WEIGHTS": has_weights,
        "SEARCH": search,
        "K_PAD": next_power_of_2(top_k),
        "num_warps": cfg.num_warps,
        **_meta(top_k, num_bins),
        **grouped,
        **_options(configs),
    }
    return (num_tokens, cfg.split_h), (hidden, n, num_bins, bin_size, num_rows), kw


def _wgrad_launch(
    configs: LaunchConfigs,
    element_size: int,
    num_tokens: int,
    hidden: int,
    n: int,
    num_bins: int,
    top_k: int,
    mode: int,
    bin_size: int,
    num_rows: int,
) -> Launch:
    """Grid, scalars and keywords of a ``_wgrad_kernel`` launch (its tensors come first)."""
    cfg = configs.wgrad(num_tokens, hidden, top_k, element_size)
    kw = {
        "BLOCK_H": cfg.block_h,
        "MODE": mode,
        "num_warps": cfg.num_warps,
        "K_PAD": next_power_of_2(top_k),
        **_meta(top_k, num_bins),
        **_options(configs),
    }
    return (num_tokens,), (hidden, n, num_bins, bin_size, num_rows), kw


def _launch_gather(
    x: torch.Tensor,
    indices: torch.Tensor,
    weights: torch.Tensor | None,
    bins: torch.Tensor,
    padded_bins: torch.Tensor | None,
    top_k: int,
    out: torch.Tensor,
    mode: int,
    bin_size: int,
    inv: torch.Tensor | None = None,
    bin_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    top_k, bin_size = int(top_k), int(bin_size)  # numpy ints are not kernel scalars
    num_tokens, hidden = x.shape
    num_bins = bins.numel()
    pad_programs = 0 if mode == PLAIN else num_bins
    if out.numel() == 0 or (num_tokens == 0 and pad_programs == 0):
        return out
    if inv is None:
        inv = _inverse(indices) if num_tokens else indices
    grid, scalars, kw = _gather_launch(
        launch_configs(),
        x.device.type == "cpu",
        x.element_size(),
        num_tokens,
        hidden,
        indices.numel(),
        num_bins,
        top_k,
        mode,
        bin_size,
        _rows(out, mode),
        weights is not None,
    )
    launch(
        _gather_kernel,
        grid,
        x,
        indices,
        inv,
        bin_ids if bin_ids is not None else bins,
        weights if weights is not None else x,
        bins,
        padded_bins if padded_bins is not None else bins,
        out,
        *scalars,
        **kw,
    )
    return out


def _launch_scatter(
    x: torch.Tensor,
    indices: torch.Tensor,
    weights: torch.Tensor | None,
    bins: torch.Tensor,
    padded_bins: torch.Tensor | None,
    top_k: int,
    mode: int,
    bin_size: int,
    bin_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    top_k, bin_size = int(top_k), int(bin_size)
    num_tokens = indices.numel() // top_k
    hidden = x.shape[-1]
    out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    grid, scalars, kw = _scatter_launch(
        launch_configs(),
        x.element_size(),
        num_tokens,
        hidden,
        indices.numel(),
        bins.numel(),
        top_k,
        mode,
        bin_size,
        _rows(x, mode),
        weights is not None,
    )
    launch(
        _scatter_kernel,
        grid,
        x,
        indices,
        _inverse(indices),
        bin_ids if bin_ids is not None else bins,
        weights if weights is not None else x,
        bins,
        padded_bins if padded_bins is not None else bins,
        out,
        *scalars,
        **kw,
    )
    return out


def _launch_wgrad(
    x: torch.Tensor,
    grad: torch.Tensor,
    indices: torch.Tensor,
    bins: torch.Tensor,
    padded_bins: torch.Tensor | None,
    top_k: int,
    mode: int,
    bin_size: int,
    bin_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    top_k, bin_size = int(top_k), int(bin_size)
    n = indices.numel()
    out = torch.empty(n, dtype=x.dtype, device=x.device)
    hidden = x.shape[-1]
    if n == 0:
        return out
    if hidden == 0:
        return out.zero_()
    grid, scalars, kw = _wgrad_launch(
        launch_configs(),
        x.element_size(),
        n // top_k,
        hidden,
        n,
        bins.numel(),
        top_k,
        mode,
        bin_size,
        _rows(x, mode),
    )
    launch(
        _wgrad_kernel,
        grid,
        x,
        grad,
        indices,
        _inverse(indices),
        bin_ids if bin_ids is not None else bins,
        bins,
        padded_bins if padded_bins is not None else bins,
        out,
        *scalars,
        **kw,
    )
    return out


# --------------------------------------------------------------------------- plain layout, per call shape
#
# gather, scatter and scatter_wgrad (the dropless layer's ops) keep their launches prepared per
# call shape: a call allocates its outputs and launches, with no launch parameter to work out.
# The key holds every input's shape and dtype (they decide every scalar and every tensor's dtype
# of the launches) and the primary input's device.

_GATHER_PLANS: dict[Any, Callable[..., torch.Tensor]] = {}
_SCATTER_PLANS: dict[Any, Callable[..., torch.Tensor]] = {}
_WGRAD_PLANS: dict[Any, Callable[..., torch.Tensor]] = {}


def _inverse_plan(configs: LaunchConfigs, n: int) -> Callable[[torch.Tensor], torch.Tensor]:
    grid, scalars, kw = _inverse_launch(configs, n)
    invert = bind(_inverse_kernel, grid, *scalars, **kw)
    int32 = torch.int32

    def inverse(indices: torch.Tensor) -> torch.Tensor:
        inv = indices.new_empty(n, dtype=int32)
        invert(indices, inv)
        return inv

    return inverse


def _gather_plan(
    configs: LaunchConfigs,
    x: torch.Tensor,
    n: int,
    num_bins: int,
    top_k: int,
    has_weights: bool,
    rows: int | None = None,
) -> Callable[..., torch.Tensor]:
    """The prepared gather of the first ``rows`` sorted rows (all n when None)."""
    num_tokens, hidden = x.shape
    dtype = x.dtype
    out_rows = n if rows is None else rows
    if out_rows * hidden == 0 or num_tokens == 0:
        return lambda x, indices, weights, bins: torch.empty(
            (out_rows, hidden), dtype=dtype, device=x.device
        )
    if configs.gather_by_rows(num_tokens, hidden, top_k, x.element_size()):
        # out_rows rows of one copy each (ids still range over all n)
        cfg = configs.permutation(out_rows, hidden, 1, x.element_size())
        copy_rows = bind(
            _gather_rows_kernel,
            (out_rows, cfg.split_h),
            n,
            hidden,
            TOP_K=top_k,
            BLOCK_H=cfg.block_h,
            SPLIT_H=cfg.split_h,
            HAS_WEIGHTS=has_weights,
            num_warps=cfg.num_warps,
            **_options(configs),
        )

        def by_rows(
            x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor | None, bins: torch.Tensor
        ) -> torch.Tensor:
            out = x.new_empty(out_rows, hidden)
            copy_rows(x, indices, weights if weights is not None else x, out)
            return out

        return by_rows
    inverse = _inverse_plan(configs, n)
    grid, scalars, kw = _gather_launch(
        configs,
        x.device.type == "cpu",
        x.element_size(),
        num_tokens,
        hidden,
        n,
        num_bins,
        top_k,
        PLAIN,
        0,
        out_rows,
        has_weights,
    )
    copy = bind(_gather_kernel, grid, *scalars, **kw)

    def by_tokens(
        x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor | None, bins: torch.Tensor
    ) -> torch.Tensor:
        out = x.new_empty(out_rows, hidden)
        inv = inverse(indices)
        copy(x, indices, inv, bins, weights if weights is not None else x, bins, bins, out)
        return out

    return by_tokens


def _scatter_plan(
    configs: LaunchConfigs,
    x: torch.Tensor,
    n: int,
    num_bins: int,
    top_k: int,
    has_weights: bool,
    grouped_rows: bool = False,
) -> Callable[..., torch.Tensor]:
    """The prepared scatter of ``x``'s rows; ``grouped_rows``: only the rows bins' groups cover
    are read (gmm_scatter's reduction: its GEMM writes no other row)."""
    num_tokens = n // top_k
    hidden = x.shape[-1]
    dtype = x.dtype
    if num_tokens * hidden == 0:
        return lambda x, indices, weights, bins: torch.empty(
            (num_tokens, hidden), dtype=dtype, device=x.device
        )
    search = configs.scatter_search(num_tokens, top_k)
    grid, scalars, kw = _scatter_launch(
        configs,
        x.element_size(),
        num_tokens,
        hidden,
        n,
        num_bins,
        top_k,
        PLAIN,
        0,
        x.shape[0],
        has_weights,
        search,
        grouped_rows,
    )
    reduce = bind(_scatter_kernel, grid, *scalars, **kw)
    if search:

        def scanning(
            x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor | None, bins: torch.Tensor
        ) -> torch.Tensor:
            out = x.new_empty(num_tokens, hidden)
            # No inverse permutation: indices stands in for inv (unread).
            reduce(
                x, indices, indices, bins, weights if weights is not None else x, bins, bins, out
            )
            return out

        return scanning
    inverse = _inverse_plan(configs, n)

    def by_inverse(
        x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor | None, bins: torch.Tensor
    ) -> torch.Tensor:
        out = x.new_empty(num_tokens, hidden)
        inv = inverse(indices)
        reduce(x, indices, inv, bins, weights if weights is not None else x, bins, bins, out)
        return out

    return by_inverse


def _wgrad_plan(
    configs: LaunchConfigs, x: torch.Tensor, n: int, num_bins: int, top_k: int
) -> Callable[..., torch.Tensor]:
    hidden = x.shape[-1]
    dtype = x.dtype
    if n == 0 or hidden == 0:
        return lambda x, grad, indices, bins: torch.zeros(n, dtype=dtype, device=x.device)
    inverse = _inverse_plan(configs, n)
    grid, scalars, kw = _wgrad_launch(
        configs, x.element_size(), n // top_k, hidden, n, num_bins, top_k, PLAIN, 0, x.shape[0]
    )
    dot = bind(_wgrad_kernel, grid, *scalars, **kw)

    def run(
        x: torch.Tensor, grad: torch.Tensor, indices: torch.Tensor, bins: torch.Tensor
    ) -> torch.Tensor:
        out = x.new_empty(n)
        inv = inverse(indices)
        dot(x, grad, indices, inv, bins, bins, bins, out)
        return out

    return run


# --------------------------------------------------------------------------- contract functions


def gather(
    x: torch.Tensor,
    indices: torch.Tensor,
    bin_ids: torch.Tensor,
    weights: torch.Tensor | None,
    bins: torch.Tensor,
    top_k: int,
    rows: int | None = None,
) -> torch.Tensor:
    """(T, H) -> (T*K, H), or its first ``rows`` rows: out[i] = x[indices[i] // K] *
    weights[indices[i]] (if weights)."""
    return _plan(_GATHER_PLANS, _gather_plan, x, indices, weights, bins, top_k, rows)(
        x, indices, weights, bins
    )


def scatter(
    x: torch.Tensor,
    indices: torch.Tensor,
    bin_ids: torch.Tensor,
    weights: torch.Tensor | None,
    bins: torch.Tensor,
    top_k: int,
) -> torch.Tensor:
    """(T*K, H) sorted rows -> (T, H): weighted top-k sum per token (fp32 accumulation)."""
    return _plan(_SCATTER_PLANS, _scatter_plan, x, indices, weights, bins, top_k)(
        x, indices, weights, bins
    )


def _plan(
    plans: dict[Any, Any],
    make: Callable[..., Any],
    x: torch.Tensor,
    indices: torch.Tensor,
    weights: torch.Tensor | None,
    bins: torch.Tensor,
    top_k: int,
    *rows: int | None,
) -> Any:
    """The prepared launches of a plain gather (``rows``: its row count) or scatter for this
    call shape (made once)."""
    configs = launch_configs()
    key = (
        x.shape,
        x.dtype,
        x.device,
        indices.shape,
        indices.dtype,
        bins.shape,
        bins.dtype,
        None if weights is None else weights.dtype,
        top_k,
        configs,
        *rows,
    )
    plan = plans.get(key)
    if plan is None:
        plan = remember(
            plans,
            key,
            make(configs, x, indices.numel(), bins.numel(), int(top_k), weights is not None, *rows),
        )
    return plan


def scatter_wgrad(
    x: torch.Tensor,
    grad: torch.Tensor,
    indices: torch.Tensor,
    bin_ids: torch.Tensor,
    bins: torch.Tensor,
    top_k: int,
) -> torch.Tensor:
    """(n,) in x.dtype: out[indices[i]] = dot(x[i], grad[indices[i] // K])."""
    configs = launch_configs()
    key = (
        x.shape,
        x.dtype,
        x.device,
        grad.shape,
        grad.dtype,
        indices.shape,
        indices.dtype,
        bins.shape,
        bins.dtype,
        top_k,
        configs,
    )
    plan = _WGRAD_PLANS.get(key)
    if plan is None:
        plan = remember(
            _WGRAD_PLANS, key, _wgrad_plan(configs, x, indices.numel(), bins.numel(), int(top_k))
        )
    return plan(x, grad, indices, bins)


def padded_gather(
    x: torch.Tensor,
    indices: torch.Tensor,
    bin_ids: torch.Tensor,
    weights: torch.Tensor | None,
    bins: torch.Tensor,
    padded_bins: torch.Tensor,
    top_k: int,
) -> torch.Tensor:
    """(T, H) -> (padded_bins[-1], H), each expert's rows starting at padded_bins[e-1]; padding rows 0.

    Reads padded_bins[-1] on the host (the output size), as MegaBlocks does.
    """
    # Queue the inverse permutation first: the GPU computes it while the host waits on the read.
    inv = _inverse(indices) if indices.numel() else indices
    rows = int(padded_bins[-1].item()) if padded_bins.numel() else 0
    if rows < 0:
        raise ContractError(
            f"megablocks_core.ops.padded_gather: argument 'padded_bins' ends at {rows}, "
            "but its last entry is the output's row count (expected >= 0)"
        )
    out = torch.empty((rows, x.shape[1]), dtype=x.dtype, device=x.device)
    return _launch_gather(
        x, indices, weights, bins, padded_bins, top_k, out, PADDED, 0, inv, bin_ids
    )


def padded_scatter(
    x: torch.Tensor,
    indices: torch.Tensor,
    bin_ids: torch.Tensor,
    weights: torch.Tensor | None,
    bins: torch.Tensor,
    padded_bins: torch.Tensor,
    top_k: int,
) -> torch.Tensor:
    """(padded rows, H) -> (T, H): inverse of padded_gather, weighted top-k sum in fp32."""
    return _launch_scatter(x, indices, weights, bins, padded_bins, top_k, PADDED, 0, bin_ids)


def padded_scatter_wgrad(
    x: torch.Tensor,
    grad: torch.Tensor,
    indices: torch.Tensor,
    bin_ids: torch.Tensor,
    bins: torch.Tensor,
    padded_bins: torch.Tensor,
    top_k: int,
) -> torch.Tensor:
    """(n,): dot of each flat id's padded row with its token's grad row."""
    return _launch_wgrad(x, grad, indices, bins, padded_bins, top_k, PADDED, 0, bin_ids)


def binned_gather(
    x: torch.Tensor,
    indices: torch.Tensor,
    weights: torch.Tensor | None,
    bins: torch.Tensor,
    bin_size: int,
    top_k: int,
) -> torch.Tensor:
    """(T, H) -> (E, bin_size, H) zero-filled; copies beyond an expert's capacity are dropped."""
    num_bins, bin_size = bins.numel(), int(bin_size)
    out = torch.empty((num_bins, bin_size, x.shape[1]), dtype=x.dtype, device=x.device)
    _launch_gather(x, indices, weights, bins, None, top_k, out, BINNED, bin_size)
    return out


def binned_scatter(
    x: torch.Tensor,
    indices: torch.Tensor,
    weights: torch.Tensor | None,
    bins: torch.Tensor,
    top_k: int,
) -> torch.Tensor:
    """(E, bin_size, H) -> (T, H): weighted top-k sum; dropped copies contribute 0."""
    return _launch_scatter(x, indices, weights, bins, None, top_k, BINNED, x.shape[1])


def binned_scatter_wgrad(
    x: torch.Tensor,
    grad: torch.Tensor,
    indices: torch.Tensor,
    bins: torch.Tensor,
    top_k: int,
) -> torch.Tensor:
    """(n,): dot of each kept binned row with its token's grad row; 0 for dropped copies."""
    return _launch_wgrad(x, grad, indices, bins, None, top_k, BINNED, x.shape[1])
