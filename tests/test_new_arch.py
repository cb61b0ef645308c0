"""A new GPU arch is one row per backend's table, nothing else.

Each backend keeps its per-arch facts in one table keyed by arch family (megablocks-triton:
``config.ARCHS``; megablocks-cuda: ``tuning.ARCHS``; megablocks-rocm: ``arch.FAMILIES``), the dense
rate its cost hints measure against included: the core holds no tuning. Here a hypothetical
``sm_120`` family ("rtx-blackwell", the RTX 5090 of ``device_infos``) is added to the tables at run
time, and the triton launch policy, the cost hints and ``megablocks backends explain`` pick it up
with no other change; likewise a hypothetical AMD family for megablocks-rocm's launch policy.
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType

import pytest
import torch
from device_infos import H200, MI300, RTX5090

import megablocks_core as mb
from megablocks_core import dispatch
from megablocks_core.plugin import TensorMeta

pytest.importorskip("triton")

from megablocks_triton import arch_table, config, tuning

FAMILY = "rtx-blackwell"
DENSE = 210.0  # made up: what the points below are fractions of
TRITON_POINTS = ((1024, 2048, 768, 0.5), (4096, 4096, 14336, 0.8))
TILES = {
    ("gmm", "16bit"): config.GmmConfig(128, 128, 64, group_m=8, num_warps=4, num_stages=2),
    ("gmm", "fp32"): config.GmmConfig(64, 64, 32, group_m=8, num_warps=4, num_stages=2),
    ("wgrad", "16bit"): config.GmmConfig(128, 64, 64, group_m=8, num_warps=4, num_stages=2),
    ("wgrad", "fp32"): config.GmmConfig(64, 64, 32, group_m=8, num_warps=4, num_stages=2),
}


@pytest.fixture
def triton_row(monkeypatch):
    """megablocks-triton's table with the new family's row (and nothing else changed)."""
    row = config.ArchTuning(
        kind="cuda",
        archs=("sm_120",),
        gmm_tiles=MappingProxyType(TILES),
        dense_bf16_tflops=DENSE,
        measured=MappingProxyType({"gmm": TRITON_POINTS, "gmm_weight_grad": TRITON_POINTS}),
        gmm_small_n_stages=3,  # a data-driven adjustment, as Hopper's
    )
    table = MappingProxyType({**config.ARCHS, FAMILY: row})
    # The table's lookups read arch_table.ARCHS; the policy's LaunchConfigs.gmm reads config's.
    monkeypatch.setattr(arch_table, "ARCHS", table)
    monkeypatch.setattr(config, "ARCHS", table)
    return row


def gmm_call(tokens: int, experts: int, k: int, n: int) -> dict[str, object]:
    return {
        "a": TensorMeta((tokens, k), torch.float16, "cuda"),
        "b": TensorMeta((experts, k, n), torch.float16, "cuda"),
        "batch_sizes": TensorMeta((experts,), torch.int64, "cpu"),
        "trans_b": False,
        "bias": None,
    }


def _dense_us(call: dict[str, object], efficiency: float) -> float:
    tokens, k = call["a"].shape  # type: ignore[attr-defined]
    n = call["b"].shape[2]  # type: ignore[attr-defined]
    return 2.0 * tokens * k * n / (efficiency * DENSE * 1e6)


def test_without_its_row_the_arch_gets_generic_tiles_and_no_estimate():
    assert config.gmm_tile_family(RTX5090) == "cuda"
    call = gmm_call(8 * 1024, 8, 2048, 768)
    assert tuning.COST_HINTS["gmm"](RTX5090, call) is None
    assert tuning.COST_HINTS["gmm"](H200, call) is not None


def test_the_launch_policy_reads_the_new_row(triton_row):
    assert config.gmm_tile_family(RTX5090) == FAMILY
    assert config.arch_tuning(RTX5090) is triton_row
    assert config.gmm_tile_family(H200) == "hopper"  # the other rows are untouched
    policy = config.LaunchConfigs()
    # Large problem: the row's tiles as declared, but for the row's few-columns adjustment.
    got = policy.gmm(RTX5090, 8 * 4096, 4096, 4096, 8, torch.bfloat16)
    assert got == TILES[("gmm", "16bit")]
    few_columns = policy.gmm(RTX5090, 8 * 4096, 1024, 4096, 8, torch.bfloat16)
    assert few_columns == dataclasses.replace(TILES[("gmm", "16bit")], num_stages=3)
    assert policy.gmm(RTX5090, 8 * 4096, 4096, 4096, 8, torch.float32) == TILES[("gmm", "fp32")]
    wgrad = policy.gmm_wgrad(RTX5090, 4096, 4096, 8 * 4096, 8, torch.bfloat16)
    assert wgrad == TILES[("wgrad", "16bit")]
    assert not wgrad.warp_specialized  # the row does not declare the Gluon path


def test_the_gmm_module_chooses_the_new_rows_tiles(triton_row):
    gmm = pytest.importorskip("megablocks_triton.gmm")
    got = gmm.choose_config("gmm", 8 * 4096, 4096, 4096, 8, torch.bfloat16, RTX5090)
    assert got == TILES[("gmm", "16bit")]
    # No Gluon weight gradient there: the row does not say it runs.
    assert gmm.warp_specialized_capability(RTX5090) is not None


def test_the_cost_hints_use_the_rows_points_and_dense_rate(triton_row):
    assert tuning.DENSE_BF16_TFLOPS["sm_120"] == DENSE
    call = gmm_call(8 * 1024, 8, 2048, 768)  # nearest point: (1024, 2048, 768, 0.5)
    assert tuning.COST_HINTS["gmm"](RTX5090, call) == pytest.approx(_dense_us(call, 0.5))


def test_the_cuda_providers_hint_reads_its_own_new_row(monkeypatch):
    cuda_tuning = pytest.importorskip("megablocks_cuda.tuning")
    from megablocks_cuda import plugin as cuda

    points = ((1024, 2048, 768, 0.25),)
    row = cuda_tuning.ArchTuning(
        archs=("sm_120",), dense_bf16_tflops=DENSE, measured={"grouped_mm": {"gmm": points}}
    )
    call = gmm_call(8 * 1024, 8, 2048, 768)

    def hint():
        kernels = cuda.megablocks_grouped_gemm_kernels()
        return next(k.cost for k in kernels if k.op == "gmm" and k.variant == "grouped_mm")

    assert hint()(RTX5090, call) is None
    monkeypatch.setattr(cuda_tuning, "ARCHS", MappingProxyType({**cuda_tuning.ARCHS, FAMILY: row}))
    assert hint()(RTX5090, call) == pytest.approx(_dense_us(call, 0.25))


@pytest.fixture
def triton_on_a_gpu_host(plugins, monkeypatch):
    """The triton backend loaded as on an NVIDIA host (ranking only: nothing runs)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    yield plugins
    monkeypatch.undo()  # before the plugins fixture reloads the normal registry


