"""torch.compile(fullgraph=True) of the FP8 training path: megablocks_core.fp8's functions, dMoE
with ``MoEConfig(fp8=...)`` and transformers' MoE blocks after ``use_fp8``, each compiled step
against the eager step (loss, output and every gradient, float32).

What is checked beside the values: the forward graph holds the FP8 functions as custom ops and the
backward graph the scaled GEMMs (``backward="fp8"``) or none (``backward="input"``), so a compiled
step that silently ran unquantized would fail; and weights changed between compiled steps (in
place, and through ``.data``, which the version counter does not see) are quantized again, with
``Recipe(cache_weights=True)`` too (the cache is not used under compile)."""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from triton_interpreter import interpreting

import megablocks_core
from megablocks_core import fp8, ops
from megablocks_core.layers import MoEConfig, dMoE

pytestmark = pytest.mark.usefixtures("reference_backend")

EXPERTS, TOP_K, HIDDEN, FFN = 3, 2, 16, 8

#: Where the Triton kernels run: the CPU under the interpreter, or the GPU test device.
TRITON_DEVICE = torch.device(
    os.environ.get("MEGABLOCKS_TRITON_TEST_DEVICE", "cpu" if interpreting() else "cuda")
)
_TRITON_RUNNABLE = interpreting() if TRITON_DEVICE.type == "cpu" else torch.cuda.is_available()


