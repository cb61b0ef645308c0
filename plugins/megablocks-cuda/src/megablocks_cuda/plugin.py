"""The ``cuda`` backend's hooks: what megablocks-cuda provides, and where it can run.

Provides

* routing: sort (CUB radix sort over bits [0, end_bit) only), histogram, inclusive_cumsum,
  exclusive_cumsum (CUB scans), topology, replicate, replicate_backward — from the C++ extension
  (:mod:`megablocks_cuda.extension`), every dtype of the contract;
* variant ``one-block`` of sort and route for decode-sized calls (up to 4096 keys; route up to
  1024 experts, sort up to end_bit 16: :func:`megablocks_cuda.routing.one_block_limits`): one
  thread block, one launch, outputs allocated in C++. In the vendor tier, above triton's kernels
  (a call's host time is what these sizes cost; see ``docs/performance.md``); larger calls go to
  the next kernel;
* variant ``scan`` of scatter: every thread block scans ``indices`` for its own token's rows, so
  a call is one launch where triton's scatter of more than 1024 rows takes two (it inverts the
  permutation first). In the vendor tier, above triton's kernel, for the calls where it was
  measured faster on the H200 (:mod:`megablocks_cuda.tuning`: 1025 to 4096 rows, at most 512 tokens, rows
  of at most 4 KiB); other calls go to the next kernel;
* grouped GEMM: gmm and gmm_weight_grad, variant ``grouped_mm`` (``torch._grouped_mm``, bf16,
  compute capability 9.x/10.x, no host sync) and variant ``grouped_gemm`` (the ``grouped_gemm``
  package, bf16, when installed; syncs the host for device-side batch sizes), in triton's
  generic-accelerator tier: the cost hints of :mod:`megablocks_cuda.tuning` pick per shape;
* FP8: scaled_gmm, variant ``scaled_grouped_mm`` (``torch._scaled_grouped_mm``, ``fp8_rowwise``
  with b stored (E, n, k), e4m3fn data, bf16 output, compute capability 9.x, no host sync), in
  the vendor tier for the calls where it was measured faster than triton's scaled_gmm on the
  H200 (:mod:`megablocks_cuda.tuning`: k and n of at least 2048, 256 rows per expert or more);
  other calls go to the next kernel.

The CUB routing kernels are in that tier too, but yield to triton's (``Kernel.yields_to``) until
GPU measurements say otherwise: they serve where triton cannot (not installed, a shape it
declines) and above the reference.

Importing this module is cheap on any host: the extension is loaded (or compiled) only when a
routing kernel is first ranked or called on a CUDA device, never at registry load.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from megablocks_core.plugin import (
    CapabilityCheck,
    DeviceInfo,
    Kernel,
    ShapeCheck,
    Tier,
    gmm_cost_hint,
    gmm_problem,
    hookimpl,
)

from . import extension, gmm, permutation, routing, tuning

#: The CUB routing kernels and the grouped-GEMM providers: triton's tier. The providers compete
#: with triton's grouped GEMM by cost hint; the routing kernels rank after triton's
#: (:data:`ROUTING_YIELDS_TO`) until GPU measurements say otherwise.
TIER = Tier.GENERIC_ACCELERATOR
ROUTING_YIELDS_TO = ("triton",)

#: The one-block sort and route and the scan scatter: measured faster than triton's kernels for
#: the calls their shape predicates take (see the docstring), so the vendor tier.
MEASURED_FASTER_TIER = Tier.VENDOR

ROUTING_OPS = (
    "sort",
    "histogram",
    "inclusive_cumsum",
    "exclusive_cumsum",
    "topology",
    "replicate",
    "replicate_backward",
)

BF16 = frozenset({torch.bfloat16})
GMM_DTYPES: dict[str, dict[str, frozenset[torch.dtype]]] = {
    "gmm": {"a": BF16, "b": BF16},
    "gmm_weight_grad": {"a": BF16, "grad": BF16},
}

#: Compute capabilities (major) where torch._grouped_mm runs its sync-free CUTLASS kernels;
#: elsewhere it loops over groups after copying the offsets to the host.
GROUPED_MM_MAJORS = (9, 10)
#: Compute capabilities (major) where torch._scaled_grouped_mm was measured (the H200).
SCALED_GROUPED_MM_MAJORS = (9,)
SCALED_DTYPES = {"a": frozenset({torch.float8_e4m3fn}), "b": frozenset({torch.float8_e4m3fn})}
# ---------------------------------------------------------------- capability predicates


def _nvidia(device: DeviceInfo) -> str | None:
    if device.kind != "cuda" or device.capability is None:
        return f"needs an NVIDIA CUDA device, not {device.kind}"
    return None


def extension_capability(device: DeviceInfo) -> str | None:
    """The extension's kernels (routing, the scan scatter) need code for this device's arch."""
    problem = _nvidia(device) or extension.problem()
    if problem:
        return f"CUDA extension unavailable: {problem}" if device.kind == "cuda" else problem
    if device.index is not None and not extension.load().has_kernel_image(device.index):
        return (
            f"the CUDA extension has no code for {device.arch}: rebuild with "
            f"TORCH_CUDA_ARCH_LIST including {'.'.join(map(str, device.capability or ()))}"
        )
    return None


def grouped_mm_capability(device: DeviceInfo) -> str | None:
    if device.kind != "cuda" or device.capability is None:
        return _nvidia(device)
    major, minor = device.capability
    if major not in GROUPED_MM_MAJORS:
        return (
            f"torch._grouped_mm is sync-free only on compute capability 9.x/10.x; "
            f"{device.name or device} is {major}.{minor}"
        )
    if gmm.grouped_mm_function() is None:
        return f"torch {torch.__version__} has no grouped_mm"
    return None


def scaled_grouped_mm_capability(device: DeviceInfo) -> str | None:
    if device.kind != "cuda" or device.capability is None:
        return _nvidia(device)
    if device.capability[0] not in SCALED_GROUPED_MM_MAJORS:
        return (
            f"torch._scaled_grouped_mm was measured against triton's scaled_gmm on compute "
            f"capability 9.x only; {device.name or device} is "
            f"{'.'.join(map(str, device.capability))}"
        )
    if gmm.scaled_grouped_mm_function() is None:
        return f"torch {torch.__version__} has no _scaled_grouped_mm"
    return None


def grouped_gemm_capability(device: DeviceInfo) -> str | None:
    if device.kind != "cuda" or device.capability is None:
        return _nvidia(device)
    if device.capability < (8, 0):
        return "grouped_gemm needs compute capability >= 8.0 (bf16)"
    if gmm.grouped_gemm_backend() is None:
        return "grouped_gemm is not installed (pip install 'megablocks-cuda[grouped-gemm]')"
    return None


# ---------------------------------------------------------------- shape predicates


def grouped_mm_supports(device: DeviceInfo, call: Mapping[str, Any]) -> str | None:
    """torch._grouped_mm's CUTLASS path needs 16-byte rows: K and N multiples of 8 (bf16).

    Misaligned calls go to the next provider (triton takes any shape). The kernel itself still
    zero-pads such operands if called directly, at the cost of copies.
    """
    _, k, n, _ = gmm_problem(call)
    multiple = gmm.ALIGN_BYTES // call["a"].dtype.itemsize
    bad = [f"{name} = {size}" for name, size in (("K", k), ("N", n)) if size % multiple]
    if bad:
        return (
            f"torch._grouped_mm needs 16-byte rows: {', '.join(bad)} not a multiple of {multiple}"
        )
    return None


def scaled_grouped_mm_supports(device: DeviceInfo, call: Mapping[str, Any]) -> str | None:
    """torch._scaled_grouped_mm takes b stored (E, n, k), bf16 output, 16-byte rows; and only
    the calls where it was measured faster than triton's scaled_gmm: few experts, wide rows and
    enough of them (:mod:`megablocks_cuda.tuning`)."""
    if not call["trans_b"]:
        return "torch._scaled_grouped_mm takes b stored (E, n, k) (trans_b=True)"
    if call["out_dtype"] not in (None, "bfloat16"):
        return (
            f"torch._scaled_grouped_mm's rowwise scaling writes bfloat16, not {call['out_dtype']}"
        )
    rows, k, n, experts = gmm_problem(call)
    if k % 16 or n % 16:
        return f"torch._scaled_grouped_mm needs k and n multiples of 16 (k = {k}, n = {n})"
    if experts > tuning.SCALED_GROUPED_MM_MOST_EXPERTS:
        return (
            f"{experts} experts: torch._scaled_grouped_mm was faster than triton's only with at "
            f"most {tuning.SCALED_GROUPED_MM_MOST_EXPERTS}"
        )
    if k < tuning.SCALED_GROUPED_MM_FEWEST_K or n < tuning.SCALED_GROUPED_MM_FEWEST_N:
        return (
            f"k = {k}, n = {n}: torch._scaled_grouped_mm was faster than triton's only from "
            f"k, n >= {tuning.SCALED_GROUPED_MM_FEWEST_K}"
        )
    if rows < tuning.SCALED_GROUPED_MM_FEWEST_ROWS_PER_EXPERT * max(experts, 1):
        return (
            f"{rows} rows for {experts} experts: torch._scaled_grouped_mm was faster than "
            f"triton's only from {tuning.SCALED_GROUPED_MM_FEWEST_ROWS_PER_EXPERT} rows per expert"
        )
    return None


def one_block_sort_supports(device: DeviceInfo, call: Mapping[str, Any]) -> str | None:
    """The one-block sort takes up to its block's keys, sorted by at most its widest digit."""
    most_keys, _, widest = routing.one_block_limits()
    n, end_bit = call["x"].shape[0], call["end_bit"]
    if end_bit is None or end_bit > widest:
        return f"end_bit = {end_bit}: the one-block sort sorts by at most {widest} bits"
    if n > most_keys:
        return f"{n} keys: the one-block sort takes at most {most_keys}"
    return None


