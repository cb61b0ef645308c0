"""The low-precision contracts: quantization, and the grouped GEMMs of quantized operands.

Their formats are data (:mod:`megablocks_core.formats`): every scale shape, data dtype and
output dtype below is derived from the ``format`` and ``encoding`` arguments through that module,
and a kernel declares the formats it takes (``Kernel.formats``). The scaled GEMMs are the FP8
forms of gmm, gather_gmm and gmm_scatter: the same groups, routing, bad-data rules and edge
cases, with each operand given as 8-bit data and its float32 scales. They are not
differentiable themselves (8-bit data has no gradient); :mod:`megablocks_core.fp8` trains through
them, calling them from the high-precision ops' backward rules.
"""

from __future__ import annotations

from typing import Any

from .. import bias as bias_ops
from ..formats import ENCODINGS, FORMAT_NAMES, FORMATS, FP8_DTYPES, SCALE_DTYPE
from ..schema import (
    FLOAT_DTYPES,
    ChoiceArg,
    IntArg,
    OpContract,
    Output,
    Rule,
    TensorArg,
)
from .common import (
    BIN_IDS,
    BINS,
    EMPTY_AND_ZERO,
    FIRST_ROWS,
    GATHER_BAD_INDICES,
    GATHER_ROWS,
    GATHER_WEIGHTS,
    INDICES,
    INDICES_FIT,
    IS_PERMUTATION,
    PAST_BINS,
    ROWS_COVER_BINS,
    ROWS_OUT,
    ROWS_OUT_DIM,
    ROWS_WITHIN,
    SCATTER_BAD_INDICES,
    TOP_K,
    UNCHECKED,
    UNROUTED_PERMUTATION_RULES,
    WEIGHTS,
    WEIGHTS_LENGTH,
    WHOLE_TOKENS,
)
from .grouped_gemm import (
    BATCH_SIZES,
    BIAS_SHAPE,
    FUSED_BAD_BINS,
    GMM_BAD_SIZES,
    GROUPS_FIT_A,
    GROUPS_FROM_BINS,
    GROUPS_WITHIN_A,
    INNER_B,
    ONE_MATRIX_PER_BIN,
    ROUTED_RULES,
    ROWS_PAST_GROUPS,
    ROWS_SHORT,
    TRANS_B,
    groups_within,
)

FORMATS_DOC = "; ".join(f"'{f.name}': {f.doc}" for f in FORMATS.values())
FORMAT = ChoiceArg(
    "format",
    "the operands' format (megablocks_core.formats): " + FORMATS_DOC,
    FORMAT_NAMES,
)
FORMAT_GIVEN = Rule(
    "format is not None", f"a format is named (one of {', '.join(FORMAT_NAMES)})", error=TypeError
)
OUT_DTYPE = ChoiceArg(
    "out_dtype",
    "the output's dtype: 'bfloat16' (None), 'float16' or 'float32'",
    ("bfloat16", "float16", "float32"),
)
OUT = "out_dtype_of(out_dtype)"

ENCODING = ChoiceArg(
    "encoding",
    "the data's 8-bit encoding: "
    + "; ".join(f"'{e.name}': {e.doc}" for e in ENCODINGS.values())
    + "; None: the one x's device takes (FNUZ on gfx942, OCP elsewhere)",
    tuple(ENCODINGS),
)

