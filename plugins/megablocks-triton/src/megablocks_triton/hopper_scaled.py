"""The FP8 rowwise grouped GEMM on Hopper, warp-specialized, its promotion overlapped (Gluon).

``out[rows of e] = (a[rows of e] @ b[e].T) * a_scale[row] * b_scale[e, col]``: ``scaled_gmm``
and ``scaled_gather_gmm`` of format ``fp8_rowwise`` (b stored (E, n, k), k contiguous, as every
FP8 recipe quantizes its weights), and the GEMM half of ``scaled_gmm_scatter``. The contract
promotes the float32 sum at least every 128 k (Hopper's FP8 MMA keeps a narrower sum). Triton's
promotion (``max_num_imprecise_acc``) waits for each 128-deep product before adding it, so the
matrix unit idles during the adds. Here each 128-deep product goes to a fresh accumulator,
asynchronously, and the previous one is added while the matrix unit computes it:

* a *loader* partition walks the program's tiles and fills a ring of shared-memory stages,
  running ahead across tiles: B's columns by TMA, A's rows by TMA (one warp) or, gathered
  (row i of the output reads token ``ids[i] // top_k``), by 16-byte ``cp.async`` copies of its
  four warps, each arriving on the stage's barrier when it lands (no row gather in Hopper's TMA);
* eight *MMA* warps (two warpgroups, 64 rows each of a 128 x 128 tile) keep two products in
  flight (plain rowwise rows; gathered and blockwise rows one: their loop holds one register set
  for the products, see _mma_and_epilogue), add the older to the tile's float32 sum and free its
  stage; a tile's epilogue (both scales, which the loader stages in shared memory for plain
  rows, the expert's bias where given, the rounding, a TMA store inside the group or masked
  stores for a group's last, partial tile; zeros for the rows past every group when asked) runs
  while the next tile's first product computes.

The sums are the Triton kernel's (same 128-deep products, same order): outputs equal bit for bit
with its 128 x 128 x 128 tiles. Hopper only, rowwise only; which calls it takes is
:func:`megablocks_triton.scaled._warp_specialized`'s rule, the Triton kernel serves the rest.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from triton.experimental import gluon  # type: ignore[import-untyped]
from triton.experimental.gluon import language as gl  # type: ignore[import-untyped]
from triton.experimental.gluon.language.nvidia.ampere import (  # type: ignore[import-untyped]
    async_copy,
)
from triton.experimental.gluon.language.nvidia.hopper import (  # type: ignore[import-untyped]
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # type: ignore[import-untyped]

from .launch import launch as launch_kernel

#: 128 x 128 tiles, 128-deep K steps: one scale block of the blockwise format a step and an n tile.
BLOCK_M, BLOCK_N, BLOCK_K = 128, 128, 128
MMA_WARPS = 8
LOADER_REGISTERS = 56
#: Tiles whose epilogue scales the loader stages ahead (plain rowwise rows).
SCALE_SLOTS = gl.constexpr(4)
#: Gathered rows are copied by the loader's threads (cp.async, 16 bytes each), not by TMA.
GATHER_LOADER_WARPS = 4
GATHER_LOADER_REGISTERS = 72  # 64 spilled at the training shapes (the compile gate)
#: Shared memory for operand stages: what the 227 KiB leave beside the output tile.
SHARED_BYTES = 220 * 1024
_FP8 = {torch.float8_e4m3fn: gl.float8e4nv}
_OUT = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}


@gluon.jit
def _add(x, y):
    return x + y


@gluon.jit
def _groups(sizes_ptr, num_experts, rows, n_tiles, block_m: gl.constexpr,
            FROM_ENDS: gl.constexpr, BLOCK_E: gl.constexpr, layout: gl.constexpr):  # fmt: skip
    # Each expert's row count made safe as the Triton kernels' _group_sizes makes them (negative
    # counts as 0, groups cut at a's last row), its tiles and their running end.
    idx = gl.arange(0, BLOCK_E, layout=layout)
    raw = gl.load(sizes_ptr + idx, mask=idx < num_experts, other=0).to(gl.int64)
    if FROM_ENDS:
        before = gl.load(sizes_ptr + idx - 1, mask=(idx >= 1) & (idx < num_experts), other=0)
        raw = raw - before.to(gl.int64)
    raw = gl.minimum(gl.maximum(raw, 0), rows)
    ends = gl.associative_scan(raw, 0, _add)
    sizes = (gl.minimum(ends, rows) - gl.minimum(ends - raw, rows)).to(gl.int32)
    covered = gl.minimum(gl.sum(raw, 0), rows).to(gl.int32)
    tiles = gl.cdiv(sizes, block_m) * n_tiles
    tile_end = gl.associative_scan(tiles, 0, _add)
    return idx, sizes, tiles, tile_end, covered


@gluon.jit
def _tile(tile, idx, sizes, tiles, tile_end, n_tiles, block_m: gl.constexpr,
          GROUP_M: gl.constexpr):  # fmt: skip
    # (expert, its first row, its row count, m-tile, n-tile) of a group tile. Inside an expert,
    # GROUP_M m-tiles at a time walk the n-tiles (as the Triton kernels' _swizzle): programs
    # running together share A's rows and B's columns in L2.
    before = tile_end <= tile
    e = gl.sum(before.to(gl.int32), 0)
    row_start = gl.sum(gl.where(before, sizes, 0), 0)
    local = tile - gl.sum(gl.where(before, tiles, 0), 0)
    size = gl.sum(gl.where(idx == e, sizes, 0), 0)
    width = GROUP_M * n_tiles
    first_m = (local // width) * GROUP_M
    group = gl.minimum(gl.cdiv(size, block_m) - first_m, GROUP_M)
    tile_m = first_m + (local % width) % group
    return e, row_start, size, tile_m, (local % width) // group


@gluon.jit
def _loader(a_desc, b_desc, a_bufs, b_bufs, empty, ready, sizes_ptr, num_experts, rows, n, k,
            x_ptr, stride_x, ids_ptr, top_k, num_ids, scales, FROM_ENDS: gl.constexpr,
            BLOCK_E: gl.constexpr, GROUP_M: gl.constexpr, GATHER: gl.constexpr,
            BLOCKWISE: gl.constexpr, LOADER_WARPS: gl.constexpr):  # fmt: skip
    block_m: gl.constexpr = a_desc.block_type.shape[0]
    block_k: gl.constexpr = a_desc.block_type.shape[1]
    block_n: gl.constexpr = b_desc.block_type.shape[0]
    stages: gl.constexpr = a_bufs.type.shape[0]
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [LOADER_WARPS], [0])
    # Gathered rows: 16 bytes a thread, a row's 128 bytes across 8 threads.
    rows_layout: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [LOADER_WARPS, 1], [1, 0])
    n_tiles = gl.cdiv(n, block_n)
    idx, sizes, tiles, tile_end, _ = _groups(
        sizes_ptr, num_experts, rows, n_tiles, block_m, FROM_ENDS, BLOCK_E, layout
    )
    group_tiles = gl.sum(tiles, 0)
    step = 0
    for tile in range(gl.program_id(0), group_tiles, gl.num_programs(0)):
        e, row_start, size, tile_m, tile_n = _tile(
            tile, idx, sizes, tiles, tile_end, n_tiles, block_m, GROUP_M
        )
        row = row_start + tile_m * block_m
        col = e * n + tile_n * block_n  # b seen as (E * n, k)
        if not GATHER and not BLOCKWISE:
            _copy_scales((tile - gl.program_id(0)) // gl.num_programs(0), e, row_start, size,
                         tile_m, tile_n, n, scales, layout)  # fmt: skip
        if GATHER:  # each sorted row reads token ids[row] // top_k of x (none past its group)
            local = tile_m * block_m + gl.arange(0, block_m, layout=gl.SliceLayout(1, rows_layout))
            ids = gl.load(ids_ptr + row_start + gl.minimum(local, size - 1)).to(gl.int64)
            named = (local < size) & (ids >= 0) & (ids < num_ids)
            token = gl.where(named, ids // top_k, 0)
            cols = gl.arange(0, block_k, layout=gl.SliceLayout(0, rows_layout))
            x_rows = x_ptr + token[:, None] * stride_x + cols[None, :]
        for kk in range(0, k, block_k):
            slot = step % stages
            mbarrier.wait(empty.index(slot), ((step // stages) & 1) ^ 1)
            bar = ready.index(slot)
            if GATHER:
                # Each thread's copies arrive on the stage's barrier when they land (its count
                # holds one arrival a loader thread, beside the expect's).
                in_k = (cols + kk < k)[None, :]
                async_copy.async_copy_global_to_shared(
                    a_bufs.index(slot), x_rows + kk, mask=named[:, None] & in_k
                )
                async_copy.mbarrier_arrive(bar, increment_count=False)
                mbarrier.expect(bar, b_desc.block_type.nbytes)
            else:
                mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(a_desc, [row, kk], bar, a_bufs.index(slot))
            tma.async_copy_global_to_shared(b_desc, [col, kk], bar, b_bufs.index(slot))
            step += 1


@gluon.jit
def _row_scales(tile, idx, sizes, tiles, tile_end, n_tiles, stride_sa, stride_sbe, stride_sbn,
                block_m: gl.constexpr, GROUP_M: gl.constexpr,
                layout: gl.constexpr):  # fmt: skip
    # Blockwise (plain rows only): the offsets of a tile's rows' scales (rows clamped into the
    # group) and of its column block's, at k block 0.
    e, row_start, size, tile_m, tile_n = _tile(tile, idx, sizes, tiles, tile_end, n_tiles,
                                               block_m, GROUP_M)  # fmt: skip
    rows = row_start + gl.minimum(tile_m * block_m + gl.arange(0, block_m, layout=layout), size - 1)
    return rows.to(gl.int64) * stride_sa, e.to(gl.int64) * stride_sbe + tile_n * stride_sbn


@gluon.jit
def _bias_row(bias_ptr, e, stride_bias, cols, n):
    # Expert e's bias at the tile's columns (0 past n).
    return gl.load(bias_ptr + e.to(gl.int64) * stride_bias + cols, mask=cols < n, other=0.0)


@gluon.jit
def _epilogue(acc, tile, idx, sizes, tiles, tile_end, n_tiles, c_smem, c_desc, c_ptr, sa_ptr,
              sb_ptr, n, stride_sa, stride_sbe, stride_sbn, ids_ptr, top_k, num_ids,
              GROUP_M: gl.constexpr, GATHER: gl.constexpr, BLOCKWISE: gl.constexpr,
              store_layout: gl.constexpr, bias_ptr, stride_bias, HAS_BIAS: gl.constexpr,
              staged=None):  # fmt: skip
    # The tile's sum times both scales (rows clamped into the group: rows past it are not
    # stored; blockwise sums are scaled already), plus its expert's bias (HAS_BIAS), rounded,
    # staged in shared memory and stored.
    # staged: (ring, its barriers, the tile's index t in the program) where the loader copied
    # the plain rows' scales (_copy_scales).
    block_m: gl.constexpr = c_smem.type.shape[0]
    block_n: gl.constexpr = c_smem.type.shape[1]
    e, row_start, size, tile_m, tile_n = _tile(tile, idx, sizes, tiles, tile_end, n_tiles,
                                               block_m, GROUP_M)  # fmt: skip
    first = tile_m * block_m
    acc_rows = gl.arange(0, block_m, layout=gl.SliceLayout(1, acc.type.layout))
    acc_cols = gl.arange(0, block_n, layout=gl.SliceLayout(0, acc.type.layout))
    a_rows = row_start + gl.minimum(first + acc_rows, size - 1)
    if GATHER:  # a gathered row's scale is its token's; an unnamed row's (NaN) must not leak
        ids = gl.load(ids_ptr + a_rows).to(gl.int64)
        named = (ids >= 0) & (ids < num_ids)
    bias_cols = tile_n * block_n + acc_cols
    if HAS_BIAS and staged is not None:  # first: its latency under the wait for the scales
        bias_row = _bias_row(bias_ptr, e, stride_bias, bias_cols, n)
    if BLOCKWISE:
        scaled = acc
    elif staged is not None:
        scale_smem, scale_ready, _empty, t = staged
        slot = t % scale_ready.type.shape[0]
        mbarrier.wait(scale_ready.index(slot), (t // scale_ready.type.shape[0]) & 1)
        sa = scale_smem.index(2 * slot).load(gl.SliceLayout(1, acc.type.layout))
        sb = scale_smem.index(2 * slot + 1).load(gl.SliceLayout(0, acc.type.layout))
        scaled = acc * sa[:, None] * sb[None, :]
    else:
        if GATHER:
            sa = gl.load(sa_ptr + gl.where(named, ids // top_k, 0) * stride_sa)
        else:
            sa = gl.load(sa_ptr + a_rows.to(gl.int64) * stride_sa)
        cols = tile_n * block_n + acc_cols
        sb = gl.load(sb_ptr + e.to(gl.int64) * stride_sbe + cols * stride_sbn, mask=cols < n,
                     other=0.0)  # fmt: skip
        scaled = acc * sa[:, None] * sb[None, :]
    if GATHER:
        scaled = gl.where(named[:, None], scaled, 0.0)
    if HAS_BIAS:  # after the masking, as the Triton kernel: an unnamed row gets it too
        if staged is None:  # (gathered rows: loaded here, kept from their loads' registers)
            bias_row = _bias_row(bias_ptr, e, stride_bias, bias_cols, n)
        # Added after the scaled sum's rounding, not fused into its last product (an FMA): the
        # Triton kernel's two roundings, so that both give the same bits.
        bias_tile, scaled = gl.broadcast(bias_row.to(gl.float32)[None, :], scaled)
        scaled = gl.inline_asm_elementwise("add.rn.f32 $0, $1, $2;", "=r,r,r", [scaled, bias_tile],
                                           dtype=gl.float32, is_pure=True, pack=1)  # fmt: skip
    result = scaled.to(c_smem.dtype)
    tma.store_wait(0)  # the previous tile's store has read c_smem
    gl.thread_barrier()  # and every warp's loads of it (and of the staged scales) are done
    if staged is not None:  # the scales' slot is free for the loader
        mbarrier.arrive(staged[2].index(staged[3] % staged[2].type.shape[0]), count=1)
    c_smem.store(result)
    fence_async_shared()
    gl.thread_barrier()
    if first + block_m <= size:
        tma.async_copy_shared_to_global(c_desc, [row_start + first, tile_n * block_n], c_smem)
    else:  # the group's last tile: only its rows (a box cannot stop at the group's end)
        values = c_smem.load(store_layout)
        r = first + gl.arange(0, block_m, layout=gl.SliceLayout(1, store_layout))
        c = tile_n * block_n + gl.arange(0, block_n, layout=gl.SliceLayout(0, store_layout))
        ptrs = c_ptr + (row_start + r).to(gl.int64)[:, None] * n + c[None, :]
        gl.store(ptrs, values, mask=(r < size)[:, None] & (c < n)[None, :])


@gluon.jit
def _copy_scales(t, e, row_start, size, tile_m, tile_n, n, scales, layout: gl.constexpr):
    # Plain rowwise rows: the loader copies its t-th tile's row and column scales (rows clamped
    # into the group) into a slot of the scales' ring by cp.async, arriving on the slot's
    # barrier when they land, so that the epilogue reads them from shared memory.
    sa_ptr, sb_ptr, stride_sa, stride_sbe, stride_sbn, scale_smem, scale_ready, scale_empty = scales
    slots: gl.constexpr = scale_ready.type.shape[0]
    block: gl.constexpr = scale_smem.type.shape[1]
    slot = t % slots
    mbarrier.wait(scale_empty.index(slot), ((t // slots) & 1) ^ 1)
    r = row_start + gl.minimum(tile_m * block + gl.arange(0, block, layout=layout), size - 1)
    async_copy.async_copy_global_to_shared(scale_smem.index(2 * slot),
                                           sa_ptr + r.to(gl.int64) * stride_sa)  # fmt: skip
    cols = tile_n * block + gl.arange(0, block, layout=layout)
    async_copy.async_copy_global_to_shared(scale_smem.index(2 * slot + 1),
                                           sb_ptr + e.to(gl.int64) * stride_sbe + cols * stride_sbn,
                                           mask=cols < n)  # fmt: skip
    async_copy.mbarrier_arrive(scale_ready.index(slot), increment_count=False)


@gluon.jit
def _issue(a_bufs, b_bufs, ready, step, zero):
    # Plain rowwise rows: a step's product, a fresh sum (promoted into the float32 total when
    # retired), issued once its stage has landed.
    stages: gl.constexpr = a_bufs.type.shape[0]
    slot = step % stages
    mbarrier.wait(ready.index(slot), (step // stages) & 1)
    return warpgroup_mma(a_bufs.index(slot), b_bufs.index(slot).permute((1, 0)), zero,
                         use_acc=False, is_async=True)  # fmt: skip


@gluon.jit
def _retire(acc, done, step, empty, tiling, out, scales, GROUP_M: gl.constexpr,
            HAS_BIAS: gl.constexpr, store_layout: gl.constexpr):  # fmt: skip
    # Plain rowwise rows: a finished step's product added into acc, its stage freed for the
    # loader and, after its tile's last step, the tile's epilogue (its scales staged by the
    # loader). tiling: the program's (pid, programs, chunks) and _groups' tiles; out and
    # scales: the epilogue's operands.
    pid, programs, chunks, idx, sizes, tiles, tile_end, n_tiles = tiling
    c_smem, scale_smem, scale_ready, scale_empty, c_desc, c_ptr, n, bias_ptr, stride_bias = out
    sa_ptr, sb_ptr, stride_sa, stride_sbe, stride_sbn, ids_ptr, top_k, num_ids = scales
    acc = acc + done
    mbarrier.arrive(empty.index(step % empty.type.shape[0]), count=1)
    if (step + 1) % chunks == 0:  # its tile's last
        t = step // chunks
        _epilogue(acc, pid + t * programs, idx, sizes, tiles, tile_end, n_tiles, c_smem, c_desc,
                  c_ptr, sa_ptr, sb_ptr, n, stride_sa, stride_sbe, stride_sbn, ids_ptr, top_k,
                  num_ids, GROUP_M, False, False, store_layout, bias_ptr, stride_bias, HAS_BIAS,
                  (scale_smem, scale_ready, scale_empty, t))  # fmt: skip
        acc = gl.zeros_like(acc)
    return acc


@gluon.jit
def _mma_and_epilogue(a_bufs, b_bufs, empty, ready, c_smem, staging, c_desc, c_ptr, sa_ptr,
                      sb_ptr, sizes_ptr, num_experts, rows, n, k, stride_sa, stride_sak, stride_sbe,
                      stride_sbn, stride_sbk, ids_ptr, top_k, num_ids, bias_ptr, stride_bias,
                      FROM_ENDS: gl.constexpr, ZERO_TAIL: gl.constexpr, BLOCK_E: gl.constexpr,
                      GROUP_M: gl.constexpr, GATHER: gl.constexpr, BLOCKWISE: gl.constexpr,
                      HAS_BIAS: gl.constexpr, num_warps: gl.constexpr):  # fmt: skip
    block_m: gl.constexpr = c_smem.type.shape[0]
    block_n: gl.constexpr = c_smem.type.shape[1]
    block_k: gl.constexpr = a_bufs.type.shape[2]
    stages: gl.constexpr = a_bufs.type.shape[0]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, block_n, 32]
    )
    # The experts' counts whole in each warp where registers allow (plain rows, up to 128
    # experts): a tile's coordinates (_tile's sums over them) then take no barrier.
    warp_local: gl.constexpr = BLOCK_E <= 128 and not BLOCKWISE
    sizes_layout: gl.constexpr = gl.BlockedLayout(
        [max(BLOCK_E // 32, 1) if warp_local else 1], [32], [num_warps], [0]
    )
    store_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    n_tiles = gl.cdiv(n, block_n)
    idx, sizes, tiles, tile_end, covered = _groups(
        sizes_ptr, num_experts, rows, n_tiles, block_m, FROM_ENDS, BLOCK_E, sizes_layout
    )
    group_tiles = gl.sum(tiles, 0)
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    chunks = gl.cdiv(k, block_k)  # every tile reduces over all of k
    zero = gl.zeros([block_m, block_n], gl.float32, acc_layout)
    rows_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
    if pid < group_tiles:
        # The program's tiles' chunks as one sequence of steps. Each step's product (a fresh
        # sum over 128 k) is issued before the one before it is added into acc: two products in
        # flight, the adds off the matrix unit's path; a tile's epilogue runs while the next
        # tile's first product computes.
        steps = gl.cdiv(group_tiles - pid, programs) * chunks
        if not GATHER and not BLOCKWISE:
            # The steps in pairs, their products in two register sets. Carried from step to
            # step in one set, the product in flight would have to be copied out before the
            # next one writes those registers: ptxas waits for it first (its note C7517), and
            # one product is in flight. Gathered and blockwise rows keep the one set (paired,
            # they spill; measured slower or no faster: docs/performance.md).
            tiling = (pid, programs, chunks, idx, sizes, tiles, tile_end, n_tiles)
            out = (c_smem, staging[0], staging[1], staging[2], c_desc, c_ptr, n, bias_ptr,
                   stride_bias)  # fmt: skip
            scales = (sa_ptr, sb_ptr, stride_sa, stride_sbe, stride_sbn, ids_ptr, top_k, num_ids)
            acc = zero
            prev = _issue(a_bufs, b_bufs, ready, 0, zero)
            for step in range(1, steps - 1, 2):
                part = _issue(a_bufs, b_bufs, ready, step, zero)
                done = warpgroup_mma_wait(num_outstanding=1, deps=(prev,))
                acc = _retire(acc, done, step - 1, empty, tiling, out, scales, GROUP_M,
                              HAS_BIAS, store_layout)  # fmt: skip
                prev = _issue(a_bufs, b_bufs, ready, step + 1, zero)
                done = warpgroup_mma_wait(num_outstanding=1, deps=(part,))
                acc = _retire(acc, done, step, empty, tiling, out, scales, GROUP_M,
                              HAS_BIAS, store_layout)  # fmt: skip
            if (steps - 1) % 2 == 1:  # one step left past the pairs
                part = _issue(a_bufs, b_bufs, ready, steps - 1, zero)
                done = warpgroup_mma_wait(num_outstanding=1, deps=(prev,))
                acc = _retire(acc, done, steps - 2, empty, tiling, out, scales, GROUP_M,
                              HAS_BIAS, store_layout)  # fmt: skip
                done = warpgroup_mma_wait(num_outstanding=0, deps=(part,))
                _retire(acc, done, steps - 1, empty, tiling, out, scales, GROUP_M, HAS_BIAS,
                        store_layout)  # fmt: skip
            else:
                done = warpgroup_mma_wait(num_outstanding=0, deps=(prev,))
                _retire(acc, done, steps - 1, empty, tiling, out, scales, GROUP_M, HAS_BIAS,
                        store_layout)  # fmt: skip
        else:
            mbarrier.wait(ready.index(0), 0)
            if GATHER:  # rows copied by cp.async (the generic proxy), read by the MMA (async proxy)
                fence_async_shared()
            prev = warpgroup_mma(a_bufs.index(0), b_bufs.index(0).permute((1, 0)), zero,
                                 use_acc=False, is_async=True)  # fmt: skip
            acc = zero
            if BLOCKWISE:  # each product times its k block's scales; loaded a step ahead of use
                sa_at, sb_at = _row_scales(pid, idx, sizes, tiles, tile_end, n_tiles, stride_sa,
                                           stride_sbe, stride_sbn, block_m, GROUP_M,
                                           rows_layout)  # fmt: skip
                sa_prev = gl.load(sa_ptr + sa_at)
                sb_prev = gl.load(sb_ptr + sb_at)
            for step in range(1, steps):
                slot = step % stages
                mbarrier.wait(ready.index(slot), (step // stages) & 1)
                if GATHER:
                    fence_async_shared()
                part = warpgroup_mma(a_bufs.index(slot), b_bufs.index(slot).permute((1, 0)), zero,
                                     use_acc=False, is_async=True)  # fmt: skip
                if BLOCKWISE:
                    kb = step % chunks
                    if kb == 0:  # a new tile's rows
                        sa_at, sb_at = _row_scales(pid + (step // chunks) * programs, idx, sizes,
                                                   tiles, tile_end, n_tiles, stride_sa, stride_sbe,
                                                   stride_sbn, block_m, GROUP_M,
                                                   rows_layout)  # fmt: skip
                    sa_next = gl.load(sa_ptr + sa_at + kb * stride_sak)
                    sb_next = gl.load(sb_ptr + sb_at + kb * stride_sbk)
                done = warpgroup_mma_wait(num_outstanding=1, deps=(prev,))
                if BLOCKWISE:
                    acc = acc + done * (sa_prev[:, None] * sb_prev)
                    sa_prev = sa_next
                    sb_prev = sb_next
                else:
                    acc = acc + done
                mbarrier.arrive(empty.index((step + stages - 1) % stages), count=1)
                prev = part
                if step % chunks == 0:  # the step before was its tile's last
                    tile = pid + (step // chunks - 1) * programs
                    _epilogue(acc, tile, idx, sizes, tiles, tile_end, n_tiles, c_smem, c_desc,
                              c_ptr, sa_ptr, sb_ptr, n, stride_sa, stride_sbe, stride_sbn, ids_ptr,
                              top_k, num_ids, GROUP_M, GATHER, BLOCKWISE, store_layout,
                              bias_ptr, stride_bias, HAS_BIAS)  # fmt: skip
                    acc = zero
            done = warpgroup_mma_wait(num_outstanding=0, deps=(prev,))
            if BLOCKWISE:  # noqa: SIM108 (a constexpr branch: sa_prev exists only blockwise)
                acc = acc + done * (sa_prev[:, None] * sb_prev)
            else:
                acc = acc + done
            mbarrier.arrive(empty.index((steps + stages - 1) % stages), count=1)
            tile = pid + (steps // chunks - 1) * programs
            _epilogue(acc, tile, idx, sizes, tiles, tile_end, n_tiles, c_smem, c_desc, c_ptr,
                      sa_ptr, sb_ptr, n, stride_sa, stride_sbe, stride_sbn, ids_ptr, top_k, num_ids,
                      GROUP_M, GATHER, BLOCKWISE, store_layout, bias_ptr, stride_bias,
                      HAS_BIAS)  # fmt: skip
    tma.store_wait(0)
    if ZERO_TAIL:  # rows past every group: zeros
        tail_tiles = gl.cdiv(rows - covered, block_m) * n_tiles
        first_tail = (pid - group_tiles % programs + programs) % programs
        zeros = gl.zeros([block_m, block_n], c_smem.dtype, store_layout)
        out_rows = gl.arange(0, block_m, layout=gl.SliceLayout(1, store_layout))
        out_cols = gl.arange(0, block_n, layout=gl.SliceLayout(0, store_layout))
        for local in range(first_tail, tail_tiles, programs):
            r = covered + (local // n_tiles) * block_m + out_rows
            c = (local % n_tiles) * block_n + out_cols
            ptrs = c_ptr + r.to(gl.int64)[:, None] * n + c[None, :]
            gl.store(ptrs, zeros, mask=(r < rows)[:, None] & (c < n)[None, :])


@gluon.jit
def _scaled_gmm_kernel(a_desc, b_desc, c_desc, c_ptr, sa_ptr, sb_ptr, sizes_ptr, num_experts,
                       rows, n, k, stride_sa, stride_sak, stride_sbe, stride_sbn, stride_sbk,
                       x_ptr, stride_x, ids_ptr, top_k, num_ids, bias_ptr, stride_bias,
                       FROM_ENDS: gl.constexpr, ZERO_TAIL: gl.constexpr, BLOCK_E: gl.constexpr,
                       GROUP_M: gl.constexpr, GATHER: gl.constexpr, BLOCKWISE: gl.constexpr,
                       HAS_BIAS: gl.constexpr, STAGES: gl.constexpr, LOADER_WARPS: gl.constexpr,
                       LOADER_REGS: gl.constexpr, num_warps: gl.constexpr):  # fmt: skip
    """The grouped GEMM (module docstring). a_desc: a (rows, k), or with GATHER x (tokens, k)
    (only its block and layout are used: the loader copies row ids[i] // top_k of x for sorted
    row i, zeros for ids outside [0, num_ids)). b_desc: b seen as (E * n, k). c_desc / c_ptr:
    the output (rows, n), contiguous. Scales: rowwise, sa per row (stride_sa) and sb per output
    column (stride_sbe, stride_sbn); BLOCKWISE (1 x 128 blocks of a, 128 x 128 of b, one block
    a K step and an n tile), sa per row and k block (stride_sak), sb per expert, n block and k
    block (stride_sbk). HAS_BIAS: bias_ptr is the per-expert bias (E, n), rows stride_bias
    apart, unit column stride, added in float32 to each grouped row before the one rounding
    (rows past every group get none); otherwise bias_ptr is unused."""
    block_m: gl.constexpr = a_desc.block_type.shape[0]
    block_k: gl.constexpr = a_desc.block_type.shape[1]
    block_n: gl.constexpr = b_desc.block_type.shape[0]
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, block_m, block_k], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, block_n, block_k], b_desc.layout)
    c_smem = gl.allocate_shared_memory(c_desc.dtype, [block_m, block_n], c_desc.layout)
    # Plain rowwise rows: a ring of SCALE_SLOTS tiles' row and column scales (block_m ==
    # block_n), filled by the loader, read by the epilogue.
    scale_smem = gl.allocate_shared_memory(
        gl.float32, [2 * SCALE_SLOTS, block_m], gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    )
    scale_empty = gl.allocate_shared_memory(gl.int64, [SCALE_SLOTS, 1], mbarrier.MBarrierLayout())
    scale_ready = gl.allocate_shared_memory(gl.int64, [SCALE_SLOTS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    # Gathered blockwise rows spill on sm_90a (the launch path never asks for them).
    gl.static_assert(not (GATHER and BLOCKWISE), "blockwise rows are not gathered here")
    # A stage is ready after the expect's arrival and, gathering, one a loader thread.
    arrivals: gl.constexpr = 1 + 32 * LOADER_WARPS if GATHER else 1
    for i in gl.static_range(STAGES):
        mbarrier.init(empty.index(i), count=1)
        mbarrier.init(ready.index(i), count=arrivals)
    for i in gl.static_range(SCALE_SLOTS):  # the loader's threads' copies arrive on ready
        mbarrier.init(scale_empty.index(i), count=1)
        mbarrier.init(scale_ready.index(i), count=32 * LOADER_WARPS)
    # fmt: off
    gl.warp_specialize(
        [
            (_mma_and_epilogue, (a_bufs, b_bufs, empty, ready, c_smem,
                                 (scale_smem, scale_ready, scale_empty), c_desc,
                                 c_ptr, sa_ptr, sb_ptr, sizes_ptr, num_experts, rows, n, k,
                                 stride_sa, stride_sak, stride_sbe, stride_sbn, stride_sbk,
                                 ids_ptr, top_k, num_ids, bias_ptr, stride_bias, FROM_ENDS,
                                 ZERO_TAIL, BLOCK_E, GROUP_M, GATHER, BLOCKWISE, HAS_BIAS,
                                 num_warps)),
            (_loader, (a_desc, b_desc, a_bufs, b_bufs, empty, ready, sizes_ptr, num_experts,
                       rows, n, k, x_ptr, stride_x, ids_ptr, top_k, num_ids,
                       (sa_ptr, sb_ptr, stride_sa, stride_sbe, stride_sbn, scale_smem, scale_ready,
                        scale_empty), FROM_ENDS, BLOCK_E, GROUP_M, GATHER, BLOCKWISE,
                       LOADER_WARPS)),
        ],
        [LOADER_WARPS],
        [LOADER_REGS],
    )
    # fmt: on


@functools.cache
def shared_layout(block: tuple[int, int], dtype: torch.dtype) -> Any:
    """The NVMMA shared-memory layout of a TMA block of ``dtype`` (built once: Gluon builds it
    in Python, tens of µs of host time)."""
    return gl.NVMMASharedLayout.get_default_for(list(block), {**_FP8, **_OUT}[dtype])


def stages(out_dtype: torch.dtype) -> int:
    """Operand stages that fit beside the (BLOCK_M, BLOCK_N) output tile."""
    tile = BLOCK_M * BLOCK_N * out_dtype.itemsize
    return (SHARED_BYTES - tile) // ((BLOCK_M + BLOCK_N) * BLOCK_K)


def serves(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """Whether this kernel takes operands of these layouts: OCP e4m3 data, a (rows, k) and b
    (E, n, k) with k contiguous and b dense, row strides TMA can address (16-byte multiples), an
    output of 16-byte rows. The caller checks the device (sm_90), which formats and row forms it
    gives it (:func:`megablocks_triton.scaled._warp_specialized`) and, per call, the bases'
    16-byte alignment."""
    k = a.shape[1]
    return (
        a.dtype in _FP8
        and b.dtype == a.dtype
        and out_dtype in _OUT
        and a.stride(1) == 1
        and b.stride(2) == 1
        and b.stride(1) == k
        and b.stride(0) == b.shape[1] * k
        and not a.stride(0) % 16
        and not k % 16
        and not (b.shape[1] * out_dtype.itemsize) % 16
    )


def launch(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    sizes: torch.Tensor,
    out: torch.Tensor,
    *,
    from_ends: bool,
    zero_tail: bool,
    block_e: int,
    num_sms: int,
    gather: tuple[torch.Tensor, int] | None = None,
    blockwise: bool = False,
    group_m: int = 8,
    bias: torch.Tensor | None = None,
) -> None:
    """``out = a @ b[e].T`` per group of rows, scaled: a (rows, k) and its (rows, 1) scales, b
    (E, n, k) and its (E, n, 1) scales, ``sizes`` the per-expert row counts on the device (or
    their running ends, ``from_ends``), out (rows, n) (:func:`serves` holds). ``gather`` (ids,
    top_k): a is the tokens (tokens, k) and sorted row i reads token ids[i] // top_k.
    ``blockwise``: format ``fp8_blockwise``'s scales instead, a (rows, k / 128) and b
    (E, n / 128, k / 128). ``bias`` (E, n), unit column stride, rowwise only: added to each
    group's rows before the rounding."""
    if bias is not None and blockwise:
        raise ValueError("the blockwise kernel takes no bias: its epilogue would spill")
    k = a.shape[1]
    rows = out.shape[0]
    num_experts, n, _ = b.shape
    a_desc = TensorDescriptor.from_tensor(
        a, [BLOCK_M, BLOCK_K], shared_layout((BLOCK_M, BLOCK_K), a.dtype)
    )
    b_desc = TensorDescriptor.from_tensor(
        b.view(num_experts * n, k), [BLOCK_N, BLOCK_K], shared_layout((BLOCK_N, BLOCK_K), b.dtype)
    )
    c_desc = TensorDescriptor.from_tensor(
        out, [BLOCK_M, BLOCK_N], shared_layout((BLOCK_M, BLOCK_N), out.dtype)
    )
    n_tiles = -(-n // BLOCK_N)
    max_tiles = (rows // BLOCK_M + min(num_experts, rows) + 1) * n_tiles
    grid = (max(1, min(num_sms, max_tiles)),)
    ids, top_k = gather if gather is not None else (sizes, 1)
    launch_kernel(
        _scaled_gmm_kernel, grid,
        a_desc, b_desc, c_desc, out, a_scale, b_scale, sizes, num_experts, rows, n, k,
        a_scale.stride(0), a_scale.stride(1), b_scale.stride(0), b_scale.stride(1),
        b_scale.stride(2), a, a.stride(0), ids, top_k, a.shape[0] * top_k,
        sizes if bias is None else bias, 0 if bias is None else bias.stride(0),
        FROM_ENDS=from_ends, ZERO_TAIL=zero_tail, BLOCK_E=block_e, GROUP_M=group_m,
        GATHER=gather is not None, BLOCKWISE=blockwise, HAS_BIAS=bias is not None,
        STAGES=stages(out.dtype),
        LOADER_WARPS=GATHER_LOADER_WARPS if gather is not None else 1,
        LOADER_REGS=GATHER_LOADER_REGISTERS if gather is not None else LOADER_REGISTERS,
        num_warps=MMA_WARPS,
    )  # fmt: skip
