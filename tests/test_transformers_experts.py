"""experts_implementation="megablocks" in Hugging Face transformers against its eager experts.

Tiny random configs of each MoE family (built from config classes: no hub access). The Experts
module alone is compared in float64 on the reference backend (outputs and every gradient, to
1e-12) and in float32 on the Triton kernels (the conformance kit's float32 tolerance); a whole
causal LM is compared on logits, loss, the router aux loss and one optimizer step, through
save_pretrained/from_pretrained and torch.compile.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
from triton_interpreter import interpreting

transformers = pytest.importorskip("transformers")

import megablocks_core  # noqa: E402
from megablocks_core.integrations import transformers as hf  # noqa: E402
from megablocks_core.testing.kit import TOLERANCES  # noqa: E402

#: Where the Triton cases run: the CPU under the interpreter, else the GPU test device.
TRITON_DEVICE = torch.device(
    os.environ.get("MEGABLOCKS_TRITON_TEST_DEVICE", "cpu" if interpreting() else "cuda")
)


def _triton_runnable() -> bool:
    return interpreting() if TRITON_DEVICE.type == "cpu" else torch.cuda.is_available()


needs_triton = pytest.mark.skipif(
    not _triton_runnable(), reason=f"Triton kernels on {TRITON_DEVICE} cannot run here"
)


def _on_device(experts: torch.nn.Module, args: tuple, backend: str) -> tuple:
    """The module and its call's tensors where ``backend``'s kernels run."""
    device = TRITON_DEVICE if backend == "triton" else torch.device("cpu")
    return experts.to(device), tuple(a.to(device) for a in args)


SMALL = {"hidden_size": 16, "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 48}


def _configs() -> dict[str, Callable[..., Any]]:
    t = transformers
    return {
        "mixtral": lambda **kw: t.MixtralConfig(
            **SMALL, **kw, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2
        ),
        "qwen2_moe": lambda **kw: t.Qwen2MoeConfig(
            **SMALL,
            **kw,
            intermediate_size=32,
            moe_intermediate_size=12,
            shared_expert_intermediate_size=20,
            num_experts=6,
            num_experts_per_tok=2,
        ),
        "qwen3_moe": lambda **kw: t.Qwen3MoeConfig(
            **SMALL,
            **kw,
            head_dim=8,
            intermediate_size=32,
            moe_intermediate_size=12,
            num_experts=6,
            num_experts_per_tok=3,
            norm_topk_prob=True,
        ),
        "olmoe": lambda **kw: t.OlmoeConfig(
            **SMALL, **kw, intermediate_size=20, num_experts=5, num_experts_per_tok=2
        ),
        "deepseek_v3": lambda **kw: t.DeepseekV3Config(
            **SMALL,
            **kw,
            intermediate_size=32,
            moe_intermediate_size=12,
            n_routed_experts=8,
            n_shared_experts=1,
            n_group=2,
            topk_group=1,
            num_experts_per_tok=2,
            first_k_dense_replace=0,
            q_lora_rank=None,
            kv_lora_rank=8,
            qk_rope_head_dim=4,
            qk_nope_head_dim=4,
            v_head_dim=8,
        ),
        # Interleaved gate/up, (in, out) weights, biases and the clamped SwiGLU.
        "gpt_oss": lambda **kw: t.GptOssConfig(
            **SMALL,
            **kw,
            head_dim=8,
            intermediate_size=12,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention"][: kw.get("num_hidden_layers", 2)],
        ),
    }


FAMILIES = tuple(_configs())


def _config(family: str, layers: int = 1, implementation: str = "eager") -> Any:
    config = _configs()[family](num_hidden_layers=layers)
    config._experts_implementation = implementation
    return config


def _experts_of(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if hasattr(m, "has_gate") and hasattr(m, "down_proj")]


def _experts(family: str, dtype: torch.dtype) -> torch.nn.Module:
    model = transformers.AutoModelForCausalLM.from_config(_config(family))
    (experts,) = _experts_of(model)
    experts = experts.to(dtype)
    generator = torch.Generator().manual_seed(0)
    # Wide enough that GPT-OSS's clamps (at 7) cut some gate and up values.
    std = 2.0 if family == "gpt_oss" else 0.5
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=generator, dtype=dtype) * std)
    return experts


def _routing(experts: torch.nn.Module, tokens: int, top_k: int, dtype: torch.dtype) -> tuple:
    generator = torch.Generator().manual_seed(1)
    num_experts = experts.num_experts
    ids = torch.stack(
        [torch.randperm(num_experts, generator=generator)[:top_k] for _ in range(tokens)]
    )
    hidden = experts.down_proj.shape[1] if not experts.is_transposed else experts.down_proj.shape[2]
    x = torch.randn(tokens, hidden, generator=generator, dtype=dtype)
    weights = torch.rand(tokens, top_k, generator=generator, dtype=dtype)
    return x, ids, weights


def _run(experts: torch.nn.Module, implementation: str, x, ids, weights) -> list[torch.Tensor]:
    """The output, then the gradients of x, the routing weights and every parameter."""
    experts.config._experts_implementation = implementation
    x = x.clone().requires_grad_()
    weights = weights.clone().requires_grad_()
    experts.zero_grad(set_to_none=True)
    out = experts(x, ids, weights)
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=out.dtype)
    probe = probe.to(out.device)
    (out * probe).sum().backward()
    grads = [x.grad, weights.grad] + [p.grad for p in experts.parameters()]
    return [out.detach()] + [g.clone() for g in grads]


def _close(got: list[torch.Tensor], want: list[torch.Tensor], tol: float) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        scale = max(1.0, w.abs().max().item())
        torch.testing.assert_close(
            g, w, rtol=tol, atol=tol * scale, msg=lambda m, i=i: f"[{i}] {m}"
        )


@pytest.mark.parametrize("family", FAMILIES)
def test_experts_match_eager_float64_reference(family: str) -> None:
    experts = _experts(family, torch.float64)
    args = _routing(
        experts, tokens=13, top_k=experts.config.num_experts_per_tok, dtype=torch.float64
    )
    want = _run(experts, "eager", *args)
    with megablocks_core.use_backend("reference"):
        got = _run(experts, hf.IMPLEMENTATION, *args)
    _close(got, want, 1e-12)


@needs_triton
@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3", "gpt_oss"])
def test_experts_match_eager_float32_triton(family: str) -> None:
    experts = _experts(family, torch.float32)
    args = _routing(experts, tokens=9, top_k=2, dtype=torch.float32)
    experts, args = _on_device(experts, args, "triton")
    want = _run(experts, "eager", *args)
    with megablocks_core.use_backend("triton"):
        got = _run(experts, hf.IMPLEMENTATION, *args)
    _close(got, want, TOLERANCES[torch.float32])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host syncs exist only with a GPU")
@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe", "mixtral", "gpt_oss"])
def test_experts_step_makes_no_host_sync_on_the_gpu(family: str) -> None:
    """The experts' forward and backward through "megablocks" never waits for the GPU (a sync
    would leave the GPU idle while Python catches up, most visible at small batches)."""
    experts = _experts(family, torch.bfloat16).cuda()
    x, ids, weights = (
        t.cuda() for t in _routing(experts, 256, experts.config.num_experts_per_tok, torch.bfloat16)
    )
    x.requires_grad_()
    weights.requires_grad_()
    experts.config._experts_implementation = hf.IMPLEMENTATION
    grad = torch.randn(x.shape, device="cuda", dtype=x.dtype)

    def step() -> None:
        experts(x, ids, weights).backward(grad)

    step()  # warm up: kernel choice and compilation once per call shape
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="needs a GPU with FP8 matrix units",
)
@pytest.mark.parametrize("fmt", ["fp8_rowwise", "fp8_blockwise"])
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_use_fp8_on_the_gpu_matches_the_reference_without_host_syncs(family: str, fmt: str) -> None:
    """use_fp8 on the GPU's own kernels: output and every gradient as the reference backend's
    FP8 computes them (the same quantization; the sums' order differs), within FP8's error of
    transformers' eager experts in float32, and a bf16 step that never waits for the GPU."""
    experts = _experts(family, torch.float32).cuda()
    top_k = experts.config.num_experts_per_tok
    args = [t.cuda() for t in _routing(experts, 256, top_k, torch.float32)]
    eager = _run(experts, "eager", *args)
    assert hf.use_fp8(experts, fmt) == 1
    with megablocks_core.use_backend("reference"):
        reference = _run(experts, hf.IMPLEMENTATION, *args)
    with megablocks_core.use_backend("triton"):
        got = _run(experts, hf.IMPLEMENTATION, *args)

        def rel(a: list[torch.Tensor], b: list[torch.Tensor]) -> list[float]:
            return [float((x - y).norm() / y.norm()) for x, y in zip(a, b, strict=True)]

        # A code rounded the other way after a reordered sum moves one element by an FP8 step.
        assert max(rel(got, reference)) < 1e-2, rel(got, reference)
        # GPT-OSS's clamps (inputs of std 2 reach them) turn FP8's error into a flipped clamp.
        assert max(rel(got, eager)) < (0.25 if family == "gpt_oss" else 0.15), rel(got, eager)
        experts.to(torch.bfloat16)
        x, ids, weights = (t.to(torch.bfloat16) if t.is_floating_point() else t for t in args)
        x.requires_grad_()
        weights.requires_grad_()
        grad = torch.randn(x.shape, device="cuda", dtype=x.dtype)
        experts(x, ids, weights).backward(grad)  # warm up: kernel choice and compilation
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            experts(x, ids, weights).backward(grad)
        finally:
            torch.cuda.set_sync_debug_mode(0)


@pytest.mark.parametrize("hidden_act", ["gelu", "gelu_pytorch_tanh", "relu"])
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_gated_gelu_and_relu_experts(hidden_act: str, backend: str) -> None:
    """transformers' "gelu" is the exact (erf) GELU, served as "geglu_erf"; its tanh forms as
    "geglu_tanh"."""
    dtype = torch.float64 if backend == "reference" else torch.float32
    model = transformers.AutoModelForCausalLM.from_config(
        _configs()["mixtral"](num_hidden_layers=1, hidden_act=hidden_act)
    )
    (experts,) = _experts_of(model)
    experts = experts.to(dtype)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.5, generator=torch.Generator().manual_seed(0))
    args = _routing(experts, tokens=9, top_k=2, dtype=dtype)
    if backend == "triton" and not _triton_runnable():
        pytest.skip(f"Triton kernels on {TRITON_DEVICE} cannot run here")
    experts, args = _on_device(experts, args, backend)
    want = _run(experts, "eager", *args)
    with megablocks_core.use_backend(backend):
        got = _run(experts, hf.IMPLEMENTATION, *args)
    _close(got, want, 1e-12 if dtype == torch.float64 else TOLERANCES[dtype])


