"""Named tiers (megablocks_core.plugin.Tier) and the one ranking rule (megablocks_core.ranking).

A higher tier wins; within a tier cost hints decide per call shape; then ``yields_to``, kernels
naming the device kind before portable ones, backend name and variant. A forced backend wins
over all of it. Also: a third-party grouped GEMM in triton's tier is compared with triton's by
cost, knowing none of triton's numbers; and the Gluon Hopper weight gradient is a declared
variant of the triton backend (``triton/gluon-hopper``) that the ranking, ``explain`` and the kit
see.
"""

from __future__ import annotations

import pytest
import torch
from device_infos import B200, H200, MI300
from fake_plugins import kernels_body, permutation, routing_inputs

import megablocks_core as mb
from megablocks_core import DeviceInfo, Kernel, dispatch, ops, ranking
from megablocks_core.plugin import TensorMeta, Tier

CPU = DeviceInfo(kind="cpu", type="cpu", name="CPU")
F16 = torch.float16

COSTS = """
def flat_cost(device, call):
    return 50.0


def cheap_cost(device, call):
    return 1.0


def dear_cost(device, call):
    return 1e6


def loop_cost(device, call):
    # A loop of one launch per expert: 10 µs each, whatever the size of the experts.
    return 10.0 * call["b"].shape[0]
"""


def gather_backend(plugins, name, tier, devices=("cpu",), cost=None, extra_args=""):
    kernel = (
        f"Kernel(op='gather', fn=recording('gather'), devices={devices!r}, tier=Tier.{tier}, "
        f"cost={cost}{extra_args})"
    )
    return plugins.add(name, permutation(f"[{kernel}]", COSTS))


def gather_call() -> dict[str, object]:
    x, indices, bin_ids, bins, _ = routing_inputs()
    meta = {
        name: TensorMeta(tuple(t.shape), t.dtype, "cpu")
        for name, t in (("x", x), ("indices", indices), ("bin_ids", bin_ids), ("bins", bins))
    }
    return {**meta, "weights": None, "top_k": 2}


def winner(op: str = "gather", device: DeviceInfo = CPU, call=None) -> str:
    trace = mb.explain(op, device)
    if call is None:
        assert trace.winner is not None, trace.error
        return trace.winner.label
    kernel, why = dispatch.explain_call(trace, call)
    assert kernel is not None, why
    return kernel.label


# ---------------------------------------------------------------------------------- the names


def test_the_tiers_are_ordered_and_exported():
    assert Tier.PORTABLE < Tier.GENERIC_ACCELERATOR < Tier.VENDOR < Tier.SPECIALISED
    assert list(Tier) == sorted(Tier)
    assert mb.Tier is Tier
    assert Tier.GENERIC_ACCELERATOR.label == "generic-accelerator"
    assert Kernel(op="gather", fn=print, devices=("cpu",)).tier is Tier.PORTABLE  # the default


def test_a_bare_integer_or_a_priority_is_refused():
    with pytest.raises(TypeError, match=r"tier must be a megablocks_core\.plugin\.Tier"):
        Kernel(op="gather", fn=print, devices=("cpu",), tier=100)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="priority"):
        Kernel(op="gather", fn=print, devices=("cpu",), priority=100)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="yields_to must be a tuple"):
        Kernel(op="gather", fn=print, devices=("cpu",), yields_to="triton")  # type: ignore[arg-type]


def test_the_bundled_backends_declare_their_tiers():
    from megablocks_reference import plugin as reference
    from megablocks_rocm import plugin as rocm

    assert reference.TIER is Tier.PORTABLE
    assert rocm.TIER is Tier.VENDOR
    cuda = pytest.importorskip("megablocks_cuda.plugin")
    assert cuda.TIER is Tier.GENERIC_ACCELERATOR and cuda.ROUTING_YIELDS_TO == ("triton",)
    assert cuda.MEASURED_FASTER_TIER is Tier.VENDOR
    assert not hasattr(cuda, "ONE_BLOCK_PRIORITY") and not hasattr(cuda, "PRIORITY")


# ---------------------------------------------------------------------------------- the rule


