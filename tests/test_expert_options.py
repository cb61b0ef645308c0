"""The expert options transformers' MoE families need: the grouped GEMMs' per-expert bias, the
exact and tanh GELUs by name, interleaved gate/up rows and GPT-OSS's clamped SwiGLU.

Each is checked against an independent per-token loop or formula (float64 on the reference
backend, tight), and the Triton kernels against the definitions (float32 under the
interpreter, the kit's tolerance).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from triton_interpreter import interpreting

import megablocks_core.ops as ops
from megablocks_core import use_backend
from megablocks_core.activations import (
    ACTIVATIONS,
    CLAMPED,
    GATED,
    GLU_NAMES,
    ROW_NAMES,
    activation_backward,
    glu,
    glu_backward,
)
from megablocks_core.entries import call
from megablocks_core.testing.kit import TOLERANCES

EXPERTS, HIDDEN, FFN, TOKENS, TOP_K = 3, 4, 5, 6, 2


#: Constants other than GPT-OSS's (alpha, limit), with a limit the samples' values cross.
OWN_CONSTANTS = (1.3, 2.5)


def _oai(
    gate: torch.Tensor, up: torch.Tensor, alpha: float = 1.702, limit: float = 7.0
) -> torch.Tensor:
    """GPT-OSS's clamped SwiGLU, written as transformers writes it."""
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def test_gelu_names() -> None:
    x = torch.linspace(-5, 5, 101, dtype=torch.float64)
    torch.testing.assert_close(ACTIVATIONS["gelu_erf"][0](x), 0.5 * x * (1 + torch.erf(x / 2**0.5)))
    tanh = F.gelu(x, approximate="tanh")
    torch.testing.assert_close(ACTIVATIONS["gelu_tanh"][0](x), tanh)
    torch.testing.assert_close(ACTIVATIONS["gelu"][0](x), tanh)  # MegaBlocks' "gelu"
    assert (ACTIVATIONS["gelu_erf"][0](x) - tanh).abs().max() > 1e-4


@pytest.mark.parametrize("constants", [(), OWN_CONSTANTS, (0.5, float("inf"))])
@pytest.mark.parametrize("interleaved", [False, True])
def test_clamped_swiglu_definition(interleaved: bool, constants: tuple[float, ...]) -> None:
    """The definition against transformers' formula in float64 (its gradient by autograd), at
    GPT-OSS's constants, at others with an active clamp, and without a clamp (limit inf)."""
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(9, 12, generator=gen, dtype=torch.float64) * 6).requires_grad_()
    gate, up = (x[:, 0::2], x[:, 1::2]) if interleaved else x.chunk(2, dim=-1)
    want = _oai(gate, up, *constants)
    if constants and constants[1] < 7:
        assert (gate > constants[1]).any() and (up.abs() > constants[1]).any()  # clamps cut
    name = "silu_oai" + ("_interleaved" if interleaved else "")
    got = glu(x.detach(), name, *constants)
    torch.testing.assert_close(got, want.detach(), rtol=1e-14, atol=1e-14)
    grad = torch.randn(want.shape, generator=gen, dtype=torch.float64)
    (want_grad,) = torch.autograd.grad(want, x, grad)
    torch.testing.assert_close(glu_backward(grad, x.detach(), name, *constants), want_grad)
    # float32 data: computed in float32, within float32 rounding of the float64 formula
    got32 = glu(x.detach().float(), name, *constants)
    torch.testing.assert_close(got32.double(), want.detach(), rtol=1e-5, atol=1e-5)


