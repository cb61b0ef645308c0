"""The backward rules of the grouped GEMMs (gmm, the fused gather_gmm and gmm_scatter, the weight
gradient) and of the gated activation."""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import torch

from .. import bias as bias_ops
from ..activations import activate_backward, activate_with, glu_backward
from .base import Call, GatheredRows, Grads, reads_gathered_rows
from .fusion import _weight_grad
from .permutation import _first_rows, _identity, _row_scales, _scale_rows, _weighted_rows


def _gmm(call: Call, a: Mapping[str, Any], grad: torch.Tensor, needs: Mapping[str, bool]) -> Grads:
    out: Grads = {}
    trans_b = a["trans_b"]
    if needs["a"]:
        out["a"] = call("gmm", grad, a["b"], a["batch_sizes"], not trans_b)
    if needs["b"]:
        if trans_b:  # b[e] is (n, k): its gradient is grad_e^T a_e
            out["b"] = _weight_grad(call, a, "b", grad, a["a"], a["batch_sizes"])
        else:
            out["b"] = _weight_grad(call, a, "b", a["a"], grad, a["batch_sizes"])
    if needs["bias"]:
        out["bias"] = bias_ops.group_sums(call, grad, a["batch_sizes"])
    return out


def _weight_grad_by_bins(
    call: Call,
    bound: Mapping[str, Any],
    x: torch.Tensor | GatheredRows,
    grad: torch.Tensor | GatheredRows,
) -> torch.Tensor | None:
    """b's gradient over the groups that cumulative bins give (sorted rows of x and grad).

    The counts stay on bins' device (no host sync). They are the groups as the fused forward read
    them, also for bins that are not a cumulative sum (unchecked data the forward accepted): a
    negative group counts as 0 and the groups are cut at the last row of x. So the weight
    gradient sees valid counts wherever they live, and the backward neither raises about an
    argument the caller never passed nor behaves differently for CPU and device-side bins."""
    rows = x.sorted_rows if isinstance(x, GatheredRows) else x.shape[0]
    return _weight_grad(call, bound, "b", x, grad, _counts_from_bins(bound["bins"], rows))


def _sorted_rows(
    call: Call,
    x: torch.Tensor,
    routing: tuple[torch.Tensor, torch.Tensor],
    weights: torch.Tensor | None,
    bins: torch.Tensor,
    top_k: int,
    rows: int | None,
) -> torch.Tensor | GatheredRows:
    """gather's (weighted) sorted rows of x as a weight gradient's operand: gathered again (a
    transient copy; a gather kernel and the best weight-gradient GEMM beat a GEMM reading rows
    through the indices), or left ungathered for a call whose weight gradient reads them through
    the indices itself (an FP8 one quantizes them as it reads: no 16-bit copy)."""
    if reads_gathered_rows(call) and not torch.is_grad_enabled():
        return GatheredRows(x, *routing, weights, bins, top_k, rows)
    return _weighted_rows(call, x, routing, weights, bins, top_k, rows)


#: The last :func:`_counts_from_bins` result: (bins, weakly; its version; rows; counts). One
#: step's backward asks for the same bins' counts for each fused op and bias (the routing is
#: shared), a dozen small tensor ops each time.
_LAST_COUNTS: tuple[weakref.ref[torch.Tensor], int, int, torch.Tensor] | None = None


def _counts_from_bins(bins: torch.Tensor, rows: int) -> torch.Tensor:
    """Group sizes (int32, each <= rows) from cumulative bins as the fused ops read them.

    Remembered for the last bins tensor while it is alive and unchanged (its version counter: an
    in-place write makes it count again), except while tracing or capturing a CUDA graph, when
    the ops that compute the counts must be recorded, not skipped."""
    global _LAST_COUNTS
    recording = _recording(bins)
    last = _LAST_COUNTS
    if (
        not recording
        and last is not None
        and last[0]() is bins
        and last[1] == bins._version
        and last[2] == rows
    ):
        return last[3]
    ends = bias_ops.group_ends(bins, rows)  # int64: sums of int32 bins cannot wrap
    counts = torch.diff(ends, prepend=ends.new_zeros(1)).int()
    if not recording:
        _LAST_COUNTS = (weakref.ref(bins), bins._version, rows, counts)
    return counts


