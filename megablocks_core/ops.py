"""The op surface, signature-compatible with ``megablocks.ops``.

``import megablocks_core.ops as ops`` can replace ``import megablocks.ops as ops``.
Each function's contract (dtypes, shapes, rules, gradients, edge cases) is in
:mod:`megablocks_core.contracts` and docs/contracts.md; the implementation is
chosen per call from the installed backends (see :mod:`megablocks_core.ranking`).
"""

from __future__ import annotations

import builtins
from collections.abc import Sequence

import torch
from torch import Tensor

from . import contracts
from .entries import ENTRIES, validator

_sort = ENTRIES["sort"]
_histogram = ENTRIES["histogram"]
_inclusive_cumsum = ENTRIES["inclusive_cumsum"]
_exclusive_cumsum = ENTRIES["exclusive_cumsum"]
_topology = ENTRIES["topology"]
_replicate = ENTRIES["replicate"]
_route = ENTRIES["route"]
_router_topk = ENTRIES["router_topk"]
_gather = ENTRIES["gather"]
_scatter = ENTRIES["scatter"]
_padded_gather = ENTRIES["padded_gather"]
_padded_scatter = ENTRIES["padded_scatter"]
_binned_gather = ENTRIES["binned_gather"]
_binned_scatter = ENTRIES["binned_scatter"]
_gmm = ENTRIES["gmm"]
_gather_gmm = ENTRIES["gather_gmm"]
_gmm_scatter = ENTRIES["gmm_scatter"]
_glu = ENTRIES["glu"]
_quantize = ENTRIES["quantize"]
_quantize_both_ways = ENTRIES["quantize_both_ways"]
_quantize_transposed = ENTRIES["quantize_transposed"]
_scaled_gmm = ENTRIES["scaled_gmm"]
_scaled_gather_gmm = ENTRIES["scaled_gather_gmm"]
_scaled_gmm_scatter = ENTRIES["scaled_gmm_scatter"]
_scaled_gmm_weight_grad = ENTRIES["scaled_gmm_weight_grad"]

# --- routing ---------------------------------------------------------------


def sort(x: Tensor, end_bit: int | None = None) -> tuple[Tensor, Tensor]:
    """Stable sort of integer keys; returns (values, indices), both in x's dtype."""
    return _sort(x, end_bit)


def histogram(x: Tensor, num_bins: int) -> Tensor:
    """int32 counts of keys per bin; keys outside [0, num_bins) are not counted."""
    return _histogram(x, num_bins)


def inclusive_cumsum(x: Tensor, dim: int) -> Tensor:
    """Running sum including each element, in x's dtype and shape."""
    return _inclusive_cumsum(x, dim)


def exclusive_cumsum(x: Tensor, dim: int) -> Tensor:
    """Running sum excluding each element, in x's dtype and shape."""
    return _exclusive_cumsum(x, dim)


def topology(
    padded_bins: Tensor, block_size: int, output_block_rows: int, output_block_columns: int
) -> Tensor:
    """int16 column indices of the block-sparse expert matrix."""
    return _topology(padded_bins, block_size, output_block_rows, output_block_columns)


def replicate(x: Tensor, bins: Tensor, num_outputs: int) -> Tensor:
    """Repeat each bin's value over that bin's rows: (batch, bins) → (batch, num_outputs)."""
    return _replicate(x, bins, num_outputs)


