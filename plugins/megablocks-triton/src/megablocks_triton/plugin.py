"""The ``triton`` backend's hooks: routing, permutation and grouped GEMM kernels for NVIDIA and AMD GPUs.

Registered under the ``megablocks.backends`` entry-point group. Importing this
module must not need triton (the core imports every plugin to list it), so
triton is imported only inside the hooks.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from megablocks_core.plugin import (
    CompileJob,
    CompileShape,
    DeviceInfo,
    Kernel,
    KernelProblem,
    Tier,
    hookimpl,
)

#: Triton kernels run on NVIDIA and AMD GPUs alike: the generic accelerator tier, where a
#: vendor's kernel declaring the same tier competes with them by cost hint.
TIER = Tier.GENERIC_ACCELERATOR

# The ops this backend provides, per family, as data: a core that adds an op still loads this
# plugin (which then does not provide it). A test demands the lists cover what they should.
ROUTING = (
    "sort",
    "histogram",
    "inclusive_cumsum",
    "exclusive_cumsum",
    "topology",
    "replicate",
    "replicate_backward",
    "route",
    "router_topk",
)
PERMUTATION = (
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
)
#: The Megatron-Core / Transformer Engine permutation ops of PERMUTATION: their own module.
MOE_PERMUTATION = PERMUTATION[-6:]
GROUPED_GEMM = ("gmm", "gmm_weight_grad", "gmm_weight_grad_accumulate", "gather_gmm", "gmm_scatter")
#: The grouped GEMMs of quantized operands, and quantization (module scaled.py).
SCALED_GEMM = ("scaled_gmm", "scaled_gather_gmm", "scaled_gmm_scatter", "scaled_gmm_weight_grad")
QUANTIZATION = (
    "quantize",
    "quantize_both_ways",
    "quantize_transposed",
    "gather_quantize_transposed",
)
ACTIVATION = ("glu", "glu_backward", "activation_backward")

_INTS = frozenset({torch.int16, torch.int32, torch.int64})
#: fp64 data is left to the reference backend (it accumulates in fp64; we use fp32).
_FLOATS = frozenset({torch.float16, torch.bfloat16, torch.float32})
#: The contract's float dtypes, for scale factors (top-k weights) that a kernel loads as any float.
_ANY_FLOAT = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


def _computed(floats: frozenset[torch.dtype]) -> frozenset[torch.dtype]:
    """``floats`` for data a kernel converts or computes on. Triton 3.6's interpreter converts
    bf16 subnormals to float32 wrongly (and multiplies bf16 tl.dot tiles as raw 16-bit integers),
    so on the CPU (interpreter) path bf16 goes to the reference backend instead: tests would
    otherwise pass on wrong numbers. Compiled kernels are unaffected."""
    return floats - {torch.bfloat16} if _interpret() else floats


def _routing_dtypes() -> dict[str, dict[str, frozenset[torch.dtype]]]:
    return {
        "sort": {"x": _INTS},
        "histogram": {"x": _INTS},
        "inclusive_cumsum": {"x": _INTS},
        "exclusive_cumsum": {"x": _INTS},
        "topology": {"padded_bins": _INTS},
        # replicate copies values without converting them: bf16 is exact under the interpreter.
        "replicate": {"x": _FLOATS | _INTS, "bins": _INTS},
        "replicate_backward": {"grad": _computed(_FLOATS), "bins": _INTS},
        "route": {"top_experts": _INTS},
        "router_topk": {"scores": _computed(_FLOATS)},
    }


def _activation_dtypes() -> dict[str, dict[str, frozenset[torch.dtype]]]:
    floats = _computed(_FLOATS)
    return {
        "glu": {"x": floats},
        "glu_backward": {"grad": floats, "x": floats},
        "activation_backward": {"grad": floats, "x": floats, "scale": _computed(_ANY_FLOAT)},
    }


def _permutation_dtypes() -> dict[str, dict[str, frozenset[torch.dtype]]]:
    # Weights keep the contract's full float set (the kernels load any float and scale in fp32),
    # bf16 only off the interpreter. An unweighted gather copies x without converting it, but a
    # weighted one converts, so bf16 x is left out on the interpreter for every op.
    floats = _computed(_FLOATS)
    weights = {"weights": _computed(_ANY_FLOAT)}
    return {
        op: {"x": floats, **({"grad": floats} if op.endswith("wgrad") else weights)}
        for op in PERMUTATION
        if op not in MOE_PERMUTATION
    }


def _gmm_dtypes() -> dict[str, dict[str, frozenset[torch.dtype]]]:
    floats = _computed(_FLOATS)
    return {
        "gmm": {"a": floats, "b": floats},
        "gmm_weight_grad": {"a": floats, "grad": floats},
        # out: a's dtype or float32 (the contract's rule); float64 is left to the reference.
        "gmm_weight_grad_accumulate": {"a": floats, "grad": floats, "out": _FLOATS},
        "gather_gmm": {"x": floats, "b": floats},
        "gmm_scatter": {"x": floats, "b": floats, "weights": _computed(_ANY_FLOAT)},
    }


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _devices() -> tuple[str, ...]:
    # The interpreter runs the same kernels on CPU tensors (slowly): for tests.
    return ("cuda", "rocm", "cpu") if _interpret() else ("cuda", "rocm")


_Declared = Kernel | KernelProblem


def _row(table: Mapping[str, Any], op: str, what: str) -> Any:
    """``op``'s row of one of this module's per-op tables, or a clear error naming the table."""
    if op not in table:
        raise LookupError(f"megablocks_triton.plugin declares no {what} for it")
    return table[op]


def _each(ops: tuple[str, ...], declare: Callable[[str], Kernel]) -> list[_Declared]:
    """``declare(op)`` for each op; one that fails (a row of a per-op table missing, a function
    absent) becomes that op's :class:`KernelProblem`, so the others still load."""
    declared: list[_Declared] = []
    for op in ops:
        try:
            declared.append(declare(op))
        except Exception as exc:  # isolation: one op's declaration must not take the others
            reason = str(exc) if isinstance(exc, LookupError) else f"{type(exc).__name__}: {exc}"
            declared.append(KernelProblem(op, reason))
    return declared


