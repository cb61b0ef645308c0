"""Triton routing, host side: histogram, cumsum, sort, topology, replicate, a fused route,
router top-k.

None of these functions syncs the host: every size they allocate is known from
input shapes. The kernels (:mod:`megablocks_triton.kernels.routing`) are a
stable counting sort of one, two or three launches (its docstring describes them) and one
launch per smaller op. Used with 2**end_bit bins it is ``sort``; with ``num_experts`` bins it
is ``route``, which returns the whole routing metadata in those launches.

The host side prepares each call shape's launches once (grid, scalars, compiled kernel:
:func:`megablocks_triton.launch.bind`), so a call allocates its outputs and launches. This module
holds the counting sort (``sort``, ``route``); the smaller ops are
:mod:`megablocks_triton.routing_ops`, re-exported here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from .config import LaunchConfigs, RoutingConfig, launch_configs
from .kernels.routing import (
    _counting_scatter_kernel,
    _tile_histogram_kernel,
    _tile_scan_kernel,
)
from .launch import bind, cdiv, next_power_of_2, remember
from .routing_ops import MAX_TOPK_EXPERTS as MAX_TOPK_EXPERTS
from .routing_ops import (
    _options,
    exclusive_cumsum,
    histogram,
    inclusive_cumsum,
    replicate,
    replicate_backward,
    router_topk,
    topology,
)
from .routing_ops import router_topk_supports as router_topk_supports

__all__ = [
    "exclusive_cumsum",
    "histogram",
    "inclusive_cumsum",
    "replicate",
    "replicate_backward",
    "route",
    "router_topk",
    "sort",
    "topology",
]

#: Bins up to this many use the fused counting sort; beyond it the per-program
#: (tiles x bins) scan and the in-register bin vector get too large.
MAX_COUNTING_BINS = 1024


# --------------------------------------------------------------------------- counting sort


Meta = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
Routing = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
#: ``run(keys, payload, values, index, meta)``: one prepared counting-sort pass. It writes the
#: sorted keys to ``values`` and the permutation (or, with a payload, the payload permuted) to
#: ``index``, and with ``meta`` the routing metadata (tokens per expert, bins, padded bins).
CountingPass = Callable[
    [torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, Meta | None], None
]
# Per call shape (and launch policy): the prepared launches of sort and route.
_SORT_PLANS: dict[Any, Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]] = {}
_ROUTE_PLANS: dict[Any, Callable[[torch.Tensor], Routing]] = {}


def _counting_plan(
    configs: LaunchConfigs,
    n: int,
    num_bins: int,
    shift: int,
    digit_mask: int | None,
    has_payload: bool,
    block_size: int | None,
) -> CountingPass:
    """One stable counting-sort pass over ``n`` keys, prepared once per call shape: one launch
    (few keys: :func:`_one_launch_plan`), else two (three with the prescan).

    ``digit_mask`` None (route): the key itself is the bin and keys outside [0, num_bins) are
    placed after the others; else the bin is ``(key >> shift) & digit_mask`` (a radix pass).
    ``block_size`` not None: the pass also writes the routing metadata.
    """
    nb = next_power_of_2(num_bins)
    cfg = configs.routing(n, nb)
    opts = _options(configs)
    if (cfg.single and n <= cfg.tile) or cfg.recount:
        return _one_launch_plan(
            configs, cfg, n, num_bins, shift, digit_mask, has_payload, block_size
        )
    num_tiles = cdiv(n, cfg.tile)
    # The (tiles x bins) count table, then one stray count per tile (route only).
    table_size = num_tiles * nb + num_tiles
    use_mask = digit_mask is not None
    dmask = digit_mask if digit_mask is not None else 0
    tile_histogram = bind(
        _tile_histogram_kernel,
        (num_tiles,),
        n,
        num_tiles,
        num_bins,
        shift,
        dmask,
        NB=nb,
        TILE=cfg.tile,
        USE_MASK=use_mask,
        num_warps=cfg.num_warps,
        **opts,
    )
    cols = min(nb, 32)
    tile_scan = bind(
        _tile_scan_kernel, (nb // cols,), num_tiles, NB=nb, COLS=cols, ROWS=64, num_warps=4, **opts
    )
    counting_scatter = bind(
        _counting_scatter_kernel,
        (num_tiles,),
        n,
        num_tiles,
        num_bins,
        shift,
        dmask,
        block_size if block_size is not None else 1,
        NB=nb,
        TILE=cfg.tile,
        CHUNK=cfg.chunk,
        TILE_ROWS=cfg.tile_rows,
        USE_MASK=use_mask,
        HAS_PAYLOAD=has_payload,
        WRITE_META=block_size is not None,
        PRESCANNED=cfg.prescan,
        SINGLE=False,
        num_warps=cfg.num_warps,
        **opts,
    )
    prescan = cfg.prescan
    int32 = torch.int32

    def run(
        keys: torch.Tensor,
        payload: torch.Tensor | None,
        values: torch.Tensor,
        index: torch.Tensor,
        meta: Meta | None,
    ) -> None:
        counts = keys.new_empty(table_size, dtype=int32)
        tile_histogram(keys, counts)
        before = total = counts  # unused unless prescanned
        if prescan:
            before = torch.empty_like(counts)
            total = counts.new_empty(nb)
            tile_scan(counts, before, total)
        tpe, bins, padded = meta if meta is not None else (counts, counts, counts)
        counting_scatter(
            keys,
            payload if payload is not None else keys,
            counts,
            before,
            total,
            values,
            index,
            tpe,
            bins,
            padded,
        )

    return run


def _one_launch_plan(
    configs: LaunchConfigs,
    cfg: RoutingConfig,
    n: int,
    num_bins: int,
    shift: int,
    digit_mask: int | None,
    has_payload: bool,
    block_size: int | None,
) -> CountingPass:
    """:func:`_counting_plan` in one launch and no count table: one program sorting every key
    (``cfg.single``, n <= tile), or one program per tile that counts every key itself
    (``cfg.recount``)."""
    single = cfg.single and n <= cfg.tile
    num_tiles = 1 if single else cdiv(n, cfg.tile)
    place = bind(
        _counting_scatter_kernel,
        (num_tiles,),
        n,
        num_tiles,
        num_bins,
        shift,
        digit_mask if digit_mask is not None else 0,
        block_size if block_size is not None else 1,
        NB=next_power_of_2(num_bins),
        TILE=cfg.tile,
        CHUNK=cfg.chunk,
        TILE_ROWS=cfg.tile_rows,
        USE_MASK=digit_mask is not None,
        HAS_PAYLOAD=has_payload,
        WRITE_META=block_size is not None,
        PRESCANNED=False,
        SINGLE=single,
        RECOUNT=not single,
        COUNT_BLOCK=1 if single else min(next_power_of_2(n), _RECOUNT_BLOCK),
        num_warps=cfg.num_warps,
        **_options(configs),
    )

    def run(
        keys: torch.Tensor,
        payload: torch.Tensor | None,
        values: torch.Tensor,
        index: torch.Tensor,
        meta: Meta | None,
    ) -> None:
        tpe, bins, padded = meta if meta is not None else (keys, keys, keys)
        # No count table: its three pointers are unused (keys stands in).
        place(
            keys,
            payload if payload is not None else keys,
            keys,
            keys,
            keys,
            values,
            index,
            tpe,
            bins,
            padded,
        )

    return run


#: Keys counted per step by a recounting program (one in-register histogram each).
_RECOUNT_BLOCK = 1024


def _route_plan(
    configs: LaunchConfigs, shape: torch.Size, num_experts: int, block_size: int
) -> Callable[[torch.Tensor], Routing]:
    n = shape.numel()
    if n == 0 or num_experts == 0:
        return functools.partial(_route_nothing, num_experts=num_experts)
    if num_experts > MAX_COUNTING_BINS:
        return functools.partial(_route_many, num_experts=num_experts, block_size=block_size)
    counting = _counting_plan(configs, n, num_experts, 0, None, False, block_size)
    flat = len(shape) == 1
    int32 = torch.int32
    # Five allocations: one split five ways would be cheaper, but a custom op's outputs may not
    # share storage (torch.compile and torch.library.opcheck rely on it).

    def run(top_experts: torch.Tensor) -> Routing:
        keys = top_experts if flat else top_experts.reshape(-1)
        bin_ids = torch.empty_like(keys)
        indices = torch.empty_like(keys)
        tpe = keys.new_empty(num_experts, dtype=int32)
        bins = tpe.new_empty(num_experts)
        padded = tpe.new_empty(num_experts)
        counting(keys, None, bin_ids, indices, (tpe, bins, padded))
        return indices, bin_ids, tpe, bins, padded

    return run


def _route_nothing(top_experts: torch.Tensor, num_experts: int) -> Routing:
    keys = top_experts.reshape(-1)
    tpe = torch.zeros(num_experts, dtype=torch.int32, device=keys.device)
    return keys.clone(), keys.clone(), tpe, tpe.clone(), tpe.clone()


def _route_many(top_experts: torch.Tensor, num_experts: int, block_size: int) -> Routing:
    # Too many bins for the in-register scan: documented torch fallback
    # (stable radix sort by torch + our sync-free histogram and cumsum).
    # Ids out of range sort last, as in the counting sort. Compared as int64: num_experts
    # may not fit the ids' dtype (int16 ids, 32768 experts), and torch would wrap it.
    keys = top_experts.reshape(-1)
    wide = keys.long()
    valid = (wide >= 0) & (wide < num_experts)
    _, order = torch.sort(torch.where(valid, wide, num_experts), stable=True)
    tpe = histogram(keys, num_experts)
    rounded = (tpe + block_size - 1) // block_size * block_size
    return (
        order.to(keys.dtype),
        keys[order],
        tpe,
        inclusive_cumsum(tpe, 0),
        inclusive_cumsum(rounded, 0),
    )


def route(top_experts: torch.Tensor, num_experts: int, block_size: int) -> Routing:
    """All routing metadata of a dropless MoE layer in one counting-sort pass (one launch for
    up to a few thousand ids, else two), no host sync.

    Returns ``(indices, bin_ids, tokens_per_expert, bins, padded_bins)``:
    the same order as ``torch.sort(top_experts, stable=True)`` (indices and
    bin_ids in top_experts' dtype), the per-expert counts, their inclusive
    cumsum, and the inclusive cumsum of the counts rounded up to block_size
    (the three int32, shape (num_experts,)). Expert ids outside
    [0, num_experts) are not counted and sort after every valid id, in input
    order (bin_ids keeps them as they are): indices is always a permutation.
    """
    configs = launch_configs()
    key = (
        top_experts.shape,
        top_experts.dtype,
        top_experts.device,
        num_experts,
        block_size,
        configs,
    )
    plan = _ROUTE_PLANS.get(key)
    if plan is None:
        shape = top_experts.shape
        plan = remember(
            _ROUTE_PLANS, key, _route_plan(configs, shape, int(num_experts), int(block_size))
        )
    return plan(top_experts)


def _sort_plan(
    configs: LaunchConfigs, n: int, end_bit: int | None
) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    if n == 0:
        return _sort_nothing
    if end_bit is None or end_bit > 16:
        return _torch_sort
    if end_bit == 0:  # every key compares equal: identity permutation
        return _sort_identity
    if end_bit <= 10:
        one_pass = _counting_plan(configs, n, 1 << end_bit, 0, (1 << end_bit) - 1, False, None)

        def sort_one_pass(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            values = torch.empty_like(x)
            index = torch.empty_like(x)
            one_pass(x, None, values, index, None)
            return values, index

        return sort_one_pass
    lo = end_bit // 2
    hi = end_bit - lo
    low_pass = _counting_plan(configs, n, 1 << lo, 0, (1 << lo) - 1, False, None)
    high_pass = _counting_plan(configs, n, 1 << hi, lo, (1 << hi) - 1, True, None)

    def two_passes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        keys = torch.empty_like(x)
        order = torch.empty_like(x)
        low_pass(x, None, keys, order, None)
        values = torch.empty_like(x)
        index = torch.empty_like(x)
        high_pass(keys, order, values, index, None)
        return values, index

    return two_passes


def _sort_nothing(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x.clone(), x.clone()


def _torch_sort(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    values, order = torch.sort(x, stable=True)
    return values, order.to(x.dtype)


def _sort_identity(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x.clone(), torch.arange(x.numel(), dtype=x.dtype, device=x.device)


def sort(x: torch.Tensor, end_bit: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Stable ascending sort of a 1-D int tensor over bits [0, end_bit).

    end_bit <= 10: one counting-sort pass (one launch for up to a few thousand keys,
    see :class:`~megablocks_triton.config.RoutingConfig`, else two). 10 < end_bit <= 16:
    two stable LSD radix passes (twice that). end_bit None or > 16: falls
    back to ``torch.sort(stable=True)`` (a full-width sort; equal to the
    end_bit sort because the contract keeps keys inside [0, 2**end_bit)).
    Both outputs have x's dtype.
    """
    configs = launch_configs()
    key = (x.shape, x.dtype, x.device, end_bit, configs)
    plan = _SORT_PLANS.get(key)
    if plan is None:
        bits = None if end_bit is None else int(end_bit)
        plan = remember(_SORT_PLANS, key, _sort_plan(configs, x.numel(), bits))
    return plan(x)
