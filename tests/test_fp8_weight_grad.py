"""FP8 weight gradients: ``quantize_transposed``, ``scaled_gmm_weight_grad`` and
``Recipe(weight_grad="fp8")``.

Independent references (test_fp8.py's): quantization as a nearest-value search over the
encoding's decoded table, per column of each expert's rows, in numpy; the weight gradient as a
float64 loop over experts of the operands decoded that way. The Triton kernels run under the CPU
interpreter here and on the GPU test device when it is set."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_fp8 import (
    _TRITON_RUNNABLE,
    BACKENDS,
    _decode_table,
    _device,
    _encodings,
    _gaussian_with_non_finite,
    _layer_case,
    _mlp,
    _reference_quantize,
)

import megablocks_core.ops as ops
from megablocks_core import formats, fp8, fuse_grad_accumulation, use_backend
from megablocks_core.calls import call
from megablocks_core.validation import ContractError

ROWWISE = "fp8_rowwise"


def _starts(sizes: list[int]) -> list[int]:
    return [sum(sizes[:e]) for e in range(len(sizes))]


@pytest.mark.parametrize("backend", BACKENDS)
def test_quantize_transposed_rounds_each_expert_column_to_the_nearest_code(backend):
    gen = torch.Generator().manual_seed(0)
    sizes = [70, 0, 1, 1100]
    rows = sum(sizes) + 5  # 5 rows past every group
    x = torch.randn(rows, 33, generator=gen) * torch.logspace(-3, 3, 33)
    for enc in _encodings(backend):
        with use_backend(backend):
            data, scale = ops.quantize_transposed(
                x.to(_device(backend)), torch.tensor(sizes), ROWWISE, enc.name
            )
        assert data.shape == (33, rows) and data.dtype == enc.dtype and data.is_contiguous()
        assert scale.shape == (4, 33) and scale.dtype == torch.float32
        codes = data.cpu().view(torch.uint8).numpy()
        for e, (start, size) in enumerate(zip(_starts(sizes), sizes, strict=True)):
            if not size:  # an empty block: amax 0, the smallest scale
                assert (scale[e] == 2.0**-126).all()
                continue
            # One block per column of the expert's rows: the transposed group, one per row.
            want_codes, want_scale = _reference_quantize(
                x[start : start + size].t().numpy(), enc, False, 1
            )
            np.testing.assert_array_equal(scale[e].cpu().numpy(), want_scale.reshape(-1))
            np.testing.assert_array_equal(codes[:, start : start + size], want_codes)
        assert not codes[:, sum(sizes) :].any()  # the rows past the groups are 0


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    backend=st.sampled_from(["reference", "triton"] if _TRITON_RUNNABLE else ["reference"]),
    sizes=st.lists(st.integers(0, 150), min_size=0, max_size=5),
    past=st.integers(0, 70),
    cols=st.integers(0, 200),
    stored_transposed=st.booleans(),
    non_finite=st.integers(0, 3),
    seed=st.integers(0, 2**16),
)
def test_quantize_transposed_is_the_definition(
    backend, sizes, past, cols, stored_transposed, non_finite, seed
):
    """Bit for bit the core's definition over random groups (empty ones too), rows past the
    groups, both storage orders, and NaN or infinities anywhere."""
    x = _gaussian_with_non_finite((sum(sizes) + past, cols), non_finite, seed)
    stored = x.t().contiguous().t() if stored_transposed else x
    for enc in _encodings(backend):
        with use_backend(backend):
            data, scale = ops.quantize_transposed(
                stored.to(_device(backend)),
                torch.tensor(sizes, dtype=torch.int64),
                ROWWISE,
                enc.name,
            )
        want_data, want_scale = formats.quantize_transposed(x, sizes, enc, False)
        assert data.is_contiguous()
        assert torch.equal(data.cpu().view(torch.uint8), want_data.view(torch.uint8))
        torch.testing.assert_close(scale.cpu(), want_scale, rtol=0, atol=0, equal_nan=True)


def _gathered_rows_loop(x, indices, weights, top_k, rows):
    """gather's sorted rows by a loop: x[id // top_k] (weighted in float32, rounded to x's
    dtype) for ids in [0, len(indices)), a zero row for any other id."""
    n = indices.shape[0] if rows is None else rows
    out = torch.zeros(n, x.shape[1], dtype=x.dtype)
    for i in range(n):
        flat = int(indices[i])
        if 0 <= flat < indices.shape[0]:
            row = x[flat // top_k]
            if weights is not None:
                row = (row.float() * weights[flat].float()).to(x.dtype)
            out[i] = row
    return out


@settings(max_examples=30, deadline=None, derandomize=True)
@given(
    backend=st.sampled_from(["reference", "triton"] if _TRITON_RUNNABLE else ["reference"]),
    tokens=st.integers(0, 40),
    top_k=st.integers(1, 4),
    experts=st.integers(1, 5),
    cols=st.integers(1, 70),
    weighted=st.booleans(),
    first_rows=st.booleans(),
    bad_ids=st.integers(0, 3),
    index_dtype=st.sampled_from([torch.int16, torch.int32, torch.int64]),
    dtype=st.sampled_from([torch.float32, torch.float16]),
    stored_transposed=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_gather_quantize_transposed_is_quantize_transposed_of_the_gathered_rows(
    backend, tokens, top_k, experts, cols, weighted, first_rows, bad_ids, index_dtype, dtype,
    stored_transposed, seed,
):  # fmt: skip
    """Bit for bit the definition of the rows a loop gathers: weighted or not, the first rows
    only, ids out of range or repeated (unchecked bad data: zero rows), empty experts, groups
    that end before the last row, any index dtype and either storage order of x."""
    gen = torch.Generator().manual_seed(seed)
    n = tokens * top_k
    x = _gaussian_with_non_finite((tokens, cols), 0, seed).to(dtype)
    indices = torch.randperm(n, generator=gen)
    for _ in range(bad_ids if n else 0):  # out of range either way, or a duplicate id
        slot = int(torch.randint(n, (1,), generator=gen))
        indices[slot] = (-3, n, int(indices[0]))[slot % 3]
    indices = indices.to(index_dtype)
    weights = torch.rand(n, generator=gen) if weighted else None
    rows = int(torch.randint(n + 1, (1,), generator=gen)) if first_rows else None
    count = n if rows is None else rows
    cuts = torch.randint(count + 1, (experts - 1,), generator=gen).sort().values.tolist()
    ends = [*cuts, int(torch.randint(max(cuts, default=0), count + 1, (1,), generator=gen))]
    sizes = [end - start for start, end in zip([0, *ends[:-1]], ends, strict=True)]
    gathered = _gathered_rows_loop(x, indices, weights, top_k, rows)
    stored = x.t().contiguous().t() if stored_transposed else x
    device = _device(backend)

    def on(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device)

    for enc in _encodings(backend):
        want_data, want_scale = formats.quantize_transposed(gathered, sizes, enc, False)
        with use_backend(backend):
            data, scale = call(
                "gather_quantize_transposed", on(stored), on(indices), on(weights), top_k,
                torch.tensor(sizes), rows, ROWWISE, enc.name,
            )  # fmt: skip
        assert data.shape == (cols, count) and data.is_contiguous()
        assert torch.equal(data.cpu().view(torch.uint8), want_data.view(torch.uint8))
        torch.testing.assert_close(scale.cpu(), want_scale, rtol=0, atol=0, equal_nan=True)


def test_a_non_finite_value_spoils_only_its_expert_column():
    x = torch.ones(6, 3)
    x[1, 2] = math.inf
    data, scale = ops.quantize_transposed(x, torch.tensor([2, 4]), ROWWISE)
    assert scale[0, 2].isnan() and not scale[1].isnan().any() and not scale[0, :2].isnan().any()
    assert data[2, :2].float().isnan().all() and not data[2, 2:].float().isnan().any()


@pytest.mark.skipif(not _TRITON_RUNNABLE, reason="the triton kernels cannot run here")
def test_device_side_bad_sizes_are_cut_as_the_reference_cuts_them():
    """Sizes the contract checks only in checked mode (device-side): a negative one counts as
    0, the groups are cut at the last row; both backends' functions alike (called directly: the
    entry would refuse these sizes on the CPU)."""
    from megablocks_reference import scaled as reference
    from megablocks_triton import scaled as triton_scaled

    x = torch.randn(50, 20, generator=torch.Generator().manual_seed(3))
    device = _device("triton")
    for sizes in ([-4, 30, 40], [10, -1, 60, 5]):
        want = reference.quantize_transposed(x, torch.tensor(sizes), ROWWISE, None)
        got = triton_scaled.quantize_transposed(
            x.to(device), torch.tensor(sizes, device=device), ROWWISE, None
        )
        assert torch.equal(got[0].cpu().view(torch.uint8), want[0].view(torch.uint8))
        torch.testing.assert_close(got[1].cpu(), want[1], rtol=0, atol=0)
        a, sa = want
        grad = reference.scaled_gmm_weight_grad(a, sa, a, sa, torch.tensor(sizes), ROWWISE, None)
        got_grad = triton_scaled.scaled_gmm_weight_grad(
            a.to(device), sa.to(device), a.to(device), sa.to(device),
            torch.tensor(sizes, device=device), ROWWISE, None,
        )  # fmt: skip
        torch.testing.assert_close(got_grad.cpu().float(), grad.float(), rtol=2e-2, atol=1e-2)


def _decoded_columns(data: torch.Tensor, scale: torch.Tensor, sizes: list[int]) -> np.ndarray:
    """Each expert's rows of (c, rows) data times its column scales, float64 from the decode
    table."""
    values = _decode_table(formats.BY_DTYPE[data.dtype])[
        data.cpu().view(torch.uint8).numpy().astype(np.int64)
    ]
    out = np.zeros_like(values)
    for e, (start, size) in enumerate(zip(_starts(sizes), sizes, strict=True)):
        columns = scale[e].cpu().double().numpy()[:, None]
        out[:, start : start + size] = values[:, start : start + size] * columns
    return out


CASES = [  # (group sizes, rows past them, k, n)
    ([40, 0, 130, 3], 7, 48, 160),
    ([9], 0, 32, 16),
    ([0, 0, 0], 4, 24, 8),
    ([300, 1, 257], 0, 136, 40),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{len(c[0])}e{c[2]}k{c[3]}n")
@pytest.mark.parametrize("out_dtype", [None, "float32"])
def test_scaled_gmm_weight_grad_against_a_float64_loop(backend, case, out_dtype):
    sizes, past, k, n = case
    rows = sum(sizes) + past
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=gen)
    dy = torch.randn(rows, n, generator=gen) * 1e-3  # gradients are small
    enc = _encodings(backend)[0]
    a, sa = formats.quantize_transposed(x, sizes, enc, False)
    g, sg = formats.quantize_transposed(dy, sizes, enc, False)
    a_values, g_values = _decoded_columns(a, sa, sizes), _decoded_columns(g, sg, sizes)
    want = np.zeros((len(sizes), k, n))
    for e, (start, size) in enumerate(zip(_starts(sizes), sizes, strict=True)):
        want[e] = a_values[:, start : start + size] @ g_values[:, start : start + size].T
    device = _device(backend)
    with use_backend(backend):
        got = ops.scaled_gmm_weight_grad(
            a.to(device), sa.to(device), g.to(device), sg.to(device), torch.tensor(sizes),
            ROWWISE, out_dtype,
        )  # fmt: skip
    # The contract's tolerance (2**-10 of the largest element: FP8 matrix units keep a narrower
    # sum between promotions) beside the output's own rounding.
    rounding = {None: 2.0**-8, "float32": 0.0}[out_dtype]
    assert got.dtype == (torch.float32 if out_dtype else torch.bfloat16)
    scale = np.abs(want).max() if want.size else 0.0
    np.testing.assert_allclose(
        got.cpu().double().numpy(), want, rtol=rounding, atol=2.0**-10 * scale + 1e-30
    )
    for e, size in enumerate(sizes):
        if not size:
            assert not got[e].any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_experts_and_rows_past_the_groups_add_nothing(backend):
    """An empty expert's gradient is exactly 0 even with NaN scales, and NaN codes in the rows
    past every group never reach the output."""
    sizes, k, n = [5, 0, 7], 16, 24
    gen = torch.Generator().manual_seed(1)
    enc = _encodings(backend)[0]
    a, sa = formats.quantize_transposed(torch.randn(15, k, generator=gen), sizes, enc, False)
    g, sg = formats.quantize_transposed(torch.randn(15, n, generator=gen), sizes, enc, False)
    nan = 0x7F if enc.negative_zero else 0x80
    a.view(torch.uint8)[:, 12:] = nan
    g.view(torch.uint8)[:, 12:] = nan
    sa[1], sg[1] = math.nan, math.nan
    device = _device(backend)
    with use_backend(backend):
        got = ops.scaled_gmm_weight_grad(
            a.to(device), sa.to(device), g.to(device), sg.to(device), torch.tensor(sizes),
            ROWWISE, "float32",
        )  # fmt: skip
    assert got.isfinite().all()
    assert not got[1].any()


def test_the_weight_gradient_ops_refuse_formats_without_those_operands():
    x = torch.randn(8, 4)
    with pytest.raises(ContractError, match="weight-gradient operands"):
        ops.quantize_transposed(x, torch.tensor([8]), "fp8_blockwise")
    a, sa = ops.quantize_transposed(x, torch.tensor([8]), ROWWISE)
    with pytest.raises(ContractError, match="weight-gradient operands"):
        ops.scaled_gmm_weight_grad(a, sa, a, sa, torch.tensor([8]), "fp8_blockwise")
    with pytest.raises(ContractError, match="one scale per expert"):
        ops.scaled_gmm_weight_grad(a, sa[:, :3], a, sa, torch.tensor([8]), ROWWISE)
    with pytest.raises(ContractError, match="the groups fit"):
        ops.quantize_transposed(x, torch.tensor([5, 4]), ROWWISE)
    with pytest.raises(ValueError, match="fp8_rowwise"):
        fp8.Recipe("fp8_blockwise", weight_grad="fp8")
    with pytest.raises(ValueError, match="weight_grad"):
        fp8.Recipe(weight_grad="bf16")  # type: ignore[arg-type]


def _grads(recipe, fuse: bool = False, bias: bool = False):
    x, w1, w2, weights, *routing = _layer_case()
    leaves: tuple[torch.Tensor, ...] = (x, w1, w2, weights)
    if fuse:  # a micro-batch after the first: the gradients exist and are added into
        fuse_grad_accumulation(w1, w2)
        for w in (w1, w2):
            w.grad = torch.ones_like(w)
    module = fp8 if recipe else ops
    kw = {"recipe": recipe} if recipe else {}
    if bias:  # each GEMM's per-expert bias, the last two leaves
        gen = torch.Generator().manual_seed(5)
        b1, b2 = (torch.randn(w.shape[0], w.shape[2], generator=gen) for w in (w1, w2))
        leaves += (b1.requires_grad_(), b2.requires_grad_())
        indices, bin_ids, bins, top_k = routing
        h = module.gather_gmm(x, w1, indices, bin_ids, bins, top_k, bias=b1, **kw)
        out = module.gmm_scatter(
            h, w2, indices, bin_ids, weights, bins, top_k, False, "swiglu", bias=b2, **kw
        )
    else:
        out = _mlp(module, *leaves, *routing, **kw)
    grad = torch.linspace(-1, 1, out.numel()).reshape(out.shape)
    out.backward(grad)
    return [t.grad for t in leaves]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp8_weight_gradients_track_the_full_precision_ones(backend):
    """Recipe(weight_grad="fp8"): the weights' gradients come through the scaled weight
    gradient (both backends on the CPU), within FP8's error of the full-precision ones, and
    differ from the recipe's gradients in the inputs' dtype (quantized indeed)."""
    if backend == "triton" and _device(backend).type != "cpu":
        pytest.skip("the layer case runs on the CPU")
    with use_backend(backend):
        exact = _grads(None)
        bf16_wgrad = _grads(fp8.Recipe(ROWWISE))
        fp8_wgrad = _grads(fp8.Recipe(ROWWISE, weight_grad="fp8"))
    for got, want in zip(fp8_wgrad, exact, strict=True):
        assert _rel(got, want) < 0.12
    # The rows' and routing weights' gradients do not read the weight gradients: unchanged.
    assert torch.equal(fp8_wgrad[0], bf16_wgrad[0]) and torch.equal(fp8_wgrad[3], bf16_wgrad[3])
    for got, ref in zip(fp8_wgrad[1:3], bf16_wgrad[1:3], strict=True):
        assert 1e-3 < _rel(got, ref) < 0.1


def test_fp8_weight_gradients_add_into_a_fused_accumulation(reference_backend):
    recipe = fp8.Recipe(ROWWISE, weight_grad="fp8")
    fresh = _grads(recipe)
    fused = _grads(recipe, fuse=True)
    for got, want in zip(fused[1:3], fresh[1:3], strict=True):
        torch.testing.assert_close(got, want + 1, rtol=1e-6, atol=1e-6)


def test_fp8_weight_gradients_run_the_scaled_ops(fp8_calls, reference_backend):
    _grads(fp8.Recipe(ROWWISE, weight_grad="fp8"))
    assert fp8_calls.count("scaled_gmm_weight_grad") == 2  # w1's and w2's
    # Each GEMM's gathered operand (x's rows for w1, the output gradient's weighted rows for
    # w2) is quantized as it is read through the indices: no 16-bit copy is gathered.
    assert fp8_calls.count("gather_quantize_transposed") == 2
    assert fp8_calls.count("quantize_transposed") == 2
    assert "gmm_weight_grad" not in fp8_calls and "gather" not in fp8_calls
    fp8_calls.clear()
    _grads(fp8.Recipe(ROWWISE))
    assert "scaled_gmm_weight_grad" not in fp8_calls and fp8_calls.count("gmm_weight_grad") == 2
    assert fp8_calls.count("gather") == 2 and "gather_quantize_transposed" not in fp8_calls


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp8_weight_gradients_read_through_the_indices_are_the_bits_of_a_gathered_copy(
    backend, monkeypatch
):
    """The weight gradients' gathered operands quantized as they are read: every gradient the
    same bits as when the backward gathers the rows into a copy first (the path before)."""
    if backend == "triton" and _device(backend).type != "cpu":
        pytest.skip("the layer case runs on the CPU")
    from megablocks_core.autograd import gmm as rules

    recipe = fp8.Recipe(ROWWISE, weight_grad="fp8")
    with use_backend(backend):
        read_through = _grads(recipe)
        monkeypatch.setattr(rules, "reads_gathered_rows", lambda call: False)
        gathered_first = _grads(recipe)
    for got, want in zip(read_through, gathered_first, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp8_weight_gradients_of_the_first_rows_only_read_through_the_indices(backend, monkeypatch):
    """With ``rows`` (the sorted rows past the last expert's belong to no expert, as expert
    parallelism leaves them): the gathered operands hold the first rows only, and every
    gradient is the same bits as when the backward gathers them into a copy first."""
    if backend == "triton" and _device(backend).type != "cpu":
        pytest.skip("the layer case runs on the CPU")
    from megablocks_core.autograd import gmm as rules

    x, w1, w2, weights, indices, bin_ids, bins, top_k = _layer_case(2)
    # The last expert lives elsewhere: its rows (sorted last, bin id 3) are past the bins.
    w1, w2 = w1[:-1].detach().requires_grad_(), w2[:-1].detach().requires_grad_()
    bins, rows = bins[:-1], int(bins[-2])
    assert 0 < rows < indices.shape[0]
    recipe = fp8.Recipe(ROWWISE, weight_grad="fp8")

    def grads() -> list[torch.Tensor]:
        leaves = (x, w1, w2, weights)
        h = fp8.gather_gmm(x, w1, indices, bin_ids, bins, top_k, False, rows, recipe=recipe)
        out = fp8.gmm_scatter(
            h, w2, indices, bin_ids, weights, bins, top_k, False, "swiglu", rows, recipe=recipe
        )
        return list(
            torch.autograd.grad(out, leaves, torch.linspace(-1, 1, out.numel()).view_as(out))
        )

    with use_backend(backend):
        read_through = grads()
        monkeypatch.setattr(rules, "reads_gathered_rows", lambda call: False)
        gathered_first = grads()
    for got, want in zip(read_through, gathered_first, strict=True):
        assert torch.equal(got, want)


def test_fp8_weight_gradients_leave_the_bias_gradients_unquantized(fp8_calls, reference_backend):
    """A bias's gradient is each expert's column sums of the output's gradient: the same bits
    with weight_grad="fp8" as without, not a sum over quantized rows."""
    fp8_wgrad = _grads(fp8.Recipe(ROWWISE, weight_grad="fp8"), bias=True)
    # w2's operand, the output gradient's weighted rows, is gathered for its bias's sums too.
    assert (
        fp8_calls.count("scaled_gmm_weight_grad") == 2
        and fp8_calls.count("quantize_transposed") == 3
        and fp8_calls.count("gather_quantize_transposed") == 1
    )
    assert fp8_calls.count("gmm_weight_grad") == 2  # the two biases' sums
    bf16_wgrad = _grads(fp8.Recipe(ROWWISE), bias=True)
    for got, want in zip(fp8_wgrad[4:], bf16_wgrad[4:], strict=True):
        assert torch.equal(got, want)
    assert 1e-3 < _rel(fp8_wgrad[1], bf16_wgrad[1]) < 0.1  # the weights' own are quantized