def test_a_higher_tier_wins_whatever_the_costs(plugins):
    gather_backend(plugins, "generic", "GENERIC_ACCELERATOR", cost="dear_cost")
    gather_backend(plugins, "portable", "PORTABLE", cost="cheap_cost")
    plugins.reload()
    assert winner(call=gather_call()) == "generic"  # cost hints never cross tiers
    assert mb.explain("gather", CPU).cost_tier == ()
    gather_backend(plugins, "vendor", "VENDOR", cost="dear_cost")
    plugins.reload()
    assert winner(call=gather_call()) == "vendor"
    order = [c.kernel.backend for c in mb.explain("gather", CPU).candidates]
    assert order == ["vendor", "generic", "portable", "reference"]


def test_cost_hints_decide_within_a_tier(plugins):
    gather_backend(plugins, "aaa", "VENDOR", cost="dear_cost")
    gather_backend(plugins, "zzz", "VENDOR", cost="cheap_cost")
    plugins.reload()
    trace = mb.explain("gather", CPU)
    assert {k.label for k in trace.cost_tier} == {"aaa", "zzz"}
    assert winner(call=gather_call()) == "zzz"  # although "aaa" sorts first


def test_a_forced_backend_still_wins(plugins):
    gather_backend(plugins, "vendor", "VENDOR", cost="cheap_cost")
    gather_backend(plugins, "portable", "PORTABLE")
    plugins.reload()
    with mb.use_backend(gather="portable"):
        assert winner(call=gather_call()) == "portable"
        x, indices, bin_ids, bins, _ = routing_inputs()
        ops.gather(x, indices, bin_ids, bins, 2)
    assert plugins.calls("portable") == ["gather"] and plugins.calls("vendor") == []


def test_ties_are_broken_deterministically(plugins):
    # Equal estimates: the tier order decides (backend name), whatever the load order.
    gather_backend(plugins, "zeta", "GENERIC_ACCELERATOR", cost="flat_cost")
    gather_backend(plugins, "alpha", "GENERIC_ACCELERATOR", cost="flat_cost")
    plugins.reload()
    for _ in range(3):
        assert winner(call=gather_call()) == "alpha"
    assert [c.kernel.backend for c in mb.explain("gather", CPU).candidates][:2] == ["alpha", "zeta"]


def test_a_device_named_kernel_beats_a_portable_one_of_its_tier(plugins):
    gather_backend(plugins, "aany", "VENDOR", devices=("any",))
    gather_backend(plugins, "zcpu", "VENDOR")
    plugins.reload()
    assert winner() == "zcpu"


def test_yields_to_ranks_after_the_named_backend_and_only_while_it_can_serve(plugins):
    # "acub" sorts first by name but yields to "triton"-like "zgeneric" of its tier.
    gather_backend(plugins, "acub", "GENERIC_ACCELERATOR", extra_args=", yields_to=('zgeneric',)")
    gather_backend(
        plugins,
        "zgeneric",
        "GENERIC_ACCELERATOR",
        extra_args=", dtypes={'x': {torch.float32}}",
    )
    plugins.reload()
    trace = mb.explain("gather", CPU, {"x": torch.float32})
    assert trace.winner.label == "zgeneric" and trace.why == "highest tier"
    assert [c.kernel.backend for c in trace.candidates] == ["zgeneric", "acub", "reference"]
    # Where the one it yields to cannot serve (a dtype it declines), it serves, above the reference.
    assert mb.explain("gather", CPU, {"x": torch.float16}).winner.label == "acub"
    with mb.use_backend(gather="acub"):  # forcing it ignores the yield
        assert mb.explain("gather", CPU, {"x": torch.float32}).winner.label == "acub"


def test_yielding_does_not_cross_tiers(plugins):
    # A kernel yielding to a backend of a lower tier still outranks it: the tier comes first.
    gather_backend(plugins, "vendor", "VENDOR", extra_args=", yields_to=('generic',)")
    gather_backend(plugins, "generic", "GENERIC_ACCELERATOR")
    plugins.reload()
    assert winner() == "vendor"


def test_the_cli_shows_tiers(plugins, capsys):
    from megablocks_core import cli

    gather_backend(plugins, "vendor", "VENDOR")
    plugins.reload()
    assert cli.main(["backends", "explain", "gather"]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("candidate"))
    assert header.split()[:2] == ["candidate", "tier"]
    assert any(line.split()[:2] == ["vendor", "vendor"] for line in out.splitlines())
    assert any(line.split()[:2] == ["reference", "portable"] for line in out.splitlines())


