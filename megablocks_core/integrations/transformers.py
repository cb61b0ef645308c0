"""An experts implementation for Hugging Face transformers' MoE models, on megablocks-core's ops.

Importing this module registers ``"megablocks"`` in ``transformers.integrations.moe``'s
``ExpertsInterface``; that import is the one line a user adds::

    import megablocks_core.integrations.transformers  # noqa: F401
    model = AutoModelForCausalLM.from_pretrained(name, experts_implementation="megablocks")

Every MoE model of transformers 5.x keeps its router and hands its ``Experts`` module the tokens
``(T, H)``, the top-k expert ids ``(T, K)`` and their weights ``(T, K)``; this implementation
serves that call with ``route`` → ``gather_gmm`` → ``gmm_scatter``, reading the module's own 3-D
weights in their own layout (no conversion, so checkpoints, weight init and tensor-parallel
plans stay transformers'): every layout the ``@use_experts_implementation`` flags describe,
[gate | up] or interleaved (``is_concatenated``), (out, in) or (in, out) (``is_transposed``),
with per-expert biases (``has_bias``: the ops' ``bias``) or without, gated or not, with SiLU,
ReLU, the exact or tanh GELU, or GPT-OSS's clamped SwiGLU with the module's own ``alpha`` and
``limit`` (``GptOssConfig.swiglu_alpha`` and ``swiglu_limit``). The activation is applied inside ``gmm_scatter`` and recomputed in backward, so
a step keeps only the first GEMM's output. Nothing reads a count on the host: a step is as
sync-free (and CUDA-graph capturable) as the backends that serve the ops.

``use_fp8(model)`` runs the experts' GEMMs in FP8 (:mod:`megablocks_core.fp8`), the weights
quantized per call from the model's own.

A module this cannot serve exactly (an activation with no fused equivalent, a custom gate, a
post-expert norm) raises :class:`UnsupportedExpertsError` naming what is unsupported, instead of
computing something else.
"""

from __future__ import annotations

import functools
import numbers
import sys
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor
from transformers.integrations import moe as hf_moe

from .. import fp8, ops
from ..activations import GATED, INTERLEAVED, SWIGLU_OAI, clamp_constants

__all__ = [
    "IMPLEMENTATION",
    "UnsupportedExpertsError",
    "experts_forward",
    "experts_modules",
    "fuse_grad_accumulation",
    "register",
    "use_fp8",
]

#: The attribute of an Experts module that holds its FP8 recipe (set by :func:`use_fp8`).
_FP8_ATTRIBUTE = "_megablocks_fp8_recipe"

#: The name to pass as ``experts_implementation=``.
IMPLEMENTATION = "megablocks"

# Only padded_bins uses it, and nothing here reads padded_bins.
_BLOCK_SIZE = 128

#: transformers' activation classes (transformers.activations.ACT2CLS) → our activation names.
_ACTIVATIONS_BY_CLASS: dict[str, str] = {
    "SiLUActivation": "silu",
    "SiLU": "silu",
    "ReLU": "relu",
    "GELUTanh": "gelu_tanh",
    "NewGELUActivation": "gelu_tanh",
    "GELUActivation": "gelu_erf",
}

#: A glu name → the gated name gmm_scatter takes ("silu" → "swiglu").
_GATED_BY_UNIT = {unit: name for name, unit in GATED.items() if unit is not None}


class UnsupportedExpertsError(NotImplementedError):
    """An Experts module whose computation this implementation cannot reproduce exactly."""


@dataclass(frozen=True)
class ExpertsLayout:
    """How one Experts module's weights and activation map onto the fused ops."""

    first: str
    """The first GEMM's weight attribute: ``gate_up_proj`` (gated) or ``up_proj``."""
    trans_b: bool
    """The weights are stored (experts, out, in) (transformers' ``is_transposed=False``)."""
    activation: str
    """gmm_scatter's activation name (a gated one for gated experts)."""
    first_bias: str | None = None
    """The first GEMM's bias attribute (``has_bias=True``), else None."""
    second_bias: str | None = None
    """The second GEMM's bias attribute (``down_proj_bias``), else None."""
    alpha: float | None = None
    """GPT-OSS's clamped SwiGLU: the module's ``alpha``, else None."""
    limit: float | None = None
    """GPT-OSS's clamped SwiGLU: the module's ``limit``, else None."""


def _unsupported(module: torch.nn.Module, what: str) -> UnsupportedExpertsError:
    return UnsupportedExpertsError(
        f"experts_implementation={IMPLEMENTATION!r} cannot serve {type(module).__name__}: {what}; "
        "use another experts_implementation (e.g. 'eager') for this model"
    )


def _activation_name(module: torch.nn.Module) -> str:
    act = getattr(module, "act_fn", None)
    if act is None:
        raise _unsupported(module, "it has no act_fn")
    kind = type(act).__name__
    name = _ACTIVATIONS_BY_CLASS.get(kind)
    if name is None:
        raise _unsupported(module, f"activation {kind} is not supported")
    return name