def _kernels(
    module_name: str, ops: tuple[str, ...], dtypes: dict[str, dict[str, frozenset[torch.dtype]]]
) -> list[_Declared]:
    if importlib.util.find_spec("triton") is None:  # megablocks_unavailable_reason says so
        return []
    module = importlib.import_module(f"megablocks_triton.{module_name}")
    from . import tuning  # measured speed: lets the core pick per shape within the tier

    def declare(op: str) -> Kernel:
        fn = getattr(module, op, None)
        if fn is None:
            raise LookupError(f"{module.__name__} has no function {op!r}")
        return Kernel(
            op=op,
            fn=fn,
            devices=_devices(),
            tier=TIER,
            dtypes=_row(dtypes, op, "dtypes"),
            contiguous=True,
            cost=tuning.COST_HINTS.get(op),
            supports=_supports(op, module),
        )

    return _each(ops, declare)


#: Offsets the kernels compute in int32 (``program_id * BLOCK + lane``, int32 flat ids, sorted
#: positions, group sizes and bin ends) stay below 2**31 up to this many elements, the last
#: block included, for every block size they use (at most 2**16).
INT32_ELEMENTS = 2**31 - 2**16
#: glu's column blocks form the second grid dimension: CUDA allows 65535 of them, of up to 512
#: columns each (megablocks_triton.activation._tiles).
GLU_CUDA_COLUMNS = 65535 * 512


@dataclass(frozen=True)
class _Limit:
    """A size the kernels cannot go past: ``measure(call)`` must be at most ``most``."""

    what: str
    measure: Callable[[Mapping[str, Any]], int]
    most: int
    why: str
    kinds: tuple[str, ...] = ()
    """Device kinds it holds on; empty: every device."""


def _length(arg: str, axis: int = 0) -> Callable[[Mapping[str, Any]], int]:
    return lambda call: int(call[arg].shape[axis])


def _value(arg: str) -> Callable[[Mapping[str, Any]], int]:
    return lambda call: int(call[arg])


def _int32(what: str, measure: Callable[[Mapping[str, Any]], int]) -> _Limit:
    return _Limit(what, measure, INT32_ELEMENTS, "int32 offsets in the kernels")


#: The grouped GEMMs' (experts, rows) arguments: each one's first dimension.
_GMM_SIZES = {
    "gmm": ("b", "a"),
    "gather_gmm": ("b", "indices"),
    "gmm_scatter": ("b", "indices"),
    "gmm_weight_grad": ("batch_sizes", "a"),
    "gmm_weight_grad_accumulate": ("batch_sizes", "a"),
}