QUANTIZE = OpContract(
    name="quantize",
    family="quantization",
    summary="Quantize a GEMM operand to 8-bit data and float32 block scales in a format.",
    args=(
        TensorArg(
            "x",
            FLOAT_DTYPES,
            (2, 3),
            "a row operand (rows, k), or expert matrices (experts, k, n) / (experts, n, k)",
        ),
        IntArg(
            "reduce_dim",
            "the dimension of x the GEMM sums over: 1 for a row operand; 1 or 2 for matrices "
            "(1 for (experts, k, n), 2 for (experts, n, k))",
            min=1,
            max=2,
        ),
        FORMAT,
        ENCODING,
    ),
    rules=(
        FORMAT_GIVEN,
        Rule("reduce_dim < x.dim()", "reduce_dim is a dimension of x"),
        Rule("x.dim() == 3 or reduce_dim == 1", "a row operand (rows, k) is summed over k"),
    ),
    outputs=(
        Output(
            "data",
            "encoding_of(encoding, x.device).dtype",
            "tuple(x.shape)",
            "x's shape, contiguous",
        ),
        Output(
            "scale",
            "torch.float32",
            "operand_scale_shape(format, x.shape, reduce_dim)",
            "one float32 per block, contiguous: (rows, 1) or (rows, ceil(k/128)) for rows; "
            "(experts, 1, n) / (experts, n, 1) per column, or (experts, ceil(./128), ceil(./128)) "
            "per tile, for matrices",
        ),
    ),
    semantics=(
        "Cuts x into the format's blocks (megablocks_core.formats.Format.block) and stores each "
        "as data * scale: amax is the block's largest |x| (x taken in float32), scale = max(amax "
        "/ max, 2**-126) in float32, rounded up to a power of two where the format says; data = "
        "x * (1 / scale) (the float32 reciprocal, one float32 product), clamped to the "
        "encoding's largest value and rounded to nearest, ties to even (megablocks_core.formats."
        "quantize is the definition: a backend matches it bit for bit). x may be any strided "
        "view, e.g. an expert matrix's transpose, to store the other dimension contiguous."
    ),
    edge_cases=(
        "an empty block (zero rows, or k = 0) has amax 0; an all-zero block has scale 2**-126 "
        "and data 0",
        "a block holding a NaN or an infinity: scale NaN and every element NaN (0x7F in e4m3fn, "
        "0x80 in e4m3fnuz)",
        "a value that rounds to zero is +0 in e4m3fnuz (which has no -0)",
    ),
)

QUANTIZE_BOTH_WAYS = OpContract(
    name="quantize_both_ways",
    family="quantization",
    summary="Quantize expert matrices for both GEMMs that read them, in one call.",
    args=(
        TensorArg(
            "x",
            FLOAT_DTYPES,
            (3,),
            "expert matrices (experts, p, q), any strides: a weight the forward sums over one "
            "dim of and the data gradient over the other",
        ),
        FORMAT,
        ENCODING,
    ),
    rules=(FORMAT_GIVEN,),
    outputs=(
        Output(
            "data",
            "encoding_of(encoding, x.device).dtype",
            "tuple(x.shape)",
            "quantize(x, 2, format, encoding)'s data: (experts, p, q), q contiguous",
        ),
        Output(
            "scale",
            "torch.float32",
            "operand_scale_shape(format, x.shape, 2)",
            "quantize(x, 2, format, encoding)'s scale",
        ),
        Output(
            "data_t",
            "encoding_of(encoding, x.device).dtype",
            "(x.shape[0], x.shape[2], x.shape[1])",
            "quantize(x.transpose(1, 2), 2, format, encoding)'s data: (experts, q, p), p "
            "contiguous",
        ),
        Output(
            "scale_t",
            "torch.float32",
            "operand_scale_shape(format, (x.shape[0], x.shape[2], x.shape[1]), 2)",
            "quantize(x.transpose(1, 2), 2, format, encoding)'s scale",
        ),
    ),
    semantics=(
        "Exactly quantize(x, 2, format, encoding) and quantize(x.transpose(1, 2), 2, format, "
        "encoding), bit for bit: x summed over q, and over p, each copy stored with its summed "
        "dim contiguous (the layout NVIDIA Hopper's FP8 matrix instructions read). One "
        "op, so that a kernel can read x once for both copies (the blockwise format's 128 x 128 "
        "tiles are the same blocks either way)."
    ),
    edge_cases=(
        "as quantize's, for each copy: an empty x gives empty data and the smallest scale "
        "(2**-126) for any empty block",
        "a NaN or an infinity in x makes NaN the scale and the data of every block holding it, "
        "in each copy",
    ),
)

