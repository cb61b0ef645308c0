"""megablocks-cuda on any host: registration, availability, capability logic, cost hints, and the
torch._grouped_mm kernels run on the CPU against a float64 loop.

Nothing here needs a GPU or the C++ extension (which is never built on import or registry load).
"""

from __future__ import annotations

import dataclasses
import sys
import types
from collections.abc import Sequence

import pytest
import torch
from fake_plugins import ENV_VARS
from megablocks_cuda import extension, gmm, plugin, tuning

import megablocks_core
from megablocks_core import DeviceInfo
from megablocks_core.descriptors import TensorMeta
from megablocks_core.plugin import GmmPoint, Tier
from megablocks_core.ranking import for_call, rank
from megablocks_core.registry import PluginRecord, Registry

A100 = DeviceInfo(
    kind="cuda", type="cuda", index=0, name="NVIDIA A100", arch="sm_80", capability=(8, 0)
)
H200 = DeviceInfo(
    kind="cuda", type="cuda", index=0, name="NVIDIA H200", arch="sm_90", capability=(9, 0)
)
B200 = DeviceInfo(
    kind="cuda", type="cuda", index=1, name="NVIDIA B200", arch="sm_100", capability=(10, 0)
)
RTX = DeviceInfo(
    kind="cuda", type="cuda", index=0, name="NVIDIA RTX 5090", arch="sm_120", capability=(12, 0)
)
MI300 = DeviceInfo(kind="rocm", type="cuda", index=0, name="AMD Instinct MI300X", arch="gfx942")
CPU = DeviceInfo(kind="cpu", type="cpu", name="CPU")
BF16_GMM = {"a": torch.bfloat16, "b": torch.bfloat16}

ROUTING = (
    "sort",
    "histogram",
    "inclusive_cumsum",
    "exclusive_cumsum",
    "topology",
    "replicate",
    "replicate_backward",
)


def _kernels():
    return [
        *plugin.megablocks_routing_kernels(),
        *plugin.megablocks_permutation_kernels(),
        *plugin.megablocks_grouped_gemm_kernels(),
    ]


def _registry() -> Registry:
    """The cuda backend alone, marked available, as the core would record it on a GPU host."""
    kernels = tuple(dataclasses.replace(k, backend="cuda") for k in _kernels())
    return Registry({"cuda": PluginRecord("cuda", "megablocks-cuda", "0.1.0", "ok", None, kernels)})


@pytest.fixture
def no_grouped_gemm(monkeypatch):
    # import fails, also where the real package is installed (its submodule may be loaded)
    monkeypatch.setitem(sys.modules, "grouped_gemm", None)
    monkeypatch.setitem(sys.modules, "grouped_gemm.backend", None)
    gmm.grouped_gemm_backend.cache_clear()
    yield
    gmm.grouped_gemm_backend.cache_clear()


@pytest.fixture
def fake_grouped_gemm(monkeypatch):
    """A stand-in ``grouped_gemm`` whose backend.gmm is a float64 loop on the CPU."""
    package = types.ModuleType("grouped_gemm")
    backend = types.ModuleType("grouped_gemm.backend")
    calls = []

    def fake_gmm(a, b, batch_sizes, trans_a, trans_b, c=None):
        calls.append((batch_sizes.device.type, batch_sizes.dtype, trans_a, trans_b))
        if trans_a:
            return loop_weight_grad(a, b, batch_sizes).to(a.dtype)
        return loop_gmm(a, b, batch_sizes, trans_b).to(a.dtype)

    backend.gmm = fake_gmm
    package.backend = backend
    monkeypatch.setitem(sys.modules, "grouped_gemm", package)
    monkeypatch.setitem(sys.modules, "grouped_gemm.backend", backend)
    gmm.grouped_gemm_backend.cache_clear()
    yield calls
    gmm.grouped_gemm_backend.cache_clear()


# ---------------------------------------------------------------- availability and registration