def _limits(op: str, module: Any) -> tuple[_Limit, ...]:
    """The sizes past which ``op``'s kernels would fail or wrap; ranking gives such calls to
    the next backend instead of letting them raise."""
    if module.__name__.endswith(".permutation"):
        return (_int32("sorted rows", _length("indices")),)
    if module.__name__.endswith(".gmm"):
        experts, rows = _row(_GMM_SIZES, op, "(experts, rows) arguments for its size limits")
        return (
            _Limit(
                "experts",
                _length(experts),
                module.MAX_EXPERTS,
                "the kernels hold every expert's row count in registers",
            ),
            _int32("rows", _length(rows)),
        )
    if op == "moe_permute_map":  # its index form's tiles are the counting sort's (int32)
        return (_int32("routing map entries", lambda call: math.prod(call["routing_map"].shape)),)
    keys = {"sort": "x", "route": "top_experts"}
    if op in keys:
        return (_int32("keys", _length(keys[op])),)
    if op == "histogram":
        return (_int32("keys", lambda call: math.prod(call["x"].shape)),)
    if op == "topology":
        return (_int32("block rows", _value("output_block_rows")),)
    if op == "replicate":
        return (_int32("output columns", _value("num_outputs")),)
    if op == "replicate_backward":
        return (_int32("columns", _length("grad", 1)),)
    if op in ("glu", "glu_backward"):
        half = _Limit(
            "columns per half",
            lambda call: int(call["x"].shape[1]) // 2,
            GLU_CUDA_COLUMNS,
            "CUDA's grid limit",
            kinds=("cuda",),
        )
        return (half,)
    return ()


def _supports(
    op: str, module: Any, own: Callable[[DeviceInfo, Mapping[str, Any]], str | None] | None = None
) -> Callable[[DeviceInfo, Mapping[str, Any]], str | None] | None:
    """The kernel's shape predicate: the declared :func:`_limits` and ``own``, by default the
    module's ``<op>_supports``, if any."""
    own = own or getattr(module, f"{op}_supports", None)
    limits = _limits(op, module)
    if not limits:
        return own

    def supports(device: DeviceInfo, call: Mapping[str, Any]) -> str | None:
        for limit in limits:
            if limit.kinds and device.kind not in limit.kinds:
                continue
            size = limit.measure(call)
            if size > limit.most:
                return f"{size} {limit.what}: more than {limit.most} ({limit.why})"
        return own(device, call) if own is not None else None

    return supports


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
def megablocks_routing_kernels() -> list[_Declared]:
    return _kernels("routing", ROUTING, _routing_dtypes())


def _moe_permutation_dtypes() -> dict[str, dict[str, frozenset[torch.dtype]]]:
    # Probabilities may be any float (Megatron keeps them in float32 beside bf16 rows); fp64
    # rows go to the reference (it accumulates in fp64). moe_permute_map takes bool or int maps.
    floats = _computed(_FLOATS)
    probs = _computed(_ANY_FLOAT)
    return {
        "moe_permute_map": {"routing_map": frozenset({torch.bool}) | _INTS},
        "moe_permute": {"x": floats, "probs": probs},
        "moe_permute_probs": {"probs": probs},
        "moe_unpermute": {"x": floats, "probs": probs},
        "moe_unpermute_wgrad": {"x": floats, "grad": floats},
        "moe_sort_chunks": {"x": floats},
    }


@hookimpl
def megablocks_permutation_kernels() -> list[_Declared]:
    classic = tuple(op for op in PERMUTATION if op not in MOE_PERMUTATION)
    return _kernels("permutation", classic, _permutation_dtypes()) + _kernels(
        "moe_permute", MOE_PERMUTATION, _moe_permutation_dtypes()
    )


#: The ops of the Gluon weight gradient, a variant of its own beside the plain Triton kernels.
WARP_SPECIALIZED_OPS = ("gmm_weight_grad", "gmm_weight_grad_accumulate")