def one_block_route_supports(device: DeviceInfo, call: Mapping[str, Any]) -> str | None:
    """The one-block route takes up to its block's ids and counts up to its most experts."""
    most_keys, most_experts, _ = routing.one_block_limits()
    n, experts = call["top_experts"].shape[0], call["num_experts"]
    if experts > most_experts:
        return f"{experts} experts: the one-block route counts at most {most_experts}"
    if n > most_keys:
        return f"{n} ids: the one-block route takes at most {most_keys}"
    return None


def scan_scatter_supports(device: DeviceInfo, call: Mapping[str, Any]) -> str | None:
    """The scan scatter takes the calls where it was measured faster than triton's two-launch
    scatter (:mod:`megablocks_cuda.tuning`), up to the rows its shared memory holds."""
    x, rows, top_k = call["x"], call["indices"].shape[0], call["top_k"]
    most_rows = permutation.scan_scatter_max_rows()
    if not tuning.SCAN_SCATTER_FEWEST_ROWS <= rows <= most_rows:
        return (
            f"{rows} rows: the scan scatter takes {tuning.SCAN_SCATTER_FEWEST_ROWS} to {most_rows}"
        )
    if rows // top_k > tuning.SCAN_SCATTER_MOST_TOKENS:
        return (
            f"{rows // top_k} tokens: the scan scatter takes at most "
            f"{tuning.SCAN_SCATTER_MOST_TOKENS} (each one scans all the rows' ids)"
        )
    row_bytes = x.shape[-1] * x.dtype.itemsize
    if row_bytes > tuning.SCAN_SCATTER_MOST_ROW_BYTES:
        return (
            f"rows of {row_bytes} bytes: the scan scatter takes at most "
            f"{tuning.SCAN_SCATTER_MOST_ROW_BYTES}"
        )
    return None


