"""The conformance kit's comparisons: one call's outputs (and what it wrote in place) against
another's, and against the shapes, dtypes and device the contract computes.

Used by the kit's stages (:mod:`.stages`) and by the bad-data checks (:mod:`.bad_data`,
:mod:`.bad_results`); re-exported by :mod:`.kit`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..schema import RULE_HELPERS, OpContract
from ..validation import output_meta

#: Relative tolerance per floating-point dtype. An element passes when
#: ``|got - want| <= tol * (|want| + max(1, max|want|))``: relative to the element and to the
#: output's scale, so values near zero are not held to an impossible standard.
#: Integer and bool outputs must match exactly.
TOLERANCES: dict[torch.dtype, float] = {
    torch.float64: 1e-10,
    torch.float32: 1e-5,
    torch.float16: 2e-3,
    torch.bfloat16: 1e-2,
}


class Mismatch(AssertionError):
    """A check failed; the message says where and how."""


def _describe_index(index: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(i) for i in index) + "]"


def compare(
    got: Any, want: torch.Tensor, what: str, source: str = "the reference", least: float = 0.0
) -> None:
    """Raise :class:`Mismatch` unless ``got`` matches ``want`` (from ``source``) in shape, dtype,
    device and values (floats within their dtype's tolerance, at least ``least``)."""
    if not isinstance(got, torch.Tensor):
        raise Mismatch(f"{what} is a {type(got).__name__}, expected a tensor")
    if got.shape != want.shape:
        raise Mismatch(f"{what} has shape {tuple(got.shape)}, {source} {tuple(want.shape)}")
    if got.dtype != want.dtype:
        raise Mismatch(f"{what} has dtype {got.dtype}, {source} {want.dtype}")
    if got.device != want.device:
        raise Mismatch(f"{what} is on {got.device}, {source} on {want.device}")
    g, w = got.detach().cpu(), want.detach().cpu()
    tol = TOLERANCES.get(want.dtype)
    if tol is None:  # integers, bool: exact
        bad = g != w
        rule = "exactly"
    else:
        g64, w64 = g.double(), w.double()
        tol = max(tol, least)
        scale = max(1.0, float(w64.abs().max())) if w64.numel() else 1.0
        bad = ~torch.isclose(g64, w64, rtol=tol, atol=tol * scale, equal_nan=True)
        rule = f"within {tol:g} relative ({want.dtype})"
    if bool(bad.any()):
        index = tuple(int(i) for i in bad.nonzero()[0])
        raise Mismatch(
            f"{what}{_describe_index(index)} = {g[index].item()!r}, {source} gives "
            f"{w[index].item()!r} ({int(bad.sum())} of {bad.numel()} elements differ; "
            f"must match {rule})"
        )
    _compare_zero_rows(g, w, what, source)


def _compare_zero_rows(got: torch.Tensor, want: torch.Tensor, what: str, source: str) -> None:
    """Rows (along the last dimension, at least two elements) that ``want`` gives as all zeros must
    be exactly zero: padding rows, empty experts' weight gradients, dropped tokens. Rows of the
    kit's random values practically never cancel to zero, so these zeros are the contract's."""
    if got.dim() < 2 or got.shape[-1] < 2 or not got.numel() or not got.is_floating_point():
        return
    zero_rows = (want.reshape(-1, want.shape[-1]) == 0).all(dim=1)
    wrong = zero_rows[:, None] & (got.reshape(-1, got.shape[-1]) != 0)
    if bool(wrong.any()):
        row, column = (int(i) for i in wrong.nonzero()[0])
        flat = torch.tensor(row * got.shape[-1] + column)
        index = tuple(int(i) for i in torch.unravel_index(flat, tuple(got.shape)))
        raise Mismatch(
            f"{what}{_describe_index(index)} = {got[index].item()!r} in a row that {source} "
            f"gives as exact zeros ({int(wrong.any(dim=1).sum())} such rows are not; the "
            f"contract's zero rows must be exactly 0)"
        )


def _outputs(value: Any) -> tuple[Any, ...]:
    return value if isinstance(value, tuple) else (value,)


#: What one call produced: its return value, and each mutable argument as the call left it.
Effects = tuple[Any, tuple[torch.Tensor, ...]]


def call_on_copies(fn: Callable[..., Any], contract: OpContract, args: tuple[Any, ...]) -> Effects:
    """Call ``fn`` with a fresh copy of each mutable argument of the contract (so ``args`` stay as
    they were, and a repeated call starts from the same values): (its return value, the copies as
    it left them). For an op without mutable arguments, ``(fn(*args), ())``."""
    if not contract.mutated:
        return fn(*args), ()
    copies = {
        a.name: v.clone() for a, v in zip(contract.args, args, strict=True) if a in contract.mutated
    }
    result = fn(*(copies.get(a.name, v) for a, v in zip(contract.args, args, strict=True)))
    return result, tuple(copies.values())


def compare_calls(
    contract: OpContract, got: Effects, want: Effects, what: str, source: str = "the reference"
) -> None:
    """Compare two calls' outputs and what they wrote in place (:func:`call_on_copies`). The
    return value of an op without outputs is not compared: :func:`check_meta` requires None."""
    (got_out, got_written), (want_out, want_written) = got, want
    if contract.outputs:
        got_t, want_t = _outputs(got_out), _outputs(want_out)
        if len(got_t) != len(want_t):
            raise Mismatch(f"{what} returned {len(got_t)} outputs, the contract says {len(want_t)}")
        for out, g, w in zip(contract.outputs, got_t, want_t, strict=True):
            compare(g, w, f"{what} output '{out.name}'", source, contract.tolerance)
    for spec, g, w in zip(contract.mutated, got_written, want_written, strict=True):
        compare(g, w, f"{what} '{spec.name}' (written in place)", source)


def check_meta(contract: OpContract, args: tuple[Any, ...], got: Any) -> None:
    """Output count, shapes, dtypes and device as the contract computes them (data-dependent
    sizes read from the arguments; one that data makes negative counts as 0). An op without
    outputs must return None."""
    if not contract.outputs:
        if got is not None:
            raise Mismatch(
                f"returned a {type(got).__name__}; the contract says None (it writes "
                + ", ".join(f"'{a.name}'" for a in contract.mutated)
                + " in place)"
            )
        return
    bound = contract.bind(args)
    scope = {**RULE_HELPERS, **bound}
    metas = output_meta(contract, bound, lambda dim: max(eval(dim.expr, scope), 0))
    device = bound[contract.primary.name].device
    outs = _outputs(got)
    if len(outs) != len(metas):
        raise Mismatch(f"returned {len(outs)} outputs, the contract says {len(metas)}")
    for out, value, (shape, dtype) in zip(contract.outputs, outs, metas, strict=True):
        if not isinstance(value, torch.Tensor):
            raise Mismatch(f"output '{out.name}' is a {type(value).__name__}, expected a tensor")
        if tuple(value.shape) != tuple(shape) or value.dtype != dtype or value.device != device:
            raise Mismatch(
                f"output '{out.name}' is {tuple(value.shape)} {value.dtype} on {value.device}; "
                f"the contract says {tuple(shape)} {dtype} on {device}"
            )
