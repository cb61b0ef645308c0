"""CUDA graphs with a transformers MoE block and with dMoE: manual capture and
``torch.compile(mode="reduce-overhead")``, forward and forward + backward, as README.md's
"CUDA graphs" section shows them.

On a CUDA GPU: each replay equals the eager step on new inputs, and the compiled step runs in
CUDA graphs (inductor skipped none). On the CPU (no graphs there): what the recipes rest on, that
torch.compile takes the whole block, forward and backward, in one graph (``fullgraph=True``)
and computes what eager does, with ``mode="reduce-overhead"`` as the README writes it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch

import megablocks_core
from megablocks_core.layers import MoEConfig, dMoE

transformers = pytest.importorskip("transformers")

from megablocks_core.integrations import transformers as hf  # noqa: E402

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SMALL = {"hidden_size": 32, "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 48}


def _config(family: str) -> Any:
    """A one-layer config of ``family``: GPT-OSS (biases, the clamped SwiGLU with constants of
    its own) or Qwen3-MoE (neither)."""
    if family == "gpt_oss":
        config = transformers.GptOssConfig(
            **SMALL, head_dim=16, intermediate_size=48, num_local_experts=4,
            num_experts_per_tok=2, sliding_window=4, layer_types=["full_attention"],
            swiglu_alpha=1.3, swiglu_limit=2.5, num_hidden_layers=1,
        )  # fmt: skip
    else:
        config = transformers.Qwen3MoeConfig(
            **SMALL, head_dim=16, intermediate_size=64, moe_intermediate_size=48, num_experts=6,
            num_experts_per_tok=2, num_hidden_layers=1,
        )  # fmt: skip
    config._experts_implementation = hf.IMPLEMENTATION
    return config


def transformers_block(family: str, device: str, dtype: torch.dtype) -> torch.nn.Module:
    """The MoE block (router and experts) of a one-layer model, served by "megablocks"."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config(family))
    block = model.model.layers[0].mlp
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 1.0, generator=torch.Generator().manual_seed(1))
    return block.to(device, dtype)


def dmoe_layer(device: str, dtype: torch.dtype) -> torch.nn.Module:
    config = MoEConfig(32, 48, 4, 2, glu=True, activation="silu", dtype=dtype, device=device)
    layer = dMoE(config, load_balancing_loss_coefficient=0.01)
    with torch.no_grad():  # clear top-k choices: no near-ties between experts
        layer.router.normal_(0, 1.0, generator=torch.Generator(device=device).manual_seed(7))
    return layer


def _out(result: Any) -> torch.Tensor:
    """The block's output: transformers' blocks may return (hidden, router logits), dMoE
    (hidden, aux loss)."""
    return result[0] if isinstance(result, tuple) else result


