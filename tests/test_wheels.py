"""The install story: ``pip install megablocks-core[rocm]`` (and ``[cuda]``, ``[all]``) from wheels.

Wheels are built once per module for the root distribution and every ``plugins/*/`` that has a
pyproject.toml, then each extra is installed into a fresh venv with ``--no-index --find-links``:
every megablocks distribution must come from those wheels (the venv's view of this
environment's site-packages hides them; see tests/venvs.py), the third-party ones (torch, triton,
pluggy, packaging, numpy) are this environment's.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from fake_plugins import ENV_VARS
from venvs import fresh_env

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
IGNORE = shutil.ignore_patterns(
    "build", "dist", "*.egg-info", "__pycache__", ".ruff_cache", ".pytest_cache"
)


def _sources() -> dict[str, Path]:
    """distribution directory name -> source tree (the root is "megablocks-core")."""
    found = {"megablocks-core": ROOT}
    found.update({p.parent.name: p.parent for p in sorted(ROOT.glob("plugins/*/pyproject.toml"))})
    return found


def _build(name: str, source: Path, tmp: Path, wheels: Path) -> None:
    # Build from a copy: setuptools writes build/ and *.egg-info into the tree it builds.
    copy = tmp / "src" / name
    if source == ROOT:
        copy.mkdir(parents=True)
        for item in ("pyproject.toml", "README.md"):
            shutil.copy(ROOT / item, copy / item)
        shutil.copytree(ROOT / "megablocks_core", copy / "megablocks_core", ignore=IGNORE)
    else:
        shutil.copytree(source, copy, ignore=IGNORE)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-q",
            "-w",
            str(wheels),
            str(copy),
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, f"building {name} failed:\n{proc.stdout}\n{proc.stderr}"


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("wheels")
    out = tmp / "dist"
    out.mkdir()
    with ThreadPoolExecutor(max_workers=4) as pool:  # each build is its own process
        for f in [pool.submit(_build, n, s, tmp, out) for n, s in _sources().items()]:
            f.result()
    return out


def _install(tmp_path: Path, wheels: Path, requirement: str) -> Path:
    python = fresh_env(tmp_path, hide=("megablocks",))
    proc = subprocess.run(
        [
            str(python),
            "-m",
            "pip",
            "install",
            "--no-index",
            "--find-links",
            str(wheels),
            "--disable-pip-version-check",
            "-q",
            requirement,
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, f"pip install {requirement} failed:\n{proc.stdout}\n{proc.stderr}"
    return python


def _listing(python: Path, cwd: Path) -> dict[str, dict]:
    env = {k: v for k, v in os.environ.items() if k not in ENV_VARS and k != "TRITON_INTERPRET"}
    script = python.parent / ("megablocks.exe" if os.name == "nt" else "megablocks")
    proc = subprocess.run(
        [str(script), "backends", "list", "--json"],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return {p["name"]: p for p in json.loads(proc.stdout)["plugins"]}


def _locations(python: Path) -> dict[str, str]:
    code = (
        "import json, importlib.metadata as m; print(json.dumps({d.metadata['Name']: "
        "str(d.locate_file('')) for d in m.distributions() "
        "if d.metadata['Name'].startswith('megablocks')}))"
    )
    out = subprocess.run(
        [str(python), "-c", code], capture_output=True, text=True, check=True
    ).stdout
    return json.loads(out)


def _need(*dists: str) -> None:
    missing = [d for d in dists if d not in _sources()]
    if missing:
        pytest.skip(f"{', '.join(missing)} not in this checkout (no plugins/<name>/pyproject.toml)")


EXTRAS = {
    "rocm": ("megablocks-reference", "megablocks-triton", "megablocks-rocm"),
    "cuda": ("megablocks-reference", "megablocks-triton", "megablocks-cuda"),
    "all": ("megablocks-reference", "megablocks-triton", "megablocks-cuda", "megablocks-rocm"),
}


@pytest.mark.parametrize("extra", list(EXTRAS))
def test_extra_installs_its_backends_from_wheels(extra, wheels, tmp_path):
    _need(*EXTRAS[extra])
    python = _install(tmp_path, wheels, f"megablocks-core[{extra}]")

    # Every megablocks distribution is the one installed from the wheels, in the fresh venv.
    venv = (tmp_path / "venv").resolve()
    where = _locations(python)
    assert set(where) == {"megablocks-core", *EXTRAS[extra]}, where
    assert all(Path(p).resolve().is_relative_to(venv) for p in where.values()), where

    plugins = _listing(python, tmp_path)
    names = {d.removeprefix("megablocks-") for d in EXTRAS[extra]}
    assert names <= set(plugins), plugins
    for name in names:
        assert plugins[name]["distribution"] == f"megablocks-{name}"
        assert plugins[name]["version"] == "0.1.0"
        assert plugins[name]["status"] in ("ok", "unavailable"), json.dumps(plugins[name])
    assert plugins["reference"]["status"] == "ok"
    if "rocm" in names:
        rocm = plugins["rocm"]
        assert rocm["device_kinds"] == ["rocm"] and len(rocm["ops"]) >= 19
        if not _is_rocm_host():  # here: a CPU build of torch, said plainly
            assert rocm["status"] == "unavailable" and "torch.version.hip is None" in rocm["reason"]


def _is_rocm_host() -> bool:
    import torch

    return bool(torch.version.hip)


def test_reference_extra_is_cpu_only(wheels, tmp_path):
    python = _install(tmp_path, wheels, "megablocks-core[reference]")
    assert set(_locations(python)) == {"megablocks-core", "megablocks-reference"}
    plugins = _listing(python, tmp_path)
    assert set(plugins) == {"reference"} and plugins["reference"]["status"] == "ok"
