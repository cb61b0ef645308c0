"""The dropless MoE layer (megablocks_core.layers) against a per-token loop, under compile, and the demo."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import megablocks_core
from megablocks_core import cli
from megablocks_core.layers import DroplessMoE, MoEConfig, dMoE, load_balancing_loss
from megablocks_core.layers.moe import expert_seed

pytestmark = pytest.mark.usefixtures("reference_backend")

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def make(hidden=8, ffn=12, experts=8, top_k=2, glu=False, dtype=torch.float64, device="cpu", **kw):
    model = DroplessMoE(
        MoEConfig(hidden, ffn, experts, top_k, glu=glu, dtype=dtype, device=device, **kw)
    )
    # Larger router weights than the 0.02 default: clear top-k choices, no near-ties between experts.
    with torch.no_grad():
        model.router.copy_(
            torch.randn(model.router.shape, generator=torch.Generator().manual_seed(7))
        )
    return model


def loop_reference(model: DroplessMoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer token by token in float64 with plain matrix products, and its aux loss, no MoE op."""
    router, w1, w2 = (p.double() for p in (model.router, model.w1, model.w2))
    v1 = None
    if model.glu:  # gate and up side by side
        w1, v1 = w1[..., : model.ffn_hidden_size], w1[..., model.ffn_hidden_size :]
    x = x.double().reshape(-1, model.hidden_size)
    probs = torch.softmax(x @ router.T, dim=-1)
    weights, top = torch.topk(probs, model.top_k, dim=-1)
    if model.normalize_expert_weights is not None:
        weights = weights / weights.norm(p=model.normalize_expert_weights, dim=-1, keepdim=True)
    rows = []
    for t in range(x.shape[0]):
        row = torch.zeros(model.hidden_size, dtype=torch.float64)
        for k in range(model.top_k):
            e = int(top[t, k])
            h = model.activation(x[t] @ w1[e])
            if v1 is not None:
                h = h * (x[t] @ v1[e])
            row = row + weights[t, k] * (h @ w2[e])
        rows.append(row)
    out = torch.stack(rows) if rows else x.new_zeros(0, model.hidden_size)
    # MegaBlocks' batched_load_balancing_loss for one layer, written out with a count loop.
    tokens, experts = probs.shape
    counts = torch.zeros(experts, dtype=torch.float64)
    for e in top.flatten().tolist():
        counts[e] += 1
    if tokens == 0:
        aux = torch.zeros((), dtype=torch.float64)
    else:
        scale = experts * model.load_balancing_loss_coefficient / (1 * tokens * model.top_k)
        aux = scale * (counts * probs.mean(dim=0)).sum()
    return out, aux


def params(model: DroplessMoE) -> list[torch.Tensor]:
    return [model.router, model.w1, model.w2]


CASES = [(1, 1), (8, 1), (8, 2), (8, 4)]  # (experts, top_k)


