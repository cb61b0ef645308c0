"""Launch shapes and direct launches of the Triton permutation kernels.

For each data kernel of :mod:`megablocks_triton.kernels.permutation`: its grid, scalars and
keywords for a call shape (``_gather_launch``, ``_scatter_launch``, ``_wgrad_launch``), and the
unprepared launch of each (``_launch_gather`` and the others: the padded and binned layouts, the
weight gradient fused into the grouped GEMM). The prepared per-call-shape plans and the contract
functions are :mod:`megablocks_triton.permutation`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .config import LaunchConfigs, launch_configs
from .kernels.permutation import (
    _gather_kernel,
    _inverse_kernel,
    _scatter_kernel,
    _wgrad_kernel,
)
from .launch import cdiv, launch, next_power_of_2

PLAIN, PADDED, BINNED = 0, 1, 2


def _inverse_launch(
    configs: LaunchConfigs, n: int
) -> tuple[tuple[int], tuple[int], dict[str, Any]]:
    """Grid, scalars and keywords of the ``_inverse_kernel`` launch over ``n`` ids."""
    block = configs.elementwise_block(n)
    return (cdiv(n, block),), (n,), {"BLOCK": block, **_options(configs)}


def _inverse(indices: torch.Tensor) -> torch.Tensor:
    """inv[indices[i]] = i (int32): the sorted row of each flat id.

    Not initialised: a flat id that no row names keeps whatever the allocator gave, and one that
    several rows name keeps one of them. Readers trust inv[f] only after checking that it points
    back at a row naming f (:func:`_reached`), which costs one int load and no memset.
    """
    n = indices.numel()
    inv = torch.empty(n, dtype=torch.int32, device=indices.device)
    grid, scalars, kw = _inverse_launch(launch_configs(), n)
    launch(_inverse_kernel, grid, indices, inv, *scalars, **kw)
    return inv


# --------------------------------------------------------------------------- launchers


def _options(configs: LaunchConfigs | None = None) -> Mapping[str, Any]:
    """Backend-specific launch keywords (empty unless a vendor policy such as megablocks-rocm's
    is in use; see config.LaunchConfigs.launch_options)."""
    return (configs or launch_configs()).launch_options("permutation")


def _meta(top_k: int, num_bins: int) -> dict[str, int]:
    return {"TOP_K": top_k, "LOG": max(num_bins.bit_length(), 1)}


def _rows(x: torch.Tensor, mode: int) -> int:
    """Rows of the plain or padded layout (the bound every destination is checked against)."""
    return x.shape[0] if mode in (PLAIN, PADDED) else 0


Launch = tuple[tuple[int, ...], tuple[int, ...], dict[str, Any]]


def _gather_launch(
    configs: LaunchConfigs,
    on_cpu: bool,
    element_size: int,
    num_tokens: int,
    hidden: int,
    n: int,
    num_bins: int,
    top_k: int,
    mode: int,
    bin_size: int,
    num_rows: int,
    has_weights: bool,
) -> Launch:
    """Grid, scalars and keywords of a ``_gather_kernel`` launch (its tensors come first)."""
    cfg = configs.permutation(num_tokens, hidden, top_k, element_size)
    pad_programs = 0 if mode == PLAIN else num_bins
    # The CPU runs programs one by one (TRITON_INTERPRET=1): two padding programs per expert
    # still exercise the lane split, at an eighth of the cost.
    zero_rows = min(cfg.zero_rows, 2) if on_cpu else cfg.zero_rows
    grid = (num_tokens + pad_programs * zero_rows, cfg.split_h)
    scalars = (num_tokens, hidden, n, num_bins, bin_size, num_rows)
    kw = {
        "BLOCK_H": cfg.block_h,
        "SPLIT_H": cfg.split_h,
        "ZERO_ROWS": zero_rows,
        "MODE": mode,
        "HAS_WEIGHTS": has_weights,
        "num_warps": cfg.num_warps,
        "BLOCK_E": min(next_power_of_2(max(num_bins, 1)), 256),
        **_meta(top_k, num_bins),
        **_options(configs),
    }
    return grid, scalars, kw


def _scatter_launch(
    configs: LaunchConfigs,
    element_size: int,
    num_tokens: int,
    hidden: int,
    n: int,
    num_bins: int,
    top_k: int,
    mode: int,
    bin_size: int,
    num_rows: int,
    has_weights: bool,
    search: int = 0,
    grouped_rows: bool = False,
) -> Launch:
    """Grid, scalars and keywords of a ``_scatter_kernel`` launch (its tensors come first);
    ``search`` > 0: the token programs scan ``indices`` for their rows (no ``inv``);
    ``grouped_rows``: rows past those bins' groups cover are never read (count as 0)."""
    cfg = configs.permutation(num_tokens, hidden, top_k, element_size)
    grouped = {"GROUPED_ROWS": True, "BLOCK_E": next_power_of_2(num_bins)} if grouped_rows else {}
    kw = {
        "BLOCK_H": cfg.block_h,
        "SPLIT_H": cfg.split_h,
        "MODE": mode,
        "HAS_WEIGHTS": has_weights,
        "SEARCH": search,
        "K_PAD": next_power_of_2(top_k),
        "num_warps": cfg.num_warps,
        **_meta(top_k, num_bins),
        **grouped,
        **_options(configs),
    }
    return (num_tokens, cfg.split_h), (hidden, n, num_bins, bin_size, num_rows), kw


