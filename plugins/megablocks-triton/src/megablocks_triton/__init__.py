"""Triton backend for megablocks-core (NVIDIA and AMD GPUs; CPU via TRITON_INTERPRET=1).

The kernel functions take the op contracts' positional arguments and assume
validated, contiguous inputs on one device (the core checks and copies).
:func:`route` (the whole routing metadata in one or two launches) and :func:`router_topk` (a
router's top-k in one launch) are extras beyond MegaBlocks' ops.

Another plugin that reuses these kernels (e.g. under its own launch policy) imports
:mod:`megablocks_triton.api` and nothing else of this package.
"""

from __future__ import annotations

from typing import Any

# Submodules import triton; resolve names lazily so that importing the package
# (e.g. for the plugin entry point) works, and can report why, without triton.
_EXPORTS = {
    "LaunchConfigs": "config",
    "launch_configs": "config",
    "set_launch_configs": "config",
    **dict.fromkeys(
        [
            "binned_gather",
            "binned_scatter",
            "binned_scatter_wgrad",
            "gather",
            "padded_gather",
            "padded_scatter",
            "padded_scatter_wgrad",
            "scatter",
            "scatter_wgrad",
        ],
        "permutation",
    ),
    **dict.fromkeys(
        [
            "exclusive_cumsum",
            "histogram",
            "inclusive_cumsum",
            "replicate",
            "replicate_backward",
            "route",
            "router_topk",
            "sort",
            "topology",
        ],
        "routing",
    ),
    **dict.fromkeys(["activation_backward", "glu", "glu_backward"], "activation"),
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__version__ = "0.1.0"

__all__ = [
    "LaunchConfigs",
    "activation_backward",
    "binned_gather",
    "binned_scatter",
    "binned_scatter_wgrad",
    "exclusive_cumsum",
    "gather",
    "glu",
    "glu_backward",
    "histogram",
    "inclusive_cumsum",
    "launch_configs",
    "padded_gather",
    "padded_scatter",
    "padded_scatter_wgrad",
    "replicate",
    "replicate_backward",
    "route",
    "router_topk",
    "scatter",
    "scatter_wgrad",
    "set_launch_configs",
    "sort",
    "topology",
]
