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

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor


def gelu_tanh(x: Tensor) -> Tensor:
    """GELU with the tanh approximation: MegaBlocks' default ``activation_fn`` (layers/arguments.py)."""
    return F.gelu(x, approximate="tanh")


def _relu_backward(grad: Tensor, x: Tensor) -> Tensor:
    return grad * (x > 0)


def _silu_backward(grad: Tensor, x: Tensor) -> Tensor:
    if torch.is_grad_enabled():  # recorded (double backward): aten's silu_backward has no formula
        s = torch.sigmoid(x)
        return grad * (s * (1 + x * (1 - s)))
    return torch.ops.aten.silu_backward(grad, x)


#: Name -> (function, its backward ``(grad of the output, input) -> grad of the input``).
ACTIVATIONS: dict[str, tuple[Callable[[Tensor], Tensor], Callable[[Tensor, Tensor], Tensor]]] = {
    "gelu": (gelu_tanh, lambda g, x: torch.ops.aten.gelu_backward(g, x, approximate="tanh")),
    "silu": (F.silu, _silu_backward),
    "relu": (F.relu, _relu_backward),
}

#: The names, in the order the docs list them.
NAMES: tuple[str, ...] = tuple(ACTIVATIONS)

#: Gated activations by name → the gate's activation: ``act(gate) * up`` of rows that hold gate
#: and up side by side, ``(rows, 2n)`` → ``(rows, n)`` (:func:`glu`; the GLU variants GEGLU,
#: SwiGLU, ReGLU and the bilinear unit).
GATED: dict[str, str | None] = {
    "geglu": "gelu",
    "swiglu": "silu",
    "reglu": "relu",
    "bilinear": None,
}

#: Every name an op that activates its input rows takes (``gmm_scatter``, ``activation_backward``).
ROW_NAMES: tuple[str, ...] = NAMES + tuple(GATED)


def activate(x: Tensor, name: str | None) -> Tensor:
    """``x`` through the named activation (``x`` itself for None; a gated name: :func:`glu`)."""
    if name is None:
        return x
    if name in GATED:
        return glu(x, GATED[name])
    return ACTIVATIONS[name][0](x)


def activate_with(call: Callable[..., Tensor], x: Tensor, name: str | None) -> Tensor:
    """:func:`activate`, a gated activation computed by ``call("glu", x, gate)`` (the dispatched
    ``glu`` op: a backend's one-pass kernel, differentiable when recorded) instead of the
    float32 definition's several passes."""
    if name in GATED:
        return call("glu", x, GATED[name])
    return activate(x, name)


def activate_backward(grad: Tensor, x: Tensor, name: str) -> Tensor:
    """The gradient of ``activate(x, name)`` times ``grad``, with respect to ``x``."""
    if name in GATED:
        return glu_backward(grad, x, GATED[name])
    return ACTIVATIONS[name][1](grad, x)


def _wide(x: Tensor) -> Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


def glu(x: Tensor, name: str | None) -> Tensor:
    """``act(gate) * up`` where ``x = [gate | up]`` holds the two halves of its last dimension
    side by side (SwiGLU with "silu", GEGLU with "gelu"; None: the bilinear ``gate * up``),
    computed in float32 (float64 for float64 x) and rounded once to x's dtype."""
    gate, up = _wide(x).chunk(2, dim=-1)
    return (activate(gate, name) * up).to(x.dtype)


def glu_backward(grad: Tensor, x: Tensor, name: str | None) -> Tensor:
    """The gradient of :func:`glu` with respect to ``x`` (gate half, then up half) for the
    output gradient ``grad``, computed as :func:`glu` is."""
    gate, up = _wide(x).chunk(2, dim=-1)
    wide_grad = grad.to(gate.dtype)
    grad_gate = wide_grad * up
    if name is not None:
        grad_gate = activate_backward(grad_gate, gate, name)
    return torch.cat((grad_gate, wide_grad * activate(gate, name)), dim=-1).to(x.dtype)


def activation_backward(
    grad: Tensor, x: Tensor, scale: Tensor | None, name: str | None
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
    scaled."""
    wide_x, wide_grad = _wide(x), _wide(grad)
    act = activate(wide_x, name).to(x.dtype)
    dots = (_wide(act) * wide_grad).sum(dim=-1).to(x.dtype)
    if scale is not None:
        wide_grad = wide_grad * _wide(scale).unsqueeze(-1)
    grad_x = wide_grad if name is None else activate_backward(wide_grad, wide_x, name)
    # copy=True: grad_x never aliases grad (float32 data with no scale or activation would),
    # which is overwritten next.
    grad_x = grad_x.to(x.dtype, copy=True)
    grad.copy_(act)
    return grad_x, dots


__all__ = [
    "ACTIVATIONS",
    "GATED",
    "NAMES",
    "ROW_NAMES",
    "activate",
    "activate_backward",
    "activate_with",
    "activation_backward",
    "gelu_tanh",
    "glu",
    "glu_backward",
]
