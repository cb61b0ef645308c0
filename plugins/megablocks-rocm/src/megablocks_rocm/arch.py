"""AMD GPU families: what each generation offers, and the HIP-only launch options per family.

This module is the backend's one table of per-arch facts (:data:`FAMILIES`): each family's gfx
archs, LDS, wavefront, HIP launch options and grouped-GEMM starting tiles; a new arch is a new
row. The tiles are plain numbers here (:class:`Tile`); :mod:`megablocks_rocm.launch` turns them
into triton's ``GmmConfig``.

Pure functions of a :class:`~megablocks_core.plugin.DeviceInfo` (no triton, no GPU), so that every
choice can be tested with simulated devices.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from megablocks_core.plugin import ARCH_LIMITS, DeviceInfo, base_arch


@dataclass(frozen=True)
class Tile:
    """A grouped-GEMM starting tile, before it is fitted to the problem (the fields of triton's
    ``GmmConfig`` that a family sets)."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class Family:
    """What the launch choices need to know about one AMD GPU generation."""

    name: str
    """``"cdna2"``, ``"cdna3"``, ``"cdna4"`` or ``"generic"``."""
    archs: tuple[str, ...]
    """The gfx names of the family (:attr:`DeviceInfo.arch` without feature suffixes)."""
    products: str
    lds_kib: int
    """Shared memory (LDS) per CU: the core's limits table (:data:`ARCH_LIMITS`)."""
    wavefront: int = 64
    kpack: int = 1
    """Triton's ``kpack`` for dot kernels; 1 = leave the default (HIPOptions warns for != 1 on
    gfx950, where kpack is deprecated)."""
    gmm_tiles: Mapping[str, Tile] = field(default_factory=lambda: MappingProxyType({}))
    """Dtype class (``"16bit"``, ``"fp32"``) -> grouped-GEMM starting tile; a class not listed
    keeps the triton backend's portable AMD tiles."""


def _lds_kib(target: str) -> int:
    return ARCH_LIMITS[target].shared_memory_per_block // 1024


# The stream pipeliner wants num_stages=2 and holds one stage of A and B tiles in LDS: 256x256x64
# 16-bit tiles take exactly the 64 KiB of a CDNA3 CU (the usual large-GEMM pick on MI300), with
# 8 wavefronts keeping the fp32 accumulator at 128 VGPRs per lane. Untested on hardware: AMD's
# published advice.
_CDNA3_TILES = MappingProxyType(
    {"16bit": Tile(256, 256, 64, 4, 8, 2), "fp32": Tile(128, 128, 32, 4, 8, 2)}
)

#: Family name -> what we know of it.
FAMILIES: Mapping[str, Family] = MappingProxyType(
    {
        # CDNA2 keeps the portable AMD tiles of the triton backend (not tuned for it yet).
        "cdna2": Family(
            "cdna2",
            ("gfx90a",),
            "MI200 (MI210, MI250, MI250X)",
            lds_kib=_lds_kib("gfx90a"),
            gmm_tiles=MappingProxyType(
                {"16bit": Tile(128, 128, 64, 4, 8, 2), "fp32": Tile(64, 64, 32, 4, 4, 2)}
            ),
        ),
        # AMD's MI300X Triton tuning guide pairs 16x16 MFMA with kpack=2 for GEMMs.
        "cdna3": Family(
            "cdna3",
            ("gfx942",),
            "MI300 (MI300X, MI300A, MI325X)",
            lds_kib=_lds_kib("gfx942"),
            kpack=2,
            gmm_tiles=_CDNA3_TILES,
        ),
        # CDNA4's 160 KiB of LDS would hold a third stage of these tiles (128 KiB: compiles within
        # limits for gfx950, the forward spill-free) or 128-deep K steps; the tile size itself is
        # bound by the register file (128 accumulator VGPRs per lane), not the LDS. Kept at
        # CDNA3's choice: whether the deeper pipeline pays is unmeasured (no MI350 run).
        "cdna4": Family(
            "cdna4",
            ("gfx950",),
            "MI350 (MI350X, MI355X)",
            lds_kib=_lds_kib("gfx950"),
            gmm_tiles=_CDNA3_TILES,
        ),
    }
)

#: Anything else with a gfx name (RDNA's wave32 parts, older CDNA): no tuning of ours.
GENERIC = Family("generic", (), "other AMD GPUs", lds_kib=64)  # the least of any CDNA/RDNA part


def family(device: DeviceInfo | str | None) -> Family:
    """The family of a device or gfx name (``"gfx942:sramecc+:xnack-"`` works too)."""
    arch = base_arch(device)
    return next((fam for fam in FAMILIES.values() if arch in fam.archs), GENERIC)


def unsupported(device: DeviceInfo) -> str | None:
    """Capability predicate of this backend's kernels: None where we have tuned configurations.

    Other archs are rejected with the reason, so the ranking falls through to the triton
    backend, whose portable defaults still serve them.
    """
    fam = family(device)
    if fam is GENERIC:
        known = ", ".join(
            f"{gfx} ({fam.products.split(' (')[0]})"
            for fam in FAMILIES.values()
            for gfx in fam.archs
        )
        return (
            f"no ROCm launch configuration for {device.arch or 'an unknown arch'} "
            f"(tuned: {known}); the triton backend's defaults serve it"
        )
    if device.warp_size not in (None, fam.wavefront):
        return f"expects {fam.wavefront}-wide wavefronts on {device.arch}, device reports {device.warp_size}"
    return None


def launch_options(device: DeviceInfo, kernel: str) -> dict[str, Any]:
    """Extra Triton launch keywords for one kernel class on ``device`` (HIP only).

    kernel: ``"routing"``, ``"permutation"``, ``"gmm"`` or ``"gmm_wgrad"``.
    """
    fam = family(device)
    if fam is GENERIC or device.kind != "rocm":  # never an AMD option anywhere else
        return {}
    if kernel in ("gmm", "gmm_wgrad"):
        # 16x16 MFMA: the gmm tiles (RocmLaunchConfigs.gmm) shrink to 64 rows for small
        # experts, where 32x32 instructions would waste half of each; waves_per_eu=2 = one
        # 8-wave workgroup per CU, so the compiler may use up to 256 VGPRs for the fp32
        # accumulator tile.
        opts: dict[str, Any] = {"matrix_instr_nonkdim": 16, "waves_per_eu": 2}
        if fam.kpack != 1:
            opts["kpack"] = fam.kpack
        return opts
    if kernel == "permutation":
        # Bandwidth-bound row copies: ask for 4 waves per SIMD (<= 128 VGPRs) to keep more loads
        # in flight; RocmLaunchConfigs sizes blocks so the fp32 accumulator fits that.
        return {"waves_per_eu": 4}
    return {}  # routing: small, latency-bound launches; the compiler's default occupancy
