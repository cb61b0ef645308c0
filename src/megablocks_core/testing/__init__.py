"""The conformance kit: prove that a backend matches the op contracts and the reference backend.

Two doors to the same checks:

- ``megablocks backends check [NAME ...] [--device DEV] [--quick] [--json]``;
- pytest, from a plugin's own test suite::

      pytest -p megablocks_core.testing.pytest_plugin --pyargs megablocks_core.testing \\
          --megablocks-backend NAME --megablocks-device cuda:0

Or from Python: ``check(["foo"], device="cuda:0")`` returns one :class:`Result` per op.
Nothing here is registered with pytest automatically: installing megablocks-core adds no
tests and no options to other projects' test runs.
"""

from __future__ import annotations

from .kit import (
    DISPATCHED,
    OPCHECK_TESTS,
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
from .scenarios import FULL, QUICK, SAMPLES, Routing, Scenario, routing, sample, scenarios

__all__ = [
    "DISPATCHED", "FULL", "OPCHECK_TESTS", "QUICK", "REFERENCE", "SAMPLES", "TOLERANCES", "Mismatch",
    "Result", "Routing", "Scenario", "bad_inputs", "check", "check_op", "compare", "passed", "routing",
    "sample", "scenarios",
]
