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

from megablocks_core.plugin import GATED_ACTIVATIONS

from .config import launch_configs
from .launch import BoundLaunch, bind, cdiv, next_power_of_2, remember

#: The ``ACTIVATION`` constexpr of the kernels, by the contract's name.
_CODES = {None: 0, "gelu": 1, "silu": 2, "relu": 3}
# Globals a jit function reads must be constexprs.
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
_GELU_CUBIC = tl.constexpr(0.044715)


@triton.jit
def _activate(gate, ACTIVATION: tl.constexpr):
    if ACTIVATION == 1:  # GELU, tanh approximation: 0.5 g (1 + tanh(z)) = g sigmoid(2z)
        inner = _SQRT_2_OVER_PI * (gate + _GELU_CUBIC * gate * gate * gate)
        return gate / (1.0 + tl.exp(-2.0 * inner))
    elif ACTIVATION == 2:  # SiLU
        return gate / (1.0 + tl.exp(-gate))
    elif ACTIVATION == 3:  # ReLU
        return tl.maximum(gate, 0.0)
    else:
        return gate


@triton.jit
def _derivative(gate, ACTIVATION: tl.constexpr):
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
    else:
        return tl.full(gate.shape, 1.0, tl.float32)


@triton.jit
def _halves(x_ptr, rows, n, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """This program's (BLOCK_R, BLOCK_C) tile of gate and up (float32), the tile's offsets in a
    (rows, n) tensor and in x, and its mask."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)[:, None]
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]
    mask = (r < rows) & (c < n)
    in_x = r * (2 * n) + c
    gate = tl.load(x_ptr + in_x, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + in_x + n, mask=mask, other=0.0).to(tl.float32)
    return gate, up, r * n + c, in_x, mask


@triton.jit
def _glu_kernel(
    x_ptr,
    out_ptr,
    rows,
    n,
    ACTIVATION: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    gate, up, at, _, mask = _halves(x_ptr, rows, n, BLOCK_R, BLOCK_C)
    out = _activate(gate, ACTIVATION) * up
    tl.store(out_ptr + at, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _glu_backward_kernel(
    grad_ptr,
    x_ptr,
    out_ptr,
    rows,
    n,
    ACTIVATION: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    gate, up, at, in_x, mask = _halves(x_ptr, rows, n, BLOCK_R, BLOCK_C)
    grad = tl.load(grad_ptr + at, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + in_x, (grad * up * _derivative(gate, ACTIVATION)).to(dtype), mask=mask)
    tl.store(out_ptr + in_x + n, (grad * _activate(gate, ACTIVATION)).to(dtype), mask=mask)


@triton.jit
def _activation_backward_kernel(
    grad_ptr,
    x_ptr,
    scale_ptr,
    grad_x_ptr,
    dots_ptr,
    rows,
    n,
    HAS_SCALE: tl.constexpr,
    ACTIVATION: tl.constexpr,
    GATED: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
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
        in_x = r[:, None] * x_width + c
        x = tl.load(x_ptr + in_x, mask=mask, other=0.0).to(tl.float32)
        grad = tl.load(grad_ptr + at, mask=mask, other=0.0).to(tl.float32)
        activated = _activate(x, ACTIVATION)
        if GATED:
            up = tl.load(x_ptr + in_x + n, mask=mask, other=0.0).to(tl.float32)
            act = (activated * up).to(dtype)
        else:
            act = activated.to(dtype)
        dots += tl.sum(act.to(tl.float32) * grad, axis=1)
        if HAS_SCALE:
            grad = grad * scale
        if GATED:  # glu's backward: the gate's gradient, then up's
            tl.store(
                grad_x_ptr + in_x, (grad * up * _derivative(x, ACTIVATION)).to(dtype), mask=mask
            )
            tl.store(grad_x_ptr + in_x + n, (grad * activated).to(dtype), mask=mask)
        else:
            tl.store(grad_x_ptr + in_x, (grad * _derivative(x, ACTIVATION)).to(dtype), mask=mask)
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


#: (kernel, dtype, rows, n, activation, policy[, scale's dtype]) -> the bound launch (its
#: compiled kernel is pinned per dtype): a call computes no launch key, most of a small call's
#: host cost.
_PLANS: dict[tuple[Any, ...], BoundLaunch] = {}


def _launch(
    kernel: Any, dtype: torch.dtype, rows: int, n: int, activation: str | None
) -> BoundLaunch:
    configs = launch_configs()
    key = (kernel, dtype, rows, n, activation, configs)
    plan = _PLANS.get(key)
    if plan is None:
        grid, blocks = _tiles(rows, n)
        options = configs.launch_options("permutation")  # bandwidth-bound, like a copy
        bound = bind(kernel, grid, rows, n, ACTIVATION=_CODES[activation], **blocks, **options)
        plan = remember(_PLANS, key, bound)
    return plan


def glu(x: torch.Tensor, activation: str | None) -> torch.Tensor:
    rows, n = x.shape[0], x.shape[1] // 2
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if out.numel():
        _launch(_glu_kernel, x.dtype, rows, n, activation)(x, out)
    return out


def glu_backward(grad: torch.Tensor, x: torch.Tensor, activation: str | None) -> torch.Tensor:
    rows, n = x.shape[0], x.shape[1] // 2
    out = torch.empty_like(x)
    if out.numel():
        _launch(_glu_backward_kernel, x.dtype, rows, n, activation)(grad, x, out)
    return out


def activation_backward(
    grad: torch.Tensor, x: torch.Tensor, scale: torch.Tensor | None, activation: str | None
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
    key = (kernel, x.dtype, rows, n, activation, configs, None if scale is None else scale.dtype)
    plan = _PLANS.get(key)
    if plan is None:
        # Whole rows per program, columns in steps of up to 256, 2048 elements per step: the
        # best of 36 tilings on the H200 at n = 768, 1536 and 2048 (docs/performance.md); gated
        # rows too (no tiling of 18 more than 2.5 % faster).
        block_c = min(next_power_of_2(n), 256)
        block_r = min(max(2048 // block_c, 1), next_power_of_2(rows))
        options = configs.launch_options("permutation")
        bound = bind(
            kernel,
            (cdiv(rows, block_r),),
            rows,
            n,
            HAS_SCALE=scale is not None,
            ACTIVATION=_CODES[gate],
            GATED=gated,
            BLOCK_R=block_r,
            BLOCK_C=block_c,
            num_warps=4,
            **options,
        )
        plan = remember(_PLANS, key, bound)
    # act goes over grad (each step's tile once the program has read it). Without a scale the
    # kernel reads none (HAS_SCALE is false): dots only fills the slot.
    plan(grad, x, scale if scale is not None else dots, grad_x, dots)
    return grad_x, dots
