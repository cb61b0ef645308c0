"""On a CUDA GPU: routing and permutation make no device→host sync, on every GPU backend.

Why this is not in the conformance kit: the contracts do not say, op by op, which ops must be
sync-free (padded_gather reads padded_bins on the host by design, gmm syncs when batch_sizes is
on the CPU), so the kit has nothing to hold a backend to; here the sync-free sequence of an MoE
layer's routing and permutation is named explicitly. The values of these ops on every backend
are the kit's job (``megablocks backends check --device cuda:0``).
"""

from __future__ import annotations

import pytest
import torch

import megablocks_core as mb
from megablocks_core import ops

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="host syncs exist only with a GPU"
)

TOKENS, HIDDEN, EXPERTS, TOP_K = 4096, 512, 64, 8


def gpu_backends(op: str, dtype: torch.dtype) -> list[str]:
    """Installed kernels (``backend`` or ``backend/variant``) that serve ``op`` on the GPU, apart
    from the portable reference; each is then forced in turn with ``use_backend(label)``."""
    trace = mb.explain(op, torch.device("cuda"), {"x": dtype})
    return sorted(
        {c.kernel.label for c in trace.candidates if c.accepted and not c.kernel.portable}
    )


def route_and_permute(
    logits: torch.Tensor, top: torch.Tensor, x: torch.Tensor, weights: torch.Tensor
) -> None:
    ops.router_topk(logits, TOP_K, True)
    end_bit = max((EXPERTS - 1).bit_length(), 1)
    bin_ids, indices = ops.sort(top, end_bit)
    ops.route(top, EXPERTS, 128)
    counts = ops.histogram(top, EXPERTS)
    bins = ops.inclusive_cumsum(counts, 0)
    rows = ops.gather(x, indices, bin_ids, bins, TOP_K)
    ops.scatter(rows, indices, bin_ids, weights, bins, TOP_K)


def test_routing_and_permutation_do_not_sync_the_host():
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(TOKENS, EXPERTS, device="cuda", generator=gen)
    weights, top = torch.topk(logits.softmax(-1), TOP_K)
    top, weights = top.flatten().int(), weights.flatten().bfloat16()
    x = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen)
    backends = gpu_backends("gather", torch.bfloat16)
    assert backends, "no GPU backend serves gather"
    for backend in backends:
        with mb.use_backend(backend):
            route_and_permute(logits, top, x, weights)  # warm up: selection once per signature
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                route_and_permute(logits, top, x, weights)
            finally:
                torch.cuda.set_sync_debug_mode(0)


def moe_permute_round_trip(
    mask: torch.Tensor, ids: torch.Tensor, x: torch.Tensor, probs: torch.Tensor
) -> None:
    rows = TOKENS * TOP_K + EXPERTS * 15  # a static bound for any routing padded to 16
    for routing in (mask, ids):
        row_map, _ = ops.moe_permute_map(routing, EXPERTS, rows, 16)
        permuted = ops.moe_permute(x, row_map, rows)
        slot_probs = probs if routing is mask else probs.gather(1, ids.long())
        ops.moe_permute_probs(slot_probs, row_map, rows)
        ops.moe_unpermute(permuted, row_map, slot_probs)
    sizes = mask.sum(0).int()
    ops.moe_sort_chunks(x, sizes, torch.arange(EXPERTS - 1, -1, -1, device="cuda"))


def test_moe_permute_ops_do_not_sync_the_host_and_capture_in_a_cuda_graph():
    gen = torch.Generator(device="cuda").manual_seed(1)
    probs = torch.randn(TOKENS, EXPERTS, device="cuda", generator=gen).softmax(-1)
    ids = probs.topk(TOP_K).indices.int()
    mask = torch.zeros_like(probs, dtype=torch.bool).scatter_(1, ids.long(), True)
    x = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen)
    backends = gpu_backends("moe_permute", torch.bfloat16)
    assert backends, "no GPU backend serves moe_permute"
    for backend in backends:
        with mb.use_backend(backend):
            moe_permute_round_trip(mask, ids, x, probs)  # warm up
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                moe_permute_round_trip(mask, ids, x, probs)
            finally:
                torch.cuda.set_sync_debug_mode(0)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                moe_permute_round_trip(mask, ids, x, probs)
            graph.replay()
            torch.cuda.synchronize()
