"""Launch parameters, chosen in one place so another vendor can override them.

Every kernel launch in this package asks :func:`launch_configs` for its block
sizes and warp counts (the grouped GEMMs for their tiles: :meth:`LaunchConfigs.gmm`,
:meth:`LaunchConfigs.gmm_wgrad`), and for extra backend-specific launch keywords
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
from dataclasses import replace
from types import MappingProxyType
from typing import Any

import torch

from megablocks_core.plugin import DeviceInfo

from .arch_table import ARCHS, arch_tuning, gmm_tile_family
from .arch_table import ArchTuning as ArchTuning
from .launch import cdiv, next_power_of_2
from .launch_types import (
    GmmConfig,
    PermutationConfig,
    RoutingConfig,
    RowCopyConfig,
    TokenGmmConfig,
    dtype_class,
)

#: The kernel classes :meth:`LaunchConfigs.launch_options` is asked about: ``"routing"``
#: (sort/route/histogram/cumsum/topology/replicate), ``"permutation"`` (gather/scatter and their
#: wgrad), ``"gmm"`` and ``"gmm_wgrad"`` (the grouped-GEMM dot kernels).
KERNEL_KINDS = ("routing", "permutation", "gmm", "gmm_wgrad")

_NO_OPTIONS: Mapping[str, Any] = MappingProxyType({})


def _pow2_at_least(x: int, floor: int) -> int:
    return max(floor, next_power_of_2(x))


def fit_gmm_tiles(
    cfg: GmmConfig, rows: int, cols: int, depth: int, rows_per_expert: float | None = None
) -> GmmConfig:
    """``cfg`` with blocks that never exceed the problem (rounded up to a power of two, >= 16
    for ``tl.dot``): ``rows`` x ``cols`` output per expert, ``depth`` the reduction per expert.

    ``rows_per_expert`` (the forward pass; None: no shrinking): experts averaging fewer rows than
    half a BLOCK_M tile waste most of their last M-tile, so BLOCK_M halves while that holds, not
    below 64 (the MMA atoms are 64 rows on Hopper; 4 16x16 MFMA blocks on AMD).
    """
    block_m = cfg.block_m
    if rows_per_expert is not None:
        while block_m > 64 and rows_per_expert < block_m / 2:
            block_m //= 2
    return replace(
        cfg,
        block_m=min(block_m, _pow2_at_least(rows, 16)),
        block_n=min(cfg.block_n, _pow2_at_least(cols, 16)),
        block_k=min(cfg.block_k, _pow2_at_least(depth, 16)),
    )


def permutation_wgrad_shape(
    num_tokens: int,
    hidden: int,
    top_k: int,
    *,
    tile_elements: int,
    min_block_h: int,
    min_programs: int,
    num_warps: tuple[int, int],
    more_warps_from: int,
) -> PermutationConfig:
    """scatter_wgrad's launch shape: each program keeps a (top_k, block_h) fp32 tile of partial
    dots in registers.

    ``tile_elements``: the tile's size target (block_h shrinks as top_k grows), with rows of at
    least ``min_block_h`` elements for wide loads. Few tokens (decode): the hidden dim is split
    until ``min_programs`` programs exist. ``num_warps``: (fewer, more), the latter for tiles of
    ``more_warps_from`` elements or more.
    """
    k_pad = next_power_of_2(top_k)
    block_h = min(next_power_of_2(hidden), max(tile_elements // k_pad, min_block_h), 4096)
    h_blocks = cdiv(hidden, block_h)
    split_h = 1
    while num_tokens * split_h < min_programs and split_h * 2 <= h_blocks:
        split_h *= 2
    warps = num_warps[1] if k_pad * block_h >= more_warps_from else num_warps[0]
    return PermutationConfig(block_h=block_h, split_h=split_h, zero_rows=16, num_warps=warps)


class LaunchConfigs:
    """Default launch parameters; subclass and override per vendor."""

    def routing(self, n: int, num_bins_pow2: int) -> RoutingConfig:
        if n <= 256:
            # Few keys: one program ranks them all in one launch. Its 64-key chunks run one after
            # the other (about 1 µs each on the H200), so past ~4 chunks the two-launch path below
            # is faster on the GPU (1024 keys: 21 µs against 10; 128 keys: 5 against 9).
            return RoutingConfig(
                tile=_pow2_at_least(n, 64),
                chunk=64,
                tile_rows=max(1, min(32, 8192 // num_bins_pow2)),
                num_warps=4,
                single=True,
            )
        if n <= 2048:
            # A few thousand keys: 256-key tiles (4 chunks of serial rank chain each), every
            # program counting all keys itself: one launch instead of a histogram launch and a
            # count table (the two-launch path took 9.7 µs of GPU time at 1024 keys on the H200).
            return RoutingConfig(
                tile=256,
                chunk=64,
                tile_rows=max(1, min(32, 8192 // num_bins_pow2)),
                num_warps=4,
                recount=True,
            )
        # Aim for ~128 tiles (16384*8 keys -> 1024-key tiles): enough programs
        # for the H200's 132 SMs and a short serial in-tile rank chain, few
        # enough that every program can re-read the whole (tiles x bins) count
        # table from L2 (128 KB at E=256) instead of a third launch/host sync.
        tile = min(max(next_power_of_2(n // 128), 256), 8192)
        # The in-tile rank is an O(chunk) compare per key; 64 keeps the
        # (chunk x chunk) mask at 4K elements (registers, no spills).
        chunk = 64
        tile_rows = max(1, min(32, 8192 // num_bins_pow2))
        # Many bins: a (tiles x bins) table re-read by every program would be MBs of L2
        # traffic, so scan it once in its own launch and use short 256-key tiles.
        prescan = num_bins_pow2 >= 64 and n > 4096
        if prescan:
            tile = 256
        return RoutingConfig(
            tile=tile, chunk=chunk, tile_rows=tile_rows, num_warps=4, prescan=prescan
        )

    def histogram_block(self, n: int) -> int:
        """Keys per program of ``histogram`` (rows of ``n`` keys). Up to 4096 keys one program
        counts a row and writes its bins (no memset launch)."""
        # H200, E = 128: one program as fast on the GPU as a memset and atomics up to 4096 keys
        # (5.2-5.3 µs in a CUDA graph), one launch less on the host; 7.9 against 5.0 at 8192.
        if n <= 4096:
            return max(next_power_of_2(n), 32)
        return min(max(next_power_of_2(n // 128), 256), 4096)

    def scan_block(self, length: int) -> int:
        return min(next_power_of_2(length), 2048)

    def elementwise_block(self, n: int) -> int:
        return min(next_power_of_2(n), 1024)

    def permutation(
        self, num_tokens: int, hidden: int, top_k: int, element_size: int
    ) -> PermutationConfig:
        """gather / scatter: one program per token, one copy at a time over a row block.

        A block covers the whole row when it fits (up to 16K elements: the fp32 top-k
        accumulator then needs 32-64 registers per thread), so every copy's destination is
        looked up once. With few tokens, rows are split so that >= ~1024 programs exist.
        """
        block_h = min(next_power_of_2(hidden), 16384)
        split_h = cdiv(hidden, block_h)
        while num_tokens * split_h < 1024 and block_h > 512:
            block_h //= 2
            split_h = cdiv(hidden, block_h)
        # ~16 bytes per thread per load: 8 warps for an 8K-element bf16 row.
        num_warps = max(4, min(16, block_h * element_size // 2048))
        return PermutationConfig(
            block_h=block_h, split_h=split_h, zero_rows=16, num_warps=num_warps
        )

    def gather_by_rows(self, num_tokens: int, hidden: int, top_k: int, element_size: int) -> bool:
        """Plain gather: one program per output row that reads its token's row (each row of x
        read top_k times, from L2 while x is small) in one launch, instead of token programs that
        read each row once but need an inverse-permutation launch first. For few rows."""
        # H200, H=2048 bf16: 5.0 µs against 7.9 at 128 tokens, 6.6 against 10.8 at 512 (2 MiB).
        return num_tokens * top_k <= 4096 and num_tokens * hidden * element_size <= 2**21

    def scatter_search(self, num_tokens: int, top_k: int) -> int:
        """Plain scatter with few rows: each token program finds its rows by scanning all of
        ``indices`` (this many ids per step) instead of an inverse-permutation launch first; 0
        for that launch (the scan is O(rows) per token)."""
        # H200, top_k 8, H = 2048: one step over all of them up to 1024 rows (4.3 µs at 1024 rows
        # against 5.3 in 256-id steps and 5.6 inverted first); at 2048 rows the inverse is faster
        # on the GPU (6.5 against 7.5 in 2048-id steps), at 4096 more so (7.7 against 11.5).
        rows = num_tokens * top_k
        return next_power_of_2(rows) if rows <= 1024 else 0

    def row_copy(self, hidden: int, element_size: int) -> RowCopyConfig:
        """moe_permute's launch: each token's row of ``hidden`` elements of ``element_size``
        bytes, copied to its slots' rows by one program per hidden block (the whole row up to
        8K elements)."""
        # H200, T = 16384 (docs/performance.md): 16 bytes a thread (32 for 8K bf16 elements: at
        # most 16 warps), 111 µs against 113 with 1K-element blocks of 4 warps at Mixtral's
        # widths, 189 against 193 at Qwen3's, 601 against 629 at DeepSeek-V3's.
        block_h = _whole_row(hidden)
        num_warps = min(max(block_h * element_size // (16 * 32), 4), 16)
        return RowCopyConfig(block_h=block_h, num_warps=num_warps)

    def row_sum(self, hidden: int) -> RowCopyConfig:
        """moe_unpermute's launch: each token's row of ``hidden`` elements, summed in float32
        over its slots' rows by one program per hidden block."""
        # H200, T = 16384, with probs (docs/performance.md): the whole row up to 8K elements in
        # 4 warps, against 1K-element blocks: 101.4 µs against 128.2 at Mixtral's widths (mask
        # form), 165.9 against 173.0 at Qwen3's, 529.7 against 562.4 at DeepSeek-V3's; 8 and 16
        # warps were slower at every width but Mixtral's index form (as fast).
        return RowCopyConfig(block_h=_whole_row(hidden), num_warps=4)

    def token_gmm_scatter(
        self,
        num_tokens: int,
        top_k: int,
        depth: int,
        width: int,
        element_size: int,
        depth_contiguous: bool,
    ) -> TokenGmmConfig | None:
        """gmm_scatter in one launch (activation, GEMM, bias and the top-k sum per (token, column
        block): :mod:`megablocks_triton.kernels.token_gmm`), or None for the tiled path.
        ``depth_contiguous``: the expert matrices hold each output column's ``depth`` values
        contiguously (``trans_b``, transformers' layout)."""
        # H200, bf16, one token, trans_b (docs/performance.md): 9.7 µs against the tiled path's
        # 13.5 at Qwen3 widths, 26.7 against 37.7 at GPT-OSS's, ~100 against 143 at Mixtral's,
        # and 25-45 µs less host time per call. Two tokens and more (each pair reads its expert's
        # matrix itself) and the other layout were slower on the GPU than the tiled path.
        if num_tokens != 1 or not depth_contiguous or depth == 0 or width == 0:
            return None
        # 16 columns per program (the most programs at one token), 32 KiB of the pairs' matrices
        # per step, two steps in flight; 8 warps, but 4 for one or two pairs, whose steps are
        # long rows (Mixtral's: 78 µs against 101 with 8; Qwen3's and GPT-OSS's were faster
        # with 8).
        block_n, k_pad = 16, next_power_of_2(top_k)
        block_k = min(_pow2_at_least(depth, 16), max(32768 // (element_size * block_n * k_pad), 16))
        return TokenGmmConfig(block_n=block_n, block_k=block_k, num_warps=4 if k_pad <= 2 else 8)

    def scatter_wgrad(
        self, num_tokens: int, hidden: int, top_k: int, element_size: int
    ) -> PermutationConfig:
        """scatter_wgrad: each program keeps a (top_k, block_h) fp32 tile of partial dots."""
        # A tile near 8K elements (32 per thread at 8 warps), rows >= 512 elements; few tokens:
        # >= ~4 programs per SM of the H200.
        return permutation_wgrad_shape(
            num_tokens,
            hidden,
            top_k,
            tile_elements=8192,
            min_block_h=512,
            min_programs=512,
            num_warps=(4, 8),
            more_warps_from=8192,
        )

    def gmm(
        self, device: DeviceInfo, tokens: int, n: int, k: int, num_experts: int, dtype: torch.dtype
    ) -> GmmConfig:
        """Tiles of the grouped GEMM ``gmm``: a (tokens, k) times b (E, k, n) on ``device``.

        The tiles of the device's :data:`ARCHS` row, fitted to the problem
        (:func:`fit_gmm_tiles`), then the row's adjustments: e.g. on Hopper, 16-bit, few output
        columns (N <= 1024, e.g. many small experts), 4 stages instead of 3 (one more K step in
        flight; 0.91 vs 0.87 of dense at the qwen3 shape on the H200).
        """
        family = gmm_tile_family(device)
        row = ARCHS[family]
        dclass = dtype_class(dtype)
        experts = max(num_experts, 1)
        cfg = fit_gmm_tiles(
            row.gmm_tiles[("gmm", dclass)],
            max(tokens // experts, 1),
            n,
            k,
            rows_per_expert=None if family == "cpu" else tokens / experts,
        )
        if row.gmm_small_n_stages is not None and dclass == "16bit" and n <= 1024:
            cfg = replace(cfg, num_stages=row.gmm_small_n_stages)
        if row.gmm_few_rows_max_warps is not None and cfg.block_m <= 16:
            cfg = replace(cfg, num_warps=min(cfg.num_warps, row.gmm_few_rows_max_warps))
        if row.gmm_flatten_max_k is not None and dclass == "16bit" and k <= row.gmm_flatten_max_k:
            cfg = replace(cfg, flatten=True)
        return cfg

    def gmm_wgrad(
        self,
        device: DeviceInfo,
        rows: int,
        cols: int,
        tokens: int,
        num_experts: int,
        dtype: torch.dtype,
    ) -> GmmConfig:
        """Tiles of ``gmm_weight_grad``: per expert a (rows x cols) output (a's and grad's
        columns) reduced over the expert's share of ``tokens``."""
        row, dclass = arch_tuning(device), dtype_class(dtype)
        cfg = row.gmm_tiles[("wgrad", dclass)]
        cfg = fit_gmm_tiles(cfg, rows, cols, max(tokens // max(num_experts, 1), 1))
        most = row.warp_specialized_max_tokens_per_expert
        if most is not None and dclass == "16bit" and tokens <= most * max(num_experts, 1):
            cfg = replace(cfg, warp_specialized=True)
        return cfg

    def gmm_wgrad_accumulate(
        self,
        device: DeviceInfo,
        rows: int,
        cols: int,
        tokens: int,
        num_experts: int,
        dtype: torch.dtype,
        out_dtype: torch.dtype,
    ) -> GmmConfig:
        """Tiles of ``gmm_weight_grad_accumulate`` (``gmm_wgrad``'s, adding into an ``out_dtype``
        gradient). Hopper, 16-bit operands: TMA loads, and the epilogue adds the tile to the
        gradient with a TMA reduction, so a program starts its next tile without waiting for the
        gradient's tile to arrive; 32-token steps, 6 stages deep into a 16-bit gradient, 8 deep
        with 128-wide tiles into a float32 one (the reduction stages the tile in shared memory):
        each expert has only ~512-1024 tokens, and the deeper pipeline hides more of each tile's
        start. H200, the qwen3 and dsv3 layers' six weight gradients, against the kernel that
        read, added and wrote the tile (same day, separate runs): 9-20 % faster into bf16,
        17-30 % into float32 (docs/performance.md).

        The warp-specialized kernel adds into a 16-bit gradient with its own TMA reduction
        where it was measured faster: more than 768 and up to 1024 tokens per expert (H200,
        softmax top-k routing, two sessions: 3-6 % faster than this kernel at the qwen3 shapes,
        1024 tokens per expert; at dsv3's 512 it was 1 % faster to 10 % slower, at mixtral's
        4096 5-13 % slower; docs/performance.md)."""
        cfg = self.gmm_wgrad(device, rows, cols, tokens, num_experts, dtype)
        warp_specialized = (
            cfg.warp_specialized
            and dtype_class(out_dtype) == "16bit"
            and tokens > 768 * max(num_experts, 1)
        )
        row = arch_tuning(device)
        if row.accumulate_fp32_max_block_n is not None and dtype_class(out_dtype) == "fp32":
            cfg = replace(cfg, block_n=min(cfg.block_n, row.accumulate_fp32_max_block_n))
        epilogue = row.reduce_epilogue.get(dtype_class(out_dtype))
        if epilogue is not None and dtype_class(dtype) == "16bit":
            block_n = cfg.block_n if epilogue.max_block_n is None else epilogue.max_block_n
            cfg = replace(
                cfg,
                block_n=min(cfg.block_n, block_n),
                block_k=min(cfg.block_k, epilogue.max_block_k),
                use_tma=True,
                reduce_epilogue=True,
                num_stages=epilogue.num_stages,
            )
        return replace(cfg, warp_specialized=warp_specialized)

    def launch_options(self, kernel: str) -> Mapping[str, Any]:
        """Extra keywords for every launch of a ``kernel`` class (see :data:`KERNEL_KINDS`).

        Triton validates them against the active backend's options (an unknown keyword raises
        at launch), so a policy must return only what its backend accepts: e.g.
        ``waves_per_eu`` / ``matrix_instr_nonkdim`` on HIP, never on CUDA. The default is
        portable: nothing.
        """
        return _NO_OPTIONS


def _whole_row(hidden: int) -> int:
    """moe_permute's and moe_unpermute's hidden block: the whole row, up to 8K elements."""
    return min(next_power_of_2(max(hidden, 1)), 8192)


_CONFIGS: LaunchConfigs = LaunchConfigs()
# A scoped policy (use_launch_configs) wins over the process-wide one; context-local so that a
# backend wrapping these kernels for one device never changes another thread's launches.
_SCOPED: ContextVar[LaunchConfigs | None] = ContextVar(
    "megablocks_triton_launch_configs", default=None
)


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
