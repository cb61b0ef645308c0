"""The backends of this repository use only declared APIs: the core's, and each other's.

Every module of ``plugins/*`` and ``examples/*`` may import :mod:`megablocks_core.plugin` (and
:mod:`megablocks_core.ops`, where a kernel composes other ops) and nothing else of the core: the
rest is private and may change between minor versions, as it may for a third-party plugin.

A plugin may import another plugin only through the module that plugin declares as its API for
other plugins (:data:`PLUGIN_APIS`: ``megablocks_triton.api``; the others declare none), and only
the names that module lists in ``__all__``: the rest of a plugin is as private as the core's.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
from pathlib import Path

import pytest
import torch

from megablocks_core import plugin as plugin_api

ROOT = Path(__file__).resolve().parents[1]
#: The core's modules a backend may import.
ALLOWED = frozenset({"megablocks_core.plugin", "megablocks_core.ops"})
#: Every plugin package of this repository -> the one module of it other plugins may import
#: (None: nothing of it).
PLUGIN_APIS: dict[str, str | None] = {
    "megablocks_reference": None,
    "megablocks_triton": "megablocks_triton.api",
    "megablocks_cuda": None,
    "megablocks_rocm": None,
    "megablocks_example_plugin": None,
}


def backend_modules() -> list[Path]:
    found = sorted(
        p
        for tree in ("plugins", "examples")
        for p in (ROOT / tree).rglob("*.py")
        if "build" not in p.relative_to(ROOT).parts
    )
    assert len(found) >= 20, found  # every package of the four plugins and the example
    return found


def absolute_imports(source: str) -> list[tuple[int, str, str]]:
    """``(line, module, imported name or "")`` for every absolute import in ``source``: import
    statements anywhere (inside functions too) and ``importlib.import_module`` / ``__import__``
    calls with a literal module name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, "") for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found += [(node.lineno, node.module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Call) and (module := _imported_by_call(node)):
            found.append((node.lineno, module, ""))
    return found


def _imported_by_call(call: ast.Call) -> str | None:
    """The module an ``import_module("...")`` / ``__import__("...")`` call names, if literal
    and absolute."""
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    if name not in ("import_module", "__import__") or not call.args:
        return None
    first = call.args[0]
    if isinstance(first, ast.Constant) and isinstance(first.value, str):
        return None if first.value.startswith(".") else first.value
    return None


def core_imports(source: str) -> list[tuple[int, str, str]]:
    """``(line, core module, imported name or "")`` for every import of the core in ``source``."""
    return [i for i in absolute_imports(source) if i[1].split(".")[0] == "megablocks_core"]


def violations(source: str) -> list[str]:
    """What ``source`` imports from the core beyond the plugin API."""
    bad = []
    for line, module, name in core_imports(source):
        # ``from megablocks_core import plugin`` names a module too.
        target = f"{module}.{name}" if module == "megablocks_core" and name else module
        if target not in ALLOWED:
            bad.append(f"line {line}: {target if module == 'megablocks_core' else module}")
        elif (
            target == "megablocks_core.plugin"
            and module == target
            and name not in plugin_api.__all__
        ):
            bad.append(f"line {line}: megablocks_core.plugin has no declared name {name!r}")
    return bad


@pytest.mark.parametrize("path", backend_modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_backend_imports_only_the_plugin_api(path: Path) -> None:
    assert violations(path.read_text()) == []


def plugin_packages() -> dict[str, Path]:
    """Every plugin package of this repository (``plugins/*/src/*``, ``examples/*/src/*``) -> its
    distribution's directory."""
    return {
        init.parent.name: init.parents[2]
        for tree in ("plugins", "examples")
        for init in (ROOT / tree).glob("*/src/*/__init__.py")
    }


def declared_names(api_module: str) -> frozenset[str]:
    """The ``__all__`` of a plugin's API module, read from its source (importing it may need
    the plugin's accelerator stack)."""
    package = api_module.split(".")[0]
    path = plugin_packages()[package] / "src" / Path(*api_module.split(".")).with_suffix(".py")
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return frozenset(ast.literal_eval(node.value))
    raise AssertionError(f"{path} declares no __all__")


def cross_plugin_violations(source: str, own_package: str) -> list[str]:
    """What ``source``, a module of ``own_package``, imports from other plugins beyond their
    declared API modules."""
    bad = []
    for line, module, name in absolute_imports(source):
        package = module.split(".")[0]
        if package not in PLUGIN_APIS or package == own_package:
            continue
        api = PLUGIN_APIS[package]
        # ``from megablocks_triton import api`` names a module too.
        target = f"{module}.{name}" if module == package and name else module
        if target != api:
            allowed = f"only {api}" if api else "nothing"
            found = f"line {line}: {target} (other plugins may import {allowed} of {package})"
            if found not in bad:  # once per statement, not per imported name
                bad.append(found)
        elif module == api and name and name not in declared_names(api):
            bad.append(f"line {line}: {api} has no declared name {name!r}")
    return bad


def test_every_plugin_package_has_a_declared_api_or_none() -> None:
    assert set(plugin_packages()) == set(PLUGIN_APIS)
    for api in filter(None, PLUGIN_APIS.values()):
        assert declared_names(api)


@pytest.mark.parametrize("path", backend_modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_plugins_import_each_other_only_through_declared_apis(path: Path) -> None:
    owners = {directory: package for package, directory in plugin_packages().items()}
    own_package = owners[ROOT.joinpath(*path.relative_to(ROOT).parts[:2])]
    assert cross_plugin_violations(path.read_text(), own_package) == []


def test_the_check_catches_imports_of_another_plugins_internals() -> None:
    source = "\n".join(
        [
            "import megablocks_triton",
            "import megablocks_triton.api",
            "from megablocks_triton import api, plugin",
            "from megablocks_triton.config import LaunchConfigs",
            "from megablocks_triton.api import LaunchConfigs, not_declared",
            "def f():",
            "    from megablocks_triton import aot",
            "    import megablocks_reference.kernels",
            "importlib.import_module('megablocks_cuda.gmm')",
            "from megablocks_rocm.launch import RocmLaunchConfigs",
            "from .config import something",
        ]
    )
    assert cross_plugin_violations(source, "megablocks_rocm") == [
        "line 1: megablocks_triton (other plugins may import only megablocks_triton.api of "
        "megablocks_triton)",
        "line 3: megablocks_triton.plugin (other plugins may import only megablocks_triton.api "
        "of megablocks_triton)",
        "line 4: megablocks_triton.config (other plugins may import only megablocks_triton.api "
        "of megablocks_triton)",
        "line 5: megablocks_triton.api has no declared name 'not_declared'",
        "line 7: megablocks_triton.aot (other plugins may import only megablocks_triton.api of "
        "megablocks_triton)",
        "line 8: megablocks_reference.kernels (other plugins may import nothing of "
        "megablocks_reference)",
        "line 9: megablocks_cuda.gmm (other plugins may import nothing of megablocks_cuda)",
    ]


def test_the_check_catches_private_imports() -> None:
    source = "\n".join(
        [
            "import megablocks_core",
            "import megablocks_core.devices",
            "from megablocks_core import Kernel, ops, plugin",
            "from megablocks_core.descriptors import DeviceInfo",
            "from megablocks_core.plugin import Kernel, not_declared",
            "from megablocks_core.ops import gmm",
            "def f():",
            "    from megablocks_core.costs import gmm_problem",
            "from .plugin import something",
        ]
    )
    assert violations(source) == [
        "line 1: megablocks_core",
        "line 2: megablocks_core.devices",
        "line 3: megablocks_core.Kernel",
        "line 4: megablocks_core.descriptors",
        "line 5: megablocks_core.plugin has no declared name 'not_declared'",
        "line 8: megablocks_core.costs",
    ]


def test_every_declared_name_exists() -> None:
    missing = [name for name in plugin_api.__all__ if not hasattr(plugin_api, name)]
    assert missing == []


@pytest.mark.parametrize("api", sorted(filter(None, PLUGIN_APIS.values())))
def test_every_name_a_plugin_api_declares_exists(api: str) -> None:
    pytest.importorskip("triton")  # the plugin APIs of this repository are the triton backend's
    module = importlib.import_module(api)
    assert set(module.__all__) == declared_names(api)
    assert [name for name in module.__all__ if not hasattr(module, name)] == []


# ---------------------------------------------------------------------------
# helpers the API declares for backends


@pytest.mark.parametrize(
    ("arch", "family"),
    [
        ("gfx90a", "cdna2"),
        ("gfx942", "cdna3"),
        ("gfx950", "cdna4"),
        ("gfx942:sramecc+:xnack-", "cdna3"),
        ("sm_80", "ampere"),
        ("sm_89", "ada"),
        ("sm_90", "hopper"),
        ("sm_100", "blackwell"),
        ("sm_120", None),
        ("gfx1100", None),
        ("gfx908", None),
        ("", None),
        (None, None),
    ],
)
def test_arch_family(arch: str | None, family: str | None) -> None:
    assert plugin_api.arch_family(arch) == family
    device = plugin_api.DeviceInfo(
        kind="rocm" if (arch or "").startswith("gfx") else "cuda", type="cuda", arch=arch
    )
    assert plugin_api.arch_family(device) == family


def _gmm_call(tokens: int, k: int, n: int, experts: int, counts_on: str) -> dict[str, object]:
    return {
        "a": plugin_api.TensorMeta((tokens, k), torch.bfloat16, "cuda"),
        "b": plugin_api.TensorMeta((experts, k, n), torch.bfloat16, "cuda"),
        "batch_sizes": plugin_api.TensorMeta((experts,), torch.int64, counts_on),
        "trans_b": False,
    }


def test_gmm_cost_hint() -> None:
    h200 = plugin_api.DeviceInfo(kind="cuda", type="cuda", arch="sm_90", capability=(9, 0))
    points = {"sm_90": [(1024.0, 2048.0, 768.0, 0.5)]}
    dense = {"sm_90": 690.0}
    on_host, on_device = _gmm_call(8192, 2048, 768, 8, "cpu"), _gmm_call(8192, 2048, 768, 8, "cuda")
    want = plugin_api.gmm_estimate_us(h200, on_host, points, dense_tflops=dense)
    assert want is not None and want > 0
    anywhere = plugin_api.gmm_cost_hint(points, dense_tflops=dense)
    assert anywhere(h200, on_host) == want and anywhere(h200, on_device) == want
    assert anywhere(dataclasses.replace(h200, arch="sm_80"), on_host) is None  # not measured there
    only_rocm = plugin_api.gmm_cost_hint(points, dense_tflops=dense, device_kinds=("rocm",))
    assert only_rocm(h200, on_host) is None
    host_counts = plugin_api.gmm_cost_hint(points, dense_tflops=dense, host_counts_only=True)
    assert host_counts(h200, on_host) == want and host_counts(h200, on_device) is None
