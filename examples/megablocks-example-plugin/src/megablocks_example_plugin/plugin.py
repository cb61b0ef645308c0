"""The hooks the core calls once, when it loads its registry (never per op call)."""

from __future__ import annotations

import torch

from megablocks_core.plugin import CompileJob, CompileShape, DeviceInfo, Kernel, Tier, hookimpl

from . import kernels

#: Plain torch code, like the reference, so the same tier; these kernels name the CPU where the
#: reference serves "any" device, so on the CPU they rank above it where their dtypes allow (and
#: below any accelerator-tier kernel, e.g. triton's under its interpreter).
TIER = Tier.PORTABLE

#: Narrower than the contract (which also allows int16): int16 calls go to another backend.
KEYS = frozenset({torch.int32, torch.int64})


def cpu_only(device: DeviceInfo) -> str | None:
    """Capability predicate: None if the kernel can run on ``device``, else the reason it cannot.

    ``devices=("cpu",)`` already limits these kernels to CPUs; an accelerator backend would look at
    ``device.capability`` (e.g. ``>= (9, 0)``), ``device.arch`` or ``device.warp_size`` here.
    """
    return None if device.kind == "cpu" else f"runs on CPUs only, not {device.kind}"


@hookimpl
def megablocks_routing_kernels() -> list[Kernel]:
    return [
        Kernel(
            op="histogram",
            fn=kernels.histogram,
            devices=("cpu",),
            tier=TIER,
            capability=cpu_only,
            dtypes={"x": KEYS},
        ),
        Kernel(
            op="inclusive_cumsum",
            fn=kernels.inclusive_cumsum,
            devices=("cpu",),
            tier=TIER,
            capability=cpu_only,
            dtypes={"x": KEYS},
        ),
    ]


@hookimpl
def megablocks_unavailable_reason() -> str | None:
    # Host-wide facts only (a missing library or driver); this example needs nothing beyond torch.
    return None


@hookimpl
def megablocks_compile_jobs(device: DeviceInfo, shape: CompileShape) -> list[CompileJob]:
    # Ahead-of-time compilation (``megablocks backends compile``) is for GPU kernels: these are
    # torch code for the CPU, so there is nothing to compile for any target. A backend with
    # Triton kernels returns one CompileJob per kernel variant its launches would use on
    # ``device`` (docs/writing-a-plugin.md, "The compile gate").
    return []
