"""The conformance kit as pytest tests: one per (backend, op).

Run it with ``pytest -p megablocks_core.testing.pytest_plugin --pyargs megablocks_core.testing
--megablocks-backend NAME [--megablocks-device cuda:0] [--megablocks-quick]``.
"""

from __future__ import annotations

import pytest

from megablocks_core.testing import REFERENCE, check, check_op


def test_op_conforms(
    megablocks_backend: str, op: str, megablocks_device: str, megablocks_quick: bool
) -> None:
    result = check_op(megablocks_backend, op, megablocks_device, megablocks_quick)
    if megablocks_backend == REFERENCE:
        pytest.skip(f"{REFERENCE}: {result.message}")
    if result.status == "not provided":
        pytest.skip(f"{megablocks_backend} does not provide {op}")
    if result.status == "unavailable":
        pytest.skip(f"{megablocks_backend} cannot run {op} here: {result.message}")
    assert result.status == "pass", result.message


def test_backend_loads(megablocks_backend: str) -> None:
    # A plugin that failed to load (broken, incompatible) provides nothing above: fail here.
    failures = [r.message for r in check([megablocks_backend], ops=()) if r.status == "fail"]
    assert not failures, failures[0] if failures else ""
