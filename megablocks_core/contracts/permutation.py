"""The permutation ops' contracts: gather and scatter, their padded and binned forms, and the
weight gradients of the scatters.
"""

from __future__ import annotations

from ..schema import DataDim, IntArg, OpContract, Output, Rule
from .common import (
    BIN_IDS,
    BINNED_BAD_LAYOUT,
    BINNED_ROWS,
    BINNED_RULES,
    BINS,
    EMPTY_AND_ZERO,
    FP32_ACCUMULATION,
    GATHER_BAD_INDICES,
    GATHER_ROWS,
    GATHER_WEIGHTS,
    GRAD_DTYPE,
    GRAD_HIDDEN,
    GRAD_TOKENS,
    INDICES,
    INDICES_FIT,
    LAYOUT_BAD_READS,
    LAYOUT_FROM_BINS,
    PADDED_BAD_LAYOUT,
    PADDED_BINS,
    PADDED_LENGTH,
    PADDED_NEGATIVE_END,
    PADDED_ROWS,
    PADDED_RULES,
    PAST_BINS,
    PERMUTATION_RULES,
    ROWS_OUT,
    ROWS_OUT_DIM,
    ROWS_WITHIN,
    SAME_LENGTH,
    SCATTER_BAD_INDICES,
    SORTED_ROWS,
    SORTED_ROWS_MATCH,
    TOKEN_GRAD,
    TOKENS,
    TOKENS_OUT,
    TOP_K,
    UNROUTED_PERMUTATION_RULES,
    WEIGHTS,
    WGRAD_BAD_INDICES,
    WGRAD_OUT,
    WHOLE_TOKENS,
)

# ---------------------------------------------------------------------------
# Permutation

GATHER = OpContract(
    name="gather",
    family="permutation",
    summary="Copy each token's row to its top_k rows in expert-sorted order.",
    args=(TOKENS, INDICES, BIN_IDS, GATHER_WEIGHTS, BINS, TOP_K, ROWS_OUT),
    rules=(GATHER_ROWS, *UNROUTED_PERMUTATION_RULES, ROWS_WITHIN),
    outputs=(Output("out", "x.dtype", (ROWS_OUT_DIM, "x.shape[1]"), "expert-sorted rows"),),
    differentiable=("x", "weights"),
    semantics="out[i] = x[indices[i] // top_k] (times weights[indices[i]] at kernel level), for "
    "i < rows (all sorted rows without rows). "
    + PAST_BINS
    + ": they are gathered like any other row (bins only describe the layout). "
    + FP32_ACCUMULATION,
    edge_cases=(*EMPTY_AND_ZERO, GATHER_BAD_INDICES),
)

SCATTER = OpContract(
    name="scatter",
    family="permutation",
    summary="Sum each token's top_k expert rows back into one row, optionally weighted.",
    args=(SORTED_ROWS, INDICES, BIN_IDS, WEIGHTS, BINS, TOP_K),
    rules=(SORTED_ROWS_MATCH, *UNROUTED_PERMUTATION_RULES),
    outputs=(TOKENS_OUT,),
    differentiable=("x", "weights"),
    semantics=(
        "out[t] = sum over k of weights[t*top_k + k] * x[i], where indices[i] = t*top_k + k. "
        + PAST_BINS
        + ": they are summed like any other row (bins only describe the layout). "
        + FP32_ACCUMULATION
    ),
    edge_cases=(*EMPTY_AND_ZERO, SCATTER_BAD_INDICES),
)

SCATTER_WGRAD = OpContract(
    name="scatter_wgrad",
    family="permutation",
    public=False,
    summary="Gradient of scatter with respect to its weights.",
    args=(SORTED_ROWS, TOKEN_GRAD, INDICES, BIN_IDS, BINS, TOP_K),
    rules=(
        SORTED_ROWS_MATCH,
        GRAD_TOKENS,
        GRAD_HIDDEN,
        GRAD_DTYPE,
        SAME_LENGTH,
        WHOLE_TOKENS,
        INDICES_FIT,
    ),
    outputs=(WGRAD_OUT,),
    differentiable=("x", "grad"),
    semantics="out[indices[i]] = dot(x[i], grad[indices[i] // top_k]), accumulated in float32.",
    edge_cases=(*EMPTY_AND_ZERO, WGRAD_BAD_INDICES),
)

PADDED_GATHER = OpContract(
    name="padded_gather",
    family="permutation",
    summary="Gather into expert segments padded to padded_bins, with zero padding rows.",
    args=(TOKENS, INDICES, BIN_IDS, GATHER_WEIGHTS, BINS, PADDED_BINS, TOP_K),
    rules=(GATHER_ROWS, *PERMUTATION_RULES, *PADDED_RULES),
    outputs=(
        Output(
            "out",
            "x.dtype",
            (DataDim("last(padded_bins)"), "x.shape[1]"),
            "rows = padded_bins[-1], read on the host",
        ),
    ),
    differentiable=("x", "weights"),
    semantics=(
        "Sorted row i of expert e = bin_ids[i] lands at padded_bins[e-1] + (i - bins[e-1]); "
        "rows no token lands on are 0. " + LAYOUT_FROM_BINS + " " + FP32_ACCUMULATION
    ),
    edge_cases=(
        *EMPTY_AND_ZERO,
        "no experts: empty output",
        GATHER_BAD_INDICES,
        PADDED_BAD_LAYOUT,
        PADDED_NEGATIVE_END,
    ),
    deviations=(
        "The output row count is read from padded_bins on the host (a sync), as in MegaBlocks.",
    ),
)

