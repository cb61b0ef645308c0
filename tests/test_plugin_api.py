"""The backends of this repository use only the declared plugin API of the core.

Every module of ``plugins/*`` and ``examples/*`` may import :mod:`megablocks_core.plugin` (and
:mod:`megablocks_core.ops`, where a kernel composes other ops) and nothing else of the core: the
rest is private and may change between minor versions, as it may for a third-party plugin.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch

from megablocks_core import plugin as plugin_api

ROOT = Path(__file__).resolve().parents[1]
#: The core's modules a backend may import.
ALLOWED = frozenset({"megablocks_core.plugin", "megablocks_core.ops"})


def backend_modules() -> list[Path]:
    found = sorted(
        p
        for tree in ("plugins", "examples")
        for p in (ROOT / tree).rglob("*.py")
        if "build" not in p.relative_to(ROOT).parts
    )
    assert len(found) >= 20, found  # every package of the four plugins and the example
    return found


def core_imports(source: str) -> list[tuple[int, str, str]]:
    """``(line, core module, imported name or "")`` for every import of the core in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [
                (node.lineno, alias.name, "")
                for alias in node.names
                if alias.name.split(".")[0] == "megablocks_core"
            ]
        elif (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and node.module
            and node.module.split(".")[0] == "megablocks_core"
        ):
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
    on_host, on_device = _gmm_call(8192, 2048, 768, 8, "cpu"), _gmm_call(8192, 2048, 768, 8, "cuda")
    want = plugin_api.gmm_estimate_us(h200, on_host, points)
    assert want is not None and want > 0
    anywhere = plugin_api.gmm_cost_hint(points)
    assert anywhere(h200, on_host) == want and anywhere(h200, on_device) == want
    assert anywhere(dataclasses.replace(h200, arch="sm_80"), on_host) is None  # not measured there
    only_rocm = plugin_api.gmm_cost_hint(points, device_kinds=("rocm",))
    assert only_rocm(h200, on_host) is None
    host_counts = plugin_api.gmm_cost_hint(points, host_counts_only=True)
    assert host_counts(h200, on_host) == want and host_counts(h200, on_device) is None