def _wgrad_launch(
    configs: LaunchConfigs,
    element_size: int,
    num_tokens: int,
    hidden: int,
    n: int,
    num_bins: int,
    top_k: int,
    mode: int,
    bin_size: int,
    num_rows: int,
) -> Launch:
    """Grid, scalars and keywords of a ``_wgrad_kernel`` launch (its tensors come first)."""
    cfg = configs.scatter_wgrad(num_tokens, hidden, top_k, element_size)
    kw = {
        "BLOCK_H": cfg.block_h,
        "MODE": mode,
        "num_warps": cfg.num_warps,
        "K_PAD": next_power_of_2(top_k),
        **_meta(top_k, num_bins),
        **_options(configs),
    }
    return (num_tokens,), (hidden, n, num_bins, bin_size, num_rows), kw


def _launch_gather(
    x: torch.Tensor,
    indices: torch.Tensor,
    weights: torch.Tensor | None,
    bins: torch.Tensor,
    padded_bins: torch.Tensor | None,
    top_k: int,
    out: torch.Tensor,
    mode: int,
    bin_size: int,
    inv: torch.Tensor | None = None,
    bin_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    top_k, bin_size = int(top_k), int(bin_size)  # numpy ints are not kernel scalars
    num_tokens, hidden = x.shape
    num_bins = bins.numel()
    pad_programs = 0 if mode == PLAIN else num_bins
    if out.numel() == 0 or (num_tokens == 0 and pad_programs == 0):
        return out
    if inv is None:
        inv = _inverse(indices) if num_tokens else indices
    grid, scalars, kw = _gather_launch(
        launch_configs(),
        x.device.type == "cpu",
        x.element_size(),
        num_tokens,
        hidden,
        indices.numel(),
        num_bins,
        top_k,
        mode,
        bin_size,
        _rows(out, mode),
        weights is not None,
    )
    launch(
        _gather_kernel,
        grid,
        x,
        indices,
        inv,
        bin_ids if bin_ids is not None else bins,
        weights if weights is not None else x,
        bins,
        padded_bins if padded_bins is not None else bins,
        out,
        *scalars,
        **kw,
    )
    return out


def _launch_scatter(
    x: torch.Tensor,
    indices: torch.Tensor,
    weights: torch.Tensor | None,
    bins: torch.Tensor,
    padded_bins: torch.Tensor | None,
    top_k: int,
    mode: int,
    bin_size: int,
    bin_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    top_k, bin_size = int(top_k), int(bin_size)
    num_tokens = indices.numel() // top_k
    hidden = x.shape[-1]
    out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    grid, scalars, kw = _scatter_launch(
        launch_configs(),
        x.element_size(),
        num_tokens,
        hidden,
        indices.numel(),
        bins.numel(),
        top_k,
        mode,
        bin_size,
        _rows(x, mode),
        weights is not None,
    )
    launch(
        _scatter_kernel,
        grid,
        x,
        indices,
        _inverse(indices),
        bin_ids if bin_ids is not None else bins,
        weights if weights is not None else x,
        bins,
        padded_bins if padded_bins is not None else bins,
        out,
        *scalars,
        **kw,
    )
    return out


def _launch_wgrad(
    x: torch.Tensor,
    grad: torch.Tensor,
    indices: torch.Tensor,
    bins: torch.Tensor,
    padded_bins: torch.Tensor | None,
    top_k: int,
    mode: int,
    bin_size: int,
    bin_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    top_k, bin_size = int(top_k), int(bin_size)
    n = indices.numel()
    out = torch.empty(n, dtype=x.dtype, device=x.device)
    hidden = x.shape[-1]
    if n == 0:
        return out
    if hidden == 0:
        return out.zero_()
    grid, scalars, kw = _wgrad_launch(
        launch_configs(),
        x.element_size(),
        n // top_k,
        hidden,
        n,
        bins.numel(),
        top_k,
        mode,
        bin_size,
        _rows(x, mode),
    )
    launch(
        _wgrad_kernel,
        grid,
        x,
        grad,
        indices,
        _inverse(indices),
        bin_ids if bin_ids is not None else bins,
        bins,
        padded_bins if padded_bins is not None else bins,
        out,
        *scalars,
        **kw,
    )
    return out
