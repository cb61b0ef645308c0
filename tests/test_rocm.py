"""The ``rocm`` backend, proven with SIMULATED AMD devices (no AMD GPU has run this code).

Devices are :class:`DeviceInfo` records as megablocks_core.devices builds them on ROCm (kind
"rocm", gfx arch, CU count, wavefront 64); the plugin's availability is simulated by setting
``torch.version.hip`` and ``torch.cuda.is_available``; kernels run on CPU tensors under
TRITON_INTERPRET=1 with the device description patched, and every launch is recorded.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from importlib import metadata

import device_infos
import pytest
import torch
from fake_plugins import routing_inputs
from megablocks_reference import kernels as reference

import megablocks_core as mb
from megablocks_core import DeviceInfo
from megablocks_core.contracts import BY_NAME

triton = pytest.importorskip("triton")
from megablocks_rocm import arch, plugin  # noqa: E402
from megablocks_rocm import kernels as rocm_kernels  # noqa: E402
from megablocks_rocm import launch as rocm_launch  # noqa: E402
from megablocks_rocm.launch import RocmLaunchConfigs  # noqa: E402
from megablocks_triton import config as tconfig  # noqa: E402
from megablocks_triton import gmm as tgmm  # noqa: E402
from megablocks_triton import gmm_configs as tgmm_configs  # noqa: E402


def amd(arch_name: str, cus: int, name: str) -> DeviceInfo:
    return DeviceInfo(
        kind="rocm",
        type="cuda",
        index=0,
        name=name,
        arch=arch_name,
        runtime="6.4.43482",
        warp_size=64,
        multiprocessors=cus,
    )


MI250X = amd("gfx90a", 110, "AMD Instinct MI250X")  # one GCD
MI300X = amd("gfx942", 304, "AMD Instinct MI300X")
MI355X = amd("gfx950", 256, "AMD Instinct MI355X")
# The shared descriptions (tests/device_infos.py) with the runtime versions these tests report.
RX7900 = dataclasses.replace(device_infos.RX7900, runtime="6.4.43482")
H200 = dataclasses.replace(device_infos.H200, runtime="13.0")
TUNED = [MI250X, MI300X, MI355X]
KINDS = tconfig.KERNEL_KINDS
#: Every keyword the rocm policy may pass to a launch: options of Triton's HIP backend only
#: (checked against the installed triton below).
HIP_ONLY_OPTIONS = frozenset({"waves_per_eu", "matrix_instr_nonkdim", "kpack"})

try:
    from triton.backends.amd.compiler import HIPOptions
    from triton.backends.nvidia.compiler import CUDAOptions
except ImportError:  # pragma: no cover - a triton without both backends
    HIPOptions = CUDAOptions = None


def _fields(options_cls) -> set[str]:
    return {f.name for f in dataclasses.fields(options_cls)}


# ---------------------------------------------------------------------------
# detection: arch -> family


@pytest.mark.parametrize(
    ("gfx", "family"),
    [
        ("gfx90a", "cdna2"),
        ("gfx942", "cdna3"),
        ("gfx950", "cdna4"),
        ("gfx942:sramecc+:xnack-", "cdna3"),
        ("gfx1100", "generic"),
        ("gfx908", "generic"),
        (None, "generic"),
    ],
)
def test_arch_family(gfx, family):
    assert arch.family(gfx).name == family


def test_capability_accepts_tuned_archs_only():
    for dev in TUNED:
        assert arch.unsupported(dev) is None
    reason = arch.unsupported(RX7900)
    assert "gfx1100" in reason and "triton backend" in reason
    assert "wavefronts" in arch.unsupported(dataclasses.replace(MI300X, warp_size=32))


def test_unavailable_with_a_clear_reason_off_rocm(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", None)
    assert "torch.version.hip is None" in plugin.megablocks_unavailable_reason()
    monkeypatch.setattr(torch.version, "hip", "6.4.43482")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "no AMD GPU visible" in plugin.megablocks_unavailable_reason()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert plugin.megablocks_unavailable_reason() is None


@pytest.mark.skipif(bool(torch.version.hip), reason="this host runs a ROCm build of torch")
def test_listed_unavailable_on_this_host(clean_env):
    record = mb.registry().plugins["rocm"]
    assert record.status == "unavailable" and "torch.version.hip is None" in record.reason
    assert record.device_kinds == ("rocm",)


# ---------------------------------------------------------------------------
# ranking on simulated devices


CUDA_ONLY = """
@hookimpl
def megablocks_permutation_kernels():
    return [Kernel(op="gather", fn=recording("gather"), devices=("cuda",), tier=Tier.SPECIALISED)]


