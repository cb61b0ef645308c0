"""What the reference backend provides: every op, on any device, in the lowest tier.

Its kernels are ``Tier.PORTABLE`` and name no device kind (``("any",)``), so they rank below
every other kernel that can serve a call and serve only where nothing faster can (the core
reports that fallback).

The ops are listed here, per family, rather than taken from the core's list: a core that adds
an op still loads this plugin (which then simply does not provide the new op), and a test
demands that the list covers every op of the core it is tested with.
"""

from __future__ import annotations

from megablocks_core.plugin import SCALED_FORMATS, Kernel, Tier, hookimpl

from . import kernels, scaled

TIER = Tier.PORTABLE

#: Family → the ops this backend provides; kernels.py (scaled.py for the low-precision ops) has
#: one function per op, named after it.
OPS: dict[str, tuple[str, ...]] = {
    "routing": (
        "sort",
        "histogram",
        "inclusive_cumsum",
        "exclusive_cumsum",
        "topology",
        "replicate",
        "replicate_backward",
        "route",
        "router_topk",
    ),
    "permutation": (
        "gather",
        "scatter",
        "scatter_wgrad",
        "padded_gather",
        "padded_scatter",
        "padded_scatter_wgrad",
        "binned_gather",
        "binned_scatter",
        "binned_scatter_wgrad",
        "moe_permute_map",
        "moe_permute",
        "moe_permute_probs",
        "moe_unpermute",
        "moe_unpermute_wgrad",
        "moe_sort_chunks",
    ),
    "grouped_gemm": (
        "gmm",
        "gmm_weight_grad",
        "gmm_weight_grad_accumulate",
        "gather_gmm",
        "gmm_scatter",
        "scaled_gmm",
        "scaled_gather_gmm",
        "scaled_gmm_scatter",
        "scaled_gmm_weight_grad",
    ),
    "activation": ("glu", "glu_backward", "activation_backward"),
    "quantization": (
        "quantize",
        "quantize_both_ways",
        "quantize_transposed",
        "gather_quantize_transposed",
    ),
}

#: The low-precision ops (their module: scaled.py), in every format the core defines.
SCALED_OPS = frozenset(
    {
        "quantize",
        "quantize_both_ways",
        "quantize_transposed",
        "gather_quantize_transposed",
        "scaled_gmm",
        "scaled_gather_gmm",
        "scaled_gmm_scatter",
        "scaled_gmm_weight_grad",
    }
)


def _kernel(op: str) -> Kernel:
    if op in SCALED_OPS:
        fn = getattr(scaled, op)
        return Kernel(op=op, fn=fn, devices=("any",), tier=TIER, formats=tuple(SCALED_FORMATS))
    return Kernel(op=op, fn=getattr(kernels, op), devices=("any",), tier=TIER)


def _kernels(family: str) -> list[Kernel]:
    return [_kernel(op) for op in OPS[family]]


@hookimpl
def megablocks_routing_kernels() -> list[Kernel]:
    return _kernels("routing")


@hookimpl
def megablocks_permutation_kernels() -> list[Kernel]:
    return _kernels("permutation")


@hookimpl
def megablocks_grouped_gemm_kernels() -> list[Kernel]:
    return _kernels("grouped_gemm")


@hookimpl
def megablocks_activation_kernels() -> list[Kernel]:
    return _kernels("activation")


@hookimpl
def megablocks_quantization_kernels() -> list[Kernel]:
    return _kernels("quantization")
