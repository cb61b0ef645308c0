"""The launch shapes the launch policy (:class:`megablocks_triton.config.LaunchConfigs`) returns:
:class:`RoutingConfig`, :class:`PermutationConfig`, :class:`TokenGmmConfig`, :class:`GmmConfig`,
and :func:`dtype_class`,
the key of the grouped-GEMM tile tables. :mod:`megablocks_triton.config` re-exports them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
    single: bool = False
    """One program sorts every key (n <= tile): it counts them itself, so one launch and no
    count table (few keys, e.g. decode)."""
    recount: bool = False
    """One program per tile, each counting every key itself (a few in-register histograms)
    instead of reading a count table that a first launch wrote: one launch, no table. For a
    few thousand keys (each program reads them all)."""


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


@dataclass(frozen=True)
class RowCopyConfig:
    """moe_permute's and moe_unpermute's launch shape: one program per token and hidden block."""

    block_h: int
    """Hidden elements per program (power of two)."""
    num_warps: int


@dataclass(frozen=True)
class TokenGmmConfig:
    """gmm_scatter's few-token launch shape (one program per token and column block)."""

    block_n: int
    """Output columns per program."""
    block_k: int
    """Reduction elements per inner-loop step."""
    num_warps: int


@dataclass(frozen=True)
class GmmConfig:
    """Grouped-GEMM tile shape and launch parameters.

    For ``gmm``: BLOCK_M tiles the rows of ``a``/output, BLOCK_N the output columns and BLOCK_K the
    reduction (``a``'s columns). For ``gmm_weight_grad``: BLOCK_M tiles ``a``'s columns (output
    rows), BLOCK_N ``grad``'s columns and BLOCK_K the tokens of the group (the reduction).
    GROUP_M: M-tiles swizzled together inside one expert so neighbouring programs share B tiles.
    programs_per_sm: persistent grid = programs_per_sm * num_sms (2 can hide the per-tile
    prologue/epilogue when occupancy allows).
    use_tma: load A/B tiles through TMA tensor descriptors (NVIDIA sm90+, or the interpreter):
    the forward ops; of the weight gradients only the accumulating one, whose epilogue then also
    reads and writes the gradient it adds to through a descriptor (16-bit gradients; any
    gradient with ``reduce_epilogue``, which only writes it). Silently
    falls back to the portable path when the device or the operands' alignment (16-byte
    base/strides, unit inner stride) do not allow it.
    flatten: forward only; the persistent tile loop and the K loop are pipelined as one loop
    (``tl.range(flatten=True)``), so a tile's first loads are in flight during the previous
    tile's epilogue: pays when the K loop is short.
    reduce_epilogue: the accumulating weight gradient with ``use_tma`` on NVIDIA hardware (not
    the interpreter): the tile is rounded to the gradient's dtype and added to it by a TMA
    reduction, asynchronous, instead of being read, added in float32 and written back.
    warp_specialized: a weight gradient on Hopper (sm_90): the policy's choice of the
    warp-specialized Gluon kernel of :mod:`megablocks_triton.hopper_wgrad` (its own 128x256x64
    tiles, 3 stages; a loader warp running ahead across tiles) for these shapes. It is read by the
    shape predicate of the declared variant ``triton/gluon-hopper``
    (:func:`megablocks_triton.gmm.warp_specialized_problem`), so the ranking, ``explain`` and the
    kit see it; the plain kernels run the Triton kernel with this config's tiles. The default policy
    sets it for a new gradient (``gmm_wgrad``) of up to 1024 tokens per expert, and for the
    accumulating one into a 16-bit gradient of more than 768 and up to 1024.
    """

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    programs_per_sm: int = 1
    use_tma: bool = False
    flatten: bool = False
    reduce_epilogue: bool = False
    warp_specialized: bool = False


def dtype_class(dtype: torch.dtype) -> str:
    """``"fp32"``, ``"16bit"`` or ``"fp8"`` (8-bit operands of the scaled GEMMs): the
    grouped-GEMM tile tables are keyed by it."""
    if dtype == torch.float32:
        return "fp32"
    return "fp8" if dtype.itemsize == 1 else "16bit"