GROUP_SIZES = TensorArg(
    "batch_sizes",
    BATCH_SIZES.dtypes,
    (1,),
    "rows per expert, the groups in order from the first row; on the CPU or on the data's device",
    any_device=True,
)
GROUPED_COLUMNS = Rule(
    "has_grouped_columns(format)",
    "the format defines weight-gradient operands (fp8_rowwise; fp8_blockwise's would need "
    "groups aligned to its 128-row blocks)",
)
GROUPED_COLUMNS_BAD_SIZES = (
    UNCHECKED + "device-side batch_sizes that are negative or sum past the rows: a negative "
    "size counts as 0 and groups are cut at the last row"
)


#: The weight gradient's operands' scales: one per column of each expert's rows.
GROUPED_COLUMN_SCALE = Output(
    "scale",
    "torch.float32",
    "grouped_column_scale_shape(format, batch_sizes.shape[0], x.shape[1])",
    "(experts, c): scale[e, j] serves column j of expert e's rows",
)

QUANTIZE_TRANSPOSED = OpContract(
    name="quantize_transposed",
    family="quantization",
    summary=(
        "Quantize a weight gradient's row operand: each column scaled over each expert's rows, "
        "stored transposed."
    ),
    args=(
        TensorArg(
            "x",
            FLOAT_DTYPES,
            (2,),
            "rows grouped by expert, (rows, c), any strides: the rows or the output gradient a "
            "weight gradient sums over",
        ),
        GROUP_SIZES,
        FORMAT,
        ENCODING,
    ),
    rules=(FORMAT_GIVEN, GROUPED_COLUMNS, *groups_within("x.shape[0]", "the rows of x")),
    outputs=(
        Output(
            "data",
            "encoding_of(encoding, x.device).dtype",
            "(x.shape[1], x.shape[0])",
            "x transposed, (c, rows), rows contiguous: the layout NVIDIA Hopper's FP8 matrix "
            "instructions read for a sum over rows",
        ),
        GROUPED_COLUMN_SCALE,
    ),
    semantics=(
        "Expert e's rows x[rows of e] (the groups in order from row 0) are quantized as quantize "
        "defines it (megablocks_core.formats.quantize, bit for bit) with one block per column: "
        "scale[e, j] from the largest |x| of column j over those rows, data[j, rows of e] = "
        "those values over that scale. " + ROWS_PAST_GROUPS + ": their data is 0."
    ),
    edge_cases=(
        "an empty expert's scales are 2**-126 (amax 0); rows = 0 or c = 0: empty data",
        "a NaN or an infinity in column j of expert e's rows: scale[e, j] NaN and that column's "
        "data NaN over those rows",
        GROUPED_COLUMNS_BAD_SIZES,
    ),
)

GATHERED_ROWS = f"({ROWS_OUT_DIM})"

GATHER_QUANTIZE_TRANSPOSED = OpContract(
    name="gather_quantize_transposed",
    family="quantization",
    public=False,
    summary=(
        "quantize_transposed of gather's expert-sorted rows, read from the token rows (the "
        "gathered rows are never written)."
    ),
    args=(
        TensorArg("x", FLOAT_DTYPES, (2,), "token rows, (tokens, c), any strides"),
        INDICES,
        GATHER_WEIGHTS,
        TOP_K,
        GROUP_SIZES,
        ROWS_OUT,
        FORMAT,
        ENCODING,
    ),
    rules=(
        FORMAT_GIVEN,
        GROUPED_COLUMNS,
        GATHER_ROWS,
        WHOLE_TOKENS,
        WEIGHTS_LENGTH,
        INDICES_FIT,
        IS_PERMUTATION,
        ROWS_WITHIN,
        *groups_within(GATHERED_ROWS, "the gathered rows"),
    ),
    outputs=(
        Output(
            "data",
            "encoding_of(encoding, x.device).dtype",
            f"(x.shape[1], {GATHERED_ROWS})",
            "the gathered rows transposed, (c, rows), rows contiguous (quantize_transposed's data)",
        ),
        GROUPED_COLUMN_SCALE,
    ),
    semantics=(
        "Bit for bit quantize_transposed(gather(x, indices, bin_ids, weights, bins, top_k, "
        "rows), batch_sizes, format, encoding): sorted row i is x[indices[i] // top_k], times "
        "weights[indices[i]] in float32 rounded to x's dtype, for i < rows (all sorted rows "
        "without rows), grouped by batch_sizes from row 0. The weight gradient of gather_gmm "
        "(and of gmm_scatter, with the top-k weights) reads its row operand this way."
    ),
    edge_cases=(
        "an empty expert's scales are 2**-126 (amax 0); no rows or c = 0: empty data",
        "a NaN or an infinity in column j of expert e's gathered rows: scale[e, j] NaN and that "
        "column's data NaN over those rows",
        GATHER_BAD_INDICES,
        GROUPED_COLUMNS_BAD_SIZES,
    ),
)

