"""Triton grouped GEMM (megablocks_triton.gmm) against the float64 oracle (oracle.py).

Runs under the Triton interpreter on the CPU (TRITON_INTERPRET=1, the default without a GPU: see
conftest.py), so shapes are tiny and tile configs small enough that every expert spans several
tiles and M-tiles straddle group ends.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import oracle
import pytest
import torch
from device_infos import B200, H200, MI300, RTX5090, RX7900
from triton_interpreter import interpreting

triton = pytest.importorskip("triton")

from megablocks_triton import gmm as G  # noqa: E402

# The kernels get CPU tensors: only the interpreter runs them (choose_config tests need neither).
needs_interpreter = pytest.mark.skipif(
    not interpreting(), reason="runs the kernels on CPU tensors: needs TRITON_INTERPRET=1"
)
from megablocks_triton.config import (  # noqa: E402
    ARCHS,
    LaunchConfigs,
    arch_tuning,
    use_launch_configs,
)

SMALL = G.GmmConfig(16, 16, 16, group_m=2, num_warps=1, num_stages=1)
# fp32 must track float64 closely (ieee dot, no tf32); 16-bit outputs are rounded once.
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-2, 2e-2), torch.float16: (2e-3, 2e-3)}


def _np(t: torch.Tensor) -> np.ndarray:
    """A tensor's exact values as a float64 numpy array (for the oracle)."""
    return t.double().numpy()


def _close(out: torch.Tensor, ref: np.ndarray, dtype: torch.dtype) -> None:
    rtol, atol = TOL[dtype]
    scale = max(1.0, float(np.abs(ref).max())) if ref.size else 1.0
    torch.testing.assert_close(out.double(), torch.from_numpy(ref), rtol=rtol, atol=atol * scale)


