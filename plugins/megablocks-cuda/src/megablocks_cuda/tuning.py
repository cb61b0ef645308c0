"""Measured tuning of this plugin: the grouped-GEMM providers' efficiency points per device arch.

Each point is ``(rows_per_expert, k, n, fraction_of_dense_peak)``: the provider's forward bf16
throughput on that problem as a fraction of a dense bf16 matmul with the same FLOPs, measured on
the device arch named by the key. ``megablocks_core.plugin.gmm_cost_hint`` turns them into a
provider's cost hint (nearest measured point in log space). An arch without points gives no
estimate, and the core then ranks by priority alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from megablocks_core.plugin import GmmPoint

#: provider (the kernel's variant) -> device arch -> measured points (both ops use the forward
#: points: the weight gradient was not measured separately).
MEASURED: Mapping[str, Mapping[str, Sequence[GmmPoint]]] = {
    # H200, torch 2.11 + CUDA 13.0, bf16 forward, `megablocks bench --ops gmm` (mean of two runs,
    # docs/performance.md): the mixtral, qwen3 and dsv3 shapes.
    "grouped_mm": {
        "sm_90": ((4096, 4096, 14336, 0.94), (1024, 2048, 768, 0.84), (512, 7168, 2048, 0.79)),
    },
    "grouped_gemm": {
        "sm_90": ((4096, 4096, 14336, 0.98), (1024, 2048, 768, 0.33), (512, 7168, 2048, 0.79)),
    },
}
