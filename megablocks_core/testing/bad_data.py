"""Bad data: inputs that pass the always-on checks but break an op's data rules.

Outside checked mode (``MEGABLOCKS_CHECK`` unset) the core never reads tensor data before a
kernel runs, so indices out of range, duplicate indices, bins that are not a cumulative sum or
group sizes that do not add up reach the kernels. Every backend must then stay memory-safe and
return the op's documented safe result (the ``edge_cases`` of each contract): this module holds
named cases per op and checks, for each:

* no crash, and no exception other than the core's ``ContractError``/``ContractTypeError``
  naming the op (a case marked ``must_raise`` has no safe result and must raise one);
* outputs of the contract's shape, dtype and device;
* values only from the documented safe result: exactly the defined values where the contract
  defines them, else every element 0 or taken from the candidates the contract allows;
* a valid call of the same op afterwards still matches the reference (catches heap corruption
  that only surfaces later).

``run(backend, device)`` runs every case a backend serves and returns the failures. Crashes
kill the process: run the cases of a backend that might crash in a subprocess each
(``python -c`` with :func:`run_case`), as ``tests/test_bad_data.py`` does.

The cases themselves are in :mod:`.bad_cases`, the checks of the safe results in
:mod:`.bad_results` (:func:`check_result`); this module runs them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..contracts import BY_NAME
from ..dispatch import registry
from ..entries import ENTRIES
from ..policy import use_backend
from ..ranking import NoKernelError
from ..validation import ContractError, ContractTypeError
from .bad_cases import (
    _BY_NAME,
    CASES,
    Args,
    BadCase,
    _valid_args,
    case_names,
)

# The cases' op tables the tests read from here.
from .bad_cases import BINNED_OPS as BINNED_OPS
from .bad_cases import PADDED_OPS as PADDED_OPS
from .bad_cases import PLAIN_OPS as PLAIN_OPS
from .bad_results import check_result
from .kit import REFERENCE, Mismatch, call_on_copies, compare

__all__ = [
    "CASES",
    "BadCase",
    "Declined",
    "Failure",
    "case_names",
    "check_call",
    "check_result",
    "run",
    "run_case",
]


class Declined(Exception):
    """The backend does not serve this call (device, dtype or shape): nothing to check."""


@dataclass(frozen=True)
class Failure:
    case: str
    backend: str
    message: str

    def __str__(self) -> str:
        return f"{self.backend}: {self.case}: {self.message}"


# ---------------------------------------------------------------------------
# Running the cases


def _force(backend: str, op: str) -> Any:
    return (
        use_backend(REFERENCE)
        if backend == REFERENCE
        else use_backend(backend, REFERENCE, **{op: backend})
    )


def check_call(backend: str, op: str, args: Args, must_raise: bool = False) -> str | None:
    """Call ``op`` on ``backend`` with (possibly bad) kernel-order ``args``; None when the
    outcome is allowed (the documented safe result, or the core's error naming the op), else
    what is wrong. Also for generated inputs (e.g. hypothesis)."""
    try:
        with _force(backend, op):
            out, written = call_on_copies(ENTRIES[op], BY_NAME[op], args)
    except NoKernelError as exc:
        raise Declined(str(exc)) from None
    except (ContractError, ContractTypeError) as exc:
        return (
            None if f"ops.{op}" in str(exc) else f"{type(exc).__name__} does not name the op: {exc}"
        )
    except Exception as exc:
        return (
            f"raised {type(exc).__name__} (only the core's ContractError/ContractTypeError may be "
            f"raised): {str(exc)[:300]}"
        )
    if must_raise:
        return "returned; no safe result exists, a ContractError is required"
    try:
        check_result(op, args, out, written)
    except Mismatch as exc:
        return str(exc)
    return None


def run_case(backend: str, name: str, device: torch.device | str = "cpu") -> Failure | None:
    """Run one case on ``backend``; None when it holds. A crash kills the calling process.
    Raises :class:`Declined` when the backend does not serve the call."""
    case = _BY_NAME[name]
    device = torch.device(device)
    contract = BY_NAME[case.op]
    call = ENTRIES[case.op]
    valid = _valid_args(case.op, device)
    with use_backend(REFERENCE):
        want, want_written = call_on_copies(call, contract, valid)
    problem = check_call(backend, case.op, case.build(device), case.must_raise)
    if problem is not None:
        return Failure(name, backend, problem)
    try:
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # a device fault surfaces here, named by this case
        with _force(backend, case.op):
            again, again_written = call_on_copies(call, contract, valid)
        outs = (again if isinstance(again, tuple) else (again,)) if contract.outputs else ()
        wants = (want if isinstance(want, tuple) else (want,)) if contract.outputs else ()
        for got, w in zip((*outs, *again_written), (*wants, *want_written), strict=True):
            compare(got, w, "the valid call after it")
    except Exception as exc:
        return Failure(
            name, backend, f"a valid call after it failed: {type(exc).__name__}: {str(exc)[:300]}"
        )
    return None


def _serves(backend: str, op: str) -> bool:
    record = registry().plugins.get(backend)
    return record is not None and record.status == "ok" and op in record.ops


def run(
    backend: str,
    device: torch.device | str = "cpu",
    ops: Sequence[str] | None = None,
    names: Sequence[str] | None = None,
) -> tuple[list[Failure], int]:
    """Run the bad-data cases of every op ``backend`` provides (or of ``ops`` / the cases
    ``names``) on ``device``. Returns (failures, cases run)."""
    if backend not in registry().plugins:
        raise ValueError(f"backend {backend!r} is not installed")
    failures, ran = [], 0
    for case in CASES:
        if (names is not None and case.name not in names) or (
            ops is not None and case.op not in ops
        ):
            continue
        if not _serves(backend, case.op):
            continue
        try:
            failure = run_case(backend, case.name, device)
        except Declined:
            continue
        ran += 1
        if failure is not None:
            failures.append(failure)
    return failures, ran
