"""The warp-specialized Hopper weight gradient (megablocks_triton.hopper_wgrad).

On the CPU: which calls it serves, and that it compiles for sm_90 (Triton's own compiler and
ptxas, with a stand-in for the CUDA driver: no GPU is needed to build a cubin). On an sm_90 GPU:
its results against the Triton kernel it replaces (bit for bit: same tiles and chunk order) and
against a float64 loop, bad sizes and worst-case buffers included.
"""

from __future__ import annotations

import pytest
import torch
from device_infos import B200, H200
from sm90_compile import compile_sm90

triton = pytest.importorskip("triton")
hopper_wgrad = pytest.importorskip("megablocks_triton.hopper_wgrad")

from megablocks_triton import gmm as G  # noqa: E402

on_hopper = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
    reason="needs an sm_90 GPU",
)


PLAIN = G.GmmConfig(128, 256, 64, num_warps=8, num_stages=4)  # the Triton kernel's tiles
PLAIN_REDUCE = G.GmmConfig(
    128, 256, 32, num_warps=8, num_stages=6, use_tma=True, reduce_epilogue=True
)


def _aligned(rows: int, cols: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.zeros(rows, cols, dtype=dtype)


def test_serves_16_bit_tma_layouts_only() -> None:
    def serves(a: torch.Tensor, g: torch.Tensor, out: torch.Tensor, **where: object) -> bool:
        return G._warp_specialized(where.get("info", H200), a, g, out) is hopper_wgrad

    a, g, out = _aligned(64, 128), _aligned(64, 256), torch.zeros(2, 128, 256, dtype=torch.bfloat16)
    assert serves(a, g, out)
    assert serves(a.half(), g.half(), out.half())
    assert not serves(a, g, out.float())  # a float32 main_grad: the Triton kernel
    assert not serves(a.float(), g.float(), out.float())
    assert not serves(a, g.half(), out)  # mixed operand dtypes
    assert not serves(_aligned(64, 130)[:, :127], g, out)  # a 260-byte row stride
    assert not serves(_aligned(128, 64).t(), g, out)  # a column-major a
    assert not serves(a, g, torch.zeros(2, 256, 128, dtype=torch.bfloat16).transpose(1, 2))
    assert not serves(_aligned(65, 128).view(-1)[4:8196].view(64, 128), g, out)  # base
    # Only on sm_90 (which calls it takes is the declared variant's predicate: test_tiers.py).
    assert not serves(a, g, out, info=B200)


def test_other_triton_releases_take_the_triton_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    for version, available in (
        ("3.6.0", True),
        ("3.6.1+git", True),
        ("3.7.0", False),
        ("4.0", False),
    ):
        G._hopper_wgrad.cache_clear()
        monkeypatch.setattr(triton, "__version__", version)
        assert (G._hopper_wgrad() is not None) == available, version
    G._hopper_wgrad.cache_clear()


#: Compiles the kernel for sm_90 (:func:`sm90_compile.compile_sm90`).
_COMPILE = """
from megablocks_triton import hopper_wgrad as H

dtype = getattr(torch, sys.argv[1])
accumulate = sys.argv[2] == "1"
a, g = torch.zeros(512, 208, dtype=dtype), torch.zeros(512, 304, dtype=dtype)
out = torch.zeros(3, 208, 304, dtype=dtype)
descs = [  # with the launch's own (cached) layouts
    TensorDescriptor.from_tensor(t, block, H.shared_layout(tuple(block), dtype))
    for t, block in ((a, [H.BLOCK_K, H.BLOCK_M]), (g, [H.BLOCK_K, H.BLOCK_N]), (out, [1, H.BLOCK_M, H.BLOCK_N]))
]
compiled = H._gmm_wgrad_kernel.warmup(
    *descs, torch.zeros(3, dtype=torch.int32), 3, 512, 2, 2, BLOCK_E=4, STAGES=H.STAGES,
    ACCUMULATE=accumulate, LOADER_REGS=H.LOADER_REGISTERS, num_warps=H.MMA_WARPS, grid=(1,),
)
report(compiled)
"""


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_compiles_for_sm90(accumulate: bool, dtype: str) -> None:
    built = compile_sm90(_COMPILE, dtype, str(int(accumulate)))
    assert "wgmma.mma_async" in built["ptx"]
    # The epilogue: a TMA store of a new gradient, a TMA reduction into an existing one.
    assert ("cp.reduce.async.bulk.tensor" in built["ptx"]) == accumulate


# ---------------------------------------------------------------------------------------------
# On the GPU
# ---------------------------------------------------------------------------------------------


CASES = {
    # sizes, k (a's columns), n (grad's columns), extra NaN rows past the groups
    "odd sizes, empty experts": ([1, 70, 0, 129, 64, 0, 255], 200, 304, 0),
    "one expert": ([1000], 256, 512, 0),
    "many experts": ([(7 * e) % 97 for e in range(200)], 128, 256, 0),
    "worst-case buffer": ([0, 300, 17, 0, 65], 136, 264, 123),
    "tiles past k and n": ([130, 2, 64], 8, 8, 5),
}


def _case(name: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    sizes, k, n, spare = CASES[name]
    rows = sum(sizes)
    gen = torch.Generator().manual_seed(len(name))
    a = torch.full((rows + spare, k), float("nan"))
    g = torch.full((rows + spare, n), float("nan"))
    a[:rows] = torch.randn(rows, k, generator=gen)
    g[:rows] = torch.randn(rows, n, generator=gen)
    return a.to("cuda", dtype), g.to("cuda", dtype), torch.tensor(sizes, dtype=torch.int32).cuda()


def _loop(a: torch.Tensor, g: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """The float64 definition, one expert at a time."""
    out, start = [], 0
    for size in sizes.tolist():
        size = max(size, 0)
        rows = slice(start, min(start + size, a.shape[0]))
        out.append(a[rows].double().T @ g[rows].double())
        start += size
    return torch.stack(out)


@on_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", sorted(CASES))
def test_new_gradient_equals_the_triton_kernel(name: str, dtype: torch.dtype) -> None:
    a, g, sizes = _case(name, dtype)
    got = G.gmm_weight_grad_warp_specialized(a, g, sizes)
    want = G.gmm_weight_grad(a, g, sizes, config=PLAIN)
    assert torch.isfinite(got).all()
    assert torch.equal(got, want)
    ref = _loop(a, g, sizes)
    err = (got.double() - ref).norm() / ref.norm().clamp_min(1e-30)
    assert err < 4e-3
    empty = (sizes == 0).nonzero().flatten()
    assert (got[empty] == 0).all() and not torch.signbit(got[empty]).any()


@on_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", sorted(CASES))
def test_accumulating_equals_the_triton_reduction(name: str, dtype: torch.dtype) -> None:
    a, g, sizes = _case(name, dtype)
    start = torch.randn(sizes.numel(), a.shape[1], g.shape[1], device="cuda").to(dtype)
    got, want = start.clone(), start.clone()
    G.gmm_weight_grad_accumulate_warp_specialized(a, g, sizes, got)
    G.gmm_weight_grad_accumulate(a, g, sizes, want, config=PLAIN_REDUCE)
    assert torch.equal(got, want)
    empty = (sizes == 0).nonzero().flatten()
    assert torch.equal(got[empty], start[empty])  # untouched


@on_hopper
def test_bad_sizes_stay_inside_the_buffers() -> None:
    # Device-side sizes are not checked outside checked mode: negative ones count as 0 and groups
    # are cut at a's last row, as the Triton kernel does.
    a, g, _ = _case("odd sizes, empty experts", torch.bfloat16)
    for bad in ([-5, 300, 2**30, 4, -1], [2**31 - 1, 1, 1], [0, 0, 0]):
        sizes = torch.tensor(bad, dtype=torch.int32, device="cuda")
        got = G.gmm_weight_grad_warp_specialized(a, g, sizes)
        assert torch.equal(got, G.gmm_weight_grad(a, g, sizes, config=PLAIN))


@on_hopper
def test_the_default_policy_takes_it_for_a_new_gradient(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = hopper_wgrad.launch
    monkeypatch.setattr(hopper_wgrad, "launch", lambda *a, **k: calls.append(k) or real(*a, **k))
    import megablocks_core as mb
    from megablocks_core.plugin import call_op

    a, g, sizes = _case("odd sizes, empty experts", torch.bfloat16)
    out = torch.zeros(sizes.numel(), a.shape[1], g.shape[1], device="cuda", dtype=torch.bfloat16)
    # The triton backend forced (its kernels against other providers are the cost hints' choice):
    # the ranking gives the call to its declared variant triton/gluon-hopper.
    with mb.use_backend(gmm_weight_grad="triton", gmm_weight_grad_accumulate="triton"):
        call_op("gmm_weight_grad", a, g, sizes)
        call_op("gmm_weight_grad", a.float(), g.float(), sizes)  # float32: the Triton kernel
        call_op("gmm_weight_grad_accumulate", a, g, sizes, out)  # the policy keeps Triton's
    assert [c["accumulate"] for c in calls] == [False]
    G.gmm_weight_grad(a, g, sizes)  # the plain kernel never runs it
    assert len(calls) == 1
