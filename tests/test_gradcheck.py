"""Autograd of every differentiable op, checked numerically in float64 on the reference backend."""

from __future__ import annotations

import pytest
import torch

from megablocks_core import contracts, ops
from megablocks_core.autograd import RULES

pytestmark = pytest.mark.usefixtures("reference_backend")


def routing(tokens: int, top_k: int, experts: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    top = torch.randint(0, experts, (tokens * top_k,), generator=gen, dtype=torch.int32)
    top[: min(2, top.numel())] = 0  # several rows in expert 0 while some experts stay empty
    bin_ids, indices = ops.sort(top, max((experts - 1).bit_length(), 1))
    counts = ops.histogram(top, experts)
    bins = ops.inclusive_cumsum(counts, 0)
    padded_bins = ops.inclusive_cumsum(ops.round_up(counts, 4), 0)
    return indices, bin_ids, bins, padded_bins, counts


def f64(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64, requires_grad=True)


def w64(n: int) -> torch.Tensor:
    return torch.rand(n, dtype=torch.float64).add(0.5).requires_grad_()


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_permutation_ops(top_k):
    tokens, experts, hidden = 5, 6, 3
    indices, bin_ids, bins, padded_bins, counts = routing(tokens, top_k, experts, seed=top_k)
    n = tokens * top_k
    capacity = 2  # smaller than expert 0's rows: binned ops drop some
    cases = {
        "gather": (lambda x: ops.gather(x, indices, bin_ids, bins, top_k), (f64(tokens, hidden),)),
        "scatter": (
            lambda x, w: ops.scatter(x, indices, bin_ids, w, bins, top_k),
            (f64(n, hidden), w64(n)),
        ),
        "padded_gather": (
            lambda x: ops.padded_gather(x, indices, bin_ids, bins, padded_bins, top_k),
            (f64(tokens, hidden),),
        ),
        "padded_scatter": (
            lambda x, w: ops.padded_scatter(x, indices, bin_ids, w, bins, padded_bins, top_k),
            (f64(int(padded_bins[-1]), hidden), w64(n)),
        ),
        "binned_gather": (
            lambda x: ops.binned_gather(x, indices, bins, capacity, top_k),
            (f64(tokens, hidden),),
        ),
        "binned_scatter": (
            lambda x, w: ops.binned_scatter(x, indices, w, bins, top_k),
            (f64(experts, capacity, hidden), w64(n)),
        ),
    }
    for name, (fn, inputs) in cases.items():
        assert torch.autograd.gradcheck(fn, inputs), name


def test_scatter_without_weights_and_weights_only():
    indices, bin_ids, bins, _, _ = routing(4, 2, 3)
    x = f64(8, 2)
    assert torch.autograd.gradcheck(lambda x: ops.scatter(x, indices, bin_ids, None, bins, 2), (x,))
    frozen = torch.randn(8, 2, dtype=torch.float64)
    assert torch.autograd.gradcheck(
        lambda w: ops.scatter(frozen, indices, bin_ids, w, bins, 2), (w64(8),)
    )


def test_replicate():
    bins = torch.tensor([2, 2, 5, 6], dtype=torch.int32)  # bin 1 is empty
    assert torch.autograd.gradcheck(lambda x: ops.replicate(x, bins, 6), (f64(3, 4),))


@pytest.mark.parametrize("trans_b", [False, True])
def test_gmm(trans_b):
    sizes = torch.tensor([3, 0, 4, 1])
    a = f64(8, 5)
    b = f64(4, 6, 5) if trans_b else f64(4, 5, 6)
    assert torch.autograd.gradcheck(lambda a, b: ops.gmm(a, b, sizes, trans_b), (a, b))


@pytest.mark.parametrize(("top_k", "trans_b"), [(1, False), (2, True), (3, False)])
def test_fused_gather_gmm_and_gmm_scatter(top_k, trans_b):
    tokens, experts, hidden, ffn = 5, 4, 3, 2
    indices, bin_ids, bins, _, _ = routing(tokens, top_k, experts, seed=10 + top_k)
    w1 = f64(experts, ffn, hidden) if trans_b else f64(experts, hidden, ffn)
    w2 = f64(experts, hidden, ffn) if trans_b else f64(experts, ffn, hidden)
    assert torch.autograd.gradcheck(
        lambda x, b: ops.gather_gmm(x, b, indices, bin_ids, bins, top_k, trans_b),
        (f64(tokens, hidden), w1),
    )
    assert torch.autograd.gradcheck(
        lambda x, b, w: ops.gmm_scatter(x, b, indices, bin_ids, w, bins, top_k, trans_b),
        (f64(tokens * top_k, ffn), w2, w64(tokens * top_k)),
    )


@pytest.mark.parametrize(
    "activation", [None, "gelu", "silu", "relu", "geglu", "swiglu", "reglu", "bilinear"]
)
def test_gmm_scatter_first_and_second_order(activation):
    """First and second order in x, b and the weights, through the activation gmm_scatter may
    apply to its rows (relu's kink is away from the random inputs). The backward's weighted
    gathers are recorded with the weights' own gradient (they once were not: the second order
    in b and the weights came out wrong)."""
    tokens, top_k, experts, hidden, ffn = 5, 2, 4, 3, 4
    indices, bin_ids, bins, _, _ = routing(tokens, top_k, experts, seed=20)
    w2 = f64(experts, ffn, hidden)

    def op(x, b, w):
        return ops.gmm_scatter(x, b, indices, bin_ids, w, bins, top_k, False, activation)

    width = 2 * ffn if activation in ("geglu", "swiglu", "reglu", "bilinear") else ffn
    inputs = (f64(tokens * top_k, width), w2, w64(tokens * top_k))
    assert torch.autograd.gradcheck(op, inputs)
    assert torch.autograd.gradgradcheck(op, inputs)


def test_gmm_empty_expert_gets_exactly_zero_weight_grad():
    sizes = torch.tensor([3, 0, 2])
    a, b = f64(5, 4), f64(3, 4, 2)
    ops.gmm(a, b, sizes).sum().backward()
    assert torch.equal(b.grad[1], torch.zeros_like(b.grad[1]))
    assert b.grad[0].abs().sum() > 0


def test_second_order_through_the_registry():
    indices, bin_ids, bins, _, _ = routing(3, 2, 2)
    x = f64(6, 2)
    assert torch.autograd.gradgradcheck(
        lambda x: ops.scatter(x, indices, bin_ids, None, bins, 2), (x,)
    )
    # Weighted: the first-order x gradient is a weighted gather, whose own gradient in the
    # output gradient and in the weights must both be recorded.
    w = w64(6)
    assert torch.autograd.gradgradcheck(
        lambda x, w: ops.scatter(x, indices, bin_ids, w, bins, 2), (x, w)
    )


def test_every_differentiable_op_has_a_backward_rule():
    differentiable = {c.name for c in contracts.ALL if c.differentiable}
    assert differentiable == set(RULES)
    for name, rule in RULES.items():
        names = set(contracts.BY_NAME[name].arg_names)
        assert set(rule.saves) <= names and set(rule.saves_if) <= names, name


def test_no_autograd_node_without_requires_grad():
    indices, bin_ids, bins, _, _ = routing(3, 2, 2)
    out = ops.gather(torch.randn(3, 2), indices, bin_ids, bins, 2)
    assert out.grad_fn is None
    with torch.no_grad():
        out = ops.gather(torch.randn(3, 2, requires_grad=True), indices, bin_ids, bins, 2)
    assert out.grad_fn is None
