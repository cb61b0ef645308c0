"""Measured tuning of this plugin, its one home for per-arch facts: per GPU arch family
(:data:`ARCHS`) the dense bf16 rate and the grouped-GEMM providers' efficiency points; and the
calls the scan scatter takes.

Each point is ``(rows_per_expert, k, n, fraction_of_dense_peak)``: the provider's bf16
throughput for an op on that problem as a fraction of a dense bf16 matmul with the same FLOPs
(the row's ``dense_bf16_tflops``), measured on an arch of the row. ``megablocks_core.plugin.
gmm_cost_hint`` turns them into a provider's cost hint (nearest measured point in log space). An
arch without points or rate gives no estimate, and the core then ranks by the tier order alone.
A new arch's tuning is one new row of :data:`ARCHS`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from megablocks_core.plugin import GmmPoint

#: grouped_gemm's forward, H200, torch 2.11 + CUDA 13.0, bf16, `megablocks bench --ops gmm` (mean
#: of two runs, docs/performance.md): the mixtral, qwen3 and dsv3 shapes.
_GROUPED_GEMM_FORWARD: tuple[GmmPoint, ...] = (
    (4096, 4096, 14336, 0.98),
    (1024, 2048, 768, 0.33),
    (512, 7168, 2048, 0.79),
)


@dataclass(frozen=True)
class ArchTuning:
    """What this plugin measured on one GPU arch family."""

    archs: tuple[str, ...]
    """The device archs (:attr:`DeviceInfo.arch`) of the family."""
    dense_bf16_tflops: float | None
    """Dense bf16 matmul TFLOP/s, what the points are fractions of (approximate is enough)."""
    measured: Mapping[str, Mapping[str, Sequence[GmmPoint]]]
    """provider (the kernel's variant) -> op -> measured points."""


#: GPU arch family -> what was measured on it.
ARCHS: Mapping[str, ArchTuning] = MappingProxyType(
    {
        "hopper": ArchTuning(
            archs=("sm_90",),
            dense_bf16_tflops=690.0,  # H200, at the benchmark shapes (docs/performance.md)
            measured={
                "grouped_mm": {
                    # H200, torch 2.11 + CUDA 13.0, bf16 forward, `megablocks bench --ops gmm`
                    # (mean of two runs, docs/performance.md): the mixtral, qwen3 and dsv3 shapes.
                    "gmm": (
                        (4096, 4096, 14336, 0.94),
                        (1024, 2048, 768, 0.84),
                        (512, 7168, 2048, 0.79),
                    ),
                    # Weight gradient, softmax top-k routing, do_bench medians of three beside a
                    # dense matmul and megablocks-triton's in the same run
                    # (docs/bench/h200-2026-12-01h-wgrad-points.jsonl): both orientations of the
                    # qwen3 / dsv3 / mixtral layers' weight gradients (k = a's columns).
                    "gmm_weight_grad": (
                        (1024, 2048, 768, 0.71),
                        (1024, 768, 2048, 0.70),
                        (512, 7168, 2048, 0.75),
                        (512, 2048, 7168, 0.72),
                        (4096, 4096, 14336, 0.93),
                        (4096, 14336, 4096, 0.91),
                    ),
                },
                # The forward's points for both ops: its weight gradient was not measured
                # separately (it reads the counts on the host, so with device-side counts it
                # gives no estimate).
                "grouped_gemm": {
                    "gmm": _GROUPED_GEMM_FORWARD,
                    "gmm_weight_grad": _GROUPED_GEMM_FORWARD,
                },
            },
        ),
    }
)


def points_by_arch(provider: str, op: str) -> dict[str, Sequence[GmmPoint]]:
    """Device arch -> ``provider``'s measured points for ``op`` (what
    ``megablocks_core.plugin.gmm_cost_hint`` takes), from :data:`ARCHS` as it is now."""
    return {
        arch: points
        for row in ARCHS.values()
        if (points := row.measured.get(provider, {}).get(op))
        for arch in row.archs
    }


def dense_tflops_by_arch() -> dict[str, float]:
    """Device arch -> the dense bf16 rate of its :data:`ARCHS` row."""
    return {
        arch: row.dense_bf16_tflops
        for row in ARCHS.values()
        if row.dense_bf16_tflops is not None
        for arch in row.archs
    }


#: The calls the scan scatter (variant ``scan`` of scatter) takes, measured on the H200 against
#: triton's scatter in the same process (bf16, docs/performance.md). From
#: ``SCAN_SCATTER_FEWEST_ROWS`` rows on, triton's scatter inverts the permutation in a launch of
#: its own (two launches, ~20 µs of host time); below it triton scans in one launch and is as fast
#: or faster on the GPU (128 rows: 3.0 against 4.4 µs).
SCAN_SCATTER_FEWEST_ROWS = 1025
#: Every block (one token) scans all of ``indices``: past 512 tokens the scans cost more GPU time
#: than the inverse launch saves (4096 rows of top-1: 25 against 9.6 µs; top-2: 16 against 7.4).
SCAN_SCATTER_MOST_TOKENS = 512
#: A block's 256 threads read a row of up to 4 KiB in one 16-byte load each; wider rows take
#: them two or more rounds, where triton's reduce was as fast or faster (8 KiB rows, 4096 rows:
#: 10.5 against 9.9 µs; 2048 rows of top-4: 8.5 against 7.6; 14 KiB rows, 4096 rows: 27.3
#: against 25.4), though not everywhere (8 KiB rows, 2048 rows of top-8: 6.9 against 7.5).
SCAN_SCATTER_MOST_ROW_BYTES = 4096

#: The scaled_gmm calls torch._scaled_grouped_mm takes (variant ``scaled_grouped_mm``), measured
#: against triton's scaled_gmm in the same process on an H100 and an H200 (fp8_rowwise, b stored
#: (E, n, k), uniform groups, docs/performance.md, 2026-12-07): 0.98-1.21x triton's speed at
#: Mixtral's 8 experts (k and n from 4096, 512 and 4096 rows per expert), and 0.75-0.95x at
#: GPT-OSS's 32, OLMoE's 64 and DeepSeek-V3's 256 experts (k and n from 2048, 256 rows per
#: expert or more), where triton's warp-specialized kernel runs. Between 8 and 32 experts: not
#: measured. Fewer rows per expert, or k or n below 2048: triton's was faster on the H200
#: before (2026-12-04).
SCALED_GROUPED_MM_FEWEST_K = 2048
SCALED_GROUPED_MM_FEWEST_N = 2048
SCALED_GROUPED_MM_FEWEST_ROWS_PER_EXPERT = 256
SCALED_GROUPED_MM_MOST_EXPERTS = 8
