"""Versions are written once, and every pin between this repository's distributions admits them.

Each distribution's version is the ``__version__`` of its package (pyproject.toml says
``dynamic = ["version"]`` and points setuptools at it), assigned as a plain string so that
setuptools reads it without importing the package (no torch or triton at build time). The
``megablocks-*`` requirements repeated across the pyproject files must each admit the current
version of what they name, so that a version bump cannot leave one behind.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
PYPROJECTS = sorted(
    [
        ROOT / "pyproject.toml",
        *ROOT.glob("plugins/*/pyproject.toml"),
        *ROOT.glob("examples/*/pyproject.toml"),
    ]
)


def _load(path: Path) -> dict[str, Any]:
    with path.open("rb") as f:
        return tomllib.load(f)


def _literal_version(module_file: Path) -> str:
    """The string assigned to ``__version__`` at module level (what setuptools reads statically)."""
    for node in ast.parse(module_file.read_text()).body:
        if (
            isinstance(node, ast.Assign)
            and [getattr(t, "id", None) for t in node.targets] == ["__version__"]
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            return node.value.value
    raise AssertionError(f"{module_file} assigns no plain string to __version__")


def _version(pyproject: Path) -> str:
    """The distribution's version, from the module attribute its pyproject.toml names."""
    config = _load(pyproject)
    project = config["project"]
    assert "version" not in project and "version" in project.get("dynamic", []), (
        f"{pyproject}: the version is written in the package (dynamic), not here"
    )
    attr = config["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    package, _, name = attr.rpartition(".")
    assert name == "__version__", attr
    module = package.replace(".", "/") + "/__init__.py"
    source = pyproject.parent / "src" / module  # plugins keep their package under src/
    return _literal_version(source if source.exists() else pyproject.parent / module)


def _requirements(config: dict[str, Any]) -> list[str]:
    project = config.get("project", {})
    found = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        found += extra
    return found + list(config.get("build-system", {}).get("requires", []))


def _package(pyproject: Path) -> str:
    return _load(pyproject)["tool"]["setuptools"]["dynamic"]["version"]["attr"].rpartition(".")[0]


def left_behind(config: dict[str, Any], versions: dict[str, str]) -> list[str]:
    """The requirements of one pyproject.toml on our distributions that exclude their version."""
    ours = [
        Requirement(r)
        for r in _requirements(config)
        if canonicalize_name(Requirement(r).name) in versions
    ]
    return [
        f"{r} does not admit {versions[canonicalize_name(r.name)]}"
        for r in ours
        if not r.specifier.contains(versions[canonicalize_name(r.name)], prereleases=True)
    ]


VERSIONS = {canonicalize_name(_load(p)["project"]["name"]): _version(p) for p in PYPROJECTS}


def test_every_distribution_has_one_version() -> None:
    assert set(VERSIONS) == {
        "megablocks-core",
        "megablocks-reference",
        "megablocks-triton",
        "megablocks-cuda",
        "megablocks-rocm",
        "megablocks-example-plugin",
    }
    for version in VERSIONS.values():
        Version(version)  # raises for an invalid one


def test_importable_packages_report_that_version() -> None:
    for pyproject in PYPROJECTS:
        package = _package(pyproject)
        if importlib.util.find_spec(package) is None:  # the example is not installed by default
            continue
        name = canonicalize_name(_load(pyproject)["project"]["name"])
        assert importlib.import_module(package).__version__ == VERSIONS[name], package


@pytest.mark.parametrize("pyproject", PYPROJECTS, ids=lambda p: str(p.parent.relative_to(ROOT)))
def test_pins_admit_the_current_versions(pyproject: Path) -> None:
    config = _load(pyproject)
    assert any(canonicalize_name(Requirement(r).name) in VERSIONS for r in _requirements(config))
    assert left_behind(config, VERSIONS) == []


def test_a_bump_that_leaves_a_pin_behind_is_caught() -> None:
    config = _load(ROOT / "plugins/megablocks-rocm/pyproject.toml")  # pins core and triton
    assert left_behind(config, {**VERSIONS, "megablocks-core": "0.2.0"}) == [
        "megablocks-core<0.2,>=0.1 does not admit 0.2.0"
    ]
    assert (
        len(
            left_behind(
                config, {**VERSIONS, "megablocks-core": "0.2.0", "megablocks-triton": "1.0.0"}
            )
        )
        == 2
    )
