"""The composite ops' contracts: plain torch, run by the core itself on every device."""

from __future__ import annotations

from ..schema import INT_DTYPES, IntArg, OpContract, Output, Rule, SequenceArg, TensorArg
from .common import ANY_DTYPE

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
