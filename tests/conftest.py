"""Shared setup and fixtures.

Setup, done here once before any test module imports triton or a plugin:

- ``TRITON_INTERPRET`` defaults to 1 on a machine without a GPU, so the Triton backend serves CPU
  tensors through Triton's interpreter (triton reads the variable when a kernel is defined, so it
  must be set first). On a GPU machine nothing is defaulted and the compiled kernels are tested;
  ``TRITON_INTERPRET=1`` runs the interpreter there too.
- plugins that are not installed are imported from the source tree (``plugins/*/src``), for the
  tests that import a plugin's modules directly;
- the test-only workaround for a Triton 3.6 interpreter bug (``triton_interpreter.apply_shims``).

Options: ``--shard K/N`` runs one of N parts of the suite (:mod:`sharding`; README, "Running the
tests").
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

_PLUGINS = Path(__file__).resolve().parents[1] / "plugins"
for _src in sorted(_PLUGINS.glob("*/src")):
    for _package in sorted(p for p in _src.iterdir() if (p / "__init__.py").is_file()):
        if importlib.util.find_spec(_package.name) is None:
            sys.path.append(str(_src))

import pytest  # noqa: E402
import triton_interpreter  # noqa: E402
from fake_plugins import ENV_VARS, ONLY_REFERENCE, FakePlugins  # noqa: E402
from sharding import (  # noqa: E402, F401  (hooks pytest finds here)
    pytest_addoption,
    pytest_collection_modifyitems,
    pytest_configure,
)

import megablocks_core  # noqa: E402

triton_interpreter.apply_shims()


@pytest.fixture
def fp8_calls(monkeypatch) -> list[str]:
    """The names of the ops megablocks_core.fp8 calls, in order, from here on."""
    from megablocks_core import fp8

    names: list[str] = []
    real = fp8.call

    def recording(op, *args):
        names.append(op)
        return real(op, *args)

    monkeypatch.setattr(fp8, "call", recording)
    return names


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
