"""The gated unit of gated experts (``glu``) and its gradient (``glu_backward``), one pass each;
``activation_backward``, an expert MLP's activation in backward (a gated one's too), in one pass.

``x`` holds each row's gate and up projections side by side, ``(rows, 2n)``. Composed from torch,
SwiGLU is a SiLU pass and a product pass forward and four passes backward, each a round trip
through memory of a ``(rows, n)`` tensor; here the forward reads x once and writes the
``(rows, n)`` product, the backward reads ``grad`` and x once and writes both halves of x's
gradient. Arithmetic in float32, rounded once to the data's dtype (as
``megablocks_core.activations.glu``).
"""

from __future__ import annotations

from typing import Any

import torch
import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

from megablocks_core.plugin import GATED_ACTIVATIONS, clamp_constants

from .config import launch_configs
from .launch import BoundLaunch, bind, cdiv, next_power_of_2, remember

#: The ``ACTIVATION`` constexpr of the kernels, by the contract's name.
#: 5: GPT-OSS's clamped SwiGLU unit (glu's "silu_oai"), which also transforms up; its constants
#: ``alpha`` and ``limit`` are runtime arguments of every kernel here (any value, one compiled
#: kernel; the other units ignore them).
_CODES = {None: 0, "gelu": 1, "gelu_tanh": 1, "silu": 2, "relu": 3, "gelu_erf": 4, "silu_oai": 5}
_INTERLEAVED = "_interleaved"
# Globals a jit function reads must be constexprs.
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
_GELU_CUBIC = tl.constexpr(0.044715)
_SQRT_HALF = tl.constexpr(0.7071067811865476)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)


def _unit(name: str | None) -> tuple[int, bool]:
    """(the ACTIVATION code, INTERLEAVED) of a glu name."""
    if name is not None and name.endswith(_INTERLEAVED):
        return _CODES[name[: -len(_INTERLEAVED)]], True
    return _CODES[name], False


@triton.jit
def _activate(gate, alpha, limit, ACTIVATION: tl.constexpr):
    if ACTIVATION == 1:  # GELU, tanh approximation: 0.5 g (1 + tanh(z)) = g sigmoid(2z)
        inner = _SQRT_2_OVER_PI * (gate + _GELU_CUBIC * gate * gate * gate)
        return gate / (1.0 + tl.exp(-2.0 * inner))
    elif ACTIVATION == 2:  # SiLU
        return gate / (1.0 + tl.exp(-gate))
    elif ACTIVATION == 3:  # ReLU
        return tl.maximum(gate, 0.0)
    elif ACTIVATION == 4:  # GELU, exact: g Phi(g)
        return 0.5 * gate * (1.0 + tl.math.erf(gate * _SQRT_HALF))
    elif ACTIVATION == 5:  # GPT-OSS: g sigmoid(alpha g) of g = min(gate, limit)
        clamped = tl.minimum(gate, limit)
        return clamped / (1.0 + tl.exp(-alpha * clamped))
    else:
        return gate


@triton.jit
def _derivative(gate, alpha, limit, ACTIVATION: tl.constexpr):
    """d act(gate) / d gate (torch's formulas: ReLU's is 0 at 0), written without the
    cancellation of 1 + tanh(z) where tanh(z) is near -1."""
    if ACTIVATION == 1:
        # With s = sigmoid(2z): 1 + tanh(z) = 2s and 1 - tanh(z)^2 = 4s(1 - s).
        inner = _SQRT_2_OVER_PI * (gate + _GELU_CUBIC * gate * gate * gate)
        s = 1.0 / (1.0 + tl.exp(-2.0 * inner))
        slope = _SQRT_2_OVER_PI * (1.0 + 3.0 * _GELU_CUBIC * gate * gate)
        return s + 2.0 * gate * s * (1.0 - s) * slope
    elif ACTIVATION == 2:
        s = 1.0 / (1.0 + tl.exp(-gate))
        return s * (1.0 + gate * (1.0 - s))
    elif ACTIVATION == 3:
        return tl.where(gate > 0.0, 1.0, 0.0)
    elif ACTIVATION == 4:  # Phi(g) + g phi(g)
        cdf = 0.5 * (1.0 + tl.math.erf(gate * _SQRT_HALF))
        return cdf + gate * _INV_SQRT_2PI * tl.exp(-0.5 * gate * gate)
    elif ACTIVATION == 5:  # the clamp passes the gradient where gate <= limit (as torch.clamp)
        clamped = tl.minimum(gate, limit)
        s = 1.0 / (1.0 + tl.exp(-alpha * clamped))
        return tl.where(gate <= limit, s + alpha * clamped * s * (1.0 - s), 0.0)
    else:
        return tl.full(gate.shape, 1.0, tl.float32)


