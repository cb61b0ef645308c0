"""megablocks-core: Mixture-of-Experts ops with pluggable, ranked backends.

- :mod:`megablocks_core.ops` — the op surface (MegaBlocks-compatible).
- :mod:`megablocks_core.contracts` — every op's contract, written once.
- :mod:`megablocks_core.hookspecs` — the plugin interface.
- :mod:`megablocks_core.ranking` — how an implementation is chosen.
"""

__version__ = "0.1.0"

import os as _os

from . import library as _library  # noqa: F401  (registers torch.ops.megablocks.*)
from . import ops
from .descriptors import DeviceInfo, Kernel
from .dispatch import current_policy, explain, registry, reload, set_backend, use_backend
from .hookspecs import hookimpl
from .ranking import NoKernelError, Policy
from .registry import PluginLoadError
from .validation import BackendError, ContractError, ContractTypeError

if _os.environ.get("MEGABLOCKS_STRICT_PLUGINS", "") not in ("", "0"):
    # Strict mode fails fast: every plugin loads now, and one that cannot raises PluginLoadError
    # from this import rather than from the first op call.
    reload()

__all__ = [
    "BackendError", "ContractError", "ContractTypeError", "DeviceInfo", "Kernel", "NoKernelError", "PluginLoadError",
    "Policy", "__version__", "current_policy", "explain", "hookimpl", "ops", "registry", "reload",
    "set_backend", "use_backend",
]
