"""Transformer Engine's MoE permutation functions, with its names and signatures, on any backend.

``from megablocks_core.integrations.transformer_engine import moe_permute, moe_unpermute`` can
replace ``from transformer_engine.pytorch import moe_permute, moe_unpermute``: the same
arguments and results, served by whatever backend megablocks-core ranks first for the device
(Triton on NVIDIA and AMD GPUs, the reference elsewhere), differentiable, and sync-free when
``num_out_tokens`` is given. The row map is megablocks-core's (the format in
docs/contracts.md, ``moe_permute_map``), not Transformer Engine's: pass it only to these
functions, never to Transformer Engine's own kernels (nor theirs to ours).

They read a size on the host only where no static one is given: ``num_out_tokens=-1`` or a
tensor count (the routed count), the index form without ``num_experts`` (the largest id), and
the padded form's output size (from ``tokens_per_expert``). Dropless Megatron-Core passes
``num_out_tokens = tokens * top_k``, which needs no host read.
"""

from __future__ import annotations

import operator

import torch
from torch import Tensor

from .. import ops

__all__ = [
    "moe_permute",
    "moe_permute_and_pad_with_probs",
    "moe_permute_with_probs",
    "moe_sort_chunks_by_index",
    "moe_sort_chunks_by_index_with_probs",
    "moe_unpermute",
]

_MAP_TYPES = ("mask", "index")


def _map_type(map_type: str) -> str:
    if map_type not in _MAP_TYPES:
        raise ValueError(f"map_type must be 'mask' or 'index', got {map_type!r}")
    return map_type


def _num_experts(routing_map: Tensor, map_type: str, num_experts: int | None) -> int:
    if num_experts is not None:
        return num_experts
    if map_type == "mask":
        return int(routing_map.shape[1])
    # The index form names experts by id only: the largest one bounds them (a host read).
    return max(int(routing_map.max()) + 1, 1) if routing_map.numel() else 1


def _integer(value: object) -> int | None:
    """``value`` as an int when it is an integer (a bool, a float or a string is not), else None."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def _count(num_out_tokens: int | Tensor | None) -> int | None:
    """``num_out_tokens`` as an int: an int, or an integer tensor of one element (Megatron's
    dropping path passes the routed count on the device; reading it is a host read). Anything
    else is refused rather than truncated."""
    if num_out_tokens is None:
        return None
    if isinstance(num_out_tokens, Tensor):
        dtype = num_out_tokens.dtype
        if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
            raise TypeError(
                f"num_out_tokens must be an int or an integer tensor, got a {dtype} tensor"
            )
        if num_out_tokens.numel() != 1:
            raise ValueError(
                "num_out_tokens must be one count, got a tensor of shape "
                f"{tuple(num_out_tokens.shape)}"
            )
        return int(num_out_tokens)  # a host read
    count = _integer(num_out_tokens)
    if count is None:
        raise TypeError(
            f"num_out_tokens must be an int or an integer tensor, got "
            f"{type(num_out_tokens).__name__} {num_out_tokens!r}"
        )
    return count


def _out_rows(routing_map: Tensor, map_type: str, num_out_tokens: int | Tensor | None) -> int:
    count = _count(num_out_tokens)
    if count is not None and count >= 0:
        return count
    if map_type == "index":
        return int(routing_map.numel())
    return int(routing_map.sum())  # every routed slot: a host read


def _check_routing(routing_map: Tensor, map_type: str) -> None:
    if map_type == "mask" and routing_map.dtype != torch.bool:
        raise TypeError(
            f"moe_permute: a mask routing_map must be torch.bool, got {routing_map.dtype}"
        )
    if map_type == "index" and (routing_map.dtype == torch.bool or routing_map.is_floating_point()):
        raise TypeError(
            f"moe_permute: an index routing_map must hold integer expert ids, got "
            f"{routing_map.dtype}"
        )


def moe_permute(
    inp: Tensor,
    routing_map: Tensor,
    num_out_tokens: int | Tensor = -1,
    max_token_num: int = -1,
    map_type: str = "mask",
    *,
    num_experts: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Permute the token rows ``inp`` (tokens, hidden) expert-major by ``routing_map``: a bool
    (tokens, experts) mask, or (tokens, top_k) expert ids with ``map_type="index"``. Returns
    (permuted rows, row_id_map). ``num_out_tokens``: rows of the output, an int or an integer
    tensor of one element (-1: every routed slot); rows past it are dropped, rows past the
    real count are 0. ``max_token_num`` is accepted for Transformer Engine's signature and not
    needed."""
    del max_token_num  # not needed: the output size comes from num_out_tokens
    kind = _map_type(map_type)
    _check_routing(routing_map, kind)
    rows = _out_rows(routing_map, kind, num_out_tokens)
    experts = _num_experts(routing_map, kind, num_experts)
    row_map, _ = ops.moe_permute_map(routing_map, experts, rows)
    return ops.moe_permute(inp, row_map, rows), row_map


