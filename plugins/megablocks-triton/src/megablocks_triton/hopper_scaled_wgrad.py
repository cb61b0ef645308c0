"""The FP8 rowwise grouped weight gradient on Hopper, warp-specialized (Gluon).

``out[e] = (a_e @ grad_e.T) * a_scale[e][:, None] * grad_scale[e][None, :]`` over each expert's
rows, the weight gradient of an FP8 rowwise layer: a (m, rows) and grad (n, rows) are the
transposed e4m3 copies that FP8 recipes quantize for it (Hopper's FP8 MMA reads both operands
K-major, and here K is the rows), with one scale per column of each expert's block. As the
forward GEMM (:mod:`.hopper_scaled`), the float32 sum is promoted every 128 rows (Hopper's FP8
MMA keeps a narrower sum): each 128-deep product goes to a fresh accumulator, asynchronously, and
the previous one is added while the matrix unit computes it. Each expert reduces over only a few
hundred rows (512 at the DeepSeek-V3 shape), so a tile is a few products: filling the pipeline
and the epilogue would dominate a kernel that does one tile at a time. Here:

* a *loader* warp walks the program's tiles (expert, then m, then n) and fills a ring of
  shared-memory stages by TMA, running ahead across tiles, and copies each tile's row and column
  scales into a ring of its own by ``cp.async`` for the epilogue;
* eight *MMA* warps (two warpgroups, 64 rows each of a 128 x 128 tile) walk the program's chunks
  as one sequence across tiles, two products in flight, add the older to its tile's float32 sum
  and free its stage; an expert's last, partial chunk has its columns past the expert's end
  zeroed in shared memory first (in both operands: they hold the next expert's rows, which must
  add nothing, not even a NaN). A tile's epilogue (both scales, the rounding, an asynchronous
  TMA store clipped at m and n) runs while the next tile's first product computes; an empty
  expert's tiles get zeros (its scales are not read).

A TMA box must start on a 16-byte boundary along the rows (an unaligned start faults), so an
expert's chunks start at its first row rounded down to 16, the rows before it zeroed like those
past its end. The sums are those of the triton backend's Triton kernel
(``kernels.scaled._scaled_wgrad_kernel``: the same chunks, masked loads,
``max_num_imprecise_acc=128``): the same 128-deep products from zero, added in the same order, so
outputs equal bit for bit. Hopper only: the caller checks the device (sm_90)
and the layouts (:func:`serves`); on the CPU its tests compile it for sm_90.
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

from .hopper_wgrad import _tile_coords
from .launch import launch as launch_kernel

#: 128 x 128 tiles (two float32 sets of 64 x 128 a warpgroup: the products in flight; 128 x 256
#: would not fit the registers), 128-deep chunks: one promotion a chunk.
BLOCK_M, BLOCK_N, BLOCK_K = 128, 128, 128
MMA_WARPS = 8
LOADER_REGISTERS = 40
#: Tiles whose epilogue scales the loader copies ahead.
SCALE_SLOTS = gl.constexpr(4)
#: A TMA box's start along the rows, in elements: 16 bytes of e4m3 (an unaligned start faults).
ALIGN = gl.constexpr(16)
#: Shared memory for operand stages: what the 227 KiB leave beside the output tile.
SHARED_BYTES = 220 * 1024
_FP8 = {torch.float8_e4m3fn: gl.float8e4nv}
_OUT = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}


@gluon.jit
def _add(x, y):
    return x + y


@gluon.jit
def _taken(end, pid, programs):
    # How many of the program's tiles (pid, pid + programs, ...) lie before `end`.
    return gl.maximum(end - pid + programs - 1, 0) // programs


@gluon.jit
def _stage_groups(sizes_ptr, num_experts, rows, starts_smem, sizes_smem, leads_smem,
                  tiles_per_expert, block_k: gl.constexpr, num_warps: gl.constexpr):  # fmt: skip
    # Every expert's rows, made safe as _group_extent makes them (a negative size counts as 0,
    # groups are cut at the last row), into shared memory once: a tile's are then one
    # shared-memory load in either partition (no registers held, no reduction). A TMA box must
    # start on a 16-byte boundary along the rows, so an expert's chunks start at its first row
    # rounded down to 16 (ALIGN): the tables hold that start, the span from it to the expert's
    # end (0 for an empty expert) and the lead (the rows before its first, zeroed like those
    # past its end). Returns the program's steps: per expert, its tiles times its chunks.
    block_e: gl.constexpr = sizes_smem.type.shape[0]
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    idx = gl.arange(0, block_e, layout=layout)
    raw = gl.load(sizes_ptr + idx, mask=idx < num_experts, other=0).to(gl.int64)
    raw = gl.minimum(gl.maximum(raw, 0), rows)
    ends = gl.associative_scan(raw, 0, _add)
    starts = gl.minimum(ends - raw, rows)
    sizes = (gl.minimum(ends, rows) - starts).to(gl.int32)
    leads = (starts % ALIGN).to(gl.int32)
    sizes = gl.where(sizes > 0, leads + sizes, 0)
    starts_smem.store((starts - leads).to(gl.int32))
    sizes_smem.store(sizes)
    leads_smem.store(leads)
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    first = idx * tiles_per_expert
    taken = _taken(first + tiles_per_expert, pid, programs) - _taken(first, pid, programs)
    return gl.sum(taken * gl.cdiv(sizes, block_k), 0)


@gluon.jit
def _lookup(table, e, layout: gl.constexpr):
    # table[e] of a (BLOCK_E,) int32 table in shared memory.
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    column = table._reinterpret(gl.int32, [table.type.shape[0], 1], flat)
    return gl.sum(column.index(e).load(layout), 0)


@gluon.jit
def _rows_of(tile, tiling, layout: gl.constexpr):
    # The span and lead of a tile's expert (0 past the last tile).
    sizes_smem, leads_smem, total_tiles, _, tiles_per_expert = tiling
    e = gl.minimum(tile, total_tiles - 1) // tiles_per_expert
    inside = tile < total_tiles
    span = gl.where(inside, _lookup(sizes_smem, e, layout), 0)
    return span, gl.where(inside, _lookup(leads_smem, e, layout), 0)


@gluon.jit
def _store_tile(values, tile, tiles_n, tiles_per_expert, c_smem, out_desc):
    # A tile's values through c_smem to out[e] by an asynchronous TMA store, clipped at m and n
    # (the caller has waited for the previous store to read c_smem).
    block_m: gl.constexpr = c_smem.type.shape[0]
    block_n: gl.constexpr = c_smem.type.shape[1]
    e, tile_m, tile_n = _tile_coords(tile, tiles_n, tiles_per_expert)
    c_smem.store(values)
    fence_async_shared()
    gl.thread_barrier()
    tma.async_copy_shared_to_global(out_desc, [e, tile_m * block_m, tile_n * block_n],
                                    c_smem.reshape([1, block_m, block_n]))  # fmt: skip


@gluon.jit
def _walk(tile, tiling, out, STORE_ZEROS: gl.constexpr, num_warps: gl.constexpr):
    # The program's first tile at or after `tile` whose expert has rows (one at or past the last
    # tile if none), its span and lead. STORE_ZEROS: the tiles passed (empty experts') get zeros.
    _, _, total_tiles, tiles_n, tiles_per_expert = tiling
    c_smem, out_desc, _ = out
    block_m: gl.constexpr = c_smem.type.shape[0]
    block_n: gl.constexpr = c_smem.type.shape[1]
    lookup: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    size, lead = _rows_of(tile, tiling, lookup)
    while (size == 0) & (tile < total_tiles):
        if STORE_ZEROS:
            layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
            zeros = gl.zeros([block_m, block_n], c_smem.dtype, layout)
            tma.store_wait(0)
            gl.thread_barrier()
            _store_tile(zeros, tile, tiles_n, tiles_per_expert, c_smem, out_desc)
        tile += gl.num_programs(0)
        size, lead = _rows_of(tile, tiling, lookup)
    return tile, size, lead


@gluon.jit
def _zero_columns_outside(buf, lo, hi, num_warps: gl.constexpr):
    # Columns outside [lo, hi) of an e4m3 operand tile (rows before the expert's first or past
    # its end: another expert's, or past the tensor), so that they add nothing. Seen as 4-byte
    # words (the swizzle is one of bytes, so the words' layout is the bytes'), each word's bytes
    # outside masked off: a quarter of the work of selecting byte by byte.
    rows: gl.constexpr = buf.type.shape[0]
    words: gl.constexpr = buf.type.shape[1] // 4
    as_words: gl.constexpr = gl.NVMMASharedLayout(buf.layout.swizzle_byte_width, 32, rank=2)
    view = buf._reinterpret(gl.int32, [rows, words], as_words)
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [num_warps, 1], [1, 0])
    tile = view.load(layout)
    first = 4 * gl.arange(0, words, layout=gl.SliceLayout(0, layout))  # each word's first column
    # Its bytes before hi, and before lo (little-endian: byte j is bits 8j to 8j + 7).
    below_hi = gl.minimum(gl.maximum(hi - first, 0), 4)
    below_lo = gl.minimum(gl.maximum(lo - first, 0), 4)
    keep_hi = gl.where(below_hi == 4, -1, (1 << (8 * below_hi)) - 1)
    drop_lo = gl.where(below_lo == 4, -1, (1 << (8 * below_lo)) - 1)
    view.store(tile & (keep_hi & ~drop_lo)[None, :])


@gluon.jit
def _issue(a_bufs, b_bufs, ready, step, zero, tile, left, lead, tiling, out,
           num_warps: gl.constexpr):  # fmt: skip
    # A step's product (a fresh sum over its chunk, promoted when retired), issued once its stage
    # has landed; then the issue cursor (its tile, the span left in it, the lead of its first
    # chunk: 0 past it) moves on.
    stages: gl.constexpr = a_bufs.type.shape[0]
    block_k: gl.constexpr = a_bufs.type.shape[2]
    slot = step % stages
    mbarrier.wait(ready.index(slot), (step // stages) & 1)
    if (left < block_k) | (lead > 0):  # the expert's last, partial chunk, or an unaligned first
        _zero_columns_outside(a_bufs.index(slot), lead, left, num_warps)
        _zero_columns_outside(b_bufs.index(slot), lead, left, num_warps)
        fence_async_shared()  # the generic proxy's writes, before the MMA's reads
        gl.thread_barrier()
    part = warpgroup_mma(a_bufs.index(slot), b_bufs.index(slot).permute((1, 0)), zero,
                         use_acc=False, is_async=True)  # fmt: skip
    left = left - block_k
    lead = 0
    if left <= 0:
        tile, left, lead = _walk(tile + gl.num_programs(0), tiling, out, False, num_warps)
    return part, tile, left, lead


@gluon.jit
def _epilogue(acc, tile, t, tiling, out):
    # The tile's sum times its row and column scales (copied by the loader into slot t of the
    # scales' ring), rounded and stored.
    _, _, _, tiles_n, tiles_per_expert = tiling
    c_smem, out_desc, staged = out
    scale_smem, scale_ready, scale_empty = staged
    slots: gl.constexpr = scale_ready.type.shape[0]
    slot = t % slots
    mbarrier.wait(scale_ready.index(slot), (t // slots) & 1)
    sa = scale_smem.index(2 * slot).load(gl.SliceLayout(1, acc.type.layout))
    sg = scale_smem.index(2 * slot + 1).load(gl.SliceLayout(0, acc.type.layout))
    result = (acc * sa[:, None] * sg[None, :]).to(c_smem.dtype)
    tma.store_wait(0)  # the previous tile's store has read c_smem
    gl.thread_barrier()  # and every warp has read the scales: their slot goes back
    mbarrier.arrive(scale_empty.index(slot), count=1)
    _store_tile(result, tile, tiles_n, tiles_per_expert, c_smem, out_desc)


@gluon.jit
def _retire(acc, done, step, empty, tile, left, t, tiling, out, block_k: gl.constexpr,
            num_warps: gl.constexpr):  # fmt: skip
    # A finished step's product added into its tile's sum and its stage freed; after the tile's
    # last, the epilogue, and the retire cursor (tile, rows left, tiles done) moves on, storing
    # the zeros of the empty experts' tiles it passes.
    acc = acc + done
    mbarrier.arrive(empty.index(step % empty.type.shape[0]), count=1)
    left = left - block_k
    if left <= 0:
        _epilogue(acc, tile, t, tiling, out)
        acc = gl.zeros_like(acc)
        tile, left, _ = _walk(tile + gl.num_programs(0), tiling, out, True, num_warps)
        t += 1
    return acc, tile, left, t


@gluon.jit
def _mma_and_epilogue(a_bufs, b_bufs, empty, ready, c_smem, out_desc, staged, sizes_smem,
                      leads_smem, steps, total_tiles, tiles_n, tiles_per_expert,
                      num_warps: gl.constexpr):  # fmt: skip
    block_m: gl.constexpr = c_smem.type.shape[0]
    block_n: gl.constexpr = c_smem.type.shape[1]
    block_k: gl.constexpr = a_bufs.type.shape[2]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, block_n, 32]
    )
    tiling = (sizes_smem, leads_smem, total_tiles, tiles_n, tiles_per_expert)
    out = (c_smem, out_desc, staged)
    # The retire cursor: the first tile with rows (zeros for the empty ones before it).
    tile, left, lead = _walk(gl.program_id(0), tiling, out, True, num_warps)
    if steps > 0:
        # The program's chunks as one sequence of steps, in pairs: each step's product is issued
        # before the one before it is added, two products in flight in two register sets
        # (carried in one, the product in flight would be copied out before the next one
        # writes those registers: ptxas waits for it first, its note C7517).
        zero = gl.zeros([block_m, block_n], gl.float32, acc_layout)
        acc = zero
        t = 0
        prev, i_tile, i_left, i_lead = _issue(a_bufs, b_bufs, ready, 0, zero, tile, left, lead,
                                              tiling, out, num_warps)  # fmt: skip
        for step in range(1, steps - 1, 2):
            part, i_tile, i_left, i_lead = _issue(a_bufs, b_bufs, ready, step, zero, i_tile,
                                                  i_left, i_lead, tiling, out, num_warps)  # fmt: skip
            done = warpgroup_mma_wait(num_outstanding=1, deps=(prev,))
            acc, tile, left, t = _retire(acc, done, step - 1, empty, tile, left, t, tiling, out,
                                         block_k, num_warps)  # fmt: skip
            prev, i_tile, i_left, i_lead = _issue(a_bufs, b_bufs, ready, step + 1, zero, i_tile,
                                                  i_left, i_lead, tiling, out, num_warps)  # fmt: skip
            done = warpgroup_mma_wait(num_outstanding=1, deps=(part,))
            acc, tile, left, t = _retire(acc, done, step, empty, tile, left, t, tiling, out,
                                         block_k, num_warps)  # fmt: skip
        if (steps - 1) % 2 == 1:  # one step left past the pairs
            part, i_tile, i_left, i_lead = _issue(a_bufs, b_bufs, ready, steps - 1, zero, i_tile,
                                                  i_left, i_lead, tiling, out, num_warps)  # fmt: skip
            done = warpgroup_mma_wait(num_outstanding=1, deps=(prev,))
            acc, tile, left, t = _retire(acc, done, steps - 2, empty, tile, left, t, tiling, out,
                                         block_k, num_warps)  # fmt: skip
            done = warpgroup_mma_wait(num_outstanding=0, deps=(part,))
            _retire(acc, done, steps - 1, empty, tile, left, t, tiling, out, block_k, num_warps)
        else:
            done = warpgroup_mma_wait(num_outstanding=0, deps=(prev,))
            _retire(acc, done, steps - 1, empty, tile, left, t, tiling, out, block_k, num_warps)
    tma.store_wait(0)


@gluon.jit
def _copy_scales(t, e, tile_m, tile_n, m, n, scales, layout: gl.constexpr):
    # The loader's t-th tile with rows: its row and column scales copied into slot t of the
    # scales' ring by cp.async, each loader thread arriving on the slot's barrier when its copies
    # land. Past m and n, nothing is copied (those outputs are clipped).
    sa_ptr, sg_ptr, stride_sae, stride_sai, stride_sge, stride_sgj, staged = scales
    scale_smem, scale_ready, scale_empty = staged
    slots: gl.constexpr = scale_ready.type.shape[0]
    block: gl.constexpr = scale_smem.type.shape[1]
    slot = t % slots
    mbarrier.wait(scale_empty.index(slot), ((t // slots) & 1) ^ 1)
    i = tile_m * block + gl.arange(0, block, layout=layout)
    async_copy.async_copy_global_to_shared(
        scale_smem.index(2 * slot),
        sa_ptr + e.to(gl.int64) * stride_sae + i * stride_sai,
        mask=i < m,
    )
    j = tile_n * block + gl.arange(0, block, layout=layout)
    async_copy.async_copy_global_to_shared(
        scale_smem.index(2 * slot + 1),
        sg_ptr + e.to(gl.int64) * stride_sge + j * stride_sgj,
        mask=j < n,
    )
    async_copy.mbarrier_arrive(scale_ready.index(slot), increment_count=False)


@gluon.jit
def _loader(a_desc, g_desc, a_bufs, b_bufs, empty, ready, scales, groups, m, n, total_tiles,
            tiles_n, tiles_per_expert):  # fmt: skip
    block_m: gl.constexpr = a_desc.block_type.shape[0]
    block_k: gl.constexpr = a_desc.block_type.shape[1]
    block_n: gl.constexpr = g_desc.block_type.shape[0]
    stages: gl.constexpr = a_bufs.type.shape[0]
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    starts_smem, sizes_smem = groups
    step = 0
    t = 0
    for tile in range(gl.program_id(0), total_tiles, gl.num_programs(0)):
        e, tile_m, tile_n = _tile_coords(tile, tiles_n, tiles_per_expert)
        start = _lookup(starts_smem, e, layout)
        size = _lookup(sizes_smem, e, layout)
        if size > 0:  # an empty expert's tile is zeros: no scales, no chunks
            _copy_scales(t, e, tile_m, tile_n, m, n, scales, layout)
            t += 1
        for k in range(0, size, block_k):
            slot = step % stages
            mbarrier.wait(empty.index(slot), ((step // stages) & 1) ^ 1)
            bar = ready.index(slot)
            mbarrier.expect(bar, a_desc.block_type.nbytes + g_desc.block_type.nbytes)
            # Along rows, a box starts at the chunk; past the tensor's end TMA fills zeros, past
            # the expert's end the MMA warps zero the columns.
            tma.async_copy_global_to_shared(
                a_desc, [tile_m * block_m, start + k], bar, a_bufs.index(slot)
            )
            tma.async_copy_global_to_shared(
                g_desc, [tile_n * block_n, start + k], bar, b_bufs.index(slot)
            )
            step += 1


@gluon.jit
def _scaled_wgrad_kernel(a_desc, g_desc, out_desc, sa_ptr, sg_ptr, stride_sae, stride_sai,
                         stride_sge, stride_sgj, sizes_ptr, num_experts, rows, m, n, tiles_m,
                         tiles_n, BLOCK_E: gl.constexpr, STAGES: gl.constexpr,
                         LOADER_REGS: gl.constexpr, num_warps: gl.constexpr):  # fmt: skip
    """The weight gradient (module docstring). a_desc: a (m, rows), g_desc: grad (n, rows),
    blocks of 128 rows by BLOCK_K; out_desc: out (E, m, n), blocks (1, BLOCK_M, BLOCK_N).
    sa_ptr: a's scales (E, m), strides stride_sae and stride_sai; sg_ptr: grad's (E, n)."""
    block_m: gl.constexpr = a_desc.block_type.shape[0]
    block_k: gl.constexpr = a_desc.block_type.shape[1]
    block_n: gl.constexpr = g_desc.block_type.shape[0]
    gl.static_assert(block_m == block_n, "one ring holds both scales of a tile")
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, block_m, block_k], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(g_desc.dtype, [STAGES, block_n, block_k], g_desc.layout)
    c_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for(
        [block_m, block_n], out_desc.dtype
    )
    c_smem = gl.allocate_shared_memory(out_desc.dtype, [block_m, block_n], c_layout)
    scale_smem = gl.allocate_shared_memory(
        gl.float32, [2 * SCALE_SLOTS, block_m], gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    )
    scale_empty = gl.allocate_shared_memory(gl.int64, [SCALE_SLOTS, 1], mbarrier.MBarrierLayout())
    scale_ready = gl.allocate_shared_memory(gl.int64, [SCALE_SLOTS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(empty.index(i), count=1)
        mbarrier.init(ready.index(i), count=1)
    for i in gl.static_range(SCALE_SLOTS):  # the loader warp's threads' copies arrive on ready
        mbarrier.init(scale_empty.index(i), count=1)
        mbarrier.init(scale_ready.index(i), count=32)
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    starts_smem = gl.allocate_shared_memory(gl.int32, [BLOCK_E], flat)
    sizes_smem = gl.allocate_shared_memory(gl.int32, [BLOCK_E], flat)
    leads_smem = gl.allocate_shared_memory(gl.int32, [BLOCK_E], flat)
    tiles_per_expert = tiles_m * tiles_n
    total_tiles = num_experts * tiles_per_expert
    steps = _stage_groups(sizes_ptr, num_experts, rows, starts_smem, sizes_smem, leads_smem,
                          tiles_per_expert, block_k, num_warps)  # fmt: skip
    staged = (scale_smem, scale_ready, scale_empty)
    # fmt: off
    gl.warp_specialize(
        [
            (_mma_and_epilogue, (a_bufs, b_bufs, empty, ready, c_smem, out_desc, staged,
                                 sizes_smem, leads_smem, steps, total_tiles, tiles_n,
                                 tiles_per_expert, num_warps)),
            (_loader, (a_desc, g_desc, a_bufs, b_bufs, empty, ready,
                       (sa_ptr, sg_ptr, stride_sae, stride_sai, stride_sge, stride_sgj, staged),
                       (starts_smem, sizes_smem), m, n, total_tiles, tiles_n, tiles_per_expert)),
        ],
        [1],  # the loader: one warp
        [LOADER_REGS],
    )
    # fmt: on


@functools.cache
def shared_layout(block: tuple[int, ...], dtype: torch.dtype) -> Any:
    """The NVMMA shared-memory layout of a TMA block of ``dtype`` (built once: Gluon builds it
    in Python, tens of µs of host time)."""
    return gl.NVMMASharedLayout.get_default_for(list(block), {**_FP8, **_OUT}[dtype])


def stages(out_dtype: torch.dtype) -> int:
    """Operand stages that fit beside the (BLOCK_M, BLOCK_N) output tile."""
    tile = BLOCK_M * BLOCK_N * out_dtype.itemsize
    return (SHARED_BYTES - tile) // ((BLOCK_M + BLOCK_N) * BLOCK_K)


def _tma_ready(t: torch.Tensor) -> bool:
    """Contiguous, its base 16-byte aligned."""
    return t.is_contiguous() and not t.data_ptr() % 16


def serves(a: torch.Tensor, grad: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether this kernel takes operands of these dtypes and layouts: a (m, rows) and grad
    (n, rows) e4m3, contiguous, with rows a multiple of 16 (TMA's 16-byte row strides) and
    16-byte aligned bases; out (E, m, n) contiguous, 16-bit or float32, with 16-byte rows and
    base. The caller checks the device (sm_90), the shapes and the scales."""
    return (
        a.dtype in _FP8
        and grad.dtype == a.dtype
        and a.dim() == 2
        and grad.dim() == 2
        and not a.shape[1] % 16
        and not grad.shape[1] % 16
        and _tma_ready(a)
        and _tma_ready(grad)
        and out.dtype in _OUT
        and out.dim() == 3
        and not (out.shape[2] * out.dtype.itemsize) % 16
        and _tma_ready(out)
    )


