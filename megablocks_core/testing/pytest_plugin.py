"""The kit's pytest options. Opt-in: load it with ``-p megablocks_core.testing.pytest_plugin``
(or ``pytest_plugins = ["megablocks_core.testing.pytest_plugin"]`` in a root conftest.py).

It is deliberately not a ``pytest11`` entry point, so installing megablocks-core changes no
other project's pytest runs. The options must come from a plugin loaded before the command
line is parsed: a conftest.py inside an installed package (``--pyargs``) is read too late.
"""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("megablocks", "megablocks conformance kit")
    group.addoption(
        "--megablocks-backend",
        action="append",
        default=[],
        metavar="NAME",
        help="backend to check (repeatable; default: every installed backend but the "
        "reference, which is the oracle)",
    )
    group.addoption(
        "--megablocks-device",
        default="cpu",
        metavar="DEVICE",
        help="torch device to check on, e.g. cpu or cuda:0 (default cpu)",
    )
    group.addoption(
        "--megablocks-quick", action="store_true", help="a few scenarios instead of the full set"
    )
