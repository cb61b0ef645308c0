"""Device descriptions: what kind of device a tensor lives on, computed once per device."""

from __future__ import annotations

import functools

import torch

from .descriptors import DeviceInfo


def _accelerator_info(device: torch.device) -> DeviceInfo:
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    warp_size = getattr(props, "warp_size", None)
    if torch.version.hip:  # ROCm builds report device.type == "cuda"
        arch = getattr(props, "gcnArchName", "").split(":")[0] or None
        return DeviceInfo(
            kind="rocm", type="cuda", index=index, name=props.name, arch=arch,
            runtime=str(torch.version.hip), warp_size=warp_size or 64,
            multiprocessors=props.multi_processor_count,
        )
    return DeviceInfo(
        kind="cuda", type="cuda", index=index, name=props.name, arch=f"sm_{props.major}{props.minor}",
        capability=(props.major, props.minor), runtime=torch.version.cuda,
        warp_size=warp_size or 32, multiprocessors=props.multi_processor_count,
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


def local_devices() -> list[DeviceInfo]:
    """Every device of this host that the core knows how to describe."""
    found = [describe("cpu")]
    if torch.cuda.is_available():
        found += [describe(torch.device("cuda", i)) for i in range(torch.cuda.device_count())]
    return found
