"""Parametrizes the kit's pytest module over backends and ops.

Options come from :mod:`megablocks_core.testing.pytest_plugin` when it is loaded with ``-p``;
without it the defaults apply (every installed backend but the reference, the kit's oracle, on
the CPU, full scenario set).
"""

from __future__ import annotations

import pytest

from megablocks_core import registry
from megablocks_core.testing import DISPATCHED, REFERENCE


def _backends(config: pytest.Config) -> list[str]:
    named = config.getoption("megablocks_backend", default=None)
    return list(named or [b for b in registry().backend_names if b != REFERENCE])


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "megablocks_backend" in metafunc.fixturenames:
        metafunc.parametrize("megablocks_backend", _backends(metafunc.config))
    if "op" in metafunc.fixturenames:
        metafunc.parametrize("op", DISPATCHED)


@pytest.fixture(scope="session")
def megablocks_device(pytestconfig: pytest.Config) -> str:
    return str(pytestconfig.getoption("megablocks_device", default="cpu"))


@pytest.fixture(scope="session")
def megablocks_quick(pytestconfig: pytest.Config) -> bool:
    return bool(pytestconfig.getoption("megablocks_quick", default=False))
