"""The grouped weight gradient on Hopper, warp-specialized (Gluon).

``out[e] = a_e.T @ grad_e`` (or ``out[e] +=``) over each expert's rows, as
:func:`megablocks_triton.gmm.gmm_weight_grad` defines it, written in Gluon (Triton's lower-level
language) so that the kernel can split its warps by role, which Triton itself does not express
on Hopper:

* one *loader* warp walks the program's tiles and issues the TMA loads of every token chunk into
  a ring of shared-memory stages, running ahead across tiles: the next tile's operands arrive
  while the current tile's last MMAs and its epilogue run;
* eight *MMA* warps (two warpgroups, 64 rows each of a 128 x 256 tile) issue the asynchronous
  warpgroup MMAs, free each stage as soon as its MMA has read it, and write the tile: a TMA store
  (a new gradient) or a TMA reduction that adds it to the gradient in memory (gradient-accumulation
  fusion), both asynchronous.

Each expert's weight gradient reduces over only a few hundred tokens (512 per expert at the
DeepSeek-V3 shape), so the plain kernel spends a large share of each tile filling its pipeline
and in its epilogue; here both overlap the loads of the next tile. Results equal the plain
kernel's bit for bit (same tiles, same chunk order, float32 accumulation).

The kernel of the triton backend's declared variant ``triton/gluon-hopper`` of
``gmm_weight_grad`` and ``gmm_weight_grad_accumulate`` (ranked, listed by ``megablocks backends
explain``, forceable by the kit): sm_90, 16-bit operands and a 16-bit gradient
(:func:`serves_dtypes`), the calls the launch policy measured it faster for, with the Triton
releases it was tested with (``megablocks_triton.gmm_wgrad.GLUON_TESTED``: Gluon is experimental);
tensors whose layouts TMA cannot take fall back to the plain kernel at launch. Everything else,
the Triton interpreter included, takes the plain kernel. It runs on a Hopper GPU only; on the CPU its tests
compile it for sm_90.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from triton._C.libtriton import ir  # type: ignore[import-untyped]
from triton.experimental import gluon  # type: ignore[import-untyped]
from triton.experimental.gluon import language as gl  # type: ignore[import-untyped]
from triton.experimental.gluon.language import _core as gl_core  # type: ignore[import-untyped]
from triton.experimental.gluon.language.nvidia.hopper import (  # type: ignore[import-untyped]
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # type: ignore[import-untyped]

from .launch import launch as launch_kernel

BLOCK_M, BLOCK_N, BLOCK_K = 128, 256, 64
PIECE = gl.constexpr(16)  # rows of a partial chunk multiplied at a time (bf16 MMAs reduce over 16)
STAGES = 3  # 3 x 48 KiB of operands + the 64 KiB output tile fit the 227 KiB of shared memory
MMA_WARPS = 8
LOADER_REGISTERS = 40
_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


@gl_core.builtin
def _tma_reduce_add(tensor_desc: Any, coord: Any, src: Any, _semantic: Any = None) -> None:
    """``global[coord] += src`` for a shared-memory tile, by the TMA unit, asynchronously
    (completion as for a TMA store: ``tma.store_wait``)."""
    coords = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(
        ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coords, src.handle
    )


@gluon.jit
def _group_extent(sizes_ptr, e, num_experts, rows, BLOCK_E: gl.constexpr, layout: gl.constexpr):
    # Expert e's first row and row count, made safe as the plain kernel's _group_sizes makes them:
    # a negative size counts as 0 and groups are cut at a's last row.
    idx = gl.arange(0, BLOCK_E, layout=layout)
    raw = gl.load(sizes_ptr + idx, mask=idx < num_experts, other=0).to(gl.int64)
    raw = gl.minimum(gl.maximum(raw, 0), rows)
    before = gl.sum(gl.where(idx < e, raw, 0), 0)
    own = gl.sum(gl.where(idx == e, raw, 0), 0)
    start = gl.minimum(before, rows)
    return start.to(gl.int32), (gl.minimum(before + own, rows) - start).to(gl.int32)


@gluon.jit
def _tile_coords(tile, tiles_n, tiles_per_expert):
    e = tile // tiles_per_expert
    local = tile - e * tiles_per_expert
    tile_m = local // tiles_n
    return e, tile_m, local - tile_m * tiles_n


@gluon.jit
def _loader(a_desc, g_desc, a_bufs, b_bufs, empty, ready, sizes_ptr, num_experts, rows,
            total_tiles, tiles_n, tiles_per_expert, BLOCK_E: gl.constexpr):  # fmt: skip
    block_k: gl.constexpr = a_desc.block_type.shape[0]
    block_m: gl.constexpr = a_desc.block_type.shape[1]
    block_n: gl.constexpr = g_desc.block_type.shape[1]
    stages: gl.constexpr = a_bufs.type.shape[0]
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    step = 0
    for tile in range(gl.program_id(0), total_tiles, gl.num_programs(0)):
        e, tile_m, tile_n = _tile_coords(tile, tiles_n, tiles_per_expert)
        start, size = _group_extent(sizes_ptr, e, num_experts, rows, BLOCK_E, layout)
        for k in range(0, size, block_k):
            slot = step % stages
            mbarrier.wait(empty.index(slot), ((step // stages) & 1) ^ 1)
            bar = ready.index(slot)
            mbarrier.expect(bar, a_desc.block_type.nbytes + g_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(
                a_desc, [start + k, tile_m * block_m], bar, a_bufs.index(slot)
            )
            tma.async_copy_global_to_shared(
                g_desc, [start + k, tile_n * block_n], bar, b_bufs.index(slot)
            )
            step += 1


@gluon.jit
def _zero_rows_from(buf, valid, num_warps: gl.constexpr):
    # Rows >= valid of a (PIECE, n) piece of an operand tile: past the group's end (another
    # group's rows, or memory a worst-case buffer never wrote), so they must add nothing.
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [num_warps, 1], [1, 0])
    tile = buf.load(layout)
    row = gl.arange(0, buf.type.shape[0], layout=gl.SliceLayout(1, layout))
    buf.store(gl.where((row < valid)[:, None], tile, gl.zeros_like(tile)))


@gluon.jit
def _partial_chunk_mma(a_buf, b_buf, acc, valid, num_warps: gl.constexpr):
    # The group's last chunk holds only `valid` (< BLOCK_K) of its rows. It is multiplied in
    # PIECE-row pieces (the MMA's own reduction step): whole pieces before the group end as
    # they are, the piece the end falls in with its rows past the end zeroed (a TMA box cannot
    # stop at a row), none after it. Zeroing one piece instead of the chunk, and skipping the
    # MMAs of the rows past the end (on average half a chunk), shortens the MMA warps' path;
    # the pieces run in the order a whole chunk's MMA runs them, so the sums are the same.
    for j in gl.static_range(a_buf.type.shape[0] // PIECE):
        if j * PIECE < valid:
            a_piece = a_buf.slice(j * PIECE, PIECE, dim=0)
            b_piece = b_buf.slice(j * PIECE, PIECE, dim=0)
            if valid < (j + 1) * PIECE:
                _zero_rows_from(a_piece, valid - j * PIECE, num_warps)
                _zero_rows_from(b_piece, valid - j * PIECE, num_warps)
                fence_async_shared()
                gl.thread_barrier()
            acc = warpgroup_mma(a_piece.permute((1, 0)), b_piece, acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
    return acc


@gluon.jit
def _mma_and_epilogue(out_desc, a_bufs, b_bufs, empty, ready, c_smem, sizes_ptr, num_experts,
                      rows, total_tiles, tiles_n, tiles_per_expert, BLOCK_E: gl.constexpr,
                      ACCUMULATE: gl.constexpr, num_warps: gl.constexpr):  # fmt: skip
    block_m: gl.constexpr = c_smem.type.shape[0]
    block_n: gl.constexpr = c_smem.type.shape[1]
    block_k: gl.constexpr = a_bufs.type.shape[1]
    stages: gl.constexpr = a_bufs.type.shape[0]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, block_n, 16]
    )
    sizes_layout: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    out_tile = c_smem.reshape([1, block_m, block_n])
    step = 0
    for tile in range(gl.program_id(0), total_tiles, gl.num_programs(0)):
        e, tile_m, tile_n = _tile_coords(tile, tiles_n, tiles_per_expert)
        _, size = _group_extent(sizes_ptr, e, num_experts, rows, BLOCK_E, sizes_layout)
        acc = gl.zeros([block_m, block_n], gl.float32, acc_layout)
        chunks = (size + block_k - 1) // block_k
        for chunk in range(chunks):
            slot = step % stages
            mbarrier.wait(ready.index(slot), (step // stages) & 1)
            valid = size - chunk * block_k
            if valid < block_k:  # the group's last, partial chunk
                acc = _partial_chunk_mma(a_bufs.index(slot), b_bufs.index(slot), acc, valid,
                                         num_warps)  # fmt: skip
            else:
                acc = warpgroup_mma(a_bufs.index(slot).permute((1, 0)), b_bufs.index(slot), acc,
                                    is_async=True)  # fmt: skip
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            # One MMA in flight, of this chunk: the previous chunk's have read its stage, which
            # goes back to the loader.
            mbarrier.arrive(empty.index((step + stages - 1) % stages), count=1, pred=chunk > 0)
            step += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index((step + stages - 1) % stages), count=1, pred=chunks > 0)
        at = [e, tile_m * block_m, tile_n * block_n]
        if ACCUMULATE:
            if size > 0:  # an empty expert's gradient is left as it is
                tma.store_wait(0)  # the previous tile's reduction has read c_smem
                c_smem.store(acc.to(c_smem.dtype))
                fence_async_shared()
                _tma_reduce_add(out_desc, at, out_tile)
        else:  # an empty expert gets exact zeros
            tma.store_wait(0)
            c_smem.store(acc.to(c_smem.dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(out_desc, at, out_tile)
    tma.store_wait(0)


@gluon.jit
def _gmm_wgrad_kernel(a_desc, g_desc, out_desc, sizes_ptr, num_experts, rows, tiles_m, tiles_n,
                  BLOCK_E: gl.constexpr, STAGES: gl.constexpr, ACCUMULATE: gl.constexpr,
                  LOADER_REGS: gl.constexpr, num_warps: gl.constexpr):  # fmt: skip
    block_k: gl.constexpr = a_desc.block_type.shape[0]
    block_m: gl.constexpr = a_desc.block_type.shape[1]
    block_n: gl.constexpr = g_desc.block_type.shape[1]
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, block_k, block_m], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(g_desc.dtype, [STAGES, block_k, block_n], g_desc.layout)
    c_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for(
        [block_m, block_n], out_desc.dtype
    )
    c_smem = gl.allocate_shared_memory(out_desc.dtype, [block_m, block_n], c_layout)
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(empty.index(i), count=1)
        mbarrier.init(ready.index(i), count=1)
    tiles_per_expert = tiles_m * tiles_n
    total_tiles = num_experts * tiles_per_expert
    # fmt: off
    gl.warp_specialize(
        [
            (_mma_and_epilogue, (out_desc, a_bufs, b_bufs, empty, ready, c_smem, sizes_ptr,
                                 num_experts, rows, total_tiles, tiles_n, tiles_per_expert,
                                 BLOCK_E, ACCUMULATE, num_warps)),
            (_loader, (a_desc, g_desc, a_bufs, b_bufs, empty, ready, sizes_ptr, num_experts,
                       rows, total_tiles, tiles_n, tiles_per_expert, BLOCK_E)),
        ],
        [1],  # the loader: one warp
        [LOADER_REGS],
    )
    # fmt: on


@functools.cache
def shared_layout(block: tuple[int, ...], dtype: torch.dtype) -> Any:
    """The NVMMA shared-memory layout of a TMA block of ``dtype``: a pure function of the block
    shape and dtype, built once (Gluon builds it in Python, tens of µs of host time, three per
    launch)."""
    return gl.NVMMASharedLayout.get_default_for(list(block), _DTYPES[dtype])


def serves_dtypes(a: torch.dtype, grad: torch.dtype, out: torch.dtype) -> bool:
    """Whether this kernel takes these dtypes: 16-bit ``a`` and ``grad`` of one dtype, a 16-bit
    gradient. The caller checks the device (sm_90) and the layouts (TMA)."""
    return a in _DTYPES and grad == a and out in _DTYPES


def launch(
    a: torch.Tensor,
    grad: torch.Tensor,
    sizes: torch.Tensor,
    out: torch.Tensor,
    *,
    accumulate: bool,
    block_e: int,
    num_sms: int,
) -> None:
    """``out[e] (+)= a_e.T @ grad_e``: a (rows, K), grad (rows, N), out (E, K, N), ``sizes``
    the int32 per-expert row counts on the device (:func:`serves_dtypes` holds, and every
    tensor suits TMA)."""
    num_experts, k, n = out.shape
    # The descriptors hold the tensors (their addresses, shapes and strides): made per call.
    a_desc = TensorDescriptor.from_tensor(
        a, [BLOCK_K, BLOCK_M], shared_layout((BLOCK_K, BLOCK_M), a.dtype)
    )
    g_desc = TensorDescriptor.from_tensor(
        grad, [BLOCK_K, BLOCK_N], shared_layout((BLOCK_K, BLOCK_N), a.dtype)
    )
    out_desc = TensorDescriptor.from_tensor(
        out, [1, BLOCK_M, BLOCK_N], shared_layout((1, BLOCK_M, BLOCK_N), out.dtype)
    )
    tiles_m, tiles_n = -(-k // BLOCK_M), -(-n // BLOCK_N)
    grid = (max(1, min(num_sms, num_experts * tiles_m * tiles_n)),)
    launch_kernel(
        _gmm_wgrad_kernel, grid,
        a_desc, g_desc, out_desc, sizes, num_experts, a.shape[0], tiles_m, tiles_n,
        BLOCK_E=block_e, STAGES=STAGES, ACCUMULATE=accumulate, LOADER_REGS=LOADER_REGISTERS,
        num_warps=MMA_WARPS,
    )  # fmt: skip