def _plain_experts_class() -> type[torch.nn.Module]:
    """Experts without a gate, with biases, weights stored (in, out): a layout none of the six
    families uses, with its eager forward a per-token loop."""
    from transformers.activations import ACT2FN
    from transformers.integrations.moe import use_experts_implementation

    @use_experts_implementation(has_gate=False, is_transposed=True, has_bias=True)
    class PlainExperts(torch.nn.Module):
        def __init__(self, config: Any) -> None:
            super().__init__()
            self.num_experts, hidden, ffn = 4, 8, 6

            def param(*shape: int) -> torch.nn.Parameter:
                return torch.nn.Parameter(torch.randn(*shape, dtype=torch.float64))

            self.up_proj, self.up_proj_bias = param(4, hidden, ffn), param(4, ffn)
            self.down_proj, self.down_proj_bias = param(4, ffn, hidden), param(4, hidden)
            self.act_fn = ACT2FN["gelu"]

        def forward(
            self,
            hidden_states: torch.Tensor,
            top_k_index: torch.Tensor,
            top_k_weights: torch.Tensor,
        ) -> torch.Tensor:
            rows = []
            for t in range(hidden_states.shape[0]):
                acc = torch.zeros_like(hidden_states[t])
                for k in range(top_k_index.shape[1]):
                    e = int(top_k_index[t, k])
                    h = self.act_fn(hidden_states[t] @ self.up_proj[e] + self.up_proj_bias[e])
                    out = h @ self.down_proj[e] + self.down_proj_bias[e]
                    acc = acc + top_k_weights[t, k] * out
                rows.append(acc)
            return torch.stack(rows)

    return PlainExperts