SCALE_DOC = "float32 scales of {name}, the shape its format gives (quantize's scale)"


def _scale_arg(name: str, ndim: int) -> TensorArg:
    return TensorArg(
        f"{name}_scale", frozenset({SCALE_DTYPE}), (ndim,), SCALE_DOC.format(name=name)
    )


def _scale_rules(rows: str, matrices: str) -> tuple[Rule, ...]:
    return (
        FORMAT_GIVEN,
        Rule(
            f"{matrices}.dtype == {rows}.dtype",
            f"{rows} and {matrices} share one encoding",
            error=TypeError,
        ),
        Rule(
            f"{rows}_scale.shape == operand_scale_shape(format, {rows}.shape, 1)",
            f"{rows}_scale has the shape {rows}'s format gives",
        ),
        Rule(
            f"{matrices}_scale.shape == operand_scale_shape(format, {matrices}.shape, "
            "2 if trans_b else 1)",
            f"{matrices}_scale has the shape {matrices}'s format gives (summed over k)",
        ),
    )


FP8_ROWS = "8-bit rows ({what}), (rows, k)"
MATRICES = TensorArg(
    "b",
    FP8_DTYPES,
    (3,),
    "8-bit expert matrices, (experts, k, n) or (experts, n, k) with trans_b (the latter, k "
    "contiguous, is the fast layout on NVIDIA Hopper)",
)


def _bias_arg(serve: Any, doc: str = "added to each expert's output rows") -> TensorArg:
    """The per-expert bias of a scaled GEMM: an option a kernel may leave to the core, as the
    16-bit GEMMs' (any float dtype: it is added to the float32 product, not multiplied)."""
    return TensorArg(
        "bias",
        FLOAT_DTYPES,
        (2,),
        f"per-expert bias (experts, n), {doc}; None: none",
        optional=True,
        serve=serve,
    )


BIAS_ADDED = (
    "With bias, bias[e] is added to each row of group e: to the float32 product, rounded once, "
    "by a kernel that takes it; by the core to the rounded output of one that does not "
    "(megablocks_core.bias), one more rounding."
)

SCALED_ARITHMETIC = (
    "Each product is taken from the dequantized operands (data * scale, megablocks_core.formats."
    "dequantize): exact in float32 for 8-bit data, summed in float32 with the running sum "
    "promoted to full float32 at least every 128 k (no long reduced-precision accumulation) and "
    "rounded once to out_dtype. A kernel may apply a row-constant or column-constant scale "
    "after the sum (exact up to float32 rounding). Between two promotions FP8 matrix units may "
    "keep the sum in fewer bits (NVIDIA Hopper's: about 2**-13 of the largest term): outputs "
    "are held to 2**-10 of the output's largest element."
)
#: The kit's least tolerance for them (OpContract.tolerance).
SCALED_TOLERANCE = 2.0**-10

