"""Shared fixtures."""

from __future__ import annotations

import pytest

import megablocks_core


@pytest.fixture
def reference_backend():
    """Run the test on the reference backend, whatever else is installed (the oracle's own tests)."""
    with megablocks_core.use_backend("reference"):
        yield