def _gpt_oss_with_constants(dtype: torch.dtype, alpha: float, limit: float) -> torch.nn.Module:
    """GPT-OSS's experts built from a config with its own swiglu_alpha and swiglu_limit."""
    model = transformers.AutoModelForCausalLM.from_config(
        _configs()["gpt_oss"](num_hidden_layers=1, swiglu_alpha=alpha, swiglu_limit=limit)
    )
    (experts,) = _experts_of(model)
    experts = experts.to(dtype)
    assert (experts.alpha, experts.limit) == (alpha, limit)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=generator, dtype=dtype))
    return experts


@pytest.mark.parametrize(
    ("backend", "dtype"), [("reference", torch.float64), ("triton", torch.float32)]
)
@pytest.mark.parametrize(("alpha", "limit"), [(1.3, 2.5), (2.0, 1.0)])
def test_gpt_oss_with_its_own_alpha_and_limit_matches_eager(
    backend: str, dtype: torch.dtype, alpha: float, limit: float
) -> None:
    """The clamped SwiGLU's constants come from the model's config (swiglu_alpha,
    swiglu_limit), with the clamps active: values and every gradient equal transformers' eager
    experts."""
    if backend == "triton" and not _triton_runnable():
        pytest.skip(f"Triton kernels on {TRITON_DEVICE} cannot run here")
    experts = _gpt_oss_with_constants(dtype, alpha, limit)
    layout = hf.layout_of(experts)
    assert (layout.alpha, layout.limit) == (alpha, limit)
    args = _routing(experts, tokens=9, top_k=2, dtype=dtype)
    with torch.no_grad():  # the clamps cut: some first-GEMM outputs lie past the limit
        x, ids, _ = args
        gate_up = torch.einsum("th,thf->tf", x, experts.gate_up_proj[ids[:, 0]])
        assert (gate_up.abs() > limit).float().mean() > 0.1
    experts, args = _on_device(experts, args, backend)
    want = _run(experts, "eager", *args)
    with megablocks_core.use_backend(backend):
        got = _run(experts, hf.IMPLEMENTATION, *args)
    _close(got, want, 1e-12 if dtype == torch.float64 else TOLERANCES[dtype])
    # and they matter: the defaults give another result
    default = _gpt_oss_with_constants(dtype, 1.702, 7.0)
    default.load_state_dict(experts.state_dict())
    default, _ = _on_device(default, (), backend)
    with megablocks_core.use_backend(backend):
        other = _run(default, hf.IMPLEMENTATION, *args)
    assert not torch.allclose(other[0], want[0], rtol=1e-3, atol=1e-3)


