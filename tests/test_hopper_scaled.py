"""The warp-specialized FP8 grouped GEMM on Hopper (megablocks_triton.hopper_scaled).

On the CPU: which calls the scaled GEMMs' launch path gives it (recorded on a simulated H200,
not run), and that it compiles for sm_90 with two products in flight. On an sm_90 GPU: its
results against the Triton kernel it replaces (bit for bit with that kernel's 128 x 128 x 128
tiles: the same 128-deep products added in the same order) and against a float64 loop, with
uneven and empty groups, rows past the groups, k and n tails, and both output dtypes.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from device_infos import B200, H200
from sm90_compile import compile_sm90
from triton_interpreter import interpreting

triton = pytest.importorskip("triton")
hopper_scaled = pytest.importorskip("megablocks_triton.hopper_scaled")

from megablocks_triton import scaled as S  # noqa: E402
from megablocks_triton.arch_table import ARCHS  # noqa: E402
from megablocks_triton.launch import record_launches  # noqa: E402
from megablocks_triton.launch_types import GmmConfig  # noqa: E402

on_hopper = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
    reason="needs an sm_90 GPU",
)
E4M3 = torch.float8_e4m3fn
#: The Triton kernel's tiles on Hopper, forced (a config override also keeps it off the Gluon one).
TRITON_TILES = GmmConfig(128, 128, 128, group_m=8, num_warps=8, num_stages=4, use_tma=True)


@pytest.fixture(autouse=True)
def _fresh_plans() -> Iterator[None]:
    # Plans are kept per call shape, and a meta tensor's shape is the same on every simulated
    # device: each test starts and ends with none.
    S._SCALED_PLANS.clear()
    yield
    S._SCALED_PLANS.clear()


def _meta(*shape: int, dtype: torch.dtype = E4M3) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def _kernels(device: object, call: str = "gmm", **shape: int) -> list[str]:
    """Module-qualified names of the kernels ``scaled_gmm`` (or ``scatter``, ``gather``) would
    launch."""
    return [
        f"{r.kernel.fn.__module__}.{r.kernel.fn.__name__}" for r in _launches(device, call, **shape)
    ]


def _launches(device: object, call: str = "gmm", **shape: int) -> list[Any]:
    rows, k, n, experts = shape["rows"], shape["k"], shape["n"], shape["experts"]
    fmt = "fp8_blockwise" if shape.get("blockwise") else "fp8_rowwise"
    a, b = _meta(rows, k), _meta(experts, n, k)
    if shape.get("blockwise"):
        sa, sb = (
            _meta(rows, -(-k // 128), dtype=torch.float32),
            _meta(experts, -(-n // 128), -(-k // 128), dtype=torch.float32),
        )
    else:
        sa, sb = _meta(rows, 1, dtype=torch.float32), _meta(experts, n, 1, dtype=torch.float32)
    counts, ids = _meta(experts, dtype=torch.int32), _meta(rows, dtype=torch.int32)
    out = "float32" if shape.get("float32") else None
    with record_launches(device) as recorder:  # type: ignore[arg-type]
        if call == "gmm":
            S.scaled_gmm(a, sa, b, sb, counts, True, fmt, out)
        elif call == "scatter":
            weights = _meta(rows, dtype=torch.float32)
            S.scaled_gmm_scatter(a, sa, b, sb, ids, ids, weights, counts, 1, True, None, fmt, None)
        else:
            S.scaled_gather_gmm(a, sa, b, sb, ids, ids, counts, 1, True, None, fmt, None)
    return recorder.launches


GLUON = "megablocks_triton.hopper_scaled._scaled_gmm_kernel"
TRITON = "megablocks_triton.kernels.scaled._scaled_gmm_kernel"
QWEN3_DOWN = {"rows": 128 * 1024, "k": 768, "n": 2048, "experts": 128}
HOPPER_MAX_K = ARCHS["hopper"].gluon_scaled_max_k


def test_hopper_plain_and_gathered_rows_take_the_gluon_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Recorded for the compile gate, the Triton kernel too: the launch operands whose bases the
    # Gluon kernel's descriptors cannot take fall back to (plain rows: no descriptor at all).
    assert _kernels(H200, **QWEN3_DOWN) == [TRITON, GLUON]
    fallback, _ = _launches(H200, **QWEN3_DOWN)
    assert not fallback.kwargs["B_TMA"] and not fallback.kwargs.get("A_TMA", False)
    # The layer's down projection: the Gluon GEMM, then the 16-bit scatter.
    assert _kernels(H200, "scatter", **QWEN3_DOWN)[1] == GLUON
    # Its up projection, the rows not copied first: the tokens gathered by the loader's threads.
    monkeypatch.setattr(S, "GATHER_FIRST", False)
    fallback, launch = _launches(H200, "gather", **QWEN3_DOWN)
    assert launch.kwargs["GATHER"] and launch.kwargs["LOADER_WARPS"] == 4
    assert fallback.kwargs["B_TMA"]  # only the tokens misaligned: b still through TMA
    # The blockwise format on plain rows: each 128-deep product scaled by its blocks' scales.
    _, launch = _launches(H200, **QWEN3_DOWN, blockwise=1)
    assert launch.kwargs["BLOCKWISE"] and not launch.kwargs["GATHER"]
    # Plain rowwise rows of 256 experts (DeepSeek-V3's count), and DeepSeek-V3's deepest k.
    assert _kernels(H200, **{**QWEN3_DOWN, "experts": 256})[1] == GLUON
    assert _kernels(H200, **{**QWEN3_DOWN, "experts": 256, "k": 7168})[1] == GLUON


def test_its_launches_take_the_cached_launch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    # Every argument of the Gluon kernel's launches has a launch-cache key (Gluon descriptors
    # included): else each call would go through Triton's generic path, slower than a small GEMM.
    from megablocks_triton.launch import _key

    monkeypatch.setattr(S, "GATHER_FIRST", False)  # the gathering kernel's launch too
    for call in ("gmm", "gather"):
        _, launch = _launches(H200, call, **QWEN3_DOWN)
        assert launch.kernel.fn.__module__.endswith("hopper_scaled")
        descriptors = [a for a in launch.args if type(a).__name__ == "TensorDescriptor"]
        assert len(descriptors) == 3
        _key(launch.args)  # raises where an argument has none


@pytest.mark.parametrize(
    "why, device, call, shape",
    [
        ("another arch", B200, "gmm", QWEN3_DOWN),
        ("blockwise gathered rows", H200, "gather", {**QWEN3_DOWN, "blockwise": 1}),
        ("k at the table's bound", H200, "gmm", {**QWEN3_DOWN, "k": HOPPER_MAX_K}),
        ("512 experts", H200, "gmm", {**QWEN3_DOWN, "experts": 512, "rows": 512 * 256}),
        ("256 experts, gathered", H200, "gather", {**QWEN3_DOWN, "experts": 256}),
        ("256 experts, blockwise", H200, "gmm", {**QWEN3_DOWN, "experts": 256, "blockwise": 1}),
        ("blockwise into float32", H200, "gmm", {**QWEN3_DOWN, "blockwise": 1, "float32": 1}),
        ("64 rows per expert", H200, "gmm", {**QWEN3_DOWN, "rows": 64 * 128}),
        ("rows TMA cannot address", H200, "gmm", {**QWEN3_DOWN, "k": 776}),
    ],
)
def test_other_calls_keep_the_triton_kernel(
    why: str, device: object, call: str, shape: dict[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(S, "GATHER_FIRST", False)  # gathered rows: the gathering kernels' rule
    kernels = _kernels(device, call, **shape)
    assert kernels and GLUON not in kernels, why


def test_switches_keep_the_triton_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(S, "WARP_SPECIALIZED", False)
    assert GLUON not in _kernels(H200, **QWEN3_DOWN)
    S._SCALED_PLANS.clear()
    monkeypatch.setattr(S, "WARP_SPECIALIZED", True)
    monkeypatch.setattr(S, "PROMOTE_EVERY", None)  # the measurement-only unpromoted sum
    assert GLUON not in _kernels(H200, **QWEN3_DOWN)


GATHER = "megablocks_triton.kernels.permutation._gather_kernel"


@pytest.mark.parametrize(
    "shape",
    [QWEN3_DOWN, {**QWEN3_DOWN, "experts": 256}, {**QWEN3_DOWN, "blockwise": 1}],
    ids=["qwen3", "256 experts", "blockwise"],
)
def test_gather_first_copies_the_rows_for_the_plain_rows_kernel(
    shape: dict[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert S.GATHER_FIRST  # the default, for both formats
    # The rows and then their scales gathered into sorted order (each copy after its inverse
    # permutation), then the plain rows' launches (the Triton fallback recorded, the Gluon one).
    launches = _launches(H200, "gather", **shape)
    names = [f"{r.kernel.fn.__module__}.{r.kernel.fn.__name__}" for r in launches]
    assert [n for n in names if n == GATHER] == [GATHER, GATHER]
    assert names[-2:] == [TRITON, GLUON]
    assert not launches[-1].kwargs["GATHER"] and launches[-1].kwargs["LOADER_WARPS"] == 1
    assert launches[-1].kwargs["BLOCKWISE"] == bool(shape.get("blockwise"))
    # Where plain rows of the shape keep the Triton kernel, the gathering one reads the tokens
    # itself: no copy.
    S._SCALED_PLANS.clear()
    assert GATHER not in _kernels(H200, "gather", **{**QWEN3_DOWN, "rows": 64 * 128})
    assert GATHER not in _kernels(B200, "gather", **QWEN3_DOWN)


def test_serves_dense_k_major_e4m3_operands_only() -> None:
    a, b = torch.zeros(64, 256, dtype=E4M3), torch.zeros(3, 128, 256, dtype=E4M3)
    assert hopper_scaled.serves(a, b, torch.bfloat16)
    assert hopper_scaled.serves(a, b, torch.float32)
    assert not hopper_scaled.serves(a.to(torch.float8_e4m3fnuz), b, torch.bfloat16)
    assert not hopper_scaled.serves(a[:, :128], b[:, :, :128], torch.bfloat16)  # b not dense
    assert not hopper_scaled.serves(
        a, torch.zeros(3, 256, 128, dtype=E4M3).transpose(1, 2), torch.bfloat16
    )
    assert not hopper_scaled.serves(a.t().contiguous().t(), b, torch.bfloat16)  # a column-major
    assert not hopper_scaled.serves(
        a, torch.zeros(3, 4, 256, dtype=E4M3), torch.bfloat16
    )  # 8-byte rows out


def test_other_triton_releases_take_the_triton_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    for version, available in (("3.6.0", True), ("3.7.0", False), ("4.0", False)):
        S._hopper_scaled.cache_clear()
        monkeypatch.setattr(triton, "__version__", version)
        assert (S._hopper_scaled() is not None) == available, version
    S._hopper_scaled.cache_clear()


#: Compiles the kernel for sm_90 (:func:`sm90_compile.compile_sm90`).
_COMPILE = """
from megablocks_triton import hopper_scaled as H

