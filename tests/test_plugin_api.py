"""The backends of this repository use only the declared plugin API of the core.

Every module of ``plugins/*`` and ``examples/*`` may import :mod:`megablocks_core.plugin` (and
:mod:`megablocks_core.ops`, where a kernel composes other ops) and nothing else of the core: the
rest is private and may change between minor versions, as it may for a third-party plugin.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from megablocks_core import plugin as plugin_api

ROOT = Path(__file__).resolve().parents[1]
#: The core's modules a backend may import.
ALLOWED = frozenset({"megablocks_core.plugin", "megablocks_core.ops"})


def backend_modules() -> list[Path]:
    found = sorted(p for tree in ("plugins", "examples") for p in (ROOT / tree).rglob("*.py")
                   if "build" not in p.relative_to(ROOT).parts)
    assert len(found) >= 20, found  # every package of the four plugins and the example
    return found


def core_imports(source: str) -> list[tuple[int, str, str]]:
    """``(line, core module, imported name or "")`` for every import of the core in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, "") for alias in node.names
                      if alias.name.split(".")[0] == "megablocks_core"]
        elif (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
              and node.module.split(".")[0] == "megablocks_core"):
            found += [(node.lineno, node.module, alias.name) for alias in node.names]
    return found


def violations(source: str) -> list[str]:
    """What ``source`` imports from the core beyond the plugin API."""
    bad = []
    for line, module, name in core_imports(source):
        # ``from megablocks_core import plugin`` names a module too.
        target = f"{module}.{name}" if module == "megablocks_core" and name else module
        if target not in ALLOWED:
            bad.append(f"line {line}: {target if module == 'megablocks_core' else module}")
        elif target == "megablocks_core.plugin" and module == target and name not in plugin_api.__all__:
            bad.append(f"line {line}: megablocks_core.plugin has no declared name {name!r}")
    return bad


@pytest.mark.parametrize("path", backend_modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_backend_imports_only_the_plugin_api(path: Path) -> None:
    assert violations(path.read_text()) == []


def test_the_check_catches_private_imports() -> None:
    source = "\n".join([
        "import megablocks_core",
        "import megablocks_core.devices",
        "from megablocks_core import Kernel, ops, plugin",
        "from megablocks_core.descriptors import DeviceInfo",
        "from megablocks_core.plugin import Kernel, not_declared",
        "from megablocks_core.ops import gmm",
        "def f():",
        "    from megablocks_core.costs import gmm_problem",
        "from .plugin import something",
    ])
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