def test_clamped_swiglu_constants_change_the_result() -> None:
    """The constants are used (a definition computing 1.702 and 7.0 whatever it is given would
    pass the comparison above only at the defaults)."""
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(6), dtype=torch.float64) * 4
    default = glu(x, "silu_oai")
    assert not torch.allclose(glu(x, "silu_oai", *OWN_CONSTANTS), default)
    assert not torch.allclose(glu(x, "silu_oai", alpha=OWN_CONSTANTS[0]), default)
    assert not torch.allclose(glu(x, "silu_oai", limit=OWN_CONSTANTS[1]), default)
    torch.testing.assert_close(glu(x, "silu_oai", 1.702, 7.0), default, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"alpha": 1.0}, "constants of the clamped SwiGLU only"),
        ({"limit": 0.0}, "limit is positive"),
        ({"limit": float("nan")}, "limit is positive"),
        ({"alpha": float("inf")}, "alpha is finite"),
    ],
)
def test_bad_clamp_constants_are_contract_errors(kwargs: dict, message: str) -> None:
    from megablocks_core import ContractError

    x = torch.randn(3, 8, dtype=torch.float64)
    name = "silu" if "alpha" in kwargs and kwargs["alpha"] == 1.0 else "silu_oai"
    with pytest.raises(ContractError, match=message):
        ops.glu(x, name, **kwargs)
    with pytest.raises(ValueError):  # the definition itself refuses them too
        glu(x, name, **kwargs)


@pytest.mark.parametrize("name", [n for n in GLU_NAMES if n.endswith("_interleaved")])
def test_interleaved_is_the_side_by_side_unit_of_the_columns(name: str) -> None:
    x = torch.randn(7, 10, dtype=torch.float64) * 3
    side_by_side = torch.cat([x[:, 0::2], x[:, 1::2]], dim=-1)
    base = name.removesuffix("_interleaved")
    torch.testing.assert_close(glu(x, name), glu(side_by_side, base))
    grad = torch.randn(7, 5, dtype=torch.float64)
    back = glu_backward(grad, side_by_side, base)
    torch.testing.assert_close(
        glu_backward(grad, x, name), torch.stack(back.chunk(2, dim=-1), dim=-1).flatten(-2)
    )


def _with_constants(names: tuple[str | None, ...]) -> list[tuple[str | None, tuple]]:
    """Each name with no constants, and the clamped ones also with constants of their own."""
    return [(n, ()) for n in names] + [(n, OWN_CONSTANTS) for n in names if n in CLAMPED]


@pytest.mark.skipif(not interpreting(), reason="the Triton kernels on CPU tensors")
def test_triton_activation_kernels_match_the_definitions() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 10, generator=gen) * 4
    grad = torch.randn(7, 5, generator=gen)
    scale = torch.rand(7, generator=gen)
    tol = TOLERANCES[torch.float32]
    with use_backend("triton"):
        for name, constants in _with_constants((*GLU_NAMES, None)):
            torch.testing.assert_close(
                call("glu", x, name, *constants), glu(x, name, *constants), rtol=tol, atol=tol
            )
            torch.testing.assert_close(
                call("glu_backward", grad, x, name, *constants),
                glu_backward(grad, x, name, *constants),
                rtol=tol,
                atol=tol,
            )
        for name, constants in _with_constants((*ROW_NAMES, None)):
            rows = x if name in GATED else x[:, :5].contiguous()
            got_grad, want_grad = grad.clone(), grad.clone()
            got = call("activation_backward", got_grad, rows, scale, name, *constants)
            want = activation_backward(want_grad, rows, scale, name, *constants)
            for g, w in zip((*got, got_grad), (*want, want_grad), strict=True):
                torch.testing.assert_close(g, w, rtol=tol, atol=tol, msg=str(name))


def _routing() -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(TOKENS)])
    return (ids.flatten(), *ops.route(ids.flatten().int(), EXPERTS, 4))


