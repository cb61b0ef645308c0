"""The kernels. Each takes its op's arguments positionally, in the order of the op's
contract (docs/contracts.md), and returns what the contract says. Inputs arrive validated
and autograd is the core's, so a kernel only computes.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def histogram(x: Tensor, num_bins: int) -> Tensor:
    """int32 counts per bin of each row of x (1-D or 2-D); keys outside [0, num_bins) are not counted."""
    rows = x.reshape(math.prod(x.shape[:-1]), x.shape[-1]).long()  # (batch, n); batch 1 for 1-D x
    # Give every row its own range of bins, so one bincount counts them all.
    offsets = torch.arange(rows.shape[0], device=x.device).unsqueeze(1) * num_bins
    keep = (rows >= 0) & (rows < num_bins)
    flat = (rows + offsets)[keep]
    counts = torch.bincount(flat, minlength=rows.shape[0] * num_bins)
    return counts.to(torch.int32).reshape(*x.shape[:-1], num_bins)


def inclusive_cumsum(x: Tensor, dim: int) -> Tensor:
    """Running sum along dim in x's dtype (no promotion, unlike torch.cumsum), shape kept."""
    return torch.cumsum(x, dim, dtype=torch.int64).to(x.dtype)