def _recording(bins: torch.Tensor) -> bool:
    """Whether torch.compile traces, or a CUDA graph is being captured on bins' device."""
    if torch.compiler.is_compiling():
        return True
    return bins.is_cuda and torch.cuda.is_current_stream_capturing()


def _gather_gmm(
    call: Call, a: Mapping[str, Any], grad: torch.Tensor, needs: Mapping[str, bool]
) -> Grads:
    out: Grads = {}
    routing = (a["indices"], a["bin_ids"])
    trans_b, top_k, bins, first = a["trans_b"], a["top_k"], a["bins"], a["rows"]
    if needs["x"]:  # every (token, k) row's gradient, summed back into its token
        out["x"] = call(
            "gmm_scatter", grad, a["b"], *routing, None, bins, top_k, not trans_b, None, first
        )
    if needs["b"]:  # the gathered rows were not kept
        rows = _sorted_rows(call, a["x"], routing, None, bins, top_k, first)
        if trans_b:  # b[e] is (n, k): grad_e^T @ rows_e
            out["b"] = _weight_grad_by_bins(call, a, grad, rows)
        else:
            out["b"] = _weight_grad_by_bins(call, a, rows, grad)
    if needs["bias"]:
        out["bias"] = bias_ops.group_sums(call, grad, _counts_from_bins(bins, grad.shape[0]))
    return out


def _row_dots(
    call: Call,
    x: torch.Tensor,
    y: torch.Tensor,
    identity: torch.Tensor,
    routing: tuple[torch.Tensor, ...],
    bins: torch.Tensor,
) -> torch.Tensor:
    """dot(x[i], y[i]) for each row, accumulated in float32: scatter_wgrad with identity indices
    and top_k 1 (its one-row-per-token form), a bandwidth-bound kernel where a batched GEMV of
    1x1 products runs several times slower."""
    return call("scatter_wgrad", x, y, identity, routing[1], bins, 1)


def _by_flat_id(values: torch.Tensor, indices: torch.Tensor, n: int) -> torch.Tensor:
    """out[indices[i]] = values[i] for ids in [0, n) (``indices`` may name the first sorted rows
    only); ids no row names get 0, ids out of range are dropped."""
    flat = indices.long()
    slot = torch.where((flat >= 0) & (flat < n), flat, n)  # out-of-range ids land in a cut-off slot
    return values.new_zeros(n + 1).index_copy_(0, slot, values)[:n]