def test_experts_without_a_gate_with_biases_stored_in_out() -> None:
    torch.manual_seed(0)
    config = transformers.PretrainedConfig()
    experts = _plain_experts_class()(config)
    assert hf.layout_of(experts).activation == "gelu_erf"
    args = _routing(experts, tokens=7, top_k=2, dtype=torch.float64)
    want = _run(experts, "eager", *args)
    got = _run(experts, hf.IMPLEMENTATION, *args)
    _close(got, want, 1e-12)


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_a_swapped_gate_and_up_fails(family: str) -> None:
    """The comparison above can fail: serving [up | gate] as [gate | up] (Mixtral), or odd
    columns as even ones (GPT-OSS), is caught."""
    experts = _experts(family, torch.float64)
    args = _routing(experts, tokens=7, top_k=2, dtype=torch.float64)
    want = _run(experts, "eager", *args)
    with torch.no_grad():
        w = experts.gate_up_proj
        if family == "gpt_oss":  # (E, H, 2F), gate in even columns
            swapped = w.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
        else:  # (E, 2F, H), [gate | up] rows
            gate, up = w.chunk(2, dim=1)
            swapped = torch.cat([up, gate], dim=1)
        w.copy_(swapped)
    got = _run(experts, hf.IMPLEMENTATION, *args)
    with pytest.raises(AssertionError):
        _close(got, want, 1e-6)


def test_gpt_oss_keeps_only_the_first_gemm_output_for_backward() -> None:
    """The fused path: gmm_scatter applies GPT-OSS's interleaved clamped SwiGLU itself, and no
    activated (pairs, intermediate) tensor is kept for backward, only the (pairs, 2 *
    intermediate) first GEMM output."""
    experts = _experts("gpt_oss", torch.float64)
    x, ids, weights = _routing(experts, tokens=5, top_k=2, dtype=torch.float64)
    experts.config._experts_implementation = hf.IMPLEMENTATION
    assert hf.layout_of(experts).activation == "swiglu_oai_interleaved"
    saved: list[tuple[int, ...]] = []

    def keep(t: torch.Tensor) -> torch.Tensor:
        saved.append(tuple(t.shape))
        return t

    ffn = experts.intermediate_size
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        experts(x.requires_grad_(), ids, weights).sum().backward()
    assert (10, 2 * ffn) in saved
    assert (10, ffn) not in saved


