"""The warp-specialized FP8 rowwise weight gradient on Hopper (megablocks_triton.hopper_scaled_wgrad).

On the CPU: which layouts it serves, its host path (no rows, the launch it records for a simulated
H200), that it compiles for sm_90 with two products in flight and nothing spilled, and the triton
backend's plain Triton kernel of the op (run by the interpreter) against a float64 loop. On an
sm_90 GPU (``MEGABLOCKS_TRITON_TEST_DEVICE``, default ``cuda``): its results against that kernel
(bit for bit: the same 128-deep products from zero, added in the same order) and against the
float64 loop, with partial last chunks, empty experts (exact zeros, their NaN scales unread), NaN
rows past the groups, bad sizes, m and n off the tiles, and every output dtype.
"""

from __future__ import annotations

import os
import re

import pytest
import torch
from device_infos import B200, H200
from sm90_compile import compile_sm90
from triton_interpreter import interpreting

triton = pytest.importorskip("triton")
H = pytest.importorskip("megablocks_triton.hopper_scaled_wgrad")

from megablocks_triton import scaled  # noqa: E402
from megablocks_triton.launch import _key, record_launches  # noqa: E402

E4M3 = torch.float8_e4m3fn
#: Where the kernels run: the GPU test device, or the CPU under the interpreter (the Triton
#: reference only: the Gluon kernel runs on a Hopper GPU alone).
DEVICE = torch.device(
    os.environ.get("MEGABLOCKS_TRITON_TEST_DEVICE", "cpu" if interpreting() else "cuda")
)
on_hopper = pytest.mark.skipif(
    not (
        DEVICE.type == "cuda"
        and not interpreting()
        and torch.cuda.is_available()
        and torch.cuda.get_device_capability(DEVICE) == (9, 0)
    ),
    reason="needs an sm_90 GPU",
)
#: The Triton reference: e4m3 dots need sm_89 or later on a GPU.
_RUNNABLE = (
    interpreting()
    if DEVICE.type == "cpu"
    else torch.cuda.is_available() and torch.cuda.get_device_capability(DEVICE) >= (8, 9)
)


def _fp8(*shape: int) -> torch.Tensor:
    return torch.zeros(shape, dtype=E4M3)


def test_serves_contiguous_e4m3_operands_and_tma_outputs_only() -> None:
    a, g = _fp8(64, 256), _fp8(128, 256)
    out = torch.zeros(2, 64, 128, dtype=torch.bfloat16)
    assert H.serves(a, g, out)
    assert H.serves(a, g, out.half())
    assert H.serves(a, g, out.float())
    assert H.serves(_fp8(5, 16), _fp8(3, 16), torch.zeros(1, 5, 8, dtype=torch.bfloat16))
    assert not H.serves(a.to(torch.float8_e4m3fnuz), g, out)
    assert not H.serves(a.to(torch.float8_e5m2), g.to(torch.float8_e5m2), out)
    assert not H.serves(a, g.to(torch.float8_e5m2), out)  # mixed formats
    assert not H.serves(a.bfloat16(), g.bfloat16(), out)
    assert not H.serves(_fp8(64, 200), _fp8(128, 200), out)  # 200-byte rows: not for TMA
    assert not H.serves(_fp8(256, 64).t(), g, out)  # rows not contiguous
    assert not H.serves(_fp8(64, 512)[:, :256], g, out)  # a strided view
    assert not H.serves(_fp8(64 * 256 + 8)[8:].view(64, 256), g, out)  # base off 16 bytes
    assert not H.serves(_fp8(2, 64, 256), g, out)  # not 2-D
    assert not H.serves(a, g, torch.zeros(2, 128, 64, dtype=torch.bfloat16).transpose(1, 2))
    assert not H.serves(a, g, torch.zeros(2, 64, 4, dtype=torch.bfloat16))  # 8-byte rows
    assert H.serves(a, g, torch.zeros(2, 64, 4))  # float32: 16-byte rows
    assert not H.serves(a, g, torch.zeros(2, 64, 128, dtype=torch.float64))
    assert not H.serves(a, g, torch.zeros(64, 128, dtype=torch.bfloat16))  # not 3-D
    base = torch.zeros(2 * 64 * 128 + 4, dtype=torch.bfloat16)[4:].view(2, 64, 128)
    assert not H.serves(a, g, base)  # base off 16 bytes