out_dtype = getattr(torch, sys.argv[1])
gather = sys.argv[2] == "1"
blockwise = sys.argv[3] == "1"
block_e = int(sys.argv[4])
has_bias = sys.argv[5] == "1"
rows, k, n, experts = 512, 256, 384, 3
a = torch.zeros(rows, k, dtype=torch.float8_e4m3fn)
b = torch.zeros(experts * n, k, dtype=torch.float8_e4m3fn)
out = torch.zeros(rows, n, dtype=out_dtype)
descs = [  # with the launch's own (cached) layouts
    TensorDescriptor.from_tensor(t, list(block), H.shared_layout(block, t.dtype))
    for t, block in ((a, (H.BLOCK_M, H.BLOCK_K)), (b, (H.BLOCK_N, H.BLOCK_K)),
                     (out, (H.BLOCK_M, H.BLOCK_N)))
]
compiled = H._scaled_gmm_kernel.warmup(
    *descs, out, torch.zeros(rows, 1), torch.zeros(experts, n, 1),
    torch.zeros(experts, dtype=torch.int32), experts, rows, n, k, 1, 1, n, 1, 1,
    a, k, torch.zeros(rows, dtype=torch.int32), 2, rows, torch.zeros(experts, n), n,
    FROM_ENDS=gather, ZERO_TAIL=True, BLOCK_E=block_e, GROUP_M=8, GATHER=gather,
    BLOCKWISE=blockwise, HAS_BIAS=has_bias,
    STAGES=H.stages(out_dtype),
    LOADER_WARPS=H.GATHER_LOADER_WARPS if gather else 1,
    LOADER_REGS=H.GATHER_LOADER_REGISTERS if gather else H.LOADER_REGISTERS,
    num_warps=H.MMA_WARPS, grid=(1,),
)
report(compiled)
"""


@pytest.mark.parametrize(
    "out_dtype, gather, blockwise, bias",
    [
        ("bfloat16", 0, 0, 0),
        ("float32", 0, 0, 0),
        ("bfloat16", 1, 0, 0),
        ("bfloat16", 0, 1, 0),
        ("bfloat16", 0, 0, 1),
        ("float32", 0, 0, 1),
        ("bfloat16", 1, 0, 1),
    ],
)
def test_compiles_for_sm90(out_dtype: str, gather: int, blockwise: int, bias: int) -> None:
    # With as many experts as the launch path gives it, a bias or not (rowwise: the launch
    # refuses a blockwise one): nothing spills (the gate's rule).
    most = (
        S.WARP_SPECIALIZED_MAX_BLOCK_E_GATHERED_OR_BLOCKWISE
        if gather or blockwise
        else S.WARP_SPECIALIZED_MAX_BLOCK_E
    )
    built = compile_sm90(_COMPILE, out_dtype, str(gather), str(blockwise), str(most), str(bias))
    assert built["spills"] == 0
    ptx = built["ptx"]
    assert "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3" in ptx
    # The promotion overlapped: the older product is waited for with the newer one in flight.
    assert "wgmma.wait_group.sync.aligned 1;" in ptx
    # Plain rowwise rows: and ptxas keeps it so (the products in two register sets; had it to
    # copy the one in flight out of the registers the next writes, it would inject a wait for
    # it first). Gathered and blockwise rows keep one set (paired, they spill): ptxas waits.
    injected = "warpgroup.wait is injected" in built["ptxas_log"]
    assert injected == bool(gather or blockwise), built["ptxas_log"]
    assert "cp.async.bulk.tensor" in ptx  # TMA loads and the full tiles' stores
    # Gathered rows: 16-byte copies by the loader's threads, each arriving on the stage's barrier.
    assert ("cp.async.cg.shared.global" in ptx) == bool(gather)
    # Plain rowwise rows: the loader's copies of the epilogue's scales arrive on their ring's.
    assert ("cp.async.mbarrier.arrive.noinc" in ptx) == (not blockwise)


# ---------------------------------------------------------------------------------------------
# On the GPU
# ---------------------------------------------------------------------------------------------


CASES = {
    # group sizes, k, n, rows past the groups
    "odd sizes, empty experts": ([1, 70, 0, 129, 300, 0, 255], 256, 384, 0),
    "one expert": ([1000], 512, 256, 0),
    "many experts": ([(7 * e) % 97 for e in range(200)], 128, 256, 0),
    "rows past the groups": ([0, 300, 17, 0, 65], 384, 264, 123),
    "k and n tails": ([130, 2, 64], 208, 136, 5),
    "one k step of 16": ([64, 64], 16, 128, 0),
    "several tiles a program": ([3000, 2500, 17], 384, 1024, 0),
}


def _case(name: str, fmt: str = "fp8_rowwise") -> tuple[torch.Tensor, ...]:
    sizes, k, n, spare = CASES[name]
    gen = torch.Generator(device="cuda").manual_seed(len(name))
    rows = sum(sizes) + spare
    x = torch.randn(rows, k, device="cuda", generator=gen)
    w = torch.randn(len(sizes), n, k, device="cuda", generator=gen) / k**0.5
    qa, sa = S.quantize(x, 1, fmt, "e4m3fn")
    qb, sb = S.quantize(w, 2, fmt, "e4m3fn")
    return qa, sa, qb, sb, torch.tensor(sizes, dtype=torch.int32, device="cuda")


def _gluon(
    *operands: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None = None, **how: bool
) -> torch.Tensor:
    qa, sa, qb, sb, sizes = operands
    hopper_scaled.launch(
        qa, sa, qb, sb, sizes, out, from_ends=how.get("from_ends", False),
        zero_tail=how.get("zero_tail", True), block_e=_block_e(sizes.numel()),
        num_sms=torch.cuda.get_device_properties(0).multi_processor_count,
        blockwise=how.get("blockwise", False), bias=bias,
    )  # fmt: skip
    return out


def _block_e(experts: int) -> int:
    """The BLOCK_E the launch path gives this many experts (its register budget: fewer experts,
    fewer registers per partition)."""
    return max(16, 1 << (experts - 1).bit_length())


def _dequantized(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float64 values of quantized data: each scale over its block (1, the whole dim, or 128)."""
    for d in range(q.dim()):
        if scale.shape[d] not in (1, q.shape[d]):
            scale = scale.repeat_interleave(128, dim=d).narrow(d, 0, q.shape[d])
    return q.double() * scale.double()


