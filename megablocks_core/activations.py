"""The expert activations an op may apply, by name, with their backward.

One definition serves the contract of ``gmm_scatter``'s ``activation`` argument (the reference
backend composes it with these functions, the core's autograd differentiates through them;
its gated names, :data:`GATED`, apply :func:`glu` to rows holding gate and up side by side),
the ``glu`` op (gated experts: :func:`glu` and :func:`glu_backward` are its definition), the
``activation_backward`` op (:func:`activation_backward` is its definition) and the layer's
expert MLPs (:class:`megablocks_core.layers.DroplessMoE`). A kernel that applies one
must match the function here in its input dtype: computed in float32 (float64 for float64
input) and rounded once to the input's dtype.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor


def gelu_tanh(x: Tensor) -> Tensor:
    """GELU with the tanh approximation: MegaBlocks' default ``activation_fn`` (layers/arguments.py)."""
    return F.gelu(x, approximate="tanh")


def gelu_erf(x: Tensor) -> Tensor:
    """The exact GELU, x * Phi(x) with the normal CDF through erf: torch's and transformers'
    ``"gelu"`` (not this module's ``"gelu"``, the tanh form)."""
    return F.gelu(x)


def _relu_backward(grad: Tensor, x: Tensor) -> Tensor:
    return grad * (x > 0)


def _silu_backward(grad: Tensor, x: Tensor) -> Tensor:
    if torch.is_grad_enabled():  # recorded (double backward): aten's silu_backward has no formula
        s = torch.sigmoid(x)
        return grad * (s * (1 + x * (1 - s)))
    return torch.ops.aten.silu_backward(grad, x)


#: Name -> (function, its backward ``(grad of the output, input) -> grad of the input``).
#: "gelu" is the tanh form (MegaBlocks' default, kept for compatibility); "gelu_tanh" names it
#: explicitly and "gelu_erf" is the exact form (transformers' and torch's "gelu").
ACTIVATIONS: dict[str, tuple[Callable[[Tensor], Tensor], Callable[[Tensor, Tensor], Tensor]]] = {
    "gelu": (gelu_tanh, lambda g, x: torch.ops.aten.gelu_backward(g, x, approximate="tanh")),
    "gelu_tanh": (gelu_tanh, lambda g, x: torch.ops.aten.gelu_backward(g, x, approximate="tanh")),
    "gelu_erf": (gelu_erf, lambda g, x: torch.ops.aten.gelu_backward(g, x)),
    "silu": (F.silu, _silu_backward),
    "relu": (F.relu, _relu_backward),
}

#: The names, in the order the docs list them.
NAMES: tuple[str, ...] = tuple(ACTIVATIONS)

#: GPT-OSS's clamped SwiGLU unit (a :func:`glu` name, not an elementwise activation):
#: ``(u + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate, limit)``, ``u = clamp(up, ±limit)``.
#: Its constants are parameters (``alpha``, ``limit``); None stands for GPT-OSS's,
#: :data:`SWIGLU_OAI_ALPHA` and :data:`SWIGLU_OAI_LIMIT` (transformers' ``GptOssConfig``
#: defaults ``swiglu_alpha`` and ``swiglu_limit``).
SWIGLU_OAI = "silu_oai"
SWIGLU_OAI_ALPHA = 1.702
SWIGLU_OAI_LIMIT = 7.0

#: A glu name with this suffix reads gate and up interleaved (gate in even columns, up in odd)
#: instead of side by side; its gradient comes back in the same layout.
INTERLEAVED = "_interleaved"

_UNITS: tuple[str, ...] = (*NAMES, SWIGLU_OAI)
#: Every name :func:`glu` takes (besides None, the bilinear unit): a gate activation or
#: GPT-OSS's unit, side by side or interleaved.
GLU_NAMES: tuple[str, ...] = _UNITS + tuple(n + INTERLEAVED for n in _UNITS)

_GATED_SIDE_BY_SIDE: dict[str, str | None] = {
    "geglu": "gelu",
    "geglu_tanh": "gelu_tanh",
    "geglu_erf": "gelu_erf",
    "swiglu": "silu",
    "reglu": "relu",
    "bilinear": None,
    "swiglu_oai": SWIGLU_OAI,
}

#: Gated activations by name → the :func:`glu` name that computes them: ``act(gate) * up`` of
#: rows that hold gate and up side by side, ``(rows, 2n)`` → ``(rows, n)`` (the GLU variants
#: GEGLU, SwiGLU, ReGLU, the bilinear unit and GPT-OSS's clamped SwiGLU), and each of them but the
#: bilinear unit with the suffix "_interleaved" for interleaved rows.
GATED: dict[str, str | None] = {
    **_GATED_SIDE_BY_SIDE,
    **{
        name + INTERLEAVED: unit + INTERLEAVED
        for name, unit in _GATED_SIDE_BY_SIDE.items()
        if unit is not None
    },
}

