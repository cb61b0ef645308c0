"""Token-major Triton permutation kernels (gather/scatter and their padded/binned forms).

Every data kernel runs one program per token (optionally a few per token when
there are few tokens, splitting the hidden dim) and handles all of that
token's top_k copies at once as a (k, BLOCK_H) tile:

* gather reads the token's row once and writes its top_k destinations;
* scatter reads the top_k rows, weights them, sums in fp32 and writes once;
* *_wgrad reads the token's grad row once and dots it with its top_k rows.

So each moves only the ideal bytes (T*H + T*K*H elements), with no (T, K, H)
intermediate. The token-major order needs, for each flat id f = t*K + k, its
row in sorted order: the inverse permutation of ``indices``, built by one tiny
scatter launch (``_inverse_kernel``), never a host sync. Only padded_gather
reads one value on the host (``padded_bins[-1]``, the output size).

Few rows (the launch policy decides: ``LaunchConfigs.gather_by_rows`` and
``scatter_search``), the plain gather and scatter skip that launch, whose host
cost then exceeds the work: gather runs one program per output row that copies
its token's row (``_gather_rows_kernel``: x is read top_k times, from L2), and
scatter's token programs find their rows by scanning ``indices`` (``_rows_naming``).
Their launches are prepared once per call shape (``megablocks_triton.launch.bind``).

Destinations by layout (``MODE``):
  0 plain:  row p = inv[f]
  1 padded: row p - bins_start(e) + padded_start(e), e = bin_ids[p] where bins confirm it
            (bins[e-1] <= p < bins[e]); other rows are placed by the gather's fix-up (binary
            search in bins) and contribute 0 to a scatter
  2 binned: row e * bin_size + (p - bins_start(e)), e found by binary search in
            bins; dropped when p - bins_start(e) >= bin_size.
The padded/binned gathers also zero their padding rows in the same launch
(extra programs after the token programs), so the output is never memset.

Bad data (inputs that pass the always-on checks but break the data rules) never
makes a kernel address memory outside its tensors, and every output element is
written: ``inv`` is trusted only where it points back at a row naming that flat
id (an int compare), destinations are masked to the layout, and each token
program also writes the sorted rows no token reaches (``_fix_unreached``); the
row-by-row gather masks each row's source to x and writes every row, and the scan
reads only ``indices``. The results are documented per op in the contracts' edge
cases and are the same on every path.

This module holds the per-call-shape plans and the contract functions; the ``@triton.jit``
kernels are :mod:`megablocks_triton.kernels.permutation` and their launch shapes and direct
launches :mod:`megablocks_triton.permutation_launches`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from megablocks_core.plugin import ContractError

from .config import LaunchConfigs, launch_configs
from .kernels.permutation import (
    _gather_kernel,
    _gather_rows_kernel,
    _inverse_kernel,
    _scatter_kernel,
    _wgrad_kernel,
)
from .launch import bind, remember
from .permutation_launches import (
    BINNED,
    PADDED,
    PLAIN,
    _gather_launch,
    _inverse,
    _inverse_launch,
    _launch_gather,
    _launch_scatter,
    _launch_wgrad,
    _options,
    _scatter_launch,
    _wgrad_launch,
)

__all__ = [
    "binned_gather",
    "binned_scatter",
    "binned_scatter_wgrad",
    "gather",
    "padded_gather",
    "padded_scatter",
    "padded_scatter_wgrad",
    "scatter",
    "scatter_wgrad",
]

# --------------------------------------------------------------------------- plain layout, per call shape
#
# gather, scatter and scatter_wgrad (the dropless layer's ops) keep their launches prepared per
# call shape: a call allocates its outputs and launches, with no launch parameter to work out.
# The key holds every input's shape and dtype (they decide every scalar and every tensor's dtype
# of the launches) and the primary input's device.

_GATHER_PLANS: dict[Any, Callable[..., torch.Tensor]] = {}
_SCATTER_PLANS: dict[Any, Callable[..., torch.Tensor]] = {}
_WGRAD_PLANS: dict[Any, Callable[..., torch.Tensor]] = {}


def _inverse_plan(configs: LaunchConfigs, n: int) -> Callable[[torch.Tensor], torch.Tensor]:
    grid, scalars, kw = _inverse_launch(configs, n)
    invert = bind(_inverse_kernel, grid, *scalars, **kw)
    int32 = torch.int32

    def inverse(indices: torch.Tensor) -> torch.Tensor:
        inv = indices.new_empty(n, dtype=int32)
        invert(indices, inv)
        return inv

    return inverse


def _gather_plan(
    configs: LaunchConfigs,
    x: torch.Tensor,
    n: int,
    num_bins: int,
    top_k: int,
    has_weights: bool,
    rows: int | None = None,
) -> Callable[..., torch.Tensor]:
    """The prepared gather of the first ``rows`` sorted rows (all n when None)."""
    num_tokens, hidden = x.shape
    dtype = x.dtype
    out_rows = n if rows is None else rows
    if out_rows * hidden == 0 or num_tokens == 0:
        return lambda x, indices, weights, bins: torch.empty(
            (out_rows, hidden), dtype=dtype, device=x.device
        )
    if configs.gather_by_rows(num_tokens, hidden, top_k, x.element_size()):
        # out_rows rows of one copy each (ids still range over all n)
        cfg = configs.permutation(out_rows, hidden, 1, x.element_size())
        copy_rows = bind(
            _gather_rows_kernel,
            (out_rows, cfg.split_h),
            n,
            hidden,
            TOP_K=top_k,
            BLOCK_H=cfg.block_h,
            SPLIT_H=cfg.split_h,
            HAS_WEIGHTS=has_weights,
            num_warps=cfg.num_warps,
            **_options(configs),
        )

        def by_rows(
            x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor | None, bins: torch.Tensor
        ) -> torch.Tensor:
            out = x.new_empty(out_rows, hidden)
            copy_rows(x, indices, weights if weights is not None else x, out)
            return out

        return by_rows
    inverse = _inverse_plan(configs, n)
    grid, scalars, kw = _gather_launch(
        configs,
        x.device.type == "cpu",
        x.element_size(),
        num_tokens,
        hidden,
        n,
        num_bins,
        top_k,
        PLAIN,
        0,
        out_rows,
        has_weights,
    )
    copy = bind(_gather_kernel, grid, *scalars, **kw)

    def by_tokens(
        x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor | None, bins: torch.Tensor
    ) -> torch.Tensor:
        out = x.new_empty(out_rows, hidden)
        inv = inverse(indices)
        copy(x, indices, inv, bins, weights if weights is not None else x, bins, bins, out)
        return out

    return by_tokens


def _scatter_plan(
    configs: LaunchConfigs,
    x: torch.Tensor,
    n: int,
    num_bins: int,
    top_k: int,
    has_weights: bool,
    grouped_rows: bool = False,
) -> Callable[..., torch.Tensor]:
    """The prepared scatter of ``x``'s rows; ``grouped_rows``: only the rows bins' groups cover
    are read (gmm_scatter's reduction: its GEMM writes no other row)."""
    num_tokens = n // top_k
    hidden = x.shape[-1]
    dtype = x.dtype
    if num_tokens * hidden == 0:
        return lambda x, indices, weights, bins: torch.empty(
            (num_tokens, hidden), dtype=dtype, device=x.device
        )
    search = configs.scatter_search(num_tokens, top_k)
    grid, scalars, kw = _scatter_launch(
        configs,
        x.element_size(),
        num_tokens,
        hidden,
        n,
        num_bins,
        top_k,
        PLAIN,
        0,
        x.shape[0],
        has_weights,
        search,
        grouped_rows,
    )
    reduce = bind(_scatter_kernel, grid, *scalars, **kw)
    if search:

        def scanning(
            x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor | None, bins: torch.Tensor
        ) -> torch.Tensor:
            out = x.new_empty(num_tokens, hidden)
            # No inverse permutation: indices stands in for inv (unread).
            reduce(
                x, indices, indices, bins, weights if weights is not None else x, bins, bins, out
            )
            return out

        return scanning
    inverse = _inverse_plan(configs, n)

    def by_inverse(
        x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor | None, bins: torch.Tensor
    ) -> torch.Tensor:
        out = x.new_empty(num_tokens, hidden)
        inv = inverse(indices)
        reduce(x, indices, inv, bins, weights if weights is not None else x, bins, bins, out)
        return out

    return by_inverse


def _wgrad_plan(
    configs: LaunchConfigs, x: torch.Tensor, n: int, num_bins: int, top_k: int
) -> Callable[..., torch.Tensor]:
    hidden = x.shape[-1]
    dtype = x.dtype
    if n == 0 or hidden == 0:
        return lambda x, grad, indices, bins: torch.zeros(n, dtype=dtype, device=x.device)
    inverse = _inverse_plan(configs, n)
    grid, scalars, kw = _wgrad_launch(
        configs, x.element_size(), n // top_k, hidden, n, num_bins, top_k, PLAIN, 0, x.shape[0]
    )
    dot = bind(_wgrad_kernel, grid, *scalars, **kw)

    def run(
        x: torch.Tensor, grad: torch.Tensor, indices: torch.Tensor, bins: torch.Tensor
    ) -> torch.Tensor:
        out = x.new_empty(n)
        inv = inverse(indices)
        dot(x, grad, indices, inv, bins, bins, bins, out)
        return out

    return run


# --------------------------------------------------------------------------- contract functions


def gather(
    x: torch.Tensor,
    indices: torch.Tensor,
    bin_ids: torch.Tensor,
    weights: torch.Tensor | None,
    bins: torch.Tensor,
    top_k: int,
    rows: int | None = None,
) -> torch.Tensor:
    """(T, H) -> (T*K, H), or its first ``rows`` rows: out[i] = x[indices[i] // K] *
    weights[indices[i]] (if weights)."""
    return _plan(_GATHER_PLANS, _gather_plan, x, indices, weights, bins, top_k, rows)(
        x, indices, weights, bins
    )


def scatter(
    x: torch.Tensor,
    indices: torch.Tensor,
    bin_ids: torch.Tensor,
    weights: torch.Tensor | None,
    bins: torch.Tensor,
    top_k: int,
) -> torch.Tensor:
    """(T*K, H) sorted rows -> (T, H): weighted top-k sum per token (fp32 accumulation)."""
    return _plan(_SCATTER_PLANS, _scatter_plan, x, indices, weights, bins, top_k)(
        x, indices, weights, bins
    )


def _plan(
    plans: dict[Any, Any],
    make: Callable[..., Any],
    x: torch.Tensor,
    indices: torch.Tensor,
    weights: torch.Tensor | None,
    bins: torch.Tensor,
    top_k: int,
    *rows: int | None,
) -> Any:
    """The prepared launches of a plain gather (``rows``: its row count) or scatter for this
    call shape (made once)."""
    configs = launch_configs()
    key = (
        x.shape,
        x.dtype,
        x.device,
        indices.shape,
        indices.dtype,
        bins.shape,
        bins.dtype,
        None if weights is None else weights.dtype,
        top_k,
        configs,
        *rows,
    )
    plan = plans.get(key)
    if plan is None:
        plan = remember(
            plans,
            key,
            make(configs, x, indices.numel(), bins.numel(), int(top_k), weights is not None, *rows),
        )
    return plan


def scatter_wgrad(
    x: torch.Tensor,
    grad: torch.Tensor,
    indices: torch.Tensor,
    bin_ids: torch.Tensor,
    bins: torch.Tensor,
    top_k: int,
) -> torch.Tensor:
    """(n,) in x.dtype: out[indices[i]] = dot(x[i], grad[indices[i] // K])."""
    configs = launch_configs()
    key = (
        x.shape,
        x.dtype,
        x.device,
        grad.shape,
        grad.dtype,
        indices.shape,
        indices.dtype,
        bins.shape,
        bins.dtype,
        top_k,
        configs,
    )
    plan = _WGRAD_PLANS.get(key)
    if plan is None:
        plan = remember(
            _WGRAD_PLANS, key, _wgrad_plan(configs, x, indices.numel(), bins.numel(), int(top_k))
        )
    return plan(x, grad, indices, bins)


def padded_gather(
    x: torch.Tensor,
    indices: torch.Tensor,
    bin_ids: torch.Tensor,
    weights: torch.Tensor | None,
    bins: torch.Tensor,
    padded_bins: torch.Tensor,
    top_k: int,
) -> torch.Tensor:
    """(T, H) -> (padded_bins[-1], H), each expert's rows starting at padded_bins[e-1]; padding rows 0.

    Reads padded_bins[-1] on the host (the output size), as MegaBlocks does.
    """
    # Queue the inverse permutation first: the GPU computes it while the host waits on the read.
    inv = _inverse(indices) if indices.numel() else indices
    rows = int(padded_bins[-1].item()) if padded_bins.numel() else 0
    if rows < 0:
        raise ContractError(
            f"megablocks_core.ops.padded_gather: argument 'padded_bins' ends at {rows}, "
            "but its last entry is the output's row count (expected >= 0)"
        )
    out = torch.empty((rows, x.shape[1]), dtype=x.dtype, device=x.device)
    return _launch_gather(
        x, indices, weights, bins, padded_bins, top_k, out, PADDED, 0, inv, bin_ids
    )


def padded_scatter(
    x: torch.Tensor,
    indices: torch.Tensor,
    bin_ids: torch.Tensor,
    weights: torch.Tensor | None,
    bins: torch.Tensor,
    padded_bins: torch.Tensor,
    top_k: int,
) -> torch.Tensor:
    """(padded rows, H) -> (T, H): inverse of padded_gather, weighted top-k sum in fp32."""
    return _launch_scatter(x, indices, weights, bins, padded_bins, top_k, PADDED, 0, bin_ids)


def padded_scatter_wgrad(
    x: torch.Tensor,
    grad: torch.Tensor,
    indices: torch.Tensor,
    bin_ids: torch.Tensor,
    bins: torch.Tensor,
    padded_bins: torch.Tensor,
    top_k: int,
) -> torch.Tensor:
    """(n,): dot of each flat id's padded row with its token's grad row."""
    return _launch_wgrad(x, grad, indices, bins, padded_bins, top_k, PADDED, 0, bin_ids)


def binned_gather(
    x: torch.Tensor,
    indices: torch.Tensor,
    weights: torch.Tensor | None,
    bins: torch.Tensor,
    bin_size: int,
    top_k: int,
) -> torch.Tensor:
    """(T, H) -> (E, bin_size, H) zero-filled; copies beyond an expert's capacity are dropped."""
    num_bins, bin_size = bins.numel(), int(bin_size)
    out = torch.empty((num_bins, bin_size, x.shape[1]), dtype=x.dtype, device=x.device)
    _launch_gather(x, indices, weights, bins, None, top_k, out, BINNED, bin_size)
    return out


def binned_scatter(
    x: torch.Tensor,
    indices: torch.Tensor,
    weights: torch.Tensor | None,
    bins: torch.Tensor,
    top_k: int,
) -> torch.Tensor:
    """(E, bin_size, H) -> (T, H): weighted top-k sum; dropped copies contribute 0."""
    return _launch_scatter(x, indices, weights, bins, None, top_k, BINNED, x.shape[1])


def binned_scatter_wgrad(
    x: torch.Tensor,
    grad: torch.Tensor,
    indices: torch.Tensor,
    bins: torch.Tensor,
    top_k: int,
) -> torch.Tensor:
    """(n,): dot of each kept binned row with its token's grad row; 0 for dropped copies."""
    return _launch_wgrad(x, grad, indices, bins, None, top_k, BINNED, x.shape[1])