PADDED_SCATTER = OpContract(
    name="padded_scatter",
    family="permutation",
    summary="Scatter from padded expert segments back to tokens, optionally weighted.",
    args=(PADDED_ROWS, INDICES, BIN_IDS, WEIGHTS, BINS, PADDED_BINS, TOP_K),
    rules=(
        *PERMUTATION_RULES,
        *PADDED_RULES,
        Rule("x.shape[0] == last(padded_bins)", "x has padded_bins[-1] rows", checked=True),
    ),
    outputs=(TOKENS_OUT,),
    differentiable=("x", "weights"),
    semantics="As scatter, reading the row each (token, k) was padded_gather'ed to. "
    + FP32_ACCUMULATION,
    edge_cases=(
        *EMPTY_AND_ZERO,
        "padding rows are never read",
        SCATTER_BAD_INDICES,
        LAYOUT_BAD_READS,
    ),
)

PADDED_SCATTER_WGRAD = OpContract(
    name="padded_scatter_wgrad",
    family="permutation",
    public=False,
    summary="Gradient of padded_scatter with respect to its weights.",
    args=(PADDED_ROWS, TOKEN_GRAD, INDICES, BIN_IDS, BINS, PADDED_BINS, TOP_K),
    rules=(
        GRAD_TOKENS,
        GRAD_HIDDEN,
        GRAD_DTYPE,
        SAME_LENGTH,
        WHOLE_TOKENS,
        INDICES_FIT,
        PADDED_LENGTH,
    ),
    outputs=(WGRAD_OUT,),
    differentiable=("x", "grad"),
    semantics="As scatter_wgrad, reading padded rows. Accumulated in float32.",
    edge_cases=(*EMPTY_AND_ZERO, WGRAD_BAD_INDICES, LAYOUT_BAD_READS),
)

BINNED_GATHER = OpContract(
    name="binned_gather",
    family="permutation",
    summary="Gather into fixed-capacity expert bins, dropping rows beyond capacity.",
    args=(
        TOKENS,
        INDICES,
        GATHER_WEIGHTS,
        BINS,
        IntArg("bin_size", "capacity per expert", min=0),
        TOP_K,
    ),
    rules=(GATHER_ROWS, *BINNED_RULES),
    outputs=(Output("out", "x.dtype", ("bins.shape[0]", "bin_size", "x.shape[1]"), "zero-filled"),),
    differentiable=("x", "weights"),
    semantics=(
        "out[e, j] = x[indices[bins[e-1] + j] // top_k] for j < min(bin_size, rows of e); "
        "other rows are 0. " + FP32_ACCUMULATION
    ),
    edge_cases=(
        *EMPTY_AND_ZERO,
        "rows beyond bin_size are dropped",
        "bin_size = 0: empty bins",
        GATHER_BAD_INDICES,
        BINNED_BAD_LAYOUT,
    ),
)

BINNED_SCATTER = OpContract(
    name="binned_scatter",
    family="permutation",
    summary="Scatter from expert bins back to tokens, optionally weighted; dropped rows contribute 0.",
    args=(BINNED_ROWS, INDICES, WEIGHTS, BINS, TOP_K),
    rules=(Rule("x.shape[0] == bins.shape[0]", "one bin of x per expert"), *BINNED_RULES),
    outputs=(TOKENS_OUT,),
    differentiable=("x", "weights"),
    semantics="out[t] = sum over kept k of weights[t*top_k + k] * x[e, j]. " + FP32_ACCUMULATION,
    edge_cases=(
        *EMPTY_AND_ZERO,
        "a token whose rows were all dropped gets 0",
        SCATTER_BAD_INDICES,
        LAYOUT_BAD_READS,
    ),
)

BINNED_SCATTER_WGRAD = OpContract(
    name="binned_scatter_wgrad",
    family="permutation",
    public=False,
    summary="Gradient of binned_scatter with respect to its weights.",
    args=(BINNED_ROWS, TOKEN_GRAD, INDICES, BINS, TOP_K),
    rules=(
        Rule("x.shape[0] == bins.shape[0]", "one bin of x per expert"),
        GRAD_TOKENS,
        GRAD_HIDDEN,
        GRAD_DTYPE,
        WHOLE_TOKENS,
        INDICES_FIT,
    ),
    outputs=(WGRAD_OUT,),
    differentiable=("x", "grad"),
    semantics="As scatter_wgrad for kept rows; dropped rows get 0. Accumulated in float32.",
    edge_cases=(*EMPTY_AND_ZERO, "dropped rows get exactly 0", WGRAD_BAD_INDICES, LAYOUT_BAD_READS),
)
