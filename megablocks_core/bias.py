"""The grouped GEMMs' per-expert ``bias`` (experts, n): its definition as the core serves it,
and the pieces of its gradient.

``gmm`` and ``gather_gmm`` add ``bias[e]`` to every output row of expert e (before any
activation the next op applies); ``gmm_scatter`` adds it to each (token, k) product row before
the weighted sum, so that token t gets ``sum_k weights[t*top_k + k] * bias[e(t, k)]`` more. A
kernel whose function takes ``bias`` adds it itself (in its epilogue); for one that does not, the
core adds it to the kernel's output with the functions here (:class:`~megablocks_core.schema.
TensorArg`'s ``serve``). Rows past the groups (and past a fused op's ``rows``) get no bias, as
they get no product. Nothing here reads a tensor on the host.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor


def _wide(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def group_ends(ends: Tensor, rows: int) -> Tensor:
    """Cumulative group ends (int64) as the grouped GEMMs read them: a negative group counts as
    0 and the groups are cut at row ``rows`` (unchecked bad data stays inside the rows)."""
    ends = ends.long()
    sizes = torch.diff(ends, prepend=ends.new_zeros(1)).clamp_(min=0)
    return sizes.cumsum(0).clamp_(max=rows)


def row_experts(ends: Tensor, rows: int) -> Tensor:
    """The expert of each of ``rows`` sorted rows (int64) from the groups' ends; the number of
    experts for a row past them."""
    return torch.searchsorted(ends, torch.arange(rows, device=ends.device), right=True)


def _with_zero_row(bias: Tensor, dtype: torch.dtype) -> Tensor:
    """bias, widened, with a zero row appended for the rows of no expert."""
    return torch.cat([bias.to(dtype), bias.new_zeros((1, bias.shape[1]), dtype=dtype)])


def add_row_bias(out: Tensor, bias: Tensor, ends: Tensor) -> Tensor:
    """out (rows, n), the kernel's own output, with bias[e] added in place to each row of group
    e. The add is computed in float32 or wider and rounded once to out's dtype (torch's
    elementwise add does so for 16-bit tensors), without a widened copy of out: at GPT-OSS's
    widths that copy and its sum were gigabytes of transient memory."""
    rows = out.shape[0]
    experts = row_experts(group_ends(ends.to(out.device), rows), rows)
    return out.add_(_with_zero_row(bias, torch.promote_types(bias.dtype, out.dtype))[experts])


def token_expert_weights(
    indices: Tensor, bins: Tensor, weights: Tensor | None, top_k: int, rows: int | None
) -> Tensor:
    """(tokens, experts) float32 (float64 for float64 weights): the summed weight with which each
    token's pairs are routed to each expert, over the pairs the fused op computes (those in the
    groups of the first ``rows`` sorted rows)."""
    pairs = indices.shape[0]
    experts = bins.shape[0]
    wide = _wide(weights.dtype if weights is not None else torch.float32)
    first = pairs if rows is None else rows
    expert = row_experts(group_ends(bins, first), pairs)
    flat = indices.long()
    valid = (flat >= 0) & (flat < pairs)
    flat = torch.where(valid, flat, 0)
    scale = valid.to(wide) if weights is None else torch.where(valid, weights.to(wide)[flat], 0)
    table = torch.zeros((pairs // top_k, experts + 1), dtype=wide, device=indices.device)
    table.index_put_((flat // top_k, expert), scale, accumulate=True)
    return table[:, :experts]


def serve_gmm(args: Mapping[str, Any], out: Tensor) -> Tensor:
    """gmm's bias for a kernel without it."""
    return add_row_bias(out, args["bias"], args["batch_sizes"].cumsum(0))


def serve_gather_gmm(args: Mapping[str, Any], out: Tensor) -> Tensor:
    """gather_gmm's bias for a kernel without it."""
    return add_row_bias(out, args["bias"], args["bins"])


def serve_gmm_scatter(args: Mapping[str, Any], out: Tensor) -> Tensor:
    """gmm_scatter's bias for a kernel without it: each token's weighted experts' biases."""
    table = token_expert_weights(
        args["indices"], args["bins"], args["weights"], args["top_k"], args["rows"]
    )
    wide = _wide(out.dtype)
    return out.add_(table.to(wide) @ args["bias"].to(wide))  # in place, as add_row_bias


def group_sums(call: Any, grad: Tensor, counts: Tensor) -> Tensor:
    """Each group's column sums of grad (experts, n), the gradient of a per-group bias, by the
    dispatched gmm_weight_grad of a column of ones (deterministic, no host sync). An FP8
    recipe's call runs it unquantized: quantizing grad would only make the sums less exact."""
    ones = grad.new_ones((grad.shape[0], 1))
    out: Tensor = getattr(call, "unquantized", call)("gmm_weight_grad", ones, grad, counts)
    return out[:, 0]