#: Every name an op that activates its input rows takes (``gmm_scatter``, ``activation_backward``).
ROW_NAMES: tuple[str, ...] = NAMES + tuple(GATED)

#: The names (glu's and the gated row names) whose unit is GPT-OSS's clamped SwiGLU: the only
#: ones that take ``alpha`` and ``limit``.
_CLAMPED_UNITS = (SWIGLU_OAI, SWIGLU_OAI + INTERLEAVED)
CLAMPED: tuple[str, ...] = (
    *_CLAMPED_UNITS,
    *(name for name, unit in GATED.items() if unit in _CLAMPED_UNITS),
)


def clamp_constants(
    name: str | None, alpha: float | None = None, limit: float | None = None
) -> tuple[float, float]:
    """(alpha, limit) of the clamped SwiGLU, None standing for GPT-OSS's constants. Raises
    ValueError for constants given with a name that takes none (not in :data:`CLAMPED`), and for
    a limit that is not positive or an alpha that is not finite (the contracts' rules)."""
    if name not in CLAMPED:
        if alpha is not None or limit is not None:
            raise ValueError(
                f"alpha and limit are constants of the clamped SwiGLU ({', '.join(CLAMPED)}); "
                f"activation {name!r} takes none"
            )
        return SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT
    alpha = SWIGLU_OAI_ALPHA if alpha is None else float(alpha)
    limit = SWIGLU_OAI_LIMIT if limit is None else float(limit)
    if not math.isfinite(alpha):
        raise ValueError(f"alpha must be finite; got {alpha}")
    if not limit > 0:
        raise ValueError(f"limit must be positive (inf: no clamp); got {limit}")
    return alpha, limit


def activate(
    x: Tensor, name: str | None, alpha: float | None = None, limit: float | None = None
) -> Tensor:
    """``x`` through the named activation (``x`` itself for None; a gated name: :func:`glu`,
    with the clamped SwiGLU's ``alpha`` and ``limit``)."""
    if name in GATED:
        return glu(x, GATED[name], alpha, limit)
    clamp_constants(name, alpha, limit)  # none taken: refuses them
    if name is None:
        return x
    return ACTIVATIONS[name][0](x)


def activate_with(
    call: Callable[..., Tensor],
    x: Tensor,
    name: str | None,
    alpha: float | None = None,
    limit: float | None = None,
) -> Tensor:
    """:func:`activate`, a gated activation computed by ``call("glu", x, gate, alpha, limit)``
    (the dispatched ``glu`` op: a backend's one-pass kernel, differentiable when recorded)
    instead of the float32 definition's several passes."""
    if name in GATED:
        return call("glu", x, GATED[name], alpha, limit)
    return activate(x, name, alpha, limit)


def activate_backward(
    grad: Tensor, x: Tensor, name: str, alpha: float | None = None, limit: float | None = None
) -> Tensor:
    """The gradient of ``activate(x, name, alpha, limit)`` times ``grad``, with respect to ``x``."""
    if name in GATED:
        return glu_backward(grad, x, GATED[name], alpha, limit)
    clamp_constants(name, alpha, limit)
    return ACTIVATIONS[name][1](grad, x)


def _wide(x: Tensor) -> Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _split(x: Tensor, name: str | None) -> tuple[Tensor, Tensor, str | None, bool]:
    """(gate, up) of x widened, the unit's name without the layout suffix, and whether x is
    interleaved."""
    wide = _wide(x)
    if name is not None and name.endswith(INTERLEAVED):
        return wide[..., 0::2], wide[..., 1::2], name[: -len(INTERLEAVED)], True
    gate, up = wide.chunk(2, dim=-1)
    return gate, up, name, False


def _join(grad_gate: Tensor, grad_up: Tensor, interleaved: bool) -> Tensor:
    if interleaved:
        return torch.stack((grad_gate, grad_up), dim=-1).flatten(-2)
    return torch.cat((grad_gate, grad_up), dim=-1)


def _clamped(gate: Tensor, up: Tensor, limit: float) -> tuple[Tensor, Tensor]:
    """GPT-OSS's clamps: the gate from above, up on both sides, then up + 1."""
    return gate.clamp(max=limit), up.clamp(-limit, limit) + 1


