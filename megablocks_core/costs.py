"""Cost hints from measured points: the one way a provider declares how fast it is.

A :attr:`Kernel.cost <megablocks_core.descriptors.Kernel.cost>` hint is built with
:func:`gmm_cost_hint` from the provider's measured points.

Why cost hints: static tiers cannot know that a cuBLAS loop wins for 8 large experts while a
persistent kernel wins for 256 small ones. A provider therefore declares how fast it measured
itself on a device family, and the core picks, per call shape, the kernel with the lowest
estimate among the eligible kernels of the highest tier (:mod:`megablocks_core.ranking`).

For grouped GEMMs a provider describes its speed by *measured points*: ``(rows_per_expert, k, n,
efficiency)`` where efficiency is its TFLOP/s divided by a dense matmul's with the same FLOPs,
measured in the same run. A call is estimated from the nearest measured point (distance in
log-space over the three features) and the arch's dense rate, which the provider declares
beside its points (``dense_tflops``: device arch -> dense bf16 TFLOP/s, from the provider's own
per-arch table; the core knows no rates). Estimates are deterministic and
cheap (a few dozen float operations, once per new call shape), so they never time anything at
call time: no warm-up, no host sync, nothing that breaks CUDA-graph capture or compilation.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence

from .descriptors import CallInfo, CostEstimate, DeviceInfo
from .devices import base_arch

#: A measured point: (rows per expert, reduction size k, output columns n, fraction of dense).
GmmPoint = tuple[float, float, float, float]


def gmm_problem(call: CallInfo) -> tuple[int, int, int, int]:
    """``(tokens, k, n, experts)`` of a ``gmm`` or ``gmm_weight_grad`` call.

    gmm: a (tokens, k) times b (E, k, n) (b (E, n, k) with trans_b). gmm_weight_grad: a (tokens, k),
    grad (tokens, n), E = len(batch_sizes); the same features describe both.
    """
    tokens, k = call["a"].shape
    if "b" in call:
        b = call["b"].shape
        experts, n = b[0], (b[1] if call.get("trans_b") else b[2])
    else:
        experts, n = call["batch_sizes"].shape[0], call["grad"].shape[1]
    return tokens, k, n, experts


def nearest_efficiency(
    points: Sequence[GmmPoint], rows_per_expert: float, k: float, n: float
) -> float | None:
    """Efficiency of the measured point nearest to the call (log-space distance)."""
    if not points:
        return None
    want = [math.log2(max(v, 1.0)) for v in (rows_per_expert, k, n)]

    def distance(p: GmmPoint) -> float:
        return sum((math.log2(max(v, 1.0)) - w) ** 2 for v, w in zip(p[:3], want, strict=True))

    return min(points, key=distance)[3]


def gmm_estimate_us(
    device: DeviceInfo,
    call: CallInfo,
    points_by_arch: Mapping[str, Sequence[GmmPoint]],
    extra_us: float = 0.0,
    *,
    dense_tflops: Mapping[str, float],
) -> float | None:
    """Estimated µs of a grouped GEMM call: FLOPs / (efficiency x dense rate) + ``extra_us``.

    ``points_by_arch`` maps a device arch (``"sm_90"``) to the provider's measured points and
    ``dense_tflops`` maps it to the dense bf16 matmul TFLOP/s the points are fractions of (both
    the provider's, read at every estimate); an arch with no points, or no dense rate, gives None
    (no estimate: the tier order decides). ``extra_us`` is a fixed cost the points do not show
    (e.g. a host sync of device counts).
    """
    arch = base_arch(device)
    points = points_by_arch.get(arch)
    dense = dense_tflops.get(arch)
    if not points or dense is None:
        return None
    tokens, k, n, experts = gmm_problem(call)
    efficiency = nearest_efficiency(points, tokens / max(experts, 1), k, n)
    if not efficiency:
        return None
    flops = 2.0 * tokens * k * n
    return flops / (efficiency * dense * 1e6) + extra_us


def gmm_cost_hint(
    points_by_arch: Mapping[str, Sequence[GmmPoint]],
    *,
    dense_tflops: Mapping[str, float],
    extra_us: float = 0.0,
    device_kinds: Collection[str] | None = None,
    host_counts_only: bool = False,
) -> CostEstimate:
    """A ``Kernel.cost`` hint for a grouped GEMM provider from its measured points (see
    :func:`gmm_estimate_us`; ``dense_tflops``: the provider's dense rate per device arch).

    ``device_kinds``: estimate only on these device kinds (None: any).
    ``host_counts_only``: the provider reads ``batch_sizes`` on the host. For a call whose counts
    live on the device that would add a device→host sync, so the hint gives no estimate there and
    the choice goes to a provider that takes device counts (this one still serves when forced or
    alone).
    """

    def cost(device: DeviceInfo, call: CallInfo) -> float | None:
        if device_kinds is not None and device.kind not in device_kinds:
            return None
        if host_counts_only and getattr(call.get("batch_sizes"), "device", "cpu") != "cpu":
            return None
        return gmm_estimate_us(device, call, points_by_arch, extra_us, dense_tflops=dense_tflops)

    return cost