def _rand(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("trans_b", [False, True])
def test_gmm_odd_shapes(dtype: torch.dtype, trans_b: bool) -> None:
    sizes, k, n = [1, 7, 0, 33], 24, 40  # K, N not multiples of 16; an empty group
    a = _rand(sum(sizes), k, dtype=dtype, seed=0)
    b = _rand(len(sizes), *((n, k) if trans_b else (k, n)), dtype=dtype, seed=1)
    out = G.gmm(a, b, torch.tensor(sizes), trans_b, config=SMALL)
    assert out.shape == (sum(sizes), n) and out.dtype == dtype
    _close(out, oracle.gmm(_np(a), _np(b), sizes, trans_b), dtype)


@needs_interpreter
@pytest.mark.parametrize("sizes_dtype", [torch.int64, torch.int32])
def test_gmm_multi_tile_many_experts(sizes_dtype: torch.dtype) -> None:
    # 20 experts (BLOCK_E=32), several M- and N-tiles per expert, K % BLOCK_K == 0 (EVEN_K path),
    # and the default (interpreter) config with 4 persistent programs looping over ~90 tiles.
    sizes = [0, 37, 5, 0, 0, 16, 50, 1, 3, 17, 0, 32, 8, 2, 0, 19, 4, 0, 6, 33]
    k, n = 32, 48
    a = _rand(sum(sizes), k, dtype=torch.float32, seed=2)
    b = _rand(len(sizes), k, n, dtype=torch.float32, seed=3)
    bs = torch.tensor(sizes, dtype=sizes_dtype)
    _close(G.gmm(a, b, bs, False), oracle.gmm(_np(a), _np(b), sizes, False), torch.float32)


@needs_interpreter
def test_gmm_one_expert_and_empty() -> None:
    a = _rand(45, 24, dtype=torch.float32, seed=4)
    b = _rand(1, 24, 20, dtype=torch.float32, seed=5)
    _close(
        G.gmm(a, b, torch.tensor([45]), False, config=SMALL),
        oracle.gmm(_np(a), _np(b), [45], False),
        torch.float32,
    )
    # M = 0: nothing to compute, no launch.
    out = G.gmm(
        a[:0],
        _rand(3, 24, 20, dtype=torch.float32, seed=6),
        torch.zeros(3, dtype=torch.int64),
        False,
    )
    assert out.shape == (0, 20)


@needs_interpreter
def test_gmm_reads_nothing_outside_groups() -> None:
    # a: a narrowed view of a larger NaN-filled buffer (the tail is past the last group end);
    # b: a column slice of a NaN-padded buffer (non-unit row stride; clamped columns must stay < N).
    sizes, k, n = [9, 0, 14, 1], 24, 40
    m = sum(sizes)
    a_buf = torch.full((m + 23, k), float("nan"))
    a_buf[:m] = _rand(m, k, dtype=torch.float32, seed=7)
    b_buf = torch.full((len(sizes), k, n + 8), float("nan"))
    b_buf[:, :, :n] = _rand(len(sizes), k, n, dtype=torch.float32, seed=8)
    a, b = a_buf[:m], b_buf[:, :, :n]
    out = G.gmm(a, b, torch.tensor(sizes, dtype=torch.int32), False, config=SMALL)
    assert torch.isfinite(out).all()
    _close(out, oracle.gmm(_np(a), _np(b), sizes, False), torch.float32)
    # trans_b: b (E, N, K) sliced on N, so rows of b[e] beyond N are NaN.
    bt_buf = torch.full((len(sizes), n + 8, k), float("nan"))
    bt_buf[:, :n] = b.transpose(1, 2)
    out = G.gmm(a, bt_buf[:, :n], torch.tensor(sizes), True, config=SMALL)
    assert torch.isfinite(out).all()
    _close(out, oracle.gmm(_np(a), _np(b), sizes, False), torch.float32)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_weight_grad_odd_shapes_empty_experts(dtype: torch.dtype) -> None:
    sizes, k, n = [1, 7, 0, 33, 0], 24, 40
    m = sum(sizes)
    a = _rand(m, k, dtype=dtype, seed=9)
    g = _rand(m, n, dtype=dtype, seed=10)
    out = G.gmm_weight_grad(a, g, torch.tensor(sizes), config=SMALL)
    assert out.shape == (len(sizes), k, n) and out.dtype == dtype
    assert (out[2] == 0).all() and (out[4] == 0).all()  # exact zeros, not just small
    assert not torch.signbit(out[2]).any()  # +0.0, as a zero-initialised accumulator gives
    _close(out, oracle.gmm_weight_grad(_np(a), _np(g), sizes), dtype)


@needs_interpreter
@pytest.mark.parametrize("sizes_dtype", [torch.int64, torch.int32])
def test_weight_grad_worst_case_buffer(sizes_dtype: torch.dtype) -> None:
    # The whole worst-case-allocated buffers are passed; rows beyond sum(batch_sizes) are NaN and
    # must not be read (the single-group backward bug seen in other grouped-GEMM ports).
    sizes, k, n = [0, 20, 3, 0, 18], 40, 24
    m = sum(sizes)
    a = torch.full((m + 19, k), float("nan"))
    g = torch.full((m + 19, n), float("nan"))
    a[:m] = _rand(m, k, dtype=torch.float32, seed=11)
    g[:m] = _rand(m, n, dtype=torch.float32, seed=12)
    out = G.gmm_weight_grad(a, g, torch.tensor(sizes, dtype=sizes_dtype))
    assert torch.isfinite(out).all()
    assert (out[0] == 0).all() and (out[3] == 0).all()
    _close(out, oracle.gmm_weight_grad(_np(a[:m]), _np(g[:m]), sizes), torch.float32)
    # A single group covering only part of the buffer.
    out1 = G.gmm_weight_grad(a, g, torch.tensor([m], dtype=sizes_dtype), config=SMALL)
    assert torch.isfinite(out1).all()
    _close(out1, oracle.gmm_weight_grad(_np(a[:m]), _np(g[:m]), [m]), torch.float32)


@needs_interpreter
def test_weight_grad_no_tokens() -> None:
    a, g = torch.empty(0, 24), torch.empty(0, 40)
    out = G.gmm_weight_grad(a, g, torch.zeros(3, dtype=torch.int64))
    assert out.shape == (3, 24, 40) and (out == 0).all()
    # Tokens present in the buffer but every group empty: the kernel itself stores zeros.
    a = torch.full((5, 24), float("nan"))
    g = torch.full((5, 40), float("nan"))
    out = G.gmm_weight_grad(a, g, torch.zeros(3, dtype=torch.int32), config=SMALL)
    assert (out == 0).all()


# (a's dtype, out's dtype): the same dtype, and a float32 buffer (main_grad) for 16-bit a.
ACCUMULATE_DTYPES = [
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float16),
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.float32),
]


