"""Shared fixtures."""

from __future__ import annotations

import pytest
from fake_plugins import ENV_VARS, ONLY_REFERENCE, FakePlugins

import megablocks_core


@pytest.fixture
def reference_backend():
    """Run the test on the reference backend, whatever else is installed (the oracle's own tests)."""
    with megablocks_core.use_backend("reference"):
        yield


@pytest.fixture
def clean_env(monkeypatch):
    """No MEGABLOCKS_* variable from the caller's environment leaks into the test."""
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def only_reference(clean_env):
    """A registry with the reference backend alone, restored to the normal one afterwards."""
    megablocks_core.set_backend()
    megablocks_core.reload(ONLY_REFERENCE)
    yield
    megablocks_core.set_backend()
    megablocks_core.reload({})


@pytest.fixture
def plugins(tmp_path, monkeypatch, clean_env):
    """Fake plugin distributions on sys.path (see fake_plugins.FakePlugins)."""
    fake = FakePlugins(tmp_path, monkeypatch)
    yield fake
    fake.cleanup()