def glu(
    x: Tensor, name: str | None, alpha: float | None = None, limit: float | None = None
) -> Tensor:
    """``act(gate) * up`` where ``x = [gate | up]`` holds the two halves of its last dimension
    side by side (SwiGLU with "silu", GEGLU with "gelu"; None: the bilinear ``gate * up``;
    :data:`SWIGLU_OAI`: GPT-OSS's clamped unit with the constants ``alpha`` and ``limit``, None
    for GPT-OSS's; a name with the suffix :data:`INTERLEAVED`: gate and up interleaved),
    computed in float32 (float64 for float64 x) and rounded once to x's dtype."""
    alpha, limit = clamp_constants(name, alpha, limit)
    gate, up, unit, _ = _split(x, name)
    if unit == SWIGLU_OAI:
        gate, up = _clamped(gate, up, limit)
        return (gate * torch.sigmoid(alpha * gate) * up).to(x.dtype)
    return (activate(gate, unit) * up).to(x.dtype)


def glu_backward(
    grad: Tensor,
    x: Tensor,
    name: str | None,
    alpha: float | None = None,
    limit: float | None = None,
) -> Tensor:
    """The gradient of :func:`glu` with respect to ``x`` (both halves, in x's layout) for the
    output gradient ``grad``, computed as :func:`glu` is."""
    alpha, limit = clamp_constants(name, alpha, limit)
    gate, up, unit, interleaved = _split(x, name)
    wide_grad = grad.to(gate.dtype)
    if unit == SWIGLU_OAI:
        clamped_gate, shifted_up = _clamped(gate, up, limit)
        s = torch.sigmoid(alpha * clamped_gate)
        # torch.clamp's gradient: 1 inside the closed interval, 0 outside.
        slope = (s + alpha * clamped_gate * s * (1 - s)) * (gate <= limit)
        grad_gate = wide_grad * shifted_up * slope
        grad_up = wide_grad * clamped_gate * s * ((up >= -limit) & (up <= limit))
        return _join(grad_gate, grad_up, interleaved).to(x.dtype)
    grad_gate = wide_grad * up
    if unit is not None:
        grad_gate = activate_backward(grad_gate, gate, unit)
    return _join(grad_gate, wide_grad * activate(gate, unit), interleaved).to(x.dtype)


def activation_backward(
    grad: Tensor,
    x: Tensor,
    scale: Tensor | None,
    name: str | None,
    alpha: float | None = None,
    limit: float | None = None,
) -> tuple[Tensor, Tensor]:
    """What the backward of an activation that feeds a weighted GEMM needs, from its GEMM's row
    gradients ``grad`` (before the rows' ``scale``) and the pre-activation rows ``x``:

    - ``grad_x = scale[i] * grad * act'(x)``, the gradient of x (float32, rounded once);
    - ``dots[i] = <act[i], grad[i]>`` accumulated in float32 (float64 for float64 x), rounded to
      x's dtype: the gradient of the row's scale;
    - ``act = act(x)`` rounded to x's dtype, the GEMM's input again (for its weight gradient),
      written over ``grad`` in place once grad has been read.

    Returns ``(grad_x, dots)``. ``scale`` None means 1; ``name`` None is the identity (act = x,
    act' = 1). With a gated name (:data:`GATED`) x is ``(rows, 2n)``, [gate | up], and grad
    ``(rows, n)``: act is :func:`glu`'s output and grad_x both halves of :func:`glu_backward`'s,
    scaled. ``alpha`` and ``limit``: the clamped SwiGLU's constants (:data:`CLAMPED` names)."""
    wide_x, wide_grad = _wide(x), _wide(grad)
    act = activate(wide_x, name, alpha, limit).to(x.dtype)
    dots = (_wide(act) * wide_grad).sum(dim=-1).to(x.dtype)
    if scale is not None:
        wide_grad = wide_grad * _wide(scale).unsqueeze(-1)
    grad_x = wide_grad if name is None else activate_backward(wide_grad, wide_x, name, alpha, limit)
    # copy=True: grad_x never aliases grad (float32 data with no scale or activation would),
    # which is overwritten next.
    grad_x = grad_x.to(x.dtype, copy=True)
    grad.copy_(act)
    return grad_x, dots


__all__ = [
    "ACTIVATIONS",
    "CLAMPED",
    "GATED",
    "GLU_NAMES",
    "INTERLEAVED",
    "NAMES",
    "ROW_NAMES",
    "SWIGLU_OAI",
    "SWIGLU_OAI_ALPHA",
    "SWIGLU_OAI_LIMIT",
    "activate",
    "activate_backward",
    "activate_with",
    "activation_backward",
    "clamp_constants",
    "gelu_erf",
    "gelu_tanh",
    "glu",
    "glu_backward",
]