def launch(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    grad: torch.Tensor,
    grad_scale: torch.Tensor,
    sizes: torch.Tensor,
    out: torch.Tensor,
    *,
    block_e: int,
    num_sms: int,
) -> None:
    """``out[e] = (a_e @ grad_e.T) * a_scale[e][:, None] * grad_scale[e][None, :]``: a (m, rows)
    and grad (n, rows) e4m3, their scales (E, m) and (E, n) float32, ``sizes`` the int32
    per-expert row counts on the device, out (E, m, n) (:func:`serves` holds). ``block_e``: a
    power of two >= E; ``num_sms``: the persistent grid's size."""
    num_experts, m, n = out.shape
    rows = a.shape[1]
    if block_e < num_experts:  # the kernel's tables hold block_e experts
        raise ValueError(f"block_e {block_e} < {num_experts} experts")
    if not out.numel():
        return
    if not rows:  # every expert empty (and no TMA descriptor of a zero-sized dim)
        out.zero_()
        return
    # The descriptors hold the tensors (their addresses, shapes and strides): made per call.
    a_desc = TensorDescriptor.from_tensor(
        a, [BLOCK_M, BLOCK_K], shared_layout((BLOCK_M, BLOCK_K), a.dtype)
    )
    g_desc = TensorDescriptor.from_tensor(
        grad, [BLOCK_N, BLOCK_K], shared_layout((BLOCK_N, BLOCK_K), grad.dtype)
    )
    out_desc = TensorDescriptor.from_tensor(
        out, [1, BLOCK_M, BLOCK_N], shared_layout((1, BLOCK_M, BLOCK_N), out.dtype)
    )
    tiles_m, tiles_n = -(-m // BLOCK_M), -(-n // BLOCK_N)
    grid = (max(1, min(num_sms, num_experts * tiles_m * tiles_n)),)
    launch_kernel(
        _scaled_wgrad_kernel, grid,
        a_desc, g_desc, out_desc, a_scale, grad_scale, a_scale.stride(0), a_scale.stride(1),
        grad_scale.stride(0), grad_scale.stride(1), sizes, num_experts, rows, m, n, tiles_m,
        tiles_n, BLOCK_E=block_e, STAGES=stages(out.dtype), LOADER_REGS=LOADER_REGISTERS,
        num_warps=MMA_WARPS,
    )  # fmt: skip
