"""Measured speed of this backend's grouped GEMM, for the core's per-shape choice.

Each point is ``(rows per expert, k, n, fraction of a dense matmul's TFLOP/s)`` measured on the
H200 (bf16, ``megablocks bench --ops gmm``/``benchmarks/gmm_sweep.py``; figures and dates in
docs/performance.md). The core estimates a call from the nearest point
(:func:`megablocks_core.plugin.gmm_estimate_us`); an arch with no points gets no estimate and the
choice falls back to priorities.
"""

from __future__ import annotations

from megablocks_core.plugin import CallInfo, DeviceInfo, GmmPoint, gmm_estimate_us

#: op → device arch → measured points.
MEASURED: dict[str, dict[str, list[GmmPoint]]] = {
    # Forward, TMA loads (the sm90 default), `megablocks bench --ops gmm` (mean of two runs):
    # mixtral / qwen3 / dsv3 shapes. No weight-gradient points yet: that op is left to providers
    # that have them (or to priority).
    "gmm": {"sm_90": [(4096, 4096, 14336, 0.96), (1024, 2048, 768, 0.86), (512, 7168, 2048, 0.86)]},
}


def gmm_cost(device: DeviceInfo, call: CallInfo) -> float | None:
    return gmm_estimate_us(device, call, MEASURED["gmm"])


def gmm_weight_grad_cost(device: DeviceInfo, call: CallInfo) -> float | None:
    return gmm_estimate_us(device, call, MEASURED.get("gmm_weight_grad", {}))