def _gate_function(module: torch.nn.Module) -> Any:
    return getattr(type(module), "_apply_gate", None)


#: The module that defines GPT-OSS's Experts class (and so its gate).
_GPT_OSS_MODELING = "transformers.models.gpt_oss.modeling_gpt_oss"


def _is_gpt_oss_gate(module: torch.nn.Module) -> bool:
    """Whether the module's gate is GPT-OSS's own, by identity. Looked up among the loaded
    modules, not imported: an import inside a call torch.compile traces breaks its graph
    (transformers' packages are lazy modules), and the gate's ``__qualname__`` is not what it
    is while dynamo traces. A GPT-OSS module's class comes from that module, so it is loaded
    whenever one exists."""
    experts_class = getattr(sys.modules.get(_GPT_OSS_MODELING), "GptOssExperts", None)
    gate = getattr(experts_class, "_apply_gate", None)
    return gate is not None and _gate_function(module) is gate


def _clamp_constants(module: torch.nn.Module) -> tuple[float, float]:
    """GPT-OSS's module's ``alpha`` and ``limit`` as floats (the ones its gate computes with)."""
    alpha, limit = getattr(module, "alpha", None), getattr(module, "limit", None)
    problem = "alpha and limit must be real numbers"
    if all(isinstance(v, numbers.Real) and not isinstance(v, bool) for v in (alpha, limit)):
        try:
            return clamp_constants(SWIGLU_OAI, float(alpha), float(limit))  # type: ignore[arg-type]
        except ValueError as exc:
            problem = str(exc)
    raise _unsupported(
        module, f"a clamped SwiGLU with alpha={alpha!r} and limit={limit!r}: {problem}"
    )


def _gate_unit(module: torch.nn.Module) -> tuple[str, float | None, float | None]:
    """The glu name (side by side) of a gated module's gate and its constants: act(gate) * up
    for transformers' default gate (no constants), GPT-OSS's clamped SwiGLU with the module's
    alpha and limit for its own."""
    if _gate_function(module) is hf_moe._default_apply_gate:
        return _activation_name(module), None, None
    if _is_gpt_oss_gate(module):
        alpha, limit = _clamp_constants(module)
        if getattr(module, "is_concatenated", True):
            raise _unsupported(
                module, "GPT-OSS's gate reads interleaved columns, yet is_concatenated=True"
            )
        return SWIGLU_OAI, alpha, limit
    raise _unsupported(module, f"its own gate function ({type(module).__name__}._apply_gate)")


def layout_of(module: torch.nn.Module) -> ExpertsLayout:
    """The layout of a transformers Experts module, from the flags its
    ``@use_experts_implementation`` decorator set (``is_concatenated``, ``is_transposed``,
    ``has_bias``, ``has_gate``, ``has_post_expert_norm``) and its gate and activation; raises
    :class:`UnsupportedExpertsError` for one it cannot serve."""
    if getattr(module, "has_post_expert_norm", False):
        raise _unsupported(
            module, "a post-expert norm (has_post_expert_norm=True) is not supported"
        )
    gated = getattr(module, "has_gate", True)
    alpha = limit = None
    if gated:
        unit, alpha, limit = _gate_unit(module)
        if not getattr(module, "is_concatenated", True):
            unit += INTERLEAVED
        activation = _GATED_BY_UNIT[unit]
    else:
        activation = _activation_name(module)
    first = "gate_up_proj" if gated else "up_proj"
    biased = getattr(module, "has_bias", False)
    return ExpertsLayout(
        first=first,
        trans_b=not getattr(module, "is_transposed", False),
        activation=activation,
        first_bias=first + "_bias" if biased else None,
        second_bias="down_proj_bias" if biased else None,
        alpha=alpha,
        limit=limit,
    )


#: The attribute of an Experts module that keeps its layout, with what it was derived from.
_LAYOUT_ATTRIBUTE = "_megablocks_layout"

#: The module's attributes its layout depends on (besides its class and its act_fn).
_LAYOUT_INPUTS = (
    "has_gate", "has_bias", "is_transposed", "is_concatenated", "has_post_expert_norm", "alpha",
    "limit",
)  # fmt: skip


def _cached_layout(module: torch.nn.Module) -> ExpertsLayout:
    """:func:`layout_of`, derived again only when what it depends on changed (a cheap check: the
    derivation costs microseconds of host time a call); nothing is stored while torch.compile
    traces."""
    inputs = (
        type(module), getattr(module, "act_fn", None),
        *(getattr(module, name, None) for name in _LAYOUT_INPUTS),
    )  # fmt: skip
    cached = module.__dict__.get(_LAYOUT_ATTRIBUTE)
    if cached is not None and cached[0] == inputs:
        return cast(ExpertsLayout, cached[1])
    layout = layout_of(module)
    if not torch.compiler.is_compiling():
        module.__dict__[_LAYOUT_ATTRIBUTE] = (inputs, layout)
    return layout