# ------------------------------------------- a third-party grouped GEMM beside triton's


@pytest.fixture
def triton_on_a_gpu_host(plugins, monkeypatch):
    """The triton backend loaded as on an NVIDIA host (ranking only: nothing runs)."""
    pytest.importorskip("triton")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    yield plugins
    monkeypatch.undo()  # before the plugins fixture reloads the normal registry


def gmm_call(tokens: int, experts: int, k: int, n: int) -> dict[str, object]:
    return {
        "a": TensorMeta((tokens, k), F16, "cuda"),
        "b": TensorMeta((experts, k, n), F16, "cuda"),
        "batch_sizes": TensorMeta((experts,), torch.int64, "cpu"),
        "trans_b": False,
        "bias": None,
    }


def test_a_third_party_gmm_in_tritons_tier_is_compared_with_it_by_cost(triton_on_a_gpu_host):
    plugins = triton_on_a_gpu_host
    plugins.add(
        "loopgmm",
        kernels_body(
            "megablocks_grouped_gemm_kernels",
            "[Kernel(op='gmm', fn=recording('gmm'), devices=('cuda',), "
            "tier=Tier.GENERIC_ACCELERATOR, variant='loop', cost=loop_cost)]",
            COSTS,
        ),
    )
    registry = plugins.reload({"MEGABLOCKS_PLUGINS": "reference,triton,loopgmm"})
    assert registry.plugins["triton"].status == "ok", registry.plugins["triton"].reason
    trace = mb.explain("gmm", H200, {"a": F16, "b": F16})
    assert {k.label for k in trace.cost_tier} == {"triton", "loopgmm/loop"}

    # Two huge experts (a loop of two launches is cheap) and 256 one-row experts (decode: 256
    # launches are dear). Whatever triton's estimates, the lower one must win each shape.
    few_large, many_small = gmm_call(16384, 2, 4096, 14336), gmm_call(256, 256, 2048, 768)
    won = {}
    for name, call in (("few large", few_large), ("many small", many_small)):
        estimates = {k.label: v for k, v in ranking.estimates(trace, call)}
        assert all(v is not None and v > 0 for v in estimates.values()), estimates
        kernel, why = dispatch.explain_call(trace, call)
        assert kernel is not None and kernel.label == min(estimates, key=estimates.__getitem__)
        assert "lowest cost hint" in why
        won[name] = kernel.label
    assert won == {"few large": "loopgmm/loop", "many small": "triton"}


# ------------------------------------------- the Gluon Hopper weight gradient, declared


def wgrad_call(tokens: int, experts: int, k: int, n: int, out=None) -> dict[str, object]:
    call: dict[str, object] = {
        "a": TensorMeta((tokens, k), F16, "cuda"),
        "grad": TensorMeta((tokens, n), F16, "cuda"),
        "batch_sizes": TensorMeta((experts,), torch.int32, "cuda"),
    }
    if out is not None:
        call["out"] = TensorMeta((experts, k, n), out, "cuda")
    return call


def test_the_gluon_weight_gradient_is_a_declared_variant():
    pytest.importorskip("triton")
    from megablocks_triton import gmm, plugin, tuning

    kernels = {(k.op, k.variant): k for k in plugin.megablocks_grouped_gemm_kernels()}
    for op in ("gmm_weight_grad", "gmm_weight_grad_accumulate"):
        gluon, plain = kernels[(op, "gluon-hopper")], kernels[(op, "")]
        assert gluon.devices == ("cuda",) and gluon.tier is plain.tier is Tier.GENERIC_ACCELERATOR
        assert gluon.cost is tuning.COST_HINTS.get(op) and plain.cost is gluon.cost
        assert gluon.dtypes["a"] == gluon.dtypes["grad"] == {torch.bfloat16, torch.float16}
        assert (op == "gmm_weight_grad_accumulate") == ("out" in gluon.dtypes)
        assert gluon.capability is gmm.warp_specialized_capability
        assert callable(gluon.supports) and callable(plain.supports)
    check = gmm.warp_specialized_capability
    assert check(H200) is None
    assert "Hopper" in check(B200) and "Hopper" in check(MI300) and "Hopper" in check(CPU)