def test_explain_shows_the_estimate_on_the_new_arch(triton_on_a_gpu_host, triton_row):
    registry = triton_on_a_gpu_host.reload({"MEGABLOCKS_PLUGINS": "reference,triton"})
    assert registry.plugins["triton"].status == "ok", registry.plugins["triton"].reason
    trace = mb.explain("gmm", RTX5090, {"a": torch.float16, "b": torch.float16})
    reasons = [(c.kernel.label, c.reason) for c in trace.candidates]
    assert trace.winner is not None and trace.winner.backend == "triton", reasons
    call = gmm_call(8 * 1024, 8, 2048, 768)
    # The kernel explain chose declares the estimate the new row gives (what ranking compares
    # with another provider of the tier, e.g. a grouped_mm row of megablocks-cuda's table).
    assert trace.winner.cost is not None
    assert trace.winner.cost(trace.device, call) == pytest.approx(_dense_us(call, 0.5))
    kernel, _ = dispatch.explain_call(trace, call)
    assert kernel is not None and kernel.backend == "triton"


def test_a_new_amd_family_is_one_row_of_the_rocm_table(monkeypatch):
    """megablocks-rocm: a hypothetical next CDNA part (gfx1250 here) served by adding one
    ``arch.FAMILIES`` row, tiles included; the launch policy and the HIP options read it."""
    rocm_arch = pytest.importorskip("megablocks_rocm.arch")
    from megablocks_rocm.launch import RocmLaunchConfigs

    device = dataclasses.replace(MI300, name="AMD Instinct (next)", arch="gfx1250")
    assert rocm_arch.unsupported(device) is not None  # no row: left to triton's defaults
    tile = rocm_arch.Tile(128, 256, 64, group_m=4, num_warps=8, num_stages=2)
    row = rocm_arch.Family(
        "cdna-next", ("gfx1250",), "hypothetical", lds_kib=160, kpack=2,
        gmm_tiles=MappingProxyType({"16bit": tile}),
    )  # fmt: skip
    monkeypatch.setattr(rocm_arch, "FAMILIES", MappingProxyType({**rocm_arch.FAMILIES, "x": row}))
    assert rocm_arch.unsupported(device) is None
    assert rocm_arch.launch_options(device, "gmm")["kpack"] == 2
    policy = RocmLaunchConfigs(device)
    got = policy.gmm(device, 8 * 4096, 4096, 4096, 8, torch.bfloat16)
    assert got == config.GmmConfig(128, 256, 64, group_m=4, num_warps=8, num_stages=2)
    # A dtype class the row does not list keeps the triton backend's portable AMD tiles.
    portable = config.LaunchConfigs().gmm(device, 8 * 4096, 4096, 4096, 8, torch.float32)
    assert policy.gmm(device, 8 * 4096, 4096, 4096, 8, torch.float32) == portable
