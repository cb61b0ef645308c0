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

FP8 rows: the permutations (not ``moe_unpermute``) also take quantized tokens as
:class:`QuantizedRows` (data in ``float8_e4m3fn`` / ``float8_e4m3fnuz``, and their float32
scales in a format of :mod:`megablocks_core.formats`: ``(tokens, 1)`` for ``fp8_rowwise``,
``(tokens, ceil(hidden / 128))`` for ``fp8_blockwise``) and return them permuted the same way,
as Transformer Engine permutes a ``Float8Tensor`` and its ``scale_inv``:

* the data moves as bytes: viewed as float32 words (4 FP8 values each; a hidden size that is not
  a multiple of 4 is padded by a copy first), through the same float32 ops, which copy words
  bit for bit. No kernel converts an FP8 value, so every backend that serves float32 serves FP8
  rows, and the ops' contracts stay float-only (no FP8 arithmetic for a kernel to get wrong).
* the scales are rows of their own, permuted through the same row map, in the same order.
* rows no slot names (padding, rows past the real count) are what quantizing a zero row gives:
  data +0 and scale ``formats.MIN_SCALE`` (2**-126), not 0: positive and a power of two, so
  ``1 / scale`` is finite and blockwise's power-of-two rule holds, and permuting quantized rows
  equals quantizing the permuted rows, bit for bit, padding included.
* FP8 rows are forward-only (the data has no gradient): data or scales that require grad are
  refused. ``probs`` stay differentiable. ``moe_unpermute`` takes the experts' outputs in a float
  dtype (bf16), as Megatron-Core unpermutes them, and refuses FP8 rows.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from .. import ops
from ..formats import BLOCK, FP8_DTYPES, MIN_SCALE

__all__ = [
    "FP8_ALIGN",
    "QuantizedRows",
    "moe_permute",
    "moe_permute_and_pad_with_probs",
    "moe_permute_with_probs",
    "moe_sort_chunks_by_index",
    "moe_sort_chunks_by_index_with_probs",
    "moe_unpermute",
]

#: Rows per expert that FP8 padding must be a multiple of (``moe_permute_and_pad_with_probs``):
#: an FP8 GEMM reads each expert's rows with the token dim contiguous in its weight gradient
#: (the transposed operand), whose start must be 16-byte aligned, i.e. 16 one-byte rows
#: (torch._scaled_grouped_mm's group offsets, Megatron-Core's FP8 recipes). 32 (MXFP8's
#: blocks) and 128 (DeepGEMM's contiguous layout, 1x128 blocks along the tokens) are multiples.
FP8_ALIGN = 16


class QuantizedRows(NamedTuple):
    """FP8 token rows and their float32 scales (what ``megablocks_core.ops.quantize(x, 1,
    format, encoding)`` returns): ``data`` (tokens, hidden) in ``float8_e4m3fn`` or
    ``float8_e4m3fnuz``; ``scale`` (tokens, 1) for ``fp8_rowwise`` or (tokens, ceil(hidden /
    128)) for ``fp8_blockwise``, so that ``data * scale`` (each scale over its block) is the
    row. A plain (data, scale) tuple is taken as one."""

    data: Tensor
    scale: Tensor


#: FP8 values per float32 word: the data's bytes move through the float32 ops as words.
_WORD = 4
#: The bits of MIN_SCALE. Scales move XOR-ed with them, so that a row an op fills with zeros (no
#: slot names it) comes back as MIN_SCALE, a zero row's scale, with no row-map pass of its own.
_MIN_SCALE_BITS = int(torch.tensor(MIN_SCALE, dtype=torch.float32).view(torch.int32))


