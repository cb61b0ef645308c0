"""The conformance kit: prove that a backend matches the op contracts and the reference backend.

Two doors to the same checks:

- ``megablocks backends check [NAME ...] [--device DEV] [--quick] [--json]``;
- pytest, from a plugin's own test suite::

      pytest -p megablocks_core.testing.pytest_plugin --pyargs megablocks_core.testing \\
          --megablocks-backend NAME --megablocks-device cuda:0

Or from Python: ``check(["foo"], device="cuda:0")`` returns one :class:`Result` per op.
Without names, every installed backend is checked except the reference: it is the oracle the
others are compared with, and megablocks-core's test suite checks it against numpy instead.
Nothing here is registered with pytest automatically: installing megablocks-core adds no
tests and no options to other projects' test runs.
"""

from __future__ import annotations

from .kit import (
    DISPATCHED,
    OPCHECK_TESTS,
    ORACLE_SKIPPED,
    REFERENCE,
    TOLERANCES,
    Mismatch,
    Result,
    bad_inputs,
    check,
    check_op,
    compare,
    passed,
)
from .scenarios import (
    DEVICE_SIZED,
    FULL,
    QUICK,
    ROUTED_ONLY_OPS,
    SAMPLES,
    Routing,
    Scenario,
    applies,
    routing,
    sample,
    scenarios,
)

__all__ = [
    "DEVICE_SIZED",
    "DISPATCHED",
    "FULL",
    "OPCHECK_TESTS",
    "ORACLE_SKIPPED",
    "QUICK",
    "REFERENCE",
    "ROUTED_ONLY_OPS",
    "SAMPLES",
    "TOLERANCES",
    "Mismatch",
    "Result",
    "Routing",
    "Scenario",
    "applies",
    "bad_inputs",
    "check",
    "check_op",
    "compare",
    "passed",
    "routing",
    "sample",
    "scenarios",
]
