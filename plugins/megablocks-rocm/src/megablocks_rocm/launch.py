"""Launch shapes for the Triton kernels on AMD GPUs (64-wide wavefronts, CU counts).

:class:`RocmLaunchConfigs` is a :class:`megablocks_triton.api.LaunchConfigs` for one device:
a pure function of its :class:`~megablocks_core.plugin.DeviceInfo`, so tests build it for simulated
MI200/MI300/MI350 devices. It sizes the routing, permutation and grouped-GEMM launches (the
starting tiles are each CDNA family's ``gmm_tiles`` in :data:`megablocks_rocm.arch.FAMILIES`) and
adds the HIP launch options (:func:`megablocks_rocm.arch.launch_options`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from megablocks_triton.api import (
    KERNEL_KINDS,
    GmmConfig,
    LaunchConfigs,
    PermutationConfig,
    RoutingConfig,
    cdiv,
    dtype_class,
    fit_gmm_tiles,
    next_power_of_2,
    permutation_wgrad_shape,
)

from megablocks_core.plugin import DeviceInfo

from . import arch


def _pow2(x: int) -> int:
    return next_power_of_2(max(int(x), 1))


def _pow2_floor(x: int) -> int:
    return 1 << (max(int(x), 1).bit_length() - 1)


#: Fewest fp32 accumulators per lane a grouped-GEMM wavefront should own: 8 16x16 MFMA output
#: blocks (4 per lane each). Tiles fitted to a small problem get fewer wavefronts, not idle ones.
MIN_ACC_PER_LANE = 32

#: Most VGPRs per lane one K step's A and B tiles may take: with fewer wavefronts than that needs,
#: a tile fitted to few rows spills (the stream pipeliner also holds the next step's operands in
#: registers), e.g. 16x128x64 16-bit tiles on one wavefront at decode shapes (gfx90a), 16x128x32
#: fp32 ones (gfx942). Spill-free by `megablocks backends compile`; speed not measured on AMD.
MAX_OPERAND_VGPRS = 64

#: Largest accumulating weight-gradient tile (elements): its epilogue holds the gradient's tile in
#: registers beside the fp32 accumulator, which at 256x256 over 8 wavefronts is 128 + 128 VGPRs
#: per lane, past the 256 that waves_per_eu=2 leaves (spilling on gfx942/gfx950). 256x128 keeps
#: both at 64: spill-free by `megablocks backends compile`; speed not measured on AMD.
MAX_ACCUMULATE_TILE = 256 * 128


class RocmLaunchConfigs(LaunchConfigs):
    """Launch parameters for one AMD device."""

    def __init__(self, device: DeviceInfo) -> None:
        self.device = device
        self.family = arch.family(device)
        self.cus = device.multiprocessors or 64
        self.wave = device.warp_size or self.family.wavefront
        # Precomputed: launch_options runs on every launch.
        self._options = {k: arch.launch_options(device, k) for k in KERNEL_KINDS}

    def __repr__(self) -> str:
        return f"RocmLaunchConfigs({self.device.arch}, {self.family.name}, {self.cus} CUs)"

    def launch_options(self, kernel: str) -> Mapping[str, Any]:
        return self._options.get(kernel, {})

    def routing(self, n: int, num_bins_pow2: int) -> RoutingConfig:
        base = super().routing(n, num_bins_pow2)
        if base.prescan:  # many bins: short tiles, the table is scanned once anyway
            return base
        # About one tile per CU (power of two, <= CU count: 256 on MI300X/MI355X, 64 on an
        # MI250X GCD) instead of the H200's 128; 4 wavefronts = 256 lanes hold the 64x64
        # in-tile compare at 16 elements per lane.
        tile = min(max(_pow2(n // _pow2_floor(self.cus)), 256), 8192)
        return RoutingConfig(
            tile=tile, chunk=base.chunk, tile_rows=base.tile_rows, num_warps=4, prescan=False
        )

    def histogram_block(self, n: int) -> int:
        return min(max(_pow2(n // _pow2_floor(self.cus)), 256), 4096)

    def permutation(
        self, num_tokens: int, hidden: int, top_k: int, element_size: int
    ) -> PermutationConfig:
        # Rows up to 8K elements per block (not 16K): waves_per_eu=4 caps VGPRs at 128, and the
        # fp32 top-k accumulator must stay <= 32 elements per lane.
        block_h = min(_pow2(hidden), 8192)
        split_h = cdiv(hidden, block_h)
        # Few tokens: split rows until there are >= 4 programs per CU (1216 on an MI300X).
        while num_tokens * split_h < 4 * self.cus and block_h > 512:
            block_h //= 2
            split_h = cdiv(hidden, block_h)
        # A wavefront moves 64 lanes x 16 bytes = 1 KiB per vector load; aim at ~4 loads per lane,
        # and enough lanes that each holds <= 32 accumulator elements.
        per_lane_cap = block_h // (32 * self.wave)
        num_warps = min(8, max(2, block_h * element_size // (4 * 16 * self.wave), per_lane_cap))
        return PermutationConfig(
            block_h=block_h, split_h=split_h, zero_rows=16, num_warps=num_warps
        )

    def scatter_wgrad(
        self, num_tokens: int, hidden: int, top_k: int, element_size: int
    ) -> PermutationConfig:
        # (top_k x block_h) fp32 partial dots per program: <= 4K elements, i.e. <= 16 per lane
        # over 4 wavefronts (half the NVIDIA tile: wave64 doubles the lanes per warp); few
        # tokens: >= 2 programs per CU.
        return permutation_wgrad_shape(
            num_tokens,
            hidden,
            top_k,
            tile_elements=4096,
            min_block_h=256,
            min_programs=2 * self.cus,
            num_warps=(2, 4),
            more_warps_from=2048,
        )

    def gmm(
        self, device: DeviceInfo, tokens: int, n: int, k: int, num_experts: int, dtype: torch.dtype
    ) -> GmmConfig:
        tiles = _gmm_tiles(device, dtype)
        if tiles is None:  # not a CDNA part: the portable defaults
            return super().gmm(device, tokens, n, k, num_experts, dtype)
        experts = max(num_experts, 1)
        fitted = fit_gmm_tiles(
            tiles, max(tokens // experts, 1), n, k, rows_per_expert=tokens / experts
        )
        return _fewer_waves_for_small_tiles(fitted, device, dtype)

    def gmm_wgrad(
        self,
        device: DeviceInfo,
        rows: int,
        cols: int,
        tokens: int,
        num_experts: int,
        dtype: torch.dtype,
    ) -> GmmConfig:
        tiles = _gmm_tiles(device, dtype)
        if tiles is None:
            return super().gmm_wgrad(device, rows, cols, tokens, num_experts, dtype)
        fitted = fit_gmm_tiles(tiles, rows, cols, max(tokens // max(num_experts, 1), 1))
        return _fewer_waves_for_small_tiles(fitted, device, dtype)

    def gmm_wgrad_accumulate(
        self,
        device: DeviceInfo,
        rows: int,
        cols: int,
        tokens: int,
        num_experts: int,
        dtype: torch.dtype,
        out_dtype: torch.dtype,
    ) -> GmmConfig:
        cfg = super().gmm_wgrad_accumulate(
            device, rows, cols, tokens, num_experts, dtype, out_dtype
        )
        if _gmm_tiles(device, dtype) is None or cfg.block_m * cfg.block_n <= MAX_ACCUMULATE_TILE:
            return cfg
        narrower = dataclasses.replace(cfg, block_n=MAX_ACCUMULATE_TILE // cfg.block_m)
        return _fewer_waves_for_small_tiles(narrower, device, dtype)


def _gmm_tiles(device: DeviceInfo, dtype: torch.dtype) -> GmmConfig | None:
    if device.kind != "rocm":
        return None
    tile = arch.family(device).gmm_tiles.get(dtype_class(dtype))
    return None if tile is None else GmmConfig(**dataclasses.asdict(tile))


def operand_vgprs(cfg: GmmConfig, dtype: torch.dtype, waves: int, wave: int = 64) -> int:
    """VGPRs per lane that one K step's A and B tiles of ``cfg`` take over ``waves`` wavefronts."""
    operand_bytes = (cfg.block_m + cfg.block_n) * cfg.block_k * dtype.itemsize
    return -(-operand_bytes // (waves * wave * 4))


def _fewer_waves_for_small_tiles(
    cfg: GmmConfig, device: DeviceInfo, dtype: torch.dtype
) -> GmmConfig:
    wave = device.warp_size or arch.family(device).wavefront
    waves = max(1, cfg.block_m * cfg.block_n // (wave * MIN_ACC_PER_LANE))
    while waves < cfg.num_warps and operand_vgprs(cfg, dtype, waves, wave) > MAX_OPERAND_VGPRS:
        waves *= 2
    return dataclasses.replace(cfg, num_warps=min(cfg.num_warps, waves))