def _rows(inp: object, name: str) -> Tensor | QuantizedRows:
    """``inp`` as it is for a tensor of a float dtype, as checked :class:`QuantizedRows` for FP8
    rows with scales; anything else is an error naming the function."""
    if isinstance(inp, Tensor):
        if inp.dtype in FP8_DTYPES:
            raise TypeError(
                f"{name}: FP8 rows ({inp.dtype}) need their scales: pass "
                "QuantizedRows(data, scale), e.g. QuantizedRows(*ops.quantize(x, 1, format))"
            )
        return inp
    if not (isinstance(inp, tuple) and len(inp) == 2 and all(isinstance(t, Tensor) for t in inp)):
        raise TypeError(
            f"{name}: inp must be a tensor or QuantizedRows(data, scale), got {type(inp).__name__}"
        )
    data, scale = inp
    if data.dtype not in FP8_DTYPES:
        names = ", ".join(sorted(str(d) for d in FP8_DTYPES))
        raise TypeError(f"{name}: QuantizedRows data must be one of {names}, got {data.dtype}")
    if data.dim() != 2:
        raise ValueError(
            f"{name}: QuantizedRows data must be (tokens, hidden), got shape {tuple(data.shape)}"
        )
    tokens, hidden = data.shape
    blocks = -(-hidden // BLOCK)
    if scale.dtype != torch.float32 or scale.dim() != 2:
        raise TypeError(
            f"{name}: QuantizedRows scale must be a 2-D float32 tensor, got {scale.dtype} of "
            f"shape {tuple(scale.shape)}"
        )
    if scale.shape[0] != tokens or scale.shape[1] not in (1, blocks):
        raise ValueError(
            f"{name}: QuantizedRows scale must be ({tokens}, 1) (fp8_rowwise) or ({tokens}, "
            f"{blocks}) (fp8_blockwise, one per 1x{BLOCK} block) for data of shape "
            f"{tuple(data.shape)}, got {tuple(scale.shape)}"
        )
    if scale.device != data.device:
        raise ValueError(
            f"{name}: QuantizedRows data and scale on different devices ({data.device}, "
            f"{scale.device})"
        )
    if data.requires_grad or scale.requires_grad:
        raise RuntimeError(
            f"{name}: FP8 rows are forward-only (8-bit data has no gradient), but QuantizedRows "
            "data or scale requires grad; permute the high-precision rows to differentiate"
        )
    return QuantizedRows(data, scale)


def _as_words(data: Tensor) -> Tensor:
    """FP8 rows (tokens, hidden) as float32 words (tokens, ceil(hidden / 4)) of their bytes."""
    raw = data.view(torch.uint8)
    if raw.shape[1] % _WORD:
        raw = torch.nn.functional.pad(raw, (0, _WORD - raw.shape[1] % _WORD))
    try:
        return raw.view(torch.float32)
    except RuntimeError:  # a stride or offset that is not whole words
        return raw.contiguous().view(torch.float32)


def _from_words(words: Tensor, hidden: int, dtype: torch.dtype) -> Tensor:
    """The inverse of :func:`_as_words`: ``hidden`` FP8 values of ``dtype`` per row."""
    raw = words.view(torch.uint8)
    if raw.shape[1] != hidden:
        raw = raw[:, :hidden].contiguous()
    return raw.view(dtype)


def _flip_scales(scale: Tensor) -> Tensor:
    """Scales with their bits XOR-ed with MIN_SCALE's (its own inverse; +0 <-> MIN_SCALE)."""
    return (scale.view(torch.int32) ^ _MIN_SCALE_BITS).view(torch.float32)


def _move(rows: Tensor | QuantizedRows, move: Callable[[Tensor], Tensor]) -> Tensor | QuantizedRows:
    """``move`` (a permutation of rows by a float op) applied to float rows, or to FP8 rows: their
    data as float32 words, bit for bit, and their scales as rows of their own."""
    if isinstance(rows, Tensor):
        return move(rows)
    data, scale = rows
    moved = _from_words(move(_as_words(data)), data.shape[1], data.dtype)
    return QuantizedRows(moved, _flip_scales(move(_flip_scales(scale))))


def _token_count(rows: Tensor | QuantizedRows) -> int:
    return int((rows if isinstance(rows, Tensor) else rows.data).shape[0])


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
    inp: Tensor | QuantizedRows,
    routing_map: Tensor,
    num_out_tokens: int | Tensor = -1,
    max_token_num: int = -1,
    map_type: str = "mask",
    *,
    num_experts: int | None = None,
) -> tuple[Tensor | QuantizedRows, Tensor]:
    """Permute the token rows ``inp`` (tokens, hidden) expert-major by ``routing_map``: a bool
    (tokens, experts) mask, or (tokens, top_k) expert ids with ``map_type="index"``. Returns
    (permuted rows, row_id_map). ``num_out_tokens``: rows of the output, an int or an integer
    tensor of one element (-1: every routed slot); rows past it are dropped, rows past the
    real count are 0. ``max_token_num`` is accepted for Transformer Engine's signature and not
    needed. FP8 rows: ``inp`` a :class:`QuantizedRows`, permuted rows one too (module
    docstring)."""
    del max_token_num  # not needed: the output size comes from num_out_tokens
    rows_in = _rows(inp, "moe_permute")
    kind = _map_type(map_type)
    _check_routing(routing_map, kind)
    rows = _out_rows(routing_map, kind, num_out_tokens)
    experts = _num_experts(routing_map, kind, num_experts)
    row_map, _ = ops.moe_permute_map(routing_map, experts, rows)
    return _move(rows_in, lambda x: ops.moe_permute(x, row_map, rows)), row_map


def moe_permute_with_probs(
    inp: Tensor | QuantizedRows,
    probs: Tensor,
    routing_map: Tensor,
    num_out_tokens: int | Tensor = -1,
) -> tuple[Tensor | QuantizedRows, Tensor, Tensor]:
    """As :func:`moe_permute` (mask form), also returning each permuted row's probability from
    ``probs`` (tokens, experts): (permuted rows, permuted probs, row_id_map)."""
    rows_in = _rows(inp, "moe_permute_with_probs")
    _check_routing(routing_map, "mask")
    rows = _out_rows(routing_map, "mask", num_out_tokens)
    row_map, _ = ops.moe_permute_map(routing_map, int(routing_map.shape[1]), rows)
    return (
        _move(rows_in, lambda x: ops.moe_permute(x, row_map, rows)),
        ops.moe_permute_probs(probs, row_map, rows),
        row_map,
    )