@triton.jit
def _up(up, limit, ACTIVATION: tl.constexpr):
    """The up projection as the unit multiplies it: GPT-OSS's clamp(up, -limit, limit) + 1."""
    if ACTIVATION == 5:
        return tl.minimum(tl.maximum(up, -limit), limit) + 1.0
    else:
        return up


@triton.jit
def _up_slope(up, limit, ACTIVATION: tl.constexpr):
    """d _up(up) / d up."""
    if ACTIVATION == 5:
        return tl.where((up >= -limit) & (up <= limit), 1.0, 0.0)
    else:
        return tl.full(up.shape, 1.0, tl.float32)


@triton.jit
def _pairs(row_start, c):
    """Offsets of the (gate, up) pairs of interleaved columns 2c and 2c + 1: (..., 2), so that
    one contiguous load reads both (split after), instead of two loads of every other element."""
    return (row_start + 2 * c)[:, :, None] + tl.arange(0, 2)[None, None, :]


@triton.jit
def _load_gate_up(x_ptr, row_start, c, n, mask, INTERLEAVED: tl.constexpr):
    """gate and up (float32) of the rows starting at ``row_start`` (x's row offsets), columns c:
    x's two halves, or (INTERLEAVED) its even and odd columns."""
    if INTERLEAVED:
        both = tl.load(x_ptr + _pairs(row_start, c), mask=mask[:, :, None], other=0.0)
        gate, up = tl.split(both.to(tl.float32))
    else:
        gate = tl.load(x_ptr + (row_start + c), mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + (row_start + c + n), mask=mask, other=0.0).to(tl.float32)
    return gate, up


@triton.jit
def _store_gate_up(out_ptr, row_start, c, n, grad_gate, grad_up, mask, INTERLEAVED: tl.constexpr):
    """Stores the gradients of gate and up where _load_gate_up read them (in out's dtype)."""
    dtype = out_ptr.dtype.element_ty
    if INTERLEAVED:
        both = tl.join(grad_gate.to(dtype), grad_up.to(dtype))
        tl.store(out_ptr + _pairs(row_start, c), both, mask=mask[:, :, None])
    else:
        tl.store(out_ptr + (row_start + c), grad_gate.to(dtype), mask=mask)
        tl.store(out_ptr + (row_start + c + n), grad_up.to(dtype), mask=mask)


