"""Backward rules: the core's autograd, written once for every backend.

Each rule receives ``call(op, *args)``, which runs another op through the
registry (kernel-order arguments), and the forward's arguments by name (those
not kept are None; ``"<name>.shape"`` gives each tensor argument's shape). So a
backend that supplies only forward kernels is autograd-correct. The same rules serve eager autograd
(:mod:`megablocks_core.dispatch`) and ``torch.compile``
(:mod:`megablocks_core.library`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

Call = Callable[..., torch.Tensor]
Grads = dict[str, "torch.Tensor | None"]


@dataclass(frozen=True)
class BackwardRule:
    fn: Callable[[Call, Mapping[str, Any], torch.Tensor, Mapping[str, bool]], Grads]
    saves: tuple[str, ...]
    """Tensor arguments the backward reads (others are not kept alive)."""
    saves_if: Mapping[str, str] = field(default_factory=dict)
    """Argument → the input whose gradient needs it (``x`` only if ``weights`` needs grad)."""


def _cast(t: torch.Tensor | None, like: torch.Tensor | None) -> torch.Tensor | None:
    return t if t is None or like is None else t.to(like.dtype)


def _gather(call: Call, a: Mapping[str, Any], grad: torch.Tensor, needs: Mapping[str, bool]) -> Grads:
    return {"x": call("scatter", grad, a["indices"], a["bin_ids"], None, a["bins"], a["top_k"])}


def _scatter(call: Call, a: Mapping[str, Any], grad: torch.Tensor, needs: Mapping[str, bool]) -> Grads:
    out: Grads = {}
    if needs["x"]:
        out["x"] = call("gather", grad, a["indices"], a["bin_ids"], a["weights"], a["bins"], a["top_k"])
    if needs["weights"]:
        wgrad = call("scatter_wgrad", a["x"], grad, a["indices"], a["bin_ids"], a["bins"], a["top_k"])
        out["weights"] = _cast(wgrad, a["weights"])
    return out


def _padded_gather(call: Call, a: Mapping[str, Any], grad: torch.Tensor, needs: Mapping[str, bool]) -> Grads:
    return {"x": call("padded_scatter", grad, a["indices"], a["bin_ids"], None, a["bins"],
                      a["padded_bins"], a["top_k"])}


def _padded_scatter(call: Call, a: Mapping[str, Any], grad: torch.Tensor, needs: Mapping[str, bool]) -> Grads:
    out: Grads = {}
    if needs["x"]:
        out["x"] = call("padded_gather", grad, a["indices"], a["bin_ids"], a["weights"], a["bins"],
                        a["padded_bins"], a["top_k"])
    if needs["weights"]:
        wgrad = call("padded_scatter_wgrad", a["x"], grad, a["indices"], a["bin_ids"], a["bins"],
                     a["padded_bins"], a["top_k"])
        out["weights"] = _cast(wgrad, a["weights"])
    return out


def _binned_gather(call: Call, a: Mapping[str, Any], grad: torch.Tensor, needs: Mapping[str, bool]) -> Grads:
    return {"x": call("binned_scatter", grad, a["indices"], None, a["bins"], a["top_k"])}


def _binned_scatter(call: Call, a: Mapping[str, Any], grad: torch.Tensor, needs: Mapping[str, bool]) -> Grads:
    out: Grads = {}
    if needs["x"]:
        bin_size = a["x.shape"][1]  # x itself is kept only when weights need a gradient
        out["x"] = call("binned_gather", grad, a["indices"], a["weights"], a["bins"], bin_size, a["top_k"])
    if needs["weights"]:
        wgrad = call("binned_scatter_wgrad", a["x"], grad, a["indices"], a["bins"], a["top_k"])
        out["weights"] = _cast(wgrad, a["weights"])
    return out


def _replicate(call: Call, a: Mapping[str, Any], grad: torch.Tensor, needs: Mapping[str, bool]) -> Grads:
    return {"x": call("replicate_backward", grad, a["bins"])}


def _gmm(call: Call, a: Mapping[str, Any], grad: torch.Tensor, needs: Mapping[str, bool]) -> Grads:
    out: Grads = {}
    trans_b = a["trans_b"]
    if needs["a"]:
        out["a"] = call("gmm", grad, a["b"], a["batch_sizes"], not trans_b)
    if needs["b"]:
        if trans_b:  # b[e] is (n, k): its gradient is grad_e^T a_e
            out["b"] = call("gmm_weight_grad", grad, a["a"], a["batch_sizes"])
        else:
            out["b"] = call("gmm_weight_grad", a["a"], grad, a["batch_sizes"])
    return out


ROUTING_SAVES = ("indices", "bin_ids", "bins")

#: Op name → its backward rule. Every differentiable contract has one (a test checks).
RULES: dict[str, BackwardRule] = {
    "gather": BackwardRule(_gather, ROUTING_SAVES),
    "scatter": BackwardRule(_scatter, (*ROUTING_SAVES, "weights"), {"x": "weights"}),
    "padded_gather": BackwardRule(_padded_gather, (*ROUTING_SAVES, "padded_bins")),
    "padded_scatter": BackwardRule(_padded_scatter, (*ROUTING_SAVES, "weights", "padded_bins"),
                                   {"x": "weights"}),
    "binned_gather": BackwardRule(_binned_gather, ("indices", "bins")),
    "binned_scatter": BackwardRule(_binned_scatter, ("indices", "weights", "bins"), {"x": "weights"}),
    "replicate": BackwardRule(_replicate, ("bins",)),
    "gmm": BackwardRule(_gmm, ("batch_sizes",), {"a": "b", "b": "a"}),
}


def kept(rule: BackwardRule, name: str, needs: Mapping[str, bool]) -> bool:
    """Whether the forward must keep argument ``name`` for this backward."""
    if name in rule.saves:
        return True
    dependant = rule.saves_if.get(name)
    return dependant is not None and needs.get(dependant, False)
