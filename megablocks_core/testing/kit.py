"""The conformance checks: one backend's kernels, op by op, against the contracts and the reference.

For every op a backend claims, each scenario's sample (see :mod:`.scenarios`)
is run with that backend forced for the op (every other op, e.g. those its
backward calls, on the reference) and compared with the reference
backend: output shapes and dtypes against the contract, values against the
reference (tolerances in :data:`TOLERANCES`; rows the reference gives as exact
zeros, exactly), inputs unmodified, a repeated call equal, gradients of every
differentiable input equal. An op that writes a mutable argument in place (e.g.
``gmm_weight_grad_accumulate``'s ``out``) is called on a copy of it each time, and that
copy, as the kernel left it, is compared like an output; every other input must
still be unmodified. Then, on the first sample the backend serves: bad
inputs raise the contract's error types, ``torch.library.opcheck`` passes,
a ``torch.compile(fullgraph=True)`` call matches eager, and a double backward
(``create_graph=True``) records the same second-order gradients as the reference. A backend with several
kernels for one op (``Kernel.variant``, e.g. grouped-GEMM providers) has each
of them forced in turn. The first mismatch fails the op and is reported.

The reference backend is the oracle and is never compared with itself: the
test suite of megablocks-core checks it against an independent numpy oracle.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch

from ..contracts import ALL, BY_NAME
from ..devices import describe
from ..dispatch import describe_call, explain, explain_call, registry
from ..entries import ENTRIES
from ..policy import Policy, use_backend
from ..schema import RULE_HELPERS, BoolArg, ChoiceArg, IntArg, OpContract, TensorArg
from ..validation import output_meta
from .scenarios import Routing, Scenario, applies, routing, sample, scenarios

REFERENCE = "reference"
#: Why the oracle is skipped: comparing the reference with itself would prove nothing.
ORACLE_SKIPPED = (
    "the kit's oracle, not compared with itself (megablocks-core's test suite checks it "
    "against an independent numpy oracle, tests/test_ops_vs_numpy.py)"
)
Status = Literal["pass", "fail", "not provided", "unavailable"]

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

#: The opcheck tests run: the ones that exercise a backend's kernel (aliasing, mutation, fake vs
#: real output metadata, autograd registration). The aot_dispatch tests check the core's own
#: registration and are part of the core's test suite.
OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor")

DISPATCHED: tuple[str, ...] = tuple(c.name for c in ALL if c.dispatched)


@dataclass(frozen=True)
class Result:
    """The verdict for one op on one backend."""

    op: str
    """Op name, or ``"*"`` for a backend that could not be loaded at all."""
    backend: str
    status: Status
    message: str = ""
    """The first mismatch (fail); why nothing could run here (unavailable); for a pass, the
    kernels of the op (variants) that could not run here, if any."""
    scenarios: int = 0
    """Scenarios checked (per kernel: an op with two variants that both ran counts each scenario twice)."""
    declined: int = 0
    """Scenarios the backend does not serve (dtype restriction, capability, shape check): not failures."""
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class Mismatch(AssertionError):
    """A check failed; the message says where and how."""


def passed(results: Sequence[Result], required: Sequence[str] = ()) -> bool:
    """True if nothing failed and each backend in ``required`` passed at least one op
    (a backend that could check nothing on this device has not proven anything)."""
    if any(r.status == "fail" for r in results):
        return False
    return all(any(r.backend == b and r.status == "pass" for r in results) for b in required)


# ---------------------------------------------------------------------------
# Comparison


def _describe_index(index: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(i) for i in index) + "]"


def compare(got: Any, want: torch.Tensor, what: str, source: str = "the reference") -> None:
    """Raise :class:`Mismatch` unless ``got`` matches ``want`` (from ``source``) in shape, dtype,
    device and values."""
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
            compare(g, w, f"{what} output '{out.name}'", source)
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


# ---------------------------------------------------------------------------
# Running an op on a backend


@contextlib.contextmanager
def _on(backend: str, op: str) -> Iterator[None]:
    """``op`` forced onto ``backend`` and every other op (those its backward or a composite kernel
    calls) onto the reference: a failure is the op under test's own. (A backend's gather that is
    wrong fails gather's check, not scatter's, whose backward would otherwise run it.) ``backend``
    may name one kernel, ``backend/variant``."""
    with use_backend(REFERENCE, **{op: backend}):
        yield


def _cannot_serve(
    backend: str, contract: OpContract, device: torch.device, args: tuple[Any, ...]
) -> str | None:
    dtypes = {
        a.name: v.dtype
        for a, v in zip(contract.args, args, strict=True)
        if isinstance(v, torch.Tensor)
    }
    trace = explain(
        contract.name, describe(device), dtypes, Policy(force=backend, source="the kit")
    )
    if trace.winner is None:
        return trace.error
    # A kernel may decline some shapes (Kernel.supports, e.g. alignment): those samples are the
    # next backend's, not a failure.
    kernel, why = explain_call(trace, describe_call(contract, args))
    return None if kernel is not None else why


def _with_grad_leaves(
    contract: OpContract, args: tuple[Any, ...]
) -> tuple[tuple[Any, ...], list[str]]:
    """``args`` with fresh leaves requiring grad for every floating-point differentiable input."""
    names = [
        a.name
        for a, v in zip(contract.args, args, strict=True)
        if a.name in contract.differentiable
        and isinstance(v, torch.Tensor)
        and v.is_floating_point()
    ]
    new = tuple(
        v.detach().requires_grad_() if a.name in names else v
        for a, v in zip(contract.args, args, strict=True)
    )
    return new, names


def _grads(
    fn: Callable[..., Any], contract: OpContract, args: tuple[Any, ...]
) -> tuple[Any, dict[str, torch.Tensor]]:
    """Run ``fn`` and return (output, gradient of each differentiable input) for a fixed cotangent."""
    leaves, names = _with_grad_leaves(contract, args)
    with torch.enable_grad():
        out = fn(*leaves)
        gen = torch.Generator().manual_seed(7)
        cotangent = torch.randn(out.shape, generator=gen).to(device=out.device, dtype=out.dtype)
        inputs = [leaves[contract.arg_names.index(n)] for n in names]
        grads = torch.autograd.grad(
            out, inputs, cotangent, allow_unused=True, materialize_grads=True
        )
    return out.detach(), dict(zip(names, grads, strict=True))


def _second_order(
    fn: Callable[..., Any], contract: OpContract, args: tuple[Any, ...]
) -> dict[str, torch.Tensor]:
    """The gradient of <∇fn · cotangent, directions> with respect to each differentiable input and
    to the cotangent: what a double backward (``create_graph=True``) through ``fn`` records."""
    leaves, names = _with_grad_leaves(contract, args)
    gen = torch.Generator().manual_seed(11)
    with torch.enable_grad():
        out = fn(*leaves)
        cotangent = torch.randn(out.shape, generator=gen).to(device=out.device, dtype=out.dtype)
        cotangent.requires_grad_()
        inputs = [leaves[contract.arg_names.index(n)] for n in names]
        grads = torch.autograd.grad(
            out, inputs, cotangent, create_graph=True, allow_unused=True, materialize_grads=True
        )
        inner = sum(
            (g * torch.randn(g.shape, generator=gen).to(g.device, g.dtype)).sum()
            for g in grads
            if g.requires_grad
        )
        wrt = [*inputs, cotangent]
        if not isinstance(inner, torch.Tensor):  # no gradient depends on anything: all zero
            second = [torch.zeros_like(t) for t in wrt]
        else:
            second = list(
                torch.autograd.grad(inner, wrt, allow_unused=True, materialize_grads=True)
            )
    return dict(zip([*names, "the cotangent"], second, strict=True))


def _check_double_backward(backend: str, contract: OpContract, args: tuple[Any, ...]) -> None:
    if not _with_grad_leaves(contract, args)[1]:
        return
    run = _caller(contract.name)
    with _on(backend, contract.name):
        got = _second_order(run, contract, args)
    with use_backend(REFERENCE):
        want = _second_order(run, contract, args)
    for name, g in got.items():
        compare(g, want[name], f"second-order gradient through '{name}'")


def _caller(op: str) -> Callable[..., Any]:
    entry = ENTRIES[op]

    def run(*args: Any) -> Any:
        return entry(*args)

    return run


def _same(old: torch.Tensor, new: torch.Tensor) -> bool:
    """Equal values, NaN included (router scores hold NaN on purpose)."""
    if old.is_floating_point():
        return old.shape == new.shape and bool(torch.isclose(old, new, 0, 0, equal_nan=True).all())
    return torch.equal(old, new)


def _check_sample(backend: str, contract: OpContract, args: tuple[Any, ...]) -> None:
    op = contract.name
    run = _caller(op)
    before = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    with _on(backend, op):
        got = call_on_copies(run, contract, args)
    for spec, old, new in zip(contract.args, before, args, strict=True):
        # A mutable argument is written on a copy: the sample's own must not change either.
        if isinstance(old, torch.Tensor) and not _same(old, new):
            raise Mismatch(f"modified its input '{spec.name}'")
    check_meta(contract, args, got[0])
    with use_backend(REFERENCE):
        want = call_on_copies(run, contract, args)
    compare_calls(contract, got, want, "forward")
    if not _with_grad_leaves(contract, args)[1]:
        with _on(backend, op):
            again = call_on_copies(run, contract, args)
        compare_calls(contract, again, got, "repeated call", "the first call")
        return
    # The forward of the gradient run is the repeated call (one kernel launch fewer per sample:
    # under Triton's interpreter that is a third of the kit's time).
    with _on(backend, op):
        again, got_grads = _grads(run, contract, args)
    compare_calls(contract, (again, ()), got, "repeated call", "the first call")
    with use_backend(REFERENCE):
        _, want_grads = _grads(run, contract, args)
    for name, g in got_grads.items():
        compare(g, want_grads[name], f"gradient of '{name}'")


def _non_contiguous(t: torch.Tensor) -> torch.Tensor | None:
    """``t``'s values in a non-contiguous view (every other slice of its first dimension longer
    than 1); None when every dimension has size 1 (such a tensor is always contiguous)."""
    dim = next((d for d, n in enumerate(t.shape) if n > 1), None)
    if dim is None:
        return None
    wide = t.new_zeros(*t.shape[:dim], 2 * t.shape[dim], *t.shape[dim + 1 :])
    view = wide[(slice(None),) * dim + (slice(None, None, 2),)]
    return view.copy_(t)


def bad_inputs(
    contract: OpContract, args: tuple[Any, ...]
) -> Iterator[tuple[str, str, tuple[Any, ...], type[Exception]]]:
    """Mutations of a valid sample that break one argument's spec in the contract:
    (argument, what was done, the mutated arguments, the error type the contract promises)."""
    primary = contract.primary.name
    for i, (spec, value) in enumerate(zip(contract.args, args, strict=True)):

        def swap(new: Any, i: int = i) -> tuple[Any, ...]:
            return (*args[:i], new, *args[i + 1 :])

        if isinstance(spec, TensorArg) and isinstance(value, torch.Tensor):
            wrong = next(
                (d for d in (torch.float32, torch.int32, torch.bool) if d not in spec.dtypes), None
            )
            if spec.dtypes and wrong is not None:
                yield spec.name, f"dtype {wrong}", swap(value.to(wrong)), TypeError
            if spec.ndim:
                extra = max(spec.ndim) + 1 - value.dim()
                yield (
                    spec.name,
                    f"{value.dim() + extra}-D",
                    swap(value[(None,) * extra]),
                    ValueError,
                )
            if spec.name != primary and not spec.any_device and value.device.type != "cpu":
                yield spec.name, "on the CPU", swap(value.cpu()), ValueError
            strided = _non_contiguous(value) if spec.mutable else None
            if strided is not None:  # written in place: the contract wants it contiguous
                yield spec.name, "non-contiguous", swap(strided), ValueError
        elif isinstance(spec, IntArg) and value is not None:
            yield spec.name, "a float", swap(value + 0.5), TypeError
            if spec.min is not None:
                yield spec.name, f"{spec.min - 1}", swap(spec.min - 1), ValueError
        elif isinstance(spec, BoolArg):
            yield spec.name, "an int", swap(int(value)), TypeError
        elif isinstance(spec, ChoiceArg):
            yield spec.name, "an unknown name", swap("no such name"), ValueError


def _check_bad_inputs(backend: str, contract: OpContract, args: tuple[Any, ...]) -> None:
    run = _caller(contract.name)
    for name, what, bad, error in bad_inputs(contract, args):
        try:
            with _on(backend, contract.name):
                run(*bad)
        except error as exc:
            if f"ops.{contract.name}" not in str(exc) or f"'{name}'" not in str(exc):
                raise Mismatch(
                    f"'{name}' as {what} raised {type(exc).__name__} without naming the op "
                    f"and the argument: {exc}"
                ) from None
            continue
        except Exception as exc:
            raise Mismatch(
                f"'{name}' as {what} raised {type(exc).__name__}, the contract says "
                f"{error.__name__}: {exc}"
            ) from None
        raise Mismatch(f"'{name}' as {what} was accepted; the contract says {error.__name__}")


def _check_opcheck(backend: str, contract: OpContract, args: tuple[Any, ...]) -> None:
    leaves, _ = _with_grad_leaves(contract, args)
    # opcheck calls the op several times: mutable arguments get a copy (the sample stays as is).
    leaves = tuple(
        v.clone() if a in contract.mutated else v
        for a, v in zip(contract.args, leaves, strict=True)
    )
    with _on(backend, contract.name):
        try:
            torch.library.opcheck(
                getattr(torch.ops.megablocks, contract.name), leaves, test_utils=OPCHECK_TESTS
            )
        except Exception as exc:
            raise Mismatch(f"torch.library.opcheck: {str(exc).splitlines()[0]}") from None


def _check_compile(backend: str, contract: OpContract, args: tuple[Any, ...]) -> None:
    torch._dynamo.reset()  # one fresh graph per op: no recompile limits, no stale guards
    run = _caller(contract.name)
    compiled = torch.compile(_caller(contract.name), fullgraph=True, backend="aot_eager")
    differentiable = bool(_with_grad_leaves(contract, args)[1])
    with _on(backend, contract.name):
        if not differentiable:
            compare_calls(
                contract,
                call_on_copies(compiled, contract, args),
                call_on_copies(run, contract, args),
                "torch.compile",
                "eager",
            )
            return
        got, got_grads = _grads(compiled, contract, args)
        want, want_grads = _grads(run, contract, args)
    compare(got, want, "torch.compile output", "eager")
    for name, g in got_grads.items():
        compare(g, want_grads[name], f"torch.compile gradient of '{name}'", "eager")


# ---------------------------------------------------------------------------
# Entry points


#: The moe_permute ops that write or read a row map. Each is also run inside the whole
#: pipeline (moe_permute_map → moe_permute → moe_unpermute) with the other two on the reference,
#: so that a row map written by one backend and read by another is proven to agree.
ROW_MAP_OPS = ("moe_permute_map", "moe_permute", "moe_unpermute")


def _check_row_map_pairing(label: str, contract: OpContract, args: tuple[Any, ...]) -> None:
    op = contract.name
    routing_map: tuple[Any, ...] | None = None
    if op == "moe_permute_map":
        routing_map = args
        tokens, rows = args[0].shape[0], args[2]
        given_map = None
        like = torch.empty(0, device=args[0].device)
    else:
        given_map = args[1]
        tokens = given_map.shape[0]
        rows = args[3] if op == "moe_permute" else args[0].shape[0]
        like = args[0]
    gen = torch.Generator().manual_seed(tokens + rows)
    hidden = like.shape[1] if like.dim() == 2 else 3
    dtype = like.dtype if like.is_floating_point() else torch.float32
    x = torch.randn(tokens, hidden, generator=gen).to(device=like.device, dtype=dtype)
    slots = (given_map if given_map is not None else args[0]).shape[1]
    probs = torch.rand(tokens, slots, generator=gen).to(device=like.device, dtype=dtype)

    def pipeline() -> torch.Tensor:
        row_map = given_map
        if routing_map is not None:
            row_map, _ = ENTRIES["moe_permute_map"](*routing_map)
        permuted = ENTRIES["moe_permute"](x, row_map, None, rows)
        return ENTRIES["moe_unpermute"](permuted * 2, row_map, probs)

    with use_backend(REFERENCE):
        want = pipeline()
    with _on(label, op):
        got = pipeline()
    compare(
        got, want, f"moe_unpermute(moe_permute(x)) with {op} on {label}, the rest on the reference"
    )


def check_op(
    backend: str,
    op: str,
    device: torch.device | str = "cpu",
    quick: bool = False,
    cases: Sequence[Scenario] | None = None,
) -> Result:
    """Check one op of one installed backend on ``device`` (see the module docstring): each of
    its kernels for the op in turn, on ``cases`` (default: :func:`.scenarios` for the device)."""
    contract = BY_NAME[op]
    if not contract.dispatched:
        raise ValueError(f"{op!r} is not a dispatched op; dispatched ops: {', '.join(DISPATCHED)}")
    record = registry().plugins.get(backend)
    if record is None:
        raise ValueError(
            f"backend {backend!r} is not installed "
            f"(installed: {', '.join(registry().backend_names) or 'none'})"
        )
    if backend == REFERENCE:
        return Result(op, backend, "unavailable", ORACLE_SKIPPED)
    if op not in record.ops:
        return Result(op, backend, "not provided")
    if record.status != "ok":
        return Result(op, backend, "unavailable", record.reason or record.status)
    device = torch.device(device)
    todo = tuple(cases) if cases is not None else scenarios(quick, device)
    # Forcing "backend/variant" picks that one kernel; a backend without variants is forced by name.
    labels = sorted({k.label for k in record.kernels if k.op == op})
    start = time.perf_counter()
    ran = declined = 0
    unchecked: list[str] = []
    for label in labels:
        outcome = _check_kernel(label, contract, device, todo)
        ran, declined = ran + outcome.scenarios, declined + outcome.declined
        named = f" via {label}" if len(labels) > 1 else ""
        if outcome.status == "fail":
            message = f"{op}{named}{outcome.message.removeprefix(op)}"
            return Result(op, backend, "fail", message, ran, declined, time.perf_counter() - start)
        if outcome.status == "unavailable":
            unchecked.append(f"{label}: {outcome.message}" if named else outcome.message)
    elapsed = time.perf_counter() - start
    if not ran:
        return Result(op, backend, "unavailable", "; ".join(unchecked), 0, declined, elapsed)
    note = f"not checked here: {'; '.join(unchecked)}" if unchecked else ""
    return Result(op, backend, "pass", note, ran, declined, elapsed)


def _check_kernel(
    label: str, contract: OpContract, device: torch.device, cases: Sequence[Scenario]
) -> Result:
    """One kernel (``backend`` or ``backend/variant``) forced for its op, on every case it serves."""
    op = contract.name
    start = time.perf_counter()
    ran, declined, reason = 0, 0, ""
    first: tuple[Any, ...] | None = None
    stage, case = "", ""
    try:
        for scenario in cases:
            if not applies(scenario, op):  # rows routed to no expert: not this op's valid input
                continue
            r: Routing = routing(scenario, device)
            args = sample(op, r)
            why_not = _cannot_serve(label, contract, device, args)
            if why_not:
                declined += 1
                reason = reason or why_not
                continue
            stage, case = "", f" ({scenario.name})"
            _check_sample(label, contract, args)
            if op in ROW_MAP_OPS:
                stage = "row map pairing"
                _check_row_map_pairing(label, contract, args)
                stage = ""
            ran += 1
            first = first or args
        if first is not None:
            case = ""
            for name, step in (
                ("bad inputs", _check_bad_inputs),
                ("opcheck", _check_opcheck),
                ("torch.compile", _check_compile),
                ("double backward", _check_double_backward),
            ):
                stage = name
                step(label, contract, first)
    except Mismatch as exc:
        where = f" [{stage}]" if stage else ""
        return Result(
            op,
            label,
            "fail",
            f"{op}{where}{case}: {exc}",
            ran,
            declined,
            time.perf_counter() - start,
        )
    except Exception as exc:  # a kernel that raises fails its op, nothing more
        where = f" [{stage}]" if stage else ""
        return Result(
            op,
            label,
            "fail",
            f"{op}{where}{case}: raised {type(exc).__name__}: {exc}",
            ran,
            declined,
            time.perf_counter() - start,
        )
    elapsed = time.perf_counter() - start
    if not ran:
        return Result(op, label, "unavailable", reason, 0, declined, elapsed)
    return Result(op, label, "pass", "", ran, declined, elapsed)


def check(
    backends: Sequence[str] | None = None,
    device: torch.device | str = "cpu",
    quick: bool = False,
    ops: Sequence[str] | None = None,
) -> list[Result]:
    """Check every op of each backend against the reference. Default: every installed backend but
    the reference itself, the oracle (one ``"*"`` result, ``unavailable``, says so; naming it
    gives the same)."""
    reg = registry()
    oracle = reg.plugins.get(REFERENCE)
    if oracle is None or oracle.status != "ok":
        raise RuntimeError(
            "the reference backend is the oracle of the conformance kit: install "
            "megablocks-reference (and do not disable it)"
        )
    unknown = [b for b in backends or () if b not in reg.plugins]
    if unknown:
        raise ValueError(
            f"backend(s) {', '.join(unknown)} not installed "
            f"(installed: {', '.join(reg.backend_names)})"
        )
    results = []
    for name in backends or reg.backend_names:
        record = reg.plugins[name]
        if name == REFERENCE:
            results.append(Result("*", name, "unavailable", ORACLE_SKIPPED))
        elif record.status in ("broken", "incompatible"):
            results.append(Result("*", name, "fail", f"{name} is {record.status}: {record.reason}"))
        elif record.status == "disabled":
            results.append(Result("*", name, "unavailable", record.reason or "disabled"))
        else:
            results += [
                check_op(name, op, device, quick) for op in (DISPATCHED if ops is None else ops)
            ]
    return results
