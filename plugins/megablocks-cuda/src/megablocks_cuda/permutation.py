"""The scatter of a few thousand rows in one launch, on top of the C++ extension."""

from __future__ import annotations

from torch import Tensor

from .extension import load

__all__ = ["scan_scatter", "scan_scatter_max_rows"]


def scan_scatter(
    x: Tensor,
    indices: Tensor,
    bin_ids: Tensor,
    weights: Tensor | None,
    bins: Tensor,
    top_k: int,
) -> Tensor:
    """scatter's contract for up to :func:`scan_scatter_max_rows` rows: every thread block scans
    ``indices`` for its own tokens' rows instead of a separate launch inverting the permutation.
    Reads rows by their flat ids only (``bin_ids`` and ``bins`` describe the layout, unused);
    inputs are made contiguous in C++."""
    out: Tensor = load().scan_scatter(x, indices, weights, top_k)
    return out


def scan_scatter_max_rows() -> int:
    """The most rows (tokens * top_k) :func:`scan_scatter` takes, from the build."""
    rows: int = load().scan_scatter_max_rows()
    return rows
