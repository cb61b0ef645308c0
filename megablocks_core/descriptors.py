"""The small typed records that plugins hand to the core.

A backend never registers functions one by one with the core: its hooks return
:class:`Kernel` descriptors (a :class:`KernelProblem` for one it could not build), and the core
validates them once, ranks them per call signature and caches the choice. :class:`DeviceInfo` is what capability
predicates look at; the core computes it once per device.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

#: Device kinds the core knows by name. ROCm tensors report ``device.type ==
#: "cuda"``; the core tells them apart and calls their kind ``"rocm"``.
DEVICE_KINDS = ("cpu", "cuda", "rocm", "xpu", "npu", "mps", "hpu", "meta")

#: A kernel that lists this kind serves every device; it ranks below any kernel
#: that names the device kind explicitly (the portable fallback).
ANY_DEVICE = "any"


class Tier(enum.IntEnum):
    """How strongly a kernel claims the calls it can serve: a higher tier wins; within a tier,
    cost hints decide (the whole rule: :mod:`megablocks_core.ranking`).

    A backend picks the tier from what its kernel *is*, never from another package's numbers:

    * ``PORTABLE``: plain framework code, correct everywhere (the reference; a CPU-only example).
    * ``GENERIC_ACCELERATOR``: accelerator kernels written once for several vendors (Triton), and
      the kernels that compete with them call shape by call shape through cost hints (a vendor's
      grouped-GEMM library), or rank after them until measured (``Kernel.yields_to``).
    * ``VENDOR``: one vendor's kernels measured faster than the generic ones on its hardware, for
      the calls their shape predicate accepts (megablocks-rocm's tuned launches, megablocks-cuda's
      one-launch scatter).
    * ``SPECIALISED``: a kernel for one arch or one narrow regime that should take every call its
      predicates accept, over the vendor tier too.
    """

    PORTABLE = 0
    GENERIC_ACCELERATOR = 1
    VENDOR = 2
    SPECIALISED = 3

    @property
    def label(self) -> str:
        """The name shown by the CLI: ``"generic-accelerator"``."""
        return self.name.lower().replace("_", "-")


@dataclass(frozen=True)
class DeviceInfo:
    """What a capability predicate may know about a device.

    Example for an H200: ``DeviceInfo(kind="cuda", type="cuda", index=0,
    name="NVIDIA H200", arch="sm_90", capability=(9, 0), runtime="13.0",
    warp_size=32, multiprocessors=132)``.
    """

    kind: str
    """``"cpu"``, ``"cuda"``, ``"rocm"``, ``"xpu"``, … (see :data:`DEVICE_KINDS`)."""
    type: str = "cpu"
    """The torch device type (``"cuda"`` for ROCm devices too)."""
    index: int | None = None
    name: str = ""
    """Marketing name, e.g. ``"NVIDIA H200"`` or ``"AMD Instinct MI300X"``."""
    arch: str | None = None
    """``"sm_90"`` on NVIDIA, the gfx name (``"gfx942"``) on AMD."""
    capability: tuple[int, int] | None = None
    """NVIDIA compute capability, e.g. ``(9, 0)``; None elsewhere."""
    runtime: str | None = None
    """CUDA or HIP runtime version torch was built with, e.g. ``"13.0"``."""
    warp_size: int | None = None
    """32 on NVIDIA, 64 on most AMD GPUs (the wavefront)."""
    multiprocessors: int | None = None
    """SM count on NVIDIA, CU count on AMD."""

    def __str__(self) -> str:
        where = self.kind if self.index is None else f"{self.kind}:{self.index}"
        details = ", ".join(x for x in (self.name, self.arch) if x)
        return f"{where} ({details})" if details else where


#: A capability predicate: returns None when the kernel can run on the device,
#: otherwise a short reason ("needs compute capability >= 9.0, device has 8.0").
CapabilityCheck = Callable[[DeviceInfo], "str | None"]


@dataclass(frozen=True)
class TensorMeta:
    """What a cost hint may know about one tensor argument of a call (never its data)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: str
    """The torch device type: ``"cpu"`` for host-side counts, ``"cuda"`` on GPUs."""


#: A call as a cost hint sees it: argument name → :class:`TensorMeta` for tensors (None for an
#: absent optional tensor), the value itself for ints and bools.
CallInfo = Mapping[str, Any]

#: A cost hint: the estimated run time of one call in microseconds, or None for "no estimate".
CostEstimate = Callable[[DeviceInfo, CallInfo], "float | None"]

#: A shape predicate: None when the kernel can take a call with these shapes, else the reason
#: ("K = 20 is not a multiple of 8 (16-byte rows)").
ShapeCheck = Callable[[DeviceInfo, CallInfo], "str | None"]


