"""The backward rules of Megatron-Core / Transformer Engine permutation (moe_permute and its
family). The row map is integer data: only the rows and the probabilities get gradients."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .base import Call, Grads, _cast


def _moe_permute(
    call: Call, a: Mapping[str, Any], grad: torch.Tensor, needs: Mapping[str, bool]
) -> Grads:
    out: Grads = {}
    row_map, probs = a["row_map"], a["probs"]
    if needs["x"]:  # each token's rows summed back, weighted as they were written
        out["x"] = call("moe_unpermute", grad, row_map, probs)
    if needs["probs"]:  # recorded only in double backward (the probs are kernel level)
        out["probs"] = _cast(call("moe_unpermute_wgrad", grad, a["x"], row_map), probs)
    return out


def _slot_values(values: torch.Tensor, row_map: torch.Tensor) -> torch.Tensor:
    """values[row_map[t, j]] per slot, 0 for a slot that goes nowhere (values is 1-D)."""
    dest = row_map.long()
    valid = (dest >= 0) & (dest < values.shape[0])
    if values.shape[0] == 0:
        return values.new_zeros(row_map.shape)
    return torch.where(valid, values[torch.where(valid, dest, 0)], 0)


def _moe_permute_probs(
    call: Call, a: Mapping[str, Any], grad: torch.Tensor, needs: Mapping[str, bool]
) -> Grads:
    # A (tokens, slots) gather of the output gradient: torch, so double backward records it too.
    return {"probs": _slot_values(grad, a["row_map"])}


def _moe_unpermute(
    call: Call, a: Mapping[str, Any], grad: torch.Tensor, needs: Mapping[str, bool]
) -> Grads:
    out: Grads = {}
    row_map, probs = a["row_map"], a["probs"]
    if needs["x"]:  # the token's gradient at each of its rows, scaled by its merging prob
        out["x"] = call("moe_permute", grad, row_map, probs, a["x.shape"][0])
    if needs["probs"]:
        out["probs"] = _cast(call("moe_unpermute_wgrad", a["x"], grad, row_map), probs)
    return out


def _moe_unpermute_wgrad(
    call: Call, a: Mapping[str, Any], out_grad: torch.Tensor, needs: Mapping[str, bool]
) -> Grads:
    # out[t, j] = <x[row_map[t, j]], grad[t]>: linear in x and in grad.
    out: Grads = {}
    row_map = a["row_map"]
    if needs["x"]:
        out["x"] = call("moe_permute", a["grad"], row_map, out_grad, a["x.shape"][0])
    if needs["grad"]:
        out["grad"] = call("moe_unpermute", a["x"], row_map, out_grad)
    return out


def _moe_sort_chunks(
    call: Call, a: Mapping[str, Any], grad: torch.Tensor, needs: Mapping[str, bool]
) -> Grads:
    # The inverse reordering: the output's chunks (sizes split_sizes[sorted_index]) put back in
    # source order. Computed on the sizes' device without reading them (no host sync).
    sizes, index = a["split_sizes"], a["sorted_index"]
    index = index.to(sizes.device).long()
    chunks = index.shape[0]
    valid = (index >= 0) & (index < chunks)
    safe = torch.where(valid, index, 0)
    out_sizes = torch.where(valid, sizes.long()[safe], 0) if chunks else sizes.long()
    slot = torch.where(valid, index, chunks)  # an out-of-range index lands in a cut-off slot
    positions = torch.arange(chunks, device=sizes.device)
    inverse = torch.full((chunks + 1,), chunks, dtype=torch.int64, device=sizes.device)
    inverse = inverse.scatter_reduce_(0, slot, positions, reduce="amin")[:chunks]
    return {"x": call("moe_sort_chunks", grad, out_sizes, inverse)}
