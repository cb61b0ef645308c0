"""Every op's contract, written once.

Read an entry top to bottom to know an op: its arguments (dtype, rank), the
rules relating them, what it returns, which inputs get gradients, edge cases,
and where it knowingly differs from MegaBlocks. Validation, fake (meta)
implementations, docs/contracts.md and the conformance kit are all derived
from these entries; nothing else describes an op.

Argument order is the kernel order: a backend's kernel receives exactly these
arguments, positionally. Public ops (``megablocks_core.ops``) take the same
arguments minus those marked ``public=False`` (passed as None).
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import bias as bias_ops
from .activations import GATED, GLU_NAMES, ROW_NAMES, activate_with
from .schema import (
    COUNT_DTYPES,
    FLOAT_DTYPES,
    INT_DTYPES,
    BoolArg,
    ChoiceArg,
    DataDim,
    IntArg,
    OpContract,
    Output,
    RowsOption,
    Rule,
    SequenceArg,
    TensorArg,
)

ANY_DTYPE: frozenset = frozenset()  # an empty set means "any dtype"

# ---------------------------------------------------------------------------
# Arguments shared by many ops: one definition each.

INDICES = TensorArg(
    "indices",
    INT_DTYPES,
    (1,),
    "flat id (token * top_k + k) of each row, in expert-sorted order; length tokens * top_k",
)
BIN_IDS = TensorArg("bin_ids", INT_DTYPES, (1,), "expert of each sorted row; length tokens * top_k")
BINS = TensorArg(
    "bins",
    INT_DTYPES,
    (1,),
    "inclusive cumsum of tokens per expert (end offset of each expert in sorted order); length experts",
)
PADDED_BINS = TensorArg(
    "padded_bins",
    INT_DTYPES,
    (1,),
    "inclusive cumsum of per-expert token counts rounded up to the block size; length experts",
)
WEIGHTS = TensorArg(
    "weights",
    FLOAT_DTYPES,
    (1,),
    "per-(token, k) scale indexed by flat id, length tokens * top_k; None means 1",
    optional=True,
)
# Gathers take weights only at kernel level: the backward of a weighted scatter
# is a weighted gather, so kernels must support it; the public op passes None.
GATHER_WEIGHTS = TensorArg(
    WEIGHTS.name,
    WEIGHTS.dtypes,
    WEIGHTS.ndim,
    "optional per-row scale (kernel level only: used by scatter's backward)",
    optional=True,
    public=False,
)
TOP_K = IntArg("top_k", "experts per token", min=1)
TOKENS = TensorArg("x", FLOAT_DTYPES, (2,), "token rows, (tokens, hidden)")
SORTED_ROWS = TensorArg(
    "x", FLOAT_DTYPES, (2,), "rows in expert-sorted order, (tokens * top_k, hidden)"
)
PADDED_ROWS = TensorArg(
    "x", FLOAT_DTYPES, (2,), "rows in padded expert order, (padded_bins[-1], hidden)"
)
BINNED_ROWS = TensorArg("x", FLOAT_DTYPES, (3,), "rows per expert bin, (experts, bin_size, hidden)")
TOKEN_GRAD = TensorArg(
    "grad", FLOAT_DTYPES, (2,), "gradient of the scatter output, (tokens, hidden)"
)

# Rules shared by the permutation ops.
SAME_LENGTH = Rule("indices.shape[0] == bin_ids.shape[0]", "one expert id per sorted row")
WHOLE_TOKENS = Rule("indices.shape[0] % top_k == 0", "every token has exactly top_k rows")
WEIGHTS_LENGTH = Rule(
    "weights is None or weights.shape[0] == indices.shape[0]", "one weight per (token, k) pair"
)


def int16_fits(arg: str, why: str) -> Rule:
    """int16 positions run 0..32767, so int16 can address at most 32768 rows: reject more rather than wrap."""
    return Rule(f"{arg}.dtype != torch.int16 or {arg}.shape[0] <= 32768", why)


INDICES_FIT = int16_fits(
    "indices", "int16 indices cannot address more than 32768 rows (MegaBlocks would wrap silently)"
)
PADDED_LENGTH = Rule("padded_bins.shape[0] == bins.shape[0]", "one padded bin per expert")
GATHER_ROWS = Rule(
    "x.shape[0] * top_k == indices.shape[0]", "indices has top_k entries per row of x"
)
SORTED_ROWS_MATCH = Rule(
    "x.shape[0] == indices.shape[0]", "one row of x per sorted (token, k) pair"
)
GRAD_TOKENS = Rule("grad.shape[0] * top_k == indices.shape[0]", "grad has one row per token")
GRAD_HIDDEN = Rule("grad.shape[1] == x.shape[-1]", "grad and x have the same hidden size")
GRAD_DTYPE = Rule("grad.dtype == x.dtype", "grad and x have the same dtype", error=TypeError)

IS_PERMUTATION = Rule(
    "is_permutation(indices)", "indices is a permutation of range(tokens * top_k)", checked=True
)
BINS_SORTED = Rule("nondecreasing(bins)", "bins is a cumulative sum", checked=True)
BINS_TOTAL = Rule("last(bins) == indices.shape[0]", "bins ends at the number of rows", checked=True)
# Ops that read rows by their flat ids (not by layout) also take sorted rows past bins[-1]: rows
# routed to no expert, e.g. the (token, k) pairs whose expert lives on another rank (expert
# parallelism routes them to a sentinel bin one past the last, then drops that bin).
BINS_WITHIN = Rule(
    "last(bins) <= indices.shape[0]",
    "bins end at or before the last sorted row (rows past bins[-1] belong to no expert)",
    checked=True,
)
BIN_IDS_MATCH = Rule("bins_match(bin_ids, bins)", "bin_ids agrees with bins", checked=True)
PADDED_SORTED = Rule("nondecreasing(padded_bins)", "padded_bins is a cumulative sum", checked=True)
PADDED_FITS = Rule(
    "fits(padded_bins, bins)", "each padded bin holds its expert's rows", checked=True
)

PERMUTATION_RULES = (
    SAME_LENGTH,
    WHOLE_TOKENS,
    WEIGHTS_LENGTH,
    INDICES_FIT,
    IS_PERMUTATION,
    BINS_SORTED,
    BINS_TOTAL,
    BIN_IDS_MATCH,
)
#: gather, scatter and gmm_scatter: as PERMUTATION_RULES, but bins may end before the last row.
UNROUTED_PERMUTATION_RULES = tuple(
    BINS_WITHIN if rule is BINS_TOTAL else rule for rule in PERMUTATION_RULES
)
PADDED_RULES = (PADDED_LENGTH, PADDED_SORTED, PADDED_FITS)
BINNED_RULES = (WHOLE_TOKENS, WEIGHTS_LENGTH, INDICES_FIT, IS_PERMUTATION, BINS_SORTED, BINS_TOTAL)

TOKENS_OUT = Output(
    "out", "x.dtype", ("indices.shape[0] // top_k", "x.shape[-1]"), "one row per token"
)
WGRAD_OUT = Output("weights_grad", "x.dtype", ("indices.shape[0]",), "indexed by flat id")

#: What sorted rows past bins[-1] are (their bin_ids hold the number of experts: a sentinel bin
#: that sorts last, which bins_match expects).
PAST_BINS = (
    "Sorted rows past bins[-1] belong to no expert (bins[-1] < tokens * top_k is valid; their "
    "bin_ids are the number of experts, a sentinel bin that sorts last)"
)
#: The row-count option of the ops that produce or take expert-sorted rows: the first ``rows``
#: sorted rows only, those past them belonging to no expert (expert parallelism's pairs of
#: other ranks' experts, which sort last), so that nothing is computed, written or kept for them.
ROWS_OUT = IntArg(
    "rows",
    "compute only the first rows sorted rows (rows past bins[-1] belong to no expert: a caller "
    "that knows how many pairs are routed need not have the rest); None: all of them",
    min=0,
    optional=True,
    option=RowsOption(total="indices.shape[0]"),
)
ROWS_IN = IntArg(
    "rows",
    "x holds only the first rows sorted rows (the rest belong to no expert: as gather_gmm's rows); "
    "None: all of them",
    min=0,
    optional=True,
    option=RowsOption(total="indices.shape[0]", pads="x"),
)
ROWS_WITHIN = Rule(
    "rows is None or rows <= indices.shape[0]", "rows counts sorted rows (at most one per pair)"
)
ROWS_COVER_BINS = Rule(
    "rows is None or last(bins) <= rows",
    "rows reaches bins[-1] (only the rows past bins[-1] belong to no expert)",
    checked=True,
)
ROWS_OUT_DIM = "indices.shape[0] if rows is None else rows"
FIRST_ROWS = (
    "With rows, only the first rows sorted rows exist (output rows i < rows); the pairs past "
    "them contribute nothing."
)

EMPTY_AND_ZERO = (
    "zero tokens: empty outputs, no kernel needs to run",
    "empty experts: contribute no rows",
)
FP32_ACCUMULATION = "Weighting and summation accumulate in float32 (float64 for float64 data)."

# Bad data: what each op returns for data that breaks its checked rules. Those rules run only in
# checked mode (MEGABLOCKS_CHECK=1), so this data reaches the kernels; every backend must stay
# inside its tensors and write every output element (see docs/writing-a-plugin.md).
UNCHECKED = "bad data (unchecked unless MEGABLOCKS_CHECK=1; never an out-of-bounds access or an unwritten element): "
GATHER_BAD_INDICES = (
    UNCHECKED + "indices not a permutation: a row whose flat id is in [0, tokens * top_k) gets "
    "x[id // top_k] (weighted), duplicate ids included; a row whose id is out of range (negative "
    "too) is 0"
)
SCATTER_BAD_INDICES = (
    UNCHECKED + "indices not a permutation: each (token, k) reads one of the rows naming its "
    "flat id (which one is unspecified when several do) and contributes 0 when none does; ids "
    "out of range are ignored"
)
WGRAD_BAD_INDICES = (
    UNCHECKED + "indices not a permutation: out[f] uses one of the rows naming f (unspecified "
    "which), 0 when none does; ids out of range are ignored"
)
LAYOUT_FROM_BINS = (
    "The expert of sorted row i is the e with bins[e-1] <= i < bins[e]; bin_ids must agree with "
    "bins (checked mode checks it) and a backend may read either; where they disagree, a copy "
    "of a padded scatter (or of its weight gradient) may contribute 0."
)
PADDED_BAD_LAYOUT = (
    UNCHECKED + "bins or padded_bins not cumulative sums, or a padded bin too small for its "
    "rows: every element is 0 or the element of a (weighted) row of x, which row lands where is "
    "unspecified; rows placed outside the output are dropped"
)
PADDED_NEGATIVE_END = "padded_bins[-1] < 0 (it is the output's row count): ContractError"
LAYOUT_BAD_READS = (
    UNCHECKED + "bins or padded_bins not cumulative sums (or x with fewer rows than they say): "
    "each (token, k) reads some row of x or contributes 0; nothing outside x is read"
)
BINNED_BAD_LAYOUT = (
    UNCHECKED + "bins not a cumulative sum: every element is 0 or the element of a (weighted) "
    "row of x, which row lands where is unspecified; bins past the rows (bins[-1] > rows) leave "
    "the missing rows 0"
)

# ---------------------------------------------------------------------------
# Routing

SORT = OpContract(
    name="sort",
    family="routing",
    summary="Stable ascending sort of integer keys, returning the values and their source positions.",
    args=(
        TensorArg("x", INT_DTYPES, (1,), "keys, e.g. the flattened top-k expert ids"),
        IntArg(
            "end_bit",
            "keys lie in [0, 2**end_bit); None means the dtype's full width",
            min=0,
            max=64,
            optional=True,
        ),
    ),
    rules=(
        Rule(
            "end_bit is None or end_bit <= torch.iinfo(x.dtype).bits", "end_bit fits the key dtype"
        ),
        int16_fits("x", "int16 indices cannot address more than 32768 keys"),
        Rule(
            "x.dtype != torch.int32 or x.shape[0] <= 2**31",
            "int32 indices cannot address more than 2**31 keys",
        ),
        Rule(
            "end_bit is None or in_range(x, 0, 1 << end_bit)",
            "keys lie in [0, 2**end_bit)",
            checked=True,
        ),
    ),
    outputs=(
        Output("values", "x.dtype", ("x.shape[0]",), "keys in ascending order"),
        Output("indices", "x.dtype", ("x.shape[0]",), "position in x of each sorted key"),
    ),
    semantics="Equal keys keep their input order (stable), so the result is deterministic.",
    edge_cases=(
        "empty input: empty outputs",
        UNCHECKED + "keys outside [0, 2**end_bit): indices is still a permutation and "
        "values = x[indices]; their order is unspecified",
    ),
    deviations=(
        "int16 keys longer than 32768 are rejected; MegaBlocks returns wrapped int16 indices.",
    ),
)

HISTOGRAM = OpContract(
    name="histogram",
    family="routing",
    summary="Count how many keys fall in each bin [i, i + 1).",
    args=(
        TensorArg("x", INT_DTYPES, (1, 2), "keys, (n,) or a batch of rows (batch, n)"),
        IntArg("num_bins", "number of bins (experts)", min=0),
    ),
    rules=(Rule("x.numel() < 2**31", "counts are int32"),),
    outputs=(
        Output("counts", "torch.int32", "(*x.shape[:-1], num_bins)", "per row for 2-D input"),
    ),
    semantics="Keys outside [0, num_bins) are not counted.",
    edge_cases=("empty input: all-zero counts", "num_bins = 0: empty counts"),
    deviations=(
        "The bin count is an int named num_bins (MegaBlocks types it as a float max_val).",
    ),
)

_CUMSUM_ARGS = (
    TensorArg("x", INT_DTYPES, (1, 2), "integer counts, (n,) or (batch, n)"),
    IntArg("dim", "dimension to sum along"),
)
_CUMSUM_RULES = (
    Rule("-x.dim() <= dim < x.dim()", "dim is a dimension of x"),
    Rule("cumsum_fits(x, dim)", "the running sums fit x's dtype", checked=True),
)
_CUMSUM_DEVIATIONS = (
    "A one-element input keeps shape (1,); MegaBlocks squeezes it to a 0-d tensor.",
    "Overflowing x's dtype is an error in checked mode; MegaBlocks wraps.",
)

INCLUSIVE_CUMSUM = OpContract(
    name="inclusive_cumsum",
    family="routing",
    summary="Running sum including the current element, in x's dtype.",
    args=_CUMSUM_ARGS,
    rules=_CUMSUM_RULES,
    outputs=(Output("out", "x.dtype", "tuple(x.shape)"),),
    semantics="out[i] = x[0] + … + x[i]. No promotion to int64 (unlike torch.cumsum).",
    edge_cases=("empty input: empty output",),
    deviations=_CUMSUM_DEVIATIONS,
)

EXCLUSIVE_CUMSUM = OpContract(
    name="exclusive_cumsum",
    family="routing",
    summary="Running sum excluding the current element, in x's dtype.",
    args=_CUMSUM_ARGS,
    rules=_CUMSUM_RULES,
    outputs=(Output("out", "x.dtype", "tuple(x.shape)"),),
    semantics="out[0] = 0, out[i] = x[0] + … + x[i - 1].",
    edge_cases=("empty input: empty output",),
    deviations=_CUMSUM_DEVIATIONS,
)

TOPOLOGY = OpContract(
    name="topology",
    family="routing",
    summary="Column indices of the block-sparse expert weight matrix, one row of blocks per padded row block.",
    args=(
        PADDED_BINS,
        IntArg("block_size", "rows (and columns) per block", min=1),
        IntArg("output_block_rows", "padded_bins[-1] // block_size", min=0),
        IntArg("output_block_columns", "blocks per expert along the ffn dimension", min=1),
    ),
    rules=(
        Rule("padded_bins.shape[0] * output_block_columns <= 32768", "column indices are int16"),
        Rule("nondecreasing(padded_bins)", "padded_bins is a cumulative sum", checked=True),
        Rule("multiple_of(padded_bins, block_size)", "padded bins are whole blocks", checked=True),
        Rule(
            "last(padded_bins) == output_block_rows * block_size",
            "output_block_rows covers padded_bins",
            checked=True,
        ),
    ),
    outputs=(
        Output("column_indices", "torch.int16", ("output_block_rows * output_block_columns",)),
    ),
    semantics=(
        "Block-row r of expert e (padded_bins[e-1] <= r * block_size < padded_bins[e]) gets "
        "columns e * output_block_columns + [0, output_block_columns)."
    ),
    edge_cases=(
        "experts with no rows own no block-rows",
        "output_block_rows = 0: empty output",
        UNCHECKED + "padded_bins not a cumulative sum of whole blocks: every entry is "
        "e * output_block_columns + j for some e in [0, experts]",
    ),
)

REPLICATE = OpContract(
    name="replicate",
    family="routing",
    summary="Expand one value per bin into one value per row of that bin.",
    args=(
        TensorArg("x", FLOAT_DTYPES | INT_DTYPES, (2,), "per-bin values, (batch, bins)"),
        BINS,
        IntArg("num_outputs", "total rows, bins[-1]", min=0),
    ),
    rules=(
        Rule("bins.shape[0] == x.shape[1]", "one bin per column of x"),
        Rule("nondecreasing(bins)", "bins is a cumulative sum", checked=True),
        Rule("last(bins) <= num_outputs", "bins fit in num_outputs", checked=True),
    ),
    outputs=(Output("out", "x.dtype", ("x.shape[0]", "num_outputs")),),
    differentiable=("x",),
    semantics=(
        "out[b, j] = x[b, e] for bins[e-1] <= j < bins[e]; columns past bins[-1] are 0. "
        "The gradient is a per-bin sum."
    ),
    edge_cases=(
        "empty bins: no output columns",
        "num_outputs = 0: empty output",
        UNCHECKED + "bins not a cumulative sum: every element is 0 or a value of its row of x",
    ),
    deviations=(
        "Any float or int dtype, forward and backward (MegaBlocks: fp16/int16/int32, fp16 backward).",
    ),
)

REPLICATE_BACKWARD = OpContract(
    name="replicate_backward",
    family="routing",
    public=False,
    summary="Sum the rows of each bin (replicate's gradient).",
    args=(
        TensorArg("grad", FLOAT_DTYPES, (2,), "gradient of replicate's output, (batch, rows)"),
        BINS,
    ),
    rules=(
        Rule("nondecreasing(bins)", "bins is a cumulative sum", checked=True),
        Rule("last(bins) <= grad.shape[1]", "bins fit in grad's rows", checked=True),
    ),
    outputs=(Output("out", "grad.dtype", ("grad.shape[0]", "bins.shape[0]")),),
    differentiable=("grad",),
    semantics="out[b, e] = sum(grad[b, bins[e-1]:bins[e]]), accumulated in float32 (float64 for float64).",
    edge_cases=(
        "an empty bin sums to exactly 0",
        UNCHECKED + "bins not a cumulative sum: each bin sums some columns of grad "
        "inside grad (which ones is unspecified)",
    ),
)

#: The most experts that route can give rows to.
_ROUTED_EXPERTS = "min(num_experts, top_experts.shape[0])"

ROUTE = OpContract(
    name="route",
    family="routing",
    summary="All routing metadata of a dropless MoE layer from the flat top-k expert ids, in one op.",
    args=(
        TensorArg("top_experts", INT_DTYPES, (1,), "expert id of each (token, k) pair, flattened"),
        IntArg("num_experts", "number of experts", min=1),
        IntArg("block_size", "padding granularity of padded_bins", min=1, max=2**31 - 1),
    ),
    rules=(
        int16_fits("top_experts", "int16 indices cannot address more than 32768 rows"),
        # Without reading the ids: the largest padded_bins[-1] of any routing (one row for each
        # of the most experts that can get one, the other rows in whole blocks on one of them),
        # so that no routing can make the int32 padded_bins wrap.
        Rule(
            f"block_size * ({_ROUTED_EXPERTS} + (top_experts.shape[0] - {_ROUTED_EXPERTS}) "
            "// block_size) < 2**31",
            "padded_bins is int32: the largest padded_bins[-1] any routing of these rows can "
            "give must fit it",
        ),
        Rule(
            "in_range(top_experts, 0, num_experts)",
            "expert ids lie in [0, num_experts)",
            checked=True,
        ),
    ),
    outputs=(
        Output("indices", "top_experts.dtype", ("top_experts.shape[0]",), "as sort's indices"),
        Output("bin_ids", "top_experts.dtype", ("top_experts.shape[0]",), "as sort's values"),
        Output("tokens_per_expert", "torch.int32", ("num_experts",), "as histogram"),
        Output("bins", "torch.int32", ("num_experts",), "inclusive cumsum of tokens_per_expert"),
        Output(
            "padded_bins",
            "torch.int32",
            ("num_experts",),
            "inclusive cumsum of tokens_per_expert rounded up to block_size",
        ),
    ),
    semantics=(
        "Exactly sort(top_experts) (stable), histogram, inclusive_cumsum, and inclusive_cumsum of "
        "round_up(counts, block_size); no device→host sync. The reference backend composes it from "
        "those dispatched ops, so every backend that provides them gets route for free; a backend "
        "may provide a fused kernel instead."
    ),
    edge_cases=(
        "zero tokens: empty indices, all-zero counts",
        UNCHECKED + "expert ids outside [0, num_experts) are not counted and sort after "
        "every valid id, in input order; bin_ids keeps them as given, indices stays a "
        "permutation and bins[-1] counts only the valid ids",
    ),
    deviations=(
        "Not in MegaBlocks, which makes the caller issue the five ops (and a sync in places).",
        "A block size with which some routing of the rows would pass int32 in padded_bins is "
        "an error, whatever the ids; MegaBlocks' ops wrap.",
    ),
)

ROUTER_TOPK = OpContract(
    name="router_topk",
    family="routing",
    summary="Each token's top_k experts by router score, and their weights (optionally softmax).",
    args=(
        TensorArg("scores", FLOAT_DTYPES, (2,), "router scores (logits), (tokens, experts)"),
        IntArg("top_k", "experts per token", min=1),
        BoolArg(
            "softmax",
            "weights are softmax(scores) over all experts (True) or the scores themselves (False)",
        ),
    ),
    rules=(
        Rule("top_k <= scores.shape[1]", "top_k is at most the number of experts"),
        Rule("scores.shape[1] <= 2**31", "expert ids are int32"),
    ),
    outputs=(
        Output(
            "weights",
            "scores.dtype",
            ("scores.shape[0]", "top_k"),
            "the chosen experts' scores, or softmax probabilities",
        ),
        Output(
            "experts",
            "torch.int32",
            ("scores.shape[0]", "top_k"),
            "ids of the top_k largest scores of each row, largest first",
        ),
    ),
    semantics=(
        "experts[t] lists the ids of row t's top_k largest scores in descending order; equal "
        "scores rank the lower id first (so the result is deterministic) and NaN ranks above "
        "every number (as torch.topk), -0.0 equals 0.0. weights[t, j] is scores[t, e] for "
        "e = experts[t, j], or with softmax the probability exp(scores[t, e]) / sum over all "
        "experts of exp(scores[t, .]) computed in at least float32 and rounded to scores' dtype "
        "(a row holding NaN, or only -inf, has NaN probabilities). Ranking by the scores is "
        "ranking by the probabilities (softmax is monotonic) without their rounding. Not "
        "differentiable: a layer that trains its router takes the weights' gradient through "
        "softmax(scores).gather(1, experts)."
    ),
    edge_cases=(
        "zero tokens: empty (0, top_k) outputs",
        "top_k = experts: every expert, in descending order of score",
    ),
    deviations=(
        "Not in MegaBlocks, whose router calls torch.topk on the probabilities (ties broken in "
        "an unspecified order) and casts the ids separately.",
    ),
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

# ---------------------------------------------------------------------------
# Grouped GEMM

BATCH_SIZES = TensorArg(
    "batch_sizes",
    COUNT_DTYPES,
    (1,),
    "rows of a per expert; on the CPU (MegaBlocks' convention) or on a's device",
    any_device=True,
)
# Checked always when batch_sizes is on the CPU (no device sync), otherwise only in checked mode.
# Each size is bounded first, so that the sum below cannot wrap around (int64 sizes
# [2**63 - 1, 2**63 - 1, 6] must not pass for 4 rows).
GROUPS_WITHIN_A = Rule(
    "sizes_within(batch_sizes, a.shape[0])",
    "group sizes are not negative and none exceeds the rows of a",
    checked="batch_sizes",
)
# The groups may end before a's last row: the rows past them belong to no group (expert
# parallelism's rows of other ranks' experts, seen through the fused ops' backward).
GROUPS_FIT_A = Rule(
    "total(batch_sizes, a.shape[0]) <= a.shape[0]",
    "the groups fit in the rows of a",
    checked="batch_sizes",
)
ROWS_PAST_GROUPS = (
    "batch_sizes may sum to less than the rows of a, and the rows past the last group belong to "
    "no group"
)

GMM_BAD_SIZES = (
    UNCHECKED + "device-side batch_sizes that are negative or sum past the rows of a: a "
    "negative size counts as 0, groups are cut at a's last row, and output rows no group covers "
    "are 0"
)

# The per-expert bias (an option added after kernels existed: the core adds it around a kernel
# without it, megablocks_core.bias).
BIAS_DOC = (
    "per-expert bias added to each expert's output rows, (experts, n) in x's dtype; None: none"
)
BIAS_OPTION_GMM = TensorArg(
    "bias", FLOAT_DTYPES, (2,), BIAS_DOC, optional=True, serve=bias_ops.serve_gmm
)
OUT_WIDTH = "(b.shape[1] if trans_b else b.shape[2])"


def bias_rules(data: str) -> tuple[Rule, ...]:
    return (
        Rule(
            f"bias is None or bias.dtype == {data}.dtype",
            f"bias has {data}'s dtype",
            error=TypeError,
        ),
        Rule(
            f"bias is None or (bias.shape[0] == b.shape[0] and bias.shape[1] == {OUT_WIDTH})",
            "bias holds one row per expert, as wide as the output, (experts, n)",
        ),
    )


BIAS_ARITHMETIC = (
    "The bias is added to the float32 (float64 for float64 data) product and rounded once by a "
    "kernel that takes it; for one that does not, the core adds it to the kernel's rounded output "
    "(megablocks_core.bias), one more rounding. Its gradient is each expert's column sum of the "
    "output gradient (over the rows of the expert)."
)

GMM = OpContract(
    name="gmm",
    family="grouped_gemm",
    summary="Grouped matrix multiply: each expert's rows of a times that expert's matrix.",
    args=(
        TensorArg("a", FLOAT_DTYPES, (2,), "rows grouped by expert, (rows, k)"),
        TensorArg(
            "b",
            FLOAT_DTYPES,
            (3,),
            "expert matrices, (experts, k, n) or (experts, n, k) with trans_b",
        ),
        BATCH_SIZES,
        BoolArg("trans_b", "b holds (n, k) matrices", default=False),
        BIAS_OPTION_GMM,
    ),
    rules=(
        Rule("b.dtype == a.dtype", "a and b have the same dtype", error=TypeError),
        Rule("batch_sizes.shape[0] == b.shape[0]", "one group size per expert"),
        Rule("a.shape[1] == (b.shape[2] if trans_b else b.shape[1])", "inner dimensions agree"),
        GROUPS_WITHIN_A,
        GROUPS_FIT_A,
        *bias_rules("a"),
    ),
    outputs=(Output("out", "a.dtype", ("a.shape[0]", "b.shape[1] if trans_b else b.shape[2]")),),
    differentiable=("a", "b", "bias"),
    semantics=(
        "Rows bins[e-1]:bins[e] of the output are a[those rows] @ b[e] (or b[e].T), plus "
        "bias[e] when bias is given. "
        + BIAS_ARITHMETIC
        + " "
        + ROWS_PAST_GROUPS
        + ": their output rows are 0, their rows of a's gradient are 0 and they add nothing to b's "
        "gradient. "
        "Accumulates in float32. The gradient of b is a variable-K grouped GEMM (gmm_weight_grad). "
        "batch_sizes on the CPU is MegaBlocks' convention (sum and signs checked on the host); on "
        "a's device it is the sync-free form: nothing reads it on the host unless MEGABLOCKS_CHECK=1, "
        "and the default ranking never picks a provider that would copy it there."
    ),
    edge_cases=(
        "rows = 0: empty output",
        "empty experts: no rows, exactly-zero weight gradient",
        GMM_BAD_SIZES,
    ),
)

WGRAD_ARGS = (
    TensorArg("a", FLOAT_DTYPES, (2,), "rows grouped by expert, (rows, k)"),
    TensorArg("grad", FLOAT_DTYPES, (2,), "rows grouped by expert, (rows, n)"),
    BATCH_SIZES,
)
WGRAD_RULES = (
    Rule("grad.dtype == a.dtype", "a and grad have the same dtype", error=TypeError),
    Rule("grad.shape[0] == a.shape[0]", "a and grad have the same rows"),
    GROUPS_WITHIN_A,
    GROUPS_FIT_A,
)

GMM_WEIGHT_GRAD = OpContract(
    name="gmm_weight_grad",
    family="grouped_gemm",
    public=False,
    summary="Per-expert a^T @ grad (the weight gradient of gmm, variable K).",
    args=WGRAD_ARGS,
    rules=WGRAD_RULES,
    outputs=(Output("out", "a.dtype", ("batch_sizes.shape[0]", "a.shape[1]", "grad.shape[1]")),),
    differentiable=("a", "grad"),
    semantics=(
        "out[e] = a[rows of e].T @ grad[rows of e], accumulated in float32. "
        + ROWS_PAST_GROUPS
        + ": they are ignored."
    ),
    edge_cases=("an empty expert gets exactly 0", GMM_BAD_SIZES),
)

GMM_WEIGHT_GRAD_ACCUMULATE = OpContract(
    name="gmm_weight_grad_accumulate",
    family="grouped_gemm",
    public=False,
    summary=(
        "Per-expert a^T @ grad added in place to an existing gradient (gmm_weight_grad with the "
        "gradient accumulation fused)."
    ),
    args=(
        *WGRAD_ARGS,
        TensorArg(
            "out",
            FLOAT_DTYPES,
            (3,),
            "the gradient to add to, (experts, k, n): in a's dtype, or float32 (a float32 "
            "main_grad for 16-bit a and grad)",
            mutable=True,
        ),
    ),
    rules=(
        *WGRAD_RULES,
        Rule(
            "out.dtype == a.dtype or out.dtype == torch.float32",
            "out is in a's dtype or float32",
            error=TypeError,
        ),
        Rule(
            "out.shape == (batch_sizes.shape[0], a.shape[1], grad.shape[1])",
            "out has the weight gradient's shape (experts, k, n)",
        ),
    ),
    outputs=(),
    semantics=(
        "out[e] += a[rows of e].T @ grad[rows of e], in place; "
        + ROWS_PAST_GROUPS.lower()[0]
        + ROWS_PAST_GROUPS[1:]
        + " and are ignored. Defined as the composition "
        "out.add_(gmm_weight_grad(a, grad, batch_sizes)), with a and grad first cast to out's "
        "dtype where out is wider (a float32 out for 16-bit a and grad: the gradient is never "
        "rounded to 16 bits); the reference backend runs exactly that through the dispatched "
        "gmm_weight_grad, so a backend that provides gmm_weight_grad but no kernel for this op "
        "still has its own GEMM run. A fused kernel writes no (experts, k, n) temporary and "
        "reads and writes out once: it adds out's value to its float32 accumulator in the GEMM's "
        "epilogue (float64 for float64 data) and rounds once to out's dtype, or it rounds its "
        "product to out's dtype and has the memory system add it to out (a TMA reduction), "
        "which for a 16-bit out rounds twice, as the composition does. The core's autograd "
        "calls it "
        "for parameters opted in to gradient-accumulation fusion "
        "(megablocks_core.fuse_grad_accumulation)."
    ),
    edge_cases=(
        "an empty expert leaves out[e] unchanged (neither read nor written by a fused kernel)",
        "rows = 0: out unchanged",
        UNCHECKED + "device-side batch_sizes that are negative or sum past the rows of a: "
        "as gmm_weight_grad (a negative size counts as 0, groups are cut at a's last row), "
        "and an expert left without rows leaves out[e] unchanged",
    ),
)

# ---------------------------------------------------------------------------
# Fused permutation + grouped GEMM. Each is *defined* by its composition from the ops above (the
# reference backend runs exactly that composition, so the conformance kit checks every fused
# kernel against it); a backend may provide a kernel that never writes the permuted rows.

EXPERT_MATRICES = TensorArg(
    "b", FLOAT_DTYPES, (3,), "expert matrices, (experts, k, n) or (experts, n, k) with trans_b"
)
TRANS_B = BoolArg("trans_b", "b holds (n, k) matrices", default=False)


def _activate_rows(x: Tensor, name: str) -> Tensor:
    """gmm_scatter's activation for a kernel that does not apply it itself (a gated one through
    the dispatched glu op)."""
    from .entries import call  # the entries import the contracts

    return activate_with(call, x, name)


GELU_NAMES_DOC = (
    "'gelu' is the tanh approximation (MegaBlocks' default; 'gelu_tanh' names it explicitly), "
    "'gelu_erf' the exact erf form (torch's and transformers' 'gelu')"
)
ROW_ACTIVATION_DOC = (
    "'gelu', 'gelu_tanh', 'gelu_erf', 'silu' or 'relu'; or gated, on rows that hold gate and up "
    "side by side, (rows, 2n) -> (rows, n) as glu: 'geglu' (= 'geglu_tanh'), 'geglu_erf', "
    "'swiglu', 'reglu' (act(gate) * up with that GELU, SiLU, ReLU), 'bilinear' (gate * up) or "
    "'swiglu_oai' (GPT-OSS's clamped SwiGLU, glu's 'silu_oai'); each gated one but 'bilinear' "
    "also with the suffix '_interleaved' for rows holding gate and up interleaved (gate in even "
    "columns, up in odd), whose gradient is interleaved too (megablocks_core.activations; "
    + GELU_NAMES_DOC
    + ")"
)
ACTIVATION = ChoiceArg(
    "activation",
    "applied to x's rows before the GEMM: " + ROW_ACTIVATION_DOC + "; None: none",
    ROW_NAMES,
    applies_to="x",
    apply=_activate_rows,
)
GATED_NAMES = repr(tuple(GATED))
# x's width as the GEMM sees it: a gated activation halves it.
ACTIVATED_WIDTH = f"(x.shape[1] // 2 if activation in {GATED_NAMES} else x.shape[1])"
GATED_EVEN = Rule(
    f"activation not in {GATED_NAMES} or x.shape[1] % 2 == 0",
    "a gated activation's x holds gate and up halves of equal width",
)
SAME_DTYPE_B = Rule("b.dtype == x.dtype", "x and b have the same dtype", error=TypeError)
ONE_MATRIX_PER_BIN = Rule("bins.shape[0] == b.shape[0]", "one expert matrix per bin")
INNER_B = Rule("x.shape[1] == (b.shape[2] if trans_b else b.shape[1])", "inner dimensions agree")
# The permutation rules without weights (the gathering ops take none).
ROUTED_RULES = (
    SAME_LENGTH,
    WHOLE_TOKENS,
    INDICES_FIT,
    IS_PERMUTATION,
    BINS_SORTED,
    BINS_WITHIN,
    BIN_IDS_MATCH,
)
GROUPS_FROM_BINS = (
    "Expert e's rows are sorted rows bins[e-1]:bins[e] (bins plays gmm's batch_sizes: no host "
    "sync, nothing read on the host)."
)
FUSED_BAD_BINS = (
    UNCHECKED + "bins not a cumulative sum: a negative group counts as 0, groups are cut at the "
    "last sorted row, and rows no group covers are 0 (as gmm with such sizes)"
)
ROWS_SHORT = (
    UNCHECKED + "rows short of bins[-1]: groups are cut at row rows (the pairs past it add nothing)"
)

GATHER_GMM = OpContract(
    name="gather_gmm",
    family="grouped_gemm",
    summary="Grouped GEMM whose rows are read from the tokens through the routing indices (gather fused).",
    args=(
        TOKENS,
        EXPERT_MATRICES,
        INDICES,
        BIN_IDS,
        BINS,
        TOP_K,
        TRANS_B,
        ROWS_OUT,
        TensorArg(
            "bias", FLOAT_DTYPES, (2,), BIAS_DOC, optional=True, serve=bias_ops.serve_gather_gmm
        ),
    ),
    rules=(
        SAME_DTYPE_B,
        ONE_MATRIX_PER_BIN,
        INNER_B,
        GATHER_ROWS,
        *ROUTED_RULES,
        ROWS_WITHIN,
        ROWS_COVER_BINS,
        *bias_rules("x"),
    ),
    outputs=(
        Output(
            "out",
            "x.dtype",
            (ROWS_OUT_DIM, "b.shape[1] if trans_b else b.shape[2]"),
            "expert-sorted rows",
        ),
    ),
    differentiable=("x", "b", "bias"),
    semantics=(
        "Exactly gmm(gather(x, indices, bin_ids, bins, top_k), b, batch_sizes, trans_b, bias) with "
        "batch_sizes[e] = bins[e] - bins[e-1]: sorted row i is x[indices[i] // top_k] @ b[e] "
        "(b[e].T with trans_b) for the expert e whose rows hold i. A fused kernel need never "
        "write the gathered (tokens * top_k, k) rows, and the backward keeps none: "
        "x's gradient is gmm_scatter of the output gradient; b's gradient gathers x again "
        "(a transient copy) for gmm_weight_grad. " + GROUPS_FROM_BINS + " " + PAST_BINS + ": their "
        "output rows are 0, and their rows of x's gradient add nothing. " + FIRST_ROWS + " "
        "Accumulates in float32."
    ),
    edge_cases=(*EMPTY_AND_ZERO, GATHER_BAD_INDICES, FUSED_BAD_BINS, ROWS_SHORT),
)

GMM_SCATTER = OpContract(
    name="gmm_scatter",
    family="grouped_gemm",
    summary="Grouped GEMM whose rows are summed straight back into token order, optionally weighted (scatter fused).",
    args=(
        SORTED_ROWS,
        EXPERT_MATRICES,
        INDICES,
        BIN_IDS,
        WEIGHTS,
        BINS,
        TOP_K,
        TRANS_B,
        ACTIVATION,
        ROWS_IN,
        TensorArg(
            "bias",
            FLOAT_DTYPES,
            (2,),
            "per-expert bias added to each (token, k) product row before the weighted sum, "
            "(experts, n) in x's dtype; None: none",
            optional=True,
            serve=bias_ops.serve_gmm_scatter,
        ),
    ),
    rules=(
        SAME_DTYPE_B,
        ONE_MATRIX_PER_BIN,
        *bias_rules("x"),
        GATED_EVEN,
        Rule(
            f"{ACTIVATED_WIDTH} == (b.shape[2] if trans_b else b.shape[1])",
            "inner dimensions agree (a gated activation halves x's width)",
        ),
        Rule(
            f"x.shape[0] == ({ROWS_OUT_DIM})",
            "one row of x per sorted (token, k) pair, or per each of the first rows of them",
        ),
        *UNROUTED_PERMUTATION_RULES,
        ROWS_WITHIN,
        ROWS_COVER_BINS,
    ),
    outputs=(
        Output(
            "out",
            "x.dtype",
            ("indices.shape[0] // top_k", "b.shape[1] if trans_b else b.shape[2]"),
            "one row per token",
        ),
    ),
    differentiable=("x", "b", "weights", "bias"),
    semantics=(
        "Exactly scatter(gmm(act(x), b, batch_sizes, trans_b, bias), indices, bin_ids, weights, "
        "bins, top_k) with batch_sizes from bins, act the named activation (identity for None, "
        "computed in float32 or wider and rounded to x's dtype; a gated one is glu of x's two "
        "halves): out[t] = sum over k of "
        "weights[t*top_k + k] * (act(x[i]) @ b[e]) where indices[i] = t*top_k + k. The backward "
        "keeps no (tokens * top_k, n) product: the weights' gradient <grad[t], act(x[i]) @ b[e]> "
        "is computed as <act(x[i]), grad[t] @ b[e].T>, from the rows the input gradient needs "
        "anyway; with an activation it keeps x only (the pre-activation rows: act(x) is "
        "recomputed in backward, by activation_backward), so an expert MLP's forward keeps one "
        "(tokens * top_k, ffn) tensor, a gated expert's one (tokens * top_k, 2 * ffn) tensor. "
        "A kernel that does not take the activation gets act(x) (a gated one from the glu op). "
        + GROUPS_FROM_BINS
        + " "
        + PAST_BINS
        + ": they are skipped (their product row is 0, so their (token, k) adds nothing to out, "
        "and their rows of x's gradient and their weights' gradient are 0). With rows, x holds "
        "the first rows sorted rows only (x's gradient too); the pairs past them are skipped "
        "alike. With bias, token t also gets sum over k of weights[t*top_k + k] * bias[e]; the "
        "weights' gradient gains <grad[t], bias[e]> and bias's gradient is the sum over each "
        "expert's pairs of weights * grad[t] (a kernel without bias: the core adds it, "
        "megablocks_core.bias). " + FP32_ACCUMULATION
    ),
    edge_cases=(*EMPTY_AND_ZERO, SCATTER_BAD_INDICES, FUSED_BAD_BINS, ROWS_SHORT),
)

# ---------------------------------------------------------------------------
# Activation: the gated unit between a gated expert's two GEMMs.

GATE_UP = TensorArg(
    "x",
    FLOAT_DTYPES,
    (2,),
    "each row's gate and up projections side by side, (rows, 2 * n): a grouped GEMM's output "
    "through [w1 | v1]",
)
GLU_ACTIVATION = ChoiceArg(
    "activation",
    "the gate's activation: 'gelu', 'gelu_tanh' or 'gelu_erf' (GEGLU), 'silu' (SwiGLU) or "
    "'relu' (megablocks_core.activations; " + GELU_NAMES_DOC + "); 'silu_oai': GPT-OSS's "
    "clamped unit (up + 1) * g * sigmoid(1.702 g) with g = min(gate, 7) and up clamped to "
    "[-7, 7]; any of them with the suffix '_interleaved': gate and up interleaved (gate in even "
    "columns, up in odd) instead of side by side; None: none (a bilinear unit)",
    GLU_NAMES,
)
EVEN_WIDTH = Rule("x.shape[1] % 2 == 0", "x holds gate and up halves of equal width")
GLU_ARITHMETIC = (
    "Computed in float32 (float64 for float64 x) and rounded once to x's dtype, as "
    "megablocks_core.plugin.{}_definition does (the reference backend runs it; a kernel matches "
    "it within the conformance kit's tolerances)."
)

GLU = OpContract(
    name="glu",
    family="activation",
    summary="Gated linear unit of gated experts: act(gate) * up of each row's two halves.",
    args=(GATE_UP, GLU_ACTIVATION),
    rules=(EVEN_WIDTH,),
    outputs=(Output("out", "x.dtype", ("x.shape[0]", "x.shape[1] // 2")),),
    differentiable=("x",),
    semantics=(
        "out[i, j] = act(x[i, j]) * x[i, n + j] with n = x.shape[1] // 2 (an '_interleaved' name: "
        "gate x[i, 2j] and up x[i, 2j + 1]; 'silu_oai': GPT-OSS's clamped unit of them): one pass "
        "over the "
        "first GEMM's (rows, 2n) output of gated experts (SwiGLU, GEGLU), instead of separate "
        "activation and product passes. The backward keeps x only (act is recomputed there) and "
        "writes x's gradient, both halves, with glu_backward. " + GLU_ARITHMETIC.format("glu")
    ),
    edge_cases=("rows = 0 or n = 0: an empty result",),
)

GLU_BACKWARD = OpContract(
    name="glu_backward",
    family="activation",
    public=False,
    summary="The gradient of glu with respect to x (glu's backward).",
    args=(
        TensorArg("grad", FLOAT_DTYPES, (2,), "gradient of glu's output, (rows, n)"),
        GATE_UP,
        GLU_ACTIVATION,
    ),
    rules=(
        Rule("x.dtype == grad.dtype", "grad and x have the same dtype", error=TypeError),
        EVEN_WIDTH,
        Rule(
            "grad.shape[0] == x.shape[0] and 2 * grad.shape[1] == x.shape[1]",
            "grad has glu's output shape",
        ),
    ),
    outputs=(Output("out", "x.dtype", "tuple(x.shape)", "(grad of the gate | grad of up)"),),
    semantics=(
        "out[i, j] = grad[i, j] * x[i, n + j] * act'(x[i, j]) and out[i, n + j] = grad[i, j] * "
        "act(x[i, j]) (an '_interleaved' name: the gate's gradient in out[i, 2j], up's in "
        "out[i, 2j + 1]; 'silu_oai': the gradient of its clamped unit, 0 where a clamp cuts). "
        + GLU_ARITHMETIC.format("glu_backward")
    ),
    edge_cases=("rows = 0 or n = 0: an empty result",),
)

ACTIVATION_BACKWARD = OpContract(
    name="activation_backward",
    family="activation",
    public=False,
    summary="One pass over an expert MLP's activation in backward: x's gradient, the rows' dots, "
    "and act(x) again, written over grad.",
    args=(
        TensorArg(
            "grad",
            FLOAT_DTYPES,
            (2,),
            "gradient of the GEMM's input rows act(x), (rows, n); overwritten with act(x)",
            mutable=True,
        ),
        TensorArg(
            "x", FLOAT_DTYPES, (2,), "the pre-activation rows, (rows, n); (rows, 2n) if gated"
        ),
        TensorArg(
            "scale",
            FLOAT_DTYPES,
            (1,),
            "each row's factor on grad (its top-k weight), length rows; None means 1",
            optional=True,
        ),
        ChoiceArg("activation", ROW_ACTIVATION_DOC + "; None: the identity", ROW_NAMES),
    ),
    rules=(
        Rule("x.dtype == grad.dtype", "grad and x have the same dtype", error=TypeError),
        GATED_EVEN,
        Rule(
            f"grad.shape[0] == x.shape[0] and grad.shape[1] == {ACTIVATED_WIDTH}",
            "grad has act(x)'s shape",
        ),
        Rule("scale is None or scale.shape[0] == x.shape[0]", "one scale per row"),
    ),
    outputs=(
        Output("grad_x", "x.dtype", "tuple(x.shape)", "scale[i] * grad * act'(x)"),
        Output("dots", "x.dtype", ("x.shape[0]",), "<act[i], grad[i]>"),
    ),
    semantics=(
        "With act = act(x) rounded to x's dtype: dots[i] = sum over j of act[i, j] * grad[i, j], "
        "accumulated in float32 (float64 for float64 x) and rounded to x's dtype (a kernel's act "
        "may differ from the definition's by a rounding, so the dots are only as exact as x's "
        "dtype); grad_x[i, j] = scale[i] * grad[i, j] * "
        "act'(x[i, j]), computed in float32 or wider and rounded once; for a gated activation "
        "act is glu(x) and grad_x glu_backward(scale[i] * grad, x), both halves. act is written "
        "over grad, in place (grad is read first): the caller gives grad up and gets act in its "
        "memory, one (rows, n) tensor fewer at the backward's peak. The backward of "
        "gmm_scatter with an activation, where grad holds each sorted row's gradient before its "
        "top-k weight (grad[t] @ b[e].T): act is the weight gradient's operand, dots the "
        "weights' gradient, grad_x the gradient of the kept pre-activation rows, in one read of "
        "grad and x instead of four passes. megablocks_core.plugin.activation_backward_definition "
        "is the definition (the reference backend runs it; a kernel matches it within the "
        "conformance kit's tolerances)."
    ),
    edge_cases=("rows = 0: empty results; n = 0: an empty grad_x, dots 0",),
)

# ---------------------------------------------------------------------------
# Megatron-Core / Transformer Engine permutation (``moe_permute``): a routing map in, permuted
# rows out, and a row map that the other ops of the family read. The row map is the contract
# between them, written here once: every backend writes and reads exactly this format, so a
# permute on one backend and the unpermute on another agree.

ROW_MAP_FORMAT = (
    "Row map: int32 (tokens, slots), the routing map's shape; the slots are the experts of a "
    "(tokens, experts) bool mask, or the top_k choices of (tokens, top_k) expert ids. "
    "row_map[t, j] is the permuted row that slot j of token t goes to, or -1 when it goes "
    "nowhere (mask False; an id outside [0, num_experts); a row at or past num_out_tokens, "
    "dropped). Permuted rows are expert-major: expert e owns rows [start(e), start(e) + "
    "round_up(count(e), align_size)), start(e) the sum of the rounded counts of the experts "
    "before it; within an expert the rows follow their tokens in ascending order (in the index "
    "form a token naming one expert twice: ascending k). Rows past an expert's count up to its "
    "rounded count are padding; every row no slot names is 0."
)
ROW_MAP = TensorArg(
    "row_map",
    frozenset({torch.int32}),
    (2,),
    "int32 (tokens, slots): the permuted row of each slot, or -1 (the row map format)",
)
NUM_OUT_TOKENS = IntArg(
    "num_out_tokens",
    "rows of the permuted tensor: a static upper bound (e.g. tokens * top_k, dropless), never "
    "exceeded; rows past the real count are 0",
    min=0,
    max=2**31 - 1,
)
SLOT_PROBS = TensorArg(
    "probs",
    FLOAT_DTYPES,
    (2,),
    "one probability per slot, the routing map's shape (tokens, slots); None means 1",
    optional=True,
)
ONE_ROW_PER_TOKEN = Rule("row_map.shape[0] == x.shape[0]", "one row map row per token of x")
PROBS_PER_SLOT = Rule(
    "probs is None or probs.shape == row_map.shape",
    "one probability per slot of the row map",
)
DESTINATIONS_IN_OUTPUT = Rule(
    "in_range(row_map, -1, num_out_tokens)",
    "row map entries are -1 or rows of the permuted output",
    checked=True,
)
DESTINATIONS_IN_X = Rule(
    "in_range(row_map, -1, x.shape[0])",
    "row map entries are -1 or rows of x",
    checked=True,
)
ROW_MAP_BAD = (
    UNCHECKED + "row map entries outside [-1, rows): such a slot goes nowhere (it writes "
    "nothing and reads nothing); two slots naming one row: each element of that row is the "
    "element of one of them (which one is unspecified)"
)
NO_HOST_SYNC = (
    "No device-to-host sync: every output size comes from the arguments' shapes and ints, so "
    "the op can be captured in a CUDA graph and traced by torch.compile(fullgraph=True)."
)

MOE_PERMUTE_MAP = OpContract(
    name="moe_permute_map",
    family="permutation",
    summary="The row map and per-expert row counts of a routing map (mask or top-k ids).",
    args=(
        TensorArg(
            "routing_map",
            frozenset({torch.bool}) | INT_DTYPES,
            (2,),
            "bool (tokens, experts) mask, or integer (tokens, top_k) expert ids",
        ),
        IntArg("num_experts", "number of experts", min=1),
        NUM_OUT_TOKENS,
        IntArg(
            "align_size",
            "each expert's rows rounded up to a multiple of this (16 for FP8 GEMMs, 32 for "
            "MXFP8); 1: no padding",
            min=1,
            default=1,
        ),
    ),
    rules=(
        Rule(
            "routing_map.dtype != torch.bool or routing_map.shape[1] == num_experts",
            "a mask has one column per expert",
        ),
        Rule(
            "routing_map.numel() + num_experts * (align_size - 1) < 2**31",
            "the padded rows of any routing must fit the int32 row map",
        ),
    ),
    outputs=(
        Output(
            "row_map",
            "torch.int32",
            ("routing_map.shape[0]", "routing_map.shape[1]"),
            "the row map (its format below)",
        ),
        Output(
            "counts",
            "torch.int32",
            ("num_experts",),
            "rows of the permuted output each expert owns, padding included and cut at "
            "num_out_tokens: sum(counts) is the real row count",
        ),
    ),
    semantics=(
        ROW_MAP_FORMAT
        + " counts[e] = min(end(e), num_out_tokens) - min(start(e), num_out_tokens), on the "
        "device. " + NO_HOST_SYNC + " Megatron-Core's unfused permute order (expert-major, "
        "tokens ascending) is this one with align_size 1."
    ),
    edge_cases=(
        "zero tokens: an empty row map, all-zero counts",
        "empty experts: count 0 (a multiple of every align_size), no rows",
        "num_out_tokens smaller than the routed (padded) rows: the rows past it are dropped "
        "(their slots -1), the counts cut there; larger: the rows past the real count are "
        "owned by no expert",
        "index form: an id outside [0, num_experts) (e.g. -1, or an expert of another rank's) "
        "routes its slot nowhere (-1); it is not counted",
    ),
    deviations=(
        "Not in MegaBlocks. Transformer Engine's mask-form row map is (tokens, 2 * experts + 1) "
        "and its index form (tokens * top_k,); this one is the routing map's shape in both forms, "
        "and also holds the padded form (no separate pad offsets).",
    ),
)

MOE_PERMUTE = OpContract(
    name="moe_permute",
    family="permutation",
    summary="Copy each token's row to the permuted rows its row map names.",
    args=(
        TensorArg("x", FLOAT_DTYPES, (2,), "token rows, (tokens, hidden)"),
        ROW_MAP,
        TensorArg(
            SLOT_PROBS.name,
            SLOT_PROBS.dtypes,
            SLOT_PROBS.ndim,
            "optional per-slot scale (kernel level only: used by moe_unpermute's backward)",
            optional=True,
            public=False,
        ),
        NUM_OUT_TOKENS,
    ),
    rules=(ONE_ROW_PER_TOKEN, PROBS_PER_SLOT, DESTINATIONS_IN_OUTPUT),
    outputs=(
        Output("out", "x.dtype", ("num_out_tokens", "x.shape[1]"), "permuted rows; unnamed rows 0"),
    ),
    differentiable=("x", "probs"),
    semantics=(
        "out[row_map[t, j]] = x[t] (times probs[t, j] at kernel level) for every slot with "
        "row_map[t, j] >= 0; rows no slot names (padding, rows past the real count) are 0. "
        + FP32_ACCUMULATION
        + " "
        + NO_HOST_SYNC
    ),
    edge_cases=("zero tokens: all-zero rows", "num_out_tokens = 0: empty output", ROW_MAP_BAD),
)

MOE_PERMUTE_PROBS = OpContract(
    name="moe_permute_probs",
    family="permutation",
    summary="Each slot's probability at its permuted row (Transformer Engine's permuted_probs).",
    args=(
        TensorArg("probs", FLOAT_DTYPES, (2,), "one probability per slot, (tokens, slots)"),
        ROW_MAP,
        NUM_OUT_TOKENS,
    ),
    rules=(
        Rule("probs.shape == row_map.shape", "one probability per slot"),
        DESTINATIONS_IN_OUTPUT,
    ),
    outputs=(Output("out", "probs.dtype", ("num_out_tokens",), "0 where no slot lands"),),
    differentiable=("probs",),
    semantics="out[row_map[t, j]] = probs[t, j] for every slot with row_map[t, j] >= 0; other "
    "rows 0. " + NO_HOST_SYNC,
    edge_cases=("zero tokens: all zeros", ROW_MAP_BAD),
)

MOE_UNPERMUTE = OpContract(
    name="moe_unpermute",
    family="permutation",
    summary="Sum each token's permuted rows back into one row, optionally weighted (merging probs).",
    args=(
        TensorArg("x", FLOAT_DTYPES, (2,), "permuted rows, (num_out_tokens, hidden)"),
        ROW_MAP,
        TensorArg(
            SLOT_PROBS.name,
            SLOT_PROBS.dtypes,
            SLOT_PROBS.ndim,
            "merging probabilities, (tokens, slots) (any float dtype); None means 1",
            optional=True,
        ),
    ),
    rules=(PROBS_PER_SLOT, DESTINATIONS_IN_X),
    outputs=(Output("out", "x.dtype", ("row_map.shape[0]", "x.shape[1]"), "one row per token"),),
    differentiable=("x", "probs"),
    semantics=(
        "out[t] = sum over slots j with row_map[t, j] >= 0 of probs[t, j] * x[row_map[t, j]]; "
        "a token every slot of which was dropped gets 0. Padding rows are never read. "
        + FP32_ACCUMULATION
        + " "
        + NO_HOST_SYNC
    ),
    edge_cases=("zero tokens: empty output", ROW_MAP_BAD),
)

MOE_UNPERMUTE_WGRAD = OpContract(
    name="moe_unpermute_wgrad",
    family="permutation",
    public=False,
    summary="Gradient of moe_unpermute with respect to its merging probabilities.",
    args=(
        TensorArg("x", FLOAT_DTYPES, (2,), "permuted rows, (num_out_tokens, hidden)"),
        TensorArg("grad", FLOAT_DTYPES, (2,), "gradient of the unpermuted rows, (tokens, hidden)"),
        ROW_MAP,
    ),
    rules=(
        Rule("row_map.shape[0] == grad.shape[0]", "one row map row per token of grad"),
        GRAD_HIDDEN,
        GRAD_DTYPE,
        DESTINATIONS_IN_X,
    ),
    outputs=(Output("out", "x.dtype", ("row_map.shape[0]", "row_map.shape[1]"), "per slot"),),
    differentiable=("x", "grad"),
    semantics="out[t, j] = dot(x[row_map[t, j]], grad[t]) accumulated in float32, 0 for a slot "
    "that goes nowhere.",
    edge_cases=("zero tokens: empty output", ROW_MAP_BAD),
)

MOE_SORT_CHUNKS = OpContract(
    name="moe_sort_chunks",
    family="permutation",
    summary="Reorder consecutive chunks of rows (expert parallelism's all-to-all layout).",
    args=(
        TensorArg("x", FLOAT_DTYPES, (2,), "rows, (rows, hidden), in chunks of split_sizes"),
        TensorArg(
            "split_sizes",
            INT_DTYPES,
            (1,),
            "rows of each chunk, in order; on x's device (no sync) or on the CPU",
            any_device=True,
        ),
        TensorArg(
            "sorted_index",
            INT_DTYPES,
            (1,),
            "the chunk to place at each output position; on x's device or on the CPU",
            any_device=True,
        ),
    ),
    rules=(
        Rule("sorted_index.shape[0] == split_sizes.shape[0]", "one position per chunk"),
        Rule(
            "sizes_within(split_sizes, x.shape[0])",
            "chunk sizes are not negative and none exceeds the rows of x",
            checked="split_sizes",
        ),
        Rule(
            "total(split_sizes, x.shape[0]) <= x.shape[0]",
            "the chunks fit in the rows of x",
            checked="split_sizes",
        ),
        Rule("is_permutation(sorted_index)", "sorted_index orders every chunk once", checked=True),
    ),
    outputs=(Output("out", "x.dtype", ("x.shape[0]", "x.shape[1]"), "the chunks reordered"),),
    differentiable=("x",),
    semantics=(
        "The output holds chunk sorted_index[0], then chunk sorted_index[1], …, chunk c being "
        "rows [sum(split_sizes[:c]), sum(split_sizes[:c + 1])) of x (Megatron-Core's "
        "sort_chunks_by_idxs, Transformer Engine's moe_sort_chunks_by_index). Rows past the "
        "chunks are 0. Device-side sizes: no host sync."
    ),
    edge_cases=(
        "zero rows or no chunks: an empty or all-zero output",
        "empty chunks: take no rows",
        UNCHECKED + "negative sizes count as 0, chunks past the rows of x are cut there, an "
        "index outside [0, chunks) places an empty chunk; sorted_index repeating a chunk copies "
        "it again while the output has rows; rows no chunk fills are 0",
    ),
    deviations=("Not in MegaBlocks.",),
)

MOE_PERMUTATION_OPS: tuple[OpContract, ...] = (
    MOE_PERMUTE_MAP,
    MOE_PERMUTE,
    MOE_PERMUTE_PROBS,
    MOE_UNPERMUTE,
    MOE_UNPERMUTE_WGRAD,
    MOE_SORT_CHUNKS,
)

# ---------------------------------------------------------------------------
# Composite ops: plain torch, run by the core itself on every device.

ROUND_UP = OpContract(
    name="round_up",
    family="composite",
    summary="Round each count up to a multiple of value.",
    args=(TensorArg("x", INT_DTYPES, (), "counts"), IntArg("value", "the multiple", min=1)),
    rules=(
        Rule("value <= torch.iinfo(x.dtype).max", "value fits x's dtype"),
        # Rounding up is monotonic: the largest count gives the largest result.
        Rule(
            "x.numel() == 0 or -(-int(x.max()) // value) * value <= torch.iinfo(x.dtype).max",
            "the rounded counts fit x's dtype",
            checked=True,
        ),
    ),
    outputs=(Output("out", "x.dtype", "tuple(x.shape)"),),
    semantics="out = ceil(x / value) * value, computed without intermediate wrap-around.",
    edge_cases=(
        "bad data (unchecked unless MEGABLOCKS_CHECK=1): a count whose multiple does not fit "
        "x's dtype wraps",
    ),
    deviations=(
        "Any integer dtype (MegaBlocks asserts int32).",
        "A value or a result beyond x's dtype is an error (the result in checked mode); "
        "MegaBlocks wraps, or divides by zero.",
    ),
)

REPEAT = OpContract(
    name="repeat",
    family="composite",
    summary="x.repeat(*tiling), returning x itself when every factor is 1.",
    args=(TensorArg("x", ANY_DTYPE, (), "any tensor"), SequenceArg("tiling", "repeat factors")),
    rules=(Rule("len(tiling) >= x.dim()", "one factor per dimension of x"),),
    outputs=(Output("out", "x.dtype", "repeated_shape(x, tiling)"),),
)

SUM = OpContract(
    name="sum",
    family="composite",
    summary="Sum over dim; a dim of size 1 is squeezed instead (no copy).",
    args=(
        TensorArg("x", ANY_DTYPE, (), "any tensor"),
        IntArg("dim", "dimension (None is not accepted)", default=0),
    ),
    rules=(
        Rule("x.dim() > 0", "x has a dimension to sum"),
        Rule("-x.dim() <= dim < x.dim()", "dim is a dimension of x"),
    ),
    outputs=(
        Output(
            "out",
            "x.dtype if x.is_floating_point() or x.shape[dim] == 1 else torch.int64",
            "tuple(s for i, s in enumerate(x.shape) if i != dim % x.dim())",
            "integer and bool sums promote to int64, as torch.sum does",
        ),
    ),
)

ALL: tuple[OpContract, ...] = (
    SORT,
    HISTOGRAM,
    INCLUSIVE_CUMSUM,
    EXCLUSIVE_CUMSUM,
    TOPOLOGY,
    REPLICATE,
    REPLICATE_BACKWARD,
    ROUTE,
    ROUTER_TOPK,
    GATHER,
    SCATTER,
    SCATTER_WGRAD,
    PADDED_GATHER,
    PADDED_SCATTER,
    PADDED_SCATTER_WGRAD,
    BINNED_GATHER,
    BINNED_SCATTER,
    BINNED_SCATTER_WGRAD,
    *MOE_PERMUTATION_OPS,
    GMM,
    GMM_WEIGHT_GRAD,
    GMM_WEIGHT_GRAD_ACCUMULATE,
    GATHER_GMM,
    GMM_SCATTER,
    GLU,
    GLU_BACKWARD,
    ACTIVATION_BACKWARD,
    ROUND_UP,
    REPEAT,
    SUM,
)
BY_NAME: dict[str, OpContract] = {c.name: c for c in ALL}


def family_ops(family: str) -> tuple[str, ...]:
    """Names of the dispatched ops of one family (what a backend's hook for it may return)."""
    return tuple(c.name for c in ALL if c.family == family and c.dispatched)
