"""The triton backend's stable surface for other plugins that reuse its kernels.

A vendor plugin (``megablocks-rocm`` is one) may serve this backend's Triton kernels on its own
devices under its own launch parameters. Everything it needs is here, and only here: every other
module of ``megablocks_triton`` is private and may change between minor versions (a test of this
repository rejects a plugin that imports one). Importing this module imports triton.

What is stable:

* **The kernel declarations**, per hook family: :func:`routing_kernels`,
  :func:`permutation_kernels`, :func:`grouped_gemm_kernels`, :func:`activation_kernels` return
  the :class:`~megablocks_core.plugin.Kernel` descriptors this backend's hooks return (devices,
  tier, dtypes, cost hints and shape limits included; NVIDIA-only variants such as the Gluon
  weight gradient declare ``devices=("cuda",)``: keep those whose devices serve yours). They are plain functions, not hook
  implementations, so they are safe to import into another plugin's module. A kernel this
  backend could not declare (its hook returns a ``KernelProblem`` in its place) is left out:
  the triton backend's own record reports it.
* **The launch policy**: every launch asks :func:`launch_configs` for its block sizes, tiles and
  extra launch keywords. :class:`LaunchConfigs` is the default policy, meant to be subclassed;
  its methods (``routing``, ``histogram_block``, ``permutation``, ``scatter_wgrad``, ``gmm``,
  ``gmm_wgrad``, ``gmm_wgrad_accumulate``, ``launch_options`` for each of :data:`KERNEL_KINDS`,
  …) return the config records :class:`RoutingConfig`, :class:`PermutationConfig` and
  :class:`GmmConfig`. :class:`use_launch_configs` puts a policy in force for a block of code
  (context-local), :func:`set_launch_configs` process-wide. The helpers the default policy is
  built from are here for a subclass to build on: :func:`dtype_class`, :func:`fit_gmm_tiles`,
  :func:`permutation_wgrad_shape`, :func:`cdiv`, :func:`next_power_of_2`.
* **The compile jobs**: :func:`compile_jobs` (``device, shape, configs``) gives what the
  ``megablocks_compile_jobs`` hook needs, every kernel variant the launch path would run on a
  simulated device under the policy ``configs``.

How a vendor plugin uses it::

    import dataclasses
    from megablocks_core.plugin import Tier, hookimpl
    from megablocks_triton import api

    class MyLaunchConfigs(api.LaunchConfigs):
        def launch_options(self, kernel):
            return {"waves_per_eu": 2} if kernel == "gmm" else {}

    def _under_my_policy(fn):
        def run(*args):
            with api.use_launch_configs(MyLaunchConfigs()):
                return fn(*args)
        return run

    @hookimpl
    def megablocks_grouped_gemm_kernels():
        return [
            dataclasses.replace(k, fn=_under_my_policy(k.fn), devices=("rocm",), tier=Tier.VENDOR)
            for k in api.grouped_gemm_kernels()
            if k.serves_kind("rocm")
        ]

The re-labelled kernels keep the triton backend's dtypes and shape limits; declare them in the
vendor tier (above this backend's generic-accelerator tier) on the devices the policy is tuned
for, with a capability predicate that rejects the others, so the ranking falls through to the
triton backend's portable defaults there.
"""

from __future__ import annotations

from collections.abc import Sequence

from megablocks_core.plugin import Kernel, KernelProblem

from . import plugin as _plugin
from .aot import compile_jobs
from .config import (
    KERNEL_KINDS,
    GmmConfig,
    LaunchConfigs,
    PermutationConfig,
    RoutingConfig,
    dtype_class,
    fit_gmm_tiles,
    launch_configs,
    permutation_wgrad_shape,
    set_launch_configs,
    use_launch_configs,
)
from .launch import cdiv, next_power_of_2

__all__ = [
    "KERNEL_KINDS",
    "GmmConfig",
    "LaunchConfigs",
    "PermutationConfig",
    "RoutingConfig",
    "activation_kernels",
    "cdiv",
    "compile_jobs",
    "dtype_class",
    "fit_gmm_tiles",
    "grouped_gemm_kernels",
    "launch_configs",
    "next_power_of_2",
    "permutation_kernels",
    "permutation_wgrad_shape",
    "quantization_kernels",
    "routing_kernels",
    "set_launch_configs",
    "use_launch_configs",
]


def _declared(items: Sequence[Kernel | KernelProblem]) -> list[Kernel]:
    return [k for k in items if isinstance(k, Kernel)]


# Wrappers rather than aliases of the hook implementations: an alias would carry pluggy's marker
# into the importing plugin's module under a name that is no hook.
def routing_kernels() -> list[Kernel]:
    """The triton backend's routing kernels, as its ``megablocks_routing_kernels`` declares them."""
    return _declared(_plugin.megablocks_routing_kernels())


def permutation_kernels() -> list[Kernel]:
    """The triton backend's permutation kernels (MegaBlocks' and Megatron-Core's)."""
    return _declared(_plugin.megablocks_permutation_kernels())


def grouped_gemm_kernels() -> list[Kernel]:
    """The triton backend's grouped-GEMM kernels (the fused ``gather_gmm``/``gmm_scatter`` too)."""
    return _declared(_plugin.megablocks_grouped_gemm_kernels())


def quantization_kernels() -> list[Kernel]:
    """The triton backend's quantization kernels, as its ``megablocks_quantization_kernels``
    declares them."""
    return _declared(_plugin.megablocks_quantization_kernels())


def activation_kernels() -> list[Kernel]:
    """The triton backend's activation kernels (``glu`` and the activations' backward)."""
    return _declared(_plugin.megablocks_activation_kernels())
