"""gmm_scatter's few-token path (megablocks_triton.kernels.token_gmm: activation, GEMM, bias,
weights and the top-k sum in one launch) against float64 row loops written here, and against the
tiled path (three launches) on the same calls.

Runs under the Triton interpreter on the CPU (TRITON_INTERPRET=1, the default without a GPU), or
on ``MEGABLOCKS_TRITON_TEST_DEVICE`` (default cuda without the interpreter).
"""

from __future__ import annotations

import math
import os

import numpy as np
import oracle
import pytest
import torch
from device_infos import H200, MI300
from triton_interpreter import interpreting

from megablocks_core.plugin import DeviceInfo

pytest.importorskip("triton")

from megablocks_triton import gmm as G
from megablocks_triton.config import LaunchConfigs, TokenGmmConfig, use_launch_configs

DEVICE = torch.device(
    os.environ.get("MEGABLOCKS_TRITON_TEST_DEVICE", "cpu" if interpreting() else "cuda")
)
needs_interpreter = pytest.mark.skipif(
    not (interpreting() if DEVICE.type == "cpu" else torch.cuda.is_available()),
    reason=f"Triton kernels on {DEVICE} cannot run here",
)
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-2, 2e-2)}


class _Tiled(LaunchConfigs):
    """The launch policy with the few-token path turned off."""

    def token_gmm_scatter(self, *args: int) -> None:
        return None


class _Always(LaunchConfigs):
    """The launch policy sending every call to the one-launch path (any layout, any tokens),
    counting them."""

    taken = 0

    def token_gmm_scatter(
        self, num_tokens: int, top_k: int, depth: int, width: int, *rest: object
    ) -> TokenGmmConfig:
        type(self).taken += 1
        return TokenGmmConfig(block_n=16, block_k=16, num_warps=4)


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-z))


def _act(x: np.ndarray, name: str | None, alpha: float | None, limit: float | None) -> np.ndarray:
    """What gmm_scatter applies to its rows, in float64, written out for the names the oracle
    does not know (interleaved rows, GPT-OSS's clamped SwiGLU)."""
    if name is not None and name.startswith("swiglu_oai"):
        a = 1.702 if alpha is None else alpha
        lim = 7.0 if limit is None else limit
        if name.endswith("_interleaved"):
            gate, up = x[:, 0::2], x[:, 1::2]
        else:
            gate, up = np.split(x, 2, axis=1)
        gate = np.minimum(gate, lim)
        return gate * _sigmoid(a * gate) * (np.clip(up, -lim, lim) + 1.0)
    if name == "swiglu_interleaved":
        gate, up = x[:, 0::2], x[:, 1::2]
        return gate * _sigmoid(gate) * up
    if name == "gelu_erf":
        return np.array([[0.5 * v * (1.0 + math.erf(v / math.sqrt(2.0))) for v in r] for r in x])
    return oracle.activate_rows(x, name)


