"""``gmm_scatter`` for a few tokens (decode) in one launch: activation, GEMM, bias, weights and
the top-k sum together, one program per (token, column block).

The tiled path is three launches (the activation's copy, the grouped GEMM into sorted rows, the
scatter), each with its own host cost, which at a few tokens is more than their GPU time. Here a
program finds its token's sorted rows by scanning ``indices`` (a few dozen ids), and for each
computes ``act(x[row]) @ b[expert][:, cols]`` as a vector-matrix product on the CUDA cores: with
a handful of rows per expert the weights' bytes decide the time, not the matrix units. Rounding
matches the composition: act(x) rounded to x's dtype, each (token, k) product row (bias added in
fp32) rounded to x's dtype, then weighted and summed in fp32.
"""

from __future__ import annotations

import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

from ..activation import _activate, _up
from .gmm import _group_sizes
from .permutation import _rows_naming


@triton.jit
def _activated_slice(
    row_ptrs, d, depth, mask, alpha, limit,
    ACTIVATION: tl.constexpr, GATED: tl.constexpr, INTERLEAVED: tl.constexpr,
):  # fmt: skip
    """act(x)'s columns d (1, BLOCK_K) of the rows at row_ptrs (K_PAD, 1), float32 holding values
    of x's dtype: gated rows hold gate and up side by side (up ``depth`` columns after gate) or
    interleaved."""
    if GATED:
        if INTERLEAVED:
            pairs = (row_ptrs + 2 * d)[:, :, None] + tl.arange(0, 2)[None, None, :]
            both = tl.load(pairs, mask=mask[:, :, None], other=0.0)
            gate, up = tl.split(both.to(tl.float32))
        else:
            gate = tl.load(row_ptrs + d, mask=mask, other=0.0).to(tl.float32)
            up = tl.load(row_ptrs + depth + d, mask=mask, other=0.0).to(tl.float32)
        value = _activate(gate, alpha, limit, ACTIVATION) * _up(up, limit, ACTIVATION)
    else:
        value = tl.load(row_ptrs + d, mask=mask, other=0.0).to(tl.float32)
        value = _activate(value, alpha, limit, ACTIVATION)
    return value.to(row_ptrs.dtype.element_ty).to(tl.float32)


@triton.jit
def _token_gmm_scatter_kernel(
    x_ptr, b_ptr, indices_ptr, weights_ptr, bins_ptr, bias_ptr, out_ptr,
    n, num_rows, num_bins, depth, width,
    stride_x, stride_be, stride_bk, stride_bn, stride_bias,
    alpha, limit,
    TOP_K: tl.constexpr, K_PAD: tl.constexpr, SEARCH: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ACTIVATION: tl.constexpr, GATED: tl.constexpr, INTERLEAVED: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr, HAS_BIAS: tl.constexpr,
):  # fmt: skip
    # All of the token's pairs advance together through one (K_PAD, BLOCK_K, BLOCK_N) tile of
    # their experts' matrices per step, and the next step's tile is loaded before this one is
    # reduced: few programs exist at one token, so each keeps many bytes in flight.
    token = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < width
    # A row's expert is the group (from bins, as the tiled GEMM reads them) holding it; rows
    # past the groups (other ranks' experts) and ids no row names contribute nothing.
    sizes, covered = _group_sizes(bins_ptr, num_bins, num_rows, BLOCK_E, True)
    ends = tl.cumsum(sizes, 0)
    copies = tl.arange(0, K_PAD)
    found = _rows_naming(indices_ptr, token * TOP_K, n, copies, SEARCH)
    keep = (copies < TOP_K) & (found >= 0) & (found < covered)
    rows = tl.where(keep, found, 0)
    experts = tl.sum((ends[None, :] <= rows[:, None]).to(tl.int32), axis=1)
    row_ptrs = (x_ptr + rows.to(tl.int64) * stride_x)[:, None]
    matrices = (b_ptr + experts.to(tl.int64) * stride_be)[:, None, None]
    tile_cols = (cols * stride_bn)[None, None, :]
    tile_ok = keep[:, None, None] & col_ok[None, None, :]
    d = tl.arange(0, BLOCK_K)
    w = tl.load(
        matrices + (d * stride_bk)[None, :, None] + tile_cols,
        mask=tile_ok & (d < depth)[None, :, None],
        other=0.0,
    )
    acc = tl.zeros([K_PAD, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, depth, BLOCK_K):
        d = k0 + tl.arange(0, BLOCK_K)
        a = _activated_slice(
            row_ptrs, d[None, :], depth, keep[:, None] & (d < depth)[None, :], alpha, limit,
            ACTIVATION, GATED, INTERLEAVED,
        )  # fmt: skip
        ahead = d + BLOCK_K
        w_next = tl.load(
            matrices + (ahead * stride_bk)[None, :, None] + tile_cols,
            mask=tile_ok & (ahead < depth)[None, :, None],
            other=0.0,
        )
        acc += tl.sum(a[:, :, None] * w.to(tl.float32), axis=1)
        w = w_next
    pair_ok = keep[:, None] & col_ok[None, :]
    if HAS_BIAS:
        at = bias_ptr + (experts.to(tl.int64) * stride_bias)[:, None] + cols[None, :]
        acc += tl.load(at, mask=pair_ok, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    products = acc.to(dtype).to(tl.float32)  # each (token, k) product row in x's dtype
    if HAS_WEIGHTS:
        scale = tl.load(weights_ptr + token * TOP_K + copies, mask=keep, other=0.0)
        products = products * scale.to(tl.float32)[:, None]
    out = tl.sum(tl.where(pair_ok, products, 0.0), axis=0)
    tl.store(out_ptr + token.to(tl.int64) * width + cols, out.to(dtype), mask=col_ok)
