"""Grouped GEMM Triton kernels (MegaBlocks ``gmm`` semantics): the persistent forward kernel, the
weight-gradient kernel and their device helpers (tile swizzle, per-expert group sizes, tile
loads through pointers, gathered rows or TMA descriptors).

Kernels only; the host side (tile configs, plans, the op functions) is
:mod:`megablocks_triton.gmm`, whose docstring describes the design. The Hopper Gluon weight
gradient is :mod:`megablocks_triton.hopper_wgrad`.
"""

from __future__ import annotations

import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]


@triton.jit
def _swizzle(local, m_tiles, n_tiles, GROUP_M: tl.constexpr):
    """Tile index inside one expert -> (m-tile, n-tile), GROUP_M m-tiles at a time so programs
    running together reuse the same B columns from L2."""
    width = GROUP_M * n_tiles
    first_m = (local // width) * GROUP_M
    group_size = tl.minimum(m_tiles - first_m, GROUP_M)
    pid_m = first_m + (local % width) % group_size
    pid_n = (local % width) // group_size
    return pid_m, pid_n


@triton.jit
def _mma(a, b, acc, IEEE_FP32: tl.constexpr):
    """acc += a @ b. fp32 inputs use full-precision ieee (no TF32) to track a float64 reference;
    16-bit inputs take the default tensor-core path with fp32 accumulation."""
    if IEEE_FP32:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _gmm_tile_ptr(
    a_ptr, b_ptr, acc, e, row_start, size_e, rows, cols, N, K,
    stride_am, stride_ak, stride_be, stride_bk, stride_bn,
    BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, IEEE_FP32: tl.constexpr,
):  # fmt: skip
    """Portable K loop of one gmm tile (plain masked loads; NVIDIA, AMD, interpreter)."""
    offs_k0 = tl.arange(0, BLOCK_K)
    # Rows (a's strided dim) are clamped to the group's last row instead of masked: loads never
    # leave the group and need no row mask; the duplicated rows are dropped by the store mask.
    # The contiguous dims are masked, never clamped: a clamp (min) hides contiguity from the
    # compiler and turns the vectorised cp.async/global loads into scalar ones.
    rows_ld = (row_start + tl.minimum(rows, size_e - 1)).to(tl.int64)
    a_ptrs = a_ptr + rows_ld[:, None] * stride_am + offs_k0[None, :] * stride_ak
    b_ptrs = (b_ptr + e.to(tl.int64) * stride_be
              + offs_k0[:, None] * stride_bk + cols[None, :].to(tl.int64) * stride_bn)  # fmt: skip
    n_ok = (cols < N)[None, :]
    for k in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs, mask=n_ok, other=0.0)
        else:  # K masked on both: a's K tail would read the next row (or past the last one)
            k_ok = offs_k0 < K - k
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok, other=0.0)
        acc = _mma(a, b, acc, IEEE_FP32)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    return acc


@triton.jit
def _gmm_tile_gather(
    x_ptr, idx_ptr, b_ptr, acc, e, row_start, size_e, rows, cols, col0, num_ids, N, K, top_k,
    stride_xm, stride_xk, stride_be, stride_bk, stride_bn,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    IEEE_FP32: tl.constexpr, B_TMA: tl.constexpr, TRANS_B: tl.constexpr,
):  # fmt: skip
    """K loop of one gather_gmm tile: row i of the A tile is token row x[indices[i] // top_k],
    read in place (the gathered copy is never written). An id outside [0, num_ids) (tokens *
    top_k) reads nothing and gives a zero row. b is read with plain loads, or through a TMA
    descriptor (B_TMA)."""
    offs_k0 = tl.arange(0, BLOCK_K)
    sorted_rows = (row_start + tl.minimum(rows, size_e - 1)).to(tl.int64)
    flat = tl.load(idx_ptr + sorted_rows).to(tl.int64)
    named = (flat >= 0) & (flat < num_ids)
    tokens = tl.where(named, flat // top_k, 0)
    a_ptrs = x_ptr + tokens[:, None] * stride_xm + offs_k0[None, :] * stride_xk
    row_ok = named[:, None]
    if not B_TMA:
        b_ptrs = (b_ptr + e.to(tl.int64) * stride_be
                  + offs_k0[:, None] * stride_bk + cols[None, :].to(tl.int64) * stride_bn)  # fmt: skip
    n_ok = (cols < N)[None, :]
    for k in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok, other=0.0)
        else:
            k_ok = offs_k0 < K - k
            a = tl.load(a_ptrs, mask=row_ok & k_ok[None, :], other=0.0)
        if B_TMA:
            if TRANS_B:
                b = tl.trans(b_ptr.load([e, col0, k]).reshape(BLOCK_N, BLOCK_K))
            else:
                b = b_ptr.load([e, k, col0]).reshape(BLOCK_K, BLOCK_N)
        else:
            if EVEN_K:
                b = tl.load(b_ptrs, mask=n_ok, other=0.0)
            else:
                b = tl.load(b_ptrs, mask=(offs_k0 < K - k)[:, None] & n_ok, other=0.0)
            b_ptrs += BLOCK_K * stride_bk
        acc = _mma(a, b, acc, IEEE_FP32)
        a_ptrs += BLOCK_K * stride_xk
    return acc