@needs_interpreter
@pytest.mark.parametrize(("dtype", "out_dtype"), ACCUMULATE_DTYPES, ids=str)
def test_weight_grad_accumulate_adds_into_out(dtype: torch.dtype, out_dtype: torch.dtype) -> None:
    """out[e] += a_e.T @ grad_e against the float64 oracle: odd K and N (masked tile edges),
    several tiles per expert, empty experts left bit-for-bit untouched (NaN, -0.0 included)."""
    sizes, k, n = [1, 7, 0, 33, 0, 12], 24, 40
    m = sum(sizes)
    a = _rand(m, k, dtype=dtype, seed=30)
    g = _rand(m, n, dtype=dtype, seed=31)
    before = _rand(len(sizes), k, n, dtype=out_dtype, seed=32)
    before[2] = float("nan")  # an empty expert's buffer is neither read nor written
    before[4] = -0.0
    out = before.clone()
    assert G.gmm_weight_grad_accumulate(a, g, torch.tensor(sizes), out, config=SMALL) is None
    assert out.dtype == out_dtype and out.shape == before.shape
    assert torch.isnan(out[2]).all()
    assert (out[4] == 0).all() and torch.signbit(out[4]).all()
    want = _np(before) + oracle.gmm_weight_grad(_np(a), _np(g), sizes)
    full = [e for e, size in enumerate(sizes) if size]
    # Accumulated in float32 and rounded once to out's dtype: with a float32 out the 16-bit
    # products are never rounded to 16 bits, so float32's tolerance holds.
    _close(out[full], want[full], out_dtype)


