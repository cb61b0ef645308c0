"""The triton backend's kernels, run under this backend's launch policy for the call's device."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from megablocks_triton.api import use_launch_configs

from megablocks_core.plugin import describe_device

from .launch import RocmLaunchConfigs

# torch.device -> policy: one dict lookup per call once a device has been seen.
_BY_DEVICE: dict[torch.device, RocmLaunchConfigs] = {}


def configs_for(device: torch.device) -> RocmLaunchConfigs:
    """The launch policy for a device (built once per device from the core's description)."""
    found = _BY_DEVICE.get(device)
    if found is None:
        found = _BY_DEVICE[device] = RocmLaunchConfigs(describe_device(device))
    return found


def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with this backend's launch policy in force for the duration of the call.

    Every op's first kernel argument is its primary tensor (the contracts' order), so its device
    is the call's device. Scoped (a ContextVar), not process-wide: the triton backend's own
    kernels keep the portable defaults, e.g. when a user forces ``MEGABLOCKS_BACKEND=triton``.
    """

    @functools.wraps(fn)
    def run(*args: Any) -> Any:
        with use_launch_configs(configs_for(args[0].device)):
            return fn(*args)

    return run
