"""What importing the op surface brings in: the mechanism only, never the applications built on it."""

from __future__ import annotations

import json
import subprocess
import sys


def _modules_after(statement: str) -> set[str]:
    code = f"import json, sys\n{statement}\nprint(json.dumps(sorted(sys.modules)))"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr
    return set(json.loads(result.stdout.splitlines()[-1]))


def test_importing_the_ops_imports_no_layer_benchmark_demo_or_cli():
    loaded = _modules_after("import megablocks_core.ops")
    assert (
        "megablocks_core.ops" in loaded and "megablocks_core.dispatch" in loaded
    )  # the check can fail
    applications = {
        m
        for m in loaded
        if m.startswith(
            (
                "megablocks_core.layers",
                "megablocks_core.demo",
                "megablocks_core.cli",
                "megablocks_bench",
                "bench",
            )
        )
    }
    assert applications == set()


def test_the_layer_package_exports_the_layer_and_its_record():
    loaded = _modules_after(
        "from megablocks_core.layers import DroplessMoE, MoEConfig, dMoE\n"
        "assert dMoE is DroplessMoE and MoEConfig.__module__ == 'megablocks_core.layers.config'"
    )
    assert {"megablocks_core.layers.moe", "megablocks_core.layers.config"} <= loaded
    assert "megablocks_core.demo" not in loaded and "megablocks_bench" not in loaded


def test_the_layer_package_holds_only_layers():
    """The demo and the model shapes are not layers: they live beside the package, and the
    benchmarks' baseline exchange is not part of its namespace."""
    import megablocks_core.layers as layers

    assert set(layers.__all__) == {
        "DroplessMoE",
        "MoEConfig",
        "dMoE",
        "gelu_tanh",
        "load_balancing_loss",
    }
    assert not hasattr(layers, "expert_parallel_apply") and not hasattr(layers, "all_to_all")
    from megablocks_core import demo, shapes

    assert demo.TinyMoEModel and "tiny" in shapes.SHAPES