# ---------------------------------------------------------------- hooks


@hookimpl
def megablocks_unavailable_reason() -> str | None:
    if torch.version.hip:
        return f"torch {torch.__version__} is a ROCm build; this backend is for NVIDIA CUDA"
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is built without CUDA"
    if not torch.cuda.is_available():
        return "no NVIDIA GPU visible"
    return None


@hookimpl
def megablocks_routing_kernels() -> list[Kernel]:
    return [
        Kernel(
            op=op,
            fn=getattr(routing, op),
            devices=("cuda",),
            tier=TIER,
            yields_to=ROUTING_YIELDS_TO,
            capability=extension_capability,
            contiguous=True,
        )
        for op in ROUTING_OPS
    ] + [
        Kernel(
            op=op,
            fn=fn,
            devices=("cuda",),
            tier=MEASURED_FASTER_TIER,
            capability=extension_capability,
            supports=supports,
            variant="one-block",  # takes any layout: made contiguous in C++, at no cost when it is
        )
        for op, fn, supports in (
            ("sort", routing.sort_one_block, one_block_sort_supports),
            ("route", routing.route_one_block, one_block_route_supports),
        )
    ]


@hookimpl
def megablocks_permutation_kernels() -> list[Kernel]:
    return [
        Kernel(
            op="scatter",
            fn=permutation.scan_scatter,
            devices=("cuda",),
            tier=MEASURED_FASTER_TIER,
            capability=extension_capability,
            supports=scan_scatter_supports,
            variant="scan",  # takes any layout: made contiguous in C++
        )
    ]


@hookimpl
def megablocks_grouped_gemm_kernels() -> list[Kernel]:
    # (variant, capability, shape check, reads batch_sizes on the host, functions). A provider
    # that reads them on the host gives no estimate for device-side counts (it would sync), so
    # the cost choice avoids it there; it still serves when forced or alone.
    providers: tuple[
        tuple[str, CapabilityCheck, ShapeCheck | None, bool, dict[str, Callable[..., Any]]], ...
    ] = (
        (
            "grouped_mm",
            grouped_mm_capability,
            grouped_mm_supports,
            False,
            {"gmm": gmm.grouped_mm_gmm, "gmm_weight_grad": gmm.grouped_mm_gmm_weight_grad},
        ),
        (
            "grouped_gemm",
            grouped_gemm_capability,
            None,
            True,
            {"gmm": gmm.grouped_gemm_gmm, "gmm_weight_grad": gmm.grouped_gemm_gmm_weight_grad},
        ),
    )
    return [
        Kernel(
            op=op,
            fn=fn,
            devices=("cuda",),
            tier=TIER,
            capability=check,
            supports=supports,
            dtypes=GMM_DTYPES[op],
            contiguous=True,
            variant=variant,
            cost=gmm_cost_hint(
                tuning.points_by_arch(variant, op),
                dense_tflops=tuning.dense_tflops_by_arch(),
                device_kinds=("cuda",),
                host_counts_only=host_only,
            ),
        )
        for variant, check, supports, host_only, fns in providers
        for op, fn in fns.items()
    ] + [
        Kernel(
            op="scaled_gmm",
            fn=gmm.scaled_grouped_mm_gmm,
            devices=("cuda",),
            tier=MEASURED_FASTER_TIER,
            capability=scaled_grouped_mm_capability,
            supports=scaled_grouped_mm_supports,
            dtypes=SCALED_DTYPES,
            contiguous=True,
            variant="scaled_grouped_mm",
            formats=("fp8_rowwise",),
        )
    ]
