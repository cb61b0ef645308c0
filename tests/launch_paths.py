"""Test-only: the Triton backend's launch policy with its small-call paths turned off.

By default (``megablocks_triton.LaunchConfigs``) small calls take one-launch paths: one program
sorts every key (or, up to a few thousand keys, one program per tile counts every key itself),
one program per histogram row writes every bin, gather copies row by row and scatter scans
``indices`` instead of inverting it first. Test shapes are small, so the paths the default keeps
for large calls are tested under :class:`LargeCallPaths` too, and the recounting sort with many
small tiles under :class:`RecountPaths`.
"""

from __future__ import annotations

from megablocks_triton.config import LaunchConfigs, RoutingConfig


class LargeCallPaths(LaunchConfigs):
    """The default policy as it treats large calls, at every size: counting sort over several
    256-key tiles through a count table, histogram programs adding into a zeroed output,
    token-major gather and scatter through the inverse permutation."""

    def routing(self, n: int, num_bins_pow2: int) -> RoutingConfig:
        return super().routing(max(n, 4096), num_bins_pow2)

    def histogram_block(self, n: int) -> int:
        return 256

    def gather_by_rows(self, num_tokens: int, hidden: int, top_k: int, element_size: int) -> bool:
        return False

    def scatter_search(self, num_tokens: int, top_k: int) -> int:
        return 0


#: Ops whose kernels or launch shape :class:`LargeCallPaths` changes.
OPS = ("sort", "route", "histogram", "gather", "scatter")


class RecountPaths(LaunchConfigs):
    """Sort and route in one launch of 64-key tiles whose programs each count every key
    themselves (the default's path for a few thousand keys), at every size: many tiles, a
    partial last one, and more keys than one counting step."""

    def routing(self, n: int, num_bins_pow2: int) -> RoutingConfig:
        return RoutingConfig(tile=64, chunk=16, tile_rows=8, num_warps=4, recount=True)
