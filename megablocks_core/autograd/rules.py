"""Op name → its backward rule (:data:`RULES`): every differentiable op's rule, gathered from the
families' modules."""

from __future__ import annotations

from .base import BackwardRule
from .gmm import _gather_gmm, _glu, _gmm, _gmm_scatter, _gmm_weight_grad
from .moe_permute import (
    _moe_permute,
    _moe_permute_probs,
    _moe_sort_chunks,
    _moe_unpermute,
    _moe_unpermute_wgrad,
)
from .permutation import (
    _binned_gather,
    _binned_scatter,
    _binned_scatter_wgrad,
    _gather,
    _padded_gather,
    _padded_scatter,
    _padded_scatter_wgrad,
    _replicate,
    _replicate_backward,
    _scatter,
    _scatter_wgrad,
)

ROUTING_SAVES = ("indices", "bin_ids", "bins")

#: Op name → its backward rule. Every differentiable contract has one (a test checks).
RULES: dict[str, BackwardRule] = {
    "gather": BackwardRule(_gather, (*ROUTING_SAVES, "weights"), {"x": "weights"}),
    "scatter": BackwardRule(_scatter, (*ROUTING_SAVES, "weights"), {"x": "weights"}),
    "scatter_wgrad": BackwardRule(_scatter_wgrad, ROUTING_SAVES, {"x": "grad", "grad": "x"}),
    "padded_gather": BackwardRule(
        _padded_gather, (*ROUTING_SAVES, "weights", "padded_bins"), {"x": "weights"}
    ),
    "padded_scatter": BackwardRule(
        _padded_scatter, (*ROUTING_SAVES, "weights", "padded_bins"), {"x": "weights"}
    ),
    "padded_scatter_wgrad": BackwardRule(
        _padded_scatter_wgrad, (*ROUTING_SAVES, "padded_bins"), {"x": "grad", "grad": "x"}
    ),
    "binned_gather": BackwardRule(_binned_gather, ("indices", "weights", "bins"), {"x": "weights"}),
    "binned_scatter": BackwardRule(
        _binned_scatter, ("indices", "weights", "bins"), {"x": "weights"}
    ),
    "binned_scatter_wgrad": BackwardRule(
        _binned_scatter_wgrad, ("indices", "bins"), {"x": "grad", "grad": "x"}
    ),
    "replicate": BackwardRule(_replicate, ("bins",)),
    "replicate_backward": BackwardRule(_replicate_backward, ("bins",)),
    "gmm_weight_grad": BackwardRule(_gmm_weight_grad, ("batch_sizes",), {"a": "grad", "grad": "a"}),
    "gmm": BackwardRule(_gmm, ("batch_sizes",), {"a": "b", "b": "a"}, fusable=("b",)),
    "gather_gmm": BackwardRule(_gather_gmm, ROUTING_SAVES, {"x": "b", "b": "x"}, fusable=("b",)),
    # x is needed for b's gradient and for the weights' (<x[i], grad[t] @ b[e].T>).
    # With an activation, x (the pre-activation rows) is also needed for its own gradient.
    "gmm_scatter": BackwardRule(
        _gmm_scatter,
        (*ROUTING_SAVES, "weights"),
        {"x": ("b", "weights"), "b": ("x", "weights"), "bias": "weights"},
        saves_if_set={"x": ("activation", "x")},
        fusable=("b",),
    ),
    "glu": BackwardRule(_glu, ("x",)),
}

RULES.update(
    {
        "moe_permute": BackwardRule(_moe_permute, ("row_map", "probs"), {"x": "probs"}),
        "moe_permute_probs": BackwardRule(_moe_permute_probs, ("row_map",)),
        "moe_unpermute": BackwardRule(_moe_unpermute, ("row_map", "probs"), {"x": "probs"}),
        "moe_unpermute_wgrad": BackwardRule(
            _moe_unpermute_wgrad, ("row_map",), {"x": "grad", "grad": "x"}
        ),
        "moe_sort_chunks": BackwardRule(_moe_sort_chunks, ("split_sizes", "sorted_index")),
    }
)