@dataclass(frozen=True)
class Kernel:
    """One implementation of one op, as a backend declares it.

    ``fn`` takes the op's arguments positionally, in the order of the op's
    contract (``megablocks backends contracts`` or docs/contracts.md), and
    returns what the contract says. It never needs to validate its inputs or
    handle autograd: the core has done both before calling it.

    Example::

        Kernel(op="gather", fn=my_gather, devices=("cuda",), tier=Tier.GENERIC_ACCELERATOR,
               dtypes={"x": {torch.bfloat16, torch.float16, torch.float32}},
               capability=lambda dev: None if dev.capability >= (8, 0) else "needs sm_80+")
    """

    op: str
    """Contract name, e.g. ``"gather"``."""
    fn: Callable[..., Any]
    devices: tuple[str, ...]
    """Device kinds served, e.g. ``("cuda", "rocm")``, or ``("any",)``."""
    tier: Tier = Tier.PORTABLE
    """A higher tier wins among the kernels that can serve a call (:class:`Tier` says which to
    choose); within a tier, cost hints decide."""
    capability: CapabilityCheck | None = None
    """Device-level predicate (arch range, library present); None means always."""
    dtypes: Mapping[str, frozenset[torch.dtype] | set[torch.dtype]] = field(default_factory=dict)
    """Per-argument dtype restriction, narrower than the contract's; absent means any allowed."""
    supports: ShapeCheck | None = None
    """Per-call predicate on the shapes/strides-free description of a call (alignment, layout
    limits): a call it rejects goes to the next kernel in the ranking. Runs once per new call
    shape, never per call. None: every shape the contract allows."""
    cost: CostEstimate | None = None
    """Shape-aware speed estimate (µs) for ops whose fastest kernel depends on the shapes (gmm).
    Among the eligible kernels of the highest tier, the lowest estimate wins per call shape;
    see :mod:`megablocks_core.costs` for helpers. None: rank by tier alone."""
    yields_to: tuple[str, ...] = ()
    """Backends this kernel ranks after within its tier when cost hints do not decide: a
    vendor's alternative not (yet) measured faster than, say, ``("triton",)``'s kernel, which
    still serves where that backend cannot (not installed, a dtype or shape it declines)."""
    contiguous: bool = False
    """True if ``fn`` needs contiguous tensors: the core copies strided inputs first."""
    formats: tuple[str, ...] = ()
    """For an op with a ``format`` argument (quantize, the scaled GEMMs): the formats
    (:data:`megablocks_core.formats.FORMATS`) this kernel takes; it must name at least one, and a
    call in another format goes to the next kernel in the ranking. Empty for other ops."""
    variant: str = ""
    """Optional label when a backend offers several kernels for one op (e.g. ``"cublas-loop"``)."""
    backend: str = ""
    """Filled in by the core with the plugin's name; plugins leave it empty."""

    def __post_init__(self) -> None:
        what = f"kernel for {self.op!r}" + (f" (variant {self.variant!r})" if self.variant else "")
        if not isinstance(self.tier, Tier):
            raise TypeError(
                f"{what}: tier must be a megablocks_core.plugin.Tier (PORTABLE, "
                f"GENERIC_ACCELERATOR, VENDOR, SPECIALISED), got {self.tier!r}"
            )
        if isinstance(self.yields_to, str) or not all(
            isinstance(name, str) for name in self.yields_to
        ):
            raise TypeError(f"{what}: yields_to must be a tuple of backend names")
        object.__setattr__(self, "yields_to", tuple(self.yields_to))
        if isinstance(self.formats, str) or not all(isinstance(f, str) for f in self.formats):
            raise TypeError(f"{what}: formats must be a tuple of format names")
        object.__setattr__(self, "formats", tuple(self.formats))

    @property
    def label(self) -> str:
        """``backend`` or ``backend/variant``, as shown by the CLI."""
        return f"{self.backend}/{self.variant}" if self.variant else self.backend

    @property
    def portable(self) -> bool:
        """True for kernels that serve any device (the fallback rank)."""
        return ANY_DEVICE in self.devices

    def serves_kind(self, kind: str) -> bool:
        return kind in self.devices or ANY_DEVICE in self.devices


@dataclass(frozen=True)
class KernelProblem:
    """A kernel a backend means to declare but could not build (a row of its per-op tables
    missing, a function absent): a kernel hook returns it in that kernel's place.

    The core loads the backend's other kernels; this op (variant) is not served by the backend,
    ``megablocks backends list`` and ``explain`` show the reason, the conformance kit fails the
    op, and ``MEGABLOCKS_STRICT_PLUGINS=1`` refuses to load the backend.

    Example::

        KernelProblem(op="gmm_scatter", reason="no dtypes declared for it")
    """

    op: str
    reason: str
    variant: str = ""

    @property
    def what(self) -> str:
        """``kernel for 'op'`` (with its variant), as the core's messages name it."""
        return f"kernel for {self.op!r}" + (f" (variant {self.variant!r})" if self.variant else "")