@triton.jit
def _gmm_tile_tma(
    a_desc, b_desc, acc, e, row0, col0, K,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    IEEE_FP32: tl.constexpr, TRANS_B: tl.constexpr,
):  # fmt: skip
    """TMA K loop of one gmm tile (Hopper+). The descriptors' bounds zero-fill the K tail and rows
    past M; rows past the group end (inside M, i.e. the next group's) only reach rows the store
    drops. b's descriptor is 3-D so b[e]'s K tail is zero-filled, not read from b[e + 1]."""
    for k in range(0, K, BLOCK_K):
        a = a_desc.load([row0, k])
        if TRANS_B:
            b = tl.trans(b_desc.load([e, col0, k]).reshape(BLOCK_N, BLOCK_K))
        else:
            b = b_desc.load([e, k, col0]).reshape(BLOCK_K, BLOCK_N)
        acc = _mma(a, b, acc, IEEE_FP32)
    return acc


@triton.jit
def _group_sizes(sizes_ptr, E, M, BLOCK_E: tl.constexpr, FROM_ENDS: tl.constexpr = False):
    """Per-expert row counts as the kernels use them (int32, BLOCK_E lanes, 0 past E).

    FROM_ENDS: sizes_ptr holds cumulative ends (``bins``), sizes are their differences.
    Device-side batch_sizes are not checked outside checked mode, so they are made safe here,
    for the cost of a few register ops: a negative size counts as 0, and groups are cut at a's
    last row (rows past M are never addressed). Returns (sizes, rows covered by the groups)."""
    e_idx = tl.arange(0, BLOCK_E)
    raw = tl.load(sizes_ptr + e_idx, mask=e_idx < E, other=0).to(tl.int64)
    if FROM_ENDS:
        before = tl.load(sizes_ptr + e_idx - 1, mask=(e_idx >= 1) & (e_idx < E), other=0)
        raw = raw - before.to(tl.int64)
    raw = tl.minimum(tl.maximum(raw, 0), M)  # cumsum of <= 4096 values <= M fits int64
    ends = tl.cumsum(raw, 0)
    sizes = tl.minimum(ends, M) - tl.minimum(ends - raw, M)
    return sizes.to(tl.int32), tl.minimum(tl.sum(raw, 0), M).to(tl.int32)


