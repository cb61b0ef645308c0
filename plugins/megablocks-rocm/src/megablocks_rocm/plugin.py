"""The ``rocm`` backend's hooks: what it provides, and where.

Provides every op of the triton backend (routing, permutation, grouped GEMM, activation) for
device kind ``"rocm"`` only, in the vendor tier (above triton's generic-accelerator tier), on
the architectures it has launch configurations for (gfx90a, gfx942, gfx950; see
:func:`megablocks_rocm.arch.unsupported`). The kernels are the triton backend's, with the same
dtype restrictions, run under :class:`megablocks_rocm.launch.RocmLaunchConfigs`. Not provided:
``torch._grouped_mm`` (on ROCm a per-group loop with host syncs, its CK path opt-in and not yet
fast) and hipBLASLt.

Importing this module needs neither triton nor a GPU (the core imports every plugin to list it).
"""

from __future__ import annotations

import dataclasses

import torch

from megablocks_core.plugin import (
    CapabilityCheck,
    CompileJob,
    CompileShape,
    DeviceInfo,
    Kernel,
    Tier,
    hookimpl,
)

from . import arch

#: Tuned for AMD's archs and measured against the triton backend's portable defaults there.
TIER = Tier.VENDOR
DEVICES = ("rocm",)


def _capability(own: CapabilityCheck | None) -> CapabilityCheck:
    if own is None:
        return arch.unsupported

    def both(device: DeviceInfo) -> str | None:  # keep any predicate the triton kernel has
        return arch.unsupported(device) or own(device)

    return both


def _rocm_kernels(triton_kernels: list[Kernel]) -> list[Kernel]:
    """Re-declare the triton backend's kernels for ROCm with this backend's policy and predicate
    (those it declares for AMD GPUs: not its NVIDIA-only variants, such as the Gluon weight
    gradient for Hopper)."""
    from .kernels import wrap  # imports triton

    return [
        dataclasses.replace(
            k,
            fn=wrap(k.fn),
            devices=DEVICES,
            tier=TIER,
            capability=_capability(k.capability),
            backend="",
        )
        for k in triton_kernels
        if k.serves_kind("rocm")
    ]


@hookimpl
def megablocks_unavailable_reason() -> str | None:
    if not torch.version.hip:
        return (
            f"torch {torch.__version__} is not a ROCm build (torch.version.hip is None); "
            "install a ROCm build of torch to use AMD GPUs"
        )
    try:
        import megablocks_triton.api  # noqa: F401  (imports triton)
    except ImportError as exc:
        return f"the triton backend cannot be imported ({exc})"
    if not torch.cuda.is_available():
        return f"no AMD GPU visible (torch built for ROCm {torch.version.hip})"
    return None


@hookimpl
def megablocks_routing_kernels() -> list[Kernel]:
    from megablocks_triton import api

    return _rocm_kernels(api.routing_kernels())


@hookimpl
def megablocks_permutation_kernels() -> list[Kernel]:
    from megablocks_triton import api

    return _rocm_kernels(api.permutation_kernels())


@hookimpl
def megablocks_grouped_gemm_kernels() -> list[Kernel]:
    from megablocks_triton import api

    return _rocm_kernels(api.grouped_gemm_kernels())


@hookimpl
def megablocks_activation_kernels() -> list[Kernel]:
    from megablocks_triton import api

    return _rocm_kernels(api.activation_kernels())


@hookimpl
def megablocks_quantization_kernels() -> list[Kernel]:
    from megablocks_triton import api

    return _rocm_kernels(api.quantization_kernels())


@hookimpl
def megablocks_compile_jobs(device: DeviceInfo, shape: CompileShape) -> list[CompileJob]:
    # The triton backend's kernels under this backend's launch policy (tiles and HIP options per
    # CDNA family), on the archs it serves.
    if device.kind != "rocm" or arch.unsupported(device) is not None:
        return []
    from megablocks_triton import api

    from .launch import RocmLaunchConfigs

    return api.compile_jobs(device, shape, RocmLaunchConfigs(device))
