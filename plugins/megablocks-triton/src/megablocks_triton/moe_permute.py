"""Triton kernels for the Megatron-Core / Transformer Engine permutation ops (``moe_permute``).

The row map is the contract's format (``megablocks_core.contracts.ROW_MAP_FORMAT``): int32
(tokens, slots), each slot's permuted row or -1. So a row map written here is read by any
backend's ``moe_unpermute``, and ours reads theirs.

* ``moe_permute_map``: a stable counting sort of the slots by expert, in tiles read once
  each: a per-tile histogram (``(tiles, experts)`` counts), a scan down the tiles, then each
  tile's program derives the padded starts from the totals and writes each of its slots' rows
  (its rank among the expert's slots: earlier tiles, then a cumsum down the tile's tokens in
  the mask form, a compare matrix in the index form; ids outside [0, experts) get -1). Every
  entry is written (no memset) and no size goes through the host or a torch op; a map that
  one tile holds (a few tokens) takes one launch. Past ``MAX_MAP_EXPERTS`` experts the tiles'
  counts would outgrow the map, and one program per expert scans the map in token order
  instead (a count, the starts in torch, then the ranks).
* ``moe_permute``: one program per token (and hidden block) reads its row once and writes it
  to each of its slots' rows, marking each row it writes in a byte per output row; the rows no
  slot names (padding, rows past the real count: known only through the row map) are then
  zeroed by one pass that reads those bytes, instead of zeroing the whole output first.
* ``moe_unpermute``: one program per token (and hidden block) sums its slots' rows in float32
  and writes its row once; ``moe_unpermute_wgrad`` dots them with the token's gradient.
* ``moe_sort_chunks``: each output row's source row (a few sync-free torch ops over the chunk
  sizes), then a row copy.

Past ``COMPACT_ABOVE_SLOTS`` slots (the mask form: one slot per expert, only top_k used), a
pre-pass (``_compact_slots_kernel``) first lists each token's valid slots in order, so that the
per-token kernels loop over those few instead of loading every slot one by one; the sums keep
their slot order.

No kernel reads a size on the host. Every row map entry is range-checked before it is used
as an address (bad data writes and reads nothing), and offsets are int64 (no size limit of
their own), but for the index-form map's tiles, the counting sort's (int32: the plugin declares
its limit on the routing map's entries).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

from .config import launch_configs
from .kernels.routing import _digits, _tile_histogram_kernel, _tile_scan_kernel
from .launch import BoundLaunch, bind, cdiv, launch, next_power_of_2, remember

__all__ = [
    "moe_permute",
    "moe_permute_map",
    "moe_permute_probs",
    "moe_sort_chunks",
    "moe_unpermute",
    "moe_unpermute_wgrad",
]

#: Routing-map entries one expert's program reads per step.
SCAN_BLOCK = 256
#: Widest hidden block one program handles (wider rows take several programs).
MAX_HIDDEN_BLOCK = 1024
#: Row maps with more slots than this go through the compaction pre-pass first.
COMPACT_ABOVE_SLOTS = 16
#: Widest slot chunk the pre-pass reads per step, and its tile (tokens x slots) size.
COMPACT_BLOCK_S = 128
COMPACT_TILE = 2048
#: Experts up to this many take the tiled map build. Its (tiles, experts) count table holds 4
#: bytes per expert per tile of MASK_MAP_TILE / experts tokens: past this it would outgrow the
#: mask itself, and the per-expert scans take over.
MAX_MAP_EXPERTS = 1024
#: Mask entries (tokens x experts) in one tile of the tiled map build.
MASK_MAP_TILE = 4096
#: An index-form map of at most this many slots is mapped by one program in one launch (a
#: mask-form map is when one tile of MASK_MAP_TILE entries holds every token).
SINGLE_MAP_TILE = 256
#: The count table's scan: columns per program, table entries per step, warps (H200, the map
#: build from a CUDA graph: 19.0 against 28.3 µs at Qwen3's mask, 31.9 against 54.9 at
#: DeepSeek-V3's, with the mask tiles' warps below; 32 columns and 64 tiles a step before).
SCAN_COLS = 4
SCAN_STEP = 4096
SCAN_WARPS = 4
#: Output rows per program of the pass that zeroes the rows no slot names, and its tile.
ZERO_ROWS = 32
ZERO_TILE = 4096


def _options() -> dict[str, object]:
    return dict(launch_configs().launch_options("permutation"))


def _hidden_block(hidden: int) -> int:
    return min(next_power_of_2(max(hidden, 1)), MAX_HIDDEN_BLOCK)


@triton.jit
def _slot_hits(routing_ptr, t, e, tokens, slots, num_experts, IS_MASK: tl.constexpr):
    """For the tokens t of one block: whether each routes to expert e, and its flat slot.

    Mask form: slot (t, e) of column e. Index form: the token's slots t * slots + j, flattened
    into the block (t then holds flat slot numbers)."""
    if IS_MASK:
        valid = t < tokens
        flat = t.to(tl.int64) * slots + e
        hit = tl.load(routing_ptr + flat, mask=valid, other=0) != 0
    else:
        valid = t < tokens * slots
        flat = t.to(tl.int64)
        ids = tl.load(routing_ptr + flat, mask=valid, other=-1)
        hit = ids == e
    return hit & valid, flat, valid


@triton.jit
def _slot_row(row_map_ptr, cols_ptr, t, i, slots, rows, COMPACT: tl.constexpr):
    """Token t's i-th slot to visit (its i-th listed valid slot when compacted), that slot's row
    in the row map (int64), and whether the row lies in [0, rows)."""
    j = tl.load(cols_ptr + t * slots + i) if COMPACT else i
    row = tl.load(row_map_ptr + t * slots + j).to(tl.int64)
    return j, row, (row >= 0) & (row < rows)


@triton.jit
def _count_kernel(
    routing_ptr,
    counts_ptr,
    tokens,
    slots,
    num_experts,
    IS_MASK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    e = tl.program_id(0)
    n = tokens if IS_MASK else tokens * slots
    total = tl.zeros((), dtype=tl.int32)
    for start in range(0, n, BLOCK):
        t = start + tl.arange(0, BLOCK)
        hit, _, _ = _slot_hits(routing_ptr, t, e, tokens, slots, num_experts, IS_MASK)
        total += tl.sum(hit.to(tl.int32), axis=0)
    tl.store(counts_ptr + e, total)


@triton.jit
def _rows_kernel(
    routing_ptr,
    starts_ptr,
    row_map_ptr,
    tokens,
    slots,
    num_experts,
    num_out,
    IS_MASK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    e = tl.program_id(0)
    start_row = tl.load(starts_ptr + e)
    n = tokens if IS_MASK else tokens * slots
    seen = tl.zeros((), dtype=tl.int64)
    for start in range(0, n, BLOCK):
        t = start + tl.arange(0, BLOCK)
        hit, flat, valid = _slot_hits(routing_ptr, t, e, tokens, slots, num_experts, IS_MASK)
        hits = hit.to(tl.int32)
        rank = seen + tl.cumsum(hits, axis=0) - 1
        row = start_row + rank
        kept = hit & (row < num_out)
        dest = tl.where(kept, row, -1).to(tl.int32)
        if IS_MASK:
            tl.store(row_map_ptr + flat, dest, mask=valid)  # the whole column is this program's
        else:
            tl.store(row_map_ptr + flat, dest, mask=hit)
            if e == 0:  # ids that name no expert: written once, by program 0
                ids = tl.load(routing_ptr + flat, mask=valid, other=0)
                nowhere = valid & ((ids < 0) | (ids >= num_experts))
                tl.store(row_map_ptr + flat, tl.full(flat.shape, -1, tl.int32), mask=nowhere)
        seen += tl.sum(hits, axis=0)


@triton.jit
def _scanned(total_ptr, before_ptr, tile, NB: tl.constexpr):
    """Every expert's slots, and its slots in the tiles before this one (the scan's output)."""
    e = tl.arange(0, NB)
    return tl.load(total_ptr + e), tl.load(before_ptr + tile * NB + e)


@triton.jit
def _tile_base(total, before, tile, counts_ptr, num_out, num_experts, align, NB: tl.constexpr):
    """The row of this tile's first slot of each expert: the expert's first row (after the
    earlier experts' rows, each padded to ``align``) plus its slots in earlier tiles. Tile 0
    also writes moe_permute_map's counts, the rows each expert owns below num_out."""
    padded = (total + align - 1) // align * align
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    if tile == 0:
        e = tl.arange(0, NB)
        owned = tl.minimum(ends, num_out) - tl.minimum(starts, num_out)
        tl.store(counts_ptr + e, owned, mask=e < num_experts)
    return starts + before


@triton.jit
def _mask_tile(mask_ptr, tile, tokens, num_experts, NB: tl.constexpr, BT: tl.constexpr):
    """One tile of a mask routing map: BT tokens x every expert (hits, flat slots, inside).
    Flat slots in int32: the plugin declines maps past INT32_ELEMENTS entries."""
    t = tile * BT + tl.arange(0, BT)
    e = tl.arange(0, NB)
    inside = (t < tokens)[:, None] & (e < num_experts)[None, :]
    flat = t[:, None] * num_experts + e[None, :]
    hit = (tl.load(mask_ptr + flat, mask=inside, other=0) != 0) & inside
    return hit, flat, inside


@triton.jit
def _mask_histogram_kernel(
    mask_ptr, table_ptr, tokens, num_experts, NB: tl.constexpr, BT: tl.constexpr
):
    """Each tile's slots per expert, a row of the (tiles, NB) count table."""
    tile = tl.program_id(0)
    hit, _, _ = _mask_tile(mask_ptr, tile, tokens, num_experts, NB, BT)
    tl.store(table_ptr + tile * NB + tl.arange(0, NB), tl.sum(hit.to(tl.int32), axis=0))


@triton.jit
def _mask_rows_kernel(
    mask_ptr,
    before_ptr,
    total_ptr,
    row_map_ptr,
    counts_ptr,
    tokens,
    num_experts,
    num_out,
    align,
    NB: tl.constexpr,
    BT: tl.constexpr,
    SINGLE: tl.constexpr,
):
    """One tile's row map entries: an expert's slots take its rows in token order, after its
    slots in earlier tiles (``before``, from the scan). SINGLE: one tile holds every token and
    counts them itself (no table). Program 0 also writes the counts."""
    tile = tl.program_id(0)
    hit, flat, inside = _mask_tile(mask_ptr, tile, tokens, num_experts, NB, BT)
    hits = hit.to(tl.int32)
    if SINGLE:
        total, before = tl.sum(hits, axis=0), tl.zeros((NB,), dtype=tl.int32)
    else:
        total, before = _scanned(total_ptr, before_ptr, tile, NB)
    base = _tile_base(total, before, tile, counts_ptr, num_out, num_experts, align, NB)
    row = base[None, :] + tl.cumsum(hits, axis=0) - 1
    tl.store(row_map_ptr + flat, tl.where(hit & (row < num_out), row, -1), mask=inside)


@triton.jit
def _index_rows_kernel(
    ids_ptr,
    before_ptr,
    total_ptr,
    row_map_ptr,
    counts_ptr,
    n,
    num_experts,
    num_out,
    align,
    NB: tl.constexpr,
    TILE: tl.constexpr,
    CHUNK: tl.constexpr,
    SINGLE: tl.constexpr,
):
    """One tile of an index routing map (flat slots, token-major): each slot's rank among the
    expert's slots, from the earlier tiles (``before``) and the earlier slots of this tile
    (CHUNK at a time: a compare matrix within the chunk, a histogram across chunks). SINGLE:
    one tile holds every slot and counts them itself. Ids outside [0, num_experts) get -1."""
    tile = tl.program_id(0)
    if SINGLE:  # names of their own: the loop below rebinds its (CHUNK,) ones
        every = tl.arange(0, TILE)
        every_id = tl.load(ids_ptr + every, mask=every < n, other=0)
        every_expert, listed = _digits(every_id, every < n, num_experts, 0, 0, False)
        total = tl.histogram(every_expert, NB, mask=listed)
        before = tl.zeros((NB,), dtype=tl.int32)
    else:
        total, before = _scanned(total_ptr, before_ptr, tile, NB)
    base = _tile_base(total, before, tile, counts_ptr, num_out, num_experts, align, NB)
    lane = tl.arange(0, CHUNK)
    for c in range(0, TILE, CHUNK):
        flat = tile * TILE + c + lane  # int32, as in the counting sort's tiles
        inb = flat < n
        raw = tl.load(ids_ptr + flat, mask=inb, other=0)
        expert, valid = _digits(raw, inb, num_experts, 0, 0, False)
        same = (expert[:, None] == expert[None, :]) & (lane[None, :] < lane[:, None])
        rank = tl.sum((same & valid[None, :]).to(tl.int32), axis=1)
        row = tl.gather(base, expert, 0) + rank
        tl.store(row_map_ptr + flat, tl.where(valid & (row < num_out), row, -1), mask=inb)
        base += tl.histogram(expert, NB, mask=valid)


# The forward ops (the map build, the permute, its probs, the unpermute) keep their launches
# prepared per call shape, as permutation.py's gather and scatter do: a repeated call allocates
# its outputs and launches, with no launch parameter to work out (Megatron's permutation at
# Mixtral's widths is host-bound: docs/performance.md). Each key holds every input's shape and
# dtype and the routing's or rows' device, which decide every scalar and tensor dtype of the
# launches, and the launch configs in force.
_MAP_PLANS: dict[Any, Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]] = {}
_PERMUTE_PLANS: dict[Any, Callable[..., torch.Tensor]] = {}
_PROBS_PLANS: dict[Any, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {}
_UNPERMUTE_PLANS: dict[Any, Callable[..., torch.Tensor]] = {}


def _aligned(n: int) -> int:
    """``n`` int32 entries rounded up to 16 bytes: scratch carved from one allocation keeps
    every piece's base 16-byte aligned (the launches' pinned specialisation)."""
    return -(-n // 4) * 4


def _scan(tiles: int, nb: int) -> BoundLaunch:
    """The scan down a (tiles, nb) count table: (table, before, total) -> each tile's earlier
    slots per expert, and every slot per expert."""
    cols, rows, warps = _scan_shape(tiles, nb)
    return bind(
        _tile_scan_kernel,
        (nb // cols,),
        tiles,
        NB=nb,
        COLS=cols,
        ROWS=rows,
        num_warps=warps,
        **_options(),
    )


def _scan_shape(tiles: int, nb: int) -> tuple[int, int, int]:
    """(COLS, ROWS, num_warps) of the scan down a (tiles, nb) count table: few columns per
    program and most of the tiles per step (each step is a dependent load, scan and store)."""
    cols = min(nb, SCAN_COLS)
    return cols, min(next_power_of_2(tiles), max(SCAN_STEP // cols, 1)), SCAN_WARPS


def _mask_map_warps(nb: int) -> int:
    """Warps of the mask map's tile programs: 8 for tall tiles of a few experts (Mixtral's 8:
    12.6 against 14.4 µs with 4), 4 for many experts (Qwen3's 128, DeepSeek-V3's 256)."""
    return 8 if nb <= 16 else 4


def _tiled_map(
    count: BoundLaunch | None,
    scan: BoundLaunch | None,
    rows: BoundLaunch,
    table_size: int,
    scanned_size: int,
    nb: int,
    shape: tuple[int, int],
    num_experts: int,
) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """The map build of one call shape: the tiles' count table (``count``: routing -> table),
    its scan, then the rows kernel (routing, before, total -> row map, counts). Without
    ``count`` one tile holds every slot and counts them itself (no table)."""
    int32 = torch.int32

    def build(routing: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        device = routing.device
        row_map = torch.empty(shape, dtype=int32, device=device)
        counts = torch.empty(num_experts, dtype=int32, device=device)
        if count is None or scan is None:
            rows(routing, row_map, row_map, row_map, counts)  # unread placeholders
            return row_map, counts
        # The table, the scan's (tiles, nb) "before" and its nb totals: one allocation.
        scratch = torch.empty(table_size + scanned_size + nb, dtype=int32, device=device)
        table = scratch[:table_size]
        before = scratch[table_size : table_size + scanned_size]
        total = scratch[table_size + scanned_size :]
        count(routing, table)
        scan(table, before, total)
        rows(routing, before, total, row_map, counts)
        return row_map, counts

    return build


def _mask_map(
    tokens: int, experts: int, num_out: int, align: int
) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    nb = next_power_of_2(experts)
    bt = min(max(MASK_MAP_TILE // nb, 1), next_power_of_2(tokens))
    tiles = cdiv(tokens, bt)
    kw = {"NB": nb, "BT": bt, "num_warps": _mask_map_warps(nb), **_options()}
    rows = bind(
        _mask_rows_kernel, (tiles,), tokens, experts, num_out, align, SINGLE=tiles == 1, **kw
    )
    if tiles == 1:
        return _tiled_map(None, None, rows, 0, 0, nb, (tokens, experts), experts)
    count = bind(_mask_histogram_kernel, (tiles,), tokens, experts, **kw)
    size = _aligned(tiles * nb)
    return _tiled_map(count, _scan(tiles, nb), rows, size, size, nb, (tokens, experts), experts)


def _index_map(
    shape: tuple[int, int], num_experts: int, num_out: int, align: int
) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    n = shape[0] * shape[1]
    nb = next_power_of_2(num_experts)
    single = n <= SINGLE_MAP_TILE
    cfg = launch_configs().routing(n, nb)  # the counting sort's tiles
    # A tile of at least nb slots keeps the (tiles, nb) count table below the map's size.
    tile = next_power_of_2(max(n, cfg.chunk)) if single else max(cfg.tile, nb)
    tiles = cdiv(n, tile)
    kw = {"num_warps": cfg.num_warps, **_options()}
    rows = bind(
        _index_rows_kernel,
        (tiles,),
        n,
        num_experts,
        num_out,
        align,
        NB=nb,
        TILE=tile,
        CHUNK=min(cfg.chunk, tile),
        SINGLE=single,
        **kw,
    )
    if single:
        return _tiled_map(None, None, rows, 0, 0, nb, shape, num_experts)
    # The counting sort's tile histogram; it also counts each tile's ids outside
    # [0, num_experts) after the table (unread here).
    count = bind(
        _tile_histogram_kernel,
        (tiles,),
        n,
        tiles,
        num_experts,
        0,
        0,
        NB=nb,
        TILE=tile,
        USE_MASK=False,
        **kw,
    )
    table, scanned = _aligned(tiles * nb + tiles), _aligned(tiles * nb)
    return _tiled_map(count, _scan(tiles, nb), rows, table, scanned, nb, shape, num_experts)


def _map_plan(
    shape: tuple[int, int], is_mask: bool, num_experts: int, num_out: int, align: int
) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    tokens, slots = shape
    int32 = torch.int32
    if tokens * slots == 0:

        def empty(routing: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            device = routing.device
            row_map = torch.empty(shape, dtype=int32, device=device)
            return row_map, torch.zeros(num_experts, dtype=int32, device=device)

        return empty
    if num_experts > MAX_MAP_EXPERTS:

        def per_expert(routing: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            row_map = torch.empty(shape, dtype=int32, device=routing.device)
            args = (routing, is_mask, num_experts, row_map, num_out, align)
            return row_map, _map_per_expert(*args)

        return per_expert
    if is_mask:
        return _mask_map(tokens, slots, num_out, align)
    return _index_map(shape, num_experts, num_out, align)


def moe_permute_map(
    routing_map: torch.Tensor, num_experts: int, num_out_tokens: int, align_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    is_mask = routing_map.dtype == torch.bool
    configs = launch_configs()
    key = (
        routing_map.shape,
        routing_map.dtype,
        routing_map.device,
        num_experts,
        num_out_tokens,
        align_size,
        configs,
    )
    plan = _MAP_PLANS.get(key)
    if plan is None:
        tokens, slots = routing_map.shape
        made = _map_plan((tokens, slots), is_mask, num_experts, num_out_tokens, align_size)
        plan = remember(_MAP_PLANS, key, made)
    # Bools are read as bytes (Triton has no pointer to bool in every version).
    return plan(routing_map.view(torch.uint8) if is_mask else routing_map)


def _map_per_expert(
    routing: torch.Tensor,
    is_mask: bool,
    num_experts: int,
    row_map: torch.Tensor,
    num_out_tokens: int,
    align_size: int,
) -> torch.Tensor:
    """moe_permute_map's row map for many experts, and its counts: one program per expert scans
    the map in token order, twice (a count, then the ranks); the padded starts in a few torch
    ops on the device."""
    tokens, slots = routing.shape
    counts = torch.empty(num_experts, dtype=torch.int32, device=routing.device)
    scalars = (tokens, slots, num_experts)
    kw = {"IS_MASK": is_mask, "BLOCK": SCAN_BLOCK, **_options()}
    launch(_count_kernel, (num_experts,), routing, counts, *scalars, **kw)
    # Padded ends and starts: a few per-expert ops on the device (int64: no wrap).
    padded = (counts.long() + align_size - 1) // align_size * align_size
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    launch(_rows_kernel, (num_experts,), routing, starts, row_map, *scalars, num_out_tokens, **kw)
    owned = ends.clamp(max=num_out_tokens) - starts.clamp(max=num_out_tokens)
    return owned.to(torch.int32)


@triton.jit
def _compact_slots_kernel(
    row_map_ptr,
    cols_ptr,
    count_ptr,
    tokens,
    slots,
    rows,
    BLOCK_T: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """For each token of the block: the slots j whose entry is a row in [0, rows), ascending,
    in cols[t, :count[t]] (the rest of cols is not written), and their number in count[t]."""
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    in_t = t < tokens
    seen = tl.zeros((BLOCK_T,), dtype=tl.int32)
    for s0 in range(0, slots, BLOCK_S):
        j = s0 + tl.arange(0, BLOCK_S)
        inside = in_t[:, None] & (j < slots)[None, :]
        base = t[:, None] * slots
        entry = tl.load(row_map_ptr + base + j[None, :], mask=inside, other=-1).to(tl.int64)
        hit = inside & (entry >= 0) & (entry < rows)
        hits = hit.to(tl.int32)
        pos = seen[:, None] + tl.cumsum(hits, axis=1) - 1
        cols = tl.broadcast_to(j[None, :], (BLOCK_T, BLOCK_S)).to(tl.int32)
        tl.store(cols_ptr + base + tl.where(hit, pos, 0), cols, mask=hit)
        seen += tl.sum(hits, axis=1)
    tl.store(count_ptr + t, seen, mask=in_t)


def _compaction(
    tokens: int, slots: int, rows: int
) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None:
    """The pre-pass of row maps with many slots (row map -> cols, count), else None."""
    if slots <= COMPACT_ABOVE_SLOTS:
        return None
    block_s = min(next_power_of_2(slots), COMPACT_BLOCK_S)
    block_t = max(COMPACT_TILE // block_s, 1)
    listing = bind(
        _compact_slots_kernel,
        (cdiv(tokens, block_t),),
        tokens,
        slots,
        rows,
        BLOCK_T=block_t,
        BLOCK_S=block_s,
        **_options(),
    )
    int32 = torch.int32
    listed = _aligned(tokens * slots)

    def compact(row_map: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        both = torch.empty(listed + tokens, dtype=int32, device=row_map.device)
        cols, count = both[: tokens * slots].view(tokens, slots), both[listed:]
        listing(row_map, cols, count)
        return cols, count

    return compact


def _compact_slots(row_map: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """The pre-pass's (cols, count) where the row map has many slots, else two unread
    placeholders; and whether it ran (the kernels' COMPACT)."""
    tokens, slots = row_map.shape
    compact = _compaction(tokens, slots, rows)
    if compact is None:
        return row_map, row_map, False
    return (*compact(row_map), True)


@triton.jit
def _permute_kernel(
    x_ptr,
    row_map_ptr,
    probs_ptr,
    out_ptr,
    named_ptr,
    cols_ptr,
    count_ptr,
    slots,
    hidden,
    num_out,
    HAS_PROBS: tl.constexpr,
    COMPACT: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Token t's row to each of its slots' rows; the first hidden block's program also marks
    each row it writes in ``named`` (one byte per output row)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    in_row = h < hidden
    marks = tl.program_id(1) == 0
    row = tl.load(x_ptr + t * hidden + h, mask=in_row, other=0.0)
    n = tl.load(count_ptr + t) if COMPACT else slots
    for i in range(n):
        j, dest, ok = _slot_row(row_map_ptr, cols_ptr, t, i, slots, num_out, COMPACT)
        if ok:
            value = row
            if HAS_PROBS:
                scale = tl.load(probs_ptr + t * slots + j).to(tl.float32)
                value = (row.to(tl.float32) * scale).to(row.dtype)
            tl.store(out_ptr + dest * hidden + h, value, mask=in_row)
            if marks:
                tl.store(named_ptr + dest, tl.full((), 1, tl.uint8))


@triton.jit
def _zero_unnamed_kernel(
    out_ptr, named_ptr, rows, hidden, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr
):
    """Zero the rows of one block that no slot named; a block whose rows are all named (every
    row of a dropless map without padding) reads its marks and writes nothing."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    unnamed = (r < rows) & (tl.load(named_ptr + r, mask=r < rows, other=1) == 0)
    if tl.max(unnamed.to(tl.int32), axis=0) > 0:
        zeros = tl.zeros((BLOCK_R, BLOCK_H), dtype=out_ptr.dtype.element_ty)
        for h0 in range(0, hidden, BLOCK_H):
            h = h0 + tl.arange(0, BLOCK_H)
            at = out_ptr + r[:, None] * hidden + h[None, :]
            tl.store(at, zeros, mask=unnamed[:, None] & (h < hidden)[None, :])


def _permute_plan(
    x_shape: tuple[int, int],
    dtype: torch.dtype,
    slots: int,
    has_probs: bool,
    num_out: int,
    element_size: int,
) -> Callable[..., torch.Tensor]:
    tokens, hidden = x_shape
    if tokens == 0 or hidden == 0 or num_out == 0:
        return lambda x, row_map, probs: torch.zeros(num_out, hidden, dtype=dtype, device=x.device)
    compact = _compaction(tokens, slots, num_out)
    shape = launch_configs().row_copy(hidden, element_size)
    copy = bind(
        _permute_kernel,
        (tokens, cdiv(hidden, shape.block_h)),
        slots,
        hidden,
        num_out,
        HAS_PROBS=has_probs,
        COMPACT=compact is not None,
        BLOCK_H=shape.block_h,
        num_warps=shape.num_warps,
        **_options(),
    )
    zero = bind(
        _zero_unnamed_kernel,
        (cdiv(num_out, ZERO_ROWS),),
        num_out,
        hidden,
        BLOCK_R=ZERO_ROWS,
        BLOCK_H=min(next_power_of_2(hidden), ZERO_TILE // ZERO_ROWS),
        **_options(),
    )
    uint8 = torch.uint8

    def permute(x: torch.Tensor, row_map: torch.Tensor, probs: torch.Tensor | None) -> torch.Tensor:
        # Only the rows no slot names are zeroed, after the copies: not the whole output first.
        out = torch.empty(num_out, hidden, dtype=dtype, device=x.device)
        named = torch.zeros(num_out, dtype=uint8, device=x.device)
        cols, count = (row_map, row_map) if compact is None else compact(row_map)
        scale = row_map if probs is None else probs  # an unread placeholder without probs
        copy(x, row_map, scale, out, named, cols, count)
        zero(out, named)
        return out

    return permute


def moe_permute(
    x: torch.Tensor, row_map: torch.Tensor, probs: torch.Tensor | None, num_out_tokens: int
) -> torch.Tensor:
    configs = launch_configs()
    probs_dtype = None if probs is None else probs.dtype
    key = (x.shape, x.dtype, x.device, row_map.shape, probs_dtype, num_out_tokens, configs)
    plan = _PERMUTE_PLANS.get(key)
    if plan is None:
        tokens, hidden = x.shape
        made = _permute_plan(
            (tokens, hidden), x.dtype, row_map.shape[1], probs is not None, num_out_tokens,
            x.element_size(),
        )  # fmt: skip
        plan = remember(_PERMUTE_PLANS, key, made)
    return plan(x, row_map, probs)


@triton.jit
def _permute_probs_kernel(probs_ptr, row_map_ptr, out_ptr, n, num_out, BLOCK: tl.constexpr):
    f = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = f < n
    dest = tl.load(row_map_ptr + f, mask=inside, other=-1).to(tl.int64)
    ok = inside & (dest >= 0) & (dest < num_out)
    value = tl.load(probs_ptr + f, mask=ok, other=0.0)
    tl.store(out_ptr + tl.where(ok, dest, 0), value, mask=ok)


def _probs_plan(
    n: int, dtype: torch.dtype, num_out: int
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    if n == 0 or num_out == 0:
        return lambda probs, row_map: torch.zeros(num_out, dtype=dtype, device=probs.device)
    block = launch_configs().elementwise_block(n)
    move = bind(
        _permute_probs_kernel, (cdiv(n, block),), n, num_out, BLOCK=block, **_options()
    )  # fmt: skip

    def permute_probs(probs: torch.Tensor, row_map: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(num_out, dtype=dtype, device=probs.device)
        move(probs, row_map, out)
        return out

    return permute_probs


def moe_permute_probs(
    probs: torch.Tensor, row_map: torch.Tensor, num_out_tokens: int
) -> torch.Tensor:
    key = (probs.shape, probs.dtype, probs.device, num_out_tokens, launch_configs())
    plan = _PROBS_PLANS.get(key)
    if plan is None:
        plan = remember(_PROBS_PLANS, key, _probs_plan(probs.numel(), probs.dtype, num_out_tokens))
    return plan(probs, row_map)


@triton.jit
def _unpermute_kernel(
    x_ptr,
    row_map_ptr,
    probs_ptr,
    out_ptr,
    cols_ptr,
    count_ptr,
    slots,
    hidden,
    rows,
    HAS_PROBS: tl.constexpr,
    COMPACT: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    in_row = h < hidden
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    n = tl.load(count_ptr + t) if COMPACT else slots
    for i in range(n):
        j, src, ok = _slot_row(row_map_ptr, cols_ptr, t, i, slots, rows, COMPACT)
        value = tl.load(x_ptr + tl.where(ok, src, 0) * hidden + h, mask=in_row & ok, other=0.0)
        value = value.to(tl.float32)
        if HAS_PROBS:
            value = value * tl.load(probs_ptr + t * slots + j, mask=ok, other=0.0).to(tl.float32)
        acc += value
    tl.store(out_ptr + t * hidden + h, acc.to(out_ptr.dtype.element_ty), mask=in_row)


def _unpermute_plan(
    rows: int, hidden: int, dtype: torch.dtype, tokens: int, slots: int, has_probs: bool
) -> Callable[..., torch.Tensor]:
    if tokens == 0 or hidden == 0:
        return lambda x, row_map, probs: torch.empty(tokens, hidden, dtype=dtype, device=x.device)
    compact = _compaction(tokens, slots, rows)
    shape = launch_configs().row_sum(hidden)
    combine = bind(
        _unpermute_kernel,
        (tokens, cdiv(hidden, shape.block_h)),
        slots,
        hidden,
        rows,
        HAS_PROBS=has_probs,
        COMPACT=compact is not None,
        BLOCK_H=shape.block_h,
        num_warps=shape.num_warps,
        **_options(),
    )

    def unpermute(
        x: torch.Tensor, row_map: torch.Tensor, probs: torch.Tensor | None
    ) -> torch.Tensor:
        out = torch.empty(tokens, hidden, dtype=dtype, device=x.device)
        cols, count = (row_map, row_map) if compact is None else compact(row_map)
        scale = row_map if probs is None else probs  # an unread placeholder without probs
        combine(x, row_map, scale, out, cols, count)
        return out

    return unpermute


def moe_unpermute(
    x: torch.Tensor, row_map: torch.Tensor, probs: torch.Tensor | None
) -> torch.Tensor:
    probs_dtype = None if probs is None else probs.dtype
    key = (x.shape, x.dtype, x.device, row_map.shape, probs_dtype, launch_configs())
    plan = _UNPERMUTE_PLANS.get(key)
    if plan is None:
        (rows, hidden), (tokens, slots) = x.shape, row_map.shape
        made = _unpermute_plan(rows, hidden, x.dtype, tokens, slots, probs is not None)
        plan = remember(_UNPERMUTE_PLANS, key, made)
    return plan(x, row_map, probs)


@triton.jit
def _unpermute_wgrad_kernel(
    x_ptr,
    grad_ptr,
    row_map_ptr,
    out_ptr,
    cols_ptr,
    count_ptr,
    slots,
    hidden,
    rows,
    COMPACT: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Compact: only the listed slots are written (out starts zeroed); else every slot."""
    t = tl.program_id(0).to(tl.int64)
    n = tl.load(count_ptr + t) if COMPACT else slots
    for i in range(n):
        j, src, ok = _slot_row(row_map_ptr, cols_ptr, t, i, slots, rows, COMPACT)
        acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
        for h0 in range(0, hidden, BLOCK_H):
            h = h0 + tl.arange(0, BLOCK_H)
            in_row = h < hidden
            a = tl.load(x_ptr + tl.where(ok, src, 0) * hidden + h, mask=in_row & ok, other=0.0)
            g = tl.load(grad_ptr + t * hidden + h, mask=in_row & ok, other=0.0)
            acc += a.to(tl.float32) * g.to(tl.float32)
        tl.store(out_ptr + t * slots + j, tl.sum(acc, axis=0).to(out_ptr.dtype.element_ty))


def moe_unpermute_wgrad(x: torch.Tensor, grad: torch.Tensor, row_map: torch.Tensor) -> torch.Tensor:
    tokens, slots = row_map.shape
    if tokens * slots == 0:
        return torch.empty(tokens, slots, dtype=x.dtype, device=x.device)
    hidden = x.shape[1]
    cols, count, compact = _compact_slots(row_map, x.shape[0])
    # The compact path writes only the valid slots: the others are 0 from the start.
    out = (torch.zeros if compact else torch.empty)(tokens, slots, dtype=x.dtype, device=x.device)
    launch(
        _unpermute_wgrad_kernel,
        (tokens,),
        x,
        grad,
        row_map,
        out,
        cols,
        count,
        slots,
        hidden,
        x.shape[0],
        COMPACT=compact,
        BLOCK_H=_hidden_block(hidden),
        **_options(),
    )
    return out


def _chunk_sources(
    split_sizes: torch.Tensor, sorted_index: torch.Tensor, rows: int
) -> torch.Tensor:
    """Each output row's source row in x (-1 past the chunks), on the sizes' device, sync-free."""
    device = split_sizes.device
    chunks = split_sizes.shape[0]
    if chunks == 0:
        return torch.full((rows,), -1, dtype=torch.int64, device=device)
    # Sizes bounded first, so that their sums cannot wrap; chunks past the rows are cut.
    src_ends = torch.cumsum(split_sizes.long().clamp(0, rows), 0).clamp(max=rows)
    src_starts = torch.cat([src_ends.new_zeros(1), src_ends[:-1]])
    index = sorted_index.to(device).long()
    valid = (index >= 0) & (index < chunks)
    index = torch.where(valid, index, 0)
    out_sizes = torch.where(valid, (src_ends - src_starts)[index], 0)
    out_ends = torch.cumsum(out_sizes, 0)
    position = torch.arange(rows, device=device)
    chunk = torch.searchsorted(out_ends, position, right=True)
    inside = chunk < chunks
    chunk = chunk.clamp(max=chunks - 1)
    source = src_starts[index[chunk]] + position - (out_ends[chunk] - out_sizes[chunk])
    return torch.where(inside, source, -1)


@triton.jit
def _copy_rows_kernel(x_ptr, source_ptr, out_ptr, hidden, rows, BLOCK_H: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    in_row = h < hidden
    src = tl.load(source_ptr + i)
    ok = (src >= 0) & (src < rows)
    value = tl.load(x_ptr + tl.where(ok, src, 0) * hidden + h, mask=in_row & ok, other=0.0)
    tl.store(out_ptr + i * hidden + h, value, mask=in_row)


def moe_sort_chunks(
    x: torch.Tensor, split_sizes: torch.Tensor, sorted_index: torch.Tensor
) -> torch.Tensor:
    rows, hidden = x.shape
    out = torch.empty_like(x)
    if out.numel() == 0:
        return out
    source = _chunk_sources(split_sizes.to(x.device), sorted_index, rows)
    block = _hidden_block(hidden)
    launch(
        _copy_rows_kernel,
        (rows, cdiv(hidden, block)),
        x,
        source,
        out,
        hidden,
        rows,
        BLOCK_H=block,
        **_options(),
    )
    return out