def test_expert_parallel_ids_of_other_ranks_are_skipped() -> None:
    """Ids >= num_experts (experts on other ranks, zero weight) contribute nothing and get no
    GEMM (transformers' expert-parallel convention)."""
    experts = _experts("mixtral", torch.float64)
    x, ids, weights = _routing(experts, tokens=8, top_k=2, dtype=torch.float64)
    foreign = torch.zeros_like(ids, dtype=torch.bool)
    foreign[::3, 1] = True
    ids = ids.masked_fill(foreign, experts.num_experts)
    weights = weights.masked_fill(foreign, 0.0)
    experts._is_expert_parallel = True
    want = _run(experts, "eager", x, ids, weights)
    got = _run(experts, hf.IMPLEMENTATION, x, ids, weights)
    _close(got[:1], want[:1], 1e-12)
    _close(got[3:], want[3:], 1e-12)  # the parameters' gradients


def _lm(family: str, implementation: str, dtype: torch.dtype = torch.float64) -> Any:
    torch.manual_seed(0)
    config = _config(family, layers=2, implementation=implementation)
    config.output_router_logits = True
    config.router_aux_loss_coef = 0.1
    return transformers.AutoModelForCausalLM.from_config(config).to(dtype)


def _batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, SMALL["vocab_size"], (2, 7), generator=torch.Generator().manual_seed(3))
    return {"input_ids": ids, "labels": ids}


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_causal_lm_logits_loss_aux_loss_and_a_step(family: str) -> None:
    results = {}
    for implementation in ("eager", hf.IMPLEMENTATION):
        model = _lm(family, implementation)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        out = model(**_batch())
        out.loss.backward()
        optimizer.step()
        aux = getattr(out, "aux_loss", None)
        params = [p.detach().clone() for p in model.parameters()]
        results[implementation] = (out.logits.detach(), out.loss.detach(), aux, params)
    want, got = results["eager"], results[hf.IMPLEMENTATION]
    torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got[1], want[1], rtol=1e-12, atol=1e-12)
    if family != "deepseek_v3":  # DeepSeek-V3's model computes no aux loss
        assert want[2] is not None
        torch.testing.assert_close(got[2], want[2], rtol=1e-12, atol=1e-12)
    for g, w in zip(got[3], want[3], strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_fused_grad_accumulation_gives_autograds_accumulated_gradients(family: str) -> None:
    """Two micro-batches with the expert weights opted in: every gradient equals the one
    autograd accumulates (the first micro-batch takes the normal path, the second the fused
    one); opting out again restores autograd's accumulation."""
    grads = {}
    for fused in (False, True):
        model = _lm(family, hf.IMPLEMENTATION)
        marked = hf.fuse_grad_accumulation(model, enabled=fused)
        assert marked == 2  # two decoder layers, one Experts module each
        weights = [w for m in hf.experts_modules(model) for w in (m.down_proj,)]
        assert all(megablocks_core.is_grad_accumulation_fused(w) == fused for w in weights)
        seen: list[bool] = []  # whether autograd handed the weight a gradient (fused: None)
        weights[0].register_hook(lambda g, seen=seen: seen.append(g is not None))
        for seed in (3, 4):
            ids = torch.randint(
                0, SMALL["vocab_size"], (2, 7), generator=torch.Generator().manual_seed(seed)
            )
            model(input_ids=ids, labels=ids).loss.backward()
        assert seen == [True, not fused]  # the second micro-batch was added by the GEMM
        grads[fused] = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        hf.fuse_grad_accumulation(model, enabled=False)
        assert not any(megablocks_core.is_grad_accumulation_fused(w) for w in weights)
    assert len(grads[True]) == len(grads[False])
    for got, want in zip(grads[True], grads[False], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_save_and_load_with_the_implementation(tmp_path: Any) -> None:
    model = _lm("qwen2_moe", "eager")
    batch = _batch()
    want = model(**batch).logits
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, experts_implementation=hf.IMPLEMENTATION, dtype=torch.float64
    )
    assert loaded.config._experts_implementation == hf.IMPLEMENTATION
    torch.testing.assert_close(loaded(**batch).logits, want, rtol=1e-12, atol=1e-12)


@pytest.mark.skipif(
    tuple(int(p) for p in torch.__version__.split(".")[:2]) < (2, 13),
    reason="transformers 5.24's forward does not trace under torch < 2.13's dynamo (seen with "
    "2.11: 'Bad import result' inside transformers' own code)",
)
def test_torch_compile_of_a_model_forward() -> None:
    model = _lm("olmoe", hf.IMPLEMENTATION, torch.float32)
    batch = _batch()
    want = model(**batch).logits
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(**batch).logits, want, rtol=1e-5, atol=1e-5)