@pytest.mark.parametrize("glu", [False, True], ids=["mlp", "glu"])
@pytest.mark.parametrize(("experts", "top_k"), CASES, ids=[f"E{e}-k{k}" for e, k in CASES])
def test_forward_and_gradients_match_loop(experts, top_k, glu):
    model = make(experts=experts, top_k=top_k, glu=glu, load_balancing_loss_coefficient=0.1)
    x = torch.randn(2, 5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    x.requires_grad_()
    out, aux = model(x)
    assert out.shape == x.shape and out.dtype == x.dtype
    grad = torch.randn_like(out)
    got = torch.autograd.grad((out * grad).sum() + aux, [x, *params(model)])

    want_out, want_aux = loop_reference(model, x)
    want = torch.autograd.grad(
        (want_out.reshape(x.shape) * grad).sum() + want_aux, [x, *params(model)]
    )
    torch.testing.assert_close(out, want_out.reshape(x.shape))
    torch.testing.assert_close(aux, want_aux)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("glu", [False, True], ids=["mlp", "glu"])
@pytest.mark.parametrize("activation", ["gelu", "silu", "relu", torch.tanh])
def test_activations_match_loop(activation, glu):
    """Named activations (SwiGLU is glu + "silu"; gated ones recompute act in backward) and any
    callable, forward and every gradient, against the float64 loop."""
    model = make(experts=4, top_k=2, glu=glu, activation=activation)
    x = torch.randn(7, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    x.requires_grad_()
    out, aux = model(x)
    grad = torch.randn_like(out)
    got = torch.autograd.grad((out * grad).sum() + aux, [x, *params(model)])
    x_ref = x.detach().clone().requires_grad_()
    want_out, want_aux = loop_reference(model, x_ref)
    want = torch.autograd.grad((want_out * grad).sum() + want_aux, [x_ref, *params(model)])
    torch.testing.assert_close(out, want_out)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


def test_unknown_activation_name_is_rejected():
    with pytest.raises(ValueError, match="activation must be one of"):
        DroplessMoE(MoEConfig(4, 4, 2, activation="swish"))
    # A gated unit's name is not an expert activation: the error says how to ask for it.
    with pytest.raises(
        ValueError, match=r"'swiglu' \(gated experts: glu=True with activation='silu'\)"
    ):
        DroplessMoE(MoEConfig(4, 4, 2, activation="swiglu"))


def _composed_layer(model: DroplessMoE, x: torch.Tensor) -> torch.Tensor:
    """The layer's output with the unfused ops: gather, gmm (model.experts), scatter."""
    unfused = copy.copy(model)
    unfused.fuse_permutation = False
    return unfused(x)[0]


def _fp32_cpu_backends() -> list[str]:
    served = megablocks_core.dispatch.explain("gather_gmm", "cpu", {"x": torch.float32})
    return sorted({c.kernel.backend for c in served.candidates if c.accepted})


@pytest.mark.parametrize("glu", [False, True], ids=["mlp", "glu"])
@pytest.mark.parametrize(("tokens", "experts", "top_k"), [(12, 8, 2), (0, 4, 2), (9, 16, 8)])
def test_fused_layer_equals_composed_ops(tokens, experts, top_k, glu):
    """The layer's fused path (gather_gmm, gmm_scatter) against gather/gmm/scatter, fp32, on every
    backend serving the CPU (triton under the interpreter included): outputs and gradients.
    Empty experts occur (E=16 with 9 tokens), and zero tokens."""
    model = make(hidden=16, ffn=8, experts=experts, top_k=top_k, glu=glu, dtype=torch.float32)
    x = torch.randn(tokens, 16, generator=torch.Generator().manual_seed(tokens)).requires_grad_()
    grad = torch.randn(tokens, 16, generator=torch.Generator().manual_seed(1))
    for backend in _fp32_cpu_backends():
        with megablocks_core.use_backend(backend):
            got_out = model(x)[0]
            got = torch.autograd.grad((got_out * grad).sum(), [x, *params(model)[1:]])
            want_out = _composed_layer(model, x)
            want = torch.autograd.grad((want_out * grad).sum(), [x, *params(model)[1:]])
        torch.testing.assert_close(got_out, want_out, rtol=1e-5, atol=1e-5, msg=backend)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=backend)


@pytest.mark.parametrize(
    ("glu", "activation", "most"),
    [(False, "gelu", 1), (False, "silu", 1), (False, torch.tanh, 2), (True, "silu", 2)],
    ids=["mlp-gelu", "mlp-silu", "mlp-callable", "swiglu"],
)
def test_forward_keeps_no_token_times_top_k_hidden_tensor(glu, activation, most):
    """What the forward saves for backward: no (tokens * top_k, hidden) tensor at all, and at most
    ``most`` (tokens * top_k, ffn) ones' worth whatever top_k is: one for MLP experts with a
    named activation (gmm_scatter applies it and keeps its input), two with a callable, two for
    GLU (gmm_scatter applies act(gate) * up and keeps its (tokens * top_k, 2 * ffn) input)."""
    tokens, hidden, ffn, top_k = 10, 24, 6, 4
    model = make(
        hidden=hidden,
        ffn=ffn,
        experts=8,
        top_k=top_k,
        glu=glu,
        activation=activation,
        dtype=torch.float32,
    )
    x = torch.randn(tokens, hidden, requires_grad=True)
    shapes: list[tuple[int, ...]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, _ = model(x)
    rows = tokens * top_k
    assert (rows, hidden) not in shapes, shapes
    assert shapes.count((rows, ffn)) + 2 * shapes.count((rows, 2 * ffn)) == most, shapes
    out.sum().backward()  # and the backward works from what was kept
    assert model.w1.grad is not None and x.grad is not None


def test_empty_experts_and_normalized_weights():
    model = make(experts=16, top_k=2, glu=True, normalize_expert_weights=1.0)
    x = torch.randn(
        3, 8, dtype=torch.float64, requires_grad=True
    )  # 6 rows: at least 10 experts empty
    out, aux = model(x)
    want_out, want_aux = loop_reference(model, x)
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(aux, want_aux)
    out.sum().backward()
    used = set(torch.topk(x.detach() @ model.router.detach().T, 2).indices.flatten().tolist())
    for e in set(range(16)) - used:  # an expert with no tokens gets exactly zero gradient
        assert not model.w1.grad[e].any() and not model.w2.grad[e].any()


def test_zero_tokens():
    model = make(glu=True)
    x = torch.zeros(0, 8, dtype=torch.float64, requires_grad=True)
    out, aux = model(x)
    assert out.shape == (0, 8) and float(aux) == 0.0
    (out.sum() + aux).backward()
    assert x.grad.shape == (0, 8) and not model.w1.grad.any()


def test_bf16_close_to_fp32():
    bf16 = make(hidden=16, ffn=32, glu=True, dtype=torch.bfloat16)
    fp32 = make(hidden=16, ffn=32, glu=True, dtype=torch.float32)
    fp32.load_state_dict(bf16.state_dict())  # the same (bf16-representable) values: same routing
    x = torch.randn(32, 16).bfloat16()
    got, got_aux = bf16(x)
    want, want_aux = fp32(x.float())
    assert got.dtype == torch.bfloat16 and got_aux.dtype == torch.float32
    assert float((got.detach().float() - want).norm() / want.norm()) < 2e-2, (
        "bf16 output far from fp32"
    )
    torch.testing.assert_close(got_aux, want_aux)


def test_load_balancing_loss_formula():
    # Perfect balance with uniform probabilities gives exactly the coefficient (Switch Transformer).
    probs = torch.full((8, 4), 0.25)
    assert float(
        load_balancing_loss(torch.tensor([4, 4, 4, 4], dtype=torch.int32), probs, 2, 0.1)
    ) == pytest.approx(0.1)
    # MegaBlocks: scale = E * w / (layers * tokens * top_k); loss = scale * dot(counts, mean(scores)).
    probs = torch.softmax(torch.randn(6, 3), dim=-1)
    counts = torch.tensor([5, 0, 7], dtype=torch.int32)
    want = 3 * 0.01 / (1 * 6 * 2) * torch.dot(counts.float(), probs.mean(dim=0))
    torch.testing.assert_close(load_balancing_loss(counts, probs, 2, 0.01), want)


def test_train_and_eval_modes():
    model = make(glu=True, load_balancing_loss_coefficient=0.1)
    x = torch.randn(10, 8, dtype=torch.float64)
    train_out, train_aux = model(x)
    assert float(train_aux) > 0 and train_aux.requires_grad
    model.eval()
    eval_out, eval_aux = model(x)
    torch.testing.assert_close(eval_out, train_out)
    assert float(eval_aux) == 0.0
    model.train()
    model.load_balancing_loss_coefficient = 0.0
    assert float(model(x)[1]) == 0.0


@pytest.mark.parametrize("normalize", [None, 1.0])
def test_inference_routing_equals_training_routing(normalize):
    """Without grad the router takes ops.router_topk's softmax weights; with grad it gathers them
    from the probabilities: the same experts and weights either way."""
    model = make(experts=8, top_k=3, glu=True, normalize_expert_weights=normalize)
    x = torch.randn(12, 8, dtype=torch.float64)
    with_grad, _ = model(x)
    with torch.no_grad():
        without, _ = model(x)
        probs, weights, experts = model.route(x)
    torch.testing.assert_close(without, with_grad.detach())
    want_w, want_e = torch.topk(torch.softmax(x @ model.router.detach().T, -1), 3)
    if normalize is not None:
        want_w = want_w / want_w.norm(p=normalize, dim=-1, keepdim=True)
    assert experts.dtype == torch.int32 and torch.equal(experts.long(), want_e)
    torch.testing.assert_close(weights, want_w)
    torch.testing.assert_close(probs, torch.softmax(x @ model.router.detach().T, -1))


def test_router_ties_take_the_lower_expert_first():
    model = make(experts=6, top_k=2)
    with torch.no_grad():
        model.router.zero_()  # every logit equal
    x = torch.randn(4, 8, dtype=torch.float64)
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            _, weights, experts = model.route(x)
        assert experts.tolist() == [[0, 1]] * 4
        torch.testing.assert_close(weights.detach(), torch.full((4, 2), 1 / 6, dtype=torch.float64))


def test_bf16_layer_keeps_float32_router_weights():
    model = make(hidden=16, ffn=32, dtype=torch.bfloat16)
    probs, weights, _ = model.route(torch.randn(5, 16).bfloat16())
    assert probs.dtype == weights.dtype == torch.float32


def test_initialisation_is_seeded_and_scaled():
    a, b, c = (DroplessMoE(MoEConfig(64, 128, 8, 2, glu=True, seed=s)) for s in (3, 3, 4))
    for pa, pb, pc in zip(a.parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(pa, pb) and not torch.equal(pa, pc)
    assert float(a.w1.std()) == pytest.approx(0.02, rel=0.05)
    assert dMoE is DroplessMoE
    with pytest.raises(ValueError, match="top_k"):
        DroplessMoE(MoEConfig(8, 8, 4, 5))


def test_initialisation_draws_one_expert_at_a_time(monkeypatch):
    """A full (experts, hidden, ffn) float32 draw is 15 GB at DeepSeek-V3's widths: the layer
    draws each expert on its own, from a seed that depends on the expert's id alone, so the
    experts of the MLP and gated layers with one seed agree and differ from one another."""
    sizes = []
    randn = torch.randn
    monkeypatch.setattr(torch, "randn", lambda *a, **k: sizes.append(a[0]) or randn(*a, **k))
    mlp = DroplessMoE(MoEConfig(64, 128, 8, 2, seed=3))
    assert max(torch.Size(s).numel() for s in sizes) == 64 * 128  # the router's or one expert's
    assert len(sizes) == 1 + 2 * 8
    monkeypatch.undo()
    glu = DroplessMoE(MoEConfig(64, 128, 8, 2, glu=True, seed=3))
    assert torch.equal(mlp.w1, glu.w1[..., :128]) and torch.equal(mlp.w2, glu.w2)
    assert torch.equal(mlp.router, glu.router)
    flat = [m.flatten() for p in (glu.w1[..., :128], glu.w1[..., 128:], glu.w2) for m in p]
    assert len({tuple(m[:4].tolist()) for m in flat}) == len(flat)  # no two share a stream
    # The seeds mix seed, matrix and expert: neighbouring triples give unrelated seeds.
    seeds = {expert_seed(s, m, e) for s in range(3) for m in range(3) for e in range(64)}
    assert len(seeds) == 3 * 3 * 64 and all(0 <= x < 2**63 for x in seeds)


def test_meta_layer_draws_nothing_and_loads_values_after_to_empty(monkeypatch):
    drawn = []
    randn = torch.randn
    monkeypatch.setattr(torch, "randn", lambda *a, **k: drawn.append(a) or randn(*a, **k))
    layer = DroplessMoE(MoEConfig(64, 128, 8, 2, glu=True, seed=3, device="meta"))
    assert drawn == [] and all(p.is_meta for p in layer.parameters())
    monkeypatch.undo()
    reference = DroplessMoE(MoEConfig(64, 128, 8, 2, glu=True, seed=3))
    layer.to_empty(device="cpu")
    layer.load_state_dict(reference.state_dict())
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(layer(x)[0], reference(x)[0], rtol=0, atol=0)


def _compile_inputs(device="cpu", dtype=torch.float32):
    model = make(
        hidden=16,
        ffn=24,
        experts=4,
        top_k=2,
        glu=True,
        dtype=dtype,
        device=device,
        load_balancing_loss_coefficient=0.1,
    )
    x = torch.randn(24, 16, generator=torch.Generator().manual_seed(2)).to(device, dtype)
    return model, x


def _step(fn, model, x):
    for p in model.parameters():
        p.grad = None
    x = x.detach().clone().requires_grad_()
    out, aux = fn(x)
    (out.float().square().sum() + aux).backward()
    return [out.detach(), aux.detach(), x.grad, *(p.grad for p in model.parameters())]


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph_matches_eager(backend):
    torch._dynamo.reset()
    model, x = _compile_inputs()
    want = _step(model, model, x)
    got = _step(torch.compile(model, fullgraph=True, backend=backend), model, x)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------
# Gradient-accumulation fusion (grad_accumulation_fusion=True)


def _expert_weights(model: DroplessMoE) -> list[torch.Tensor]:
    return [model.w1, model.w2]


def _micro_batches(model: DroplessMoE, steps: int, tokens: int = 12, compiled=None) -> None:
    """``steps`` forward + backward calls whose gradients accumulate (never zeroed)."""
    forward = model if compiled is None else compiled
    for step in range(steps):
        gen = torch.Generator().manual_seed(100 + step)
        x = torch.randn(tokens, model.hidden_size, generator=gen).to(model.w1.dtype)
        out, aux = forward(x.requires_grad_())
        grad = torch.randn(out.shape, generator=gen).to(out.dtype)
        ((out * grad).sum() + aux).backward()


def _twins(dtype, glu, fuse_permutation, **kw):
    """Two identical layers, the second with grad_accumulation_fusion."""
    args = dict(hidden=16, ffn=8, experts=8, top_k=2, glu=glu, dtype=dtype, **kw)
    plain = make(**args, fuse_permutation=fuse_permutation)
    fused = make(**args, fuse_permutation=fuse_permutation, grad_accumulation_fusion=True)
    fused.load_state_dict(plain.state_dict())
    assert fused.grad_accumulation_fusion and not plain.grad_accumulation_fusion
    return plain, fused


@pytest.mark.parametrize("fuse_permutation", [True, False], ids=["fused-ops", "unfused-ops"])
@pytest.mark.parametrize("glu", [False, True], ids=["mlp", "glu"])
@pytest.mark.parametrize(
    ("dtype", "tol"), [(torch.float32, 1e-5), (torch.float64, 1e-12)], ids=["fp32", "fp64"]
)
def test_grad_accumulation_fusion_gives_the_unfused_gradients(dtype, tol, glu, fuse_permutation):
    """Two forward + backward calls accumulating into .grad: with the fusion on, every parameter's
    gradient equals the plain layer's; the first call (no .grad yet) goes through autograd, the
    second adds the expert gradients in place (their gradient hooks see None then)."""
    backends = _fp32_cpu_backends() if dtype == torch.float32 else ["reference"]
    for backend in backends:
        plain, fused = _twins(dtype, glu, fuse_permutation)
        seen: list[bool] = []
        fused.w1.register_hook(seen.append)  # None once the gradient is added in place
        with megablocks_core.use_backend(backend):
            _micro_batches(plain, 1)
            _micro_batches(fused, 1)
            for p, q in zip(plain.parameters(), fused.parameters(), strict=True):
                torch.testing.assert_close(q.grad, p.grad, rtol=tol, atol=tol, msg=backend)
            _micro_batches(plain, 1)
            _micro_batches(fused, 1)
        for p, q in zip(plain.parameters(), fused.parameters(), strict=True):
            torch.testing.assert_close(q.grad, p.grad, rtol=tol, atol=tol, msg=backend)
        # The first call returned the gradient, the second added it in place.
        assert [g is not None for g in seen] == [True, False], backend


@pytest.mark.parametrize("fuse_permutation", [True, False], ids=["fused-ops", "unfused-ops"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grad_accumulation_fusion_into_float32_main_grad(dtype, fuse_permutation):
    """Megatron's convention: each expert weight's float32 main_grad gets the sum of every call's
    gradient (the first call's too), its .grad stays None; the router accumulates as usual."""
    plain, fused = _twins(dtype, True, fuse_permutation)
    for w in _expert_weights(fused):
        w.main_grad = torch.zeros(w.shape, dtype=torch.float32)
    want = {name: torch.zeros(w.shape, dtype=torch.float64) for name, w in plain.named_parameters()}
    for step in range(2):
        plain.zero_grad(set_to_none=True)
        gen = torch.Generator().manual_seed(100 + step)
        x = torch.randn(12, 16, generator=gen).to(dtype)
        for model in (plain, fused):
            out, aux = model(x.clone().requires_grad_())
            grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(step))
            ((out * grad.to(out.dtype)).sum() + aux).backward()
        for name, w in plain.named_parameters():
            want[name] += w.grad.double()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for name, w in fused.named_parameters():
        if name == "router":
            assert w.grad is not None and w.grad.dtype == dtype
            torch.testing.assert_close(w.grad.double(), want[name], rtol=tol, atol=tol)
        else:
            assert w.grad is None and w.grad_added_to_main_grad, name
            torch.testing.assert_close(w.main_grad.double(), want[name], rtol=tol, atol=tol)


def test_grad_accumulation_fusion_under_compile():
    """Compiled, the layer never fuses (the custom ops' autograd returns every gradient) and its
    accumulated gradients stay right."""
    torch._dynamo.reset()
    plain, fused = _twins(torch.float32, True, True)
    seen = []
    fused.w2.register_hook(lambda g: seen.append(g is not None))
    compiled = torch.compile(fused, fullgraph=True, backend="aot_eager")
    _micro_batches(plain, 2)
    _micro_batches(fused, 2, compiled=compiled)
    for p, q in zip(plain.parameters(), fused.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5)
    assert seen == [True, True]


def test_grad_accumulation_fusion_is_a_settable_bool():
    model = make(glu=True)
    assert model.grad_accumulation_fusion is False
    model.grad_accumulation_fusion = True
    assert all(megablocks_core.is_grad_accumulation_fused(w) for w in _expert_weights(model))
    assert not megablocks_core.is_grad_accumulation_fused(model.router)
    model.grad_accumulation_fusion = False
    assert not any(megablocks_core.is_grad_accumulation_fused(w) for w in _expert_weights(model))
    with pytest.raises(TypeError, match="grad_accumulation_fusion must be a bool"):
        DroplessMoE(MoEConfig(8, 8, 2, grad_accumulation_fusion=1))


def _hand_composed_moe(x, router, w1, w2, top_k):
    """A dropless MoE written with the routing primitives (sort, histogram, inclusive_cumsum) rather
    than ``ops.route``, exact GELU: the ops composed by hand, as a user of megablocks.ops would."""
    experts = w1.shape[0]
    probs = torch.softmax(x.float() @ router.float(), dim=-1)
    weights, top_experts = torch.topk(probs, top_k, dim=-1)
    weights, top_experts = weights.flatten().to(x.dtype), top_experts.flatten().int()
    bin_ids, indices = megablocks_core.ops.sort(top_experts, max((experts - 1).bit_length(), 1))
    tokens_per_expert = megablocks_core.ops.histogram(top_experts, experts)
    bins = megablocks_core.ops.inclusive_cumsum(tokens_per_expert, 0)
    rows = megablocks_core.ops.gather(x, indices, bin_ids, bins, top_k)
    hidden = F.gelu(megablocks_core.ops.gmm(rows, w1, tokens_per_expert))
    rows = megablocks_core.ops.gmm(hidden, w2, tokens_per_expert)
    return megablocks_core.ops.scatter(rows, indices, bin_ids, weights, bins, top_k)


def _hand_composed_loop(x, router, w1, w2, top_k):
    """The same layer token by token in float64, with no MoE op at all."""
    probs = torch.softmax(x @ router, dim=-1)
    weights, top_experts = torch.topk(probs, top_k, dim=-1)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(top_k):
            e = int(top_experts[t, k])
            out[t] += weights[t, k] * (F.gelu(x[t] @ w1[e]) @ w2[e])
    return out


@pytest.mark.parametrize(
    ("tokens", "experts", "top_k"), [(16, 4, 2), (64, 8, 2), (33, 5, 3), (8, 1, 1)]
)
def test_ops_composed_by_hand_match_a_float64_loop(tokens, experts, top_k):
    gen = torch.Generator().manual_seed(tokens * 31 + experts)
    hidden, ffn = 32, 48
    x = torch.randn(tokens, hidden, generator=gen, requires_grad=True)
    router = torch.randn(hidden, experts, generator=gen)
    w1 = (torch.randn(experts, hidden, ffn, generator=gen) / hidden**0.5).requires_grad_()
    w2 = (torch.randn(experts, ffn, hidden, generator=gen) / ffn**0.5).requires_grad_()
    out = _hand_composed_moe(x, router, w1, w2, top_k)
    out.square().sum().backward()

    x64, w1_64, w2_64 = (t.detach().double().requires_grad_() for t in (x, w1, w2))
    want = _hand_composed_loop(x64, router.double(), w1_64, w2_64, top_k)
    want.square().sum().backward()

    def relative_error(got, expected):
        return float((got.double() - expected).norm() / expected.norm().clamp_min(1e-30))

    for name, got, expected in [
        ("output", out.detach(), want.detach()),
        ("grad x", x.grad, x64.grad),
        ("grad w1", w1.grad, w1_64.grad),
        ("grad w2", w2.grad, w2_64.grad),
    ]:
        assert relative_error(got, expected) <= 1e-5, name


def test_demo_trains(capsys):
    assert cli.main(["demo", "--steps", "20"]) == 0
    text = capsys.readouterr().out
    assert "step   20/20" in text and "ok, the loss fell" in text
    served = text.split("backends that served each op:")[1]
    assert any(line.split()[:1] == ["gmm"] and "reference" in line for line in served.splitlines())


# --- GPU: sync-free and CUDA graphs (run on the H200; skipped without CUDA) ---------------------


def _gpu_model(dtype=torch.bfloat16):
    model = DroplessMoE(
        MoEConfig(
            256,
            512,
            8,
            2,
            glu=True,
            dtype=dtype,
            device="cuda",
            load_balancing_loss_coefficient=0.01,
        )
    )
    x = torch.randn(1024, 256, device="cuda", dtype=dtype)
    return model, x


def _loss(model, x):
    out, aux = model(x)
    return out.float().square().mean() + aux


@cuda
def test_cuda_forward_backward_is_sync_free():
    with (
        megablocks_core.use_backend()
    ):  # the normal ranking (the reference gmm reads counts on the host)
        model, x = _gpu_model()
        x.requires_grad_()
        _loss(model, x).backward()  # first calls rank and cache the kernels
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            _loss(model, x).backward()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()


@cuda
def test_cuda_grad_accumulation_fusion_is_sync_free_and_right():
    """On the GPU (triton's fused gmm_weight_grad_accumulate): the fused micro-batch makes no host
    sync, .grad matches the unfused layer's, and a float32 main_grad gets the sum."""
    with megablocks_core.use_backend():
        plain, x = _gpu_model()
        fused = copy.deepcopy(plain)
        fused.grad_accumulation_fusion = True
        main = copy.deepcopy(plain)
        main.grad_accumulation_fusion = True
        for w in _expert_weights(main):
            w.main_grad = torch.zeros(w.shape, dtype=torch.float32, device="cuda")
        for model in (plain, fused, main):
            _loss(model, x).backward()  # the first micro-batch: allocates .grad, ranks kernels
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            _loss(fused, x).backward()  # the expert gradients added in place
        finally:
            torch.cuda.set_sync_debug_mode(0)
        for model in (plain, main):
            _loss(model, x).backward()

    def relative_error(got, want):  # the gradients are small (a mean loss): compare by norm
        return float((got.double() - want.double()).norm() / want.double().norm())

    for p, q in zip(plain.parameters(), fused.parameters(), strict=True):
        assert relative_error(q.grad, p.grad) < 1e-2
    for p, q in zip(_expert_weights(plain), _expert_weights(main), strict=True):
        assert q.grad is None and relative_error(q.main_grad, p.grad) < 1e-2


@cuda
def test_cuda_compile_fullgraph_matches_eager():
    torch._dynamo.reset()
    with megablocks_core.use_backend():
        model, x = _compile_inputs("cuda", torch.bfloat16)
        want = _step(model, model, x)
        got = _step(torch.compile(model, fullgraph=True), model, x)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-2)


def test_gelu_default_is_tanh_approximation():
    x = torch.linspace(-3, 3, 7)
    torch.testing.assert_close(
        DroplessMoE(MoEConfig(4, 4, 2)).activation(x), F.gelu(x, approximate="tanh")
    )


def test_gated_layer_loads_gate_and_up_saved_apart():
    """A state dict with w1 and v1 of (E, hidden, ffn) each (MegaBlocks' layout) loads into the
    joined w1 = [w1 | v1], and the layer then computes the loop reference of those matrices."""
    model = make(glu=True)
    ffn = model.ffn_hidden_size
    gate = torch.randn(8, 8, ffn, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    up = torch.randn(8, 8, ffn, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    apart = {**model.state_dict(), "w1": gate, "v1": up}
    model.load_state_dict(apart)
    assert torch.equal(model.w1[..., :ffn], gate) and torch.equal(model.w1[..., ffn:], up)
    assert "v1" in apart  # the caller's dict is left as it was
    x = torch.randn(5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(model(x)[0], loop_reference(model, x)[0])
    with pytest.raises(RuntimeError, match="v1"):  # an MLP layer has no up projection
        make().load_state_dict({**make().state_dict(), "v1": up})


@pytest.mark.parametrize("wrong", ["w1", "v1"])
def test_gate_and_up_saved_apart_with_a_wrong_width_blame_the_wrong_one(wrong):
    model = make(glu=True)
    ffn = model.ffn_hidden_size
    halves = {"w1": torch.zeros(8, 8, ffn, dtype=torch.float64)}
    halves["v1"] = halves["w1"].clone()
    halves[wrong] = torch.zeros(8, 8, ffn + 1, dtype=torch.float64)
    with pytest.raises(RuntimeError) as info:
        model.load_state_dict({**model.state_dict(), **halves})
    message = str(info.value)
    assert f"size mismatch for {wrong}: copying a param with shape (8, 8, {ffn + 1})" in message
    assert f"saved apart are each (8, 8, {ffn}) here" in message
    right = "v1" if wrong == "w1" else "w1"
    assert f"for {right}" not in message and "Missing" not in message, message
    assert "Unexpected" not in message, message
    # strict=False reports it too (a size mismatch is never skipped), and loads nothing
    before = model.w1.detach().clone()
    with pytest.raises(RuntimeError, match=f"size mismatch for {wrong}"):
        model.load_state_dict({**model.state_dict(), **halves}, strict=False)
    assert torch.equal(model.w1, before)
