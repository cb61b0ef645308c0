"""Shared setup and fixtures.

Setup, done here once before any test module imports triton or a plugin:

- ``TRITON_INTERPRET`` defaults to 1 on a machine without a GPU, so the Triton backend serves CPU
  tensors through Triton's interpreter (triton reads the variable when a kernel is defined, so it
  must be set first). On a GPU machine nothing is defaulted and the compiled kernels are tested;
  ``TRITON_INTERPRET=1`` runs the interpreter there too.
- plugins that are not installed are imported from the source tree (``plugins/*/src``), for the
  tests that import a plugin's modules directly;
- the test-only workaround for a Triton 3.6 interpreter bug (``triton_interpreter.apply_shims``).
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

import megablocks_core  # noqa: E402

triton_interpreter.apply_shims()

#: Tests measured at several seconds or more on 2 CPU cores ("file" or "file::function"),
#: marked ``slow`` here rather than in their files. Everything still runs by default;
#: ``pytest -m "not slow"`` is the quick loop.
SLOW_TESTS = frozenset({
    "test_bench.py::test_bench_tiny_on_cpu",
    "test_backends_vs_reference.py::test_permutation_forward_and_backward",
    "test_conformance.py::test_example_plugin_installed_as_a_wheel_is_listed_ranked_and_conforms",
    "test_conformance.py::test_pytest_door_runs_from_any_directory",
    "test_cost_choice.py::test_kit_counts_declined_shapes_as_declined_not_failed",
    "test_expert_parallel.py::test_matches_single_process",
    "test_wheels.py",
})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        name = getattr(item, "originalname", item.name)
        if item.path.name in SLOW_TESTS or f"{item.path.name}::{name}" in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)


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