def moe_permute_and_pad_with_probs(
    inp: Tensor | QuantizedRows,
    probs: Tensor,
    routing_map: Tensor,
    tokens_per_expert: Tensor,
    align_size: int,
) -> tuple[Tensor | QuantizedRows, Tensor, Tensor, None, Tensor]:
    """The padded form: each expert's rows rounded up to a multiple of ``align_size``, padding
    rows 0. Returns (permuted rows, permuted probs, row_id_map, pad_offsets, padded tokens per
    expert). The row map already holds the padded rows, so ``pad_offsets`` is None (pass it on
    to :func:`moe_unpermute` as it is). The output size is read from ``tokens_per_expert`` on
    the host; :func:`megablocks_core.ops.moe_permute_map` with a static bound avoids that.
    FP8 rows (:class:`QuantizedRows`, either format) take an ``align_size`` that is a multiple
    of 16 (``FP8_ALIGN``: 16 for FP8 GEMMs, 32 for MXFP8, 128 for DeepGEMM's layout); their
    padding rows are data 0 with scale 2**-126 (a zero row quantized)."""
    rows_in = _rows(inp, "moe_permute_and_pad_with_probs")
    _check_routing(routing_map, "mask")
    align = _integer(align_size)
    if align is None:
        raise TypeError(f"align_size must be an int >= 1, got {type(align_size).__name__}")
    if align < 1:
        raise ValueError(f"align_size must be an int >= 1, got {align}")
    if not isinstance(rows_in, Tensor) and align % FP8_ALIGN:
        # Neither format's scales need it (no scale block spans two rows); the FP8 GEMMs do.
        raise ValueError(
            f"align_size must be a multiple of {FP8_ALIGN} for FP8 rows (an FP8 GEMM's weight "
            f"gradient reads each expert's rows from a 16-byte aligned start: 16 for FP8, 32 "
            f"for MXFP8, 128 for 1x128 blocks along the tokens), got {align}"
        )
    padded = (tokens_per_expert.long() + align - 1) // align * align
    rows = int(padded.sum())
    row_map, counts = ops.moe_permute_map(routing_map, int(routing_map.shape[1]), rows, align)
    return (
        _move(rows_in, lambda x: ops.moe_permute(x, row_map, rows)),
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
    ``restore_shape``: the output's shape. FP8 rows are refused: the experts' outputs that
    Megatron-Core unpermutes are bf16."""
    if isinstance(inp, tuple) or inp.dtype in FP8_DTYPES:
        raise TypeError(
            "moe_unpermute: inp must be the experts' outputs in a float dtype (e.g. bf16), not "
            "FP8 rows: FP8 tokens are permuted forward only; dequantize them first"
        )
    _map_type(map_type)
    del pad_offsets  # the row map holds the padded rows
    if merging_probs is not None and probs is not None:
        raise ValueError(
            "moe_unpermute: merging_probs and probs (its older name) both given; pass one"
        )
    weights = merging_probs if merging_probs is not None else probs
    out = ops.moe_unpermute(inp, row_id_map, weights)
    return out if restore_shape is None else out.view(restore_shape)


def moe_sort_chunks_by_index(
    inp: Tensor | QuantizedRows, split_sizes: Tensor, sorted_index: Tensor
) -> Tensor | QuantizedRows:
    """The chunks of ``inp`` (consecutive rows of ``split_sizes``) in the order
    ``sorted_index``; FP8 rows (:class:`QuantizedRows`) with their scales."""
    rows_in = _rows(inp, "moe_sort_chunks_by_index")
    return _move(rows_in, lambda x: ops.moe_sort_chunks(x, split_sizes, sorted_index))


def moe_sort_chunks_by_index_with_probs(
    inp: Tensor | QuantizedRows, probs: Tensor, split_sizes: Tensor, sorted_index: Tensor
) -> tuple[Tensor | QuantizedRows, Tensor]:
    """As :func:`moe_sort_chunks_by_index`, with the per-row ``probs`` (tokens,) reordered
    alike."""
    rows_in = _rows(inp, "moe_sort_chunks_by_index_with_probs")
    tokens = _token_count(rows_in)
    if probs.dim() != 1 or probs.shape[0] != tokens:
        raise ValueError(
            f"moe_sort_chunks_by_index_with_probs: probs must be 1-D, one per row of inp "
            f"({tokens},), got shape {tuple(probs.shape)}"
        )
    out = _move(rows_in, lambda x: ops.moe_sort_chunks(x, split_sizes, sorted_index))
    sorted_probs = ops.moe_sort_chunks(probs.reshape(-1, 1), split_sizes, sorted_index)
    return out, sorted_probs.view(probs.shape)
