"""Grouped-GEMM providers: ``torch._grouped_mm``, the ``grouped_gemm`` package and, for FP8,
``torch._scaled_grouped_mm``.

The bf16 ones implement the core's contracts (``docs/contracts.md``):

* ``gmm(a, b, batch_sizes, trans_b)``: rows ``bins[e-1]:bins[e]`` of the output are
  ``a[those rows] @ b[e]`` (``@ b[e].T`` with ``trans_b``), in a's dtype;
* ``gmm_weight_grad(a, grad, batch_sizes)``: ``out[e] = a_e.T @ grad_e``, shape (E, K, N),
  exactly 0 for an expert without rows.

``scaled_grouped_mm_gmm`` is ``scaled_gmm`` in the ``fp8_rowwise`` format with b stored (E, n, k)
(``trans_b``, the layout the FP8 recipes quantize): torch's rowwise scales are the format's, a's
per row and b's per output column, so the data and scales go in as they are.

``grouped_mm`` never syncs the host: the group end offsets are an int32 cumsum computed on the
device (CPU ``batch_sizes`` are copied there asynchronously). ``grouped_gemm`` takes its sizes
on the host (a serial cuBLAS loop), so device-side ``batch_sizes`` cost a device→host sync; under
CUDA-graph capture, where that sync is impossible, it hands the call to the ``grouped_mm`` path.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from megablocks_core.plugin import out_dtype_of

from . import extension

#: torch._grouped_mm needs 16-byte aligned base pointers and strides: 8 bf16 elements.
ALIGN_BYTES = 16


def grouped_mm_function() -> Callable[..., Tensor] | None:
    """The public ``F.grouped_mm`` when this torch has it, else ``torch._grouped_mm``, else None."""
    return getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def _grouped_mm() -> Callable[..., Tensor]:
    found = grouped_mm_function()
    if found is None:  # the capability predicate keeps such calls away; a direct call says why
        raise RuntimeError(
            f"torch {torch.__version__} has neither F.grouped_mm nor torch._grouped_mm"
        )
    return found


@functools.cache
def grouped_gemm_backend() -> Any:
    """``grouped_gemm.backend`` or None when the package cannot be imported (checked once)."""
    try:
        return importlib.import_module("grouped_gemm.backend")
    except Exception:  # not installed, or its extension does not load with this torch
        return None


def _shape_of(a: Tensor, b: Tensor, trans_b: bool) -> tuple[int, int, int]:
    return a.shape[0], a.shape[1], b.shape[1] if trans_b else b.shape[2]


def _unchecked(batch_sizes: Tensor) -> bool:
    """Device-side sizes: the core checks them only in checked mode (CPU ones always)."""
    return batch_sizes.device.type != "cpu"


def _end_offsets(batch_sizes: Tensor, device: torch.device, rows: int) -> Tensor:
    """int32 end offset of each group on ``device``, without a host sync.

    CPU sizes were checked by the core (non-negative, summing to at most ``rows``: rows past the
    last group belong to no group). Device-side sizes are not, outside checked mode: negative sizes count as 0 and the groups are cut at ``rows``, so
    torch's grouped mm never addresses a row outside a (three tiny launches on E values).
    """
    if not _unchecked(batch_sizes):
        # non_blocking: a CPU→device copy that never waits for the device (no host sync).
        sizes = batch_sizes.to(device=device, non_blocking=True)
        return torch.cumsum(sizes, 0, dtype=torch.int32)
    ends = torch.cumsum(batch_sizes.to(device).clamp(min=0), 0, dtype=torch.int64)
    return ends.clamp_(max=rows).to(torch.int32)


def _zero_uncovered_rows(out: Tensor, offs: Tensor, batch_sizes: Tensor) -> Tensor:
    """Zero the rows past the last group end (sizes summing short of the rows, which the contract
    allows: those rows belong to no group): torch's grouped mm leaves them unwritten. One launch
    that writes only those rows."""
    if out.numel() == 0:
        return out
    if not _unchecked(batch_sizes):  # host sizes: their sum is known without a sync
        covered = int(batch_sizes.sum())
        if covered < out.shape[0]:
            out[covered:].zero_()
        return out
    ext = extension.load() if extension.problem() is None else None
    if (
        out.is_cuda
        and out.is_contiguous()
        and ext is not None
        and hasattr(ext, "zero_uncovered_rows")
    ):
        ext.zero_uncovered_rows(out, offs)
        return out
    rows = torch.arange(out.shape[0], device=out.device)
    return out.masked_fill_(
        (rows >= offs[-1:].long()).view(-1, 1), 0
    )  # a pass, without the extension


def _round_up(size: int, element_size: int) -> int:
    multiple = max(ALIGN_BYTES // element_size, 1)
    return -(-size // multiple) * multiple


def _aligned(t: Tensor, shape: tuple[int, ...]) -> Tensor:
    """``t`` zero-padded (at the end of each dim) to ``shape``, contiguous and 16-byte aligned.

    Returns ``t`` itself when it already is all of that; zero padding along the reduction dim
    adds exact zeros, padding along N adds columns the caller slices off.
    """
    if tuple(t.shape) == shape and t.is_contiguous() and t.data_ptr() % ALIGN_BYTES == 0:
        return t
    out = t.new_zeros(shape)  # fresh storage from the caching allocator is well aligned
    out[tuple(slice(0, s) for s in t.shape)] = t
    return out


def _zero_empty_experts(out: Tensor, batch_sizes: Tensor) -> Tensor:
    """Set out[e] to exact zeros for every expert e without rows, without a host sync.

    torch's grouped mm has had bugs with empty groups in the weight gradient (K = 0), so the
    contract's exact zeros are enforced here. Host-side sizes name the empty experts for free;
    device-side sizes use the extension's kernel (one launch, only empty slices are written) or,
    without the extension, a masked fill (one pass over the output).
    """
    if out.numel() == 0:
        return out
    if batch_sizes.device.type == "cpu":
        empty = (batch_sizes == 0).nonzero().flatten()
        if empty.numel():
            out.index_fill_(0, empty.to(out.device, non_blocking=True), 0)
        return out
    if out.is_cuda and out.is_contiguous() and extension.problem() is None:
        extension.load().zero_empty_groups(out, batch_sizes.contiguous())
        return out
    return out.masked_fill_((batch_sizes == 0).view(-1, 1, 1), 0)


# ---------------------------------------------------------------- torch._grouped_mm


def grouped_mm_gmm(a: Tensor, b: Tensor, batch_sizes: Tensor, trans_b: bool) -> Tensor:
    m, k, n = _shape_of(a, b, trans_b)
    experts = b.shape[0]
    if 0 in (m, k, n, experts):
        return a.new_zeros(m, n)
    offs = _end_offsets(batch_sizes, a.device, m)
    kp, np_ = _round_up(k, a.element_size()), _round_up(n, a.element_size())
    a = _aligned(a, (m, kp))
    if trans_b:  # (E, N, K) row-major is (E, K, N) column-major: only K must be aligned
        mat_b = _aligned(b, (experts, n, kp)).transpose(1, 2)
    else:
        mat_b = _aligned(b, (experts, kp, np_))
    out = _grouped_mm()(a, mat_b, offs=offs)
    return _zero_uncovered_rows(out[:, :n].contiguous(), offs, batch_sizes)


def _trivial_weight_grad(a: Tensor, grad: Tensor, batch_sizes: Tensor) -> Tensor | None:
    """The (E, K, N) zeros when there is nothing to multiply (no rows, K, N or experts), else None."""
    (m, k), n, experts = a.shape, grad.shape[1], batch_sizes.shape[0]
    return a.new_zeros(experts, k, n) if 0 in (m, k, n, experts) else None


def grouped_mm_gmm_weight_grad(a: Tensor, grad: Tensor, batch_sizes: Tensor) -> Tensor:
    trivial = _trivial_weight_grad(a, grad, batch_sizes)
    if trivial is not None:
        return trivial
    m, k = a.shape
    n = grad.shape[1]
    offs = _end_offsets(batch_sizes, a.device, m)
    kp, np_ = _round_up(k, a.element_size()), _round_up(n, a.element_size())
    # Groups run along the rows of a and grad: rows past offs[-1] belong to no group.
    out = _grouped_mm()(_aligned(a, (m, kp)).t(), _aligned(grad, (m, np_)), offs=offs)
    out = out[:, :k, :n].contiguous()
    if _unchecked(batch_sizes):
        # The sizes the groups got (bad device-side sizes are clamped): those are the empty ones.
        batch_sizes = torch.diff(offs, prepend=offs.new_zeros(1))
    return _zero_empty_experts(out, batch_sizes)


# ---------------------------------------------------------------- grouped_gemm


def _host_sizes(batch_sizes: Tensor) -> Tensor:
    # grouped_gemm reads int64 sizes on the host: device-side counts cost a sync here.
    return batch_sizes.to("cpu", torch.int64)


def _host_sizes_ok(sizes: Tensor, rows: int) -> bool:
    """Device-side sizes are unchecked outside checked mode; now on the host, check them for free.
    grouped_gemm trusts them and needs groups covering every row, so bad ones, and sizes summing
    short (valid: the rows past the last group belong to none), go to the grouped_mm path."""
    return bool((sizes >= 0).all()) and int(sizes.sum()) == rows


def _capturing(batch_sizes: Tensor) -> bool:
    return batch_sizes.is_cuda and torch.cuda.is_current_stream_capturing()


def grouped_gemm_gmm(a: Tensor, b: Tensor, batch_sizes: Tensor, trans_b: bool) -> Tensor:
    m, k, n = _shape_of(a, b, trans_b)
    if 0 in (m, k, n, b.shape[0]):
        return a.new_zeros(m, n)
    if _capturing(batch_sizes):  # no host sync possible inside a CUDA graph
        return grouped_mm_gmm(a, b, batch_sizes, trans_b)
    sizes = _host_sizes(batch_sizes)
    if not _host_sizes_ok(sizes, m):
        return grouped_mm_gmm(a, b, batch_sizes, trans_b)
    return grouped_gemm_backend().gmm(a, b, sizes, False, trans_b)


def grouped_gemm_gmm_weight_grad(a: Tensor, grad: Tensor, batch_sizes: Tensor) -> Tensor:
    trivial = _trivial_weight_grad(a, grad, batch_sizes)
    if trivial is not None:
        return trivial
    if _capturing(batch_sizes):
        return grouped_mm_gmm_weight_grad(a, grad, batch_sizes)
    sizes = _host_sizes(batch_sizes)
    if not _host_sizes_ok(sizes, a.shape[0]):
        return grouped_mm_gmm_weight_grad(a, grad, batch_sizes)
    out = grouped_gemm_backend().gmm(a, grad, sizes, True, False)
    return _zero_empty_experts(out, sizes)


# ---------------------------------------------------------------- torch._scaled_grouped_mm


def scaled_grouped_mm_function() -> Callable[..., Tensor] | None:
    """``torch._scaled_grouped_mm`` when this torch has it, else None."""
    return getattr(torch, "_scaled_grouped_mm", None)


def scaled_grouped_mm_gmm(
    a: Tensor,
    a_scale: Tensor,
    b: Tensor,
    b_scale: Tensor,
    batch_sizes: Tensor,
    trans_b: bool,
    format: str,
    out_dtype: str | None,
) -> Tensor:
    """``scaled_gmm`` of ``fp8_rowwise`` operands, b (E, n, k) (trans_b: the plugin's shape
    predicate declines the other layout), through torch's sync-free CUTLASS kernel."""
    if not trans_b or format != "fp8_rowwise":  # a direct call; ranking never sends these
        raise ValueError("scaled_grouped_mm_gmm takes fp8_rowwise operands with trans_b=True")
    (m, k), (experts, n) = a.shape, b.shape[:2]
    dtype = out_dtype_of(out_dtype)
    if 0 in (m, k, n, experts):  # a sum over nothing: zeros
        return torch.zeros(m, n, dtype=dtype, device=a.device)
    found = scaled_grouped_mm_function()
    if found is None:
        raise RuntimeError(f"torch {torch.__version__} has no _scaled_grouped_mm")
    offs = _end_offsets(batch_sizes, a.device, m)
    scale_a, scale_b = a_scale.reshape(m), b_scale.reshape(experts, n)
    out = found(a, b.transpose(1, 2), scale_a, scale_b, offs=offs, out_dtype=dtype)
    return _zero_uncovered_rows(out, offs, batch_sizes)