def moe_permute_with_probs(
    inp: Tensor, probs: Tensor, routing_map: Tensor, num_out_tokens: int | Tensor = -1
) -> tuple[Tensor, Tensor, Tensor]:
    """As :func:`moe_permute` (mask form), also returning each permuted row's probability from
    ``probs`` (tokens, experts): (permuted rows, permuted probs, row_id_map)."""
    _check_routing(routing_map, "mask")
    rows = _out_rows(routing_map, "mask", num_out_tokens)
    row_map, _ = ops.moe_permute_map(routing_map, int(routing_map.shape[1]), rows)
    return (
        ops.moe_permute(inp, row_map, rows),
        ops.moe_permute_probs(probs, row_map, rows),
        row_map,
    )


def moe_permute_and_pad_with_probs(
    inp: Tensor, probs: Tensor, routing_map: Tensor, tokens_per_expert: Tensor, align_size: int
) -> tuple[Tensor, Tensor, Tensor, None, Tensor]:
    """The padded form: each expert's rows rounded up to a multiple of ``align_size``, padding
    rows 0. Returns (permuted rows, permuted probs, row_id_map, pad_offsets, padded tokens per
    expert). The row map already holds the padded rows, so ``pad_offsets`` is None (pass it on
    to :func:`moe_unpermute` as it is). The output size is read from ``tokens_per_expert`` on
    the host; :func:`megablocks_core.ops.moe_permute_map` with a static bound avoids that."""
    _check_routing(routing_map, "mask")
    align = _integer(align_size)
    if align is None:
        raise TypeError(f"align_size must be an int >= 1, got {type(align_size).__name__}")
    if align < 1:
        raise ValueError(f"align_size must be an int >= 1, got {align}")
    padded = (tokens_per_expert.long() + align - 1) // align * align
    rows = int(padded.sum())
    row_map, counts = ops.moe_permute_map(routing_map, int(routing_map.shape[1]), rows, align)
    return (
        ops.moe_permute(inp, row_map, rows),
        ops.moe_permute_probs(probs, row_map, rows),
        row_map,
        None,
        counts,
    )


def moe_unpermute(
    inp: Tensor,
    row_id_map: Tensor,
    merging_probs: Tensor | None = None,
    restore_shape: torch.Size | tuple[int, ...] | None = None,
    map_type: str = "mask",
    probs: Tensor | None = None,
    pad_offsets: Tensor | None = None,
) -> Tensor:
    """Sum each token's permuted rows back into its row, weighted by ``merging_probs``
    ((tokens, experts) for the mask form, (tokens, top_k) for the index form) when given
    (``probs`` is its older name: giving both is an error, as in Transformer Engine).
    ``restore_shape``: the output's shape."""
    _map_type(map_type)
    del pad_offsets  # the row map holds the padded rows
    if merging_probs is not None and probs is not None:
        raise ValueError(
            "moe_unpermute: merging_probs and probs (its older name) both given; pass one"
        )
    weights = merging_probs if merging_probs is not None else probs
    out = ops.moe_unpermute(inp, row_id_map, weights)
    return out if restore_shape is None else out.view(restore_shape)


def moe_sort_chunks_by_index(inp: Tensor, split_sizes: Tensor, sorted_index: Tensor) -> Tensor:
    """The chunks of ``inp`` (consecutive rows of ``split_sizes``) in the order
    ``sorted_index``."""
    return ops.moe_sort_chunks(inp, split_sizes, sorted_index)


def moe_sort_chunks_by_index_with_probs(
    inp: Tensor, probs: Tensor, split_sizes: Tensor, sorted_index: Tensor
) -> tuple[Tensor, Tensor]:
    """As :func:`moe_sort_chunks_by_index`, with the per-row ``probs`` (tokens,) reordered
    alike."""
    if probs.dim() != 1 or probs.shape[0] != inp.shape[0]:
        raise ValueError(
            f"moe_sort_chunks_by_index_with_probs: probs must be 1-D, one per row of inp "
            f"({inp.shape[0]},), got shape {tuple(probs.shape)}"
        )
    out = ops.moe_sort_chunks(inp, split_sizes, sorted_index)
    sorted_probs = ops.moe_sort_chunks(probs.reshape(-1, 1), split_sizes, sorted_index)
    return out, sorted_probs.view(probs.shape)
