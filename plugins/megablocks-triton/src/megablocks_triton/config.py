"""Launch parameters, chosen in one place so another vendor can override them.

Every kernel launch in this package asks :func:`launch_configs` for its block
sizes and warp counts, and for extra backend-specific launch keywords
(:meth:`LaunchConfigs.launch_options`, e.g. ``waves_per_eu`` on AMD). The
defaults are tuned by reasoning for an NVIDIA H200 (132 SMs, 32-wide warps) and
pass no extra keywords; a ROCm plugin (64-wide wavefronts, different register
file) can subclass :class:`LaunchConfigs` and install it process-wide with
:func:`set_launch_configs`, or for a block of code with
:class:`use_launch_configs`, without touching the kernels.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextvars import ContextVar, Token
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

from .launch import cdiv, next_power_of_2

#: The kernel classes :meth:`LaunchConfigs.launch_options` is asked about: ``"routing"``
#: (sort/route/histogram/cumsum/topology/replicate), ``"permutation"`` (gather/scatter and their
#: wgrad), ``"gmm"`` and ``"gmm_wgrad"`` (the grouped-GEMM dot kernels).
KERNEL_KINDS = ("routing", "permutation", "gmm", "gmm_wgrad")

_NO_OPTIONS: Mapping[str, Any] = MappingProxyType({})


@dataclass(frozen=True)
class RoutingConfig:
    """Counting-sort / route launch shape."""

    tile: int
    """Keys per program; tiles are the unit of the per-tile histograms."""
    chunk: int
    """Keys ranked together with one (chunk x chunk) compare inside a tile."""
    tile_rows: int
    """Rows of the (tiles x bins) count table read per step by the scan."""
    num_warps: int
    prescan: bool = False
    """Scan the count table in a launch of its own (many bins) instead of in every program."""


@dataclass(frozen=True)
class PermutationConfig:
    """Token-major gather/scatter launch shape."""

    block_h: int
    """Hidden elements per inner-loop step (power of two)."""
    split_h: int
    """Programs sharing one token's hidden dim (more parallelism for few tokens)."""
    zero_rows: int
    """Programs per expert that zero-fill padding rows (padded/binned gather)."""
    num_warps: int


def _pow2(x: int) -> int:
    return next_power_of_2(max(int(x), 1))


class LaunchConfigs:
    """Default launch parameters; subclass and override per vendor."""

    def routing(self, n: int, num_bins_pow2: int) -> RoutingConfig:
        # Aim for ~128 tiles (16384*8 keys -> 1024-key tiles): enough programs
        # for the H200's 132 SMs and a short serial in-tile rank chain, few
        # enough that every program can re-read the whole (tiles x bins) count
        # table from L2 (128 KB at E=256) instead of a third launch/host sync.
        tile = min(max(_pow2(n // 128), 256), 8192)
        # The in-tile rank is an O(chunk) compare per key; 64 keeps the
        # (chunk x chunk) mask at 4K elements (registers, no spills).
        chunk = 64
        tile_rows = max(1, min(32, 8192 // num_bins_pow2))
        # Many bins: a (tiles x bins) table re-read by every program would be MBs of L2
        # traffic, so scan it once in its own launch and use short 256-key tiles.
        prescan = num_bins_pow2 >= 64 and n > 4096
        if prescan:
            tile = 256
        return RoutingConfig(tile=tile, chunk=chunk, tile_rows=tile_rows, num_warps=4, prescan=prescan)

    def histogram_block(self, n: int) -> int:
        return min(max(_pow2(n // 128), 256), 4096)

    def scan_block(self, length: int) -> int:
        return min(_pow2(length), 2048)

    def elementwise_block(self, n: int) -> int:
        return min(_pow2(n), 1024)

    def permutation(
        self, num_tokens: int, hidden: int, top_k: int, element_size: int
    ) -> PermutationConfig:
        """gather / scatter: one program per token, one copy at a time over a row block.

        A block covers the whole row when it fits (up to 16K elements: the fp32 top-k
        accumulator then needs 32-64 registers per thread), so every copy's destination is
        looked up once. With few tokens, rows are split so that >= ~1024 programs exist.
        """
        block_h = min(_pow2(hidden), 16384)
        split_h = cdiv(hidden, block_h)
        while num_tokens * split_h < 1024 and block_h > 512:
            block_h //= 2
            split_h = cdiv(hidden, block_h)
        # ~16 bytes per thread per load: 8 warps for an 8K-element bf16 row.
        num_warps = max(4, min(16, block_h * element_size // 2048))
        return PermutationConfig(block_h=block_h, split_h=split_h, zero_rows=16, num_warps=num_warps)

    def wgrad(
        self, num_tokens: int, hidden: int, top_k: int, element_size: int
    ) -> PermutationConfig:
        """scatter_wgrad: each program keeps a (top_k, block_h) fp32 tile of partial dots."""
        k_pad = _pow2(top_k)
        # Each step holds k_pad rows x block_h elements in registers: keep that
        # near 8K elements, but each row slice >= 512 elements for wide loads.
        block_h = min(_pow2(hidden), max(8192 // k_pad, 512), 4096)
        h_blocks = cdiv(hidden, block_h)
        # Few tokens (decode): split the hidden dim so >= ~4 programs per SM exist.
        split_h = 1
        while num_tokens * split_h < 512 and split_h * 2 <= h_blocks:
            split_h *= 2
        num_warps = 8 if k_pad * block_h >= 8192 else 4
        return PermutationConfig(block_h=block_h, split_h=split_h, zero_rows=16, num_warps=num_warps)

    def launch_options(self, kernel: str) -> Mapping[str, Any]:
        """Extra keywords for every launch of a ``kernel`` class (see :data:`KERNEL_KINDS`).

        Triton validates them against the active backend's options (an unknown keyword raises
        at launch), so a policy must return only what its backend accepts: e.g.
        ``waves_per_eu`` / ``matrix_instr_nonkdim`` on HIP, never on CUDA. The default is
        portable: nothing.
        """
        return _NO_OPTIONS


_CONFIGS: LaunchConfigs = LaunchConfigs()
# A scoped policy (use_launch_configs) wins over the process-wide one; context-local so that a
# backend wrapping these kernels for one device never changes another thread's launches.
_SCOPED: ContextVar[LaunchConfigs | None] = ContextVar("megablocks_triton_launch_configs",
                                                       default=None)


def launch_configs() -> LaunchConfigs:
    """The launch-parameter policy in use: the scoped one if any, else the process-wide one."""
    return _SCOPED.get() or _CONFIGS


class use_launch_configs:  # lower-case: used like a function, ``with use_launch_configs(c):``
    """Use ``configs`` for the launches inside a ``with`` block (context-local, nestable).

    A plain class rather than ``@contextmanager``: it wraps every kernel call of a plugin that
    supplies its own policy, so it should cost no more than a ContextVar set and reset.
    """

    __slots__ = ("_configs", "_token")

    def __init__(self, configs: LaunchConfigs) -> None:
        self._configs = configs
        self._token: Token[LaunchConfigs | None] | None = None

    def __enter__(self) -> LaunchConfigs:
        self._token = _SCOPED.set(self._configs)
        return self._configs

    def __exit__(self, *exc: object) -> None:
        if self._token is not None:
            _SCOPED.reset(self._token)
            self._token = None


def set_launch_configs(configs: LaunchConfigs) -> None:
    """Install another policy (e.g. a ROCm plugin's wavefront-64 tuning)."""
    global _CONFIGS
    _CONFIGS = configs


def is_rocm() -> bool:
    return torch.version.hip is not None
