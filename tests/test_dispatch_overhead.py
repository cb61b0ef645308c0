"""benchmarks/dispatch_overhead.py: its kernel-order arguments follow the contracts, and a short
run on the CPU prints a report with a median and a spread for every op."""

from __future__ import annotations

import importlib.util
import inspect
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from megablocks_core import contracts, ops
from megablocks_core.schema import TensorArg

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "dispatch_overhead.py"


def _benchmark() -> ModuleType:
    spec = importlib.util.spec_from_file_location("dispatch_overhead", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "contract", [c for c in contracts.ALL if c.public and c.dispatched], ids=lambda c: c.name
)
def test_kernel_args_follow_the_contract(contract: contracts.OpContract) -> None:
    """Given the public op's required arguments, the benchmark's direct call passes them in the
    contract's order, None for the kernel-only tensors and the public defaults for the rest."""
    public = getattr(ops, contract.name)
    parameters = inspect.signature(public).parameters.values()
    given = {p.name: object() for p in parameters if p.default is inspect.Parameter.empty}
    args = _benchmark().kernel_args(contract, public, tuple(given.values()))
    assert len(args) == len(contract.args)
    defaults = {p.name: p.default for p in parameters}
    for arg, value in zip(contract.args, args, strict=True):
        if isinstance(arg, TensorArg) and not arg.public:
            assert value is None, arg.name
        else:
            assert value is given.get(arg.name, defaults[arg.name]), arg.name


@pytest.mark.parametrize(
    "runs",
    [[0.9872592010330129, 0.987259201033013], [0.6787239593088918, 0.678723959308892], [2.0]],
)
def test_the_spread_stays_ordered_when_runs_differ_by_an_ulp(runs: list[float]) -> None:
    """Quartiles interpolated between runs one ulp apart can round past the median; the
    reported spread is still ordered and within the runs."""
    stats = _benchmark().spread(runs)
    assert stats["min"] <= stats["q1"] <= stats["median"] <= stats["q3"] <= stats["max"]
    assert stats["min"] == min(runs) and stats["max"] == max(runs)


def test_a_short_cpu_run_reports_each_op_with_its_spread() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--json", "--calls", "3", "--samples", "2", "--repeats", "2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["meta"]["repeats"] == 2 and report["meta"]["device"] == "cpu"
    for kind, backend in (("null_kernels", "null"), ("reference_kernels", "reference")):
        rows = report[kind]
        # the ops whose signatures gained the rows option are among those timed
        assert {"gather", "gather_gmm", "gmm_scatter"} <= {r["op"] for r in rows}
        for row in rows:
            assert row["backend"].split("/")[0] == backend, row
            for figure in ("op_us", "direct_us", "overhead_us"):
                stats = row[figure]
                assert len(stats["runs"]) == 2
                assert stats["min"] <= stats["q1"] <= stats["median"] <= stats["q3"] <= stats["max"]
            assert row["direct_us"]["min"] > 0
    assert len(report["median_overhead_us"]["runs"]) == 2
