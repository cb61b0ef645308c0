"""bfloat16 subnormal inputs through the compiled Triton kernels (GPU only).

Triton 3.6's interpreter converts bfloat16 subnormals to float32 wrongly, so on the CPU these
ops' bfloat16 calls go to the reference backend and the interpreter cannot prove the compiled
kernels right for such inputs. This module does, on a GPU: every input is a bfloat16
subnormal (or a mix of subnormals and normal numbers), and each kernel's output must equal the
reference backend's on the same tensors (computed in float32 and rounded once, as the contracts
say).
"""

from __future__ import annotations

import os

import pytest
import torch

import megablocks_core
from megablocks_core import ops

DEVICE = torch.device(os.environ.get("MEGABLOCKS_TRITON_TEST_DEVICE", "cuda"))
pytestmark = pytest.mark.skipif(
    DEVICE.type == "cpu" or not torch.cuda.is_available(),
    reason="the compiled Triton kernels need a GPU (the interpreter mis-converts bf16 subnormals)",
)

#: The smallest positive bfloat16 subnormal, and the largest.
TINY = 2.0**-133
LARGEST_SUBNORMAL = 2.0**-126 - 2.0**-133


def _subnormals(*shape: int, seed: int, mixed: bool = False) -> torch.Tensor:
    """bf16 values drawn from the subnormal range, both signs (with ``mixed``, every other value
    normal-sized instead), on DEVICE."""
    gen = torch.Generator().manual_seed(seed)
    mantissa = torch.randint(1, 128, shape, generator=gen).double()
    sign = torch.randint(0, 2, shape, generator=gen).double() * 2 - 1
    values = sign * mantissa * TINY
    if mixed:
        normal = torch.randn(shape, generator=gen, dtype=torch.float64)
        values = torch.where(torch.arange(values.numel()).reshape(shape) % 2 == 0, values, normal)
    out = values.to(torch.bfloat16)
    subnormal = values.abs() < 2.0**-126
    assert bool((out.double()[subnormal] == values[subnormal]).all()), "bf16 holds them exactly"
    return out.to(DEVICE)


def _on_both(fn):
    with megablocks_core.use_backend("triton"):
        got = fn()
    with megablocks_core.use_backend("reference"):
        want = fn()
    return got, want


def _assert_equal(got, want, what: str, rtol: float = 2**-7) -> None:
    """Equal up to ``rtol`` (default one bf16 unit: a kernel may round its float32 result in
    another order) and one bf16 subnormal step."""
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.dtype == w.dtype, f"{what} output {i}"
        if g.is_floating_point():
            torch.testing.assert_close(g.float(), w.float(), rtol=rtol, atol=TINY)
        else:
            assert torch.equal(g, w), f"{what} output {i}"


#: Mixed with normal numbers, glu's tanh GELU differs from the reference by up to ~2 % in its far
#: negative tail, where the reference's 0.5 g (1 + tanh z) cancels and the kernel's
#: g sigmoid(2z) does not (seen on the H200: gate -4.5625, up -0.365: 1.311e-6 vs 1.289e-6).
GELU_TAIL_RTOL = 2e-2


@pytest.mark.parametrize("activation", [None, "silu", "gelu", "relu"])
@pytest.mark.parametrize("mixed", [False, True])
def test_glu_on_subnormals(activation, mixed):
    x = _subnormals(64, 96, seed=1, mixed=mixed)
    got, want = _on_both(lambda: ops.glu(x, activation))
    rtol = GELU_TAIL_RTOL if mixed and activation == "gelu" else 2**-7
    _assert_equal(got, want, f"glu({activation})", rtol)


@pytest.mark.parametrize("mixed", [False, True])
def test_weighted_scatter_on_subnormals(mixed):
    tokens, top_k, experts, hidden = 32, 2, 4, 64
    top = torch.randint(0, experts, (tokens * top_k,), dtype=torch.int32, device=DEVICE)
    with megablocks_core.use_backend("reference"):
        bin_ids, indices = ops.sort(top, 2)
        bins = ops.inclusive_cumsum(ops.histogram(top, experts), 0)
    x = _subnormals(tokens * top_k, hidden, seed=2, mixed=mixed)
    weights = _subnormals(tokens * top_k, seed=3, mixed=True).abs()
    got, want = _on_both(lambda: ops.scatter(x, indices, bin_ids, weights, bins, top_k))
    _assert_equal(got, want, "weighted scatter")


@pytest.mark.parametrize("softmax", [False, True])
def test_router_topk_ranks_subnormal_scores(softmax):
    scores = _subnormals(128, 16, seed=4)
    got, want = _on_both(lambda: ops.router_topk(scores, 4, softmax))
    assert torch.equal(got[1], want[1]), "the chosen experts"
    _assert_equal(got[0], want[0], "router weights")
    # Independent of either backend: the ranking of the exact values, ties to the lower id.
    exact = scores.double().cpu()
    order = sorted(range(16), key=lambda e: (-float(exact[0, e]), e))[:4]
    assert got[1][0].tolist() == order


def test_the_values_are_subnormal():
    x = _subnormals(8, 8, seed=5).float().abs()
    assert bool((x > 0).all()) and bool((x <= LARGEST_SUBNORMAL).all())
