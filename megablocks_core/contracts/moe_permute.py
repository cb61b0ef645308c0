"""The Megatron-Core / Transformer Engine permutation ops' contracts (``moe_permute`` and its
family), and the row map format they share.
"""

from __future__ import annotations

import torch

from ..schema import FLOAT_DTYPES, INT_DTYPES, IntArg, OpContract, Output, Rule, TensorArg
from .common import FP32_ACCUMULATION, GRAD_DTYPE, GRAD_HIDDEN, UNCHECKED

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
