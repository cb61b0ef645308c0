"""Per-arch hardware limits: the one table that kernels are checked against.

It lives in the core, not in a backend, because two places need the same numbers: the
ahead-of-time compile gate (``megablocks backends compile``, :mod:`megablocks_core.aot`), which
checks every backend's compiled kernels without the chip, and a backend's launch path, which
refuses a forced configuration over a limit on a real device (e.g. the triton backend's
``MEGABLOCKS_TRITON_GMM_CONFIG``). The core keeps only what a check needs: resource limits, the
compiler target, and enough of a product's description (CU/SM count, wavefront width) for a
backend's launch policy to choose for that arch as it would on the device. Tuning facts (which
tiles suit an arch) stay in the backends.

Figures are the vendors' published limits (CUDA programming guide, compute capability tables;
AMD CDNA2/3/4 ISA guides).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal

from .descriptors import DeviceInfo
from .devices import base_arch

KIB = 1024


@dataclass(frozen=True)
class ArchLimits:
    """What one GPU arch allows a kernel (a block / workgroup) to use."""

    target: str
    """The compiler target: ``"gfx942"``, ``"sm_90a"`` (what ``megablocks backends compile
    --target`` takes)."""
    vendor: Literal["amd", "nvidia"]
    arch: str
    """The arch a :class:`DeviceInfo` of this GPU reports (``"gfx942"``, ``"sm_90"``)."""
    product: str
    """The product the simulated device stands for (its CU/SM count)."""
    multiprocessors: int
    warp_size: int
    shared_memory_per_block: int
    """Bytes of shared memory (LDS) one block (workgroup) may use."""
    shared_memory_per_sm: int
    """Bytes of shared memory (LDS) per SM (CU): bounds how many blocks run together."""
    registers_per_thread: int
    """NVIDIA: 32-bit registers per thread. CDNA: VGPRs + AGPRs per lane of a wavefront."""
    registers_per_sm: int
    """NVIDIA: the 32-bit register file of an SM. CDNA: VGPRs (+ AGPRs) per lane of one SIMD,
    shared by the wavefronts resident on it."""
    max_warps_per_sm: int
    """NVIDIA: resident warps per SM. CDNA: resident wavefronts per SIMD."""
    capability: tuple[int, int] | None = None

    @property
    def backend(self) -> str:
        """Triton's name for the compiler backend: ``"hip"`` or ``"cuda"``."""
        return "hip" if self.vendor == "amd" else "cuda"

    def triton_target(self) -> Any:
        """Triton's ``GPUTarget`` for this arch (imports triton)."""
        from triton.backends.compiler import GPUTarget  # type: ignore[import-untyped]

        if self.vendor == "amd":
            return GPUTarget("hip", self.target, self.warp_size)
        assert self.capability is not None
        return GPUTarget("cuda", self.capability[0] * 10 + self.capability[1], self.warp_size)

    def device(self) -> DeviceInfo:
        """A description of this GPU as :func:`megablocks_core.plugin.describe_device` would
        report it, for choosing launches for it on a host without it."""
        return DeviceInfo(
            kind="rocm" if self.vendor == "amd" else "cuda",
            type="cuda",
            index=0,
            name=f"{self.product} (simulated)",
            arch=self.arch,
            capability=self.capability,
            warp_size=self.warp_size,
            multiprocessors=self.multiprocessors,
        )

    def occupancy(self, num_warps: int, registers: int, shared: int) -> int:
        """Resident warps per SM (NVIDIA) or wavefronts per SIMD (AMD) of a kernel using
        ``registers`` per thread/lane and ``shared`` bytes per block: an estimate from the register
        file and shared memory alone (allocation granules rounded, no other limits)."""
        if self.vendor == "nvidia":
            per_warp = -(-max(registers, 1) * 32 // 256) * 256  # allocated per warp, 256 at a time
            by_registers = self.registers_per_sm // (per_warp * num_warps)
            by_shared = self.shared_memory_per_sm // shared if shared else 32
            blocks = min(by_registers, by_shared, 32, self.max_warps_per_sm // num_warps)
            return max(blocks, 0) * num_warps
        per_wave = -(-max(registers, 1) // 8) * 8  # VGPRs are allocated 8 at a time
        by_registers = self.registers_per_sm // per_wave
        waves_per_simd = -(-num_warps // 4)  # a workgroup's wavefronts spread over 4 SIMDs
        by_shared = (self.shared_memory_per_sm // shared) * waves_per_simd if shared else 64
        return max(min(by_registers, by_shared, self.max_warps_per_sm), 0)


def _nvidia(
    target: str, product: str, sms: int, capability: tuple[int, int], per_block_kib: int
) -> ArchLimits:
    return ArchLimits(
        target=target,
        vendor="nvidia",
        arch=f"sm_{capability[0]}{capability[1]}",
        product=product,
        multiprocessors=sms,
        warp_size=32,
        shared_memory_per_block=per_block_kib * KIB,
        shared_memory_per_sm=(per_block_kib + 1) * KIB,  # 1 KiB per block is the driver's
        registers_per_thread=255,
        registers_per_sm=65536,
        max_warps_per_sm=64,
        capability=capability,
    )


def _cdna(target: str, product: str, cus: int, lds_kib: int) -> ArchLimits:
    return ArchLimits(
        target=target,
        vendor="amd",
        arch=target,
        product=product,
        multiprocessors=cus,
        warp_size=64,
        shared_memory_per_block=lds_kib * KIB,
        shared_memory_per_sm=lds_kib * KIB,
        registers_per_thread=512,  # 256 VGPRs + 256 AGPRs (CDNA2); one unified 512 (CDNA3/4)
        registers_per_sm=512,
        max_warps_per_sm=8,
    )


#: Compiler target → its limits. The products set the simulated device's CU/SM count.
LIMITS: Mapping[str, ArchLimits] = MappingProxyType(
    {
        "gfx90a": _cdna("gfx90a", "AMD Instinct MI250X (one GCD)", 110, lds_kib=64),
        "gfx942": _cdna("gfx942", "AMD Instinct MI300X", 304, lds_kib=64),
        "gfx950": _cdna("gfx950", "AMD Instinct MI355X", 256, lds_kib=160),
        "sm_80": _nvidia("sm_80", "NVIDIA A100", 108, (8, 0), per_block_kib=163),
        "sm_90a": _nvidia("sm_90a", "NVIDIA H200", 132, (9, 0), per_block_kib=227),
        "sm_100a": _nvidia("sm_100a", "NVIDIA B200", 148, (10, 0), per_block_kib=227),
    }
)

#: Other spellings of a target: a device's arch name (``sm_90``) names its compiler target.
ALIASES: Mapping[str, str] = MappingProxyType({"sm_90": "sm_90a", "sm_100": "sm_100a"})


def limits(target: str) -> ArchLimits:
    """The limits of a compiler target or arch name (``"gfx942"``, ``"sm_90a"``, ``"sm_90"``);
    ValueError naming the known ones otherwise."""
    found = LIMITS.get(ALIASES.get(target, target))
    if found is None:
        raise ValueError(f"unknown target {target!r} (known: {', '.join(LIMITS)})")
    return found


def device_limits(device: DeviceInfo) -> ArchLimits | None:
    """The limits of a device's arch, or None for an arch not in :data:`LIMITS`. A table entry
    describes one product: the device's own CU/SM count is kept."""
    arch = base_arch(device)
    found = LIMITS.get(ALIASES.get(arch, arch))
    if found is None or found.arch != arch:
        return None
    if device.multiprocessors:
        found = dataclasses.replace(found, multiprocessors=device.multiprocessors)
    return found
