"""Per-shape choice by cost hints (ranking step 4) and the helpers in megablocks_core.costs.

Two fake grouped-GEMM backends of one tier declare opposite speed profiles: "loop" is
fast for few large experts, "persistent" for many small ones. The dispatcher must pick per call
shape, cache the choice per shape, and leave forced backends and tiers in charge.
"""

from __future__ import annotations

import math

import pytest
import torch
from fake_plugins import kernels_body
from megablocks_reference import kernels as reference

import megablocks_core as mb
from megablocks_core import DeviceInfo, costs, dispatch, ops
from megablocks_core.descriptors import TensorMeta

CPU = DeviceInfo(kind="cpu", type="cpu", name="CPU")
H200 = DeviceInfo(
    kind="cuda", type="cuda", index=0, name="NVIDIA H200", arch="sm_90", capability=(9, 0)
)

# Estimated µs: "loop" pays 10 µs per expert (one launch each); "persistent" pays 2 µs per row.
COST_HINTS = """
HINT_CALLS = []


def loop_cost(device, call):
    HINT_CALLS.append(call["a"].shape)
    return 10.0 * call["b"].shape[0]


def persistent_cost(device, call):
    HINT_CALLS.append(call["a"].shape)
    return 2.0 * call["a"].shape[0]


def broken_cost(device, call):
    raise RuntimeError("bug in a cost hint")


def even_k(device, call):
    k = call["a"].shape[1]
    return None if k % 2 == 0 else f"needs an even K, got {k}"


def broken_check(device, call):
    raise ValueError("bug in a shape check")
"""


def gmm_backend(plugins, name, cost, tier="GENERIC_ACCELERATOR", supports=None):
    kernel = (
        f"Kernel(op='gmm', fn=recording('gmm'), devices=('cpu',), tier=Tier.{tier}, "
        f"cost={cost}, supports={supports})"
    )
    return plugins.add(
        name, kernels_body("megablocks_grouped_gemm_kernels", f"[{kernel}]", COST_HINTS)
    )