@hookimpl
def megablocks_grouped_gemm_kernels():
    return [Kernel(op="gmm", fn=recording("gmm"), devices=("cuda",), tier=Tier.SPECIALISED,
                   variant="grouped_mm")]
"""


@pytest.fixture
def on_rocm_host(plugins, monkeypatch):
    """A registry loaded as on a ROCm host: rocm available, a CUDA-only fake plugin, and the
    megablocks-cuda plugin when it is installed."""
    monkeypatch.setattr(torch.version, "hip", "6.4.43482")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    plugins.add("cudaonly", CUDA_ONLY)
    names = ["reference", "triton", "rocm", "cudaonly"]
    if "cuda" in {ep.name for ep in metadata.entry_points(group="megablocks.backends")}:
        names.append("cuda")
    registry = plugins.reload({"MEGABLOCKS_PLUGINS": ",".join(names)})
    assert registry.plugins["rocm"].status == "ok", registry.plugins["rocm"]
    yield registry
    monkeypatch.undo()  # before the plugins fixture reloads the normal registry


def _triton_ops(registry) -> list[str]:
    return sorted(registry.plugins["triton"].ops)


@pytest.mark.parametrize("device", TUNED, ids=lambda d: d.arch)
def test_every_triton_op_goes_to_rocm_on_tuned_archs(on_rocm_host, device):
    ops = _triton_ops(on_rocm_host)
    assert len(ops) >= 19 and set(ops) == set(on_rocm_host.plugins["rocm"].ops)
    for op in ops:
        trace = mb.dispatch.explain(op, device)
        triton = [c for c in trace.candidates if c.kernel.backend == "triton"]
        if not any(c.accepted for c in triton):  # the arch lacks what the op needs (FP8 on CDNA2)
            rocm = [c for c in trace.candidates if c.kernel.backend == "rocm"]
            assert {c.reason for c in rocm} == {c.reason for c in triton}, (op, device.arch)
            continue
        assert trace.winner is not None and trace.winner.backend == "rocm", (op, trace.why)
        runner_up = [c for c in triton if c.accepted]
        assert runner_up, f"triton must still be able to serve {op} on {device.arch}"


def test_generic_amd_arch_falls_through_to_triton(on_rocm_host):
    trace = mb.dispatch.explain("gather", RX7900)
    assert trace.winner.backend == "triton"
    [rocm] = [c for c in trace.candidates if c.kernel.backend == "rocm"]
    assert not rocm.accepted and "no ROCm launch configuration for gfx1100" in rocm.reason


def test_triton_alone_still_serves_amd(on_rocm_host):
    with mb.use_backend("triton"):
        for op in _triton_ops(on_rocm_host):
            assert mb.dispatch.explain(op, MI300X).winner.backend == "triton"


@pytest.mark.parametrize("device", [*TUNED, RX7900], ids=lambda d: d.arch)
def test_no_cuda_only_kernel_is_ever_chosen_on_rocm(on_rocm_host, device):
    ops = sorted(op for op, c in BY_NAME.items() if c.dispatched)
    for op in ops:
        trace = mb.dispatch.explain(op, device)
        assert trace.winner is not None, (op, trace.error)
        assert trace.winner.serves_kind("rocm"), (op, trace.winner)
        assert trace.winner.backend not in ("cuda", "cudaonly"), (op, trace.winner)
    # The fake's kernels outrank everything, but are rejected for their device kind.
    for op in ("gather", "gmm"):
        [fake] = [
            c for c in mb.dispatch.explain(op, device).candidates if c.kernel.backend == "cudaonly"
        ]
        assert not fake.accepted and fake.reason == "serves cuda, not rocm"


def test_rocm_never_serves_nvidia(on_rocm_host):
    trace = mb.dispatch.explain("gather", H200)
    assert trace.winner.backend == "cudaonly"
    [rocm] = [c for c in trace.candidates if c.kernel.backend == "rocm"]
    assert not rocm.accepted and rocm.reason == "serves rocm, not cuda"


# ---------------------------------------------------------------------------
# launch configurations per arch


def test_launch_options_per_arch_and_kernel():
    dot = {"matrix_instr_nonkdim": 16, "waves_per_eu": 2}
    assert RocmLaunchConfigs(MI300X).launch_options("gmm") == {**dot, "kpack": 2}
    assert RocmLaunchConfigs(MI355X).launch_options("gmm") == dot  # kpack is deprecated on gfx950
    assert RocmLaunchConfigs(MI250X).launch_options("gmm_wgrad") == dot
    for dev in TUNED:
        assert RocmLaunchConfigs(dev).launch_options("permutation") == {"waves_per_eu": 4}
        assert RocmLaunchConfigs(dev).launch_options("routing") == {}
    # Nothing AMD-specific for RDNA or any NVIDIA device; the default policy passes nothing.
    for kind in KINDS:
        assert arch.launch_options(RX7900, kind) == {}
        assert arch.launch_options(H200, kind) == {}
        assert tconfig.LaunchConfigs().launch_options(kind) == {}


def test_permutation_and_routing_shapes_per_arch():
    # Mixtral-like training step: 8192 tokens, hidden 4096, bf16.
    for dev in TUNED:
        cfg = RocmLaunchConfigs(dev).permutation(8192, 4096, 2, 2)
        assert (cfg.block_h, cfg.split_h, cfg.num_warps) == (4096, 1, 2)
    # Decode (16 tokens): rows split until >= 4 programs per CU exist.
    mi300 = RocmLaunchConfigs(MI300X).permutation(16, 4096, 2, 2)
    mi250 = RocmLaunchConfigs(MI250X).permutation(16, 4096, 2, 2)
    assert (mi300.block_h, mi300.split_h) == (512, 8)
    assert 16 * mi250.split_h >= 4 * 110 or mi250.block_h == 512
    # Each lane of a 64-wide wavefront holds <= 32 fp32 accumulator elements (waves_per_eu=4).
    for tokens in (1, 16, 1024, 65536):
        for hidden in (1, 128, 4096, 7168, 16384):
            for size in (2, 4):
                cfg = RocmLaunchConfigs(MI300X).permutation(tokens, hidden, 8, size)
                assert cfg.block_h <= 32 * 64 * cfg.num_warps and cfg.num_warps <= 8
                w = RocmLaunchConfigs(MI300X).scatter_wgrad(tokens, hidden, 8, size)
                assert 8 * w.block_h <= 16 * 64 * w.num_warps
    # Routing: about one tile per CU (power of two at most the CU count).
    assert RocmLaunchConfigs(MI300X).routing(1 << 17, 8).tile == 512  # 256 tiles
    assert RocmLaunchConfigs(MI250X).routing(1 << 17, 8).tile == 2048  # 64 tiles
    assert tconfig.LaunchConfigs().routing(1 << 17, 8).tile == 1024  # the NVIDIA default: 128


GMM_SHAPES = [  # (tokens, n, k, experts): training steps, many small experts, decode, odd sizes
    (32768, 14336, 4096, 8),
    (16384, 768, 2048, 128),
    (8192, 2048, 7168, 256),
    (64, 4096, 4096, 8),
    (1, 24, 40, 1),
    (1000, 100, 36, 3),
    (0, 64, 64, 4),
]


def _pow2_at_least_16(x: int) -> int:
    return max(16, 1 << max(int(x) - 1, 0).bit_length())


@pytest.mark.parametrize("device", TUNED, ids=lambda d: d.arch)
def test_gmm_tiles_fit_a_cdna_cu(device):
    policy = RocmLaunchConfigs(device)
    lds = arch.family(device).lds_kib * 1024
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for tokens, n, k, experts in GMM_SHAPES:
            per_expert = max(tokens // experts, 1)
            for cfg, out_rows, depth in (
                (policy.gmm(device, tokens, n, k, experts, dtype), per_expert, k),
                (policy.gmm_wgrad(device, k, n, tokens, experts, dtype), k, per_expert),
            ):
                assert not cfg.use_tma and cfg.num_stages == 2, cfg
                # A workgroup is at most 1024 lanes = 16 wavefronts of 64.
                assert cfg.num_warps >= 1 and cfg.num_warps * 64 <= 1024, cfg
                # fp32 accumulators per lane: <= 128 (waves_per_eu=2 leaves 256 VGPRs), and no
                # wavefront owns fewer than 8 16x16 MFMA blocks unless there is only one, or
                # fewer would hold more than MAX_OPERAND_VGPRS of a K step's operand tiles.
                per_lane = cfg.block_m * cfg.block_n / (cfg.num_warps * 64)
                fewer = max(cfg.num_warps // 2, 1)
                operands = rocm_launch.operand_vgprs(cfg, dtype, fewer)
                assert per_lane <= 128, cfg
                assert (
                    per_lane >= 32 or cfg.num_warps == 1 or operands > rocm_launch.MAX_OPERAND_VGPRS
                ), cfg
                # One pipeline stage of A and B tiles in LDS.
                assert (cfg.block_m + cfg.block_n) * cfg.block_k * dtype.itemsize <= lds, cfg
                # Never larger than the problem (power-of-two rounded, >= 16 for tl.dot).
                assert cfg.block_m <= _pow2_at_least_16(out_rows), cfg
                assert cfg.block_n <= _pow2_at_least_16(n) and cfg.block_k <= _pow2_at_least_16(
                    depth
                )


@pytest.mark.parametrize("device", TUNED, ids=lambda d: d.arch)
def test_accumulating_weight_gradient_tiles_hold_the_gradient_tile(device):
    # The epilogue keeps the gradient's tile beside the accumulator: at most 256x128 (256x256
    # spilled on CDNA3/4 in `megablocks backends compile`); the new gradient keeps its tiles.
    policy = RocmLaunchConfigs(device)
    for out in (torch.bfloat16, torch.float32):
        cfg = policy.gmm_wgrad_accumulate(device, 2048, 768, 16384, 16, torch.bfloat16, out)
        assert cfg.block_m * cfg.block_n <= rocm_launch.MAX_ACCUMULATE_TILE, cfg
    new = policy.gmm_wgrad(device, 2048, 768, 16384, 16, torch.bfloat16)
    assert (new.block_m, new.block_n) == (
        (128, 128) if arch.family(device).name == "cdna2" else (256, 256)
    )


def test_gmm_tiles_per_family():
    # A large problem gets its family's row tiles as they are (FAMILIES, whatever they are).
    big = (32768, 14336, 4096, 8)
    for device in (MI250X, MI300X, MI355X):
        tile = arch.family(device).gmm_tiles["16bit"]
        cfg = RocmLaunchConfigs(device).gmm(device, *big, torch.bfloat16)
        got = (cfg.block_m, cfg.block_n, cfg.block_k, cfg.group_m, cfg.num_warps, cfg.num_stages)
        assert got == dataclasses.astuple(tile), device.arch
    # Many small experts (64 rows each): 64-row tiles; a smaller tile gets fewer wavefronts
    # (64x256 = 16K fp32 accumulators = 32 per lane over 8 wavefronts; 64x128 over 4).
    cfg = RocmLaunchConfigs(MI300X).gmm(MI300X, 64 * 128, 768, 2048, 128, torch.bfloat16)
    assert (cfg.block_m, cfg.block_n, cfg.num_warps) == (64, 256, 8)
    cfg = RocmLaunchConfigs(MI300X).gmm(MI300X, 64 * 128, 128, 2048, 128, torch.bfloat16)
    assert (cfg.block_m, cfg.block_n, cfg.num_warps) == (64, 128, 4)
    # Not a CDNA part (or not AMD at all): the triton backend's portable defaults.
    for device in (RX7900, H200):
        for shape in ((32768, 14336, 4096, 8), (1000, 100, 36, 3)):
            assert RocmLaunchConfigs(device).gmm(
                device, *shape, torch.bfloat16
            ) == tconfig.LaunchConfigs().gmm(device, *shape, torch.bfloat16)
            assert RocmLaunchConfigs(device).gmm_wgrad(
                device, *shape, torch.float32
            ) == tconfig.LaunchConfigs().gmm_wgrad(device, *shape, torch.float32)


@pytest.mark.parametrize("device", TUNED, ids=lambda d: d.arch)
def test_gmm_tiles_reach_choose_config_under_the_rocm_policy(device, monkeypatch):
    monkeypatch.delenv("MEGABLOCKS_TRITON_GMM_CONFIG", raising=False)
    monkeypatch.delenv("MEGABLOCKS_TRITON_GMM_WGRAD_CONFIG", raising=False)
    policy = RocmLaunchConfigs(device)
    with tconfig.use_launch_configs(policy):
        assert tgmm.choose_config("gmm", 8192, 4096, 4096, 8, torch.bfloat16, device) == policy.gmm(
            device, 8192, 4096, 4096, 8, torch.bfloat16
        )
        assert tgmm.choose_config(
            "wgrad", 4096, 2048, 8192, 8, torch.bfloat16, device
        ) == policy.gmm_wgrad(device, 4096, 2048, 8192, 8, torch.bfloat16)
    # Without it (the triton backend alone), every AMD GPU gets the portable AMD tiles.
    assert (
        tgmm.choose_config("gmm", 8192, 4096, 4096, 8, torch.bfloat16, device)
        == tconfig.ARCHS["amd"].gmm_tiles[("gmm", "16bit")]
    )


# ---------------------------------------------------------------------------
# the options are valid for Triton's HIP backend, and never cross vendors


@pytest.mark.skipif(HIPOptions is None, reason="triton without the AMD and NVIDIA backends")
@pytest.mark.parametrize("device", TUNED, ids=lambda d: d.arch)
def test_options_are_hip_options_and_never_nvidia_ones(device):
    hip, cuda = _fields(HIPOptions), _fields(CUDAOptions)
    assert hip >= HIP_ONLY_OPTIONS
    assert not HIP_ONLY_OPTIONS & cuda  # each would raise KeyError at a CUDA launch
    cfgs = RocmLaunchConfigs(device)
    for kind in KINDS:
        opts = dict(cfgs.launch_options(kind))
        assert set(opts) <= HIP_ONLY_OPTIONS
        assert not {"maxnreg", "num_ctas", "launch_pdl", "ptx_options", "enable_reflect_ftz"} & set(
            opts
        )
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # e.g. kpack != 1 on gfx950 warns
            built = HIPOptions(arch=device.arch, num_warps=8, **opts)
        for key, value in opts.items():
            assert getattr(built, key) == value
        assert built.num_ctas == 1


@pytest.mark.skipif(HIPOptions is None, reason="triton without the AMD and NVIDIA backends")
def test_default_policy_passes_nothing_to_cuda():
    for kind in KINDS:
        assert set(tconfig.LaunchConfigs().launch_options(kind)) <= _fields(CUDAOptions) - _fields(
            HIPOptions
        )


# ---------------------------------------------------------------------------
# the policy reaches the launches (interpreter, device description simulated)

interpret = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="runs the kernels on CPU tensors: needs TRITON_INTERPRET=1",
)


@pytest.fixture
def launches(monkeypatch):
    from triton.runtime.interpreter import InterpretedFunction

    seen: list[tuple[str, dict]] = []
    run = InterpretedFunction.run

    def recording(self, *args, grid, warmup, **kwargs):
        seen.append((self.fn.__name__, kwargs))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", recording)
    return seen


def _rocm_fn(hook, op):
    [k] = [k for k in hook() if k.op == op]
    return k.fn


@interpret
@pytest.mark.parametrize("device", TUNED, ids=lambda d: d.arch)
def test_rocm_kernels_launch_with_the_arch_policy(device, monkeypatch, launches):
    monkeypatch.setattr(rocm_kernels, "describe_device", lambda _dev: device)
    monkeypatch.setattr(tgmm_configs, "describe_device", lambda _dev: device)  # device_info
    monkeypatch.setattr(rocm_kernels, "_BY_DEVICE", {})  # no policy of another test's device
    x, indices, bin_ids, bins, _ = routing_inputs(tokens=8, hidden=32)
    gather = _rocm_fn(plugin.megablocks_permutation_kernels, "gather")
    out = gather(x, indices, bin_ids, None, bins, 2)
    torch.testing.assert_close(out, reference.gather(x, indices, bin_ids, None, bins, 2))
    policy = RocmLaunchConfigs(device)
    assert launches and all(kw.get("waves_per_eu") == 4 for _, kw in launches), launches
    [(name, main)] = [(n, kw) for n, kw in launches if n.startswith("_gather")]
    if policy.gather_by_rows(8, 32, 2, 4):  # few rows: one program per row (16 rows, one copy)
        assert name == "_gather_rows_kernel"
        want = policy.permutation(16, 32, 1, 4)
    else:
        assert name == "_gather_kernel"
        want = policy.permutation(8, 32, 2, 4)
    assert main["num_warps"] == want.num_warps and main["BLOCK_H"] == want.block_h

    launches.clear()
    a = torch.randn(12, 16)
    b = torch.randn(3, 16, 24)
    sizes = torch.tensor([5, 0, 7])
    gmm = _rocm_fn(plugin.megablocks_grouped_gemm_kernels, "gmm")
    torch.testing.assert_close(gmm(a, b, sizes, False), reference.gmm(a, b, sizes, False))
    [(_, kw)] = launches
    assert {k: kw[k] for k in ("matrix_instr_nonkdim", "waves_per_eu")} == {
        "matrix_instr_nonkdim": 16,
        "waves_per_eu": 2,
    }
    tiles = RocmLaunchConfigs(device).gmm(device, 12, 24, 16, 3, torch.float32)
    assert (kw["BLOCK_M"], kw["BLOCK_N"], kw["BLOCK_K"], kw["num_warps"]) == (
        tiles.block_m,
        tiles.block_n,
        tiles.block_k,
        tiles.num_warps,
    )
    assert kw.get("kpack", 1) == arch.family(device).kpack

    launches.clear()
    sort = _rocm_fn(plugin.megablocks_routing_kernels, "sort")
    keys = torch.randint(0, 8, (64,), dtype=torch.int32)
    torch.testing.assert_close(sort(keys, 3), reference.sort(keys, 3))
    assert launches and not any(set(kw) & HIP_ONLY_OPTIONS for _, kw in launches)
    # The policy is scoped to the call.
    assert type(tconfig.launch_configs()) is tconfig.LaunchConfigs


@interpret
def test_triton_kernels_alone_pass_no_hip_options(launches):
    from megablocks_triton import permutation as tperm

    x, indices, bin_ids, bins, _ = routing_inputs(tokens=8, hidden=32)
    tperm.gather(x, indices, bin_ids, None, bins, 2)
    tgmm.gmm(torch.randn(12, 16), torch.randn(3, 16, 24), torch.tensor([5, 0, 7]))
    assert launches
    for _, kw in launches:
        assert not set(kw) & HIP_ONLY_OPTIONS, kw


def test_scoped_policy_is_restored_and_nests():
    class Marked(tconfig.LaunchConfigs):
        pass

    outer, inner = Marked(), RocmLaunchConfigs(MI300X)
    with tconfig.use_launch_configs(outer):
        assert tconfig.launch_configs() is outer
        with tconfig.use_launch_configs(inner):
            assert tconfig.launch_configs() is inner
        assert tconfig.launch_configs() is outer
    assert type(tconfig.launch_configs()) is tconfig.LaunchConfigs