def test_set_experts_implementation_switches_a_built_model() -> None:
    model = _lm("mixtral", "eager")
    model.set_experts_implementation(hf.IMPLEMENTATION)
    assert all(m.config._experts_implementation == hf.IMPLEMENTATION for m in _experts_of(model))


def test_unsupported_layouts_are_errors_naming_what() -> None:
    experts = _experts("mixtral", torch.float64)
    args = _routing(experts, tokens=4, top_k=2, dtype=torch.float64)
    experts.config._experts_implementation = hf.IMPLEMENTATION
    experts.has_post_expert_norm = True
    with pytest.raises(hf.UnsupportedExpertsError, match="post-expert norm"):
        experts(*args)
    experts = _experts("mixtral", torch.float64)
    experts.config._experts_implementation = hf.IMPLEMENTATION
    experts.act_fn = torch.nn.Tanh()
    with pytest.raises(hf.UnsupportedExpertsError, match="activation Tanh"):
        experts(*args)
    for alpha, limit in ((1.702, 0.0), (float("nan"), 7.0), (None, 7.0), (1.702, "7")):
        experts = _experts("gpt_oss", torch.float64)
        experts.config._experts_implementation = hf.IMPLEMENTATION
        experts.alpha, experts.limit = alpha, limit
        with pytest.raises(hf.UnsupportedExpertsError, match=f"limit={limit!r}"):
            experts(*_routing(experts, tokens=4, top_k=2, dtype=torch.float64))


def test_the_layout_is_derived_again_only_when_its_inputs_change(monkeypatch) -> None:
    experts = _experts("mixtral", torch.float64)
    args = _routing(experts, tokens=4, top_k=2, dtype=torch.float64)
    experts.config._experts_implementation = hf.IMPLEMENTATION
    derived = []
    layout_of = hf.layout_of
    monkeypatch.setattr(hf, "layout_of", lambda m: derived.append(m) or layout_of(m))
    with torch.no_grad():
        first = experts(*args)
        assert torch.equal(experts(*args), first) and len(derived) == 1
        experts.act_fn = torch.nn.ReLU()  # a changed activation is seen, not served stale
        relu = experts(*args)
    assert len(derived) == 2 and not torch.equal(relu, first)
    experts.config._experts_implementation = "eager"
    with torch.no_grad():
        torch.testing.assert_close(relu, experts(*args))


def test_import_megablocks_core_does_not_import_transformers() -> None:
    code = "import sys, megablocks_core.ops; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_use_fp8_runs_the_experts_gemms_quantized(family: str, monkeypatch) -> None:
    """use_fp8(model): the Experts modules' GEMMs go through the scaled ops (output and every
    gradient within FP8's error of the full-precision ones); None turns it off again."""
    import megablocks_core.fp8 as fp8_module

    experts = _experts(family, torch.float32)
    args = _routing(experts, 24, 2, torch.float32)
    with megablocks_core.use_backend("reference"):
        want = _run(experts, hf.IMPLEMENTATION, *args)
        assert hf.use_fp8(experts, "fp8_blockwise") == 1
        seen: list[str] = []
        real = fp8_module.call

        def spy(op: str, *a: Any) -> Any:
            seen.append(op)
            return real(op, *a)

        monkeypatch.setattr(fp8_module, "call", spy)
        got = _run(experts, hf.IMPLEMENTATION, *args)
        assert "scaled_gather_gmm" in seen and "scaled_gmm_scatter" in seen
        for g, w in zip(got, want, strict=True):
            rel = float((g - w).norm() / w.norm())
            assert rel < 0.15, rel  # FP8's ~4e-2 a GEMM, two GEMMs deep
        seen.clear()
        assert hf.use_fp8(experts, None) == 1
        _close(_run(experts, hf.IMPLEMENTATION, *args), want, 1e-6)
        assert not any(op.startswith("scaled_") for op in seen)
    with pytest.raises(TypeError, match="recipe"):
        hf.use_fp8(experts, 8)  # type: ignore[arg-type]