def _want(
    x: torch.Tensor,
    b: torch.Tensor,
    indices: torch.Tensor,
    weights: torch.Tensor | None,
    bins: list[int],
    top_k: int,
    trans_b: bool,
    bias: torch.Tensor | None,
    act: str | None,
    alpha: float | None = None,
    limit: float | None = None,
) -> np.ndarray:
    """out[t] = sum over k of weights[f] * (act(x[i]) @ b[e] + bias[e]) for sorted row i naming
    f = t * top_k + k, e the group of bins holding i; rows past the groups add nothing."""
    rows = _act(x.double().cpu().numpy(), act, alpha, limit)
    mats = b.double().cpu().numpy()
    width = mats.shape[1] if trans_b else mats.shape[2]
    out = np.zeros((indices.numel() // top_k, width))
    for i, f in enumerate(indices.tolist()):
        expert = int(np.searchsorted(np.asarray(bins), i, side="right"))
        if i >= x.shape[0] or expert >= len(bins):
            continue
        m = mats[expert].T if trans_b else mats[expert]
        product = rows[i] @ m
        if bias is not None:
            product = product + bias[expert].double().cpu().numpy()
        out[f // top_k] += (1.0 if weights is None else float(weights[f])) * product
    return out


def _close(out: torch.Tensor, want: np.ndarray, dtype: torch.dtype) -> None:
    rtol, atol = TOL[dtype]
    scale = max(1.0, float(np.abs(want).max())) if want.size else 1.0
    torch.testing.assert_close(
        out.double().cpu(), torch.from_numpy(want), rtol=rtol, atol=atol * scale
    )


def _call(
    seed: int,
    tokens: int,
    top_k: int,
    experts: int,
    depth: int,
    width: int,
    act: str | None,
    dtype: torch.dtype,
    trans_b: bool,
    with_bias: bool,
    with_weights: bool,
    alpha: float | None = None,
    limit: float | None = None,
) -> tuple[tuple, dict, list[int]]:
    """A routed call (distinct experts per token, sorted rows by expert) and its bins."""
    gen = torch.Generator().manual_seed(seed)
    top = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    order = torch.sort(top.reshape(-1), stable=True)
    indices, bin_ids = order.indices.to(torch.int32), order.values.to(torch.int32)
    bins = torch.bincount(top.reshape(-1), minlength=experts).cumsum(0).tolist()
    gated = act is not None and (act.startswith(("swiglu", "geglu", "reglu")) or act == "bilinear")
    x = (torch.randn(tokens * top_k, depth * (2 if gated else 1), generator=gen) * 3).to(dtype)
    shape = (experts, width, depth) if trans_b else (experts, depth, width)
    b = (torch.randn(shape, generator=gen) / depth**0.5).to(dtype)
    weights = torch.rand(tokens * top_k, generator=gen) if with_weights else None
    bias = torch.randn(experts, width, generator=gen).to(dtype) if with_bias else None
    x, b, indices, bin_ids = (t.to(DEVICE) for t in (x, b, indices, bin_ids))
    weights, bias = (None if t is None else t.to(DEVICE) for t in (weights, bias))
    cumulative = torch.tensor(bins, dtype=torch.int32, device=DEVICE)
    args = (x, b, indices, bin_ids, weights, cumulative, top_k, trans_b)
    kw = {"activation": act, "bias": bias, "alpha": alpha, "limit": limit}
    return args, kw, bins


ACTIVATIONS = [
    None, "gelu", "gelu_erf", "silu", "relu", "swiglu", "geglu", "reglu", "bilinear",
    "swiglu_interleaved", "swiglu_oai", "swiglu_oai_interleaved",
]  # fmt: skip


# Every activation in bf16; float32 (its tighter tolerance) for one of each kind.
CASES = [(act, torch.bfloat16) for act in ACTIVATIONS] + [
    (act, torch.float32) for act in (None, "gelu_erf", "swiglu", "swiglu_oai_interleaved")
]


@needs_interpreter
@pytest.mark.parametrize(("act", "dtype"), CASES, ids=str)
def test_one_launch_matches_the_row_loop_and_the_tiled_path(
    act: str | None, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both layouts, one token and several (the kernel serves them all; the default policy sends
    it only one token with trans_b), top_k 1 to 4, a top_k of 3 (padded lanes)."""
    monkeypatch.setattr(G, "_GMM_SCATTER_PLANS", {})
    for seed, (tokens, top_k, experts, trans_b, with_bias, with_weights) in enumerate(
        [(1, 4, 8, True, True, True), (3, 3, 8, False, False, True), (2, 1, 3, True, True, False)]
    ):
        args, kw, bins = _call(
            seed, tokens, top_k, experts, 40, 24, act, dtype, trans_b, with_bias, with_weights
        )
        _Always.taken = 0
        with use_launch_configs(_Always()):
            out = G.gmm_scatter(*args, **kw)
        assert _Always.taken == 1
        x, b, indices, _, weights, _, _, _ = args
        _close(out, _want(x, b, indices, weights, bins, top_k, trans_b, kw["bias"], act), dtype)
        with use_launch_configs(_Tiled()):
            tiled = G.gmm_scatter(*args, **kw)
        rtol, atol = TOL[dtype]
        torch.testing.assert_close(out, tiled, rtol=rtol, atol=atol * max(1.0, tiled.abs().max()))


@needs_interpreter
@pytest.mark.parametrize("act", ["swiglu_oai", "swiglu_oai_interleaved"])
def test_the_clamp_constants_reach_the_kernel(act: str) -> None:
    """GPT-OSS's unit with constants other than its defaults and a clamp that bites (|x| ~ 3
    against limit 1.5): the default constants would give another result."""
    args, kw, bins = _call(7, 2, 4, 16, 24, 32, act, torch.float32, True, True, True, 1.1, 1.5)
    with use_launch_configs(_Always()):
        out = G.gmm_scatter(*args, **kw)
    x, b, indices, _, weights, _, top_k, trans_b = args
    want = _want(x, b, indices, weights, bins, top_k, trans_b, kw["bias"], act, 1.1, 1.5)
    _close(out, want, torch.float32)
    default = _want(x, b, indices, weights, bins, top_k, trans_b, kw["bias"], act)
    assert not np.allclose(default, want, rtol=1e-3)


@needs_interpreter
def test_rows_past_the_groups_and_unnamed_ids_add_nothing() -> None:
    """Expert parallelism's pairs of other ranks' experts sort last, past bins: NaN in their rows
    must not reach the output; neither may rows past x's first ``rows`` (x holds those only)."""
    tokens, top_k, experts, depth, width = 3, 2, 8, 16, 24
    args, kw, bins = _call(
        3, tokens, top_k, experts, depth, width, "swiglu", torch.float32, False, True, True
    )
    x, b, indices, bin_ids, weights, _, _, trans_b = args
    cut = [min(end, bins[-1] - 2) for end in bins]  # the last two sorted rows: no group's
    x = x.clone()
    x[cut[-1] :] = float("nan")
    ends = torch.tensor(cut, dtype=torch.int32, device=DEVICE)
    with use_launch_configs(_Always()):
        out = G.gmm_scatter(x, b, indices, bin_ids, weights, ends, top_k, trans_b, **kw)
        # x holding only the covered rows
        short = x[: cut[-1]]
        again = G.gmm_scatter(
            short, b, indices, bin_ids, weights, ends, top_k, trans_b, rows=cut[-1], **kw
        )
    assert not out.isnan().any()
    want = _want(x, b, indices, weights, cut, top_k, trans_b, kw["bias"], "swiglu")
    _close(out, want, torch.float32)
    torch.testing.assert_close(again, out)


def test_the_default_policy_takes_one_token_with_contiguous_depth() -> None:
    policy = LaunchConfigs()
    qwen3 = policy.token_gmm_scatter(1, 8, 768, 2048, 2, True)  # decode, transformers' layout
    assert qwen3 is not None and 8 * qwen3.block_n * qwen3.block_k == 16384
    mixtral = policy.token_gmm_scatter(1, 2, 14336, 4096, 2, True)
    assert (
        mixtral is not None
        and mixtral.num_warps == 4
        and 2 * mixtral.block_n * mixtral.block_k == 16384
    )
    three = policy.token_gmm_scatter(1, 3, 768, 2048, 4, True)  # padded lanes, float32
    assert three is not None and 4 * three.block_n * three.block_k == 8192
    assert policy.token_gmm_scatter(2, 8, 768, 2048, 2, True) is None  # two tokens
    assert policy.token_gmm_scatter(1, 8, 768, 2048, 2, False) is None  # the other layout
    assert policy.token_gmm_scatter(0, 8, 768, 2048, 2, True) is None  # no tokens


@pytest.mark.parametrize("device", [H200, MI300], ids=lambda d: d.arch)
def test_one_token_is_one_launch_and_two_take_the_tiled_path(device: DeviceInfo) -> None:
    """The launches gmm_scatter would make on the device (recorded, not run): one token,
    transformers' layout, with GPT-OSS's activation, bias and weights is the one kernel and
    nothing else; two tokens are the grouped GEMM and the scatter."""
    from megablocks_triton.kernels.token_gmm import _token_gmm_scatter_kernel
    from megablocks_triton.launch import record_launches

    experts, top_k, hidden, ffn = 32, 4, 64, 48

    def kernels(tokens: int, act: str | None) -> list[object]:
        pairs = tokens * top_k
        meta = {"device": "meta"}
        x = torch.empty(pairs, 2 * ffn if act else ffn, dtype=torch.bfloat16, **meta)
        ids = torch.empty(pairs, dtype=torch.int32, **meta)
        b = torch.empty(experts, hidden, ffn, dtype=torch.bfloat16, **meta)
        bias = torch.empty(experts, hidden, dtype=torch.bfloat16, **meta)
        weights = torch.empty(pairs, dtype=torch.bfloat16, **meta)
        bins = torch.empty(experts, dtype=torch.int32, **meta)
        with record_launches(device) as recorder:
            G.gmm_scatter(x, b, ids, ids, weights, bins, top_k, True, act, None, bias)
        return [launch.kernel for launch in recorder.launches]

    assert kernels(1, "swiglu_oai_interleaved") == [_token_gmm_scatter_kernel]
    tiled = kernels(2, None)
    assert len(tiled) == 2 and _token_gmm_scatter_kernel not in tiled
