"""Triton routing's smaller ops, host side: router top-k, histogram, cumsum, topology,
replicate (one launch each, no host sync; :mod:`megablocks_triton.routing` re-exports them
beside its counting sort). Router top-k, histogram and cumsum prepare each call shape's launch
once (:func:`megablocks_triton.launch.bind`); topology and replicate launch directly.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from .config import LaunchConfigs, launch_configs
from .kernels.routing import (
    _cumsum_kernel,
    _histogram_kernel,
    _replicate_backward_kernel,
    _replicate_kernel,
    _router_topk_kernel,
    _topology_kernel,
)
from .launch import bind, cdiv, launch, next_power_of_2, remember

#: Bins up to this many are counted with an in-register per-tile histogram and
#: one atomic per bin; more bins use one atomic per key.
MAX_TILE_HISTOGRAM_BINS = 4096


def _options(configs: LaunchConfigs | None = None) -> Mapping[str, Any]:
    """Backend-specific launch keywords for the routing kernels (empty unless a vendor policy
    such as megablocks-rocm's is in use; see config.LaunchConfigs.launch_options)."""
    return (configs or launch_configs()).launch_options("routing")


# Per call shape (and launch policy): the prepared launches of histogram, cumsum, router top-k.
_HISTOGRAM_PLANS: dict[Any, Callable[[torch.Tensor], torch.Tensor]] = {}
_CUMSUM_PLANS: dict[Any, Callable[[torch.Tensor], torch.Tensor]] = {}
_ROUTER_TOPK_PLANS: dict[Any, Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]] = {}


# --------------------------------------------------------------------------- router top-k


#: Experts up to this many sit in registers (one row per program at the most); the plugin
#: declines more (:func:`router_topk_supports`), so the core gives such calls to the next backend.
MAX_TOPK_EXPERTS = 8192
#: Elements of the (rows x experts) tile one program ranks.
_TOPK_TILE = 4096


def _too_many_experts(experts: int) -> str | None:
    if experts > MAX_TOPK_EXPERTS:
        return f"{experts} experts: more than the {MAX_TOPK_EXPERTS} one program holds"
    return None


def router_topk_supports(device: Any, call: Mapping[str, Any]) -> str | None:
    """The plugin's shape predicate for router_topk (see :data:`MAX_TOPK_EXPERTS`)."""
    return _too_many_experts(call["scores"].shape[1])