def route(
    top_experts: Tensor, num_experts: int, block_size: int
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(indices, bin_ids, tokens_per_expert, bins, padded_bins) from the flat top-k expert ids."""
    return _route(top_experts, num_experts, block_size)


def router_topk(scores: Tensor, top_k: int, softmax: bool = False) -> tuple[Tensor, Tensor]:
    """(weights, experts int32), each (tokens, top_k): every row's top_k experts by score,
    largest first (equal scores: lower id first), and their scores or softmax probabilities."""
    return _router_topk(scores, top_k, softmax)


# --- permutation -------------------------------------------------------------


def gather(
    x: Tensor,
    indices: Tensor,
    bin_ids: Tensor,
    bins: Tensor,
    top_k: int,
    rows: int | None = None,
) -> Tensor:
    """(tokens, hidden) → (tokens * top_k, hidden) in expert-sorted order; with ``rows``, only
    the first ``rows`` sorted rows."""
    return _gather(x, indices, bin_ids, None, bins, top_k, rows)


def scatter(
    x: Tensor, indices: Tensor, bin_ids: Tensor, weights: Tensor | None, bins: Tensor, top_k: int
) -> Tensor:
    """(tokens * top_k, hidden) sorted rows → (tokens, hidden), summing each token's (weighted) rows."""
    return _scatter(x, indices, bin_ids, weights, bins, top_k)


def padded_gather(
    x: Tensor, indices: Tensor, bin_ids: Tensor, bins: Tensor, padded_bins: Tensor, top_k: int
) -> Tensor:
    """Gather into per-expert segments padded to padded_bins (padding rows are zero)."""
    return _padded_gather(x, indices, bin_ids, None, bins, padded_bins, top_k)


def padded_scatter(
    x: Tensor,
    indices: Tensor,
    bin_ids: Tensor,
    weights: Tensor | None,
    bins: Tensor,
    padded_bins: Tensor,
    top_k: int,
) -> Tensor:
    """Scatter from padded expert segments back to (tokens, hidden)."""
    return _padded_scatter(x, indices, bin_ids, weights, bins, padded_bins, top_k)


def binned_gather(x: Tensor, indices: Tensor, bins: Tensor, bin_size: int, top_k: int) -> Tensor:
    """Gather into (experts, bin_size, hidden) bins, dropping rows beyond bin_size."""
    return _binned_gather(x, indices, None, bins, bin_size, top_k)


def binned_scatter(
    x: Tensor, indices: Tensor, weights: Tensor | None, bins: Tensor, top_k: int
) -> Tensor:
    """Scatter (experts, bin_size, hidden) bins back to (tokens, hidden); dropped rows add 0."""
    return _binned_scatter(x, indices, weights, bins, top_k)


# --- grouped GEMM --------------------------------------------------------------


def gmm(
    a: Tensor, b: Tensor, batch_sizes: Tensor, trans_b: bool = False, bias: Tensor | None = None
) -> Tensor:
    """Grouped GEMM: a (rows, k), grouped by expert, → (rows, n): each expert's rows of a times
    that expert's matrix of b, (experts, k, n) or (experts, n, k) with ``trans_b`` (plus
    ``bias[e]``, (experts, n) in a's dtype, for each row of expert e when given).

    ``batch_sizes`` (int32 or int64, one group size per expert) may be a CPU tensor (MegaBlocks'
    convention) or live on a's device: the sync-free form (no device→host copy; CUDA-graph
    capturable with the triton or ``torch._grouped_mm`` providers). The groups may cover fewer
    rows than a has: the rows past the last group belong to no expert and their output rows are 0.
    """
    return _gmm(a, b, batch_sizes, trans_b, bias)


def gather_gmm(
    x: Tensor,
    b: Tensor,
    indices: Tensor,
    bin_ids: Tensor,
    bins: Tensor,
    top_k: int,
    trans_b: bool = False,
    rows: int | None = None,
    bias: Tensor | None = None,
) -> Tensor:
    """``gmm(gather(x, indices, bin_ids, bins, top_k), b, batch_sizes, trans_b, bias)`` without
    writing the gathered rows, ``batch_sizes[e] = bins[e] - bins[e - 1]``: (tokens, k) tokens →
    (tokens * top_k, n) expert-sorted rows. The expert groups come from ``bins`` (no host sync);
    sorted rows past ``bins[-1]`` belong to no expert and their output rows are 0. ``rows``:
    compute only the first ``rows`` sorted rows, (rows, n) (at least ``bins[-1]``), e.g. a
    receiving rank's own pairs under expert parallelism. ``bias``: (experts, n) in x's dtype,
    added to each of expert e's rows."""
    return _gather_gmm(x, b, indices, bin_ids, bins, top_k, trans_b, rows, bias)


def gmm_scatter(
    x: Tensor,
    b: Tensor,
    indices: Tensor,
    bin_ids: Tensor,
    weights: Tensor | None,
    bins: Tensor,
    top_k: int,
    trans_b: bool = False,
    activation: str | None = None,
    rows: int | None = None,
    bias: Tensor | None = None,
    alpha: float | None = None,
    limit: float | None = None,
) -> Tensor:
    """``scatter(gmm(act(x), b, batch_sizes, trans_b, bias), indices, bin_ids, weights, bins,
    top_k)``, ``batch_sizes`` from ``bins``: expert-sorted rows (tokens * top_k, k) → (tokens, n),
    each token's rows summed, weighted by ``weights`` (flat, tokens * top_k; None: 1).

    ``activation`` is applied to x's rows first (a transient act(x)): "gelu" (= "gelu_tanh", the
    tanh approximation), "gelu_erf" (exact), "silu" or "relu"; or gated, on rows holding gate and
    up side by side, (rows, 2k) → (rows, k) as :func:`glu`: "geglu" (= "geglu_tanh"),
    "geglu_erf", "swiglu", "reglu" (act(gate) * up), "bilinear" (gate * up) or "swiglu_oai"
    (GPT-OSS's clamped SwiGLU), each but "bilinear" also with the suffix "_interleaved" (gate in
    even columns, up in odd); None: none. Its backward keeps no (tokens * top_k, n) product, and
    with an activation only x (act(x) is recomputed there). ``rows``: x holds only the first
    ``rows`` sorted rows (``gather_gmm``'s with the same ``rows``); sorted rows past ``bins[-1]``
    add nothing. ``bias``: (experts, n) in x's dtype, added to each (token, k) product row before
    the weighted sum. ``alpha``, ``limit``: the clamped SwiGLU's constants ("swiglu_oai" and its
    interleaved form only; None: GPT-OSS's 1.702 and 7.0)."""
    return _gmm_scatter(
        x, b, indices, bin_ids, weights, bins, top_k, trans_b, activation, rows, bias, alpha, limit
    )


# --- activation --------------------------------------------------------------


def glu(
    x: Tensor,
    activation: str | None = None,
    alpha: float | None = None,
    limit: float | None = None,
) -> Tensor:
    """Gated experts' unit: ``act(x[:, :n]) * x[:, n:]`` for x of (rows, 2n), the first GEMM's
    output through ``[w1 | v1]`` side by side, → (rows, n), in float32 rounded once.

    ``activation``: "silu" (SwiGLU); "gelu" or "gelu_tanh" (tanh), "gelu_erf" (exact): GEGLU;
    "relu"; "silu_oai" (GPT-OSS's clamped unit, ``(up + 1) * g * sigmoid(alpha * g)`` with
    ``g = min(gate, limit)`` and up clamped to ``[-limit, limit]``; ``alpha`` and ``limit`` None:
    GPT-OSS's 1.702 and 7.0); any of them with the suffix "_interleaved" for gate and up
    interleaved (gate in even columns, up in odd); None: bilinear. Its backward keeps x only."""
    return _glu(x, activation, alpha, limit)


# --- low precision: formats in megablocks_core.formats; training through them: megablocks_core.fp8


def quantize(
    x: Tensor, reduce_dim: int, format: str | None = None, encoding: str | None = None
) -> tuple[Tensor, Tensor]:
    """(8-bit data, float32 scales) of a GEMM operand in ``format`` ("fp8_rowwise",
    "fp8_blockwise"): a row operand (rows, k) with ``reduce_dim`` 1, or expert matrices (experts,
    k, n) / (experts, n, k) summed over ``reduce_dim`` 1 / 2. ``encoding``: "e4m3fn" or
    "e4m3fnuz"; None: the one x's device takes. x may be a strided view (a matrix's transpose:
    the output is contiguous in x's shape)."""
    return _quantize(x, reduce_dim, format, encoding)


def quantize_both_ways(
    x: Tensor, format: str | None = None, encoding: str | None = None
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Expert matrices (experts, p, q) quantized for both GEMMs that read them: ``(data, scale,
    data_t, scale_t)``, exactly :func:`quantize` ``(x, 2, ...)`` and ``(x.transpose(1, 2), 2,
    ...)``, from one call (a kernel may read x once for both). For a weight (experts, k, n):
    ``data`` serves the data gradient (summed over n), ``data_t`` the forward (summed over k)."""
    return _quantize_both_ways(x, format, encoding)


def quantize_transposed(
    x: Tensor, batch_sizes: Tensor, format: str | None = None, encoding: str | None = None
) -> tuple[Tensor, Tensor]:
    """A weight gradient's row operand (rows, c), grouped by expert, quantized for the sum over
    its rows: ``(data, scale)``, data (c, rows) with rows contiguous, one scale per column per
    expert (experts, c). The operands of :func:`scaled_gmm_weight_grad`."""
    return _quantize_transposed(x, batch_sizes, format, encoding)


def scaled_gmm(
    a: Tensor,
    a_scale: Tensor,
    b: Tensor,
    b_scale: Tensor,
    batch_sizes: Tensor,
    trans_b: bool = False,
    format: str | None = None,
    out_dtype: str | None = None,
    bias: Tensor | None = None,
) -> Tensor:
    """:func:`gmm` of quantized operands (each as :func:`quantize` gives it, in ``format``),
    accumulated in float32, ``bias[e]`` added (if given), rounded to ``out_dtype`` ("bfloat16"
    when None, "float16", "float32"). Not differentiable: :mod:`megablocks_core.fp8` trains
    through it."""
    return _scaled_gmm(a, a_scale, b, b_scale, batch_sizes, trans_b, format, out_dtype, bias)


def scaled_gather_gmm(
    x: Tensor,
    x_scale: Tensor,
    b: Tensor,
    b_scale: Tensor,
    indices: Tensor,
    bin_ids: Tensor,
    bins: Tensor,
    top_k: int,
    trans_b: bool = False,
    rows: int | None = None,
    format: str | None = None,
    out_dtype: str | None = None,
    bias: Tensor | None = None,
) -> Tensor:
    """:func:`gather_gmm` of quantized operands: the 8-bit token rows (one quantization per
    token) read through the indices."""
    return _scaled_gather_gmm(
        x, x_scale, b, b_scale, indices, bin_ids, bins, top_k, trans_b, rows, format, out_dtype,
        bias,
    )  # fmt: skip


def scaled_gmm_scatter(
    x: Tensor,
    x_scale: Tensor,
    b: Tensor,
    b_scale: Tensor,
    indices: Tensor,
    bin_ids: Tensor,
    weights: Tensor | None,
    bins: Tensor,
    top_k: int,
    trans_b: bool = False,
    rows: int | None = None,
    format: str | None = None,
    out_dtype: str | None = None,
    bias: Tensor | None = None,
) -> Tensor:
    """:func:`gmm_scatter` of quantized operands (no activation: quantize the activated rows):
    each product row (with ``bias[e]`` if given) rounded to ``out_dtype``, then summed per
    token, weighted, in float32."""
    return _scaled_gmm_scatter(
        x, x_scale, b, b_scale, indices, bin_ids, weights, bins, top_k, trans_b, rows, format,
        out_dtype, bias,
    )  # fmt: skip


def scaled_gmm_weight_grad(
    a: Tensor,
    a_scale: Tensor,
    grad: Tensor,
    grad_scale: Tensor,
    batch_sizes: Tensor,
    format: str | None = None,
    out_dtype: str | None = None,
) -> Tensor:
    """The weight gradient of quantized operands: ``out[e] = x[rows of e].T @ dy[rows of e]``
    from ``quantize_transposed(x)`` (a, a_scale) and ``quantize_transposed(dy)`` (grad,
    grad_scale), (experts, k, n) in ``out_dtype``, summed in float32."""
    return _scaled_gmm_weight_grad(a, a_scale, grad, grad_scale, batch_sizes, format, out_dtype)


# --- composite ops: plain torch on every device ------------------------------------


#: Each composite op's validation: their rules read only dtypes, shapes, devices and the
#: int/sequence arguments (never data), so a repeated call shape skips it (~30 µs of host time),
#: as the dispatched ops' entries do.
_VALIDATORS = {c.name: validator(c) for c in (contracts.ROUND_UP, contracts.REPEAT, contracts.SUM)}


def _check(contract: contracts.OpContract, *args: object) -> None:
    if torch.compiler.is_compiling():  # dynamo traces the torch calls, not the checks
        return
    _VALIDATORS[contract.name](args)


def round_up(x: Tensor, value: int) -> Tensor:
    """Round each count up to a multiple of ``value``."""
    _check(contracts.ROUND_UP, x, value)
    # Truncation keeps |x // value * value| <= |x|, so only a result beyond x's dtype can wrap
    # (x + value - 1 would wrap for counts near the dtype's maximum).
    down = torch.div(x, value, rounding_mode="trunc") * value
    return torch.where(down < x, down + value, down)


def repeat(x: Tensor, tiling: Sequence[int]) -> Tensor:
    """``x.repeat(*tiling)``, or x itself when every factor is 1."""
    _check(contracts.REPEAT, x, tiling)
    if builtins.all(t == 1 for t in tiling):
        return x
    return x.repeat(*tiling)


def sum(x: Tensor, dim: int = 0) -> Tensor:
    """Sum over ``dim``; a dimension of size 1 is squeezed instead."""
    _check(contracts.SUM, x, dim)
    if x.shape[dim] == 1:
        return x.squeeze(dim=dim)
    return x.sum(dim=dim)


__all__ = [
    "binned_gather",
    "binned_scatter",
    "exclusive_cumsum",
    "gather",
    "gather_gmm",
    "glu",
    "gmm",
    "gmm_scatter",
    "histogram",
    "inclusive_cumsum",
    "padded_gather",
    "padded_scatter",
    "quantize",
    "quantize_both_ways",
    "quantize_transposed",
    "repeat",
    "replicate",
    "round_up",
    "route",
    "router_topk",
    "scaled_gather_gmm",
    "scaled_gmm",
    "scaled_gmm_scatter",
    "scaled_gmm_weight_grad",
    "scatter",
    "sort",
    "sum",
    "topology",
]


# --- Megatron-Core / Transformer Engine permutation ---------------------------------------
# The row map format is written in the contracts (docs/contracts.md, moe_permute_map); the
# drop-in for Transformer Engine's functions is megablocks_core.integrations.transformer_engine.

_moe_permute_map = ENTRIES["moe_permute_map"]
_moe_permute = ENTRIES["moe_permute"]
_moe_permute_probs = ENTRIES["moe_permute_probs"]
_moe_unpermute = ENTRIES["moe_unpermute"]
_moe_sort_chunks = ENTRIES["moe_sort_chunks"]


def moe_permute_map(
    routing_map: Tensor, num_experts: int, num_out_tokens: int, align_size: int = 1
) -> tuple[Tensor, Tensor]:
    """(row_map, counts) of a bool (tokens, experts) mask or integer (tokens, top_k) expert ids:
    int32 ``row_map``, the routing map's shape, holds each slot's row in the expert-major
    permuted tensor of ``num_out_tokens`` rows (or -1: routed nowhere, or dropped past
    ``num_out_tokens``); int32 ``counts``, (num_experts,), the rows each expert owns there
    (rounded up to ``align_size``, cut at ``num_out_tokens``). Both on the device, no host sync."""
    return _moe_permute_map(routing_map, num_experts, num_out_tokens, align_size)


def moe_permute(x: Tensor, row_map: Tensor, num_out_tokens: int) -> Tensor:
    """Copy each token row to the rows its row map names: (tokens, h) → (num_out_tokens, h),
    unnamed rows zero."""
    return _moe_permute(x, row_map, None, num_out_tokens)


def moe_permute_probs(probs: Tensor, row_map: Tensor, num_out_tokens: int) -> Tensor:
    """Each slot's probability at its permuted row: (tokens, slots) → (num_out_tokens,), 0 where
    no slot lands."""
    return _moe_permute_probs(probs, row_map, num_out_tokens)


def moe_unpermute(x: Tensor, row_map: Tensor, probs: Tensor | None) -> Tensor:
    """Sum each token's permuted rows back, weighted by ``probs`` (tokens, slots) or not (None):
    (num_out_tokens, h) → (tokens, h); a token none of whose slots has a row gets 0."""
    return _moe_unpermute(x, row_map, probs)


def moe_sort_chunks(x: Tensor, split_sizes: Tensor, sorted_index: Tensor) -> Tensor:
    """The chunks of x (consecutive rows, ``split_sizes``) in the order ``sorted_index``: (rows,
    h) → (rows, h), rows past the chunks 0."""
    return _moe_sort_chunks(x, split_sizes, sorted_index)


__all__ += [
    "moe_permute",
    "moe_permute_map",
    "moe_permute_probs",
    "moe_sort_chunks",
    "moe_unpermute",
]