def test_no_rows_gives_zeros_without_a_launch() -> None:
    out = torch.full((3, 8, 16), float("nan"), dtype=torch.bfloat16)
    scales = torch.full((3, 8), float("nan")), torch.full((3, 16), float("nan"))
    H.launch(_fp8(8, 0), scales[0], _fp8(16, 0), scales[1], torch.zeros(3, dtype=torch.int32),
             out, block_e=4, num_sms=132)  # fmt: skip
    assert (out == 0).all() and not torch.signbit(out).any()


def test_the_arch_table_row_decides_where_it_runs() -> None:
    """Hopper's row runs it (gluon_scaled_wgrad); other archs, FNUZ data and the measurement
    switch take the Triton kernel."""
    a, out = _fp8(256, 64), torch.bfloat16
    assert scaled._warp_specialized_wgrad(H200, a, a, out)
    assert not scaled._warp_specialized_wgrad(B200, a, a, out)
    fnuz = a.view(torch.uint8).view(torch.float8_e4m3fnuz)
    assert not scaled._warp_specialized_wgrad(H200, fnuz, fnuz, out)
    before = scaled.WGRAD_WARP_SPECIALIZED
    scaled.WGRAD_WARP_SPECIALIZED = False
    try:
        assert not scaled._warp_specialized_wgrad(H200, a, a, out)
    finally:
        scaled.WGRAD_WARP_SPECIALIZED = before