@needs_interpreter
@pytest.mark.parametrize("sizes_dtype", [torch.int64, torch.int32])
def test_weight_grad_accumulate_default_config_and_worst_case_buffer(
    sizes_dtype: torch.dtype,
) -> None:
    # 20 experts, the default (interpreter) tiles with 4 persistent programs; a and grad are
    # worst-case buffers whose rows past sum(batch_sizes) are NaN and must not be read.
    sizes = [0, 37, 5, 0, 0, 16, 50, 1, 3, 17, 0, 32, 8, 2, 0, 19, 4, 0, 6, 33]
    m, k, n = sum(sizes), 32, 48
    a = torch.full((m + 9, k), float("nan"))
    g = torch.full((m + 9, n), float("nan"))
    a[:m] = _rand(m, k, dtype=torch.float32, seed=33)
    g[:m] = _rand(m, n, dtype=torch.float32, seed=34)
    before = _rand(len(sizes), k, n, dtype=torch.float32, seed=35)
    out = before.clone()
    G.gmm_weight_grad_accumulate(a, g, torch.tensor(sizes, dtype=sizes_dtype), out)
    assert torch.isfinite(out).all()
    want = _np(before) + oracle.gmm_weight_grad(_np(a[:m]), _np(g[:m]), sizes)
    _close(out, want, torch.float32)
    for e, size in enumerate(sizes):
        if not size:
            assert torch.equal(out[e], before[e]), e


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_weight_grad_accumulate_tma_path(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Hopper variant (interpreter-emulated descriptors): whole token chunks through TMA,
    each group's partial last chunk masked; a and grad are worst-case buffers whose rows past
    the groups are NaN, the gradient tile is read and written through a 3-D descriptor (odd K
    and N clipped by its bounds), an empty expert's NaN buffer is left untouched."""
    from megablocks_triton import gmm_wgrad  # the weight gradients' launches read it there

    made = []
    real = gmm_wgrad.TensorDescriptor

    class Counting:
        @staticmethod
        def from_tensor(t: torch.Tensor, block: list[int]) -> object:
            made.append(tuple(block))
            return real.from_tensor(t, block)

    monkeypatch.setattr(gmm_wgrad, "TensorDescriptor", Counting)
    sizes, k, n = [32, 7, 0, 48, 16, 1], 40, 24
    m = sum(sizes)
    a = torch.full((m + 16, k), float("nan"), dtype=dtype)
    g = torch.full((m + 16, n), float("nan"), dtype=dtype)
    a[:m] = _rand(m, k, dtype=dtype, seed=40)
    g[:m] = _rand(m, n, dtype=dtype, seed=41)
    before = _rand(len(sizes), k, n, dtype=dtype, seed=42)
    before[2] = float("nan")
    out = before.clone()
    cfg = G.GmmConfig(16, 16, 16, group_m=2, num_warps=1, num_stages=1, use_tma=True)
    G.gmm_weight_grad_accumulate(a, g, torch.tensor(sizes), out, config=cfg)
    assert made == [(16, 16), (16, 16), (1, 16, 16)]  # a, grad and the gradient's descriptors
    assert torch.isnan(out[2]).all()
    full = [e for e, size in enumerate(sizes) if size]
    want = _np(before) + oracle.gmm_weight_grad(_np(a[:m]), _np(g[:m]), sizes)
    _close(out[full], want[full], dtype)
    # A float32 gradient (main_grad) keeps the plain epilogue: no descriptor is made.
    made.clear()
    wide = before.float()
    G.gmm_weight_grad_accumulate(a, g, torch.tensor(sizes), wide, config=cfg)
    assert made == []
    _close(wide[full], want[full], torch.float32)
    # The interpreter has no TMA reduction: a config asking for it reads, adds and writes.
    made.clear()
    out = before.clone()
    reducing = dataclasses.replace(cfg, reduce_epilogue=True)
    G.gmm_weight_grad_accumulate(a, g, torch.tensor(sizes), out, config=reducing)
    assert made == [(16, 16), (16, 16), (1, 16, 16)]
    _close(out[full], want[full], dtype)


@needs_interpreter
def test_weight_grad_accumulate_twice_equals_the_sum() -> None:
    """Two micro-batches accumulated into one buffer give the sum of their weight gradients."""
    sizes, k, n = [9, 0, 14], 16, 24
    m = sum(sizes)
    out = torch.zeros(3, k, n)
    parts = []
    for seed in (36, 37):
        a, g = (
            _rand(m, k, dtype=torch.float32, seed=seed),
            _rand(m, n, dtype=torch.float32, seed=seed + 10),
        )
        G.gmm_weight_grad_accumulate(a, g, torch.tensor(sizes), out, config=SMALL)
        parts.append(oracle.gmm_weight_grad(_np(a), _np(g), sizes))
    _close(out, parts[0] + parts[1], torch.float32)
    assert (out[1] == 0).all()


@needs_interpreter
def test_weight_grad_accumulate_no_rows_leaves_out_unchanged() -> None:
    before = _rand(3, 24, 40, dtype=torch.float32, seed=38)
    out = before.clone()
    G.gmm_weight_grad_accumulate(
        torch.empty(0, 24), torch.empty(0, 40), torch.zeros(3, dtype=torch.int64), out
    )
    assert torch.equal(out, before)
    # Rows in the buffers, but every group empty: the kernel runs and touches nothing.
    nan_rows = torch.full((5, 24), float("nan")), torch.full((5, 40), float("nan"))
    G.gmm_weight_grad_accumulate(*nan_rows, torch.zeros(3, dtype=torch.int32), out, config=SMALL)
    assert torch.equal(out, before)


@needs_interpreter
def test_weight_grad_accumulate_passes_the_conformance_kit() -> None:
    """Through the core (validation, dispatch) against the reference's composition: the quick
    scenarios and the full set's float32 buffers for 16-bit data (fp16 here: the interpreter
    leaves bf16 to the reference)."""
    from megablocks_core import testing

    wide = [s for s in testing.FULL if s.accumulate_dtype not in (None, s.dtype)]
    result = testing.check_op(
        "triton", "gmm_weight_grad_accumulate", "cpu", cases=(*testing.QUICK, *wide)
    )
    assert result.status == "pass", result.message
    assert result.scenarios >= 5  # fp32 and fp16 scenarios ran on triton, bf16 ones declined


@needs_interpreter
def test_non_unit_inner_stride() -> None:
    # A transposed view of a is made contiguous by the wrapper; results unchanged.
    sizes, k, n = [5, 12], 24, 16
    a = _rand(k, sum(sizes), dtype=torch.float32, seed=13).T
    b = _rand(2, k, n, dtype=torch.float32, seed=14)
    _close(
        G.gmm(a, b, torch.tensor(sizes), False, config=SMALL),
        oracle.gmm(_np(a), _np(b), sizes, False),
        torch.float32,
    )


# ---------------------------------------------------------------------------------------------
# choose_config: pure function of the shapes / dtype / device description.
# ---------------------------------------------------------------------------------------------


def test_choose_config_tables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MEGABLOCKS_TRITON_GMM_CONFIG", raising=False)
    monkeypatch.delenv("MEGABLOCKS_TRITON_GMM_WGRAD_CONFIG", raising=False)
    # A large problem gets the arch row's tiles as they are (whatever they are tuned to).
    hopper = arch_tuning(H200)
    big = G.choose_config("gmm", 32768, 14336, 4096, 8, torch.bfloat16, H200)
    assert big == hopper.gmm_tiles[("gmm", "16bit")]
    # Many small experts (~64 rows each): BLOCK_M shrinks, not below 64; few output columns
    # take the row's stage count for them.
    small = G.choose_config("gmm", 128 * 64, 768, 2048, 128, torch.bfloat16, H200)
    assert small.block_m == 64 and small.num_stages == hopper.gmm_small_n_stages
    tiny = G.choose_config("gmm", 128 * 8, 768, 2048, 128, torch.bfloat16, H200)
    assert tiny.block_m == 16  # capped by the rows per expert
    # Blocks never exceed the (power-of-two rounded) problem.
    c = G.choose_config("gmm", 4096, 40, 24, 4, torch.float32, H200)
    assert c.block_n == 64 and c.block_k == 32
    mi300_wgrad = G.choose_config("wgrad", 2048, 768, 131072, 128, torch.bfloat16, MI300)
    assert mi300_wgrad.num_stages == ARCHS["amd"].gmm_tiles[("wgrad", "16bit")].num_stages
    # By family: data-center Blackwell has its own tiles, sm_120 the generic NVIDIA ones, and
    # every AMD GPU the portable AMD ones (the rocm plugin tunes CDNA through its launch policy).
    b200 = G.choose_config("gmm", 32768, 14336, 4096, 8, torch.bfloat16, B200)
    assert b200 == ARCHS["blackwell"].gmm_tiles[("gmm", "16bit")]
    for device, family in ((RTX5090, "cuda"), (MI300, "amd"), (RX7900, "amd")):
        for op in ("gmm", "wgrad"):
            got = G.choose_config(op, 4096, 4096, 4096, 8, torch.float16, device)
            assert got == ARCHS[family].gmm_tiles[(op, "16bit")], (device.arch, op)
    assert G.device_info(torch.device("cpu")).kind == "cpu"
    # Hopper, 16-bit: a short K loop is flattened into the tile loop (qwen3's K = 768, and 1536
    # for gated experts' x gradient), a long one is not; the accumulating weight gradient goes
    # through TMA with a reduction epilogue and 32-token steps: 6 stages into a 16-bit gradient,
    # 128-wide tiles and 8 stages into a float32 one (main_grad). Not on AMD.
    assert G.choose_config("gmm", 131072, 2048, 768, 128, torch.bfloat16, H200).flatten
    assert G.choose_config("gmm", 131072, 2048, 1536, 128, torch.bfloat16, H200).flatten
    assert not G.choose_config("gmm", 131072, 768, 2048, 128, torch.bfloat16, H200).flatten
    wgrad = G.choose_config("wgrad", 2048, 768, 131072, 128, torch.bfloat16, H200)
    into_bf16 = G.choose_config(
        "wgrad_accumulate", 2048, 768, 131072, 128, torch.bfloat16, H200, torch.bfloat16
    )
    tma_reduce = {"use_tma": True, "reduce_epilogue": True}
    assert into_bf16 == dataclasses.replace(wgrad, block_k=32, num_stages=6, **tma_reduce)
    tma_reduce["warp_specialized"] = False
    into_fp32 = G.choose_config(
        "wgrad_accumulate", 2048, 768, 131072, 128, torch.bfloat16, H200, torch.float32
    )
    assert into_fp32 == dataclasses.replace(
        wgrad, block_n=128, block_k=32, num_stages=8, **tma_reduce
    )
    assert not wgrad.use_tma and not wgrad.reduce_epilogue
    fp32_data = G.choose_config(
        "wgrad_accumulate", 2048, 768, 131072, 128, torch.float32, H200, torch.float32
    )
    assert not fp32_data.use_tma and not fp32_data.reduce_epilogue
    on_amd = G.choose_config(
        "wgrad_accumulate", 2048, 768, 131072, 128, torch.bfloat16, MI300, torch.bfloat16
    )
    assert not on_amd.use_tma and not on_amd.reduce_epilogue
    # The warp-specialized weight gradient: a new gradient on Hopper from 16-bit operands (its
    # launch then also checks the layouts: tests/test_hopper_wgrad.py); adding into a 16-bit
    # gradient only from 769 to 1024 tokens per expert (qwen3's 1024: yes; dsv3's 512: no), never
    # into a float32 one (the Gluon kernel writes 16-bit gradients only).
    assert wgrad.warp_specialized and into_bf16.warp_specialized
    assert not into_fp32.warp_specialized
    assert not fp32_data.warp_specialized and not on_amd.warp_specialized
    for tokens, experts, want in ((131072, 256, False), (98304, 128, False), (98432, 128, True)):
        assert (
            G.choose_config(
                "wgrad_accumulate", 7168, 2048, tokens, experts, torch.bfloat16, H200,
                torch.bfloat16,
            ).warp_specialized
            is want
        ), (tokens, experts)  # fmt: skip
    for device in (B200, RTX5090, MI300):
        assert not G.choose_config(
            "wgrad", 2048, 768, 131072, 128, torch.bfloat16, device
        ).warp_specialized
    assert not G.choose_config("gmm", 131072, 2048, 768, 128, torch.bfloat16, H200).warp_specialized
    # Only where it was measured: up to 1024 tokens per expert (not mixtral's 4096).
    assert G.choose_config("wgrad", 7168, 2048, 131072, 256, torch.bfloat16, H200).warp_specialized
    assert not G.choose_config(
        "wgrad", 4096, 14336, 32768, 8, torch.bfloat16, H200
    ).warp_specialized


@needs_interpreter
def test_choose_config_asks_the_launch_policy() -> None:
    class Fixed(LaunchConfigs):
        def gmm(self, device, tokens, n, k, num_experts, dtype):
            return G.GmmConfig(32, 16, 16, group_m=1, num_warps=2, num_stages=1)

        def gmm_wgrad(self, device, rows, cols, tokens, num_experts, dtype):
            return G.GmmConfig(16, 32, 16, group_m=1, num_warps=2, num_stages=1)

    with use_launch_configs(Fixed()):
        assert G.choose_config("gmm", 4096, 4096, 4096, 8, torch.bfloat16, H200).block_m == 32
        assert G.choose_config("wgrad", 4096, 4096, 4096, 8, torch.bfloat16, H200).block_n == 32
        # ... and its tiles reach the kernels: still exact with 32-row and 32-column tiles.
        sizes, k, n = [3, 0, 40], 24, 20
        a = _rand(43, k, dtype=torch.float32, seed=21)
        b = _rand(3, k, n, dtype=torch.float32, seed=22)
        _close(
            G.gmm(a, b, torch.tensor(sizes), False),
            oracle.gmm(_np(a), _np(b), sizes, False),
            torch.float32,
        )
    assert G.choose_config("gmm", 4096, 4096, 4096, 8, torch.bfloat16, H200).block_m == 128


@needs_interpreter
def test_choose_config_env_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEGABLOCKS_TRITON_GMM_CONFIG", "64,128,32,4,4,5")
    cfg = G.choose_config("gmm", 4096, 4096, 4096, 8, torch.bfloat16, H200)
    assert cfg == G.GmmConfig(64, 128, 32, group_m=4, num_warps=4, num_stages=5)
    monkeypatch.setenv("MEGABLOCKS_TRITON_GMM_CONFIG", "64,128")
    with pytest.raises(ValueError):
        G.choose_config("gmm", 4096, 4096, 4096, 8, torch.bfloat16, H200)
    # The override drives the kernel of a call shape first seen after it is set (here: 32x16x16
    # tiles on the interpreter); the prepared launch keeps it.
    monkeypatch.setenv("MEGABLOCKS_TRITON_GMM_CONFIG", "32,16,16,1,1,1")
    monkeypatch.setattr(G, "_FORWARD_PLANS", {})
    sizes = [3, 0, 38]
    a = _rand(41, 24, dtype=torch.float32, seed=15)
    b = _rand(3, 24, 20, dtype=torch.float32, seed=16)
    _close(
        G.gmm(a, b, torch.tensor(sizes), False),
        oracle.gmm(_np(a), _np(b), sizes, False),
        torch.float32,
    )
    (plan,) = G._FORWARD_PLANS.values()
    assert plan.config == G.GmmConfig(32, 16, 16, group_m=1, num_warps=1, num_stages=1)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("trans_b", [False, True])
def test_gmm_tma_path(dtype: torch.dtype, trans_b: bool) -> None:
    # The Hopper TMA variant (interpreter-emulated descriptors): K tail and rows past M come back
    # zero-filled from the descriptor bounds; a 3-D b descriptor keeps b[e]'s K tail off b[e + 1].
    sizes, k, n = [1, 7, 0, 33, 5], 40, 24
    a = _rand(sum(sizes), k, dtype=dtype, seed=17)
    b_buf = torch.full(
        (len(sizes) + 1, *((n, k) if trans_b else (k, n))), float("nan"), dtype=dtype
    )
    b = b_buf[: len(sizes)]  # NaN past the last expert: a K tail read from there would show up
    b.copy_(_rand(*b.shape, dtype=dtype, seed=18))
    cfg = G.GmmConfig(16, 16, 32, group_m=2, num_warps=1, num_stages=1, use_tma=True)
    out = G.gmm(a, b, torch.tensor(sizes), trans_b, config=cfg)
    assert torch.isfinite(out).all()
    _close(out, oracle.gmm(_np(a), _np(b), sizes, trans_b), dtype)


# ---------------------------------------------------------------------------------------------
# Prepared forward launches: one per call shape, never reused for another.
# ---------------------------------------------------------------------------------------------

TMA_SMALL = dataclasses.replace(SMALL, block_k=32, use_tma=True)


def _a_operand(m: int, k: int, dtype: torch.dtype, layout: str, seed: int) -> torch.Tensor:
    """(m, k) values laid out as asked: contiguous, rows of a wider buffer (row stride k + 8),
    or starting one element past a 16-byte boundary (no TMA descriptor may be built on it)."""
    values = _rand(m, k, dtype=dtype, seed=seed)
    if layout == "wide rows":
        buf = torch.full((m, k + 8), float("nan"), dtype=dtype)
        buf[:, :k] = values
        return buf[:, :k]
    if layout == "unaligned":
        flat = torch.full((m * k + 1,), float("nan"), dtype=dtype)
        out = flat[1:].view(m, k)
        out.copy_(values)
        return out
    return values


@needs_interpreter
def test_prepared_gmm_follows_each_call_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    """gmm calls that change one thing at a time (rows, experts, columns, trans_b, dtype, the
    counts' dtype, a's row stride, a TMA config, an unaligned a) and come back to earlier
    shapes with new data: every result against the float64 oracle, so a launch prepared for
    another call shape would show."""
    monkeypatch.setattr(G, "_FORWARD_PLANS", {})
    cases = [
        # sizes, k, n, trans_b, dtype, counts dtype, a's layout, config
        ([5, 0, 12], 24, 16, False, torch.float32, torch.int64, "contiguous", SMALL),
        ([17], 24, 16, False, torch.float32, torch.int64, "contiguous", SMALL),  # one expert
        ([0, 0, 0], 24, 16, False, torch.float32, torch.int64, "contiguous", SMALL),  # no tokens
        ([5, 0, 12], 24, 40, False, torch.float32, torch.int64, "contiguous", SMALL),
        ([5, 0, 12], 24, 24, False, torch.float32, torch.int64, "contiguous", SMALL),
        ([5, 0, 12], 24, 24, True, torch.float32, torch.int64, "contiguous", SMALL),  # b's shape
        ([5, 0, 12], 24, 16, False, torch.float16, torch.int64, "contiguous", SMALL),
        ([5, 0, 12], 24, 16, False, torch.float32, torch.int32, "contiguous", SMALL),
        ([5, 0, 12], 24, 16, False, torch.float32, torch.int64, "wide rows", SMALL),
        ([9, 1, 0, 30], 64, 24, False, torch.float32, torch.int32, "contiguous", TMA_SMALL),
        ([9, 1, 0, 30], 64, 24, False, torch.float32, torch.int32, "unaligned", TMA_SMALL),
        ([0, 7, 2], 40, 16, True, torch.float16, torch.int32, "contiguous", None),
    ]
    for seed, (sizes, k, n, trans_b, dtype, count_dtype, layout, cfg) in enumerate(cases * 2):
        a = _a_operand(sum(sizes), k, dtype, layout, seed)
        b = _rand(len(sizes), *((n, k) if trans_b else (k, n)), dtype=dtype, seed=100 + seed)
        out = G.gmm(a, b, torch.tensor(sizes, dtype=count_dtype), trans_b, config=cfg)
        assert out.shape == (sum(sizes), n) and out.dtype == dtype
        _close(out, oracle.gmm(_np(a), _np(b), sizes, trans_b), dtype)
    # The aligned and the unaligned TMA call share one prepared launch (the address decides per
    # call); every other case has its own.
    assert len(G._FORWARD_PLANS) == len(cases) - 1


def _routing(tokens: int, top_k: int, experts: int, seed: int, empty: bool = False) -> dict:
    r = oracle.make_routing(np.random.default_rng(seed), tokens, top_k, experts, empty=empty)
    as_int32 = {
        name: torch.from_numpy(r[name]).to(torch.int32) for name in ("indices", "bin_ids", "bins")
    }
    return {**r, **as_int32}


@needs_interpreter
def test_prepared_gather_gmm_and_gmm_scatter_follow_each_call_shape(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """gather_gmm and gmm_scatter over changing routings (tokens, top_k, experts, empty experts,
    no tokens), weights absent or of two dtypes, trans_b, a TMA config for b: each result
    against the float64 row loops; a launch kept for another call shape would show."""
    monkeypatch.setattr(G, "_FORWARD_PLANS", {})
    monkeypatch.setattr(G, "_GMM_SCATTER_PLANS", {})
    cases = [
        # tokens, top_k, experts, empty experts, hidden, ffn, trans_b, weights dtype, config
        (6, 2, 4, False, 24, 16, False, torch.float32, SMALL),
        (6, 2, 4, False, 24, 16, False, None, SMALL),
        (6, 2, 4, False, 24, 16, False, torch.float16, SMALL),
        (5, 3, 4, True, 24, 16, False, torch.float32, SMALL),
        (9, 1, 1, False, 24, 16, True, torch.float32, SMALL),  # one expert
        (0, 2, 4, False, 24, 16, False, torch.float32, SMALL),  # no tokens
        (7, 2, 5, False, 32, 40, False, torch.float32, TMA_SMALL),
        (7, 2, 5, False, 32, 40, True, None, TMA_SMALL),
    ]
    dtype = torch.float32
    for seed, case in enumerate(cases * 2):
        tokens, top_k, experts, empty, hidden, ffn, trans_b, w_dtype, cfg = case
        r = _routing(tokens, top_k, experts, seed, empty)
        routing = (r["indices"], r["bin_ids"])
        x = _rand(tokens, hidden, dtype=dtype, seed=seed)
        w1 = _rand(experts, *((ffn, hidden) if trans_b else (hidden, ffn)), dtype=dtype, seed=seed)
        rows = G.gather_gmm(x, w1, *routing, r["bins"], top_k, trans_b, config=cfg)
        want = oracle.gather_gmm(_np(x), _np(w1), r["indices"], r["bins"], top_k, trans_b)
        _close(rows, want, dtype)
        h = _rand(tokens * top_k, ffn, dtype=dtype, seed=50 + seed)
        w2 = _rand(experts, *((hidden, ffn) if trans_b else (ffn, hidden)), dtype=dtype, seed=seed)
        weights = None
        if w_dtype is not None:
            weights = torch.rand(tokens * top_k, generator=_gen(seed)).to(w_dtype)
        out = G.gmm_scatter(h, w2, *routing, weights, r["bins"], top_k, trans_b)
        w_np = None if weights is None else _np(weights)
        want = oracle.gmm_scatter(_np(h), _np(w2), r["indices"], w_np, r["bins"], top_k, trans_b)
        assert out.shape == (tokens, hidden)
        _close(out, want, dtype)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@needs_interpreter
@pytest.mark.parametrize(
    "bins, covered",
    [
        ([3, 7], 7),  # sorted rows 7.. belong to no expert (expert parallelism's sentinel pairs)
        ([0, 0], 0),  # every pair unrouted
        ([9, 4], 9),  # not cumulative: a negative group counts as 0, rows 0..8 are covered
    ],
)
def test_gmm_scatter_reduction_reads_only_covered_rows(bins: list[int], covered: int) -> None:
    """gmm_scatter's GEMM leaves the sorted rows no group covers unwritten, so its reduction
    must never read them: NaN there must not reach the output, and every covered row counts."""
    from megablocks_triton.permutation import _scatter_plan

    tokens, top_k, hidden = 6, 2, 8
    n = tokens * top_k
    indices = torch.randperm(n, generator=_gen(0)).to(torch.int32)
    weights = torch.rand(n, generator=_gen(1))
    rows = _rand(n, hidden, dtype=torch.float32, seed=2)
    rows[covered:] = float("nan")
    plan = _scatter_plan(LaunchConfigs(), rows, n, len(bins), top_k, True, grouped_rows=True)
    out = plan(rows, indices, weights, torch.tensor(bins, dtype=torch.int32))
    want = np.zeros((tokens, hidden))
    for p, f in enumerate(indices.tolist()):  # sorted row p holds flat id f = t * top_k + k
        if p < covered:
            want[f // top_k] += float(weights[f]) * _np(rows[p])
    _close(out, want, torch.float32)