def run_gmm(tokens, experts, k=8, n=4):
    gen = torch.Generator().manual_seed(tokens * 31 + experts)
    a = torch.randn(tokens, k, generator=gen)
    b = torch.randn(experts, k, n, generator=gen)
    sizes = torch.full((experts,), tokens // experts, dtype=torch.int64)
    sizes[-1] += tokens - int(sizes.sum())
    out = ops.gmm(a, b, sizes)
    torch.testing.assert_close(out, reference.gmm(a, b, sizes, False))


@pytest.fixture
def two_gmms(plugins):
    gmm_backend(plugins, "loop", "loop_cost")
    gmm_backend(plugins, "persistent", "persistent_cost")
    plugins.reload()
    return plugins


def test_cheapest_estimate_wins_per_shape(two_gmms):
    run_gmm(tokens=400, experts=2)  # loop 20 µs vs persistent 800 µs
    run_gmm(tokens=8, experts=8)  # loop 80 µs vs persistent 16 µs
    assert two_gmms.calls("loop") == ["gmm"]
    assert two_gmms.calls("persistent") == ["gmm"]
    assert mb.dispatch.served()["gmm"] == ["loop", "persistent"]


def test_choice_is_cached_per_shape(two_gmms):
    for _ in range(3):
        run_gmm(tokens=8, experts=8)
    assert two_gmms.calls("persistent") == ["gmm"] * 3
    assert two_gmms.module("persistent").HINT_CALLS == [(8, 8)]  # asked once for the shape
    run_gmm(tokens=16, experts=8)
    assert two_gmms.module("persistent").HINT_CALLS == [(8, 8), (16, 8)]


def test_forced_backend_beats_cost(two_gmms):
    with mb.use_backend("persistent"):
        run_gmm(tokens=400, experts=2)
    assert two_gmms.calls("persistent") == ["gmm"]
    assert two_gmms.calls("loop") == []


def test_cost_only_decides_within_the_top_tier(plugins):
    gmm_backend(plugins, "loop", "loop_cost", tier="PORTABLE")
    gmm_backend(plugins, "persistent", "persistent_cost")
    plugins.reload()
    run_gmm(tokens=400, experts=2)  # loop would be cheaper, but it is in a lower tier
    assert plugins.calls("persistent") == ["gmm"]
    assert dispatch.explain("gmm", CPU).cost_tier == ()


def test_raising_hint_counts_as_no_estimate(plugins):
    gmm_backend(plugins, "aaa", "broken_cost")
    gmm_backend(plugins, "zzz", "persistent_cost")
    plugins.reload()
    run_gmm(tokens=8, experts=8)
    assert plugins.calls("zzz") == ["gmm"]  # the only estimate, although "aaa" sorts first
    trace = dispatch.explain("gmm", CPU)
    call = {
        "a": TensorMeta((8, 8), torch.float32, "cpu"),
        "b": TensorMeta((8, 8, 4), torch.float32, "cpu"),
    }
    kernel, why = dispatch.explain_call(trace, call)
    assert kernel is not None and kernel.backend == "zzz"
    assert "16.0" in why


def test_shape_predicate_sends_other_shapes_to_the_next_kernel(plugins):
    gmm_backend(plugins, "even", None, tier="VENDOR", supports="even_k")
    plugins.reload()
    run_gmm(tokens=8, experts=2, k=8)
    run_gmm(tokens=8, experts=2, k=7)  # rejected by its shape check: the reference serves it
    assert plugins.calls("even") == ["gmm"]
    assert dispatch.served()["gmm"] == ["even", "reference"]
    trace = dispatch.explain("gmm", CPU)
    assert trace.per_call and trace.winner.backend == "even"


def test_forced_backend_that_declines_the_shape_raises_with_its_reason(plugins):
    gmm_backend(plugins, "even", None, tier="VENDOR", supports="even_k")
    plugins.reload()
    with mb.use_backend("even"):
        run_gmm(tokens=8, experts=2, k=8)
        with pytest.raises(mb.NoKernelError, match=r"forced.*needs an even K, got 7"):
            run_gmm(tokens=8, experts=2, k=7)


def test_shape_predicate_and_cost_together(plugins):
    gmm_backend(plugins, "loop", "loop_cost", supports="even_k")
    gmm_backend(plugins, "persistent", "persistent_cost")
    plugins.reload()
    run_gmm(tokens=400, experts=2, k=8)  # both can take it: loop is cheaper
    run_gmm(tokens=400, experts=2, k=7)  # loop declines: persistent, although dearer
    assert plugins.calls("loop") == ["gmm"] and plugins.calls("persistent") == ["gmm"]


def test_raising_shape_check_rejects_only_its_kernel(plugins):
    gmm_backend(plugins, "buggy", None, tier="VENDOR", supports="broken_check")
    plugins.reload()
    run_gmm(tokens=8, experts=2)
    assert plugins.calls("buggy") == []
    call = {
        "a": TensorMeta((8, 8), torch.float32, "cpu"),
        "b": TensorMeta((2, 8, 4), torch.float32, "cpu"),
    }
    with mb.use_backend("buggy"):
        trace = dispatch.explain("gmm", CPU)
    kernel, why = dispatch.explain_call(trace, call)
    assert kernel is None and "shape check raised ValueError: bug in a shape check" in why


def test_explain_call_reports_estimates(two_gmms):
    trace = dispatch.explain("gmm", CPU)
    assert "per call shape" in trace.why
    call = {
        "a": TensorMeta((400, 8), torch.float32, "cpu"),
        "b": TensorMeta((2, 8, 4), torch.float32, "cpu"),
        "trans_b": False,
    }
    kernel, why = dispatch.explain_call(trace, call)
    assert kernel is not None and kernel.backend == "loop"
    assert "20.0" in why and "persistent 800.0" in why


# ---------------------------------------------------------------------------
# megablocks_core.costs


def gmm_call(tokens, k, n, experts, trans_b=False):
    b = (experts, n, k) if trans_b else (experts, k, n)
    return {
        "a": TensorMeta((tokens, k), torch.bfloat16, "cuda"),
        "b": TensorMeta(b, torch.bfloat16, "cuda"),
        "batch_sizes": TensorMeta((experts,), torch.int64, "cpu"),
        "trans_b": trans_b,
    }


def test_gmm_problem_reads_both_layouts_and_weight_grad():
    assert costs.gmm_problem(gmm_call(100, 16, 32, 4)) == (100, 16, 32, 4)
    assert costs.gmm_problem(gmm_call(100, 16, 32, 4, trans_b=True)) == (100, 16, 32, 4)
    wgrad = {
        "a": TensorMeta((100, 16), torch.bfloat16, "cuda"),
        "grad": TensorMeta((100, 32), torch.bfloat16, "cuda"),
        "batch_sizes": TensorMeta((4,), torch.int64, "cuda"),
    }
    assert costs.gmm_problem(wgrad) == (100, 16, 32, 4)


def test_nearest_efficiency_matches_brute_force():
    gen = torch.Generator().manual_seed(0)
    points = [
        (*(float(v) for v in torch.randint(1, 20000, (3,), generator=gen)), i / 10)
        for i in range(1, 9)
    ]
    for _ in range(50):
        q = [float(v) for v in torch.randint(1, 20000, (3,), generator=gen)]
        want = min(
            points, key=lambda p: sum((math.log(p[i]) - math.log(q[i])) ** 2 for i in range(3))
        )[3]
        assert costs.nearest_efficiency(points, *q) == want
    assert costs.nearest_efficiency([], 1, 1, 1) is None


def test_gmm_estimate_is_flops_over_rate():
    points = {"sm_90": [(4096, 4096, 14336, 0.5)]}
    dense = {"sm_90": 690.0}  # the provider's rate, per arch
    call = gmm_call(32768, 4096, 14336, 8)
    flops = 2 * 32768 * 4096 * 14336
    want_us = flops / (0.5 * 690.0 * 1e12) * 1e6
    assert costs.gmm_estimate_us(H200, call, points, dense_tflops=dense) == pytest.approx(want_us)
    assert costs.gmm_estimate_us(
        H200, call, points, extra_us=7.0, dense_tflops=dense
    ) == pytest.approx(want_us + 7.0)
    a100 = DeviceInfo(kind="cuda", type="cuda", index=0, arch="sm_80", capability=(8, 0))
    assert (
        costs.gmm_estimate_us(a100, call, points, dense_tflops=dense) is None
    )  # unmeasured arch: the tier order decides


def test_gmm_cost_hint_estimates_from_points_and_can_refuse_device_counts():
    points = {"sm_90": [(4096, 4096, 14336, 0.5)]}
    dense = {"sm_90": 690.0}  # the provider's rate, per arch
    call = gmm_call(32768, 4096, 14336, 8)  # host-side batch_sizes
    device_counts = {**call, "batch_sizes": TensorMeta((8,), torch.int64, "cuda")}
    hint = costs.gmm_cost_hint(points, dense_tflops=dense, extra_us=3.0)
    assert hint(H200, call) == pytest.approx(
        costs.gmm_estimate_us(H200, call, points, dense_tflops=dense) + 3.0
    )
    assert hint(H200, device_counts) == hint(H200, call)
    host_only = costs.gmm_cost_hint(points, dense_tflops=dense, host_counts_only=True)
    assert host_only(H200, call) == pytest.approx(
        costs.gmm_estimate_us(H200, call, points, dense_tflops=dense)
    )
    assert (
        host_only(H200, device_counts) is None
    )  # it would sync: no estimate, the tier order decides
    assert hint(CPU, call) is None


@pytest.mark.parametrize(
    ("arch", "family"),
    [
        ("gfx90a", "cdna2"),
        ("gfx942", "cdna3"),
        ("gfx950", "cdna4"),
        ("gfx942:sramecc+:xnack-", "cdna3"),
        ("gfx1100", None),
        ("sm_90", "hopper"),
        ("sm_100", "blackwell"),
        ("sm_120", None),
        (None, None),
    ],
)
def test_arch_family(arch, family):
    from megablocks_core import plugin

    assert plugin.arch_family(arch) == family
    assert plugin.arch_family(DeviceInfo(kind="rocm", type="cuda", arch=arch)) == family


def test_dense_rate_is_the_providers_own_and_known_for_the_measured_arch_only():
    from megablocks_core import plugin

    assert not hasattr(plugin, "dense_tflops") and not hasattr(plugin, "DENSE_BF16_TFLOPS")
    tuning = pytest.importorskip("megablocks_triton.tuning")
    assert tuning.DENSE_BF16_TFLOPS["sm_90"] > 0
    assert "sm_80" not in tuning.DENSE_BF16_TFLOPS


def test_triton_hint_prefers_itself_only_where_measured():
    tuning = pytest.importorskip("megablocks_triton.tuning")
    call = gmm_call(16384 * 8, 2048, 768, 128)
    assert tuning.COST_HINTS["gmm"](H200, call) is not None
    assert tuning.COST_HINTS["gmm"](CPU, call) is None


def test_cli_explain_shows_the_per_shape_choice(two_gmms, capsys):
    from megablocks_core import cli

    assert (
        cli.main(
            [
                "backends",
                "explain",
                "gmm",
                "--device",
                "cpu",
                "--shape",
                "a=8x8",
                "--shape",
                "b=8x8x4",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "lowest cost hint" in out
    row = next(line for line in out.splitlines() if line.startswith("a=8x8"))
    assert row.split()[-3:] == [
        "80.0",
        "16.0",
        "persistent",
    ]  # loop 10 µs x 8 experts; 2 µs x 8 rows
    assert cli.main(["backends", "explain", "gmm", "--device", "cpu"]) == 0
    rows = {
        line.split()[0]: line.split()
        for line in capsys.readouterr().out.splitlines()
        if line.split() and line.split()[0] in ("mixtral", "qwen3", "dsv3")
    }
    assert rows["qwen3"][-3:] == ["1280.0", str(2.0 * 16384 * 8), "loop"]


@pytest.mark.slow
def test_kit_counts_declined_shapes_as_declined_not_failed(plugins):
    from megablocks_core import testing

    gmm_backend(plugins, "even", None, tier="VENDOR", supports="even_k")
    plugins.reload()
    [result] = [r for r in testing.check(["even"], device="cpu") if r.op == "gmm"]
    assert result.status == "pass", result.message
    assert result.scenarios > 0 and result.declined > 0  # the kit has odd and even K


def test_cli_explain_shows_a_declined_shape(plugins, capsys):
    from megablocks_core import cli

    gmm_backend(plugins, "even", None, tier="VENDOR", supports="even_k")
    plugins.reload()
    assert cli.main(["backends", "explain", "gmm", "--shape", "a=8x7", "--shape", "b=2x7x4"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert (
        line.startswith("a=8x7 b=2x7x4: reference")
        and "even declined: needs an even K, got 7" in line
    )
    assert cli.main(["backends", "explain", "gmm", "--shape", "a=8x8", "--shape", "b=2x8x4"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("a=8x8 b=2x8x4: even")