def _assert_matches_eager(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    """Each tensor within 1e-4 of its largest magnitude (inductor may order the model's own
    float32 ops otherwise than eager)."""
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        bound = 1e-4 * float(w.abs().max()) + 1e-6
        torch.testing.assert_close(g, w, rtol=0, atol=bound)


def _recording_backend(graphs: list[set[str]]) -> Any:
    """aot_eager that records the ops of each graph it is given (forward, then backward)."""

    def record(gm: torch.fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
        graphs.append({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
        return make_boxed_func(gm.forward)

    return aot_autograd(fw_compiler=record, bw_compiler=record)


# ---------------------------------------------------------------------------------------------
# The functions: gather_gmm -> gmm -> gmm_scatter, biases on, every argument differentiable


def _mlp_case(device: torch.device | str = "cpu", tokens: int = 8) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    top = torch.randint(0, EXPERTS, (tokens * TOP_K,), generator=gen, dtype=torch.int32)
    bin_ids, indices = ops.sort(top, 2)
    counts = ops.histogram(top, EXPERTS)

    def leaf(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(device).requires_grad_()

    return {
        "leaves": {
            "x": leaf(tokens, HIDDEN),
            "w1": leaf(EXPERTS, HIDDEN, 2 * FFN, scale=0.3),
            "b1": leaf(EXPERTS, 2 * FFN, scale=0.1),
            "w_mid": leaf(EXPERTS, 2 * FFN, 2 * FFN, scale=0.3),
            "w2": leaf(EXPERTS, FFN, HIDDEN, scale=0.3),
            "b2": leaf(EXPERTS, HIDDEN, scale=0.1),
            "weights": torch.rand(tokens * TOP_K, generator=gen).to(device).requires_grad_(),
        },
        "routing": tuple(
            t.to(device) for t in (indices, bin_ids, counts, ops.inclusive_cumsum(counts, 0))
        ),
    }


def _mlp(module: Any, leaves: dict[str, torch.Tensor], routing: tuple, **kw: Any) -> torch.Tensor:
    """Experts' MLP through ``module``'s gather_gmm, gmm and gmm_scatter (fp8 or ops)."""
    indices, bin_ids, counts, bins = routing
    x, w1, b1, w_mid, w2, b2, weights = leaves.values()
    h = module.gather_gmm(x, w1, indices, bin_ids, bins, TOP_K, False, None, b1, **kw)
    h = module.gmm(h, w_mid, counts, **kw)
    return module.gmm_scatter(
        h, w2, indices, bin_ids, weights, bins, TOP_K, False, "swiglu", None, b2, **kw
    )


def _mlp_step(fn: Callable[..., torch.Tensor], case: dict[str, Any], **kw: Any) -> list:
    """The output and each leaf's gradient of sum(out * cotangent)."""
    leaves = case["leaves"]
    out = fn(leaves, case["routing"], **kw)
    cotangent = torch.linspace(-1, 1, out.numel(), device=out.device).reshape(out.shape)
    grads = torch.autograd.grad(out, list(leaves.values()), cotangent)
    return [out.detach(), *grads]


def _eager_mlp(leaves: dict[str, torch.Tensor], routing: tuple, **kw: Any) -> torch.Tensor:
    return _mlp(fp8, leaves, routing, **kw)


def _compiled_step_matching_eager(recipe: fp8.Recipe) -> tuple[list, list[set[str]]]:
    """The MLP step compiled in one graph, asserted equal to eager's: its outputs and gradients,
    and the op names of its forward and backward graphs."""
    torch._dynamo.reset()
    case = _mlp_case()
    graphs: list[set[str]] = []
    compiled = torch.compile(_eager_mlp, fullgraph=True, backend=_recording_backend(graphs))
    got = _mlp_step(compiled, case, recipe=recipe)
    _assert_matches_eager(got, _mlp_step(_eager_mlp, case, recipe=recipe))
    return got, graphs


@pytest.mark.parametrize("fmt", ["fp8_rowwise", "fp8_blockwise"])
@pytest.mark.parametrize("backward", ["fp8", "input"])
def test_the_fp8_functions_compile_in_one_graph_and_match_eager(fmt: str, backward: str) -> None:
    got, graphs = _compiled_step_matching_eager(fp8.Recipe(fmt, backward=backward))  # type: ignore[arg-type]
    forward_ops, backward_ops = graphs
    assert {f"megablocks.fp8_{name}.default" for name in fp8._GEMMS} <= forward_ops
    scaled = {op for op in backward_ops if "scaled_" in op or "quantize" in op}
    if backward == "fp8":  # the data gradients' GEMMs quantized, the weight gradients not
        assert scaled == {
            "megablocks.quantize.default",
            "megablocks.scaled_gmm.default",
            "megablocks.scaled_gather_gmm.default",
            "megablocks.scaled_gmm_scatter.default",
        }
    else:
        assert not scaled
    # Quantized indeed: an FP8 GEMM is off the full-precision one by ~3e-2 of its norm.
    full = _mlp_step(lambda leaves, routing: _mlp(ops, leaves, routing), _mlp_case())[0]
    assert float((got[0] - full).norm() / full.norm()) > 1e-3


def test_fp8_weight_gradients_compile_and_match_eager() -> None:
    """Recipe(weight_grad="fp8") through the compiled ops: the recipe reaches the traced
    backward, whose weight gradients run on the scaled ops, as eager's do."""
    _, graphs = _compiled_step_matching_eager(fp8.Recipe("fp8_rowwise", weight_grad="fp8"))
    backward_ops = graphs[1]
    # gather_gmm's rows of x are quantized as they are read through the indices (the output
    # gradient's rows are gathered anyway here, for the second bias's sums).
    assert {
        "megablocks.quantize_transposed.default",
        "megablocks.gather_quantize_transposed.default",
        "megablocks.scaled_gmm_weight_grad.default",
    } <= backward_ops
    # The biases' gradients, column sums, stay unquantized (the eager tests count the calls).
    assert "megablocks.gmm_weight_grad.default" in backward_ops


@pytest.mark.parametrize("name", ["gmm", "gather_gmm", "gmm_scatter"])
@pytest.mark.parametrize("fmt, weight_grad", [("fp8_blockwise", "input"), ("fp8_rowwise", "fp8")])
def test_opcheck_of_the_fp8_custom_ops(name: str, fmt: str, weight_grad: str) -> None:
    """torch.library.opcheck: schema, fake against real, the autograd formula against itself under
    AOT dispatch (static and dynamic shapes)."""
    case = _mlp_case()
    x, w1, b1, _, w2, b2, weights = case["leaves"].values()
    indices, bin_ids, counts, bins = case["routing"]
    rows = torch.randn(indices.shape[0], 2 * FFN, requires_grad=True)
    routed = (indices, bin_ids)
    args = {
        "gmm": (rows, w1.transpose(1, 2).detach().requires_grad_(), counts, False, b2),
        "gather_gmm": (x, w1, *routed, bins, TOP_K, False, None, b1),
        "gmm_scatter": (rows, w2, *routed, weights, bins, TOP_K, False, "swiglu", None, b2),
    }[name]
    op = getattr(torch.ops.megablocks, f"fp8_{name}")
    torch.library.opcheck(op, (fmt, None, "fp8", weight_grad, *args))


def test_fp8_gmm_compiles_with_dynamic_shapes_and_a_recipe_by_name() -> None:
    """One graph for every row count (dynamic=True), the recipe a format name."""
    torch._dynamo.reset()

    def step(a: torch.Tensor, b: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
        return fp8.gmm(a, b, sizes, recipe="fp8_blockwise")

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager", dynamic=True)
    gen = torch.Generator().manual_seed(3)
    b = torch.randn(EXPERTS, HIDDEN, FFN, generator=gen).requires_grad_()
    for rows in (7, 12, 30):
        a = torch.randn(rows, HIDDEN, generator=gen).requires_grad_()
        sizes = torch.tensor([rows // 2, 0, rows - rows // 2])
        results = []
        for fn in (compiled, step):
            out = fn(a, b, sizes)
            results.append([out.detach(), *torch.autograd.grad(out.square().sum(), (a, b))])
        _assert_matches_eager(*results)


@pytest.mark.skipif(
    not _TRITON_RUNNABLE, reason=f"the triton kernels cannot run on {TRITON_DEVICE}"
)
def test_the_fp8_functions_compile_on_the_triton_backend() -> None:
    torch._dynamo.reset()
    recipe = fp8.Recipe("fp8_rowwise")
    case = _mlp_case(TRITON_DEVICE, tokens=4)
    with megablocks_core.use_backend("triton"):
        compiled = torch.compile(_eager_mlp, fullgraph=True, backend="aot_eager")
        got = _mlp_step(compiled, case, recipe=recipe)
        want = _mlp_step(_eager_mlp, case, recipe=recipe)
    _assert_matches_eager(got, want)


# ---------------------------------------------------------------------------------------------
# The layer and the transformers blocks, two compiled steps after weight updates


def _module(name: str, recipe: fp8.Recipe) -> torch.nn.Module:
    if name == "dmoe":
        torch.manual_seed(0)
        config = MoEConfig(32, 48, 4, 2, glu=True, activation="silu", fp8=recipe)
        layer = dMoE(config, load_balancing_loss_coefficient=0.01)
        with torch.no_grad():  # clear top-k choices: no near-ties between experts
            layer.router.normal_(0, 1.0, generator=torch.Generator().manual_seed(7))
        return layer
    pytest.importorskip("transformers")
    from test_cuda_graphs import transformers_block

    from megablocks_core.integrations import transformers as hf

    block = transformers_block(name, "cpu", torch.float32)
    assert hf.use_fp8(block, recipe) == 1
    return block


def _module_step(
    module: torch.nn.Module, seed: int, device: torch.device | str = "cpu"
) -> list[torch.Tensor]:
    """The loss, the input's gradient and every parameter's, of one step."""
    module.zero_grad(set_to_none=True)
    x = torch.randn(1, 9, 32, generator=torch.Generator().manual_seed(seed))
    x = x.to(device).requires_grad_()
    result = module(x)
    out = result[0] if isinstance(result, tuple) else result
    loss = out.square().mean()
    if isinstance(result, tuple) and result[1].dim() == 0:  # dMoE's load-balancing loss
        loss = loss + result[1]
    loss.backward()
    return [loss.detach(), x.grad, *(p.grad for p in module.parameters())]


def _update(modules: tuple[torch.nn.Module, ...], seed: int, through_data: bool) -> None:
    """The same change of every parameter of each module: in place (the version counter sees it)
    or through ``.data`` (it does not)."""
    for params in zip(*(m.parameters() for m in modules), strict=True):
        noise = 0.2 * torch.randn(params[0].shape, generator=torch.Generator().manual_seed(seed))
        for p in params:
            if through_data:
                p.data.add_(noise.to(p.device))
            else:
                with torch.no_grad():
                    p.add_(noise.to(p.device))


@pytest.mark.parametrize(
    ("name", "fmt", "backward"),
    [
        ("dmoe", "fp8_rowwise", "fp8"),
        ("qwen3_moe", "fp8_blockwise", "fp8"),
        ("gpt_oss", "fp8_rowwise", "input"),
    ],
)
def test_a_module_in_fp8_compiles_and_quantizes_updated_weights(
    name: str, fmt: str, backward: str
) -> None:
    """Compiled with ``cache_weights=True`` against an eager copy without the cache: the same
    step after a first step, after an in-place update and after a ``.data`` update (an eager
    cache would keep the stale copy there; the compiled step quantizes every call)."""
    torch._dynamo.reset()
    compiled_module = _module(name, fp8.Recipe(fmt, backward=backward, cache_weights=True))  # type: ignore[arg-type]
    eager_module = _module(name, fp8.Recipe(fmt, backward=backward))  # type: ignore[arg-type]
    compiled = torch.compile(compiled_module, fullgraph=True, backend="aot_eager")
    for seed, through_data in enumerate((None, False, True)):
        if through_data is not None:
            _update((compiled_module, eager_module), seed, through_data)
        _assert_matches_eager(_module_step(compiled, seed), _module_step(eager_module, seed))


@pytest.mark.slow  # inductor's C++ compile: ~18 s on 2 cores with a cold cache
def test_dmoe_in_fp8_compiles_with_inductor() -> None:
    """The default backend: inductor generates code around the custom ops."""
    torch._dynamo.reset()
    module = _module("dmoe", fp8.Recipe("fp8_blockwise"))
    eager = copy.deepcopy(module)
    compiled = torch.compile(module, fullgraph=True)
    for seed in range(2):
        _assert_matches_eager(_module_step(compiled, seed), _module_step(eager, seed))


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="needs a GPU with FP8 matrix units",
)
@pytest.mark.parametrize("fmt", ["fp8_rowwise", "fp8_blockwise"])
def test_dmoe_in_fp8_runs_in_cuda_graphs_on_the_gpu(fmt: str) -> None:
    """``mode="reduce-overhead"`` on the GPU's own kernels: the FP8 step recorded in CUDA graphs
    (inductor skipped none), each replay with a new input and updated weights equal to eager's."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    module = _module("dmoe", fp8.Recipe(fmt)).cuda()
    eager = copy.deepcopy(module)
    compiled = torch.compile(module, mode="reduce-overhead", fullgraph=True)
    with megablocks_core.use_backend("triton"):
        for seed in range(4):  # the first calls compile and record; the later ones replay
            if seed:
                _update((module, eager), seed, through_data=False)
            want = _module_step(eager, seed, "cuda")
            torch.compiler.cudagraph_mark_step_begin()
            _assert_matches_eager(_module_step(compiled, seed, "cuda"), want)
    assert counters["inductor"]["cudagraph_skips"] == 0
