"""Gradient-accumulation fusion: the op ``gmm_weight_grad_accumulate`` against a numpy loop on
every backend serving the CPU (triton under TRITON_INTERPRET=1)."""

from __future__ import annotations

import functools

import numpy as np
import oracle
import pytest
import torch
import triton_interpreter

import megablocks_core
from megablocks_core.entries import call

F32, F16, BF16, F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64

#: Relative tolerance per dtype of out, against its scale (as the conformance kit's). A 16-bit
#: out rounds the sum once (a fused kernel) or twice (the composition).
TOL = {F64: 1e-12, F32: 1e-5, F16: 2e-3, BF16: 1e-2}

# name: (group sizes, k, n, dtype of a and grad, dtype of out, strided a and grad, seed)
CASES = {
    "basic": ([3, 5, 4], 6, 5, F32, F32, False, 0),
    "empty_experts": ([0, 7, 0, 0, 5, 0], 4, 3, F32, F32, False, 1),
    "one_expert": ([9], 5, 7, F32, F32, False, 2),
    "zero_rows": ([0, 0, 0], 4, 3, F32, F32, False, 3),
    "strided": ([6, 0, 5], 7, 4, F32, F32, True, 4),
    "bf16_into_f32": ([4, 0, 11], 8, 6, BF16, F32, False, 5),
    "fp16_into_f32": ([13, 2, 0, 6], 9, 5, F16, F32, False, 6),
    "bf16": ([5, 9], 8, 6, BF16, BF16, False, 7),
    "fp16": ([0, 8, 3], 6, 10, F16, F16, False, 8),
    "f64": ([2, 0, 7], 5, 4, F64, F64, False, 9),
    "f64_into_f32": ([7, 3], 4, 6, F64, F32, False, 10),
    "k1_n1": ([4, 1, 0], 1, 1, F32, F32, False, 11),
}
# Random shapes: sizes with empty experts, k and n off the tile sizes.
for _seed in range(4):
    _rng = np.random.default_rng(40 + _seed)
    _experts = int(_rng.integers(1, 12))
    _sizes = [int(v) if _rng.random() > 0.3 else 0 for v in _rng.integers(0, 20, _experts)]
    CASES[f"random{_seed}"] = (
        _sizes, int(_rng.integers(1, 40)), int(_rng.integers(1, 40)),
        (F32, F16)[_seed % 2], F32, bool(_seed % 2), 40 + _seed,
    )  # fmt: skip


def _strided(t: torch.Tensor) -> torch.Tensor:
    wide = t.new_zeros(t.shape[0], 2 * t.shape[1])
    wide[:, ::2] = t
    return wide[:, ::2]


def _backends(dtype: torch.dtype, out_dtype: torch.dtype) -> list[str]:
    """The installed backends whose kernel accepts these dtypes on the CPU."""
    trace = megablocks_core.dispatch.explain(
        "gmm_weight_grad_accumulate", "cpu", {"a": dtype, "grad": dtype, "out": out_dtype}
    )
    return sorted({c.kernel.backend for c in trace.candidates if c.accepted})


