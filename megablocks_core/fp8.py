"""Training through FP8 grouped GEMMs: a recipe, and gmm / gather_gmm / gmm_scatter whose
GEMMs run on quantized operands.

The functions here take and return what the ops of the same name take and return (16- or 32-bit
tensors, the same contracts, validated the same way), and differentiate through the same backward
rules (:mod:`megablocks_core.autograd`). Only the GEMMs change: each one quantizes its operands
(``quantize``: the row operand once per token, the expert weights once per call or once per
weight version, then both layouts in one ``quantize_both_ways``, see
:attr:`Recipe.cache_weights`) and runs the scaled op (``scaled_gmm``, ``scaled_gather_gmm``,
``scaled_gmm_scatter``) on whichever backend ranks first for it. The
backward's data-gradient GEMMs run in the recipe's format too unless ``backward="input"``;
the weight gradients run in the inputs' dtype, reading the rows the backward has anyway, unless
``weight_grad="fp8"`` (rowwise only): then both of their operands are quantized per expert
column (``quantize_transposed``; a gathered one as it is read through the indices,
``gather_quantize_transposed``) and ``scaled_gmm_weight_grad`` sums over the rows.

Expert weights are quantized with their reduced dimension stored contiguous (the transpose of a
``(experts, k, n)`` weight for the forward, the weight as it is for the gradient of the rows):
the layout NVIDIA Hopper's FP8 matrix instructions read at full speed.

Under ``torch.compile`` (``fullgraph=True`` too) each function is one custom op,
``torch.ops.megablocks.fp8_<op>``: its forward runs the eager forward, its backward (the rule
above, on the ops' custom ops) is traced into the compiled backward graph, and the weights are
quantized on every call (:attr:`Recipe.cache_weights` does not apply there).

Not supported (a clear error): ``create_graph=True`` through an FP8 GEMM (torch.compile refuses a
double backward of its own).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from . import autograd, library
from .activations import activate_with
from .autograd.base import GatheredRows
from .calls import call
from .contracts import BY_NAME
from .entries import validator
from .formats import ENCODINGS, FORMAT_NAMES, FORMATS
from .policy import current_policy

#: A 16/32-bit dtype -> the scaled ops' out_dtype name (float64 data: computed in float32).
_OUT_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


@dataclass(frozen=True)
class Recipe:
    """How a layer's grouped GEMMs run in low precision.

    ``format``: the operands' format (:data:`megablocks_core.formats.FORMATS`). ``encoding``: the
    8-bit encoding, None for the one the device's matrix units take (FNUZ on gfx942, OCP
    elsewhere). ``backward``: ``"fp8"`` runs the data-gradient GEMMs (the gradient of the rows and
    tokens) quantized too, ``"input"`` in the inputs' dtype. ``weight_grad``: ``"input"`` (the
    default) runs the weight gradients in the inputs' dtype, ``"fp8"`` on operands quantized
    with one scale per expert and column (``quantize_transposed``, then
    ``scaled_gmm_weight_grad``; a gathered operand, the rows of gather_gmm's x or of
    gmm_scatter's output gradient, is read through the indices as it is quantized,
    ``gather_quantize_transposed``, with no 16-bit gathered copy): formats that define those
    operands only (``fp8_rowwise``).
    Bias terms (a bias's gradient, its share of the routing weights') stay unquantized under
    either switch. ``cache_weights``: keep each weight's quantized copy while the weight tensor
    is unchanged (its version counter), across the forward, the backward and further
    micro-batches, for one byte a weight element per layout kept (two: the forward's and the
    backward's); a training forward quantizes a changed weight into both layouts in one call
    (``quantize_both_ways``: one read of it in the blockwise format). Off by default: an update
    the version counter does not see (through ``.data``) would go unnoticed. Under
    ``torch.compile`` the cache is neither read nor filled: a compiled step quantizes the weights
    on every call, whatever this says."""

    format: str = "fp8_rowwise"
    encoding: str | None = None
    backward: Literal["fp8", "input"] = "fp8"
    cache_weights: bool = False
    weight_grad: Literal["fp8", "input"] = "input"

    def __post_init__(self) -> None:
        if self.format not in FORMAT_NAMES:
            raise ValueError(
                f"Recipe: format must be one of {', '.join(FORMAT_NAMES)}; got {self.format!r}"
            )
        if self.encoding is not None and self.encoding not in ENCODINGS:
            raise ValueError(
                f"Recipe: encoding must be None or one of {', '.join(ENCODINGS)}; "
                f"got {self.encoding!r}"
            )
        if self.backward not in ("fp8", "input"):
            raise ValueError(f"Recipe: backward must be 'fp8' or 'input'; got {self.backward!r}")
        if self.weight_grad not in ("fp8", "input"):
            raise ValueError(
                f"Recipe: weight_grad must be 'fp8' or 'input'; got {self.weight_grad!r}"
            )
        if self.weight_grad == "fp8" and not FORMATS[self.format].grouped_columns:
            grouped = ", ".join(f.name for f in FORMATS.values() if f.grouped_columns)
            raise ValueError(
                f"Recipe: weight_grad='fp8' needs a format that defines the weight gradient's "
                f"operands ({grouped}); {self.format!r} does not"
            )
        if not isinstance(self.cache_weights, bool):
            raise TypeError(f"Recipe: cache_weights must be a bool; got {self.cache_weights!r}")


def recipe_of(value: Recipe | str | None) -> Recipe | None:
    """A recipe from a recipe, a format name (the recipe's defaults otherwise) or None."""
    if value is None or isinstance(value, Recipe):
        return value
    if isinstance(value, str):
        return Recipe(format=value)
    raise TypeError(
        f"an FP8 recipe is a megablocks_core.fp8.Recipe, a format name ({', '.join(FORMAT_NAMES)}) "
        f"or None; got {type(value).__name__}"
    )


#: id(weight) -> (a weak reference to it, {(format, encoding, layout): (its version, data,
#: scale)}): quantized copies kept while the weight lives and is unchanged
#: (Recipe.cache_weights). Keyed by id: a tensor's == compares elements.
_WEIGHT_CACHE: dict[int, tuple[weakref.ref[Tensor], dict[Any, tuple[int, Tensor, Tensor]]]] = {}


def _cached_copies(weight: Tensor) -> dict[Any, tuple[int, Tensor, Tensor]]:
    """The cache entry of ``weight`` (made on first use, dropped when the weight is freed)."""
    found = _WEIGHT_CACHE.get(id(weight))
    if found is not None and found[0]() is weight:
        return found[1]
    copies: dict[Any, tuple[int, Tensor, Tensor]] = {}
    _WEIGHT_CACHE[id(weight)] = (weakref.ref(weight), copies)
    weakref.finalize(weight, _WEIGHT_CACHE.pop, id(weight), None)
    return copies


def _fresh_copy(
    copies: dict[Any, tuple[int, Tensor, Tensor]], key: Any, version: int
) -> tuple[Tensor, Tensor] | None:
    """The copy kept under ``key`` if it was made at the weight's ``version``. Otherwise None,
    with every copy made at another version dropped (nothing else holds them once a step's
    backward is done): a changed weight's stale copies are freed before its new ones are made,
    so that the two generations never hold memory together (both layouts take as many bytes as
    the bf16 weight)."""
    kept = copies.get(key)
    if kept is not None and kept[0] == version:
        return kept[1], kept[2]
    for stale in [k for k, (made, *_) in copies.items() if made != version]:
        del copies[stale]
    return None


def _out_name(dtype: torch.dtype) -> str:
    return _OUT_NAMES.get(dtype, "float32")


class _ScaledCall:
    """``call(op, *args)`` of the backward rules and forwards, with the grouped GEMMs run on
    quantized operands (the rest goes to the ops as they are).

    ``traced``: the backward of the compiled op (:func:`_register_compiled`), which torch traces
    into the compiled graph: every op runs as its ``torch.ops.megablocks`` custom op (the eager
    entries take no fake tensors), and no weight cache is read (a graph replays its quantization
    on every step)."""

    def __init__(
        self, recipe: Recipe, in_backward: bool, traced: bool = False, both_ways: bool = False
    ) -> None:
        self.recipe = recipe
        self.scaled = not in_backward or recipe.backward == "fp8"
        self.in_backward = in_backward
        self.traced = traced
        # A forward whose backward will want each weight's other layout too: with the weight
        # cache (matrices()), a changed weight is quantized both ways in one call.
        self.both_ways = both_ways

    def op(self, name: str, *args: Any) -> Any:
        """The op ``name`` itself, as this call runs it (eager or traced)."""
        if self.traced:
            return getattr(torch.ops.megablocks, name)(*args)
        return call(name, *args)

    #: The backward rules' call for the bias terms, which the recipe leaves unquantized (a bias's
    #: own gradient, and its share of the routing weights'): the recipe is for the weights' GEMMs.
    unquantized = op

    @property
    def fp8_weight_grads(self) -> bool:
        """Whether the weight gradients run on quantized operands (a backward whose recipe asks)."""
        return self.in_backward and self.recipe.weight_grad == "fp8"

    @property
    def reads_gathered_rows(self) -> bool:
        """Whether a weight gradient takes a gathered row operand as
        :class:`~megablocks_core.autograd.base.GatheredRows`: an FP8 one quantizes it as it
        reads it (``gather_quantize_transposed``)."""
        return self.fp8_weight_grads

    def __call__(self, op: str, *args: Any) -> Any:
        if op in _WEIGHT_GRADS:
            gemm = _WEIGHT_GRADS[op] if self.fp8_weight_grads else None
        else:
            gemm = _GEMMS.get(op) if self.scaled else None
        if gemm is None:
            return self.op(op, *args)
        # (A compiled backward is traced without gradients: torch itself refuses a double
        # backward through a compiled graph.)
        if self.in_backward and torch.is_grad_enabled():
            raise NotImplementedError(
                f"megablocks_core.fp8: a backward with create_graph=True through the FP8 {op} "
                "is not supported (its quantized GEMMs have no gradient of their own)"
            )
        return gemm(self, *args)

    def rows(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """A row operand (rows, k), quantized along k."""
        data, scale = self.op("quantize", x, 1, self.recipe.format, self.recipe.encoding)
        return data, scale

    def matrices(self, b: Tensor, trans_b: bool) -> tuple[Tensor, Tensor]:
        """Expert matrices quantized with the reduced dim stored contiguous, as (experts, n, k)
        (the op then takes them with trans_b=True)."""
        recipe = self.recipe
        key = (recipe.format, recipe.encoding, trans_b)
        copies = _cached_copies(b) if recipe.cache_weights and not self.traced else None
        if copies is not None:
            fresh = _fresh_copy(copies, key, b._version)
            if fresh is not None:
                return fresh
        if copies is not None and self.both_ways:
            # (data, scale) summed over b's last dim: trans_b's layout; (data_t, scale_t) the other.
            data, scale, data_t, scale_t = self.op(
                "quantize_both_ways", b, recipe.format, recipe.encoding
            )
            copies[(recipe.format, recipe.encoding, True)] = (b._version, data, scale)
            copies[(recipe.format, recipe.encoding, False)] = (b._version, data_t, scale_t)
            return (data, scale) if trans_b else (data_t, scale_t)
        k_last = b if trans_b else b.transpose(1, 2)
        data, scale = self.op("quantize", k_last, 2, recipe.format, recipe.encoding)
        if copies is not None:
            copies[key] = (b._version, data, scale)
        return data, scale


def _gmm(
    scaled: _ScaledCall,
    a: Tensor,
    b: Tensor,
    batch_sizes: Tensor,
    trans_b: bool,
    bias: Tensor | None = None,
) -> Tensor:
    rows, matrices = scaled.rows(a), scaled.matrices(b, trans_b)
    fmt, out_name = scaled.recipe.format, _out_name(a.dtype)
    out = scaled.op("scaled_gmm", *rows, *matrices, batch_sizes, True, fmt, out_name, bias)
    return out.to(a.dtype)  # the scaled op added the bias


def _gather_gmm(
    scaled: _ScaledCall,
    x: Tensor,
    b: Tensor,
    indices: Tensor,
    bin_ids: Tensor,
    bins: Tensor,
    top_k: int,
    trans_b: bool,
    rows: int | None = None,
    bias: Tensor | None = None,
) -> Tensor:
    tokens, matrices = scaled.rows(x), scaled.matrices(b, trans_b)
    out = scaled.op(
        "scaled_gather_gmm",
        *tokens,
        *matrices,
        indices,
        bin_ids,
        bins,
        top_k,
        True,
        rows,
        scaled.recipe.format,
        _out_name(x.dtype),
        bias,
    )
    return out.to(x.dtype)


def _gmm_scatter(
    scaled: _ScaledCall,
    x: Tensor,
    b: Tensor,
    indices: Tensor,
    bin_ids: Tensor,
    weights: Tensor | None,
    bins: Tensor,
    top_k: int,
    trans_b: bool,
    activation: str | None = None,
    rows: int | None = None,
    bias: Tensor | None = None,
    alpha: float | None = None,
    limit: float | None = None,
) -> Tensor:
    # The activation in the inputs' dtype (a transient copy), then its rows quantized.
    activated = x if activation is None else activate_with(scaled.op, x, activation, alpha, limit)
    sorted_rows, matrices = scaled.rows(activated), scaled.matrices(b, trans_b)
    out = scaled.op(
        "scaled_gmm_scatter",
        *sorted_rows,
        *matrices,
        indices,
        bin_ids,
        weights,
        bins,
        top_k,
        True,
        rows,
        scaled.recipe.format,
        _out_name(x.dtype),
        bias,
    )
    return out.to(x.dtype)


_GEMMS: dict[str, Callable[..., Tensor]] = {
    "gmm": _gmm,
    "gather_gmm": _gather_gmm,
    "gmm_scatter": _gmm_scatter,
}


def _transposed(
    scaled: _ScaledCall, rows: Tensor | GatheredRows, batch_sizes: Tensor
) -> tuple[Tensor, Tensor]:
    """A weight gradient's row operand quantized per expert column, transposed; gathered rows
    are read through their indices (never gathered into a 16-bit copy)."""
    fmt, encoding = scaled.recipe.format, scaled.recipe.encoding
    if isinstance(rows, GatheredRows):
        x, indices, _, weights, _, top_k, first = rows
        return scaled.op(
            "gather_quantize_transposed",
            x, indices, weights, top_k, batch_sizes, first, fmt, encoding,
        )  # fmt: skip
    return scaled.op("quantize_transposed", rows, batch_sizes, fmt, encoding)


def _transposed_operands(
    scaled: _ScaledCall, a: Tensor | GatheredRows, grad: Tensor | GatheredRows, batch_sizes: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(a, a_scale, grad, grad_scale) of scaled_gmm_weight_grad."""
    return (*_transposed(scaled, a, batch_sizes), *_transposed(scaled, grad, batch_sizes))


def _dtype(rows: Tensor | GatheredRows) -> torch.dtype:
    return rows.x.dtype if isinstance(rows, GatheredRows) else rows.dtype


def _gmm_weight_grad(
    scaled: _ScaledCall, a: Tensor | GatheredRows, grad: Tensor | GatheredRows, batch_sizes: Tensor
) -> Tensor:
    operands = _transposed_operands(scaled, a, grad, batch_sizes)
    fmt, dtype = scaled.recipe.format, _dtype(a)
    return scaled.op("scaled_gmm_weight_grad", *operands, batch_sizes, fmt, _out_name(dtype)).to(
        dtype
    )


def _gmm_weight_grad_accumulate(
    scaled: _ScaledCall,
    a: Tensor | GatheredRows,
    grad: Tensor | GatheredRows,
    batch_sizes: Tensor,
    out: Tensor,
) -> None:
    # The scaled gradient in out's dtype (a float32 main_grad gets it unrounded), then added.
    operands = _transposed_operands(scaled, a, grad, batch_sizes)
    fmt, out_name = scaled.recipe.format, _out_name(out.dtype)
    out.add_(scaled.op("scaled_gmm_weight_grad", *operands, batch_sizes, fmt, out_name))


#: The weight gradients the backward rules call, as they run with Recipe(weight_grad="fp8").
_WEIGHT_GRADS: dict[str, Callable[..., Any]] = {
    "gmm_weight_grad": _gmm_weight_grad,
    "gmm_weight_grad_accumulate": _gmm_weight_grad_accumulate,
}
#: Each function's validation as its op's entry does it: a call shape accepted once is checked
#: again only for what its key cannot vouch for.
_VALIDATORS = {name: validator(BY_NAME[name]) for name in _GEMMS}


def _run(name: str, args: tuple[Any, ...], recipe: Recipe | str) -> Tensor:
    """The op ``name`` on ``args`` (kernel order, validated against its contract) with its GEMMs
    in ``recipe``, differentiable through the op's own backward rule."""
    resolved = recipe_of(recipe)
    assert resolved is not None
    if torch.compiler.is_compiling():  # one custom op: its fake validates, its real runs eagerly
        compiled = getattr(torch.ops.megablocks, _COMPILED_PREFIX + name)
        return compiled(
            resolved.format, resolved.encoding, resolved.backward, resolved.weight_grad, *args
        )
    contract = BY_NAME[name]
    args = _VALIDATORS[name](args)
    bound = contract.bind(args)
    wants_grad = torch.is_grad_enabled() and any(
        isinstance(bound[n], Tensor) and bound[n].requires_grad for n in contract.differentiable
    )
    rows = bound[contract.args[0].name]  # the row operand: its gradient reads the other layout
    needs_rows_grad = wants_grad and rows.requires_grad and resolved.backward == "fp8"
    forward = _ScaledCall(resolved, in_backward=False, both_ways=needs_rows_grad)
    if wants_grad:
        backward = _ScaledCall(resolved, in_backward=True)
        return autograd.apply(
            contract, lambda *a: forward(name, *a), current_policy(), backward, args
        )
    return forward(name, *args)


# ---------------------------------------------------------------------------------------------
# Under torch.compile: torch.ops.megablocks.fp8_<op>(format, encoding, backward, weight_grad,
# *op's args)
#
# Tracing never enters the eager path above (its validation, autograd node and weight cache are
# Python that dynamo cannot follow): each function is one custom op with the op's own fake
# (library.py), a real implementation that runs the eager forward, and an autograd formula whose
# backward runs the op's rule on the custom ops, traced into the compiled backward graph.
# Weights are quantized on every call there: Recipe.cache_weights does not apply.

_COMPILED_PREFIX = "fp8_"
_COMPILED_LIBRARY = torch.library.Library(library.NAMESPACE, "FRAGMENT")
#: The leading arguments of a compiled op that carry the recipe: Recipe's first three fields
#: and weight_grad.
_RECIPE_ARGS = 4


def _compiled_recipe(
    fmt: str,
    encoding: str | None,
    backward: Literal["fp8", "input"],
    weight_grad: Literal["fp8", "input"],
) -> Recipe:
    return Recipe(fmt, encoding, backward, weight_grad=weight_grad)


def _register_compiled(name: str) -> None:
    contract = BY_NAME[name]
    op_schema = library.schema(contract)
    _COMPILED_LIBRARY.define(
        f"{_COMPILED_PREFIX}{name}(str recipe_format, str? recipe_encoding, str recipe_backward, "
        "str recipe_weight_grad, " + op_schema[op_schema.index("(") + 1 :]
    )
    fake = library._fake(contract)

    def real(
        fmt: str,
        encoding: str | None,
        backward: Literal["fp8", "input"],
        weight_grad: Literal["fp8", "input"],
        *args: Any,
    ) -> Tensor:
        recipe = _compiled_recipe(fmt, encoding, backward, weight_grad)
        with torch.no_grad():  # the autograd formula below records the graph
            return _run(name, library._complete(contract, args), recipe)

    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        args = library._complete(contract, inputs[_RECIPE_ARGS:])
        needs = {
            a.name: a.name in contract.differentiable and isinstance(v, Tensor) and v.requires_grad
            for a, v in zip(contract.args, args, strict=True)
        }
        tensors, consts = autograd.pack_for_backward(contract, args, needs)
        ctx.save_for_backward(*tensors)
        ctx.meta = (consts, needs, len(inputs), _compiled_recipe(*inputs[:_RECIPE_ARGS]))

    def backward(ctx: Any, grad: Tensor) -> tuple[Any, ...]:
        consts, needs, given, recipe = ctx.meta
        bound = autograd.unpack_for_backward(contract, ctx.saved_tensors, consts)
        scaled = _ScaledCall(recipe, in_backward=True, traced=True)
        grads = autograd.run_rule(contract, scaled, bound, grad, needs)
        op_grads = (grads.get(a.name) if needs[a.name] else None for a in contract.args)
        return (*(None,) * _RECIPE_ARGS, *op_grads)[:given]

    qualified = f"{library.NAMESPACE}::{_COMPILED_PREFIX}{name}"
    _COMPILED_LIBRARY.impl(_COMPILED_PREFIX + name, real, "CompositeExplicitAutograd")
    torch.library.register_fake(
        qualified, lambda *a: fake(*a[_RECIPE_ARGS:]), lib=_COMPILED_LIBRARY
    )
    torch.library.register_autograd(qualified, backward, setup_context=setup_context)


def gmm(
    a: Tensor,
    b: Tensor,
    batch_sizes: Tensor,
    trans_b: bool = False,
    bias: Tensor | None = None,
    *,
    recipe: Recipe | str = "fp8_rowwise",
) -> Tensor:
    """:func:`megablocks_core.ops.gmm` with its GEMMs in ``recipe`` (a format name or a
    :class:`Recipe`)."""
    return _run("gmm", (a, b, batch_sizes, trans_b, bias), recipe)


def gather_gmm(
    x: Tensor,
    b: Tensor,
    indices: Tensor,
    bin_ids: Tensor,
    bins: Tensor,
    top_k: int,
    trans_b: bool = False,
    rows: int | None = None,
    bias: Tensor | None = None,
    *,
    recipe: Recipe | str = "fp8_rowwise",
) -> Tensor:
    """:func:`megablocks_core.ops.gather_gmm` with its GEMMs in ``recipe``: each token's row is
    quantized once (not once per expert it is routed to), and the scaled GEMM reads the 8-bit rows
    through the indices."""
    args = (x, b, indices, bin_ids, bins, top_k, trans_b, rows, bias)
    return _run("gather_gmm", args, recipe)


def gmm_scatter(
    x: Tensor,
    b: Tensor,
    indices: Tensor,
    bin_ids: Tensor,
    weights: Tensor | None,
    bins: Tensor,
    top_k: int,
    trans_b: bool = False,
    activation: str | None = None,
    rows: int | None = None,
    bias: Tensor | None = None,
    alpha: float | None = None,
    limit: float | None = None,
    *,
    recipe: Recipe | str = "fp8_rowwise",
) -> Tensor:
    """:func:`megablocks_core.ops.gmm_scatter` with its GEMMs in ``recipe``: the activation runs
    in x's dtype, its rows are quantized, and the scaled GEMM's products are summed per token."""
    args = (
        x, b, indices, bin_ids, weights, bins, top_k, trans_b, activation, rows, bias, alpha, limit
    )  # fmt: skip
    return _run("gmm_scatter", args, recipe)


for _name in _GEMMS:
    _register_compiled(_name)


__all__ = ["Recipe", "gather_gmm", "gmm", "gmm_scatter", "recipe_of"]
