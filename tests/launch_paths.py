"""Test-only: the Triton backend's launch policy with its small-call paths turned off.

By default (``megablocks_triton.LaunchConfigs``) small calls take one-launch paths: one program
sorts every key, one program per histogram row writes every bin, gather copies row by row and
scatter scans ``indices`` instead of inverting it first. Test shapes are small, so the paths the
default keeps for large calls are tested under :class:`LargeCallPaths` too.
"""

from __future__ import annotations

from megablocks_triton.config import LaunchConfigs, RoutingConfig


class LargeCallPaths(LaunchConfigs):
    """The default policy as it treats large calls, at every size: counting sort over several
    256-key tiles, histogram programs adding into a zeroed output, token-major gather and
    scatter through the inverse permutation."""

    def routing(self, n: int, num_bins_pow2: int) -> RoutingConfig:
        return super().routing(max(n, 2048), num_bins_pow2)

    def histogram_block(self, n: int) -> int:
        return 256

    def gather_by_rows(self, num_tokens: int, hidden: int, top_k: int, element_size: int) -> bool:
        return False

    def scatter_search(self, num_tokens: int, top_k: int) -> int:
        return 0


#: Ops whose kernels or launch shape :class:`LargeCallPaths` changes.
OPS = ("sort", "route", "histogram", "gather", "scatter")
