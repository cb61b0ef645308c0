"""torch.compile(fullgraph=True) over routing → gather → gmm → scatter, forward and backward."""

from __future__ import annotations

import pytest
import torch

from megablocks_core import ops
from megablocks_core.contracts import ALL

pytestmark = pytest.mark.usefixtures("reference_backend")


def moe(x, w1, top_experts, weights, padded: bool):
    experts, top_k = w1.shape[0], top_experts.shape[0] // x.shape[0]
    bin_ids, indices = ops.sort(top_experts, max((experts - 1).bit_length(), 1))
    counts = ops.histogram(top_experts, experts)
    bins = ops.inclusive_cumsum(counts, 0)
    if padded:
        padded_bins = ops.inclusive_cumsum(ops.round_up(counts, 4), 0)
        rows = ops.padded_gather(x, indices, bin_ids, bins, padded_bins, top_k)
        rows = ops.gmm(rows, w1, ops.round_up(counts, 4))
        return ops.padded_scatter(rows, indices, bin_ids, weights, bins, padded_bins, top_k)
    rows = ops.gmm(ops.gather(x, indices, bin_ids, bins, top_k), w1, counts)
    return ops.scatter(rows, indices, bin_ids, weights, bins, top_k)


def inputs(tokens=12, hidden=8, experts=4, top_k=2):
    torch.manual_seed(0)
    x = torch.randn(tokens, hidden, requires_grad=True)
    w1 = torch.randn(experts, hidden, hidden, requires_grad=True)
    top = torch.randint(0, experts, (tokens * top_k,), dtype=torch.int32)
    weights = torch.rand(tokens * top_k, requires_grad=True)
    return x, w1, top, weights


def run(fn, x, w1, top, weights, padded):
    for t in (x, w1, weights):
        t.grad = None
    out = fn(x, w1, top, weights, padded)
    out.square().sum().backward()
    return out.detach(), x.grad.clone(), w1.grad.clone(), weights.grad.clone()


@pytest.mark.parametrize("padded", [False, True])
def test_fullgraph_aot_eager_matches_eager(padded):
    torch._dynamo.reset()
    args = inputs()
    want = run(moe, *args, padded)
    got = run(torch.compile(moe, fullgraph=True, backend="aot_eager"), *args, padded)
    for w, g in zip(want, got, strict=True):
        torch.testing.assert_close(g, w)


