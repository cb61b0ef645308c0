"""The grouped GEMMs' contracts: gmm, its weight gradients, and the fused permutation + grouped
GEMM ops (gather_gmm, gmm_scatter).
"""

from __future__ import annotations

from torch import Tensor

from .. import bias as bias_ops
from ..activations import CLAMPED, GATED, ROW_NAMES, activate_with
from ..calls import call
from ..schema import (
    COUNT_DTYPES,
    FLOAT_DTYPES,
    BoolArg,
    ChoiceArg,
    FloatArg,
    OpContract,
    Output,
    Rule,
    TensorArg,
)
from .common import (
    BIN_IDS,
    BIN_IDS_MATCH,
    BINS,
    BINS_SORTED,
    BINS_WITHIN,
    EMPTY_AND_ZERO,
    FIRST_ROWS,
    FP32_ACCUMULATION,
    GATHER_ROWS,
    INDICES,
    INDICES_FIT,
    IS_PERMUTATION,
    PAST_BINS,
    ROWS_COVER_BINS,
    ROWS_IN,
    ROWS_OUT,
    ROWS_OUT_DIM,
    ROWS_WITHIN,
    SAME_LENGTH,
    SCATTER_BAD_INDICES,
    SORTED_ROWS,
    TOKENS,
    TOP_K,
    UNCHECKED,
    UNROUTED_PERMUTATION_RULES,
    WEIGHTS,
    WHOLE_TOKENS,
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


def groups_within(rows: str, rows_doc: str) -> tuple[Rule, Rule]:
    """batch_sizes' two rules against ``rows`` (an expression; ``rows_doc`` names it). Checked
    always when batch_sizes is on the CPU (no device sync), otherwise only in checked mode. Each
    size is bounded first, so that the sum cannot wrap around (int64 sizes [2**63 - 1,
    2**63 - 1, 6] must not pass for 4 rows). The groups may end before the last row: the rows
    past them belong to no group (expert parallelism's rows of other ranks' experts, seen
    through the fused ops' backward)."""
    return (
        Rule(
            f"sizes_within(batch_sizes, {rows})",
            f"group sizes are not negative and none exceeds {rows_doc}",
            checked="batch_sizes",
        ),
        Rule(
            f"total(batch_sizes, {rows}) <= {rows}",
            f"the groups fit in {rows_doc}",
            checked="batch_sizes",
        ),
    )


GROUPS_WITHIN_A, GROUPS_FIT_A = groups_within("a.shape[0]", "the rows of a")
ROWS_PAST_GROUPS = (
    "batch_sizes may sum to less than the rows of a, and the rows past the last group belong to "
    "no group"
)

GMM_BAD_SIZES = (
    UNCHECKED + "device-side batch_sizes that are negative or sum past the rows of a: a "
    "negative size counts as 0, groups are cut at a's last row, and output rows no group covers "
    "are 0"
)

# The per-expert bias: an option a kernel may leave to the core, which adds it around a kernel
# that does not take it (megablocks_core.bias); the Triton kernels add it in their epilogue.
BIAS_DOC = (
    "per-expert bias added to each expert's output rows, (experts, n) in x's dtype; None: none"
)
BIAS_OPTION_GMM = TensorArg(
    "bias", FLOAT_DTYPES, (2,), BIAS_DOC, optional=True, serve=bias_ops.serve_gmm
)
OUT_WIDTH = "(b.shape[1] if trans_b else b.shape[2])"
BIAS_SHAPE = Rule(
    f"bias is None or (bias.shape[0] == b.shape[0] and bias.shape[1] == {OUT_WIDTH})",
    "bias holds one row per expert, as wide as the output, (experts, n)",
)


def bias_rules(data: str) -> tuple[Rule, ...]:
    return (
        Rule(
            f"bias is None or bias.dtype == {data}.dtype",
            f"bias has {data}'s dtype",
            error=TypeError,
        ),
        BIAS_SHAPE,
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


def _activate_rows(
    x: Tensor, name: str, alpha: float | None = None, limit: float | None = None
) -> Tensor:
    """gmm_scatter's activation for a kernel that does not apply it itself (a gated one through
    the dispatched glu op, run by name: the contracts import no entries)."""
    return activate_with(call, x, name, alpha, limit)


GELU_NAMES_DOC = (
    "'gelu' is the tanh approximation (MegaBlocks' default; 'gelu_tanh' names it explicitly), "
    "'gelu_erf' the exact erf form (torch's and transformers' 'gelu')"
)
ROW_ACTIVATION_DOC = (
    "'gelu', 'gelu_tanh', 'gelu_erf', 'silu' or 'relu'; or gated, on rows that hold gate and up "
    "side by side, (rows, 2n) -> (rows, n) as glu: 'geglu' (= 'geglu_tanh'), 'geglu_erf', "
    "'swiglu', 'reglu' (act(gate) * up with that GELU, SiLU, ReLU), 'bilinear' (gate * up) or "
    "'swiglu_oai' (GPT-OSS's clamped SwiGLU, glu's 'silu_oai', with the constants alpha and "
    "limit); each gated one but 'bilinear' "
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
CLAMPED_NAMES = repr(CLAMPED)
#: The clamped SwiGLU's constants, parameters of the activation (trailing options: a kernel that
#: takes the activation but not them declines the calls that set them).
CLAMP_CONSTANTS = (
    FloatArg(
        "alpha",
        "the clamped SwiGLU's alpha, sigmoid(alpha g) (transformers' GptOssConfig.swiglu_alpha); "
        "None: GPT-OSS's 1.702. Only with " + CLAMPED_NAMES,
        of="activation",
    ),
    FloatArg(
        "limit",
        "the clamped SwiGLU's limit: the gate is clamped from above at limit, up to "
        "[-limit, limit] (GptOssConfig.swiglu_limit; inf: no clamp); None: GPT-OSS's 7.0. "
        "Only with " + CLAMPED_NAMES,
        of="activation",
    ),
)
CLAMP_RULES = (
    Rule(
        f"(alpha is None and limit is None) or activation in {CLAMPED_NAMES}",
        "alpha and limit are constants of the clamped SwiGLU only",
    ),
    Rule("alpha is None or isfinite(alpha)", "alpha is finite"),
    Rule("limit is None or limit > 0", "limit is positive (inf: no clamp)"),
)
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
# gather's rule for such ids, told for a GEMM with a bias: the row gathered is 0, not the output.
GATHER_GMM_BAD_INDICES = (
    UNCHECKED + "indices not a permutation: a sorted row whose flat id is in [0, tokens * top_k) "
    "reads x[id // top_k], duplicate ids included; a row whose id is out of range (negative "
    "too) reads a zero row, so its output is bias[e] with bias (0 without), its gradient "
    "reaches bias only"
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
    edge_cases=(*EMPTY_AND_ZERO, GATHER_GMM_BAD_INDICES, FUSED_BAD_BINS, ROWS_SHORT),
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
        *CLAMP_CONSTANTS,
    ),
    rules=(
        SAME_DTYPE_B,
        ONE_MATRIX_PER_BIN,
        *bias_rules("x"),
        GATED_EVEN,
        *CLAMP_RULES,
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