def _gmm_scatter(
    call: Call, a: Mapping[str, Any], grad: torch.Tensor, needs: Mapping[str, bool]
) -> Grads:
    out: Grads = {}
    routing = (a["indices"], a["bin_ids"])
    trans_b, top_k, weights, bins = a["trans_b"], a["top_k"], a["weights"], a["bins"]
    activation, first = a["activation"], a["rows"]
    constants = (a["alpha"], a["limit"])  # the clamped SwiGLU's (None for others)
    # x holds the first `first` sorted rows (all when None): so do the per-row tensors below.
    row_routing = _first_rows(routing, first)
    # With an activation whose input needs a gradient, one activation_backward pass gives that
    # gradient, act(x) and the weights' dots together (when this backward is itself recorded,
    # the differentiable composition below runs instead).
    one_pass = activation is not None and needs["x"] and not torch.is_grad_enabled()
    # The GEMM's input rows: x, or act(x) recomputed (transient) from the kept pre-activation.
    x_in = a["x"]
    if activation is not None and not one_pass and (needs["weights"] or needs["b"]):
        x_in = activate_with(call, x_in, activation, *constants)
    if needs["x"] or needs["weights"]:
        # grad[t] @ b[e].T for each sorted row: act(x)'s gradient before weighting, and (dotted
        # with act(x)) the weights' gradient, so the forward's (rows, n) product need not be kept.
        rows_grad = call("gather_gmm", grad, a["b"], *routing, bins, top_k, not trans_b, first)
        if one_pass:
            scale = None if weights is None else _row_scales(weights, row_routing[0])
            # act(x), the weight gradient's operand, is written over rows_grad (its last use).
            out["x"], dots = call(
                "activation_backward", rows_grad, a["x"], scale, activation, *constants
            )
            x_in = rows_grad
        else:
            identity = _identity(row_routing[0])
            if needs["weights"]:
                dots = _row_dots(call, x_in, rows_grad, identity, row_routing, bins)
            if needs["x"]:
                if weights is not None:
                    scale = _row_scales(weights, row_routing[0])
                    rows_grad = _scale_rows(call, rows_grad, scale, row_routing, bins, identity)
                if activation is not None:
                    rows_grad = activate_backward(rows_grad, a["x"], activation, *constants)
                out["x"] = rows_grad
        if needs["weights"]:
            if a["bias"] is not None:  # bias is kept only for this (its own gradient needs none)
                dots = _with_bias_dots(call, dots, grad, a["bias"], routing, bins, top_k, first)
            n = a["indices"].shape[0]
            out["weights"] = _by_flat_id(dots, row_routing[0], n).to(weights.dtype)
    # The weighted rows of grad, gathered again (transient): per expert summed, bias's gradient,
    # and the GEMM's operand for b (left ungathered where only b's gradient reads them).
    rows: torch.Tensor | GatheredRows
    if needs["bias"]:
        rows = weighted = _weighted_rows(call, grad, routing, weights, bins, top_k, first)
        out["bias"] = bias_ops.group_sums(
            call, weighted, _counts_from_bins(bins, weighted.shape[0])
        )
    elif needs["b"]:
        rows = _sorted_rows(call, grad, routing, weights, bins, top_k, first)
    if needs["b"]:
        if trans_b:  # b[e] is (n, k): rows_e^T @ act(x)_e
            out["b"] = _weight_grad_by_bins(call, a, rows, x_in)
        else:
            out["b"] = _weight_grad_by_bins(call, a, x_in, rows)
    return out


def _with_bias_dots(
    call: Call,
    dots: torch.Tensor,
    grad: torch.Tensor,
    bias: torch.Tensor,
    routing: tuple[torch.Tensor, torch.Tensor],
    bins: torch.Tensor,
    top_k: int,
    first: int | None,
) -> torch.Tensor:
    """``dots[i] + <grad[t], bias[e]>`` for each sorted row i of token t and expert e: the
    bias's share of its weight's gradient, one grouped GEMV of the token rows by bias[e] (a
    gather_gmm with bias as (experts, n, 1) matrices; rows of no expert get 0), summed in
    float32 and rounded once. An FP8 recipe's call runs it unquantized, as the bias's own sums."""
    bias_gemv = getattr(call, "unquantized", call)
    bias_dots = bias_gemv(
        "gather_gmm", grad, bias.unsqueeze(-1), *routing, bins, top_k, False, first
    )
    wide = torch.promote_types(dots.dtype, torch.float32)
    return (dots.to(wide) + bias_dots[:, 0].to(wide)).to(dots.dtype)


def _glu(call: Call, a: Mapping[str, Any], grad: torch.Tensor, needs: Mapping[str, bool]) -> Grads:
    unit = (a["activation"], a["alpha"], a["limit"])
    if torch.is_grad_enabled():  # recorded (double backward): the differentiable definition
        return {"x": glu_backward(grad, a["x"], *unit)}
    return {"x": call("glu_backward", grad, a["x"], *unit)}


def _gmm_weight_grad(
    call: Call, a: Mapping[str, Any], out_grad: torch.Tensor, needs: Mapping[str, bool]
) -> Grads:
    # out[e] = a_e^T grad_e: a_e's gradient is grad_e out_grad[e]^T, grad_e's is a_e out_grad[e].
    out: Grads = {}
    sizes = a["batch_sizes"]
    if needs["a"]:
        out["a"] = call("gmm", a["grad"], out_grad.to(a["grad"].dtype), sizes, True)
    if needs["grad"]:
        out["grad"] = call("gmm", a["a"], out_grad.to(a["a"].dtype), sizes, False)
    return out
