"""The backward rules of the permutation ops (gather, scatter, their padded and binned forms,
replicate) and of the kernel-level ops their backwards call, with the row helpers they share."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..schema import RowsOption
from .base import Call, Grads, _cast


def _gather(
    call: Call, a: Mapping[str, Any], grad: torch.Tensor, needs: Mapping[str, bool]
) -> Grads:
    # A kernel-level weighted gather (a backward's) is the adjoint of the weighted scatter (which
    # takes every sorted row: those past rows, which the gather did not produce, add nothing).
    out: Grads = {}
    routing = (a["indices"], a["bin_ids"])
    grad = RowsOption.pad(grad, a["indices"].shape[0])
    if needs["x"]:
        out["x"] = call("scatter", grad, *routing, a["weights"], a["bins"], a["top_k"])
    if needs["weights"]:  # recorded only in double backward (the weights are kernel level)
        wgrad = call("scatter_wgrad", grad, a["x"], *routing, a["bins"], a["top_k"])
        out["weights"] = _cast(wgrad, a["weights"])
    return out


def _weighted_rows(
    call: Call,
    grad: torch.Tensor,
    routing: tuple[torch.Tensor, torch.Tensor],
    weights: torch.Tensor | None,
    bins: torch.Tensor,
    top_k: int,
    rows: int | None,
) -> torch.Tensor:
    """grad[indices[i] // top_k] * weights[indices[i]] for each sorted row (the first ``rows``):
    the weighted gather kernel, or, when this backward is itself recorded (double backward), the
    plain gather times the weights through torch, so that the weights' second-order terms are
    recorded too (the gather kernel's weights carry no gradient)."""
    if weights is None or not torch.is_grad_enabled():
        return call("gather", grad, *routing, weights, bins, top_k, rows)
    gathered = call("gather", grad, *routing, None, bins, top_k, rows)
    first = _first_rows(routing, rows)
    return _scale_rows(call, gathered, _row_scales(weights, first[0]), first, bins)


def _first_rows(
    routing: tuple[torch.Tensor, torch.Tensor], rows: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing (indices, bin_ids) of the first ``rows`` sorted rows (all when None)."""
    return routing if rows is None else (routing[0][:rows], routing[1][:rows])


def _scatter(
    call: Call, a: Mapping[str, Any], grad: torch.Tensor, needs: Mapping[str, bool]
) -> Grads:
    out: Grads = {}
    if needs["x"]:
        routing = (a["indices"], a["bin_ids"])
        out["x"] = _weighted_rows(call, grad, routing, a["weights"], a["bins"], a["top_k"], None)
    if needs["weights"]:
        wgrad = call(
            "scatter_wgrad", a["x"], grad, a["indices"], a["bin_ids"], a["bins"], a["top_k"]
        )
        out["weights"] = _cast(wgrad, a["weights"])
    return out


def _padded_gather(
    call: Call, a: Mapping[str, Any], grad: torch.Tensor, needs: Mapping[str, bool]
) -> Grads:
    out: Grads = {}
    layout = (a["indices"], a["bin_ids"])
    bins, padded_bins, top_k = a["bins"], a["padded_bins"], a["top_k"]
    if needs["x"]:
        out["x"] = call("padded_scatter", grad, *layout, a["weights"], bins, padded_bins, top_k)
    if needs["weights"]:  # recorded only in double backward (the weights are kernel level)
        wgrad = call("padded_scatter_wgrad", grad, a["x"], *layout, bins, padded_bins, top_k)
        out["weights"] = _cast(wgrad, a["weights"])
    return out


def _padded_scatter(
    call: Call, a: Mapping[str, Any], grad: torch.Tensor, needs: Mapping[str, bool]
) -> Grads:
    out: Grads = {}
    if needs["x"]:
        out["x"] = call(
            "padded_gather",
            grad,
            a["indices"],
            a["bin_ids"],
            a["weights"],
            a["bins"],
            a["padded_bins"],
            a["top_k"],
        )
    if needs["weights"]:
        wgrad = call(
            "padded_scatter_wgrad",
            a["x"],
            grad,
            a["indices"],
            a["bin_ids"],
            a["bins"],
            a["padded_bins"],
            a["top_k"],
        )
        out["weights"] = _cast(wgrad, a["weights"])
    return out


def _binned_gather(
    call: Call, a: Mapping[str, Any], grad: torch.Tensor, needs: Mapping[str, bool]
) -> Grads:
    out: Grads = {}
    indices, bins, top_k = a["indices"], a["bins"], a["top_k"]
    if needs["x"]:
        out["x"] = call("binned_scatter", grad, indices, a["weights"], bins, top_k)
    if needs["weights"]:  # recorded only in double backward (the weights are kernel level)
        wgrad = call("binned_scatter_wgrad", grad, a["x"], indices, bins, top_k)
        out["weights"] = _cast(wgrad, a["weights"])
    return out


def _binned_scatter(
    call: Call, a: Mapping[str, Any], grad: torch.Tensor, needs: Mapping[str, bool]
) -> Grads:
    out: Grads = {}
    if needs["x"]:
        bin_size = a["x.shape"][1]  # x itself is kept only when weights need a gradient
        out["x"] = call(
            "binned_gather", grad, a["indices"], a["weights"], a["bins"], bin_size, a["top_k"]
        )
    if needs["weights"]:
        wgrad = call("binned_scatter_wgrad", a["x"], grad, a["indices"], a["bins"], a["top_k"])
        out["weights"] = _cast(wgrad, a["weights"])
    return out


def _replicate(
    call: Call, a: Mapping[str, Any], grad: torch.Tensor, needs: Mapping[str, bool]
) -> Grads:
    return {"x": call("replicate_backward", grad, a["bins"])}


def _row_scales(weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """weights[indices[i]] for each sorted row i; 0 for an id out of range (bad data stays inside
    weights)."""
    flat = indices.long()
    valid = (flat >= 0) & (flat < weights.shape[0])
    return torch.where(valid, weights.index_select(0, torch.where(valid, flat, 0)), 0)


def _identity(indices: torch.Tensor) -> torch.Tensor:
    """Sorted row i named by flat id i: the routing's own layout (bins, bin_ids) over rows that
    are already sorted, for the ops that take one row per token with top_k 1. Shares the
    indices' dtype (and its row limit)."""
    return torch.arange(indices.shape[0], device=indices.device, dtype=indices.dtype)


def _scale_rows(
    call: Call,
    rows: torch.Tensor,
    scale: torch.Tensor,
    routing: tuple[torch.Tensor, ...],
    bins: torch.Tensor,
    identity: torch.Tensor | None = None,
) -> torch.Tensor:
    """rows[i] * scale[i]: a weighted gather with identity indices and top_k 1 (a row-broadcast
    multiply runs on torch's unvectorised strided path at about half the bandwidth). When this
    backward is itself recorded (double backward), torch's multiply instead, so that the scale's
    gradient is recorded too (the gather kernel's weights carry none)."""
    if torch.is_grad_enabled():
        return rows * scale.to(rows.dtype).unsqueeze(1)
    if identity is None:
        identity = _identity(routing[0])
    return call("gather", rows, identity, routing[1], scale, bins, 1)


# The kernel-level ops a backward calls are differentiable too, so that a backward recorded for
# double backward (create_graph=True) carries every second-order term on every backend. Each is
# linear in each of its float inputs; its rule is the adjoint. ``out_grad`` is the cotangent (the
# ops' own "grad" argument is one of their inputs).


def _scatter_wgrad(
    call: Call, a: Mapping[str, Any], out_grad: torch.Tensor, needs: Mapping[str, bool]
) -> Grads:
    # out[indices[i]] = <x[i], grad[indices[i] // top_k]>
    out: Grads = {}
    routing, bins, top_k = (a["indices"], a["bin_ids"]), a["bins"], a["top_k"]
    if needs["x"]:
        out["x"] = _weighted_rows(call, a["grad"], routing, out_grad, bins, top_k, None)
    if needs["grad"]:
        out["grad"] = call("scatter", a["x"], *routing, out_grad, bins, top_k)
    return out


def _padded_scatter_wgrad(
    call: Call, a: Mapping[str, Any], out_grad: torch.Tensor, needs: Mapping[str, bool]
) -> Grads:
    out: Grads = {}
    layout = (a["indices"], a["bin_ids"], out_grad, a["bins"], a["padded_bins"], a["top_k"])
    if needs["x"]:
        out["x"] = call("padded_gather", a["grad"], *layout)
    if needs["grad"]:
        out["grad"] = call("padded_scatter", a["x"], *layout)
    return out


def _binned_scatter_wgrad(
    call: Call, a: Mapping[str, Any], out_grad: torch.Tensor, needs: Mapping[str, bool]
) -> Grads:
    out: Grads = {}
    indices, bins, top_k = a["indices"], a["bins"], a["top_k"]
    if needs["x"]:
        bin_size = a["x.shape"][1]
        out["x"] = call("binned_gather", a["grad"], indices, out_grad, bins, bin_size, top_k)
    if needs["grad"]:
        out["grad"] = call("binned_scatter", a["x"], indices, out_grad, bins, top_k)
    return out


def _replicate_backward(
    call: Call, a: Mapping[str, Any], out_grad: torch.Tensor, needs: Mapping[str, bool]
) -> Grads:
    return {"grad": call("replicate", out_grad, a["bins"], a["grad.shape"][1])}
