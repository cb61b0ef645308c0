"""What many op contracts share: argument specs, rules, outputs and the prose of their edge
cases, one definition each.
"""

from __future__ import annotations

from ..schema import FLOAT_DTYPES, INT_DTYPES, IntArg, Output, RowsOption, Rule, TensorArg

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
