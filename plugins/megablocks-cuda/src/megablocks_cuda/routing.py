"""Routing kernels (the core's contract order and outputs) on top of the C++ extension.

Inputs arrive validated and contiguous (the kernels are declared ``contiguous=True``). The
Python side only reshapes: 1-D keys become one row, a cumsum's summed dim is moved last.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .extension import load

__all__ = [
    "exclusive_cumsum",
    "histogram",
    "inclusive_cumsum",
    "one_block_limits",
    "replicate",
    "replicate_backward",
    "route_one_block",
    "sort",
    "sort_one_block",
    "topology",
]


def sort(x: Tensor, end_bit: int | None) -> tuple[Tensor, Tensor]:
    bits = torch.iinfo(x.dtype).bits if end_bit is None else end_bit
    values, indices = load().sort(x, bits)
    return values, indices


def sort_one_block(x: Tensor, end_bit: int) -> tuple[Tensor, Tensor]:
    """The sort of a decode-sized call in one thread block: one launch, its outputs allocated
    and its input made contiguous in C++ (the plugin declares it for calls within
    :func:`one_block_limits`)."""
    return load().sort_one_block(x, end_bit)


def route_one_block(
    top_experts: Tensor, num_experts: int, block_size: int
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """route's five outputs from one launch in one thread block (calls within
    :func:`one_block_limits`)."""
    return load().route_one_block(top_experts, num_experts, block_size)


def one_block_limits() -> tuple[int, int, int]:
    """(most keys, most experts, widest end_bit) the one-block kernels take, from the build."""
    keys, experts, bits = load().one_block_limits()
    return keys, experts, bits


def histogram(x: Tensor, num_bins: int) -> Tensor:
    rows = x.reshape(-1, x.shape[-1]) if x.dim() == 2 else x.reshape(1, -1)
    counts = load().histogram(rows, num_bins)
    return counts.reshape(*x.shape[:-1], num_bins)


def _cumsum(x: Tensor, dim: int, inclusive: bool) -> Tensor:
    if x.dim() == 1:
        return load().cumsum(x.reshape(1, -1), inclusive).reshape(x.shape)
    if dim % 2 == 1:
        return load().cumsum(x, inclusive)
    # Summing down the columns: scan the transposed rows and transpose back.
    return load().cumsum(x.t().contiguous(), inclusive).t().contiguous()


def inclusive_cumsum(x: Tensor, dim: int) -> Tensor:
    return _cumsum(x, dim, True)


def exclusive_cumsum(x: Tensor, dim: int) -> Tensor:
    return _cumsum(x, dim, False)


def topology(
    padded_bins: Tensor, block_size: int, output_block_rows: int, output_block_columns: int
) -> Tensor:
    return load().topology(padded_bins, block_size, output_block_rows, output_block_columns)


def replicate(x: Tensor, bins: Tensor, num_outputs: int) -> Tensor:
    return load().replicate(x, bins, num_outputs)


def replicate_backward(grad: Tensor, bins: Tensor) -> Tensor:
    return load().replicate_backward(grad, bins)
