"""Triton kernels of the low-precision ops: quantization into an FP8 encoding with float32 block
scales, and the grouped GEMM of quantized operands (``scaled_gmm``, ``scaled_gather_gmm``, the
GEMM half of ``scaled_gmm_scatter``).

Kernels only; the host side is :mod:`megablocks_triton.scaled`. The arithmetic is the core's
(:mod:`megablocks_core.formats`): a quantized element is bit for bit what its definition gives,
here by integer arithmetic on the float32 bits (:func:`_encode_e4m3`), which Triton's CPU
interpreter runs exactly too, or by the hardware's conversion where the device has one.
"""

from __future__ import annotations

import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

from .gmm import _group_sizes, _swizzle


@triton.jit
def _encode_e4m3(
    v, BIAS: tl.constexpr, NEG_ZERO: tl.constexpr, HARDWARE: tl.constexpr,
    FP8: tl.constexpr,
):  # fmt: skip
    """The E4M3 bits (int32, 0..255) of float32 ``v`` rounded to nearest, ties to even; ``v`` is
    already clamped to the encoding's range (finite: a NaN block is written by the caller).
    NEG_ZERO False (FNUZ): a value that rounds to zero is +0. HARDWARE: the device's conversion
    (round to nearest even, saturating) into FP8, then its bits."""
    if HARDWARE:
        if not NEG_ZERO:
            v = tl.where(v == 0.0, 0.0, v)
        return v.to(FP8).to(tl.uint8, bitcast=True).to(tl.int32)
    bits = v.to(tl.int32, bitcast=True)
    magnitude = tl.abs(v)
    # Rounding |v| to the encoding's spacing at its binade: adding 2**(e + 20) leaves the float32
    # sum 3 mantissa bits below that binade's top, so the float32 add itself rounds to nearest
    # even; subnormals share the spacing of the lowest normal binade.
    exponent = (magnitude.to(tl.int32, bitcast=True) >> 23) - 127
    exponent = tl.maximum(exponent, 1 - BIAS)
    magic = ((exponent + (20 + 127)) << 23).to(tl.float32, bitcast=True)
    rounded = (magnitude + magic) - magic
    r_bits = rounded.to(tl.int32, bitcast=True)
    r_exponent = (r_bits >> 23) - 127
    normal_code = ((r_exponent + BIAS) << 3) | ((r_bits >> 20) & 7)
    subnormal_code = (rounded * (2.0 ** (BIAS + 2))).to(tl.int32)  # multiples of 2**-(BIAS + 2)
    code = tl.where(r_exponent >= 1 - BIAS, normal_code, subnormal_code)
    negative = bits < 0
    if not NEG_ZERO:
        negative = negative & (code != 0)
    return tl.where(negative, code | 128, code)


@triton.jit
def _block_scale(amax, bad, MAX: tl.constexpr, POW2: tl.constexpr):
    """The float32 scale of blocks with largest magnitude ``amax`` (NaN where ``bad``: a NaN or
    an infinity in the block), as megablocks_core.formats.quantize defines it."""
    scale = tl.maximum(tl.math.div_rn(amax, MAX), 1.1754943508222875e-38)  # 2**-126
    if POW2:  # round up to a power of two: carry any mantissa bit into the exponent
        scale = ((scale.to(tl.int32, bitcast=True) + 0x7FFFFF) & 0x7F800000).to(
            tl.float32, bitcast=True
        )
    return tl.where(bad, float("nan"), scale)


@triton.jit
def _quantized_codes(
    values, scale, bad, MAX: tl.constexpr, BIAS: tl.constexpr, NEG_ZERO: tl.constexpr,
    NAN_BITS: tl.constexpr, HARDWARE: tl.constexpr, FP8: tl.constexpr,
):  # fmt: skip
    """Codes of float32 ``values`` under their blocks' ``scale`` (broadcast), NaN where ``bad``."""
    inverse = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
    scaled = tl.minimum(tl.maximum(values * inverse, -MAX), MAX)
    codes = _encode_e4m3(scaled, BIAS, NEG_ZERO, HARDWARE, FP8)
    return tl.where(bad, NAN_BITS, codes).to(tl.uint8)


@triton.jit
def _nonfinite(values):
    return (values != values) | (tl.abs(values) == float("inf"))