SCALED_GMM = OpContract(
    tolerance=SCALED_TOLERANCE,
    name="scaled_gmm",
    family="grouped_gemm",
    summary="gmm of quantized operands: each expert's rows of a times that expert's matrix.",
    args=(
        TensorArg("a", FP8_DTYPES, (2,), FP8_ROWS.format(what="grouped by expert")),
        _scale_arg("a", 2),
        MATRICES,
        _scale_arg("b", 3),
        BATCH_SIZES,
        TRANS_B,
        FORMAT,
        OUT_DTYPE,
        _bias_arg(bias_ops.serve_gmm),
    ),
    rules=(
        *_scale_rules("a", "b"),
        BIAS_SHAPE,
        Rule("batch_sizes.shape[0] == b.shape[0]", "one group size per expert"),
        Rule("a.shape[1] == (b.shape[2] if trans_b else b.shape[1])", "inner dimensions agree"),
        GROUPS_WITHIN_A,
        GROUPS_FIT_A,
    ),
    outputs=(Output("out", OUT, ("a.shape[0]", "b.shape[1] if trans_b else b.shape[2]")),),
    semantics=(
        "Rows bins[e-1]:bins[e] of the output are dequant(a)[those rows] @ dequant(b)[e] (or its "
        "transpose). "
        + SCALED_ARITHMETIC
        + " "
        + BIAS_ADDED
        + " "
        + ROWS_PAST_GROUPS
        + ": their output rows are 0 (no bias)."
    ),
    edge_cases=("rows = 0: empty output", "empty experts: no rows", GMM_BAD_SIZES),
)

SCALED_GATHER_GMM = OpContract(
    tolerance=SCALED_TOLERANCE,
    name="scaled_gather_gmm",
    family="grouped_gemm",
    summary="gather_gmm of quantized operands: rows read from the 8-bit tokens through the routing.",
    args=(
        TensorArg("x", FP8_DTYPES, (2,), FP8_ROWS.format(what="one per token")),
        _scale_arg("x", 2),
        MATRICES,
        _scale_arg("b", 3),
        INDICES,
        BIN_IDS,
        BINS,
        TOP_K,
        TRANS_B,
        IntArg(
            "rows",
            "compute only the first rows sorted rows (as gather_gmm's rows); None: all of them",
            min=0,
            optional=True,
        ),
        FORMAT,
        OUT_DTYPE,
        _bias_arg(bias_ops.serve_gather_gmm),
    ),
    rules=(
        *_scale_rules("x", "b"),
        BIAS_SHAPE,
        ONE_MATRIX_PER_BIN,
        INNER_B,
        GATHER_ROWS,
        *ROUTED_RULES,
        ROWS_WITHIN,
        ROWS_COVER_BINS,
    ),
    outputs=(
        Output(
            "out",
            OUT,
            (ROWS_OUT_DIM, "b.shape[1] if trans_b else b.shape[2]"),
            "expert-sorted rows",
        ),
    ),
    semantics=(
        "Exactly scaled_gmm of the gathered rows: sorted row i is dequant(x)[indices[i] // top_k] "
        "@ dequant(b)[e] for the expert e whose rows hold i (each token's row and scales are "
        "quantized once, whatever its top_k copies). "
        + GROUPS_FROM_BINS
        + " "
        + PAST_BINS
        + ": their output rows are 0 (no bias). "
        + FIRST_ROWS
        + " "
        + SCALED_ARITHMETIC
        + " "
        + BIAS_ADDED
    ),
    edge_cases=(*EMPTY_AND_ZERO, GATHER_BAD_INDICES, FUSED_BAD_BINS, ROWS_SHORT),
)

