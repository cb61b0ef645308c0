"""Gradient-accumulation fusion: the op ``gmm_weight_grad_accumulate`` against a numpy loop on
every backend serving the CPU (triton under TRITON_INTERPRET=1)."""

from __future__ import annotations

import numpy as np
import oracle
import pytest
import torch

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
    if dtype in (F32, F16) and megablocks_core.registry().plugins["triton"].status == "ok":
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
    for sizes in ([2, 4, 1], [-1, 4, 3], [2, 2, 1]):
        with pytest.raises(ValueError, match="gmm_weight_grad_accumulate"):
            call("gmm_weight_grad_accumulate", a, grad, torch.tensor(sizes), out)
    assert (out == 0).all()


def test_schema_declares_the_write():
    schema = str(torch.ops.megablocks.gmm_weight_grad_accumulate.default._schema)
    assert schema.endswith("Tensor(a!) out) -> ()"), schema