def _warp_specialized_kernels() -> list[_Declared]:
    """Variant ``gluon-hopper`` of the weight gradients (:mod:`megablocks_triton.hopper_wgrad`):
    NVIDIA Hopper only, 16-bit, for the calls the launch policy measured it faster on
    (:func:`megablocks_triton.gmm.warp_specialized_problem`; the plain kernels decline exactly
    those). Same tier and cost hint as the plain kernel: the backend's measured points are of
    this split (:mod:`megablocks_triton.tuning`), so against other providers nothing changes."""
    if importlib.util.find_spec("triton") is None:
        return []
    from . import gmm, tuning

    sixteen = gmm.WARP_SPECIALIZED_DTYPES
    functions: dict[str, Callable[..., Any]] = {
        "gmm_weight_grad": gmm.gmm_weight_grad_warp_specialized,
        "gmm_weight_grad_accumulate": gmm.gmm_weight_grad_accumulate_warp_specialized,
    }

    def declare(op: str) -> Kernel:
        return Kernel(
            op=op,
            fn=_row(functions, op, "warp-specialized function"),
            devices=("cuda",),
            tier=TIER,
            capability=gmm.warp_specialized_capability,
            dtypes={
                "a": sixteen,
                "grad": sixteen,
                **({"out": sixteen} if op == "gmm_weight_grad_accumulate" else {}),
            },
            contiguous=True,
            cost=tuning.COST_HINTS.get(op),
            supports=_supports(op, gmm, functools.partial(gmm.warp_specialized_problem, op)),
            variant=gmm.WARP_SPECIALIZED_VARIANT,
        )

    return _each(WARP_SPECIALIZED_OPS, declare)


def _scaled_kernels(ops: tuple[str, ...]) -> list[_Declared]:
    """The low-precision ops, in every format the core defines, on devices with FP8 matrix
    instructions (:func:`megablocks_triton.scaled.fp8_capability`); quantize reads any strides
    (an expert matrix's transposed view is its transpose-quantize)."""
    if importlib.util.find_spec("triton") is None:
        return []
    from megablocks_core.plugin import FP8_DTYPES, SCALED_FORMATS

    from . import scaled

    eight = frozenset(FP8_DTYPES)
    dtypes = {
        "quantize": {"x": _computed(_FLOATS)},
        "quantize_both_ways": {"x": _computed(_FLOATS)},
        "quantize_transposed": {"x": _computed(_FLOATS)},
        "gather_quantize_transposed": {
            "x": _computed(_FLOATS),
            "indices": _INTS,
            "weights": _ANY_FLOAT,
        },
        "scaled_gmm": {"a": eight, "b": eight},
        "scaled_gather_gmm": {"x": eight, "b": eight},
        "scaled_gmm_scatter": {"x": eight, "b": eight, "weights": _ANY_FLOAT},
        "scaled_gmm_weight_grad": {"a": eight, "grad": eight},
    }
    # The weight gradient's operands exist only in the formats that define them.
    grouped = tuple(f for f, spec in SCALED_FORMATS.items() if spec.grouped_columns)
    weight_grad_ops = (
        "quantize_transposed",
        "gather_quantize_transposed",
        "scaled_gmm_weight_grad",
    )

    def declare(op: str) -> Kernel:
        fn = getattr(scaled, op, None)
        if fn is None:
            raise LookupError(f"{scaled.__name__} has no function {op!r}")
        return Kernel(
            op=op,
            fn=fn,
            devices=_devices(),
            tier=TIER,
            capability=scaled.fp8_capability,
            dtypes=_row(dtypes, op, "dtypes"),
            contiguous=op not in QUANTIZATION,
            supports=getattr(scaled, f"{op}_supports", None),
            formats=grouped if op in weight_grad_ops else tuple(SCALED_FORMATS),
        )

    return _each(ops, declare)


@hookimpl
def megablocks_grouped_gemm_kernels() -> list[_Declared]:
    return (
        _kernels("gmm", GROUPED_GEMM, _gmm_dtypes())
        + _warp_specialized_kernels()
        + _scaled_kernels(SCALED_GEMM)
    )


@hookimpl
def megablocks_quantization_kernels() -> list[_Declared]:
    return _scaled_kernels(QUANTIZATION)


@hookimpl
def megablocks_activation_kernels() -> list[_Declared]:
    return _kernels("activation", ACTIVATION, _activation_dtypes())


@hookimpl
def megablocks_compile_jobs(device: DeviceInfo, shape: CompileShape) -> list[CompileJob]:
    # Every kernel the launch path would run on the device, under this backend's own policy.
    if importlib.util.find_spec("triton") is None:
        return []
    from . import aot

    return aot.compile_jobs(device, shape)