SCALED_GMM_SCATTER = OpContract(
    tolerance=SCALED_TOLERANCE,
    name="scaled_gmm_scatter",
    family="grouped_gemm",
    summary="gmm_scatter of quantized operands: products summed straight back into token order.",
    args=(
        TensorArg("x", FP8_DTYPES, (2,), FP8_ROWS.format(what="expert-sorted")),
        _scale_arg("x", 2),
        MATRICES,
        _scale_arg("b", 3),
        INDICES,
        BIN_IDS,
        WEIGHTS,
        BINS,
        TOP_K,
        TRANS_B,
        IntArg(
            "rows",
            "x holds only the first rows sorted rows (as gmm_scatter's rows); None: all of them",
            min=0,
            optional=True,
        ),
        FORMAT,
        OUT_DTYPE,
        _bias_arg(bias_ops.serve_gmm_scatter, "added to each (token, k) product row"),
    ),
    rules=(
        *_scale_rules("x", "b"),
        BIAS_SHAPE,
        ONE_MATRIX_PER_BIN,
        INNER_B,
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
            OUT,
            ("indices.shape[0] // top_k", "b.shape[1] if trans_b else b.shape[2]"),
            "one row per token",
        ),
    ),
    semantics=(
        "Exactly scatter(scaled_gmm(x, ...), indices, bin_ids, weights, bins, top_k): each sorted "
        "row's product rounded to out_dtype, then out[t] = sum over k of weights[t*top_k + k] * "
        "product row, weighted and summed in float32 and rounded once to out_dtype. "
        + GROUPS_FROM_BINS
        + " "
        + PAST_BINS
        + ": they are skipped. "
        + SCALED_ARITHMETIC
        + " With bias, bias[e] is added to each product row of group e before its rounding, so "
        "token t also gets sum over k of weights[t*top_k + k] * bias[e]; a kernel that leaves "
        "the bias to the core gets it added to its output (megablocks_core.bias), one more "
        "rounding."
    ),
    edge_cases=(*EMPTY_AND_ZERO, SCATTER_BAD_INDICES, FUSED_BAD_BINS, ROWS_SHORT),
)

SCALED_GMM_WEIGHT_GRAD = OpContract(
    tolerance=SCALED_TOLERANCE,
    name="scaled_gmm_weight_grad",
    family="grouped_gemm",
    summary=(
        "gmm_weight_grad of quantized operands: per expert, the transposed rows times the "
        "transposed gradient, summed over the expert's rows."
    ),
    args=(
        TensorArg(
            "a", FP8_DTYPES, (2,), "8-bit rows transposed, (k, rows) (quantize_transposed's data)"
        ),
        TensorArg("a_scale", frozenset({SCALE_DTYPE}), (2,), "float32 scales of a, (experts, k)"),
        TensorArg(
            "grad",
            FP8_DTYPES,
            (2,),
            "8-bit output gradient transposed, (n, rows) (quantize_transposed's data)",
        ),
        TensorArg(
            "grad_scale", frozenset({SCALE_DTYPE}), (2,), "float32 scales of grad, (experts, n)"
        ),
        GROUP_SIZES,
        FORMAT,
        OUT_DTYPE,
    ),
    rules=(
        FORMAT_GIVEN,
        GROUPED_COLUMNS,
        Rule("grad.dtype == a.dtype", "a and grad share one encoding", error=TypeError),
        Rule("grad.shape[1] == a.shape[1]", "a and grad have the same rows"),
        Rule(
            "a_scale.shape == grouped_column_scale_shape(format, batch_sizes.shape[0], a.shape[0])",
            "a_scale has one scale per expert and row of a",
        ),
        Rule(
            "grad_scale.shape == grouped_column_scale_shape(format, batch_sizes.shape[0], "
            "grad.shape[0])",
            "grad_scale has one scale per expert and row of grad",
        ),
        *groups_within("a.shape[1]", "the rows (a's columns)"),
    ),
    outputs=(Output("out", OUT, ("batch_sizes.shape[0]", "a.shape[0]", "grad.shape[0]")),),
    semantics=(
        "out[e] = dequant(a)[:, rows of e] @ dequant(grad)[:, rows of e].T, each column of a "
        "and grad dequantized with expert e's scale (the weight gradient out[e] = x[rows of "
        "e].T @ dy[rows of e] of gmm, from quantize_transposed(x) and quantize_transposed(dy)). "
        + SCALED_ARITHMETIC.replace("every 128 k", "every 128 rows")
        + " "
        + ROWS_PAST_GROUPS
        + ": they are ignored."
    ),
    edge_cases=(
        "an empty expert gets exactly 0 (whatever its scales)",
        GROUPED_COLUMNS_BAD_SIZES,
    ),
)

SCALED_OPS = (
    QUANTIZE,
    QUANTIZE_BOTH_WAYS,
    QUANTIZE_TRANSPOSED,
    GATHER_QUANTIZE_TRANSPOSED,
    SCALED_GMM,
    SCALED_GATHER_GMM,
    SCALED_GMM_SCATTER,
    SCALED_GMM_WEIGHT_GRAD,
)
