"""Launch shapes for the Triton kernels on AMD GPUs (64-wide wavefronts, CU counts).

:class:`RocmLaunchConfigs` is a :class:`megablocks_triton.config.LaunchConfigs` for one device:
a pure function of its :class:`~megablocks_core.plugin.DeviceInfo`, so tests build it for simulated
MI200/MI300/MI350 devices. The grouped-GEMM tiles stay those of ``megablocks_triton.gmm.CONFIGS``
(which has CDNA entries); this policy adds the HIP launch options for the dot kernels.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import triton
from megablocks_triton.config import KERNEL_KINDS, LaunchConfigs, PermutationConfig, RoutingConfig

from megablocks_core.plugin import DeviceInfo

from . import arch


def _pow2(x: int) -> int:
    return triton.next_power_of_2(max(int(x), 1))


def _pow2_floor(x: int) -> int:
    return 1 << (max(int(x), 1).bit_length() - 1)


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
        return RoutingConfig(tile=tile, chunk=base.chunk, tile_rows=base.tile_rows, num_warps=4,
                             prescan=False)

    def histogram_block(self, n: int) -> int:
        return min(max(_pow2(n // _pow2_floor(self.cus)), 256), 4096)

    def permutation(self, num_tokens: int, hidden: int, top_k: int,
                    element_size: int) -> PermutationConfig:
        # Rows up to 8K elements per block (not 16K): waves_per_eu=4 caps VGPRs at 128, and the
        # fp32 top-k accumulator must stay <= 32 elements per lane.
        block_h = min(_pow2(hidden), 8192)
        split_h = triton.cdiv(hidden, block_h)
        # Few tokens: split rows until there are >= 4 programs per CU (1216 on an MI300X).
        while num_tokens * split_h < 4 * self.cus and block_h > 512:
            block_h //= 2
            split_h = triton.cdiv(hidden, block_h)
        # A wavefront moves 64 lanes x 16 bytes = 1 KiB per vector load; aim at ~4 loads per lane,
        # and enough lanes that each holds <= 32 accumulator elements.
        per_lane_cap = block_h // (32 * self.wave)
        num_warps = min(8, max(2, block_h * element_size // (4 * 16 * self.wave), per_lane_cap))
        return PermutationConfig(block_h=block_h, split_h=split_h, zero_rows=16,
                                 num_warps=num_warps)

    def wgrad(self, num_tokens: int, hidden: int, top_k: int,
              element_size: int) -> PermutationConfig:
        k_pad = _pow2(top_k)
        # (k_pad x block_h) fp32 partial dots per program: <= 4K elements, i.e. <= 16 per lane
        # over 4 wavefronts (half the NVIDIA tile: wave64 doubles the lanes per warp).
        block_h = min(_pow2(hidden), max(4096 // k_pad, 256), 4096)
        h_blocks = triton.cdiv(hidden, block_h)
        split_h = 1
        while num_tokens * split_h < 2 * self.cus and split_h * 2 <= h_blocks:
            split_h *= 2
        num_warps = 4 if k_pad * block_h >= 2048 else 2
        return PermutationConfig(block_h=block_h, split_h=split_h, zero_rows=16,
                                 num_warps=num_warps)