def experts_forward(
    self: torch.nn.Module, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor
) -> Tensor:
    """transformers' experts call ``(T, H), (T, K) ids, (T, K) weights -> (T, H)`` through
    ``route``, ``gather_gmm`` and ``gmm_scatter``."""
    layout = _cached_layout(self)
    num_experts = cast(int, self.num_experts)
    top_k = top_k_index.shape[-1]
    expert_ids = top_k_index.reshape(-1).to(torch.int32)
    experts_routed = num_experts
    if getattr(self, "_is_expert_parallel", False):
        # Ids of experts on other ranks (>= num_experts, zero weight) go to one extra bin that
        # sorts last; bins[:num_experts] then ends before them, so no GEMM computes them.
        expert_ids = expert_ids.clamp(max=num_experts)
        experts_routed = num_experts + 1
    indices, bin_ids, _, bins, _ = ops.route(expert_ids, experts_routed, _BLOCK_SIZE)
    bins = bins[:num_experts]
    first: Tensor = getattr(self, layout.first)
    second = cast(Tensor, self.down_proj)
    x = hidden_states.to(first.dtype)
    weights = top_k_weights.reshape(-1).to(first.dtype)
    first_bias = _bias(self, layout.first_bias)
    second_bias = _bias(self, layout.second_bias)
    trans_b = layout.trans_b
    recipe = getattr(self, _FP8_ATTRIBUTE, None)
    gather_gmm, gmm_scatter = ops.gather_gmm, ops.gmm_scatter
    if recipe is not None:  # use_fp8: the same ops with their GEMMs quantized
        gather_gmm = functools.partial(fp8.gather_gmm, recipe=recipe)
        gmm_scatter = functools.partial(fp8.gmm_scatter, recipe=recipe)
    h = gather_gmm(x, first, indices, bin_ids, bins, top_k, trans_b, None, first_bias)
    out = gmm_scatter(
        h, second, indices, bin_ids, weights, bins, top_k, trans_b, layout.activation, None,
        second_bias, layout.alpha, layout.limit,
    )  # fmt: skip
    return out.to(hidden_states.dtype)


def _served(model: torch.nn.Module) -> list[tuple[torch.nn.Module, ExpertsLayout]]:
    """(module, layout) of each Experts module of ``model`` this implementation can serve."""
    found = []
    for module in model.modules():
        if hasattr(module, "has_gate") and hasattr(module, "down_proj"):
            try:
                found.append((module, layout_of(module)))
            except UnsupportedExpertsError:
                continue
    return found


def experts_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The Experts modules of ``model`` that this implementation can serve (the modules that
    ``@use_experts_implementation`` marked: they carry ``has_gate``)."""
    return [module for module, _ in _served(model)]


def fuse_grad_accumulation(model: torch.nn.Module, enabled: bool = True) -> int:
    """Opt the expert weights of every Experts module of ``model`` in to (or, ``enabled=False``,
    out of) gradient-accumulation fusion: where a micro-batch's gradient is added to an existing
    ``.grad`` (or ``main_grad``), the weight-gradient GEMM adds it, not a separate autograd pass.
    :func:`megablocks_core.fuse_grad_accumulation` says when it applies and what it does not
    support (DDP and FSDP reducers; gradient hooks see None). Applies to the modules served by
    ``"megablocks"``; returns how many modules were marked."""
    from ..autograd.fusion import fuse_grad_accumulation as fuse

    served = _served(model)
    for module, layout in served:
        fuse(getattr(module, layout.first), cast(Tensor, module.down_proj), enabled=enabled)
    return len(served)


def use_fp8(model: torch.nn.Module, recipe: fp8.Recipe | str | None = "fp8_rowwise") -> int:
    """Run the expert GEMMs of every Experts module of ``model`` that ``"megablocks"`` serves in
    FP8 (:mod:`megablocks_core.fp8`): ``recipe`` a :class:`megablocks_core.fp8.Recipe` or a format
    name; None turns it off again. The weights stay the model's own (the master copy), quantized
    per call (``Recipe(cache_weights=True)``: once while unchanged, except under
    ``torch.compile``, which quantizes them every call); checkpoints are unaffected. Returns how
    many modules it set."""
    resolved = fp8.recipe_of(recipe)
    served = _served(model)
    for module, _ in served:
        setattr(module, _FP8_ATTRIBUTE, resolved)
    return len(served)


def _bias(module: torch.nn.Module, name: str | None) -> Tensor | None:
    return None if name is None else cast(Tensor, getattr(module, name))


def register(name: str = IMPLEMENTATION) -> None:
    """Registers :func:`experts_forward` in transformers' ``ExpertsInterface`` as ``name``
    (done for ``"megablocks"`` on import of this module)."""
    hf_moe.ExpertsInterface.register(name, experts_forward)


register()
