"""The plugin API: everything a backend may import from the core, in one module.

A backend imports this module (and :mod:`megablocks_core.ops` where its kernels compose other
ops); every other module of the core is private and may change between minor versions. The
backends in this repository use nothing else, like any third-party plugin.

- :data:`hookimpl` marks the hook implementations (the hooks: :class:`BackendHooks`);
- :class:`Kernel` is what the kernel hooks return; :class:`DeviceInfo`, :class:`TensorMeta` and
  :data:`CallInfo` are what its predicates and cost hints receive;
- :func:`family_ops` and :func:`contract` say which ops exist and what each promises;
- :func:`describe_device` gives the :class:`DeviceInfo` of a torch device; :func:`arch_family`
  (:data:`ARCH_FAMILIES`) names the GPU generation of its arch, for tuning tables;
- :func:`gmm_cost_hint` makes a grouped-GEMM provider's cost hint from its measured points per
  arch (:data:`GmmPoint`; :func:`gmm_estimate_us` is the estimate it gives);
- :class:`ContractError` / :class:`ContractTypeError` are what a kernel raises for input it
  cannot serve safely (the core names the op and backend).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from types import MappingProxyType

from .contract import OpContract
from .contracts import BY_NAME, family_ops
from .costs import GmmPoint, gmm_estimate_us, gmm_problem
from .descriptors import (
    ANY_DEVICE,
    CallInfo,
    CapabilityCheck,
    CostEstimate,
    DeviceInfo,
    Kernel,
    ShapeCheck,
    TensorMeta,
)
from .devices import describe as describe_device
from .hookspecs import ENTRY_POINT_GROUP, BackendHooks, hookimpl
from .validation import ContractError, ContractTypeError


def contract(op: str) -> OpContract:
    """The contract of ``op`` (arguments in kernel order, outputs, rules, edge cases)."""
    return BY_NAME[op]


#: Device arch (:attr:`DeviceInfo.arch`) -> the GPU generation whose tuning it shares. Archs not
#: listed have no family: a backend uses its generic defaults there. "blackwell" is the
#: data-center parts (B200/GB200, B300); sm_120 (RTX 50xx, RTX PRO) has far less shared memory
#: and is not in it.
ARCH_FAMILIES: Mapping[str, str] = MappingProxyType({
    "sm_80": "ampere", "sm_86": "ampere", "sm_87": "ampere",
    "sm_89": "ada",
    "sm_90": "hopper",
    "sm_100": "blackwell", "sm_103": "blackwell",
    "gfx90a": "cdna2",  # MI200 (MI210, MI250, MI250X)
    "gfx942": "cdna3",  # MI300 (MI300X, MI300A, MI325X)
    "gfx950": "cdna4",  # MI350 (MI350X, MI355X)
})


def arch_family(device: DeviceInfo | str | None) -> str | None:
    """The family of a device or arch name (:data:`ARCH_FAMILIES`); None when it has none.

    A ROCm target id with features (``"gfx942:sramecc+:xnack-"``) is read as its gfx name.
    """
    arch = device.arch if isinstance(device, DeviceInfo) else device
    return ARCH_FAMILIES.get((arch or "").split(":")[0])


def gmm_cost_hint(points_by_arch: Mapping[str, Sequence[GmmPoint]], *,
                  device_kinds: Collection[str] | None = None,
                  host_counts_only: bool = False) -> CostEstimate:
    """The :attr:`Kernel.cost` hint of a grouped-GEMM provider (``gmm`` or ``gmm_weight_grad``).

    ``points_by_arch``: device arch -> the provider's measured points there (:data:`GmmPoint`);
    a call on an arch without points gets no estimate (priority decides). ``device_kinds``:
    estimate only on these device kinds (None: any). ``host_counts_only``: the provider reads
    ``batch_sizes`` on the host, so with device-side counts it would add a device->host sync:
    it then gives no estimate, and the choice goes to a provider that takes device counts.
    """

    def cost(device: DeviceInfo, call: CallInfo) -> float | None:
        if device_kinds is not None and device.kind not in device_kinds:
            return None
        if host_counts_only and getattr(call.get("batch_sizes"), "device", "cpu") != "cpu":
            return None
        return gmm_estimate_us(device, call, points_by_arch)

    return cost


__all__ = [
    "ANY_DEVICE",
    "ARCH_FAMILIES",
    "ENTRY_POINT_GROUP",
    "BackendHooks",
    "CallInfo",
    "CapabilityCheck",
    "ContractError",
    "ContractTypeError",
    "CostEstimate",
    "DeviceInfo",
    "GmmPoint",
    "Kernel",
    "OpContract",
    "ShapeCheck",
    "TensorMeta",
    "arch_family",
    "contract",
    "describe_device",
    "family_ops",
    "gmm_cost_hint",
    "gmm_estimate_us",
    "gmm_problem",
    "hookimpl",
]