def test_fullgraph_inductor_matches_eager():
    torch._dynamo.reset()
    args = inputs()
    want = run(moe, *args, False)
    got = run(torch.compile(moe, fullgraph=True), *args, False)
    for w, g in zip(want, got, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def _scaled_samples(a, b, x, indices, bin_ids, w, bins, counts):
    """The low-precision ops' samples: the operands quantized (no gradients: 8-bit data)."""
    fmt = "fp8_blockwise"
    qa, sa = ops.quantize(a, 1, fmt)
    qx, sx = ops.quantize(x, 1, fmt)
    qb, sb = ops.quantize(b, 1, fmt)
    qbt, sbt = ops.quantize(b.transpose(1, 2), 2, fmt)  # (experts, n, k)
    return {
        "quantize": (b.transpose(1, 2), 2, fmt, None),
        "quantize_both_ways": (b, "fp8_rowwise", None),
        "quantize_transposed": (a, counts.long(), "fp8_rowwise", None),
        "gather_quantize_transposed": (
            x.detach(),
            indices,
            w.detach(),
            2,
            counts.long(),
            None,
            "fp8_rowwise",
            None,
        ),
        "scaled_gmm_weight_grad": (
            *ops.quantize_transposed(a, counts.long(), "fp8_rowwise"),
            *ops.quantize_transposed(torch.randn(a.shape[0], 5), counts.long(), "fp8_rowwise"),
            counts.long(),
            "fp8_rowwise",
            "float32",
        ),
        "scaled_gmm": (qa, sa, qb, sb, counts.long(), False, fmt, None),
        "scaled_gather_gmm": (qx, sx, qbt, sbt, indices, bin_ids, bins, 2, True, None, fmt, None),
        "scaled_gmm_scatter": (
            *ops.quantize(torch.randn(8, 5), 1, fmt),
            *ops.quantize(b.transpose(1, 2).contiguous(), 1, fmt),
            indices,
            bin_ids,
            w,
            bins,
            2,
            False,
            None,
            fmt,
            "float32",
        ),
    }


def _opcheck_samples():
    torch.manual_seed(1)
    top = torch.randint(0, 4, (8,), dtype=torch.int32)
    bin_ids, indices = ops.sort(top, 2)
    counts = ops.histogram(top, 4)
    bins = ops.inclusive_cumsum(counts, 0)
    padded = ops.inclusive_cumsum(ops.round_up(counts, 4), 0)
    x = torch.randn(4, 3, requires_grad=True)
    rows = torch.randn(8, 3, requires_grad=True)
    w = torch.rand(8, requires_grad=True)
    grad = torch.randn(4, 3)
    prows = torch.randn(int(padded[-1]), 3, requires_grad=True)
    binned = torch.randn(4, 2, 3, requires_grad=True)
    a, b = torch.randn(8, 3, requires_grad=True), torch.randn(4, 3, 5, requires_grad=True)
    return {
        "sort": (top, 2),
        "histogram": (top, 4),
        "inclusive_cumsum": (counts, 0),
        "exclusive_cumsum": (counts, 0),
        "topology": (padded, 4, int(padded[-1]) // 4, 2),
        "replicate": (torch.randn(2, 4, requires_grad=True), bins, 8),
        "replicate_backward": (torch.randn(2, 8), bins),
        "route": (top, 4, 4),
        "router_topk": (torch.randn(4, 6), 2, True),
        "gather": (x, indices, bin_ids, None, bins, 2),
        "scatter": (rows, indices, bin_ids, w, bins, 2),
        "scatter_wgrad": (rows.detach(), grad, indices, bin_ids, bins, 2),
        "padded_gather": (x, indices, bin_ids, None, bins, padded, 2),
        "padded_scatter": (prows, indices, bin_ids, w, bins, padded, 2),
        "padded_scatter_wgrad": (prows.detach(), grad, indices, bin_ids, bins, padded, 2),
        "binned_gather": (x, indices, None, bins, 2, 2),
        "binned_scatter": (binned, indices, w, bins, 2),
        "binned_scatter_wgrad": (binned.detach(), grad, indices, bins, 2),
        **_scaled_samples(
            a.detach(), b.detach(), x.detach(), indices, bin_ids, w.detach(), bins, counts
        ),
        "gmm": (a, b, counts.long(), False),
        "gmm_weight_grad": (a.detach(), torch.randn(8, 5), counts),
        # Writes out in place: the schema declares it (Tensor(a!) out -> ()), opcheck checks that
        # the real and fake implementations mutate exactly that.
        "gmm_weight_grad_accumulate": (a.detach(), torch.randn(8, 5), counts, torch.randn(4, 3, 5)),
        "gather_gmm": (x, b, indices, bin_ids, bins, 2, False),
        "gmm_scatter": (
            torch.randn(8, 5, requires_grad=True),
            b,
            indices,
            bin_ids,
            w,
            bins,
            2,
            True,
        ),
        "glu": (torch.randn(8, 6, requires_grad=True), "silu"),
        "glu_backward": (torch.randn(8, 3), torch.randn(8, 6), "gelu"),
        "activation_backward": (torch.randn(8, 3), torch.randn(8, 3), torch.rand(8), "silu"),
        **_moe_permute_samples(),
    }


def _moe_permute_samples():
    mask = torch.zeros(4, 3, dtype=torch.bool)
    mask[[0, 0, 1, 2, 3], [0, 2, 1, 1, 2]] = True
    row_map, _ = ops.moe_permute_map(mask, 3, 9, 2)
    probs = torch.rand(4, 3, requires_grad=True)
    permuted = torch.randn(9, 3, requires_grad=True)
    return {
        "moe_permute_map": (mask, 3, 9, 2),
        "moe_permute": (torch.randn(4, 3, requires_grad=True), row_map, probs, 9),
        "moe_permute_probs": (probs, row_map, 9),
        "moe_unpermute": (permuted, row_map, probs),
        "moe_unpermute_wgrad": (permuted, torch.randn(4, 3, requires_grad=True), row_map),
        "moe_sort_chunks": (
            torch.randn(6, 3, requires_grad=True),
            torch.tensor([2, 0, 4]),
            torch.tensor([2, 0, 1]),
        ),
    }


#: The clamped SwiGLU's constants (alpha, limit) of the samples that take them: float options.
CLAMP = (1.25, 1.5)


def _with_activation(name: str) -> tuple:
    """gmm_scatter and activation_backward with the named activation (the samples above leave
    gmm_scatter's out), a gated one on rows twice as wide; glu with GPT-OSS's unit at constants
    of its own."""
    if name == "glu+silu_oai":
        return (torch.randn(8, 6, requires_grad=True) * 3, "silu_oai", *CLAMP)
    if name.startswith("activation_backward+"):
        activation = name.split("+")[1]
        constants = CLAMP if activation == "swiglu_oai" else ()
        return (torch.randn(8, 3), torch.randn(8, 6), torch.rand(8), activation, *constants)
    x, b, *rest = _opcheck_samples()["gmm_scatter"]
    if name in ("gmm_scatter+swiglu", "gmm_scatter+swiglu_oai"):
        x = torch.randn(8, 2 * x.shape[1], requires_grad=True)
    if name == "gmm_scatter+swiglu_oai":
        return (x, b, *rest, "swiglu_oai", None, None, *CLAMP)
    return (x, b, *rest, name.split("+")[1])


WITH_ACTIVATION = (
    "gmm_scatter+gelu",
    "gmm_scatter+swiglu",
    "gmm_scatter+swiglu_oai",
    "activation_backward+swiglu",
    "activation_backward+swiglu_oai",
    "glu+silu_oai",
)


@pytest.mark.parametrize("name", [*(c.name for c in ALL if c.dispatched), *WITH_ACTIVATION])
def test_opcheck(name):
    args = _with_activation(name) if name in WITH_ACTIVATION else _opcheck_samples()[name]
    name = name.split("+")[0]
    # The data-dependent padded_gather output needs dynamic sizes, which aot_dispatch tests
    # cannot fabricate; everything else runs the full opcheck suite.
    skip = (
        ("test_aot_dispatch_dynamic", "test_aot_dispatch_static")
        if name in ("padded_gather", "padded_scatter")
        else ()
    )
    if name in ("scaled_gmm", "scaled_gather_gmm", "scaled_gmm_scatter", "scaled_gmm_weight_grad"):
        # test_schema compares the inputs with arithmetic torch lacks for 8-bit floats on the CPU
        # (the conformance kit checks every sample's inputs are unmodified instead).
        skip = (*skip, "test_schema")
    tests = [
        t
        for t in (
            "test_schema",
            "test_autograd_registration",
            "test_faketensor",
            "test_aot_dispatch_static",
            "test_aot_dispatch_dynamic",
        )
        if t not in skip
    ]
    torch.library.opcheck(getattr(torch.ops.megablocks, name), args, test_utils=tests)