@triton.jit
def _halves(
    x_ptr, rows, n, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, INTERLEAVED: tl.constexpr
):
    """This program's (BLOCK_R, BLOCK_C) tile of gate and up (float32), its offsets in a
    (rows, n) tensor, the offsets of its rows in x and its columns, and its mask."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)[:, None]
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]
    mask = (r < rows) & (c < n)
    row_start = r * (2 * n)
    gate, up = _load_gate_up(x_ptr, row_start, c, n, mask, INTERLEAVED)
    return gate, up, r * n + c, row_start, c, mask


@triton.jit
def _glu_kernel(
    x_ptr,
    out_ptr,
    rows,
    n,
    alpha,
    limit,
    ACTIVATION: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    INTERLEAVED: tl.constexpr = False,
):
    gate, up, at, _, _, mask = _halves(x_ptr, rows, n, BLOCK_R, BLOCK_C, INTERLEAVED)
    out = _activate(gate, alpha, limit, ACTIVATION) * _up(up, limit, ACTIVATION)
    tl.store(out_ptr + at, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _glu_backward_kernel(
    grad_ptr,
    x_ptr,
    out_ptr,
    rows,
    n,
    alpha,
    limit,
    ACTIVATION: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    INTERLEAVED: tl.constexpr = False,
):
    gate, up, at, row_start, c, mask = _halves(x_ptr, rows, n, BLOCK_R, BLOCK_C, INTERLEAVED)
    grad = tl.load(grad_ptr + at, mask=mask, other=0.0).to(tl.float32)
    grad_gate = grad * _up(up, limit, ACTIVATION) * _derivative(gate, alpha, limit, ACTIVATION)
    grad_up = grad * _activate(gate, alpha, limit, ACTIVATION) * _up_slope(up, limit, ACTIVATION)
    _store_gate_up(out_ptr, row_start, c, n, grad_gate, grad_up, mask, INTERLEAVED)


@triton.jit
def _activation_backward_kernel(
    grad_ptr,
    x_ptr,
    scale_ptr,
    grad_x_ptr,
    dots_ptr,
    rows,
    n,
    alpha,
    limit,
    HAS_SCALE: tl.constexpr,
    ACTIVATION: tl.constexpr,
    GATED: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    INTERLEAVED: tl.constexpr = False,
):
    # Whole rows per program, so that each row's dot is summed in one place, in one order.
    # n is grad's width; a gated x holds gate and up side by side, rows of 2n. act(x) is written
    # over grad, each step's tile after the whole program has read it.
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < rows
    if HAS_SCALE:
        scale = tl.load(scale_ptr + r, mask=r_ok, other=0.0).to(tl.float32)[:, None]
    dtype = x_ptr.dtype.element_ty
    x_width = 2 * n if GATED else n
    dots = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for start in range(0, n, BLOCK_C):
        c = start + tl.arange(0, BLOCK_C)[None, :]
        mask = r_ok[:, None] & (c < n)
        at = r[:, None] * n + c
        row_start = r[:, None] * x_width
        if INTERLEAVED:  # gated rows holding gate and up in even and odd columns: one load
            x, up = _load_gate_up(x_ptr, row_start, c, n, mask, True)
        else:
            x = tl.load(x_ptr + (row_start + c), mask=mask, other=0.0).to(tl.float32)
        grad = tl.load(grad_ptr + at, mask=mask, other=0.0).to(tl.float32)
        activated = _activate(x, alpha, limit, ACTIVATION)
        if GATED:
            if not INTERLEAVED:
                up = tl.load(x_ptr + (row_start + c + n), mask=mask, other=0.0).to(tl.float32)
            act = (activated * _up(up, limit, ACTIVATION)).to(dtype)
        else:
            act = activated.to(dtype)
        dots += tl.sum(act.to(tl.float32) * grad, axis=1)
        if HAS_SCALE:
            grad = grad * scale
        if GATED:  # glu's backward: the gate's gradient, then up's
            grad_gate = grad * _up(up, limit, ACTIVATION) * _derivative(x, alpha, limit, ACTIVATION)
            grad_up = grad * activated * _up_slope(up, limit, ACTIVATION)
            _store_gate_up(grad_x_ptr, row_start, c, n, grad_gate, grad_up, mask, INTERLEAVED)
        else:
            grad_x = (grad * _derivative(x, alpha, limit, ACTIVATION)).to(dtype)
            tl.store(grad_x_ptr + (row_start + c), grad_x, mask=mask)
        # Every thread has used its grad values (act does not depend on them, and a thread may
        # store elements another thread loaded): the barrier orders those reads before act's
        # writes over them.
        tl.debug_barrier()
        tl.store(grad_ptr + at, act, mask=mask)
    tl.store(dots_ptr + r, dots.to(dtype), mask=r_ok)


def _tiles(rows: int, n: int) -> tuple[tuple[int, int], dict[str, int]]:
    """The grid and block sizes: 4096 elements of each half per program, columns first (rows
    of 16-bit data whose n is a multiple of 8 load in 16-byte vectors)."""
    block_c = min(next_power_of_2(n), 512)
    block_r = min(max(4096 // block_c, 1), next_power_of_2(rows))
    grid = (cdiv(rows, block_r), cdiv(n, block_c))
    warps = 8 if block_r * block_c >= 4096 else 4
    return grid, {"BLOCK_R": block_r, "BLOCK_C": block_c, "num_warps": warps}


#: (kernel, dtype, rows, n, activation, alpha, limit, policy[, scale's dtype]) -> the bound
#: launch (its compiled kernel is pinned per dtype): a call computes no launch key, most of a
#: small call's host cost.
_PLANS: dict[tuple[Any, ...], BoundLaunch] = {}


def _launch(
    kernel: Any,
    dtype: torch.dtype,
    rows: int,
    n: int,
    activation: str | None,
    alpha: float | None,
    limit: float | None,
) -> BoundLaunch:
    configs = launch_configs()
    key = (kernel, dtype, rows, n, activation, alpha, limit, configs)
    plan = _PLANS.get(key)
    if plan is None:
        grid, blocks = _tiles(rows, n)
        options = configs.launch_options("permutation")  # bandwidth-bound, like a copy
        code, interleaved = _unit(activation)
        layout = {"INTERLEAVED": True} if interleaved else {}  # the default keeps the old key
        constants = clamp_constants(activation, alpha, limit)
        bound = bind(
            kernel, grid, rows, n, *constants, ACTIVATION=code, **blocks, **layout, **options
        )
        plan = remember(_PLANS, key, bound)
    return plan


def glu(
    x: torch.Tensor,
    activation: str | None,
    alpha: float | None = None,
    limit: float | None = None,
) -> torch.Tensor:
    rows, n = x.shape[0], x.shape[1] // 2
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if out.numel():
        _launch(_glu_kernel, x.dtype, rows, n, activation, alpha, limit)(x, out)
    return out


def glu_backward(
    grad: torch.Tensor,
    x: torch.Tensor,
    activation: str | None,
    alpha: float | None = None,
    limit: float | None = None,
) -> torch.Tensor:
    rows, n = x.shape[0], x.shape[1] // 2
    out = torch.empty_like(x)
    if out.numel():
        _launch(_glu_backward_kernel, x.dtype, rows, n, activation, alpha, limit)(grad, x, out)
    return out


def activation_backward(
    grad: torch.Tensor,
    x: torch.Tensor,
    scale: torch.Tensor | None,
    activation: str | None,
    alpha: float | None = None,
    limit: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    rows, n = grad.shape
    gated = activation in GATED_ACTIVATIONS
    gate = GATED_ACTIVATIONS[activation] if activation is not None and gated else activation
    grad_x = torch.empty_like(x)
    if not grad.numel():  # no row, or rows of no element (their dots are 0)
        return grad_x, x.new_zeros(rows)
    dots = x.new_empty(rows)  # the kernel writes every row
    configs = launch_configs()
    kernel = _activation_backward_kernel
    key = (
        kernel, x.dtype, rows, n, activation, alpha, limit, configs,
        None if scale is None else scale.dtype,
    )  # fmt: skip
    plan = _PLANS.get(key)
    if plan is None:
        # Whole rows per program, columns in steps of up to 256, 2048 elements per step: the
        # best of 36 tilings on the H200 at n = 768, 1536 and 2048 (docs/performance.md); gated
        # rows too (no tiling of 18 more than 2.5 % faster).
        block_c = min(next_power_of_2(n), 256)
        block_r = min(max(2048 // block_c, 1), next_power_of_2(rows))
        options = configs.launch_options("permutation")
        code, interleaved = _unit(gate)
        bound = bind(
            kernel,
            (cdiv(rows, block_r),),
            rows,
            n,
            *clamp_constants(activation, alpha, limit),
            HAS_SCALE=scale is not None,
            ACTIVATION=code,
            GATED=gated,
            BLOCK_R=block_r,
            BLOCK_C=block_c,
            num_warps=4,
            **({"INTERLEAVED": True} if interleaved else {}),
            **options,
        )
        plan = remember(_PLANS, key, bound)
    # act goes over grad (each step's tile once the program has read it). Without a scale the
    # kernel reads none (HAS_SCALE is false): dots only fills the slot.
    plan(grad, x, scale if scale is not None else dots, grad_x, dots)
    return grad_x, dots