def _meta(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


@pytest.mark.parametrize("out_dtype, stages", [(torch.bfloat16, 5), (torch.float32, 4)])
def test_launch_is_persistent_and_takes_the_cached_launch_path(
    out_dtype: torch.dtype, stages: int
) -> None:
    # DeepSeek-V3's down projection: 256 experts, (m, n) = (2048, 7168): one program an SM.
    experts, m, n, rows = 256, 2048, 7168, 131072
    operands = (
        _meta(m, rows, dtype=E4M3), _meta(experts, m), _meta(n, rows, dtype=E4M3),
        _meta(experts, n), _meta(experts, dtype=torch.int32), _meta(experts, m, n, dtype=out_dtype),
    )  # fmt: skip
    with record_launches(H200) as recorder:
        H.launch(*operands, block_e=256, num_sms=132)
    (launch,) = recorder.launches
    assert launch.kernel.fn.__name__ == "_scaled_wgrad_kernel"
    assert launch.grid == (132,)
    assert launch.kwargs["STAGES"] == stages == H.stages(out_dtype)
    assert launch.kwargs["BLOCK_E"] == 256 and launch.kwargs["num_warps"] == H.MMA_WARPS
    assert sum(type(a).__name__ == "TensorDescriptor" for a in launch.args) == 3
    _key(launch.args)  # every argument has a launch-cache key (raises where one has none)
    with pytest.raises(ValueError, match="block_e"):  # the kernel's tables hold block_e experts
        H.launch(*operands, block_e=128, num_sms=132)


#: Compiles the kernel for sm_90 (:func:`sm90_compile.compile_sm90`).
_COMPILE = """
from megablocks_triton import hopper_scaled_wgrad as H

out_dtype = getattr(torch, sys.argv[1])
block_e = int(sys.argv[2])
experts, m, n, rows = 3, 208, 304, 512
a = torch.zeros(m, rows, dtype=torch.float8_e4m3fn)
g = torch.zeros(n, rows, dtype=torch.float8_e4m3fn)
out = torch.zeros(experts, m, n, dtype=out_dtype)
descs = [  # with the launch's own (cached) layouts
    TensorDescriptor.from_tensor(t, list(block), H.shared_layout(block, t.dtype))
    for t, block in ((a, (H.BLOCK_M, H.BLOCK_K)), (g, (H.BLOCK_N, H.BLOCK_K)),
                     (out, (1, H.BLOCK_M, H.BLOCK_N)))
]
compiled = H._scaled_wgrad_kernel.warmup(
    *descs, torch.zeros(experts, m), torch.zeros(experts, n), m, 1, n, 1,
    torch.zeros(experts, dtype=torch.int32), experts, rows, m, n, 2, 3,
    BLOCK_E=block_e, STAGES=H.stages(out_dtype), LOADER_REGS=H.LOADER_REGISTERS,
    num_warps=H.MMA_WARPS, grid=(1,),
)
report(compiled)
"""


@pytest.mark.parametrize(
    "out_dtype, block_e",
    [("bfloat16", 256), ("bfloat16", 16), ("float16", 256), ("float16", 1), ("float32", 128)],
)
def test_compiles_for_sm90(out_dtype: str, block_e: int) -> None:
    # Up to DeepSeek-V3's 256 experts: nothing spills (the compile gate's rule).
    built = compile_sm90(_COMPILE, out_dtype, str(block_e))
    assert built["spills"] == 0, built["ptxas_log"]
    ptx = built["ptx"]
    # Each 128-deep product: four k32 e4m3 MMAs chained from a zero accumulator (the first with
    # its scale-d off), into a float32 sum.
    assert "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3" in ptx
    # The promotion overlapped: the older product is waited for with the newer one in flight,
    # and ptxas keeps it so (the products in two register sets: no wait injected, note C7517).
    assert "wgmma.wait_group.sync.aligned 1;" in ptx
    assert "warpgroup.wait is injected" not in built["ptxas_log"], built["ptxas_log"]
    # TMA loads of the operands, asynchronous TMA stores of the tiles (clipped by the 3-D box).
    assert "cp.async.bulk.tensor.2d.shared::cluster.global" in ptx
    assert "cp.async.bulk.tensor.3d.global.shared::cta" in ptx
    assert "cp.async.bulk.wait_group.read" in ptx
    # The epilogue's scales copied ahead by the loader, arriving on their ring's barriers.
    assert "cp.async.mbarrier.arrive.noinc" in ptx
    # Warp-specialized: the loader warp's registers set apart, the rest the MMA warps'.
    assert re.search(rf"setmaxnreg\.\w+\.sync\.aligned\.u32\s+{H.LOADER_REGISTERS};", ptx)


# ---------------------------------------------------------------------------------------------
# Results: the Triton reference (interpreter or GPU) and the Gluon kernel (sm_90 GPU)
# ---------------------------------------------------------------------------------------------


CASES = {
    # sizes, m, n
    "odd sizes, empty experts": ([1, 70, 0, 129, 300, 0, 255], 200, 264),
    "one expert": ([1000], 256, 136),
    "many experts": ([(7 * e) % 97 for e in range(200)], 128, 128),
    "whole chunks": ([128, 256, 512], 384, 256),
    "smaller than a tile": ([5, 17, 0, 3], 8, 16),
    "every expert empty": ([0, 0, 0], 136, 72),
    "bad sizes": ([-5, 300, 2**30, 4, -1], 72, 40),
    "several tiles a program": ([300, 700, 129, 1000], 1024, 768),
    # Experts starting off a 16-row boundary: their first chunk starts below it (TMA faults on
    # an unaligned start), the rows before theirs zeroed.
    "unaligned starts": ([8, 128, 100, 60, 3, 200], 256, 256),
}
#: Cheap enough for the interpreter.
INTERPRETED = ["bad sizes", "every expert empty", "odd sizes, empty experts", "smaller than a tile"]


def _extents(sizes: list[int], rows: int) -> list[tuple[int, int]]:
    """Each expert's first row and row count as the kernel makes them safe: a negative size
    counts as 0, groups are cut at the last row."""
    extents, before = [], 0
    for size in sizes:
        size = min(max(size, 0), rows)
        first = min(before, rows)
        extents.append((first, min(before + size, rows) - first))
        before += size
    return extents


def _case(name: str, device: torch.device) -> tuple[torch.Tensor, ...]:
    """a (m, rows) and grad (n, rows) e4m3 (NaN past the groups' rows, rows a multiple of 16),
    their scales (NaN for empty experts: never read) and the sizes."""
    sizes, m, n = CASES[name]
    total = sum(max(s, 0) for s in sizes)
    rows = -(-(min(total, 2048) + 13) // 16) * 16
    covered = min(total, rows)
    gen = torch.Generator().manual_seed(len(name))
    a = torch.full((m, rows), float("nan"))
    g = torch.full((n, rows), float("nan"))
    a[:, :covered] = 4 * torch.randn(m, covered, generator=gen)
    g[:, :covered] = 4 * torch.randn(n, covered, generator=gen)
    sa = torch.rand(len(sizes), m, generator=gen) + 0.5
    sg = torch.rand(len(sizes), n, generator=gen) / 64
    for e, (_, size) in enumerate(_extents(sizes, rows)):
        if not size:
            sa[e], sg[e] = float("nan"), float("nan")
    tensors = (a.to(E4M3), sa, g.to(E4M3), sg, torch.tensor(sizes, dtype=torch.int32))
    return tuple(t.to(device) for t in tensors)


def _loop(a: torch.Tensor, sa: torch.Tensor, g: torch.Tensor, sg: torch.Tensor,
          sizes: list[int]) -> torch.Tensor:  # fmt: skip
    """The float64 definition, one expert at a time (an empty expert's scales unread)."""
    out = []
    for e, (first, size) in enumerate(_extents(sizes, a.shape[1])):
        rows = slice(first, first + size)
        total = a[:, rows].double() @ g[:, rows].double().T
        out.append(total * sa[e].double()[:, None] * sg[e].double()[None, :] if size else total)
    return torch.stack(out)


def _reference(a: torch.Tensor, sa: torch.Tensor, g: torch.Tensor, sg: torch.Tensor,
               sizes: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """The triton backend's own Triton kernel (the Gluon one switched off), whose sums the Gluon
    kernel's equal: masked 128-deep chunks, each product promoted into the float32 sum."""
    name = str(out_dtype).removeprefix("torch.")
    before = scaled.WGRAD_WARP_SPECIALIZED
    scaled.WGRAD_WARP_SPECIALIZED = False
    try:
        return scaled.scaled_gmm_weight_grad(a, sa, g, sg, sizes, "fp8_rowwise", name)
    finally:
        scaled.WGRAD_WARP_SPECIALIZED = before


def _check(got: torch.Tensor, a: torch.Tensor, sa: torch.Tensor, g: torch.Tensor,
           sg: torch.Tensor, sizes: torch.Tensor) -> None:  # fmt: skip
    """Against the float64 loop (the same e4m3 data: a bfloat16 rounding's error), and exact
    zeros for empty experts."""
    ref = _loop(a.cpu(), sa.cpu(), g.cpu(), sg.cpu(), sizes.tolist())
    err = (got.double().cpu() - ref).norm() / ref.norm().clamp_min(1e-30)
    assert err < 1e-2, err
    empty = [e for e, (_, size) in enumerate(_extents(sizes.tolist(), a.shape[1])) if not size]
    assert (got[empty] == 0).all() and not torch.signbit(got[empty]).any()


@pytest.mark.skipif(not _RUNNABLE, reason=f"triton kernels on {DEVICE} cannot run here")
@pytest.mark.parametrize("name", INTERPRETED)
def test_the_reference_kernel_is_the_float64_loop(name: str) -> None:
    a, sa, g, sg, sizes = _case(name, DEVICE)
    got = _reference(a, sa, g, sg, sizes, torch.float32)
    assert torch.isfinite(got).all()
    _check(got, a, sa, g, sg, sizes)


def _block_e(experts: int) -> int:
    return 1 << (experts - 1).bit_length()


@on_hopper
@pytest.mark.parametrize("programs", ["one a SM", "three"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("name", sorted(CASES))
def test_equals_the_triton_kernel_and_a_float64_loop(
    name: str, out_dtype: torch.dtype, programs: str
) -> None:
    # Three programs: each walks many tiles, empty experts' and whole ones, across experts.
    a, sa, g, sg, sizes = _case(name, DEVICE)
    experts, m, n = sizes.numel(), a.shape[0], g.shape[0]
    got = torch.full((experts, m, n), float("nan"), dtype=out_dtype, device=DEVICE)
    assert H.serves(a, g, got)
    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    H.launch(a, sa, g, sg, sizes, got, block_e=_block_e(experts),
             num_sms=sms if programs == "one a SM" else 3)  # fmt: skip
    assert torch.isfinite(got).all()  # every element written, no NaN row or scale leaked
    assert torch.equal(got, _reference(a, sa, g, sg, sizes, out_dtype))
    _check(got, a, sa, g, sg, sizes)