def _loss(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    result = module(x)
    loss = _out(result).float().square().mean()
    if isinstance(result, tuple) and result[1].dim() == 0:  # dMoE's load-balancing loss
        loss = loss + result[1]
    return loss


def _modules(device: str, dtype: torch.dtype) -> dict[str, Callable[[], torch.nn.Module]]:
    return {
        "gpt_oss": lambda: transformers_block("gpt_oss", device, dtype),
        "qwen3_moe": lambda: transformers_block("qwen3_moe", device, dtype),
        "dmoe": lambda: dmoe_layer(device, dtype),
    }


def _input(device: str, dtype: torch.dtype, seed: int, tokens: int = 9) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(1, tokens, SMALL["hidden_size"], generator=generator).to(device, dtype)


def _grads(module: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """The loss, the input's gradient and every parameter's, of one eager step."""
    module.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    loss = _loss(module, x)
    loss.backward()
    return [loss.detach(), x.grad, *(p.grad for p in module.parameters())]


def _assert_matches_eager(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    """Each float32 tensor within 1e-4 of its largest magnitude: inductor fuses the model's own
    torch ops (router, softmax, clamp) in another order than eager, and a sum that cancels keeps
    that rounding as it is (seen: 1 element in 288 off by 3e-5 of itself, with torch 2.11)."""
    for g, w in zip(got, want, strict=True):
        bound = 1e-4 * float(w.abs().max()) + 1e-6
        torch.testing.assert_close(g, w, rtol=0, atol=bound)


# ---------------------------------------------------------------------------------------------
# On the CPU: the whole step in one graph, as the compiled recipes need it
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt_oss", "dmoe"])
def test_reduce_overhead_compiles_the_whole_step_and_matches_eager(name: str) -> None:
    """torch.compile(mode="reduce-overhead", fullgraph=True), the README's recipe: one graph for
    the forward and one for the backward (no graph break), the same loss and gradients as eager
    (on the CPU inductor runs them without CUDA graphs)."""
    torch._dynamo.reset()
    module = _modules("cpu", torch.float32)[name]()
    x = _input("cpu", torch.float32, seed=2)
    with megablocks_core.use_backend("reference"):
        want = _grads(module, x)
        compiled = torch.compile(module, mode="reduce-overhead", fullgraph=True)
        for _ in range(2):  # a second step reuses the compiled graphs
            torch.compiler.cudagraph_mark_step_begin()
            got = _grads(compiled, x)
    _assert_matches_eager(got, want)


@pytest.mark.parametrize("name", ["gpt_oss", "qwen3_moe"])
def test_a_block_compiles_on_its_first_call(name: str) -> None:
    """Traced before any eager call (nothing cached on the module): GPT-OSS's gate is still
    recognised, and the compiled forward is the eager one."""
    torch._dynamo.reset()
    x = _input("cpu", torch.float32, seed=3)
    with megablocks_core.use_backend("reference"):
        compiled = torch.compile(
            _modules("cpu", torch.float32)[name](), fullgraph=True, backend="aot_eager"
        )
        got = _out(compiled(x))
        want = _out(_modules("cpu", torch.float32)[name]()(x))
    _assert_matches_eager([got], [want])


# ---------------------------------------------------------------------------------------------
# On a CUDA GPU: manual capture and reduce-overhead, replays against eager steps
# ---------------------------------------------------------------------------------------------


def _warm_up(step: Callable[[], Any]) -> None:
    """Runs ``step`` a few times on a side stream (kernel choice, compilation, the allocator's
    pools), as torch.cuda.graph's documentation asks before a capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)


@cuda
@pytest.mark.parametrize("name", ["gpt_oss", "qwen3_moe", "dmoe"])
def test_a_captured_forward_replays_new_inputs(name: str) -> None:
    """Inference (decode): the block's no-grad forward captured once on a static input, then
    replayed after copying each new input into it, equals the eager forward."""
    dtype = torch.bfloat16
    module = _modules("cuda", dtype)[name]()
    static_x = _input("cuda", dtype, seed=0, tokens=4)

    def forward() -> torch.Tensor:
        with torch.no_grad():
            return _out(module(static_x))

    _warm_up(forward)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = forward()
    for seed in (1, 2):
        x = _input("cuda", dtype, seed=seed, tokens=4)
        static_x.copy_(x)
        graph.replay()
        with torch.no_grad():
            want = _out(module(x))
        torch.testing.assert_close(static_out, want, rtol=0, atol=0)


@cuda
@pytest.mark.parametrize("name", ["gpt_oss", "qwen3_moe", "dmoe"])
def test_a_captured_training_step_replays_new_inputs(name: str) -> None:
    """Forward + backward + an SGD update captured once (gradients allocated in the graph's
    pool: set to None before the capture), replayed on new inputs: the loss, gradients and
    updated weights equal an eager copy's."""
    lr = 0.1
    module = _modules("cuda", torch.float32)[name]()
    reference = copy.deepcopy(module)
    static_x = _input("cuda", torch.float32, seed=0, tokens=256)

    def step(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        loss = _loss(m, x)
        loss.backward()
        with torch.no_grad():
            for p in m.parameters():
                p.sub_(lr * p.grad)
        return loss.detach()

    _warm_up(lambda: _loss(module, static_x).backward())  # no update: the weights stay as copied
    module.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = step(module, static_x)
    for seed in (1, 2):
        x = _input("cuda", torch.float32, seed=seed, tokens=256)
        static_x.copy_(x)
        graph.replay()
        reference.zero_grad(set_to_none=True)
        want = step(reference, x)
        torch.testing.assert_close(static_loss, want)
        for p, q in zip(module.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad)
            torch.testing.assert_close(p, q)


@cuda
@pytest.mark.parametrize("name", ["gpt_oss", "qwen3_moe", "dmoe"])
def test_reduce_overhead_runs_the_step_in_cuda_graphs(name: str) -> None:
    """torch.compile(mode="reduce-overhead", fullgraph=True): forward and backward recorded in
    CUDA graphs (inductor skipped none), and each step's loss and gradients equal eager's."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    module = _modules("cuda", torch.float32)[name]()
    compiled = torch.compile(module, mode="reduce-overhead", fullgraph=True)
    for seed in range(4):  # the first calls compile and record; the later ones replay
        x = _input("cuda", torch.float32, seed=seed)
        want = _grads(module, x)
        torch.compiler.cudagraph_mark_step_begin()
        got = _grads(compiled, x)
        _assert_matches_eager(got, want)
    assert counters["inductor"]["cudagraph_skips"] == 0