@triton.jit
def _running_peak(peak, values):
    """Elementwise the largest |value| so far, NaN once any value was NaN: the passes over a
    row or column keep a whole tile of these and reduce it once, after the loop."""
    return tl.maximum(peak, tl.abs(values), propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _peak_amax(peak, axis: tl.constexpr):
    """(amax, whether the block held a NaN or an infinity) along ``axis`` of a running peak."""
    bad = tl.max(_nonfinite(peak).to(tl.int32), axis) > 0
    return tl.max(tl.where(_nonfinite(peak), 0.0, peak), axis), bad


@triton.jit
def _quantize_kernel(
    x_ptr, data_ptr, scale_ptr,
    R, C, r_tiles, c_tiles,
    stride_xe, stride_xr, stride_xc,
    stride_se, stride_sr, stride_sc,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, MODE: tl.constexpr,
    MAX: tl.constexpr, BIAS: tl.constexpr, NEG_ZERO: tl.constexpr, NAN_BITS: tl.constexpr,
    POW2: tl.constexpr, HARDWARE: tl.constexpr, FP8: tl.constexpr, TRANSPOSED: tl.constexpr,
):  # fmt: skip
    """x viewed as (E, R, C) with any strides -> data (E, R, C) contiguous (as uint8 codes) and
    its scales (strided as given). MODE "tile": one scale per (BLOCK_R, BLOCK_C) tile; "row_tile":
    one per row of each tile (1 x BLOCK_C blocks; one tile across C: one per whole row, in one
    read); "row": one per whole row (two passes over C);
    "column": one per whole column (two passes over R). TRANSPOSED ("tile", "column"): the data
    stored (E, C, R) contiguous instead. Program (e, r-tile, c-tile)."""
    pid = tl.program_id(0)
    e = pid // (r_tiles * c_tiles)
    rest = pid % (r_tiles * c_tiles)
    rows = (rest // c_tiles) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = (rest % c_tiles) * BLOCK_C + tl.arange(0, BLOCK_C)
    x_base = x_ptr + e.to(tl.int64) * stride_xe
    d_base = data_ptr + e.to(tl.int64) * R * C
    s_base = scale_ptr + e.to(tl.int64) * stride_se
    r_off = rows.to(tl.int64)[:, None]
    c_off = cols.to(tl.int64)[None, :]
    if MODE == "tile" or MODE == "row_tile":
        mask = (rows < R)[:, None] & (cols < C)[None, :]
        values = tl.load(x_base + r_off * stride_xr + c_off * stride_xc, mask=mask, other=0.0)
        values = values.to(tl.float32)
        magnitude = tl.abs(values)
        bad_elements = _nonfinite(values).to(tl.int32)
        if MODE == "tile":
            amax = tl.max(tl.max(magnitude, 1), 0)
            bad = tl.max(tl.max(bad_elements, 1), 0) > 0
            scale = _block_scale(amax, bad, MAX, POW2)
            tl.store(s_base + (rest // c_tiles) * stride_sr + (rest % c_tiles) * stride_sc, scale)
            codes = _quantized_codes(
                values, scale, bad, MAX, BIAS, NEG_ZERO, NAN_BITS, HARDWARE, FP8
            )
        else:
            amax = tl.max(magnitude, 1)
            bad = tl.max(bad_elements, 1) > 0
            scale = _block_scale(amax, bad, MAX, POW2)
            tl.store(
                s_base + rows.to(tl.int64) * stride_sr + (rest % c_tiles) * stride_sc,
                scale,
                mask=rows < R,
            )
            codes = _quantized_codes(
                values, scale[:, None], bad[:, None], MAX, BIAS, NEG_ZERO, NAN_BITS, HARDWARE,
                FP8,
            )  # fmt: skip
        d_off = c_off * R + r_off if TRANSPOSED else r_off * C + c_off
        tl.store(d_base + d_off, codes, mask=mask)
    elif MODE == "row":
        r_ok = (rows < R)[:, None]
        peak = tl.zeros((BLOCK_R, BLOCK_C), tl.float32)
        for c0 in range(0, C, BLOCK_C):
            c_at = c0 + tl.arange(0, BLOCK_C)
            mask = r_ok & (c_at < C)[None, :]
            values = tl.load(
                x_base + r_off * stride_xr + c_at.to(tl.int64)[None, :] * stride_xc,
                mask=mask,
                other=0.0,
            ).to(tl.float32)
            peak = _running_peak(peak, values)
        amax, bad = _peak_amax(peak, 1)
        scale = _block_scale(amax, bad, MAX, POW2)
        tl.store(s_base + rows.to(tl.int64) * stride_sr, scale, mask=rows < R)
        for c0 in range(0, C, BLOCK_C):
            c_at = c0 + tl.arange(0, BLOCK_C)
            mask = r_ok & (c_at < C)[None, :]
            c64 = c_at.to(tl.int64)[None, :]
            values = tl.load(x_base + r_off * stride_xr + c64 * stride_xc, mask=mask, other=0.0)
            codes = _quantized_codes(
                values.to(tl.float32), scale[:, None], bad[:, None], MAX, BIAS, NEG_ZERO,
                NAN_BITS, HARDWARE, FP8,
            )  # fmt: skip
            tl.store(d_base + r_off * C + c64, codes, mask=mask)
    else:  # "column"
        c_ok = (cols < C)[None, :]
        peak = tl.zeros((BLOCK_R, BLOCK_C), tl.float32)
        for r0 in range(0, R, BLOCK_R):
            r_at = r0 + tl.arange(0, BLOCK_R)
            mask = (r_at < R)[:, None] & c_ok
            values = tl.load(
                x_base + r_at.to(tl.int64)[:, None] * stride_xr + c_off * stride_xc,
                mask=mask,
                other=0.0,
            ).to(tl.float32)
            peak = _running_peak(peak, values)
        amax, bad = _peak_amax(peak, 0)
        scale = _block_scale(amax, bad, MAX, POW2)
        tl.store(s_base + cols.to(tl.int64) * stride_sc, scale, mask=cols < C)
        for r0 in range(0, R, BLOCK_R):
            r_at = r0 + tl.arange(0, BLOCK_R)
            mask = (r_at < R)[:, None] & c_ok
            r64 = r_at.to(tl.int64)[:, None]
            values = tl.load(x_base + r64 * stride_xr + c_off * stride_xc, mask=mask, other=0.0)
            codes = _quantized_codes(
                values.to(tl.float32), scale[None, :], bad[None, :], MAX, BIAS, NEG_ZERO,
                NAN_BITS, HARDWARE, FP8,
            )  # fmt: skip
            d_off = c_off * R + r64 if TRANSPOSED else r64 * C + c_off
            tl.store(d_base + d_off, codes, mask=mask)


@triton.jit
def _pq_tile(x_ptr, pid, P, Q, p_tiles, q_tiles, stride_xe, stride_xp, stride_xq,
             BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr):  # fmt: skip
    """Program ``pid``'s (e, p-tile, q-tile) of x (E, P, Q), read in float32 (zeros outside),
    with its indices: (values, e64, p_tile, q_tile, ps, qs, p_ok, q_ok)."""
    e = pid // (p_tiles * q_tiles)
    rest = pid % (p_tiles * q_tiles)
    p_tile = rest // q_tiles
    q_tile = rest % q_tiles
    ps = p_tile * BLOCK_P + tl.arange(0, BLOCK_P)
    qs = q_tile * BLOCK_Q + tl.arange(0, BLOCK_Q)
    p_ok = ps < P
    q_ok = qs < Q
    e64 = e.to(tl.int64)
    mask = p_ok[:, None] & q_ok[None, :]
    offsets = ps.to(tl.int64)[:, None] * stride_xp + qs.to(tl.int64)[None, :] * stride_xq
    values = tl.load(x_ptr + e64 * stride_xe + offsets, mask=mask, other=0.0).to(tl.float32)
    return values, e64, p_tile, q_tile, ps, qs, p_ok, q_ok


@triton.jit
def _store_transposed(data_t_ptr, codes, e64, ps, qs, p_ok, q_ok, P, Q):
    """A (p, q) tile of codes stored as its transpose into data_t (E, Q, P), contiguous."""
    tl.store(
        data_t_ptr + e64 * P * Q + qs.to(tl.int64)[:, None] * P + ps.to(tl.int64)[None, :],
        tl.trans(codes),
        mask=q_ok[:, None] & p_ok[None, :],
    )


@triton.jit
def _both_ways_kernel(
    x_ptr, data_ptr, data_t_ptr, scale_ptr, scale_t_ptr,
    P, Q, p_tiles, q_tiles,
    stride_xe, stride_xp, stride_xq,
    BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr,
    MAX: tl.constexpr, BIAS: tl.constexpr, NEG_ZERO: tl.constexpr, NAN_BITS: tl.constexpr,
    POW2: tl.constexpr, HARDWARE: tl.constexpr, FP8: tl.constexpr,
):  # fmt: skip
    """quantize_both_ways of x (E, P, Q) in square blocks (the blockwise format's tiles, the same
    block either way), one read of each: data (E, P, Q) and data_t (E, Q, P), both contiguous,
    and one scale per tile, (E, p_tiles, q_tiles) and (E, q_tiles, p_tiles). Program (e,
    p-tile, q-tile)."""
    values, e64, p_tile, q_tile, ps, qs, p_ok, q_ok = _pq_tile(
        x_ptr, tl.program_id(0), P, Q, p_tiles, q_tiles, stride_xe, stride_xp, stride_xq,
        BLOCK_P, BLOCK_Q,
    )  # fmt: skip
    bad = tl.max(tl.max(_nonfinite(values).to(tl.int32), 1), 0) > 0
    scale = _block_scale(tl.max(tl.max(tl.abs(values), 1), 0), bad, MAX, POW2)
    tl.store(scale_ptr + (e64 * p_tiles + p_tile) * q_tiles + q_tile, scale)
    tl.store(scale_t_ptr + (e64 * q_tiles + q_tile) * p_tiles + p_tile, scale)
    codes = _quantized_codes(values, scale, bad, MAX, BIAS, NEG_ZERO, NAN_BITS, HARDWARE, FP8)
    data_off = ps.to(tl.int64)[:, None] * Q + qs.to(tl.int64)[None, :]
    tl.store(data_ptr + e64 * P * Q + data_off, codes, mask=p_ok[:, None] & q_ok[None, :])
    _store_transposed(data_t_ptr, codes, e64, ps, qs, p_ok, q_ok, P, Q)


@triton.jit
def _rows_and_column_peaks_kernel(
    x_ptr, data_ptr, scale_ptr, col_peak_ptr,
    P, Q, p_chunks,
    stride_xe, stride_xp, stride_xq,
    BLOCK_R: tl.constexpr, Q_PAD: tl.constexpr, STEPS: tl.constexpr,
    MAX: tl.constexpr, BIAS: tl.constexpr, NEG_ZERO: tl.constexpr, NAN_BITS: tl.constexpr,
    POW2: tl.constexpr, HARDWARE: tl.constexpr, FP8: tl.constexpr,
):  # fmt: skip
    """Rowwise quantize_both_ways, first read: x (E, P, Q)'s rows quantized whole (data (E, P, Q)
    and its row scales, as quantize(x, 2)), and each column's peak (|x|, +inf where a NaN or an
    infinity is) raised in float32 (E, Q) that starts at zero. Program (e, chunk of STEPS *
    BLOCK_R rows): its column peaks kept in registers, raised once at the end."""
    pid = tl.program_id(0)
    e = pid // p_chunks
    chunk = pid % p_chunks
    e64 = e.to(tl.int64)
    qs = tl.arange(0, Q_PAD)
    q_ok = qs < Q
    q64 = qs.to(tl.int64)
    col_peak = tl.zeros((Q_PAD,), tl.float32)
    for step in range(STEPS):
        ps = (chunk * STEPS + step) * BLOCK_R + tl.arange(0, BLOCK_R)
        p_ok = ps < P
        p64 = ps.to(tl.int64)
        mask = p_ok[:, None] & q_ok[None, :]
        offsets = p64[:, None] * stride_xp + q64[None, :] * stride_xq
        values = tl.load(x_ptr + e64 * stride_xe + offsets, mask=mask, other=0.0).to(tl.float32)
        magnitude = tl.abs(values)
        bad_elements = _nonfinite(values)
        bad = tl.max(bad_elements.to(tl.int32), 1) > 0
        scale = _block_scale(tl.max(magnitude, 1), bad, MAX, POW2)
        tl.store(scale_ptr + e64 * P + p64, scale, mask=p_ok)
        codes = _quantized_codes(
            values, scale[:, None], bad[:, None], MAX, BIAS, NEG_ZERO, NAN_BITS, HARDWARE, FP8
        )
        tl.store(data_ptr + e64 * P * Q + p64[:, None] * Q + q64[None, :], codes, mask=mask)
        peaks = tl.where(bad_elements, float("inf"), magnitude)
        col_peak = tl.maximum(col_peak, tl.max(peaks, 0))
    tl.atomic_max(col_peak_ptr + e64 * Q + qs, col_peak, mask=q_ok)


@triton.jit
def _column_codes_kernel(
    x_ptr, data_t_ptr, scale_t_ptr, col_peak_ptr,
    P, Q, p_tiles, q_tiles,
    stride_xe, stride_xp, stride_xq,
    BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr,
    MAX: tl.constexpr, BIAS: tl.constexpr, NEG_ZERO: tl.constexpr, NAN_BITS: tl.constexpr,
    POW2: tl.constexpr, HARDWARE: tl.constexpr, FP8: tl.constexpr,
):  # fmt: skip
    """Rowwise quantize_both_ways, second read: x (E, P, Q) quantized per whole column from the
    peaks :func:`_rows_and_column_peaks_kernel` left, stored transposed, data_t (E, Q, P)
    contiguous (as quantize(x.transpose(1, 2), 2)); the programs of the first p-tile write the
    column scales. Program (e, p-tile, q-tile)."""
    values, e64, p_tile, _, ps, qs, p_ok, q_ok = _pq_tile(
        x_ptr, tl.program_id(0), P, Q, p_tiles, q_tiles, stride_xe, stride_xp, stride_xq,
        BLOCK_P, BLOCK_Q,
    )  # fmt: skip
    peak = tl.load(col_peak_ptr + e64 * Q + qs, mask=q_ok, other=0.0)
    bad = peak == float("inf")
    scale = _block_scale(tl.where(bad, 0.0, peak), bad, MAX, POW2)
    if p_tile == 0:
        tl.store(scale_t_ptr + e64 * Q + qs, scale, mask=q_ok)
    codes = _quantized_codes(
        values, scale[None, :], bad[None, :], MAX, BIAS, NEG_ZERO, NAN_BITS, HARDWARE, FP8
    )
    _store_transposed(data_t_ptr, codes, e64, ps, qs, p_ok, q_ok, P, Q)


@triton.jit
def _rounded(values, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """float32 ``values`` in ``dtype``, rounded to nearest even. Triton's CPU interpreter
    truncates float32 to bfloat16: there the rounding is done on the bits."""
    if INTERPRETED and dtype == tl.bfloat16:
        bits = values.to(tl.int32, bitcast=True)
        bits += 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    return values.to(dtype)


@triton.jit
def _scaled_gmm_kernel(
    a_ptr, b_ptr, c_ptr, sizes_ptr, idx_ptr, sa_ptr, sb_ptr, bias_ptr,
    M, N, K, E, top_k, num_ids,
    stride_am, stride_ak,
    stride_be, stride_bk, stride_bn,
    stride_cm, stride_cn,
    stride_sam, stride_sak,
    stride_sbe, stride_sbk, stride_sbn, stride_bias,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCKWISE: tl.constexpr, SCALE_BLOCK: tl.constexpr, PROMOTE: tl.constexpr,
    B_TMA: tl.constexpr, TRANS_B: tl.constexpr, GATHER: tl.constexpr,
    FROM_ENDS: tl.constexpr, ZERO_TAIL: tl.constexpr, INTERPRETED: tl.constexpr = False,
    NO_PROMOTION: tl.constexpr = False, A_TMA: tl.constexpr = False, FLATTEN: tl.constexpr = False,
    HAS_BIAS: tl.constexpr = False,
):  # fmt: skip
    """The persistent grouped GEMM of 8-bit operands (as ``_gmm_kernel``: the same tile walk
    over every expert's tiles, group sizes read on the device, rows clamped to their group).

    Rowwise (not BLOCKWISE): sa (M or tokens, 1) per row, sb per output column (strided by
    stride_sbn); the float32 accumulator is promoted every PROMOTE k (Hopper's FP8 MMA keeps a
    narrower sum) and the epilogue multiplies by both scales. BLOCKWISE: sa (rows, ceil(K /
    SCALE_BLOCK)), sb (E, ., .) per SCALE_BLOCK x SCALE_BLOCK tile (strides stride_sbk along k,
    stride_sbn along n); each K step (BLOCK_K divides SCALE_BLOCK) is a fresh product, scaled
    and added in float32. GATHER: A's row i is token row a[idx[i] // top_k] (its scales too);
    ids outside [0, num_ids) give zero rows. B_TMA: b_ptr is a 3-D TMA descriptor over b's
    storage; A_TMA (not GATHER): a_ptr a (M, K) one (rows past the group, the next group's, reach
    only rows the store drops; its bounds zero-fill the K tail). FROM_ENDS: sizes_ptr holds bins.
    FLATTEN: the tile and K loops pipelined as one (a short K loop's epilogue overlaps the next
    tile's loads). HAS_BIAS: bias_ptr is the per-expert bias (E, N), rows stride_bias apart,
    unit column stride, added in float32 to every row of a group (an unnamed one too) before
    the one rounding; otherwise bias_ptr is unused."""
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    e_idx = tl.arange(0, BLOCK_E)
    sizes, covered = _group_sizes(sizes_ptr, E, M, BLOCK_E, FROM_ENDS)
    n_tiles = tl.cdiv(N, BLOCK_N)
    tiles = tl.cdiv(sizes, BLOCK_M) * n_tiles
    tile_end = tl.cumsum(tiles, 0)
    group_tiles = tl.sum(tiles, 0)
    total_tiles = group_tiles
    if ZERO_TAIL:
        total_tiles += tl.cdiv(M - covered, BLOCK_M) * n_tiles
    offs_k0 = tl.arange(0, BLOCK_K)

    for tile in tl.range(pid, group_tiles, num_programs, flatten=FLATTEN):
        before = tile_end <= tile
        e = tl.sum(before.to(tl.int32), 0)
        row_start = tl.sum(tl.where(before, sizes, 0), 0)
        tile_base = tl.sum(tl.where(before, tiles, 0), 0)
        size_e = tl.sum(tl.where(e_idx == e, sizes, 0), 0)
        pid_m, pid_n = _swizzle(tile - tile_base, tl.cdiv(size_e, BLOCK_M), n_tiles, GROUP_M)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col0 = pid_n * BLOCK_N
        n_ok = cols < N

        # A's rows (clamped into the group) and, gathered, the token each one reads.
        sorted_rows = (row_start + tl.minimum(rows, size_e - 1)).to(tl.int64)
        if GATHER:
            flat = tl.load(idx_ptr + sorted_rows).to(tl.int64)
            named = (flat >= 0) & (flat < num_ids)
            a_rows = tl.where(named, flat // top_k, 0)
        else:
            named = rows >= 0
            a_rows = sorted_rows
        if not A_TMA:
            a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k0[None, :] * stride_ak
        if not B_TMA:
            b_ptrs = (b_ptr + e.to(tl.int64) * stride_be
                      + offs_k0[:, None] * stride_bk + cols[None, :].to(tl.int64) * stride_bn)  # fmt: skip
        sa_row = sa_ptr + a_rows * stride_sam
        sb_col = sb_ptr + e.to(tl.int64) * stride_sbe + (cols // SCALE_BLOCK) * stride_sbn

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            if A_TMA:
                a = a_ptr.load([row_start + pid_m * BLOCK_M, k])
            elif EVEN_K:
                a = tl.load(a_ptrs, mask=named[:, None], other=0.0)
            else:
                a = tl.load(a_ptrs, mask=named[:, None] & (offs_k0 < K - k)[None, :], other=0.0)
            if B_TMA:
                if TRANS_B:
                    b = tl.trans(b_ptr.load([e, col0, k]).reshape(BLOCK_N, BLOCK_K))
                else:
                    b = b_ptr.load([e, k, col0]).reshape(BLOCK_K, BLOCK_N)
            else:
                if EVEN_K:
                    b = tl.load(b_ptrs, mask=n_ok[None, :], other=0.0)
                else:
                    b = tl.load(b_ptrs, mask=(offs_k0 < K - k)[:, None] & n_ok[None, :], other=0.0)
                b_ptrs += BLOCK_K * stride_bk
            if not A_TMA:
                a_ptrs += BLOCK_K * stride_ak
            if BLOCKWISE:
                kb = k // SCALE_BLOCK
                sa = tl.load(sa_row + kb * stride_sak)
                sb = tl.load(sb_col + kb * stride_sbk, mask=n_ok, other=0.0)
                acc += tl.dot(a, b) * (sa[:, None] * sb[None, :])
            elif NO_PROMOTION:  # measurements only: the MMA's own accumulation throughout
                acc = tl.dot(a, b, acc)
            else:
                acc = tl.dot(a, b, acc, max_num_imprecise_acc=PROMOTE)

        if not BLOCKWISE:
            sa = tl.load(sa_row)
            sb = tl.load(sb_col, mask=n_ok, other=0.0)
            acc = acc * sa[:, None] * sb[None, :]
        acc = tl.where(named[:, None], acc, 0.0)  # an unnamed row's NaN scale must not leak
        if HAS_BIAS:
            bias_row = bias_ptr + e.to(tl.int64) * stride_bias
            acc += tl.load(bias_row + cols, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        out_rows = (row_start + rows).to(tl.int64)
        c_ptrs = c_ptr + out_rows[:, None] * stride_cm + cols[None, :].to(tl.int64) * stride_cn
        c_mask = (rows < size_e)[:, None] & n_ok[None, :]
        tl.store(c_ptrs, _rounded(acc, c_ptr.dtype.element_ty, INTERPRETED), mask=c_mask)

    first_tail = group_tiles + (pid - group_tiles % num_programs + num_programs) % num_programs
    for tile in range(first_tail, total_tiles, num_programs):
        local = tile - group_tiles
        rows = covered + (local // n_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = (local % n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
        c_ptrs = (
            c_ptr + rows[:, None].to(tl.int64) * stride_cm + cols[None, :].to(tl.int64) * stride_cn
        )
        zeros = tl.zeros((BLOCK_M, BLOCK_N), dtype=c_ptr.dtype.element_ty)
        tl.store(c_ptrs, zeros, mask=(rows < M)[:, None] & (cols < N)[None, :])


@triton.jit
def _group_extent(sizes_ptr, e, E, R, BLOCK_E: tl.constexpr):
    """(first row, rows) of group ``e``, its sizes made safe as ``_group_sizes`` makes them;
    ``e == E`` is the rows past every group."""
    sizes, covered = _group_sizes(sizes_ptr, E, R, BLOCK_E)
    e_idx = tl.arange(0, BLOCK_E)
    start = tl.sum(tl.where(e_idx < e, sizes, 0), 0)
    size = tl.where(e == E, R - covered, tl.sum(tl.where(e_idx == e, sizes, 0), 0))
    return start.to(tl.int64), size


@triton.jit
def _operand_rows(
    x_cols, idx_ptr, w_ptr, r_at, row_ok, c_ok, stride_xr, n_ids,
    TOP_K: tl.constexpr, GATHERED: tl.constexpr, WEIGHTED: tl.constexpr,
):  # fmt: skip
    """Rows ``r_at`` of a weight gradient's operand, (BLOCK_R, BLOCK_C) in float32: x's own rows,
    or (GATHERED) gather's sorted rows read through the flat ids: x[ids // TOP_K], weighted in
    float32 and rounded to x's dtype as gather's kernel rounds them; 0 for an id outside
    [0, n_ids)."""
    if GATHERED:
        ids = tl.load(idx_ptr + r_at, mask=row_ok, other=-1).to(tl.int64)
        named = row_ok & (ids >= 0) & (ids < n_ids)
        ids = tl.where(named, ids, 0)
        mask = named[:, None] & c_ok[None, :]
        values = tl.load(x_cols + (ids // TOP_K)[:, None] * stride_xr, mask=mask, other=0.0)
        if WEIGHTED:
            w = tl.load(w_ptr + ids, mask=named, other=0).to(tl.float32)
            values = (values.to(tl.float32) * w[:, None]).to(x_cols.dtype.element_ty)
    else:
        mask = row_ok[:, None] & c_ok[None, :]
        values = tl.load(x_cols + r_at[:, None] * stride_xr, mask=mask, other=0.0)
    return values.to(tl.float32)


@triton.jit
def _quantize_transposed_kernel(
    x_ptr, data_ptr, scale_ptr, sizes_ptr, idx_ptr, w_ptr,
    R, C, E, c_tiles, stride_xr, stride_xc, n_ids,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_E: tl.constexpr,
    MAX: tl.constexpr, BIAS: tl.constexpr, NEG_ZERO: tl.constexpr, NAN_BITS: tl.constexpr,
    POW2: tl.constexpr, HARDWARE: tl.constexpr, FP8: tl.constexpr, STAGES: tl.constexpr,
    TOP_K: tl.constexpr = 1, GATHERED: tl.constexpr = False, WEIGHTED: tl.constexpr = False,
):  # fmt: skip
    """x (R, C), any strides, grouped by expert along R -> data (C, R) contiguous (uint8 codes)
    and scale (E, C): one scale per column of each group, two passes over the group's rows (the
    peak, then the codes, written transposed). Program (e, c-tile); e == E writes zeros into
    the rows past every group. GATHERED: the R rows are gather's, read from token rows x through
    the flat ids at idx_ptr (and weighted by w_ptr's, WEIGHTED), never written."""
    pid = tl.program_id(0)
    e = pid // c_tiles
    cols = (pid % c_tiles) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = cols < C
    start, size = _group_extent(sizes_ptr, e, E, R, BLOCK_E)
    steps = tl.arange(0, BLOCK_R)
    x_cols = x_ptr + cols.to(tl.int64)[None, :] * stride_xc
    # The codes go out transposed, (BLOCK_C, BLOCK_R) with rows contiguous in memory.
    d_cols = data_ptr + cols.to(tl.int64)[:, None] * R
    if e == E:
        for r in range(0, size, BLOCK_R):
            r_at = start + r + steps
            mask = c_ok[:, None] & (r + steps < size)[None, :]
            zeros = tl.zeros((BLOCK_C, BLOCK_R), tl.uint8)
            tl.store(d_cols + r_at[None, :], zeros, mask=mask)
    else:
        peak = tl.zeros((BLOCK_R, BLOCK_C), tl.float32)
        for r in tl.range(0, size, BLOCK_R, num_stages=STAGES):
            r_at = start + r + steps
            values = _operand_rows(
                x_cols, idx_ptr, w_ptr, r_at, r + steps < size, c_ok, stride_xr, n_ids,
                TOP_K, GATHERED, WEIGHTED,
            )  # fmt: skip
            peak = _running_peak(peak, values)
        amax, bad = _peak_amax(peak, 0)
        scale = _block_scale(amax, bad, MAX, POW2)
        tl.store(scale_ptr + e.to(tl.int64) * C + cols, scale, mask=c_ok)
        for r in tl.range(0, size, BLOCK_R, num_stages=STAGES):
            r_at = start + r + steps
            row_ok = r + steps < size
            values = _operand_rows(
                x_cols, idx_ptr, w_ptr, r_at, row_ok, c_ok, stride_xr, n_ids,
                TOP_K, GATHERED, WEIGHTED,
            )  # fmt: skip
            codes = _quantized_codes(
                values, scale[None, :], bad[None, :], MAX, BIAS, NEG_ZERO, NAN_BITS, HARDWARE, FP8,
            )  # fmt: skip
            mask = c_ok[:, None] & row_ok[None, :]
            tl.store(d_cols + r_at[None, :], tl.trans(codes), mask=mask)


@triton.jit
def _scaled_wgrad_kernel(
    a_ptr, g_ptr, c_ptr, sizes_ptr, sa_ptr, sg_ptr,
    M, N, R, E,
    stride_am, stride_ar, stride_gn, stride_gr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr, PROMOTE: tl.constexpr, INTERPRETED: tl.constexpr,
    ALIGN: tl.constexpr = 16,
):  # fmt: skip
    """out[e] (M, N) = (a[:, rows of e] @ g[:, rows of e].T) * sa[e][:, None] * sg[e][None, :]:
    the weight gradient of transposed 8-bit operands, a (M, R) and g (N, R) with rows
    contiguous, their scales (E, M) and (E, N); out (E, M, N) contiguous. Persistent over every
    expert's (m, n) tiles; each 128-deep product promoted into the float32 sum, the rows outside
    the group masked to zero in both operands; an empty expert's tiles are exact zeros."""
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    m_tiles = tl.cdiv(M, BLOCK_M)
    n_tiles = tl.cdiv(N, BLOCK_N)
    per_expert = m_tiles * n_tiles
    steps = tl.arange(0, BLOCK_K)
    for tile in tl.range(pid, E * per_expert, num_programs):
        e = tile // per_expert
        local = tile - e * per_expert
        rows_m = (local // n_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols_n = (local % n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok = rows_m < M
        n_ok = cols_n < N
        start, size = _group_extent(sizes_ptr, e, E, R, BLOCK_E)
        # The chunks start at the group's first row rounded down to ALIGN, as the Gluon
        # kernel's TMA boxes must: the same 128-row products, so the same sums.
        lead = start % ALIGN
        span = tl.where(size > 0, lead + size, 0)
        a_rows = a_ptr + rows_m.to(tl.int64)[:, None] * stride_am
        g_rows = g_ptr + cols_n.to(tl.int64)[:, None] * stride_gn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, span, BLOCK_K):
            in_group = ((k + steps >= lead) & (k + steps < span))[None, :]
            r_at = (start - lead + k + steps)[None, :]
            a = tl.load(a_rows + r_at * stride_ar, mask=m_ok[:, None] & in_group, other=0.0)
            g = tl.load(g_rows + r_at * stride_gr, mask=n_ok[:, None] & in_group, other=0.0)
            acc = tl.dot(a, tl.trans(g), acc, max_num_imprecise_acc=PROMOTE)
        sa = tl.load(sa_ptr + e.to(tl.int64) * M + rows_m, mask=m_ok, other=0.0)
        sg = tl.load(sg_ptr + e.to(tl.int64) * N + cols_n, mask=n_ok, other=0.0)
        acc = acc * sa[:, None] * sg[None, :]
        acc = tl.where(size > 0, acc, 0.0)  # an empty expert's NaN scales must not leak
        c_ptrs = (c_ptr + e.to(tl.int64) * M * N + rows_m.to(tl.int64)[:, None] * N
                  + cols_n.to(tl.int64)[None, :])  # fmt: skip
        tl.store(c_ptrs, _rounded(acc, c_ptr.dtype.element_ty, INTERPRETED),
                 mask=m_ok[:, None] & n_ok[None, :])  # fmt: skip
