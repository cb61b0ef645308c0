"""Measured speed of this backend's grouped GEMM, for the core's per-shape choice.

Each point is ``(rows per expert, k, n, fraction of a dense matmul's TFLOP/s)`` measured on the
H200 (bf16, ``megablocks bench --ops gmm``/``benchmarks/gmm_sweep.py``; figures and dates in
docs/performance.md). The core estimates a call from the nearest point
(:func:`megablocks_core.plugin.gmm_cost_hint`); an arch with no points gets no estimate and the
choice falls back to the tier order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from megablocks_core.plugin import CostEstimate, GmmPoint, gmm_cost_hint

#: op → device arch → measured points.
MEASURED: Mapping[str, Mapping[str, Sequence[GmmPoint]]] = {
    # Forward, TMA loads (the sm90 default), `megablocks bench --ops gmm` (mean of two runs):
    # mixtral / qwen3 / dsv3 shapes.
    "gmm": {"sm_90": ((4096, 4096, 14336, 0.96), (1024, 2048, 768, 0.86), (512, 7168, 2048, 0.86))},
    # Weight gradient, the default policy (the Gluon kernel up to 1024 rows per expert), softmax
    # top-k routing, do_bench medians of three beside a dense matmul and megablocks-cuda's
    # grouped_mm in the same run (docs/bench/h200-2026-12-01h-wgrad-points.jsonl): both
    # orientations of the qwen3 / dsv3 / mixtral layers' weight gradients (k = a's columns).
    "gmm_weight_grad": {
        "sm_90": (
            (1024, 2048, 768, 0.80),
            (1024, 768, 2048, 0.78),
            (512, 7168, 2048, 0.77),
            (512, 2048, 7168, 0.73),
            (4096, 4096, 14336, 0.87),
            (4096, 14336, 4096, 0.90),
        )
    },
}

#: op → the cost hint its kernel declares.
COST_HINTS: Mapping[str, CostEstimate] = {
    op: gmm_cost_hint(points) for op, points in MEASURED.items()
}