def _tensor(values: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(oracle.representable(values, dtype)).to(dtype)


@pytest.mark.parametrize("name", list(CASES))
def test_accumulate_matches_a_numpy_loop(name):
    sizes, k, n, dtype, out_dtype, strided, seed = CASES[name]
    rng = np.random.default_rng(seed)
    rows = sum(sizes)
    a_np, g_np = rng.standard_normal((rows, k)), rng.standard_normal((rows, n))
    before = _tensor(rng.standard_normal((len(sizes), k, n)), out_dtype)
    a, grad = _tensor(a_np, dtype), _tensor(g_np, dtype)
    if strided:
        a, grad = _strided(a), _strided(grad)
        assert not a.is_contiguous() and not grad.is_contiguous()
    want = oracle.gmm_weight_grad_accumulate(
        oracle.representable(a_np, dtype), oracle.representable(g_np, dtype), sizes, before.double()
    )
    backends = _backends(dtype, out_dtype)
    assert "reference" in backends
    if (
        dtype in (F32, F16)
        and triton_interpreter.interpreting()
        and megablocks_core.registry().plugins["triton"].status == "ok"
    ):
        assert "triton" in backends  # the interpreter runs the fused kernel for these
    for backend in backends:
        out = before.clone()
        inputs = (a.clone(), grad.clone())
        with megablocks_core.use_backend(backend):
            returned = call("gmm_weight_grad_accumulate", a, grad, torch.tensor(sizes), out)
        assert returned is None
        assert torch.equal(a, inputs[0]) and torch.equal(grad, inputs[1])  # only out is written
        assert out.dtype == out_dtype and out.shape == before.shape and out.is_contiguous()
        scale = max(1.0, float(np.abs(want).max()))
        np.testing.assert_allclose(
            out.double().numpy(), want, rtol=TOL[out_dtype], atol=TOL[out_dtype] * scale,
            err_msg=f"{backend}: {name}",
        )  # fmt: skip
        for e, size in enumerate(sizes):
            if size == 0:  # unchanged, bit for bit
                assert torch.equal(out[e], before[e]), (backend, e)


@pytest.mark.parametrize("dtype,out_dtype", [(F32, F32), (F16, F32)])
def test_accumulate_ignores_rows_past_the_groups(dtype, out_dtype):
    """batch_sizes summing short of the rows (the fused ops' backward with rows routed to no
    expert): the rows past the last group add nothing, on every backend."""
    rng = np.random.default_rng(11)
    sizes, extra, k, n = [5, 0, 8], 7, 6, 4
    a_np = rng.standard_normal((sum(sizes) + extra, k))
    g_np = rng.standard_normal((sum(sizes) + extra, n))
    before = _tensor(rng.standard_normal((len(sizes), k, n)), out_dtype)
    want = oracle.gmm_weight_grad_accumulate(
        oracle.representable(a_np[: sum(sizes)], dtype),
        oracle.representable(g_np[: sum(sizes)], dtype),
        sizes,
        before.double(),
    )
    for backend in _backends(dtype, out_dtype):
        out = before.clone()
        with megablocks_core.use_backend(backend):
            call("gmm_weight_grad_accumulate", _tensor(a_np, dtype), _tensor(g_np, dtype),
                 torch.tensor(sizes), out)  # fmt: skip
        scale = max(1.0, float(np.abs(want).max()))
        np.testing.assert_allclose(
            out.double().numpy(), want, rtol=TOL[out_dtype], atol=TOL[out_dtype] * scale,
            err_msg=backend,
        )  # fmt: skip
        assert torch.equal(out[1], before[1]), backend


def test_two_accumulations_give_the_sum():
    """Two micro-batches into one float32 buffer (fp16 data): the sum of both gradients, at
    float32 precision."""
    rng = np.random.default_rng(5)
    sizes = [6, 0, 9]
    rows = sum(sizes)
    batches = [
        (oracle.representable(rng.standard_normal((rows, 8)), F16),
         oracle.representable(rng.standard_normal((rows, 5)), F16))
        for _ in range(2)
    ]  # fmt: skip
    want = np.zeros((3, 8, 5))
    for a_np, g_np in batches:
        want = oracle.gmm_weight_grad_accumulate(a_np, g_np, sizes, want)
    for backend in _backends(F16, F32):
        out = torch.zeros(3, 8, 5)
        with megablocks_core.use_backend(backend):
            for a_np, g_np in batches:
                call("gmm_weight_grad_accumulate", _tensor(a_np, F16), _tensor(g_np, F16),
                     torch.tensor(sizes), out)  # fmt: skip
        np.testing.assert_allclose(out.double().numpy(), want, rtol=1e-5, atol=1e-5 * 10)


@pytest.mark.parametrize(
    ("out", "error", "message"),
    [
        (torch.zeros(3, 4, 5, dtype=F64), TypeError, "out is in a's dtype or float32"),
        (torch.zeros(3, 4, 5, dtype=F16), TypeError, "out is in a's dtype or float32"),
        (torch.zeros(2, 4, 5), ValueError, "out has the weight gradient's shape"),
        (torch.zeros(3, 5, 4), ValueError, "out has the weight gradient's shape"),
        (torch.zeros(3, 5, 4).transpose(1, 2), ValueError, "got a non-contiguous tensor"),
        (torch.zeros(3, 4, 5, dtype=torch.int32), TypeError, "argument 'out' must be"),
        (torch.zeros(4, 5), ValueError, "argument 'out' must be a contiguous 3-D tensor"),
    ],
)
def test_bad_out_is_rejected_naming_the_op(out, error, message):
    a, grad, sizes = torch.randn(6, 4), torch.randn(6, 5), torch.tensor([2, 4, 0])
    before = out.clone()
    with pytest.raises(error, match=message) as info:
        call("gmm_weight_grad_accumulate", a, grad, sizes, out)
    assert str(info.value).startswith("megablocks_core.ops.gmm_weight_grad_accumulate: ")
    assert torch.equal(out, before)


def test_a_non_contiguous_out_is_rejected_after_a_cached_call():
    """Contiguity is not part of the call key: a later strided out of the same shape is still
    caught."""
    a, grad, sizes = torch.randn(6, 4), torch.randn(6, 5), torch.tensor([2, 4, 0])
    call("gmm_weight_grad_accumulate", a, grad, sizes, torch.zeros(3, 4, 5))
    strided = torch.zeros(3, 5, 4).transpose(1, 2)
    with pytest.raises(ValueError, match="non-contiguous"):
        call("gmm_weight_grad_accumulate", a, grad, sizes, strided)
    assert (strided == 0).all()


def test_host_batch_sizes_are_checked():
    a, grad, out = torch.randn(6, 4), torch.randn(6, 5), torch.zeros(3, 4, 5)
    # Sizes summing past the rows, or negative (sizes summing short are valid: the rows past the
    # last group belong to none, test_accumulate_ignores_rows_past_the_groups).
    for sizes in ([2, 4, 1], [-1, 4, 3], [7, 0, 0]):
        with pytest.raises(ValueError, match="gmm_weight_grad_accumulate"):
            call("gmm_weight_grad_accumulate", a, grad, torch.tensor(sizes), out)
    assert (out == 0).all()


def test_schema_declares_the_write():
    schema = str(torch.ops.megablocks.gmm_weight_grad_accumulate.default._schema)
    assert schema.endswith("Tensor(a!) out) -> ()"), schema


# ---------------------------------------------------------------------------
# The core's autograd: opted-in weights accumulate through the op


def _routing(tokens: int, experts: int, top_k: int, seed: int) -> tuple[torch.Tensor, ...]:
    """(indices, bin_ids, bins) of random top-k routing with some experts empty, int32."""
    rng = np.random.default_rng(seed)
    r = oracle.make_routing(rng, tokens, top_k, experts, empty=True)
    return tuple(torch.tensor(r[n], dtype=torch.int32) for n in ("indices", "bin_ids", "bins"))


def _op_step(op: str, x: torch.Tensor, w: torch.Tensor, trans_b: bool, seed: int) -> None:
    """One micro-batch through ``op`` with expert matrices ``w``: forward, backward."""
    indices, bin_ids, bins = _routing(x.shape[0], w.shape[0], 2, seed)
    gen = torch.Generator().manual_seed(seed)
    if op == "gmm":
        counts = torch.diff(bins, prepend=bins.new_zeros(1)).long()
        rows = x.repeat_interleave(2, 0)[: int(counts.sum())]
        out = megablocks_core.ops.gmm(rows, w, counts, trans_b)
    elif op == "gather_gmm":
        out = megablocks_core.ops.gather_gmm(x, w, indices, bin_ids, bins, 2, trans_b)
    else:  # gmm_scatter of the sorted rows
        rows = x.repeat_interleave(2, 0)
        weights = torch.rand(rows.shape[0], generator=gen, dtype=x.dtype)
        out = megablocks_core.ops.gmm_scatter(rows, w, indices, bin_ids, weights, bins, 2, trans_b)
    out.backward(torch.randn(out.shape, generator=gen, dtype=out.dtype))


def _weights(experts: int, k: int, n: int, trans_b: bool, dtype=F32) -> torch.nn.Parameter:
    shape = (experts, n, k) if trans_b else (experts, k, n)
    return torch.nn.Parameter(
        torch.randn(shape, generator=torch.Generator().manual_seed(3), dtype=dtype)
    )


def _record(calls: list[bool], grad: torch.Tensor | None) -> None:
    calls.append(grad is not None)


def _fp32_backends() -> list[str]:
    return _backends(F32, F32)


@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("op", ["gmm", "gather_gmm", "gmm_scatter"])
def test_fused_weight_gradient_equals_autograds_sum(op, trans_b):
    """Three micro-batches: the opted-in weight's .grad equals the plain one's, the first
    micro-batch through autograd (no .grad yet), the later ones added in place (autograd's
    AccumulateGrad gets no gradient for them)."""
    for backend in _fp32_backends():
        k, n = (6, 5) if op != "gmm_scatter" else (5, 6)
        plain, fused = _weights(8, k, n, trans_b), _weights(8, k, n, trans_b)
        megablocks_core.fuse_grad_accumulation(fused)
        assert megablocks_core.is_grad_accumulation_fused(fused)
        assert not megablocks_core.is_grad_accumulation_fused(plain)
        seen: dict[str, list[bool]] = {"plain": [], "fused": []}  # gradient handed to autograd?
        plain.register_hook(functools.partial(_record, seen["plain"]))
        fused.register_hook(functools.partial(_record, seen["fused"]))
        x = torch.randn(7, k, generator=torch.Generator().manual_seed(1))
        with megablocks_core.use_backend(backend):
            for step in range(3):
                for w in (plain, fused):
                    _op_step(op, x.clone().requires_grad_(), w, trans_b, seed=10 + step)
                if step == 0:
                    first = fused.grad
        assert fused.grad is first  # accumulated in place, never replaced
        torch.testing.assert_close(fused.grad, plain.grad, rtol=1e-5, atol=1e-5)
        # The weight's gradient hooks see None once it is added in place.
        assert seen == {"plain": [True] * 3, "fused": [True, False, False]}, (backend, seen)


def test_float64_fused_equals_unfused_tightly():
    plain, fused = _weights(6, 4, 3, False, F64), _weights(6, 4, 3, False, F64)
    megablocks_core.fuse_grad_accumulation(fused)
    x = torch.randn(9, 4, generator=torch.Generator().manual_seed(2), dtype=F64)
    for step in range(2):
        for w in (plain, fused):
            _op_step("gather_gmm", x.clone().requires_grad_(), w, False, seed=step)
    torch.testing.assert_close(fused.grad, plain.grad, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("dtype", [F32, BF16, F16])
def test_main_grad_gets_the_sum_and_grad_stays_none(dtype):
    """Megatron's convention: a float32 main_grad accumulates every micro-batch (the first one
    too), .grad is never created, grad_added_to_main_grad is set."""
    for backend in _backends(dtype, F32):
        plain = _weights(8, 6, 5, False, dtype)
        fused = _weights(8, 6, 5, False, dtype)
        fused.main_grad = torch.zeros(fused.shape, dtype=F32)
        megablocks_core.fuse_grad_accumulation(fused)
        x = torch.randn(7, 6, generator=torch.Generator().manual_seed(1)).to(dtype)
        want = torch.zeros(fused.shape, dtype=F64)
        with megablocks_core.use_backend(backend):
            for step in range(2):
                plain.grad = None
                for w in (plain, fused):
                    _op_step("gather_gmm", x.clone().requires_grad_(), w, False, seed=20 + step)
                want += plain.grad.double()
        assert fused.grad is None
        assert fused.grad_added_to_main_grad is True
        # 16-bit data: each micro-batch's plain gradient was rounded to 16 bits, main_grad's not.
        tol = 1e-5 if dtype == F32 else 1e-2
        torch.testing.assert_close(fused.main_grad.double(), want, rtol=tol, atol=tol)


def test_autograd_grad_and_backward_inputs_leave_grad_alone():
    """torch.autograd.grad returns the weight's gradient and never touches .grad; backward(inputs=)
    without the weight does not accumulate into it either."""
    w = _weights(8, 6, 5, False)
    megablocks_core.fuse_grad_accumulation(w)
    x = torch.randn(7, 6, generator=torch.Generator().manual_seed(1), requires_grad=True)
    indices, bin_ids, bins = _routing(7, 8, 2, 0)
    _op_step("gather_gmm", x, w, False, seed=0)  # .grad exists from here on
    before = w.grad.clone()
    out = megablocks_core.ops.gather_gmm(x, w, indices, bin_ids, bins, 2)
    (dw,) = torch.autograd.grad(out.sum(), [w])
    assert torch.equal(w.grad, before)
    want = torch.zeros_like(before)
    counts = torch.diff(bins, prepend=bins.new_zeros(1)).tolist()
    rows = x.detach()[indices.long() // 2]
    start = 0
    for e, size in enumerate(counts):
        want[e] = rows[start : start + size].T @ torch.ones(size, 5)
        start += size
    torch.testing.assert_close(dw, want)
    out = megablocks_core.ops.gather_gmm(x, w, indices, bin_ids, bins, 2)
    out.sum().backward(inputs=[x])
    assert torch.equal(w.grad, before)
    out = megablocks_core.ops.gather_gmm(x, w, indices, bin_ids, bins, 2)
    out.sum().backward(inputs=[w])  # named: accumulated (fused)
    torch.testing.assert_close(w.grad, before + want)


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph")
def test_create_graph_is_not_fused():
    """With create_graph the weight gradient must be a graph value: autograd accumulates it."""
    w = _weights(4, 3, 2, False, F64)
    megablocks_core.fuse_grad_accumulation(w)
    x = torch.randn(5, 3, dtype=F64, generator=torch.Generator().manual_seed(4), requires_grad=True)
    _op_step("gather_gmm", x, w, False, seed=1)
    seen: list[bool] = []
    w.register_hook(functools.partial(_record, seen))
    indices, bin_ids, bins = _routing(5, 4, 2, 2)
    out = megablocks_core.ops.gather_gmm(x, w, indices, bin_ids, bins, 2)
    out.square().sum().backward(create_graph=True)
    assert seen == [True] and w.grad.requires_grad


@pytest.mark.filterwarnings("ignore:grad and param do not obey the gradient layout contract")
def test_a_grad_autograd_must_handle_is_not_fused():
    """A .grad of another dtype or layout is left to AccumulateGrad (which may replace it)."""
    w = _weights(4, 3, 2, False)
    megablocks_core.fuse_grad_accumulation(w)
    w.grad = torch.zeros(4, 2, 3).transpose(1, 2)  # non-contiguous
    seen: list[bool] = []
    w.register_hook(functools.partial(_record, seen))
    _op_step("gmm", torch.randn(6, 3, requires_grad=True), w, False, seed=3)
    assert seen == [True]


def test_opting_out_and_bad_arguments():
    w = _weights(4, 3, 2, False)
    megablocks_core.fuse_grad_accumulation(w)
    megablocks_core.fuse_grad_accumulation(w, enabled=False)
    assert not megablocks_core.is_grad_accumulation_fused(w)
    _op_step("gmm", torch.randn(6, 3, requires_grad=True), w, False, seed=3)
    seen: list[bool] = []
    w.register_hook(functools.partial(_record, seen))
    _op_step("gmm", torch.randn(6, 3, requires_grad=True), w, False, seed=4)
    assert seen == [True]
    with pytest.raises(TypeError, match="fuse_grad_accumulation: argument 1 must be a tensor"):
        megablocks_core.fuse_grad_accumulation(w, "w2")
    with pytest.raises(ValueError, match="must be a leaf tensor"):
        megablocks_core.fuse_grad_accumulation(w * 2)


@pytest.mark.parametrize(
    "main_grad",
    [torch.zeros(4, 2, 3), torch.zeros(4, 3, 2, dtype=F64), torch.zeros(4, 2, 3).transpose(1, 2)],
    ids=["shape", "dtype", "strided"],
)
def test_a_main_grad_that_does_not_fit_is_an_error(main_grad):
    w = _weights(4, 3, 2, False)
    w.main_grad = main_grad
    megablocks_core.fuse_grad_accumulation(w)
    with pytest.raises(ValueError, match="has a main_grad, which must be a contiguous tensor"):
        _op_step("gmm", torch.randn(6, 3, requires_grad=True), w, False, seed=3)
