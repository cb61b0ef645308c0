"""Devices: what kind of device a tensor lives on (computed once per device), and per-arch facts.

The facts every backend may share live here, once: the family of a GPU arch's name. Tuning
facts (tiles, launch options, a backend's measured speed and the dense matmul rate its cost hints
measure against) belong to the backend that measured them, in its own per-arch table
(docs/writing-a-plugin.md, "Extension paths").
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from types import MappingProxyType

import torch

from .descriptors import DeviceInfo


def _accelerator_info(device: torch.device) -> DeviceInfo:
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    warp_size = getattr(props, "warp_size", None)
    if torch.version.hip:  # ROCm builds report device.type == "cuda"
        arch = getattr(props, "gcnArchName", "").split(":")[0] or None
        return DeviceInfo(
            kind="rocm",
            type="cuda",
            index=index,
            name=props.name,
            arch=arch,
            runtime=str(torch.version.hip),
            warp_size=warp_size or 64,
            multiprocessors=props.multi_processor_count,
        )
    return DeviceInfo(
        kind="cuda",
        type="cuda",
        index=index,
        name=props.name,
        arch=f"sm_{props.major}{props.minor}",
        capability=(props.major, props.minor),
        runtime=torch.version.cuda,
        warp_size=warp_size or 32,
        multiprocessors=props.multi_processor_count,
    )


@functools.cache
def describe(device: torch.device | str) -> DeviceInfo:
    """Describe ``device`` (cached: every later call is a dict lookup)."""
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"device {device} is not available: torch sees no CUDA/ROCm device")
        return _accelerator_info(device)
    if device.type == "cpu":
        return DeviceInfo(kind="cpu", type="cpu", name="CPU")
    return DeviceInfo(kind=device.type, type=device.type, index=device.index)


#: GPU arch → its architecture family (a gfx name's feature suffix, e.g. ``:xnack-``, is ignored).
ARCH_FAMILIES: Mapping[str, str] = MappingProxyType(
    {
        "sm_80": "ampere",
        "sm_86": "ampere",
        "sm_87": "ampere",
        "sm_89": "ada",
        "sm_90": "hopper",
        # Data-center Blackwell (B200/GB200, B300); sm_120 (RTX 50xx) has far less shared memory.
        "sm_100": "blackwell",
        "sm_103": "blackwell",
        "gfx90a": "cdna2",  # MI200 (MI210, MI250, MI250X)
        "gfx942": "cdna3",  # MI300 (MI300X, MI300A, MI325X)
        "gfx950": "cdna4",  # MI350 (MI350X, MI355X)
    }
)


def base_arch(device: DeviceInfo | str | None) -> str:
    """The arch name of a device (or arch string) without feature suffixes: ``"gfx942"`` for
    ``"gfx942:sramecc+:xnack-"``; ``""`` when unknown."""
    arch = device.arch if isinstance(device, DeviceInfo) else device
    return (arch or "").split(":")[0]


def arch_family(device: DeviceInfo | str | None) -> str | None:
    """The family of a device's arch (``"cdna3"`` for gfx942), or None for an arch not listed in
    :data:`ARCH_FAMILIES`."""
    return ARCH_FAMILIES.get(base_arch(device))
