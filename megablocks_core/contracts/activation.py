"""The activation ops' contracts: the gated unit (glu) between a gated expert's two GEMMs, and
the activations' backward.
"""

from __future__ import annotations

from ..activations import GLU_NAMES, ROW_NAMES
from ..schema import FLOAT_DTYPES, ChoiceArg, OpContract, Output, Rule, TensorArg
from .grouped_gemm import (
    ACTIVATED_WIDTH,
    CLAMP_CONSTANTS,
    CLAMP_RULES,
    GATED_EVEN,
    GELU_NAMES_DOC,
    ROW_ACTIVATION_DOC,
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
    "clamped unit (up + 1) * g * sigmoid(alpha g) with g = min(gate, limit) and up clamped to "
    "[-limit, limit] (alpha and limit: the arguments, GPT-OSS's 1.702 and 7.0 when None); any "
    "of them with the suffix '_interleaved': gate and up interleaved (gate in even "
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
    args=(GATE_UP, GLU_ACTIVATION, *CLAMP_CONSTANTS),
    rules=(EVEN_WIDTH, *CLAMP_RULES),
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
        *CLAMP_CONSTANTS,
    ),
    rules=(
        Rule("x.dtype == grad.dtype", "grad and x have the same dtype", error=TypeError),
        EVEN_WIDTH,
        *CLAMP_RULES,
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
        *CLAMP_CONSTANTS,
    ),
    rules=(
        Rule("x.dtype == grad.dtype", "grad and x have the same dtype", error=TypeError),
        GATED_EVEN,
        *CLAMP_RULES,
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