@pytest.mark.skipif(torch.version.cuda is not None, reason="a CPU-only torch")
def test_unavailable_on_cpu_torch_with_a_reason(monkeypatch):
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    try:
        record = megablocks_core.reload({}).plugins["cuda"]
    finally:
        megablocks_core.reload({})
    assert record.status == "unavailable"
    assert "without CUDA" in record.reason
    assert record.distribution == "megablocks-cuda" and record.version == "0.1.0"
    assert set(record.ops) == {*ROUTING, "route", "scatter", "gmm", "gmm_weight_grad", "scaled_gmm"}
    assert extension.loaded() is None  # listing never builds or loads the extension


def test_rocm_torch_is_unavailable(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", "6.4.0", raising=False)
    assert "ROCm" in plugin.megablocks_unavailable_reason()


def test_no_gpu_visible(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    monkeypatch.setattr(torch.version, "cuda", "13.0", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert plugin.megablocks_unavailable_reason() == "no NVIDIA GPU visible"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert plugin.megablocks_unavailable_reason() is None


def test_every_op_is_registered_with_its_variant_and_dtypes():
    kernels = {(k.op, k.variant): k for k in _kernels()}
    expected = (
        {(op, "") for op in ROUTING}
        | {(op, "one-block") for op in ("sort", "route")}
        | {("scatter", "scan")}
        | {(op, v) for op in ("gmm", "gmm_weight_grad") for v in ("grouped_mm", "grouped_gemm")}
        | {("scaled_gmm", "scaled_grouped_mm")}
    )
    assert set(kernels) == expected
    for op in ROUTING:
        k = kernels[(op, "")]
        # Triton's tier, ranked after triton's kernels until measured (above the reference).
        assert k.devices == ("cuda",) and k.tier == plugin.TIER == Tier.GENERIC_ACCELERATOR
        assert k.yields_to == ("triton",)
        assert k.dtypes == {} and k.contiguous  # every dtype of the contract
    for op in ("sort", "route"):
        k = kernels[(op, "one-block")]
        assert k.tier == plugin.MEASURED_FASTER_TIER == Tier.VENDOR  # above triton's routing
        assert k.yields_to == ()
        assert k.dtypes == {} and not k.contiguous and callable(k.supports)  # C++ makes it so
    k = kernels[("scatter", "scan")]
    assert k.tier == Tier.VENDOR and k.yields_to == ()  # above triton's scatter
    assert k.dtypes == {} and not k.contiguous and callable(k.supports)
    for variant in ("grouped_mm", "grouped_gemm"):
        assert kernels[("gmm", variant)].dtypes == {"a": {torch.bfloat16}, "b": {torch.bfloat16}}
        assert kernels[("gmm_weight_grad", variant)].dtypes == {
            "a": {torch.bfloat16},
            "grad": {torch.bfloat16},
        }
        for op in ("gmm", "gmm_weight_grad"):  # triton's tier: the cost hints compare them
            assert kernels[(op, variant)].tier == Tier.GENERIC_ACCELERATOR
            assert kernels[(op, variant)].yields_to == ()


def test_cost_hooks_are_declared_for_the_grouped_gemms():
    # (The FP8 provider takes its calls by shape predicate, in the vendor tier: no cost hint.)
    bf16 = [k for k in plugin.megablocks_grouped_gemm_kernels() if k.op != "scaled_gmm"]
    assert bf16 and all(callable(k.cost) for k in bf16)
    assert all(k.cost is None for k in plugin.megablocks_routing_kernels())


def test_the_plugin_module_does_not_build_anything(monkeypatch):
    def boom():
        raise AssertionError("the extension was loaded")

    monkeypatch.setattr(extension, "_load", boom)
    _kernels()
    plugin.megablocks_unavailable_reason()
    assert plugin.grouped_mm_capability(H200) is None  # gmm providers never need the extension


# ---------------------------------------------------------------- capability per device


def test_grouped_mm_only_on_hopper_and_blackwell():
    assert plugin.grouped_mm_capability(H200) is None
    assert plugin.grouped_mm_capability(B200) is None
    assert "8.0" in plugin.grouped_mm_capability(A100)
    assert "12.0" in plugin.grouped_mm_capability(RTX)
    assert plugin.grouped_mm_capability(MI300) is not None
    assert plugin.grouped_mm_capability(CPU) is not None


def test_grouped_gemm_only_when_importable(no_grouped_gemm):
    assert "not installed" in plugin.grouped_gemm_capability(H200)


def test_grouped_gemm_when_importable(fake_grouped_gemm):
    assert plugin.grouped_gemm_capability(H200) is None
    assert plugin.grouped_gemm_capability(A100) is None
    assert plugin.grouped_gemm_capability(MI300) is not None
    old = dataclasses.replace(A100, capability=(7, 0), arch="sm_70")
    assert "8.0" in plugin.grouped_gemm_capability(old)


def test_extension_capability_reports_why_the_extension_is_missing(monkeypatch):
    monkeypatch.setattr(extension, "_module", None)
    monkeypatch.setattr(extension, "_problem", "no CUDA toolkit to compile it")
    reason = plugin.extension_capability(H200)
    assert reason.startswith("CUDA extension unavailable") and "toolkit" in reason
    assert plugin.extension_capability(MI300).startswith("needs an NVIDIA")


def test_extension_capability_checks_the_build_has_code_for_the_device(monkeypatch):
    fake = types.SimpleNamespace(has_kernel_image=lambda index: index == 0)
    monkeypatch.setattr(extension, "_module", fake)
    assert plugin.extension_capability(H200) is None
    assert "sm_100" in plugin.extension_capability(B200)  # index 1: no code in this build


@pytest.fixture
def one_block_build(monkeypatch):
    """The extension as the capability check and the shape predicates see it, limits included."""
    fake = types.SimpleNamespace(
        has_kernel_image=lambda index: True,
        one_block_limits=lambda: (4096, 1024, 16),
        scan_scatter_max_rows=lambda: 4096,
    )
    monkeypatch.setattr(extension, "_module", fake)


def _ids(n: int) -> TensorMeta:
    return TensorMeta((n,), torch.int32, "cuda")


def _scatter_call(
    rows: int, top_k: int = 8, hidden: int = 2048, dtype: torch.dtype = torch.bfloat16
) -> dict[str, object]:
    return {
        "x": TensorMeta((rows, hidden), dtype, "cuda"),
        "indices": _ids(rows),
        "bin_ids": _ids(rows),
        "weights": TensorMeta((rows,), torch.float32, "cuda"),
        "bins": _ids(64),
        "top_k": top_k,
    }


@pytest.mark.parametrize(
    "op,call,winner",
    [
        ("sort", {"x": _ids(1024), "end_bit": 7}, "cuda/one-block"),
        ("sort", {"x": _ids(4096), "end_bit": 16}, "cuda/one-block"),
        ("sort", {"x": _ids(4097), "end_bit": 7}, "cuda"),  # past one block's keys
        ("sort", {"x": _ids(8), "end_bit": 17}, "cuda"),  # too wide a digit
        ("sort", {"x": _ids(8), "end_bit": None}, "cuda"),
        ("route", {"top_experts": _ids(0), "num_experts": 1, "block_size": 1}, "cuda/one-block"),
        (
            "route",
            {"top_experts": _ids(4096), "num_experts": 1024, "block_size": 128},
            "cuda/one-block",
        ),
        ("route", {"top_experts": _ids(4097), "num_experts": 8, "block_size": 128}, None),
        ("route", {"top_experts": _ids(8), "num_experts": 1025, "block_size": 128}, None),
        ("scatter", _scatter_call(4096), "cuda/scan"),
        ("scatter", _scatter_call(1025, top_k=5), "cuda/scan"),
        ("scatter", _scatter_call(1024), None),  # triton scans these in one launch
        ("scatter", _scatter_call(4104), None),  # past the scan scatter's rows
        ("scatter", _scatter_call(2052, top_k=2), None),  # 1026 tokens: too many scans
        ("scatter", _scatter_call(2048, hidden=2049), None),  # rows past 4 KiB
        ("scatter", _scatter_call(2048, hidden=1024, dtype=torch.float32), "cuda/scan"),
        ("scatter", _scatter_call(2048, hidden=1025, dtype=torch.float32), None),
    ],
)
def test_one_block_kernels_take_the_small_calls(one_block_build, op, call, winner):
    dtypes = {name: v.dtype for name, v in call.items() if isinstance(v, TensorMeta)}
    trace = rank(_registry(), op, H200, dtypes)
    kernel, why, error = for_call(trace, call)
    if winner is None:  # the cuda backend has no other kernel: a larger call is another backend's
        assert kernel is None and ("one-block route" in error or "scan scatter" in error)
    else:
        assert kernel is not None and kernel.label == winner, why


def test_ranking_per_simulated_device(no_grouped_gemm):
    registry = _registry()
    for op, dtypes in (
        ("gmm", BF16_GMM),
        ("gmm_weight_grad", {"a": torch.bfloat16, "grad": torch.bfloat16}),
    ):
        for device in (H200, B200):
            trace = rank(registry, op, device, dtypes)
            assert trace.winner is not None and trace.winner.variant == "grouped_mm", (
                trace.candidates
            )
        for device in (A100, MI300, CPU):
            assert rank(registry, op, device, dtypes).winner is None
    fp16 = rank(registry, "gmm", H200, {"a": torch.float16, "b": torch.float16})
    assert fp16.winner is None and "bfloat16" in fp16.candidates[0].reason


def test_ranking_on_an_a100_with_grouped_gemm(fake_grouped_gemm):
    trace = rank(_registry(), "gmm", A100, BF16_GMM)
    assert trace.winner.variant == "grouped_gemm"


# ---------------------------------------------------------------- cost hints


def test_efficiency_points_are_measured_per_arch():
    for provider in ("grouped_mm", "grouped_gemm"):
        assert set(tuning.ARCHS["hopper"].measured[provider]) == {"gmm", "gmm_weight_grad"}
        for op in ("gmm", "gmm_weight_grad"):
            # only the H200 was measured
            assert set(tuning.points_by_arch(provider, op)) == {"sm_90"}
            for rows, k, n, fraction in tuning.points_by_arch(provider, op)["sm_90"]:
                assert min(rows, k, n) > 0 and 0 < fraction <= 1


def _measured(provider, rows_per_expert, k, n, op="gmm"):
    points = tuning.points_by_arch(provider, op)["sm_90"]
    return {p[:3]: p[3] for p in points}[(rows_per_expert, k, n)]


def _weight_grad_call(rows_per_expert, k, n, experts):
    return {
        "a": TensorMeta((rows_per_expert * experts, k), torch.bfloat16, "cuda"),
        "grad": TensorMeta((rows_per_expert * experts, n), torch.bfloat16, "cuda"),
        "batch_sizes": TensorMeta((experts,), torch.int32, "cuda"),
    }


def _by_shape(points: Sequence[GmmPoint]) -> dict[tuple[float, float, float], float]:
    """A table's points as ``{(rows_per_expert, k, n): fraction}``; no shape may be listed twice."""
    fractions = {tuple(p[:3]): p[3] for p in points}
    assert len(fractions) == len(points), f"a shape listed twice in {points}"
    return fractions


def test_weight_grad_hints_use_their_own_points() -> None:
    """The weight-gradient hints of megablocks-triton and of grouped_mm estimate a call from the
    weight gradient's own points, not the forward's; at each shape both tables list, the provider
    with the higher efficiency gets the lower estimate, so the choice follows the tables."""
    triton_tuning = pytest.importorskip("megablocks_triton.tuning")
    mm = {
        k.op: k.cost for k in plugin.megablocks_grouped_gemm_kernels() if k.variant == "grouped_mm"
    }
    tables = {
        "triton": triton_tuning.MEASURED,
        "grouped_mm": {
            op: tuning.points_by_arch("grouped_mm", op) for op in triton_tuning.MEASURED
        },
    }
    hints = {"triton": triton_tuning.COST_HINTS, "grouped_mm": mm}
    experts = 8  # every estimate scales with the experts alike: the choice does not depend on it
    wgrad: dict[str, dict[tuple[float, float, float], float]] = {}
    for name, table in tables.items():
        forward = _by_shape(table["gmm"]["sm_90"])
        wgrad[name] = _by_shape(table["gmm_weight_grad"]["sm_90"])
        for (rows, k, n), fraction in [*forward.items(), *wgrad[name].items()]:
            assert min(rows, k, n) > 0 and 0 < fraction <= 1, (name, rows, k, n)
        for (rows, k, n), fraction in wgrad[name].items():
            shape = (rows, k, n, experts)
            got = hints[name]["gmm_weight_grad"](H200, _weight_grad_call(*shape))
            assert got == pytest.approx(_dense_us(*shape) / fraction), (name, shape)
            if forward.get((rows, k, n), fraction) != fraction:  # the forward measured otherwise
                assert got != pytest.approx(hints[name]["gmm"](H200, _call(*shape))), name
    common = sorted(wgrad["triton"].keys() & wgrad["grouped_mm"].keys())
    assert common, "no weight-gradient shape in both tables: nothing to choose between"
    for rows, k, n in common:
        fractions = {name: points[(rows, k, n)] for name, points in wgrad.items()}
        if fractions["triton"] == fractions["grouped_mm"]:
            continue  # a tie: either choice is right
        call = _weight_grad_call(rows, k, n, experts)
        estimates = {name: hint["gmm_weight_grad"](H200, call) for name, hint in hints.items()}
        faster = max(fractions, key=fractions.get)
        assert min(estimates, key=estimates.get) == faster, ((rows, k, n), estimates)


def _call(rows_per_expert, k, n, experts, sizes_on="cuda"):
    return {
        "a": TensorMeta((rows_per_expert * experts, k), torch.bfloat16, "cuda"),
        "b": TensorMeta((experts, k, n), torch.bfloat16, "cuda"),
        "batch_sizes": TensorMeta((experts,), torch.int32, sizes_on),
        "trans_b": False,
    }


def _dense_us(rows_per_expert, k, n, experts):
    return 2.0 * rows_per_expert * experts * k * n / (tuning.dense_tflops_by_arch()["sm_90"] * 1e6)


def test_costs_follow_the_measured_efficiency():
    hints = {k.variant: k.cost for k in plugin.megablocks_grouped_gemm_kernels() if k.op == "gmm"}
    mm, gg = hints["grouped_mm"], hints["grouped_gemm"]
    small = (1024, 2048, 768, 128)  # qwen3-like: one of the measured points
    eff_mm, eff_gg = _measured("grouped_mm", *small[:3]), _measured("grouped_gemm", *small[:3])
    assert mm(H200, _call(*small)) == pytest.approx(_dense_us(*small) / eff_mm)
    assert gg(H200, _call(*small, sizes_on="cpu")) == pytest.approx(_dense_us(*small) / eff_gg)
    # device-side counts: grouped_gemm would sync the host, so it offers no estimate
    assert gg(H200, _call(*small)) is None
    big = (4096, 4096, 14336, 8)  # mixtral-like: grouped_gemm measured faster than grouped_mm
    assert gg(H200, _call(*big, sizes_on="cpu")) < mm(H200, _call(*big))
    assert mm(H200, _call(*small)) < mm(H200, _call(*big))
    # never measured there, or not NVIDIA: no estimate, priorities decide
    assert mm(B200, _call(*big)) is None and gg(A100, _call(*big, sizes_on="cpu")) is None
    assert mm(MI300, _call(*big)) is None and mm(CPU, _call(*big)) is None


def test_cost_picks_the_provider_per_shape_on_an_h200(fake_grouped_gemm):
    trace = rank(_registry(), "gmm", H200, BF16_GMM)
    assert {k.variant for k in trace.cost_tier} == {"grouped_mm", "grouped_gemm"}
    assert for_call(trace, _call(1024, 2048, 768, 128, "cpu"))[0].variant == "grouped_mm"
    assert for_call(trace, _call(4096, 4096, 14336, 8, "cpu"))[0].variant == "grouped_gemm"
    # Device-side counts: never the provider that would copy them to the host.
    assert for_call(trace, _call(4096, 4096, 14336, 8))[0].variant == "grouped_mm"


@pytest.mark.parametrize(
    "k,n,accepted",
    [(4096, 768, True), (100, 768, False), (4096, 36, False), (8, 8, True), (12, 8, False)],
)
def test_grouped_mm_declines_shapes_without_16_byte_rows(no_grouped_gemm, k, n, accepted):
    # (k, n) in bf16: rows of a, b and the output are 16-byte aligned only for multiples of 8.
    call = _call(64, k, n, 4)
    reason = plugin.grouped_mm_supports(H200, call)
    assert (reason is None) == accepted
    winner, why, error = for_call(rank(_registry(), "gmm", H200, BF16_GMM), call)
    if accepted:
        assert winner is not None and winner.variant == "grouped_mm"
    else:  # the cuda backend alone here: nothing else can take it, and the error says why
        assert (
            winner is None
            and "16-byte rows" in error
            and (f"K = {k}" in error or f"N = {n}" in error)
        )


# ---------------------------------------------------------------- grouped_mm kernels on the CPU


def loop_gmm(a, b, sizes, trans_b):
    out = torch.zeros(a.shape[0], b.shape[1] if trans_b else b.shape[2], dtype=torch.float64)
    start = 0
    for e, s in enumerate(sizes.tolist()):
        w = b[e].double().t() if trans_b else b[e].double()
        out[start : start + s] = a[start : start + s].double() @ w
        start += s
    return out


def loop_weight_grad(a, grad, sizes):
    out = torch.zeros(sizes.shape[0], a.shape[1], grad.shape[1], dtype=torch.float64)
    start = 0
    for e, s in enumerate(sizes.tolist()):
        out[e] = a[start : start + s].double().t() @ grad[start : start + s].double()
        start += s
    return out


def _problem(m, k, n, sizes, dtype, trans_b=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    sizes = torch.tensor(sizes, dtype=torch.int64)
    assert int(sizes.sum()) == m
    a = torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(len(sizes), *((n, k) if trans_b else (k, n)), generator=g).to(dtype)
    grad = torch.randn(m, n, generator=g).to(dtype)
    return a, b, grad, sizes


SHAPES = [  # (m, k, n, sizes): aligned, unaligned K and N, empty experts, one expert
    (48, 16, 24, [10, 0, 30, 8]),
    (37, 13, 5, [0, 20, 17]),
    (64, 40, 8, [64]),
    (20, 8, 16, [0, 0, 20, 0]),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("m,k,n,sizes", SHAPES)
def test_grouped_mm_gmm_on_cpu(dtype, trans_b, m, k, n, sizes):
    a, b, _, sizes_t = _problem(m, k, n, sizes, dtype, trans_b, seed=m + k)
    for batch_sizes in (sizes_t, sizes_t.to(torch.int32)):
        out = gmm.grouped_mm_gmm(a, b, batch_sizes, trans_b)
        assert out.dtype == dtype and out.shape == (m, n) and out.is_contiguous()
        tol = (
            {"rtol": 2e-2, "atol": 5e-2}
            if dtype == torch.bfloat16
            else {"rtol": 1e-4, "atol": 1e-4}
        )
        torch.testing.assert_close(out.double(), loop_gmm(a, b, sizes_t, trans_b), **tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m,k,n,sizes", SHAPES)
def test_grouped_mm_weight_grad_on_cpu(dtype, m, k, n, sizes):
    a, _, grad, sizes_t = _problem(m, k, n, sizes, dtype, seed=m * k)
    out = gmm.grouped_mm_gmm_weight_grad(a, grad, sizes_t)
    assert out.dtype == dtype and out.shape == (len(sizes), k, n)
    tol = {"rtol": 2e-2, "atol": 1e-1} if dtype == torch.bfloat16 else {"rtol": 1e-4, "atol": 1e-4}
    torch.testing.assert_close(out.double(), loop_weight_grad(a, grad, sizes_t), **tol)
    for e, s in enumerate(sizes):
        if s == 0:
            assert torch.equal(out[e], torch.zeros_like(out[e]))  # exact zeros, not just close


def test_weight_grad_ignores_rows_past_the_groups():
    a, _, grad, sizes = _problem(40, 16, 8, [10, 0, 30], torch.float32)
    want = gmm.grouped_mm_gmm_weight_grad(a, grad, sizes)
    # Extra garbage rows after sum(batch_sizes) (a worst-case-sized buffer) must change nothing.
    junk_a = torch.cat([a, torch.full((7, 16), 1e6)])
    junk_g = torch.cat([grad, torch.full((7, 8), float("nan"))])
    assert torch.equal(gmm.grouped_mm_gmm_weight_grad(junk_a, junk_g, sizes), want)


def test_device_side_style_empty_expert_masking():
    out = torch.ones(3, 2, 2)
    gmm._zero_empty_experts(out, torch.tensor([4, 0, 1]))
    assert out[1].eq(0).all() and out[0].eq(1).all() and out[2].eq(1).all()


@pytest.mark.parametrize("k,n", [(0, 8), (8, 0)])
def test_grouped_mm_degenerate_sizes(k, n):
    a, b, grad, sizes = _problem(6, k, n, [6, 0], torch.float32)
    assert torch.equal(gmm.grouped_mm_gmm(a, b, sizes, False), torch.zeros(6, n))
    assert torch.equal(gmm.grouped_mm_gmm_weight_grad(a, grad, sizes), torch.zeros(2, k, n))
    empty = torch.zeros(0, 8)
    assert gmm.grouped_mm_gmm(empty, torch.zeros(2, 8, 4), torch.tensor([0, 0]), False).shape == (
        0,
        4,
    )


def test_grouped_gemm_provider_passes_host_int64_sizes(fake_grouped_gemm):
    a, b, grad, sizes = _problem(30, 8, 16, [0, 12, 18], torch.float32)
    out = gmm.grouped_gemm_gmm(a, b, sizes.to(torch.int32), False)
    torch.testing.assert_close(out.double(), loop_gmm(a, b, sizes, False))
    wg = gmm.grouped_gemm_gmm_weight_grad(a, grad, sizes)
    assert torch.equal(wg[0], torch.zeros_like(wg[0]))
    assert fake_grouped_gemm == [
        ("cpu", torch.int64, False, False),
        ("cpu", torch.int64, True, False),
    ]


@pytest.mark.parametrize("trans_b", [False, True])
def test_grouped_mm_gmm_zeroes_rows_past_host_sizes(trans_b):
    """Host (CPU) sizes summing short of the rows are valid: the rows past the last group belong
    to no group and come out 0, whatever the output buffer held (torch's grouped mm leaves them
    unwritten)."""
    a, b, _, sizes = _problem(18, 8, 16, [7, 0, 11], torch.float32, trans_b, seed=5)
    a = torch.cat([a, torch.full((12, 8), 1e6)])  # rows past the groups: large, must not leak
    out = gmm.grouped_mm_gmm(a, b, sizes, trans_b)
    assert out.shape == (30, 16)
    assert torch.equal(out[18:], torch.zeros(12, 16))
    torch.testing.assert_close(
        out[:18].double(), loop_gmm(a[:18], b, sizes, trans_b), rtol=1e-4, atol=1e-4
    )


def test_grouped_gemm_provider_hands_short_host_sizes_to_grouped_mm(fake_grouped_gemm):
    """grouped_gemm needs groups covering every row: sizes summing short go to grouped_mm."""
    a, b, grad, sizes = _problem(22, 8, 16, [0, 12, 10], torch.float32)
    a, grad = torch.cat([a, torch.randn(8, 8)]), torch.cat([grad, torch.randn(8, 16)])
    out = gmm.grouped_gemm_gmm(a, b, sizes, False)
    assert torch.equal(out[22:], torch.zeros(8, 16))
    tol = {"rtol": 1e-4, "atol": 1e-4}
    torch.testing.assert_close(out[:22].double(), loop_gmm(a[:22], b, sizes, False), **tol)
    wg = gmm.grouped_gemm_gmm_weight_grad(a, grad, sizes)
    torch.testing.assert_close(wg.double(), loop_weight_grad(a[:22], grad[:22], sizes), **tol)
    assert fake_grouped_gemm == []


# ---------------------------------------------------------------- torch._scaled_grouped_mm

E4M3 = torch.float8_e4m3fn
SCALED_FP8 = {"a": E4M3, "b": E4M3, "a_scale": torch.float32, "b_scale": torch.float32}


def _scaled_call(rows_per_expert, k, n, experts, trans_b=True, out_dtype=None):
    b = (experts, n, k) if trans_b else (experts, k, n)
    return {
        "a": TensorMeta((rows_per_expert * experts, k), E4M3, "cuda"),
        "b": TensorMeta(b, E4M3, "cuda"),
        "batch_sizes": TensorMeta((experts,), torch.int32, "cuda"),
        "trans_b": trans_b,
        "format": "fp8_rowwise",
        "out_dtype": out_dtype,
    }


def test_scaled_grouped_mm_is_declared_for_fp8_rowwise_only():
    (k,) = [k for k in _kernels() if k.variant == "scaled_grouped_mm"]
    assert k.op == "scaled_gmm" and k.formats == ("fp8_rowwise",) and k.contiguous
    assert k.dtypes == {"a": {E4M3}, "b": {E4M3}}  # OCP data only: no FNUZ on NVIDIA
    assert k.tier == plugin.MEASURED_FASTER_TIER == Tier.VENDOR  # above triton, where it takes


def test_scaled_grouped_mm_only_where_it_was_measured():
    assert plugin.scaled_grouped_mm_capability(H200) is None
    for device in (B200, A100, RTX, MI300, CPU):  # Blackwell: unmeasured, so not claimed
        assert plugin.scaled_grouped_mm_capability(device) is not None


@pytest.mark.parametrize(
    ("call", "accepted"),
    [
        (_scaled_call(4096, 4096, 14336, 8), True),  # Mixtral's up projection
        (_scaled_call(512, 14336, 4096, 8), True),  # Mixtral's down, 512 rows per expert
        (_scaled_call(512, 2048, 7168, 256), False),  # DeepSeek-V3's down: triton's is faster
        (_scaled_call(2048, 2880, 2880, 32), False),  # GPT-OSS's 32 experts: triton's is faster
        (_scaled_call(4096, 4096, 14336, 16), False),  # 16 experts: not measured
        (_scaled_call(1024, 2048, 1536, 128), False),  # Qwen3's widths: triton's is faster
        (_scaled_call(64, 7168, 4096, 256), False),  # 64 rows per expert: triton's is faster
        (_scaled_call(4096, 1024, 2048, 8), False),  # k = 1024
        (_scaled_call(4096, 4096, 14336, 8, trans_b=False), False),  # b stored (E, k, n)
        (_scaled_call(4096, 4096, 14336, 8, out_dtype="float32"), False),
        (_scaled_call(4096, 4104, 14336, 8), False),  # k not a multiple of 16
    ],
)
def test_scaled_grouped_mm_takes_the_calls_measured_faster(call, accepted):
    assert (plugin.scaled_grouped_mm_supports(H200, call) is None) == accepted


def test_scaled_gmm_goes_to_torch_or_triton_per_shape_on_an_h200():
    triton_like = megablocks_core.Kernel(
        op="scaled_gmm",
        fn=lambda *args: None,
        devices=("cuda",),
        tier=Tier.GENERIC_ACCELERATOR,
        formats=("fp8_rowwise", "fp8_blockwise"),
        backend="triton",
    )
    records = dict(_registry().plugins)
    records["triton"] = PluginRecord(
        "triton", "megablocks-triton", "0.1.0", "ok", None, (triton_like,)
    )
    trace = rank(Registry(records), "scaled_gmm", H200, SCALED_FP8)
    assert for_call(trace, _scaled_call(4096, 4096, 14336, 8))[0].backend == "cuda"
    assert for_call(trace, _scaled_call(1024, 2048, 1536, 128))[0].backend == "triton"
    blockwise = {**_scaled_call(4096, 4096, 14336, 8), "format": "fp8_blockwise"}
    assert for_call(trace, blockwise)[0].backend == "triton"


def test_scaled_grouped_mm_gmm_refuses_what_ranking_never_sends():
    a = torch.zeros(4, 32, dtype=E4M3)
    with pytest.raises(ValueError, match="trans_b=True"):
        gmm.scaled_grouped_mm_gmm(
            a, torch.ones(4, 1), torch.zeros(2, 32, 32, dtype=E4M3), torch.ones(2, 1, 32),
            torch.tensor([2, 2]), False, "fp8_rowwise", None,
        )  # fmt: skip
    empty = gmm.scaled_grouped_mm_gmm(
        a[:0], torch.ones(0, 1), torch.zeros(2, 16, 32, dtype=E4M3), torch.ones(2, 16, 1),
        torch.tensor([0, 0]), True, "fp8_rowwise", None,
    )  # fmt: skip
    assert empty.shape == (0, 16) and empty.dtype == torch.bfloat16