@triton.jit
def _gmm_kernel(
    a_ptr, b_ptr, c_ptr, sizes_ptr, idx_ptr, bias_ptr,
    M, N, K, E, top_k, num_ids,
    stride_am, stride_ak,
    stride_be, stride_bk, stride_bn,
    stride_cm, stride_cn, stride_bias,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, IEEE_FP32: tl.constexpr, USE_TMA: tl.constexpr, TRANS_B: tl.constexpr,
    GATHER: tl.constexpr = False, FROM_ENDS: tl.constexpr = False, FLATTEN: tl.constexpr = False,
    ZERO_TAIL: tl.constexpr = True, HAS_BIAS: tl.constexpr = False,
):  # fmt: skip
    # USE_TMA: a_ptr is a (M, K) TensorDescriptor and b_ptr a 3-D one over b's storage
    # ((E, K, N), or (E, N, K) when TRANS_B); the strides are then unused.
    # GATHER (gather_gmm): a_ptr is the token rows x and A's row i is x[idx[i] // top_k] (ids in
    # [0, num_ids): M may be fewer rows, the first of them); with USE_TMA only b goes through a
    # descriptor. FROM_ENDS: sizes_ptr holds bins (cumulative).
    # HAS_BIAS: bias_ptr is the per-expert bias (E, N), rows stride_bias apart, unit column
    # stride: the epilogue adds bias[e] to the float32 accumulator of expert e's rows before the
    # one rounding (rows of no group get none). Otherwise bias_ptr is unused.
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)  # runtime, so the grid size never forces a recompile
    # Per-expert sizes and tile-count prefix, built once per program (device side: no host sync).
    e_idx = tl.arange(0, BLOCK_E)
    sizes, covered = _group_sizes(sizes_ptr, E, M, BLOCK_E, FROM_ENDS)
    n_tiles = tl.cdiv(N, BLOCK_N)
    tiles = tl.cdiv(sizes, BLOCK_M) * n_tiles
    tile_end = tl.cumsum(tiles, 0)  # inclusive prefix: tiles of experts 0..e
    group_tiles = tl.sum(tiles, 0)
    # Rows [covered, M) belong to no group (batch_sizes summing to less than M): zero tiles,
    # none at all on valid input. Not ZERO_TAIL (gmm_scatter's private product rows, whose
    # reduction never reads them): left unwritten.
    total_tiles = group_tiles
    if ZERO_TAIL:
        total_tiles += tl.cdiv(M - covered, BLOCK_M) * n_tiles

    for tile in tl.range(pid, group_tiles, num_programs, flatten=FLATTEN):
        # Experts wholly before this tile (empty experts included) give the expert id and bases.
        before = tile_end <= tile
        e = tl.sum(before.to(tl.int32), 0)
        row_start = tl.sum(tl.where(before, sizes, 0), 0)
        tile_base = tl.sum(tl.where(before, tiles, 0), 0)
        size_e = tl.sum(tl.where(e_idx == e, sizes, 0), 0)
        pid_m, pid_n = _swizzle(tile - tile_base, tl.cdiv(size_e, BLOCK_M), n_tiles, GROUP_M)

        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if GATHER:
            acc = _gmm_tile_gather(
                a_ptr, idx_ptr, b_ptr, acc, e, row_start, size_e, rows, cols, pid_n * BLOCK_N,
                num_ids, N, K, top_k,
                stride_am, stride_ak, stride_be, stride_bk, stride_bn,
                BLOCK_N, BLOCK_K, EVEN_K, IEEE_FP32, USE_TMA, TRANS_B,
            )  # fmt: skip
        elif USE_TMA:
            acc = _gmm_tile_tma(
                a_ptr, b_ptr, acc, e, row_start + pid_m * BLOCK_M, pid_n * BLOCK_N, K,
                BLOCK_M, BLOCK_N, BLOCK_K, IEEE_FP32, TRANS_B,
            )  # fmt: skip
        else:
            acc = _gmm_tile_ptr(
                a_ptr, b_ptr, acc, e, row_start, size_e, rows, cols, N, K,
                stride_am, stride_ak, stride_be, stride_bk, stride_bn,
                BLOCK_K, EVEN_K, IEEE_FP32,
            )  # fmt: skip

        if HAS_BIAS:
            bias_row = bias_ptr + e.to(tl.int64) * stride_bias
            acc += tl.load(bias_row + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        out_rows = (row_start + rows).to(tl.int64)
        c_ptrs = c_ptr + out_rows[:, None] * stride_cm + cols[None, :].to(tl.int64) * stride_cn
        c_mask = (rows < size_e)[:, None] & (cols < N)[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)

    # The uncovered rows' tiles follow the groups' in the same strided order.
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
def _wgrad_tile_tma(
    a_desc, g_desc, a_ptr, g_ptr, acc, row_start, size_e, rows, cols, col_a, col_g, KA, N,
    stride_am, stride_ak, stride_gm, stride_gn,
    BLOCK_K: tl.constexpr, IEEE_FP32: tl.constexpr,
):  # fmt: skip
    """Token loop of one weight-gradient tile through TMA (Hopper+): the group's whole BLOCK_K
    chunks unmasked through the descriptors, then its last partial chunk with masked loads (a
    descriptor cannot stop at the group end: the rows after it are another group's, or
    uninitialised)."""
    full = (size_e // BLOCK_K) * BLOCK_K
    for t in range(0, full, BLOCK_K):
        a = a_desc.load([row_start + t, col_a])
        g = g_desc.load([row_start + t, col_g])
        acc = _mma(tl.trans(a), g, acc, IEEE_FP32)
    if full < size_e:
        offs_t = tl.arange(0, BLOCK_K)
        toks = (row_start + full).to(tl.int64) + offs_t
        t_ok = (offs_t < size_e - full)[:, None]
        a_ptrs = a_ptr + toks[:, None] * stride_am + rows[None, :].to(tl.int64) * stride_ak
        g_ptrs = g_ptr + toks[:, None] * stride_gm + cols[None, :].to(tl.int64) * stride_gn
        a = tl.load(a_ptrs, mask=t_ok & (rows < KA)[None, :], other=0.0)
        g = tl.load(g_ptrs, mask=t_ok & (cols < N)[None, :], other=0.0)
        acc = _mma(tl.trans(a), g, acc, IEEE_FP32)
    return acc


@triton.jit
def _gmm_wgrad_kernel(
    a_ptr, g_ptr, c_ptr, sizes_ptr, a_desc, g_desc, c_desc,
    M, KA, N, E,
    stride_am, stride_ak,
    stride_gm, stride_gn,
    stride_ce, stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr, GROUP_M: tl.constexpr,
    IEEE_FP32: tl.constexpr, ACCUMULATE: tl.constexpr = False, TMA: tl.constexpr = False,
    REDUCE: tl.constexpr = False,
):  # fmt: skip
    # ACCUMULATE (gmm_weight_grad_accumulate): c holds a gradient to add to (its own dtype, e.g. a
    # float32 main_grad for 16-bit a): the epilogue adds it to the float32 accumulator and rounds
    # once; an empty expert's tiles are neither read nor written.
    # TMA (with ACCUMULATE): a_desc / g_desc are (M, KA) / (M, N) descriptors of a and grad, c_desc
    # a 3-D (E, KA, N) one of c: the loads go through the descriptors (:func:`_wgrad_tile_tma`)
    # and the epilogue reads and writes c's tile through c_desc, asynchronous copies that leave
    # the warps free sooner. Otherwise the *_desc arguments are unused.
    # REDUCE (with TMA): the epilogue rounds the tile to c's dtype and adds it to c with a TMA
    # reduction (done by the memory system, asynchronous): the program goes on to its next tile
    # at once instead of waiting for c's tile to arrive.
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)  # runtime, so the grid size never forces a recompile
    e_idx = tl.arange(0, BLOCK_E)
    sizes, _ = _group_sizes(sizes_ptr, E, M, BLOCK_E)
    m_tiles = tl.cdiv(KA, BLOCK_M)
    n_tiles = tl.cdiv(N, BLOCK_N)
    tiles_per_e = m_tiles * n_tiles
    offs_t0 = tl.arange(0, BLOCK_K)

    # Expert-major tile order: programs running together work on the same expert's rows (L2).
    for tile in range(pid, E * tiles_per_e, num_programs):
        e = tile // tiles_per_e
        row_start = tl.sum(tl.where(e_idx < e, sizes, 0), 0)
        size_e = tl.sum(tl.where(e_idx == e, sizes, 0), 0)
        pid_m, pid_n = _swizzle(tile - e * tiles_per_e, m_tiles, n_tiles, GROUP_M)

        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # columns of a = output rows
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # columns of grad
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if TMA:
            acc = _wgrad_tile_tma(
                a_desc, g_desc, a_ptr, g_ptr, acc, row_start, size_e, rows, cols,
                pid_m * BLOCK_M, pid_n * BLOCK_N, KA, N,
                stride_am, stride_ak, stride_gm, stride_gn, BLOCK_K, IEEE_FP32,
            )  # fmt: skip
            if size_e > 0:  # (always ACCUMULATE) the descriptor's bounds clip the tile at KA, N
                at = [e, pid_m * BLOCK_M, pid_n * BLOCK_N]
                if REDUCE:
                    c_desc.atomic_add(at, acc.to(c_desc.dtype).reshape(1, BLOCK_M, BLOCK_N))
                else:
                    prev = c_desc.load(at).reshape(BLOCK_M, BLOCK_N).to(tl.float32)
                    c_desc.store(at, (acc + prev).to(c_desc.dtype).reshape(1, BLOCK_M, BLOCK_N))
        else:
            toks0 = row_start.to(tl.int64) + offs_t0
            # a^T tile loaded as (BLOCK_K tokens, BLOCK_M), contiguous along a's rows, then
            # transposed.
            a_ptrs = a_ptr + toks0[:, None] * stride_am + rows[None, :].to(tl.int64) * stride_ak
            g_ptrs = g_ptr + toks0[:, None] * stride_gm + cols[None, :].to(tl.int64) * stride_gn
            m_ok = (rows < KA)[None, :]
            n_ok = (cols < N)[None, :]
            # An empty group runs zero iterations and stores exact zeros.
            for t in range(0, size_e, BLOCK_K):
                # Tokens masked on both operands: rows past the group end are never read (they
                # may be another group's rows, or uninitialised memory of a worst-case buffer,
                # NaN included).
                t_ok = (offs_t0 < size_e - t)[:, None]
                a = tl.load(a_ptrs, mask=t_ok & m_ok, other=0.0)
                g = tl.load(g_ptrs, mask=t_ok & n_ok, other=0.0)
                acc = _mma(tl.trans(a), g, acc, IEEE_FP32)
                a_ptrs += BLOCK_K * stride_am
                g_ptrs += BLOCK_K * stride_gm

            c_ptrs = (c_ptr + e.to(tl.int64) * stride_ce + rows[:, None].to(tl.int64) * stride_cm
                      + cols[None, :].to(tl.int64) * stride_cn)  # fmt: skip
            c_mask = (rows < KA)[:, None] & (cols < N)[None, :]
            if ACCUMULATE:
                if size_e > 0:
                    prev = tl.load(c_ptrs, mask=c_mask, other=0.0).to(tl.float32)
                    tl.store(c_ptrs, (acc + prev).to(c_ptr.dtype.element_ty), mask=c_mask)
            else:
                tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)
