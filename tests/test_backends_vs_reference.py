"""Every device-specific backend's ops against the reference backend, through the core.

On a CUDA/ROCm GPU at realistic shapes; on the CPU, with ``TRITON_INTERPRET=1``, the Triton
backend at tiny shapes (the interpreter is slow). Each op runs through ``megablocks_core.ops``
with the backend forced, forward and backward (so the core's autograd drives the backend's
kernels), and is compared with the reference backend on the same inputs.
"""

from __future__ import annotations

import os

import pytest
import torch

import megablocks_core as mb
from megablocks_core import ops

ON_GPU = torch.cuda.is_available()
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.skipif(not (ON_GPU or INTERPRETED),
                                reason="needs a GPU, or TRITON_INTERPRET=1 for the CPU interpreter")

DEV = "cuda" if ON_GPU else "cpu"
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def gpu_backends(op: str, dtype: torch.dtype) -> list[str]:
    """Installed kernels (``backend`` or ``backend/variant``) that serve ``op`` on DEV, apart from
    the portable reference; each is then forced in turn with ``use_backend(label)``."""
    trace = mb.explain(op, torch.device(DEV), {"x": dtype, "a": dtype, "b": dtype, "top_experts": dtype})
    return sorted({c.kernel.label for c in trace.candidates if c.accepted and not c.kernel.portable})


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return float((got - want).norm() / want.norm().clamp_min(1e-30)) if want.numel() else 0.0


