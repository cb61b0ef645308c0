"""The ``triton`` backend's hooks: routing, permutation and grouped GEMM kernels for NVIDIA and AMD GPUs.

Registered under the ``megablocks.backends`` entry-point group. Importing this
module must not need triton (the core imports every plugin to list it), so
triton is imported only inside the hooks.
"""

from __future__ import annotations

import importlib
import importlib.util
import os

import torch

from megablocks_core.plugin import Kernel, family_ops, hookimpl

PRIORITY = 100

ROUTING = family_ops("routing")
PERMUTATION = family_ops("permutation")

GROUPED_GEMM = family_ops("grouped_gemm")
ACTIVATION = family_ops("activation")

_INTS = frozenset({torch.int16, torch.int32, torch.int64})
#: fp64 data is left to the reference backend (it accumulates in fp64; we use fp32).
_FLOATS = frozenset({torch.float16, torch.bfloat16, torch.float32})

_ROUTING_DTYPES: dict[str, dict[str, frozenset[torch.dtype]]] = {
    "sort": {"x": _INTS},
    "histogram": {"x": _INTS},
    "inclusive_cumsum": {"x": _INTS},
    "exclusive_cumsum": {"x": _INTS},
    "topology": {"padded_bins": _INTS},
    "replicate": {"x": _FLOATS | _INTS, "bins": _INTS},
    "replicate_backward": {"grad": _FLOATS, "bins": _INTS},
    "route": {"top_experts": _INTS},
    "router_topk": {"scores": _FLOATS},
}

_ACTIVATION_DTYPES: dict[str, dict[str, frozenset[torch.dtype]]] = {
    "glu": {"x": _FLOATS},
    "glu_backward": {"grad": _FLOATS, "x": _FLOATS},
    "activation_backward": {"grad": _FLOATS, "x": _FLOATS},
}

# Weights keep the contract's full float set: the kernels load any float and scale in fp32.
_PERMUTATION_DTYPES: dict[str, dict[str, frozenset[torch.dtype]]] = {
    op: {"x": _FLOATS, **({"grad": _FLOATS} if op.endswith("wgrad") else {})} for op in PERMUTATION
}


def _gmm_dtypes() -> dict[str, dict[str, frozenset[torch.dtype]]]:
    # Triton 3.6's interpreter multiplies bf16 tiles as raw 16-bit integers: on the CPU
    # (interpreter) path bf16 goes to the reference backend instead.
    floats = _FLOATS - {torch.bfloat16} if _interpret() else _FLOATS
    return {
        "gmm": {"a": floats, "b": floats},
        "gmm_weight_grad": {"a": floats, "grad": floats},
        # out: a's dtype or float32 (the contract's rule); float64 is left to the reference.
        "gmm_weight_grad_accumulate": {"a": floats, "grad": floats, "out": _FLOATS},
        "gather_gmm": {"x": floats, "b": floats},
        "gmm_scatter": {"x": floats, "b": floats},
    }


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _devices() -> tuple[str, ...]:
    # The interpreter runs the same kernels on CPU tensors (slowly): for tests.
    return ("cuda", "rocm", "cpu") if _interpret() else ("cuda", "rocm")


def _kernels(
    module_name: str, ops: tuple[str, ...], dtypes: dict[str, dict[str, frozenset[torch.dtype]]]
) -> list[Kernel]:
    if importlib.util.find_spec("triton") is None:  # megablocks_unavailable_reason says so
        return []
    module = importlib.import_module(f"megablocks_triton.{module_name}")
    from . import tuning  # measured speed: lets the core pick per shape among equal priorities

    return [
        Kernel(
            op=op,
            fn=getattr(module, op),
            devices=_devices(),
            priority=PRIORITY,
            dtypes=dtypes[op],
            contiguous=True,
            cost=tuning.COST_HINTS.get(op),
            supports=getattr(module, f"{op}_supports", None),  # a kernel's own shape limits
        )
        for op in ops
    ]


def _interpreter_problem() -> str | None:
    """Triton <= 3.6's interpreter breaks on numpy >= 2.4 (loops with tensor bounds call int() on
    a 1-element array: triton-lang/triton#9171); say so instead of failing inside a kernel."""
    import triton  # type: ignore[import-untyped]
    from packaging.version import Version

    try:
        import numpy
    except ImportError:
        return "TRITON_INTERPRET=1 needs numpy"

    if Version(triton.__version__).release <= (3, 6) and Version(numpy.__version__).release >= (
        2,
        4,
    ):
        return (
            f"TRITON_INTERPRET=1 needs numpy < 2.4 with triton {triton.__version__} "
            f"(numpy {numpy.__version__} is installed; triton-lang/triton#9171)"
        )
    return None


@hookimpl
def megablocks_unavailable_reason() -> str | None:
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        return f"triton cannot be imported ({exc})"
    if _interpret():
        return _interpreter_problem()
    if not torch.cuda.is_available():
        return "no CUDA/ROCm GPU visible (set TRITON_INTERPRET=1 to run on CPU, slowly)"
    return None


@hookimpl
def megablocks_routing_kernels() -> list[Kernel]:
    return _kernels("routing", ROUTING, _ROUTING_DTYPES)


@hookimpl
def megablocks_permutation_kernels() -> list[Kernel]:
    return _kernels("permutation", PERMUTATION, _PERMUTATION_DTYPES)


@hookimpl
def megablocks_grouped_gemm_kernels() -> list[Kernel]:
    return _kernels("gmm", GROUPED_GEMM, _gmm_dtypes())


@hookimpl
def megablocks_activation_kernels() -> list[Kernel]:
    return _kernels("activation", ACTIVATION, _ACTIVATION_DTYPES)
