"""Second-order gradients (``create_graph=True``) on every backend.

A backward recorded for double backward runs the core's rules, which call kernel-level ops
(``gmm_weight_grad``, ``scatter_wgrad``, weighted gathers, ...). Those ops are differentiable
too, so every second-order term is recorded whatever backend serves them. Checked two ways:

- numerically (``gradgradcheck``) in float64 on the reference backend, op by op, the
  kernel-level ops included;
- the Triton backend in float32 (under the interpreter on the CPU, compiled on a GPU) against the
  reference in float64: Hessian-vector products of a loss through each differentiable op and
  through a whole dMoE layer's gradient penalty. A dropped term is off by tens of percent.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Sequence

import pytest
import torch
from triton_interpreter import interpreting

import megablocks_core
from megablocks_core import ops
from megablocks_core.entries import call
from megablocks_core.layers import dMoE

F64 = torch.float64


def _routing(tokens: int, top_k: int, experts: int, seed: int, device: torch.device | str = "cpu"):
    gen = torch.Generator().manual_seed(seed)
    top = torch.randint(0, experts, (tokens * top_k,), generator=gen, dtype=torch.int32)
    top[: min(2, top.numel())] = 0  # expert 0 holds several rows while others may stay empty
    top = top.to(device)
    with megablocks_core.use_backend("reference"):
        bin_ids, indices = ops.sort(top, max((experts - 1).bit_length(), 1))
        counts = ops.histogram(top, experts)
        bins = ops.inclusive_cumsum(counts, 0)
        padded_bins = ops.inclusive_cumsum(ops.round_up(counts, 4), 0)
    return indices, bin_ids, bins, padded_bins, counts


def _leaf(*shape: int, positive: bool = False) -> torch.Tensor:
    t = torch.rand(*shape, dtype=F64).add(0.5) if positive else torch.randn(*shape, dtype=F64)
    return t.requires_grad_()


# ---------------------------------------------------------------------------
# Numerically, op by op, on the reference backend (float64)


@pytest.mark.usefixtures("reference_backend")
@pytest.mark.parametrize("top_k", [1, 2])
def test_kernel_level_permutation_ops_second_order(top_k):
    tokens, experts, hidden, capacity = 4, 3, 3, 2
    indices, bin_ids, bins, padded_bins, _ = _routing(tokens, top_k, experts, seed=top_k)
    n = tokens * top_k
    padded = int(padded_bins[-1])
    cases: dict[str, tuple[Callable[..., torch.Tensor], tuple[torch.Tensor, ...]]] = {
        "scatter_wgrad": (
            lambda x, g: call("scatter_wgrad", x, g, indices, bin_ids, bins, top_k),
            (_leaf(n, hidden), _leaf(tokens, hidden)),
        ),
        "padded_scatter_wgrad": (
            lambda x, g: call(
                "padded_scatter_wgrad", x, g, indices, bin_ids, bins, padded_bins, top_k
            ),
            (_leaf(padded, hidden), _leaf(tokens, hidden)),
        ),
        "binned_scatter_wgrad": (
            lambda x, g: call("binned_scatter_wgrad", x, g, indices, bins, top_k),
            (_leaf(experts, capacity, hidden), _leaf(tokens, hidden)),
        ),
        "weighted gather": (
            lambda x, w: call("gather", x, indices, bin_ids, w, bins, top_k, None),
            (_leaf(tokens, hidden), _leaf(n, positive=True)),
        ),
        "weighted padded_gather": (
            lambda x, w: call("padded_gather", x, indices, bin_ids, w, bins, padded_bins, top_k),
            (_leaf(tokens, hidden), _leaf(n, positive=True)),
        ),
        "weighted binned_gather": (
            lambda x, w: call("binned_gather", x, indices, w, bins, capacity, top_k),
            (_leaf(tokens, hidden), _leaf(n, positive=True)),
        ),
        "weighted padded_scatter": (
            lambda x, w: ops.padded_scatter(x, indices, bin_ids, w, bins, padded_bins, top_k),
            (_leaf(padded, hidden), _leaf(n, positive=True)),
        ),
        "weighted binned_scatter": (
            lambda x, w: ops.binned_scatter(x, indices, w, bins, top_k),
            (_leaf(experts, capacity, hidden), _leaf(n, positive=True)),
        ),
    }
    for name, (fn, inputs) in cases.items():
        assert torch.autograd.gradcheck(fn, inputs), name
        assert torch.autograd.gradgradcheck(fn, inputs), name


@pytest.mark.usefixtures("reference_backend")
def test_replicate_backward_and_gmm_weight_grad_second_order():
    bins = torch.tensor([2, 2, 5, 6], dtype=torch.int32)  # bin 1 is empty
    rb = (lambda g: call("replicate_backward", g, bins), (_leaf(3, 6),))
    sizes = torch.tensor([3, 0, 4, 1])
    wg = (lambda a, g: call("gmm_weight_grad", a, g, sizes), (_leaf(8, 5), _leaf(8, 3)))
    for fn, inputs in (rb, wg):
        assert torch.autograd.gradcheck(fn, inputs)
        assert torch.autograd.gradgradcheck(fn, inputs)


# ---------------------------------------------------------------------------
# The Triton backend (float32) against the reference (float64)

DEVICE = torch.device(
    os.environ.get("MEGABLOCKS_TRITON_TEST_DEVICE", "cpu" if interpreting() else "cuda")
)
_RUNNABLE = interpreting() if DEVICE.type == "cpu" else torch.cuda.is_available()
needs_triton = pytest.mark.skipif(
    not _RUNNABLE or importlib.util.find_spec("megablocks_triton") is None,
    reason=f"Triton kernels on {DEVICE}: CPU tensors need TRITON_INTERPRET=1, GPU tensors a GPU",
)


def _hvp(
    loss_fn: Callable[..., torch.Tensor],
    values: Sequence[torch.Tensor],
    directions: Sequence[torch.Tensor],
    dtype: torch.dtype,
    backend: str,
) -> list[torch.Tensor]:
    """d/dθ <∇loss(θ), v> at θ = values, computed in ``dtype`` on ``backend``, as float64."""
    leaves = [v.to(DEVICE, dtype).requires_grad_() for v in values]
    with megablocks_core.use_backend(backend):
        grads = torch.autograd.grad(loss_fn(*leaves), leaves, create_graph=True)
        inner = sum((g * d.to(DEVICE, dtype)).sum() for g, d in zip(grads, directions, strict=True))
        second = torch.autograd.grad(inner, leaves, allow_unused=True, materialize_grads=True)
    return [s.detach().to("cpu", F64) for s in second]


def _assert_hvp_matches(loss_fn, values, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    directions = [torch.randn(v.shape, generator=gen, dtype=F64) for v in values]
    want = _hvp(loss_fn, values, directions, F64, "reference")
    got = _hvp(loss_fn, values, directions, torch.float32, "triton")
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        scale = max(float(w.abs().max()), 1e-12)
        error = float((g - w).abs().max()) / scale
        assert error < 1e-4, f"input {i}: second-order term off by {error:.2%} of its scale"


def _values(*shapes: tuple[int, ...], positive_last: bool = False, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    out = [torch.randn(s, generator=gen, dtype=F64) for s in shapes]
    if positive_last:
        out[-1] = out[-1].abs() + 0.5
    return out


@needs_triton
@pytest.mark.parametrize("trans_b", [False, True])
def test_triton_gmm_hessian_vector_product(trans_b):
    sizes = torch.tensor([3, 0, 4, 2])
    b_shape = (4, 5, 6) if trans_b else (4, 6, 5)

    def loss(a, b):
        return ops.gmm(a, b, sizes, trans_b).pow(2).sum()

    _assert_hvp_matches(loss, _values((9, 6), b_shape))


@needs_triton
@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_triton_weighted_scatter_and_gather_hessian_vector_product(top_k):
    tokens, experts, hidden = 5, 4, 6
    indices, bin_ids, bins, _, _ = _routing(tokens, top_k, experts, seed=top_k, device=DEVICE)

    def loss(x, w):
        rows = ops.gather(x, indices, bin_ids, bins, top_k)
        return ops.scatter(rows.pow(2), indices, bin_ids, w, bins, top_k).pow(2).sum()

    _assert_hvp_matches(loss, _values((tokens, hidden), (tokens * top_k,), positive_last=True))


@needs_triton
@pytest.mark.parametrize("activation", [None, "gelu", "swiglu"])
def test_triton_fused_experts_hessian_vector_product(activation):
    tokens, top_k, experts, hidden, ffn = 6, 2, 3, 4, 5
    indices, bin_ids, bins, _, _ = _routing(tokens, top_k, experts, seed=7, device=DEVICE)
    width = 2 * ffn if activation == "swiglu" else ffn

    def loss(x, w1, w2, weights):
        h = ops.gather_gmm(x, w1, indices, bin_ids, bins, top_k, False)
        y = ops.gmm_scatter(h, w2, indices, bin_ids, weights, bins, top_k, False, activation)
        return y.pow(2).sum()

    values = _values(
        (tokens, hidden),
        (experts, hidden, width),
        (experts, ffn, hidden),
        (tokens * top_k,),
        positive_last=True,
    )
    _assert_hvp_matches(loss, values)


@needs_triton
def test_triton_padded_and_binned_scatter_hessian_vector_product():
    tokens, top_k, experts, hidden, capacity = 5, 2, 3, 4, 3
    indices, bin_ids, bins, padded_bins, _ = _routing(tokens, top_k, experts, seed=3, device=DEVICE)
    padded = int(padded_bins[-1])

    def padded_loss(x, w):
        return ops.padded_scatter(x, indices, bin_ids, w, bins, padded_bins, top_k).pow(2).sum()

    def binned_loss(x, w):
        return ops.binned_scatter(x, indices, w, bins, top_k).pow(2).sum()

    n = tokens * top_k
    _assert_hvp_matches(padded_loss, _values((padded, hidden), (n,), positive_last=True))
    _assert_hvp_matches(binned_loss, _values((experts, capacity, hidden), (n,), positive_last=True))


@needs_triton
def test_triton_replicate_hessian_vector_product():
    bins = torch.tensor([2, 2, 5, 6], dtype=torch.int32, device=DEVICE)

    def loss(x):
        return ops.replicate(x, bins, 6).pow(3).sum()

    _assert_hvp_matches(loss, _values((3, 4)))


@needs_triton
@pytest.mark.parametrize("glu", [False, True])
def test_triton_dmoe_gradient_penalty(glu):
    """A gradient penalty (the norm of the loss's input gradient, itself differentiated) on a
    whole dMoE layer: the expert weights' gradients need every second-order term."""
    torch.manual_seed(0)
    layer = dMoE(hidden_size=8, ffn_hidden_size=6, num_experts=4, top_k=2, glu=glu, dtype=F64)
    layer.reset_parameters(std=0.5)  # weights of order 1: the penalty's gradients are too
    x = torch.randn(10, 8, dtype=F64)
    names = [n for n, _ in layer.named_parameters()]

    def penalty_grads(dtype: torch.dtype, backend: str) -> dict[str, torch.Tensor]:
        copy = dMoE(
            hidden_size=8, ffn_hidden_size=6, num_experts=4, top_k=2, glu=glu, dtype=dtype
        ).to(DEVICE)
        copy.load_state_dict({k: v.to(dtype) for k, v in layer.state_dict().items()})
        inputs = x.to(DEVICE, dtype).requires_grad_()
        with megablocks_core.use_backend(backend):
            out, _ = copy(inputs)
            (input_grad,) = torch.autograd.grad(out.pow(2).sum(), inputs, create_graph=True)
            grads = torch.autograd.grad(input_grad.pow(2).sum(), list(copy.parameters()))
        return {n: g.to("cpu", F64) for n, g in zip(names, grads, strict=True)}

    want = penalty_grads(F64, "reference")
    got = penalty_grads(torch.float32, "triton")
    for name in names:
        scale = max(float(want[name].abs().max()), 1e-12)
        error = float((got[name] - want[name]).abs().max()) / scale
        assert error < 1e-4, f"{name}: off by {error:.2%}"