def _router_topk_plan(
    configs: LaunchConfigs,
    shape: torch.Size,
    strides: tuple[int, ...],
    top_k: int,
    softmax: bool,
) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    tokens, experts = shape
    int32 = torch.int32
    if tokens == 0:
        return lambda s: (s.new_empty((0, top_k)), s.new_empty((0, top_k), dtype=int32))
    too_many = _too_many_experts(experts)
    if too_many:
        raise ValueError(f"router_topk: {too_many}")
    block_e = next_power_of_2(experts)
    rows = min(max(1, _TOPK_TILE // block_e), next_power_of_2(tokens))
    select = bind(
        _router_topk_kernel,
        (cdiv(tokens, rows),),
        tokens,
        experts,
        *strides,
        top_k,
        ROWS=rows,
        BLOCK_E=block_e,
        SOFTMAX=softmax,
        num_warps=4,
        **_options(configs),
    )

    def run(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights = scores.new_empty((tokens, top_k))
        ids = scores.new_empty((tokens, top_k), dtype=int32)
        select(scores, weights, ids)
        return weights, ids

    return run


def router_topk(
    scores: torch.Tensor, top_k: int, softmax: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's top_k experts by score (descending, equal scores by lower id, NaN first) and
    their weights: the scores, or with ``softmax`` the softmax probabilities over the row, in
    scores' dtype. One launch (whole rows in registers, up to :data:`MAX_TOPK_EXPERTS`
    experts), no host sync."""
    configs = launch_configs()
    key = (scores.shape, scores.stride(), scores.dtype, scores.device, top_k, softmax, configs)
    plan = _ROUTER_TOPK_PLANS.get(key)
    if plan is None:
        plan = remember(
            _ROUTER_TOPK_PLANS,
            key,
            _router_topk_plan(configs, scores.shape, scores.stride(), int(top_k), bool(softmax)),
        )
    return plan(scores)


# --------------------------------------------------------------------------- histogram


def _histogram_plan(
    configs: LaunchConfigs, shape: torch.Size, num_bins: int
) -> Callable[[torch.Tensor], torch.Tensor]:
    rows = 1 if len(shape) == 1 else shape[0]
    n = shape[-1]
    out_shape = (*shape[:-1], num_bins)
    int32 = torch.int32
    if n == 0 or rows == 0 or num_bins == 0:
        return lambda x: torch.zeros(out_shape, dtype=int32, device=x.device)
    block = configs.histogram_block(n)
    per_key = num_bins > MAX_TILE_HISTOGRAM_BINS
    # One program per row (few keys) writes every bin itself; otherwise the programs add into a
    # zeroed output.
    whole_row = not per_key and block >= n
    count = bind(
        _histogram_kernel,
        (cdiv(n, block), rows),
        n,
        num_bins,
        NB=1 if per_key else next_power_of_2(num_bins),
        BLOCK=block,
        PER_KEY=per_key,
        WHOLE_ROW=whole_row,
        **_options(configs),
    )
    allocate = torch.Tensor.new_empty if whole_row else torch.Tensor.new_zeros

    def run(x: torch.Tensor) -> torch.Tensor:
        out = allocate(x, out_shape, dtype=int32)
        count(x, out)
        return out

    return run


def histogram(x: torch.Tensor, num_bins: int) -> torch.Tensor:
    """int32 counts of values in [0, num_bins); 1-D -> (num_bins,), 2-D -> (B, num_bins) per row.

    Out-of-range values are dropped. One launch for rows that one program counts (the launch
    policy's ``histogram_block``), else two (a memset and the count).
    """
    configs = launch_configs()
    key = (x.shape, x.dtype, x.device, num_bins, configs)
    plan = _HISTOGRAM_PLANS.get(key)
    if plan is None:
        plan = remember(_HISTOGRAM_PLANS, key, _histogram_plan(configs, x.shape, int(num_bins)))
    return plan(x)


# --------------------------------------------------------------------------- cumsum


def _cumsum_plan(
    configs: LaunchConfigs, shape: torch.Size, dtype: torch.dtype, dim: int, exclusive: bool
) -> Callable[[torch.Tensor], torch.Tensor]:
    if shape.numel() == 0:
        return torch.empty_like
    if len(shape) == 1:
        lines, length, line_stride, elem_stride = 1, shape[0], 0, 1
    else:
        rows, cols = shape
        if dim % 2 == 1:
            lines, length, line_stride, elem_stride = rows, cols, cols, 1
        else:
            lines, length, line_stride, elem_stride = cols, rows, 1, cols
    scan = bind(
        _cumsum_kernel,
        (lines,),
        length,
        line_stride,
        elem_stride,
        BLOCK=configs.scan_block(length),
        EXCLUSIVE=exclusive,
        WIDE=dtype == torch.int64,
        **_options(configs),
    )

    def run(x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        scan(x, out)
        return out

    return run


def _cumsum(x: torch.Tensor, dim: int, exclusive: bool) -> torch.Tensor:
    configs = launch_configs()
    key = (x.shape, x.dtype, x.device, dim, exclusive, configs)
    plan = _CUMSUM_PLANS.get(key)
    if plan is None:
        plan = remember(
            _CUMSUM_PLANS, key, _cumsum_plan(configs, x.shape, x.dtype, int(dim), exclusive)
        )
    return plan(x)


def inclusive_cumsum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Inclusive prefix sum along dim; same dtype and shape as x."""
    return _cumsum(x, dim, exclusive=False)


def exclusive_cumsum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Exclusive prefix sum along dim (out[i] = sum(x[:i])); same dtype and shape."""
    return _cumsum(x, dim, exclusive=True)


# --------------------------------------------------------------------------- topology


def topology(
    padded_bins: torch.Tensor, block_size: int, output_block_rows: int, output_block_columns: int
) -> torch.Tensor:
    """int16 (rows*cols,) block-sparse column indices: out[r*cols+j] = e(r)*cols + j."""
    block_size, rows, cols = int(block_size), int(output_block_rows), int(output_block_columns)
    out = torch.empty(rows * cols, dtype=torch.int16, device=padded_bins.device)
    if out.numel() == 0:
        return out
    num_bins = padded_bins.numel()
    block_r = 32
    block_c = min(next_power_of_2(cols), 128)
    launch(
        _topology_kernel,
        (cdiv(rows, block_r),),
        padded_bins,
        out,
        num_bins,
        block_size,
        rows,
        cols,
        BLOCK_R=block_r,
        BLOCK_C=block_c,
        LOG=max(num_bins.bit_length(), 1),
        **_options(),
    )
    return out


# --------------------------------------------------------------------------- replicate


def replicate(x: torch.Tensor, bins: torch.Tensor, num_outputs: int) -> torch.Tensor:
    """(B, E) -> (B, num_outputs): out[b, j] = x[b, e] for bins[e-1] <= j < bins[e]; 0 past bins[-1]."""
    batch, num_bins = x.shape
    num_outputs = int(num_outputs)
    out = torch.empty((batch, num_outputs), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    if num_bins == 0:
        return out.zero_()
    block = launch_configs().elementwise_block(num_outputs)
    launch(
        _replicate_kernel,
        (cdiv(num_outputs, block), batch),
        x,
        bins,
        out,
        num_bins,
        num_outputs,
        BLOCK=block,
        LOG=num_bins.bit_length(),
        **_options(),
    )
    return out


def replicate_backward(grad: torch.Tensor, bins: torch.Tensor) -> torch.Tensor:
    """(B, N) -> (B, E): segment sums out[b, e] = sum(grad[b, bins[e-1]:bins[e]]), fp32 accumulation."""
    batch, num_cols = grad.shape
    num_bins = bins.numel()
    out = torch.empty((batch, num_bins), dtype=grad.dtype, device=grad.device)
    if out.numel() == 0:
        return out
    launch(
        _replicate_backward_kernel,
        (num_bins, batch),
        grad,
        bins,
        out,
        num_bins,
        num_cols,
        BLOCK=256,
        **_options(),
    )
    return out
