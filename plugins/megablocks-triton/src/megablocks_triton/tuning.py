"""Measured speed of this backend's grouped GEMM, for the core's per-shape choice.

The points and the dense rate they are fractions of live in the per-arch table
(:data:`megablocks_triton.config.ARCHS`, ``measured`` and ``dense_bf16_tflops`` of each row); this
module only turns them into cost hints. Each point is ``(rows per expert, k, n, fraction of a
dense matmul's TFLOP/s)`` (H200: bf16, ``megablocks bench --ops gmm``/``benchmarks/gmm_sweep.py``;
figures and dates in docs/performance.md). The core estimates a call from the nearest point
(:func:`megablocks_core.plugin.gmm_cost_hint`); an arch with no points or no dense rate gets no
estimate and the choice falls back to the tier order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from megablocks_core.plugin import CostEstimate, GmmPoint, gmm_cost_hint

from .arch_table import ArchTuning, by_arch

#: Device arch -> the dense bf16 TFLOP/s of its row (a live view of the table).
DENSE_BF16_TFLOPS: Mapping[str, float] = by_arch(lambda row: row.dense_bf16_tflops)


def _points(op: str) -> Mapping[str, Sequence[GmmPoint]]:
    def points(row: ArchTuning) -> Sequence[GmmPoint] | None:
        return row.measured.get(op)

    return by_arch(points)


#: op → device arch → measured points (live views of the table).
MEASURED: Mapping[str, Mapping[str, Sequence[GmmPoint]]] = {
    op: _points(op) for op in ("gmm", "gmm_weight_grad")
}

#: op → the cost hint its kernel declares.
COST_HINTS: Mapping[str, CostEstimate] = {
    op: gmm_cost_hint(points, dense_tflops=DENSE_BF16_TFLOPS) for op, points in MEASURED.items()
}