def test_the_gluon_variant_and_the_plain_kernel_split_the_calls():
    pytest.importorskip("triton")
    from megablocks_triton import plugin

    kernels = {(k.op, k.variant): k for k in plugin.megablocks_grouped_gemm_kernels()}

    def taker(op: str, call, device=H200) -> str:
        gluon, plain = kernels[(op, "gluon-hopper")], kernels[(op, "")]
        takes = [k.variant for k in (plain, gluon) if k.supports(device, call) is None]
        assert len(takes) == 1 or (device is not H200 and takes == [""]), takes
        return takes[0] or "plain"

    # Where the launch policy measured it faster: a new gradient up to 1024 tokens per expert
    # (qwen3), not mixtral's 4096; into a 16-bit gradient from 769 to 1024 only, never float32.
    assert taker("gmm_weight_grad", wgrad_call(131072, 128, 2048, 768)) == "gluon-hopper"
    assert taker("gmm_weight_grad", wgrad_call(32768, 8, 4096, 14336)) == "plain"
    assert taker("gmm_weight_grad", wgrad_call(1024, 2, 20, 768)) == "plain"  # K: 40-byte rows
    accumulate = "gmm_weight_grad_accumulate"
    assert taker(accumulate, wgrad_call(131072, 128, 2048, 768, F16)) == "gluon-hopper"
    assert taker(accumulate, wgrad_call(65536, 128, 2048, 768, F16)) == "plain"  # 512 each
    assert taker(accumulate, wgrad_call(131072, 128, 2048, 768, torch.float32)) == "plain"
    for device in (B200, MI300):
        assert taker("gmm_weight_grad", wgrad_call(131072, 128, 2048, 768), device) == "plain"


def test_a_tuning_override_keeps_the_triton_kernel(monkeypatch):
    pytest.importorskip("triton")
    from megablocks_triton import gmm

    call = wgrad_call(131072, 128, 2048, 768)
    assert gmm.warp_specialized_problem("gmm_weight_grad", H200, call) is None
    monkeypatch.setenv("MEGABLOCKS_TRITON_GMM_WGRAD_CONFIG", "128,128,32")
    assert "tuning" in gmm.warp_specialized_problem("gmm_weight_grad", H200, call)


def test_explain_lists_the_gluon_variant_and_it_can_be_forced(triton_on_a_gpu_host):
    registry = triton_on_a_gpu_host.reload({"MEGABLOCKS_PLUGINS": "reference,triton"})
    assert registry.plugins["triton"].status == "ok", registry.plugins["triton"].reason
    trace = mb.explain("gmm_weight_grad", H200, {"a": F16, "grad": F16})
    labels = {c.kernel.label: c for c in trace.candidates}
    assert labels["triton/gluon-hopper"].accepted and labels["triton"].accepted
    qwen3, mixtral = wgrad_call(131072, 128, 2048, 768), wgrad_call(32768, 8, 4096, 14336)
    assert dispatch.explain_call(trace, qwen3)[0].label == "triton/gluon-hopper"
    assert dispatch.explain_call(trace, mixtral)[0].label == "triton"
    # Forced as the kit forces each variant: it serves the calls it takes, declines the others.
    with mb.use_backend(gmm_weight_grad="triton/gluon-hopper"):
        forced = mb.explain("gmm_weight_grad", H200, {"a": F16, "grad": F16})
        assert forced.winner.label == "triton/gluon-hopper"
        assert dispatch.explain_call(forced, qwen3)[0].label == "triton/gluon-hopper"
        kernel, why = dispatch.explain_call(forced, mixtral)
        assert kernel is None and "launch policy keeps the Triton kernel" in why
    on_b200 = mb.explain("gmm_weight_grad", B200, {"a": F16, "grad": F16})
    gluon = next(c for c in on_b200.candidates if c.kernel.label == "triton/gluon-hopper")
    assert not gluon.accepted and "Hopper" in gluon.reason
    assert dispatch.explain_call(on_b200, qwen3)[0].label == "triton"