def _loop(
    qa: torch.Tensor, sa: torch.Tensor, qb: torch.Tensor, sb: torch.Tensor, sizes: list[int]
) -> torch.Tensor:
    """The float64 definition, one expert at a time, on the dequantized operands."""
    a, b = _dequantized(qa, sa), _dequantized(qb, sb)
    out = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float64, device=a.device)
    start = 0
    for e, size in enumerate(sizes):
        out[start : start + size] = a[start : start + size] @ b[e].T
        start += size
    return out


@on_hopper
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", sorted(CASES))
def test_equals_the_triton_kernel_and_a_float64_loop(
    name: str, out_dtype: torch.dtype, with_bias: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # With a bias, the epilogue adds it as the Triton kernel's does (bit for bit): to each
    # grouped row, before the rounding; rows past the groups stay zero.
    qa, sa, qb, sb, sizes = _case(name)
    rows, n = qa.shape[0], qb.shape[1]
    covered = int(sizes.sum())
    bias = None
    if with_bias:
        gen = torch.Generator(device="cuda").manual_seed(n)
        bias = torch.randn(sizes.numel(), n, device="cuda", generator=gen).bfloat16()
    got = _gluon(
        qa,
        sa,
        qb,
        sb,
        sizes,
        out=torch.full((rows, n), float("nan"), device="cuda", dtype=out_dtype),
        bias=bias,
    )
    monkeypatch.setattr(S, "CONFIG_OVERRIDE", TRITON_TILES)
    want = S.scaled_gmm(
        qa, sa, qb, sb, sizes, True, "fp8_rowwise", str(out_dtype).removeprefix("torch."), bias
    )
    assert torch.equal(got, want)
    ref = _loop(qa, sa, qb, sb, CASES[name][0])
    if bias is not None:
        ref += _row_bias(bias, torch.cumsum(sizes, 0), rows).to(ref.device)
    err = (got.double() - ref).norm() / ref.norm().clamp_min(1e-30)
    assert err < (4e-3 if out_dtype == torch.bfloat16 else 1e-3)
    assert (got[covered:] == 0).all() and not torch.signbit(got[covered:]).any()
    # Running ends (bins) give the same; without the zero tail the rows past are left as they were.
    ends = torch.cumsum(sizes, 0, dtype=torch.int32)
    kept = torch.full((rows, n), 7.0, device="cuda", dtype=out_dtype)
    _gluon(qa, sa, qb, sb, ends, out=kept, from_ends=True, zero_tail=False, bias=bias)
    assert torch.equal(kept[:covered], got[:covered]) and (kept[covered:] == 7).all()


@on_hopper
def test_the_ops_take_it_and_equal_the_triton_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    # Through the op functions, at a shape the table gives the Gluon kernel: 16 experts of about
    # 200 rows (uneven, one empty), k 768, n 512: plain rows in float16, the scatter's products,
    # and the tokens gathered by int64 ids (one naming no token) into more rows than the groups
    # hold (zeros past them) by the gathering Gluon kernel (not copied first).
    monkeypatch.setattr(S, "GATHER_FIRST", False)
    gen = torch.Generator(device="cuda").manual_seed(3)
    sizes_list = [int(v) for v in torch.randint(100, 300, (16,), generator=gen, device="cuda")]
    sizes_list[5] = 0
    rows = sum(sizes_list)
    x = torch.randn(rows, 768, device="cuda", generator=gen)
    w = torch.randn(16, 512, 768, device="cuda", generator=gen) / 768**0.5
    qa, sa = S.quantize(x, 1, "fp8_rowwise", "e4m3fn")
    qb, sb = S.quantize(w, 2, "fp8_rowwise", "e4m3fn")
    sizes = torch.tensor(sizes_list, dtype=torch.int32, device="cuda")
    ids = torch.randperm(rows, device="cuda", generator=gen).int()
    bins = torch.cumsum(sizes, 0, dtype=torch.int32)
    weights = torch.rand(rows, device="cuda", generator=gen)
    gather_ids = torch.randint(0, 2 * rows, (rows,), device="cuda", generator=gen)
    gather_ids[7] = 2 * rows + 1  # names no token

    def calls() -> list[torch.Tensor]:
        return [
            S.scaled_gmm(qa, sa, qb, sb, sizes, True, "fp8_rowwise", "float16"),
            S.scaled_gmm_scatter(
                qa, sa, qb, sb, ids, ids, weights, bins, 1, True, None, "fp8_rowwise", None
            ),
            S.scaled_gather_gmm(
                qa, sa, qb, sb, gather_ids, gather_ids, bins, 2, True, rows + 37, "fp8_rowwise",
                None,
            ),
        ]  # fmt: skip

    got = calls()
    plans = list(S._SCALED_PLANS.values())
    assert len(plans) == 3 and all(isinstance(p, S._WarpSpecializedPlan) for p in plans)
    assert (got[2][rows:] == 0).all() and (got[2][[7]] == 0).all()
    monkeypatch.setattr(S, "CONFIG_OVERRIDE", TRITON_TILES)
    S._SCALED_PLANS.clear()
    for mine, triton_kernel in zip(got, calls(), strict=True):
        assert torch.equal(mine, triton_kernel)


@on_hopper
def test_misaligned_bases_take_the_triton_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    # Rows starting 8 bytes past a 16-byte boundary (a view into a larger buffer): the Gluon
    # plan's descriptors cannot take them, so the call goes to its Triton fallback: the same
    # bits as the Triton kernel on the aligned copy.
    gen = torch.Generator(device="cuda").manual_seed(5)
    sizes = torch.full((16,), 200, dtype=torch.int32, device="cuda")
    rows, k, n = 3200, 768, 512
    x = torch.randn(rows, k, device="cuda", generator=gen)
    w = torch.randn(16, n, k, device="cuda", generator=gen) / k**0.5
    qa, sa = S.quantize(x, 1, "fp8_rowwise", "e4m3fn")
    qb, sb = S.quantize(w, 2, "fp8_rowwise", "e4m3fn")
    shifted = torch.empty(rows * k + 16, dtype=torch.uint8, device="cuda")[8 : 8 + rows * k]
    shifted = shifted.view(E4M3).view(rows, k)
    shifted.copy_(qa)
    assert shifted.data_ptr() % 16 == 8
    # Which kernel ran: the two give the same bits, so the launches are counted.
    ran = {"gluon": 0, "triton": 0}
    gluon_launch, triton_plan = hopper_scaled.launch, S._ScaledPlan.__call__

    def counted_gluon(*args: Any, **kw: Any) -> None:
        ran["gluon"] += 1
        gluon_launch(*args, **kw)

    def counted_triton(self: Any, *tensors: torch.Tensor) -> torch.Tensor:
        ran["triton"] += 1
        return triton_plan(self, *tensors)

    monkeypatch.setattr(hopper_scaled, "launch", counted_gluon)
    monkeypatch.setattr(S._ScaledPlan, "__call__", counted_triton)
    got = S.scaled_gmm(shifted, sa, qb, sb, sizes, True, "fp8_rowwise", None)
    assert ran == {"gluon": 0, "triton": 1}
    plans = list(S._SCALED_PLANS.values())
    assert plans and all(isinstance(p, S._WarpSpecializedPlan) for p in plans)
    S.scaled_gmm(qa, sa, qb, sb, sizes, True, "fp8_rowwise", None)  # aligned: the Gluon kernel
    assert ran == {"gluon": 1, "triton": 1}
    monkeypatch.setattr(S, "WARP_SPECIALIZED", False)
    S._SCALED_PLANS.clear()
    want = S.scaled_gmm(qa, sa, qb, sb, sizes, True, "fp8_rowwise", None)
    assert torch.equal(got, want)
    ref = _loop(qa, sa, qb, sb, sizes.tolist())
    assert (got.double() - ref).norm() / ref.norm() < 4e-3


GATHER_CASES = {
    # tokens, top_k, experts, k, n, sorted rows whose id names no token
    "top 1 of 4": (300, 1, 4, 256, 384, 0),
    "top 8 of 16, ids past the tokens": (200, 8, 16, 208, 136, 9),
    "top 2 of 3, one expert empty": (700, 2, 3, 384, 264, 0),
}


def _gather_case(name: str) -> tuple[Any, ...]:
    tokens, top_k, experts, k, n, bad = GATHER_CASES[name]
    gen = torch.Generator(device="cuda").manual_seed(len(name))
    x = torch.randn(tokens, k, device="cuda", generator=gen)
    w = torch.randn(experts, n, k, device="cuda", generator=gen) / k**0.5
    choice = torch.randint(0, experts, (tokens * top_k,), device="cuda", generator=gen)
    if name.endswith("empty"):
        choice[choice == 1] = 0
    ids = torch.sort(choice, stable=True).indices.int()
    ids[torch.randperm(ids.numel(), device="cuda", generator=gen)[:bad]] = tokens * top_k + 3
    bins = torch.cumsum(torch.bincount(choice, minlength=experts), 0).int()
    qx, sx = S.quantize(x, 1, "fp8_rowwise", "e4m3fn")
    qw, sw = S.quantize(w, 2, "fp8_rowwise", "e4m3fn")
    return qx, sx, qw, sw, ids, bins, top_k


@on_hopper
@pytest.mark.parametrize("name", sorted(GATHER_CASES))
def test_gathered_rows_equal_the_triton_kernel_and_a_float64_loop(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    qx, sx, qw, sw, ids, bins, top_k = _gather_case(name)
    rows, n = ids.numel(), qw.shape[1]
    got = torch.full((rows, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    hopper_scaled.launch(
        qx, sx, qw, sw, bins, got, from_ends=True, zero_tail=True, block_e=_block_e(bins.numel()),
        num_sms=torch.cuda.get_device_properties(0).multi_processor_count, gather=(ids, top_k),
    )  # fmt: skip
    monkeypatch.setattr(S, "CONFIG_OVERRIDE", TRITON_TILES)
    want = S.scaled_gather_gmm(
        qx, sx, qw, sw, ids, ids, bins, top_k, True, None, "fp8_rowwise", None
    )  # fmt: skip
    assert torch.equal(got, want)
    x, w = qx.double() * sx.double(), qw.double() * sw.double()
    named = ids < qx.shape[0] * top_k
    tokens = torch.where(named, ids // top_k, 0).long()
    experts = torch.searchsorted(
        bins, torch.arange(rows, device="cuda", dtype=bins.dtype), right=True
    )
    ref = torch.einsum("rk,rnk->rn", x[tokens], w[experts])
    ref[~named] = 0
    err = (got.double() - ref).norm() / ref.norm()
    assert err < 4e-3
    assert (got[~named] == 0).all()


@on_hopper
@pytest.mark.parametrize("name", sorted(CASES))
def test_blockwise_equals_the_triton_kernel_and_a_float64_loop(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # fp8_blockwise: 1 x 128 blocks of a, 128 x 128 of b, each 128-deep product scaled by its
    # blocks' scales before it is added (as the Triton kernel does, so the bits are equal).
    qa, sa, qb, sb, sizes = _case(name, "fp8_blockwise")
    rows, n = qa.shape[0], qb.shape[1]
    covered = int(sizes.sum())
    got = torch.full((rows, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    _gluon(qa, sa, qb, sb, sizes, out=got, blockwise=True)
    monkeypatch.setattr(S, "CONFIG_OVERRIDE", TRITON_TILES)
    want = S.scaled_gmm(qa, sa, qb, sb, sizes, True, "fp8_blockwise", None)
    assert torch.equal(got, want)
    ref = _loop(qa, sa, qb, sb, CASES[name][0])
    err = (got.double() - ref).norm() / ref.norm().clamp_min(1e-30)
    assert err < 4e-3
    assert (got[covered:] == 0).all()


# ---------------------------------------------------------------------------------------------
# Gathered rows copied first (GATHER_FIRST), on the Triton test device
# ---------------------------------------------------------------------------------------------

#: Where the Triton kernels run: the CPU under the interpreter, or the GPU test device.
TRITON_DEVICE = torch.device(
    os.environ.get("MEGABLOCKS_TRITON_TEST_DEVICE", "cpu" if interpreting() else "cuda")
)
_RUNNABLE = interpreting() if TRITON_DEVICE.type == "cpu" else torch.cuda.is_available()


def _routed(
    tokens: int, top_k: int, experts: int, k: int, n: int, fmt: str, device: torch.device
) -> tuple[Any, ...]:
    """Quantized tokens and expert weights, and sorted routing with expert 1 empty and three
    sorted rows naming no token (ids past the pairs, and negative)."""
    gen = torch.Generator().manual_seed(tokens + k)
    x = torch.randn(tokens, k, generator=gen).to(device)
    w = (torch.randn(experts, n, k, generator=gen) / k**0.5).to(device)
    choice = torch.randint(0, experts, (tokens * top_k,), generator=gen)
    choice[choice == 1] = 0
    ids = torch.sort(choice, stable=True).indices.int()
    ids[torch.randperm(ids.numel(), generator=gen)[:3]] = torch.tensor(
        [-1, -7, tokens * top_k], dtype=torch.int32
    )
    bins = torch.cumsum(torch.bincount(choice, minlength=experts), 0).int()
    qx, sx = S.quantize(x, 1, fmt, "e4m3fn")
    qw, sw = S.quantize(w, 2, fmt, "e4m3fn")
    return tuple(t.to(device) for t in (qx, sx, qw, sw, ids, bins))


@pytest.mark.skipif(not _RUNNABLE, reason=f"triton kernels on {TRITON_DEVICE} cannot run here")
@pytest.mark.parametrize("fmt", ["fp8_rowwise", "fp8_blockwise"])
def test_gathered_rows_copied_first_equal_the_gathering_kernel(
    fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Forced wherever it would not be taken (the interpreter's plain rows are the Triton
    # kernel's, as are these small shapes' on a GPU): the same sums as the gathering kernel, in
    # the same order, so the same bits; an id naming no token gives a zero row.
    top_k = 2
    qx, sx, qw, sw, ids, bins = _routed(40, top_k, 3, 256, 136, fmt, TRITON_DEVICE)
    named = (ids >= 0) & (ids < ids.numel())
    short = ids.numel() - 6  # the first rows only, the groups cut there
    for rows, ends in ((None, bins), (short, bins.clamp(max=short))):
        args = (qx, sx, qw, sw, ids, ids, ends, top_k, True, rows, fmt, None)
        monkeypatch.setattr(S, "GATHER_FIRST", False)
        want = S.scaled_gather_gmm(*args)
        monkeypatch.setattr(S, "GATHER_FIRST", True)
        monkeypatch.setattr(S, "_gathers_first", lambda *a: True)
        S._SCALED_PLANS.clear()
        got = S.scaled_gather_gmm(*args)
        assert all(isinstance(p, S._GatherFirstPlan) for p in S._SCALED_PLANS.values())
        assert torch.equal(got, want), rows
        assert (got[~named[: got.shape[0]]] == 0).all()
        monkeypatch.undo()
        S._SCALED_PLANS.clear()


@on_hopper
def test_gathered_rows_copied_first_take_the_gluon_kernel_and_equal_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # At a shape whose plain rows take the Gluon kernel (8 experts of about 256 rows), rows
    # copied first (the default) through the plain rows' Gluon kernel equal the gathering
    # Gluon kernel's.
    assert S.GATHER_FIRST
    qx, sx, qw, sw, ids, bins = _routed(1024, 2, 8, 768, 512, "fp8_rowwise", torch.device("cuda"))
    args = (qx, sx, qw, sw, ids, ids, bins, 2, True, None, "fp8_rowwise", None)
    S._SCALED_PLANS.clear()
    got = S.scaled_gather_gmm(*args)
    plan = next(iter(S._SCALED_PLANS.values()))
    assert isinstance(plan, S._GatherFirstPlan) and isinstance(plan.plain, S._WarpSpecializedPlan)
    monkeypatch.setattr(S, "GATHER_FIRST", False)
    S._SCALED_PLANS.clear()
    want = S.scaled_gather_gmm(*args)
    assert isinstance(next(iter(S._SCALED_PLANS.values())), S._WarpSpecializedPlan)
    assert torch.equal(got, want)


@pytest.mark.skipif(not _RUNNABLE, reason=f"triton kernels on {TRITON_DEVICE} cannot run here")
def test_an_fp8_layer_step_is_the_same_with_rows_copied_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Through the layer (the up projection's tokens and the down projection's gradient are
    # gathered rows): forward and backward give the same bits with the copy forced.
    from megablocks_core import use_backend
    from megablocks_core.layers import MoEConfig, dMoE

    def step() -> list[torch.Tensor]:
        config = MoEConfig(64, 48, 4, 2, glu=True, activation="silu", fp8="fp8_rowwise", seed=3)
        layer = dMoE(config).to(TRITON_DEVICE)
        x = torch.randn(24, 64, generator=torch.Generator().manual_seed(4)).to(TRITON_DEVICE)
        x.requires_grad_()
        S._SCALED_PLANS.clear()
        with use_backend(scaled_gather_gmm="triton"):
            out, _ = layer(x)
            out.square().sum().backward()
        assert x.grad is not None
        return [out, x.grad, *(p.grad for p in layer.parameters() if p.grad is not None)]

    monkeypatch.setattr(S, "GATHER_FIRST", False)
    want = step()
    monkeypatch.setattr(S, "GATHER_FIRST", True)
    monkeypatch.setattr(S, "_gathers_first", lambda *a: True)
    got = step()
    # The forward's up projection and the backward's gradient of the down projection's input.
    copied = [p for p in S._SCALED_PLANS.values() if isinstance(p, S._GatherFirstPlan)]
    assert len(copied) == 2
    assert len(got) == len(want) > 2
    for mine, theirs in zip(got, want, strict=True):
        assert torch.equal(mine, theirs)


def _row_bias(bias: torch.Tensor, ends: torch.Tensor, rows: int) -> torch.Tensor:
    """bias[e] for each of ``rows`` sorted rows in group e (groups ending at ``ends``), 0 past
    them, in float64 on the CPU."""
    expert = torch.searchsorted(ends.long().cpu(), torch.arange(rows), right=True)
    table = torch.cat([bias.double().cpu(), torch.zeros(1, bias.shape[1], dtype=torch.float64)])
    return table[expert]


@pytest.mark.skipif(not _RUNNABLE, reason=f"triton kernels on {TRITON_DEVICE} cannot run here")
@pytest.mark.parametrize("fmt", ["fp8_rowwise", "fp8_blockwise"])
@pytest.mark.parametrize("copied_first", [False, True])
def test_a_bias_is_added_to_each_group_s_rows_before_the_rounding(
    fmt: str, copied_first: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Float32 outputs: each grouped row (one naming no token too) gets its expert's bias, rows
    # past the groups none, and the scatter's tokens their weighted experts' biases; the
    # bias's bfloat16 values are exact in float32, so only the sum's one rounding separates
    # the kernel from the float64 sum of its unbiased output and the bias.
    monkeypatch.setattr(S, "GATHER_FIRST", copied_first)
    monkeypatch.setattr(S, "_gathers_first", lambda *a: copied_first)
    top_k = 2
    qx, sx, qw, sw, ids, bins = _routed(40, top_k, 3, 256, 136, fmt, TRITON_DEVICE)
    pairs = ids.numel()
    gen = torch.Generator().manual_seed(9)
    bias = (4 * torch.randn(3, 136, generator=gen)).bfloat16().to(TRITON_DEVICE)
    for rows in (None, pairs + 5):
        plain = (qx, sx, qw, sw, ids, ids, bins, top_k, True, rows, fmt, "float32")
        want = S.scaled_gather_gmm(*plain).double().cpu()
        got = S.scaled_gather_gmm(*plain, bias).double().cpu()
        want += _row_bias(bias, bins, want.shape[0])
        assert torch.allclose(got, want, rtol=2**-23, atol=0), rows
        assert (got[pairs:] == 0).all()
    # scaled_gmm on the gathered rows' copy, grouped by sizes; scaled_gmm_scatter on them.
    rows_q = S.scaled_gather_gmm(qx, sx, qw, sw, ids, ids, bins, top_k, True, None, fmt, None)
    qr, sr = S.quantize(rows_q[:, :128].float(), 1, fmt, "e4m3fn")
    w2 = torch.randn(3, 96, 128, generator=gen).to(TRITON_DEVICE) / 128**0.5
    qw2, sw2 = S.quantize(w2, 2, fmt, "e4m3fn")
    sizes = torch.diff(bins, prepend=bins.new_zeros(1))
    bias2 = (4 * torch.randn(3, 96, generator=gen)).bfloat16().to(TRITON_DEVICE)
    plain_gmm = (qr, sr, qw2, sw2, sizes, True, fmt, "float32")
    want = S.scaled_gmm(*plain_gmm).double().cpu() + _row_bias(bias2, bins, pairs)
    got = S.scaled_gmm(*plain_gmm, bias2).double().cpu()
    assert torch.allclose(got, want, rtol=2**-23, atol=0)
    weights = torch.rand(pairs, generator=gen).to(TRITON_DEVICE)
    named = ((ids >= 0) & (ids < pairs)).cpu()
    scatter = (qr, sr, qw2, sw2, ids, ids, weights, bins, top_k, True, None, fmt, "float32")
    want = S.scaled_gmm_scatter(*scatter).double().cpu()
    per_row = (
        _row_bias(bias2, bins, pairs)
        * weights.double().cpu()[ids.long().cpu().clamp(0, pairs - 1)][:, None]
    )
    want.index_add_(0, ids.long().cpu()[named] // top_k, per_row[named])
    got = S.scaled_gmm_scatter(*scatter, bias2).double().cpu()
    assert torch.allclose(got, want, rtol=2**-20, atol=2**-20 * float(want.abs().max()))


@on_hopper
@pytest.mark.parametrize("out_dtype", ["bfloat16", "float32"])
def test_the_gluon_kernel_s_bias_epilogue_equals_the_triton_kernel_s(
    out_dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Gathered rows copied first, then the plain rows' Gluon kernel: its epilogue adds the bias
    # as the Triton kernel's does, so the outputs are equal bit for bit.
    qx, sx, qw, sw, ids, bins = _routed(1024, 2, 8, 768, 512, "fp8_rowwise", torch.device("cuda"))
    bias = torch.randn(8, 512, device="cuda").bfloat16()
    args = (qx, sx, qw, sw, ids, ids, bins, 2, True, None, "fp8_rowwise", out_dtype, bias)
    S._SCALED_PLANS.clear()
    got = S.scaled_gather_gmm(*args)
    plan = next(iter(S._SCALED_PLANS.values()))
    assert isinstance(plan, S._GatherFirstPlan) and isinstance(plan.plain, S._WarpSpecializedPlan)
    monkeypatch.setattr(S, "CONFIG_OVERRIDE", TRITON_TILES)
    monkeypatch.setattr(S, "GATHER_FIRST", False)
    S._SCALED_PLANS.clear()
    assert torch.equal(got, S.scaled_gather_gmm(*args))


@on_hopper
def test_the_blockwise_gluon_kernel_s_bias_is_added_after_its_rounding() -> None:
    # Blockwise, the Gluon kernel takes no bias (its launch refuses one): the plan adds the bias
    # to its rounded output, one more rounding.
    qa, sa, qb, sb, sizes = _case("several tiles a program", "fp8_blockwise")
    rows, n = qa.shape[0], qb.shape[1]
    bias = torch.randn(sizes.numel(), n, device="cuda").bfloat16()
    out = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="no bias"):
        _gluon(qa, sa, qb, sb, sizes, out=out, blockwise=True, bias=bias)
    args = (qa, sa, qb, sb, sizes, True, "fp8_blockwise", "bfloat16")
    S._SCALED_PLANS.clear()
    got = S.scaled_gmm(*args, bias)
    assert isinstance(next(iter(S._SCALED_PLANS.values())), S._WarpSpecializedPlan)
    unbiased = S.scaled_gmm(*args)
    row_bias = _row_bias(bias, torch.cumsum(sizes, 0), rows).to("cuda")
    assert torch.equal(got, (unbiased.double() + row_bias).bfloat16())
