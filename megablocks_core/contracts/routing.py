"""The routing ops' contracts: sort, histogram, cumsums, topology, replicate, route, router_topk."""

from __future__ import annotations

from ..schema import FLOAT_DTYPES, INT_DTYPES, BoolArg, IntArg, OpContract, Output, Rule, TensorArg
from .common import BINS, PADDED_BINS, UNCHECKED, int16_fits

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
