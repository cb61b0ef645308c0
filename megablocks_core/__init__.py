"""megablocks-core: Mixture-of-Experts ops with pluggable, ranked backends.

- :mod:`megablocks_core.ops` — the op surface (MegaBlocks-compatible).
- :mod:`megablocks_core.contracts` — every op's contract, written once.
- :mod:`megablocks_core.plugin` — what a backend may import (the plugin API).
- :mod:`megablocks_core.ranking` — how an implementation is chosen.
- :mod:`megablocks_core.layers` — a dropless MoE layer built on the ops.
- :func:`fuse_grad_accumulation` — opt expert weights in to gradient-accumulation fusion.
"""

__version__ = "0.1.0"

import os as _os

from . import ops
from .autograd import fuse_grad_accumulation, is_grad_accumulation_fused
from .descriptors import DeviceInfo, Kernel, Tier
from .dispatch import explain, registry, reload
from .hookspecs import hookimpl
from .policy import Policy, current_policy, set_backend, use_backend
from .ranking import NoKernelError
from .registry import PluginLoadError
from .validation import BackendError, ContractError, ContractTypeError

if _os.environ.get("MEGABLOCKS_STRICT_PLUGINS", "") not in ("", "0"):
    # Strict mode fails fast: every plugin loads now, and one that cannot raises PluginLoadError
    # from this import rather than from the first op call.
    reload()

__all__ = [
    "BackendError",
    "ContractError",
    "ContractTypeError",
    "DeviceInfo",
    "Kernel",
    "NoKernelError",
    "PluginLoadError",
    "Policy",
    "Tier",
    "__version__",
    "current_policy",
    "explain",
    "fuse_grad_accumulation",
    "hookimpl",
    "is_grad_accumulation_fused",
    "ops",
    "registry",
    "reload",
    "set_backend",
    "use_backend",
]