def routing(tokens: int, experts: int, top_k: int, seed: int = 0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    logits = torch.randn(tokens, experts, device=DEV, generator=gen)
    weights, top = torch.topk(logits.softmax(-1), top_k)
    return top.flatten().int(), weights.flatten()


SHAPES = [  # tokens, hidden, experts, top_k
    (4096, 1024, 8, 2),
    (2048, 512, 64, 8),
    (1024, 2048, 256, 8),
    (777, 129, 16, 1),  # odd sizes: masks and tails
    (0, 256, 8, 2),  # zero tokens
] if ON_GPU else [
    (24, 40, 4, 2),
    (9, 33, 32, 8),  # mostly empty experts, odd hidden size (padding: 32 x 128 rows)
    (7, 1, 3, 1),  # hidden 1
    (0, 8, 4, 2),  # zero tokens
]
GMM_SHAPES = [(8, 512, 1024, 768), (128, 64, 256, 384), (16, 37, 72, 136)] if ON_GPU else [
    (4, 9, 24, 40), (1, 5, 16, 8)]
# Triton's CPU interpreter cannot multiply bf16 (the backend leaves bf16 gmm to the reference there).
GMM_DTYPES = [torch.bfloat16, torch.float16, torch.float32] if ON_GPU else [torch.float16, torch.float32]


@pytest.mark.parametrize("tokens,hidden,experts,top_k", SHAPES)
def test_routing_matches_reference_exactly(tokens, hidden, experts, top_k):
    top, _ = routing(tokens, experts, top_k)
    end_bit = max((experts - 1).bit_length(), 1)

    def run():
        bin_ids, indices = ops.sort(top, end_bit)
        counts = ops.histogram(top, experts)
        return (*ops.route(top, experts, 128), bin_ids, indices, counts, ops.inclusive_cumsum(counts, 0), ops.exclusive_cumsum(counts, 0),
                ops.topology(ops.inclusive_cumsum(ops.round_up(counts, 128), 0), 128,
                             int(ops.round_up(counts, 128).sum()) // 128, 4))

    with mb.use_backend("reference"):
        want = run()
    backends = gpu_backends("route", torch.int32)
    assert backends, "no GPU backend for the routing ops"
    for backend in backends:
        with mb.use_backend(backend):
            got = run()
        for g, w in zip(got, want, strict=True):
            assert g.dtype == w.dtype and torch.equal(g, w), backend


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("tokens,hidden,experts,top_k", SHAPES)
def test_permutation_forward_and_backward(tokens, hidden, experts, top_k, dtype):
    top, weights = routing(tokens, experts, top_k, seed=1)
    with mb.use_backend("reference"):
        bin_ids, indices = ops.sort(top, max((experts - 1).bit_length(), 1))
        counts = ops.histogram(top, experts)
        bins = ops.inclusive_cumsum(counts, 0)
        padded_bins = ops.inclusive_cumsum(ops.round_up(counts, 128), 0)
    gen = torch.Generator(device=DEV).manual_seed(2)
    x = torch.randn(tokens, hidden, device=DEV, generator=gen).to(dtype)
    capacity = max(1, (tokens * top_k) // experts)

    def run(backend: str):
        with mb.use_backend(backend):
            xs = x.clone().requires_grad_()
            w = weights.to(dtype).clone().requires_grad_()
            rows = ops.gather(xs, indices, bin_ids, bins, top_k)
            out = ops.scatter(rows * 1.5, indices, bin_ids, w, bins, top_k)
            prow = ops.padded_gather(xs, indices, bin_ids, bins, padded_bins, top_k)
            pout = ops.padded_scatter(prow, indices, bin_ids, w, bins, padded_bins, top_k)
            brow = ops.binned_gather(xs, indices, bins, capacity, top_k)
            bout = ops.binned_scatter(brow, indices, w, bins, top_k)
            (out.float().square().sum() + pout.float().sum() + bout.float().sum()).backward()
            return [rows, out, prow, pout, brow, bout, xs.grad, w.grad]

    want = run("reference")
    for backend in gpu_backends("gather", dtype):
        got = run(backend)
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert g.shape == w.shape and g.dtype == w.dtype, (backend, i)
            assert rel_err(g, w) <= TOL[dtype], (backend, i, rel_err(g, w))


@pytest.mark.parametrize("dtype", GMM_DTYPES)
@pytest.mark.parametrize("experts,rows_per_expert,k,n", GMM_SHAPES)
@pytest.mark.parametrize("sizes_on", sorted({"cpu", DEV}))
def test_gmm_forward_and_backward(dtype, experts, rows_per_expert, k, n, sizes_on):
    gen = torch.Generator().manual_seed(3)
    sizes = torch.randint(0, 2 * rows_per_expert, (experts,), generator=gen)
    sizes[::5] = 0  # empty experts
    a0 = torch.randn(int(sizes.sum()), k, device=DEV).to(dtype)
    b0 = (torch.randn(experts, k, n, device=DEV) / k**0.5).to(dtype)

    def run(backend: str, trans_b: bool):
        with mb.use_backend(backend):
            a = a0.clone().requires_grad_()
            b = (b0.transpose(1, 2).contiguous() if trans_b else b0.clone()).requires_grad_()
            out = ops.gmm(a, b, sizes.to(sizes_on), trans_b)
            out.float().square().sum().backward()
            return out, a.grad, b.grad

    for trans_b in (False, True):
        want = run("reference", trans_b)
        for backend in gpu_backends("gmm", dtype):
            got = run(backend, trans_b)
            for g, w in zip(got, want, strict=True):
                assert g.shape == w.shape and g.dtype == w.dtype
                assert rel_err(g, w) <= TOL[dtype], (backend, trans_b, rel_err(g, w))
            empty = (sizes == 0).nonzero().flatten().tolist()
            assert torch.equal(got[2][empty], torch.zeros_like(got[2][empty])), backend


@pytest.mark.skipif(not ON_GPU, reason="host syncs exist only with a GPU")
def test_routing_and_permutation_do_not_sync_the_host():
    top, weights = routing(4096, 64, 8)
    x = torch.randn(4096, 512, device=DEV, dtype=torch.bfloat16)
    for backend in gpu_backends("gather", torch.bfloat16):
        with mb.use_backend(backend):
            bin_ids, indices = ops.sort(top, 6)  # warm up: selection happens once per signature
            ops.route(top, 64, 128)
            counts = ops.histogram(top, 64)
            bins = ops.inclusive_cumsum(counts, 0)
            rows = ops.gather(x, indices, bin_ids, bins, 8)
            ops.scatter(rows, indices, bin_ids, weights.bfloat16(), bins, 8)
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                bin_ids, indices = ops.sort(top, 6)
                ops.route(top, 64, 128)
                counts = ops.histogram(top, 64)
                bins = ops.inclusive_cumsum(counts, 0)
                rows = ops.gather(x, indices, bin_ids, bins, 8)
                ops.scatter(rows, indices, bin_ids, weights.bfloat16(), bins, 8)
            finally:
                torch.cuda.set_sync_debug_mode(0)