def _leaves(dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    shapes = [
        (TOKENS, HIDDEN),  # x
        (EXPERTS, HIDDEN, 2 * FFN),  # first GEMM (in, out)
        (EXPERTS, 2 * FFN),  # its bias
        (EXPERTS, FFN, HIDDEN),  # second GEMM
        (EXPERTS, HIDDEN),  # its bias
    ]
    leaves = [torch.randn(s, generator=gen, dtype=dtype) for s in shapes]
    weights = torch.rand(TOKENS * TOP_K, generator=gen, dtype=dtype)
    return [t.requires_grad_() for t in (*leaves, weights)]


def _per_token(
    leaves: list[torch.Tensor], ids: torch.Tensor, interleaved: bool, constants: tuple = ()
) -> torch.Tensor:
    x, w1, b1, w2, b2, weights = leaves
    out = []
    for t in range(TOKENS):
        acc = torch.zeros(HIDDEN, dtype=x.dtype)
        for k in range(TOP_K):
            e = int(ids[t * TOP_K + k])
            h = x[t] @ w1[e] + b1[e]
            gate, up = (h[0::2], h[1::2]) if interleaved else h.chunk(2)
            acc = acc + weights[t * TOP_K + k] * (_oai(gate, up, *constants) @ w2[e] + b2[e])
        out.append(acc)
    return torch.stack(out)


@pytest.mark.parametrize(
    ("backend", "dtype"), [("reference", torch.float64), ("triton", torch.float32)]
)
@pytest.mark.parametrize("constants", [(), OWN_CONSTANTS])
@pytest.mark.parametrize("interleaved", [False, True])
def test_biased_clamped_swiglu_experts_and_every_gradient(
    backend: str, dtype: torch.dtype, interleaved: bool, constants: tuple
) -> None:
    """GPT-OSS's experts through the fused ops: gather_gmm with a bias, then gmm_scatter with
    the clamped SwiGLU (GPT-OSS's constants or others) and a bias, against a per-token loop."""
    if backend == "triton" and not interpreting():
        pytest.skip("the Triton kernels on CPU tensors")
    ids, indices, bin_ids, _, bins, _ = _routing()
    leaves = _leaves(dtype)
    x, w1, b1, w2, b2, weights = leaves
    activation = "swiglu_oai" + ("_interleaved" if interleaved else "")
    with use_backend(backend):
        h = ops.gather_gmm(x * 3, w1, indices, bin_ids, bins, TOP_K, False, None, b1 * 3)
        got = ops.gmm_scatter(h, w2, indices, bin_ids, weights, bins, TOP_K, False, activation,
                              None, b2, *constants)  # fmt: skip
    scaled = [x * 3, w1, b1 * 3, w2, b2, weights]
    want = _per_token(scaled, ids, interleaved, constants)
    probe = torch.randn(want.shape, generator=torch.Generator().manual_seed(3), dtype=dtype)
    got_grads = torch.autograd.grad((got * probe).sum(), leaves)
    want_grads = torch.autograd.grad((want * probe).sum(), leaves)
    tol = 1e-12 if dtype == torch.float64 else TOLERANCES[dtype]
    for g, w in zip((got, *got_grads), (want, *want_grads), strict=True):
        scale = max(1.0, w.abs().max().item())
        torch.testing.assert_close(g, w, rtol=tol, atol=tol * scale)


def test_gmm_bias_per_group_and_none_past_the_groups() -> None:
    gen = torch.Generator().manual_seed(4)
    a = torch.randn(9, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, 5, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(3, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    sizes = torch.tensor([2, 0, 5])  # the last two rows belong to no group
    out = ops.gmm(a, b, sizes, True, bias)
    experts = [0, 0, 2, 2, 2, 2, 2]
    want = torch.cat(
        [torch.stack([a[i] @ b[e].t() + bias[e] for i, e in enumerate(experts)]), a.new_zeros(2, 5)]
    )
    torch.testing.assert_close(out, want)
    probe = torch.randn(9, 5, generator=gen, dtype=torch.float64)
    got = torch.autograd.grad((out * probe).sum(), (a, b, bias))
    expected = torch.autograd.grad((want * probe).sum(), (a, b, bias))
    for g, w in zip(got, expected, strict=True):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("bias_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_served_bias_is_added_in_float32_and_rounded_once(dtype, bias_dtype) -> None:
    """The core adds a bias to a kernel's output in place; the sum is still the float32 sum of
    the two, rounded once to the output's dtype (a row loop here)."""
    from megablocks_core.bias import add_row_bias

    gen = torch.Generator().manual_seed(5)
    out = torch.randn(23, 7, generator=gen).to(dtype)
    bias = torch.randn(3, 7, generator=gen).to(bias_dtype)
    ends = torch.tensor([4, 4, 20])  # an empty group, and 3 rows past the groups
    experts = [0] * 4 + [2] * 16
    want = out.clone()
    for row, e in enumerate(experts):
        want[row] = (out[row].float() + bias[e].float()).to(dtype)
    assert torch.equal(add_row_bias(out.clone(), bias, ends), want)


def test_a_bias_of_the_wrong_shape_or_dtype_is_an_error_naming_it() -> None:
    a = torch.randn(4, 3)
    b = torch.randn(2, 3, 5)
    sizes = torch.tensor([2, 2])
    with pytest.raises(ValueError, match="bias"):
        ops.gmm(a, b, sizes, False, torch.randn(2, 3))
    with pytest.raises(TypeError, match="bias"):
        ops.gmm(a, b, sizes, False, torch.randn(2, 5, dtype=torch.float64))


@pytest.mark.parametrize(
    ("backend", "dtype"), [("reference", torch.float64), ("triton", torch.float32)]
)
def test_gather_gmm_bias_on_a_row_whose_id_is_out_of_range(
    backend: str, dtype: torch.dtype
) -> None:
    """The contract's rule: such a row gathers a zero row, so with a bias its output is bias[e]
    (the composition gmm(gather(...), bias)); rows past bins[-1] stay 0. Against a plain loop,
    values and gradients (the bias's gradient takes the row's; x's takes nothing from it)."""
    if backend == "triton" and not interpreting():
        pytest.skip("the Triton kernels on CPU tensors")
    gen = torch.Generator().manual_seed(6)
    tokens, top_k, pairs = 4, 2, 8
    x = torch.randn(tokens, HIDDEN, generator=gen, dtype=dtype, requires_grad=True)
    w = torch.randn(EXPERTS, HIDDEN, FFN, generator=gen, dtype=dtype, requires_grad=True)
    bias = torch.randn(EXPERTS, FFN, generator=gen, dtype=dtype, requires_grad=True)
    # Rows 1 and 4 name no pair (past the pairs, negative); rows 7 and 8 are past bins[-1].
    indices = torch.tensor([3, pairs, 0, 5, -1, 2, 6, 1], dtype=torch.int32)
    bins = torch.tensor([2, 2, 6], dtype=torch.int32)
    bin_ids = torch.tensor([0, 0, 2, 2, 2, 2, 3, 3], dtype=torch.int32)
    with use_backend(backend):
        out = ops.gather_gmm(x, w, indices, bin_ids, bins, top_k, False, None, bias)
    rows = []
    for i, flat in enumerate(indices.tolist()):
        if i >= int(bins[-1]):
            rows.append(x.new_zeros(FFN))
            continue
        e = int(torch.searchsorted(bins, torch.tensor(i), right=True))
        gathered = x[flat // top_k] if 0 <= flat < pairs else x.new_zeros(HIDDEN)
        rows.append(gathered @ w[e] + bias[e])
    want = torch.stack(rows)
    assert torch.equal(out[1].detach(), bias[0].detach()) and not out[6:].any()
    probe = torch.randn(want.shape, generator=gen, dtype=dtype)
    got_grads = torch.autograd.grad((out * probe).sum(), (x, w, bias))
    want_grads = torch.autograd.grad((want * probe).sum(), (x, w, bias))
    tol = 1e-12 if dtype == torch.float64 else TOLERANCES[dtype]
    for g, wnt in zip((out, *got_grads), (want, *want_grads), strict=True):
        torch.testing.assert_close(g, wnt, rtol=tol, atol=tol)


def test_gather_gmm_states_one_rule_for_a_row_whose_id_is_out_of_range() -> None:
    from megablocks_core.contracts import BY_NAME

    [rule] = [e for e in BY_NAME["gather_gmm"].edge_cases if "out of range" in e]
    assert "bias[e] with bias" in rule


needs_interpreter = pytest.mark.skipif(not interpreting(), reason="the Triton kernels on CPU")


def _one_rounding_case() -> dict[str, torch.Tensor]:
    """float16 operands whose products are exact in float32 but not in float16 (2049: between
    the float16 neighbours 2048 and 2050), with a bias of 0.75: added to the float32 product and
    rounded once, 2049.75 gives 2050; the product rounded first (2048, a tie to even) then biased
    gives 2048. Expert 0 has rows 0-2, expert 1 none, expert 2 rows 3-5; rows 6-7 belong to no
    expert."""
    b = torch.tensor([[[2048.0], [1.0]]] * 3, dtype=torch.float16)  # (3, 2, 1)
    return {
        "a": torch.ones(8, 2, dtype=torch.float16),  # each row's product: 2048 + 1
        "b": b,
        "bias": torch.tensor([[0.75], [5.0], [0.75]], dtype=torch.float16),
        "sizes": torch.tensor([3, 0, 3]),
        "bins": torch.tensor([3, 3, 6], dtype=torch.int32),
        "indices": torch.arange(8, dtype=torch.int32),
    }


@needs_interpreter
def test_triton_adds_the_bias_in_the_epilogue_rounding_once() -> None:
    """gmm, gather_gmm and gmm_scatter on the Triton kernels add the bias to the float32
    product and round once (the contract's rule for a kernel that takes it); the core's
    served bias, after the kernel's own rounding, gives another value, so the core did not add
    it. Rows of no expert get no bias."""
    c = _one_rounding_case()
    want = torch.tensor([2050.0] * 6 + [0.0] * 2, dtype=torch.float16)[:, None]
    with use_backend("triton"):
        got_gmm = ops.gmm(c["a"], c["b"], c["sizes"], False, c["bias"])
        got_gather = ops.gather_gmm(
            c["a"], c["b"], c["indices"], c["indices"], c["bins"], 1, False, None, c["bias"]
        )
        # gmm_scatter, one pair per token, weight 1: each token's row is its pair's product
        got_scatter = ops.gmm_scatter(
            c["a"], c["b"], c["indices"], c["indices"], None, c["bins"], 1, False, None, None,
            c["bias"],
        )  # fmt: skip
    assert torch.equal(got_gmm, want)
    assert torch.equal(got_gather, want)
    assert torch.equal(got_scatter, want)
    with use_backend("reference"):  # the core's bias around the reference's rounded product
        served = ops.gmm(c["a"], c["b"], c["sizes"], False, c["bias"])
    assert torch.equal(served[:6], torch.full((6, 1), 2048.0, dtype=torch.float16))


@needs_interpreter
def test_triton_bias_with_an_empty_inner_dimension_is_the_bias() -> None:
    sizes = torch.tensor([2, 0, 3])
    bias = torch.randn(3, 4)
    with use_backend("triton"):
        out = ops.gmm(torch.empty(6, 0), torch.empty(3, 0, 4), sizes, False, bias)
    want = torch.cat([bias[0].expand(2, 4), bias[2].expand(3, 4), torch.zeros(1, 4)])
    assert torch.equal(out, want)


@needs_interpreter
def test_gpt_oss_experts_on_triton_run_no_core_side_bias_pass(monkeypatch) -> None:
    """GPT-OSS's experts (biases on both GEMMs) on the Triton kernels, forward and backward:
    the core never adds a bias around a kernel (megablocks_core.bias's serving functions are
    replaced by ones that raise)."""
    import megablocks_core.bias as bias_ops

    def refuse(*args: object) -> None:
        raise AssertionError("the core served a bias")

    monkeypatch.setattr(bias_ops, "add_row_bias", refuse)
    monkeypatch.setattr(bias_ops, "token_expert_weights", refuse)
    ids, indices, bin_ids, _, bins, _ = _routing()
    leaves = _leaves(torch.float32)
    x, w1, b1, w2, b2, weights = leaves
    with use_backend("triton"):
        h = ops.gather_gmm(x, w1, indices, bin_ids, bins, TOP_K, False, None, b1)
        out = ops.gmm_scatter(h, w2, indices, bin_ids, weights, bins, TOP_K, False,
                              "swiglu_oai_interleaved", None, b2, *OWN_CONSTANTS)  # fmt: skip
        out.sum().backward()
    assert all(t.grad is not None for t in leaves)
