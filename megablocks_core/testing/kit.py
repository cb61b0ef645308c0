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

This module runs the checks and reports them (:func:`check`, :func:`check_op`, :class:`Result`);
the comparisons are in :mod:`.comparison`, the stages in :mod:`.stages`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch

from ..contracts import ALL, BY_NAME
from ..dispatch import registry
from ..schema import OpContract

# The comparisons and the stages live in their own modules; their public names stay importable
# from here.
from .comparison import TOLERANCES as TOLERANCES
from .comparison import Mismatch
from .comparison import call_on_copies as call_on_copies
from .comparison import check_meta as check_meta
from .comparison import compare as compare
from .comparison import compare_calls as compare_calls
from .scenarios import Routing, Scenario, applies, routing, sample, scenarios
from .stages import OPCHECK_TESTS as OPCHECK_TESTS
from .stages import (
    REFERENCE,
    ROW_MAP_OPS,
    _cannot_serve,
    _check_bad_inputs,
    _check_compile,
    _check_double_backward,
    _check_opcheck,
    _check_row_map_pairing,
    _check_sample,
)
from .stages import bad_inputs as bad_inputs

#: Why the oracle is skipped: comparing the reference with itself would prove nothing.
ORACLE_SKIPPED = (
    "the kit's oracle, not compared with itself (megablocks-core's test suite checks it "
    "against an independent numpy oracle, tests/test_ops_vs_numpy.py)"
)
Status = Literal["pass", "fail", "not provided", "unavailable"]

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


def passed(results: Sequence[Result], required: Sequence[str] = ()) -> bool:
    """True if nothing failed and each backend in ``required`` passed at least one op
    (a backend that could check nothing on this device has not proven anything)."""
    if any(r.status == "fail" for r in results):
        return False
    return all(any(r.backend == b and r.status == "pass" for r in results) for b in required)


# ---------------------------------------------------------------------------
# Entry points


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
    problems = record.problems_for(op)
    if problems:
        why = "; ".join(f"its {p.what} did not load: {p.reason}" for p in problems)
        return Result(op, backend, "fail", why)
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
    progress: Callable[[Result], None] | None = None,
) -> list[Result]:
    """Check every op of each backend against the reference. Default: every installed backend but
    the reference itself, the oracle (one ``"*"`` result, ``unavailable``, says so; naming it
    gives the same). ``progress`` is called with each op's result as it comes."""
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
            for op in DISPATCHED if ops is None else ops:
                results.append(check_op(name, op, device, quick))
                if progress is not None:
                    progress(results[-1])
    return results
