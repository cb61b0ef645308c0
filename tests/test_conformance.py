"""The conformance kit (``megablocks_core.testing``): its scenarios, both doors (the
``megablocks backends check`` command and pytest), and the third-party plugin path — the example
plugin built as a wheel, installed into a fresh environment, listed, ranked and checked, and a
deliberately wrong plugin caught."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fake_plugins import ENV_VARS, permutation
from venvs import fresh_env

from megablocks_core import contracts, testing, validation
from megablocks_core.cli import main

pytestmark = pytest.mark.usefixtures("only_reference")

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "megablocks-example-plugin"
DISPATCHED = {c.name for c in contracts.ALL if c.dispatched}




def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# ---------------------------------------------------------------------------
# The scenarios: one generator, one per-op table, every sample valid


def test_samples_cover_every_dispatched_contract():
    # A new contract without a row here must fail CI, not go unchecked.
    assert set(testing.SAMPLES) == DISPATCHED
    assert set(testing.DISPATCHED) == DISPATCHED


@pytest.mark.parametrize("scenario", testing.FULL, ids=lambda s: s.name)
def test_every_sample_satisfies_its_contract_in_checked_mode(scenario):
    r = testing.routing(scenario)
    for op in testing.DISPATCHED:
        args = testing.sample(op, r)
        validation.validate(contracts.BY_NAME[op], args, checked_mode=True)
        if scenario.non_contiguous:
            assert not all(a.is_contiguous() for a in args if isinstance(a, torch.Tensor) and a.numel() > 1)


def test_scenarios_cover_the_edge_cases():
    for cases in (testing.QUICK, testing.FULL):
        assert any(s.tokens == 0 for s in cases)
        assert any(s.empty_experts for s in cases)
        assert any(s.experts == 1 for s in cases)
        assert any(s.experts == 256 for s in cases)
        assert any(s.hidden == 1 for s in cases)
        assert any(s.non_contiguous for s in cases)
        assert {torch.float32, torch.float16, torch.bfloat16} <= {s.dtype for s in cases}
        assert {torch.int16, torch.int32, torch.int64} == {s.index_dtype for s in cases}
    assert set(range(1, 9)) <= {s.top_k for s in testing.FULL}
    assert torch.float64 in {s.dtype for s in testing.FULL}


def test_tolerance_table_is_the_documented_one():
    doc = (ROOT / "docs" / "writing-a-plugin.md").read_text()
    rows = dict(re.findall(r"^\| `(\w+)` \| ([0-9.e-]+) \|$", doc, re.MULTILINE))
    assert {name: float(tol) for name, tol in rows.items()} == {
        str(d).removeprefix("torch."): t for d, t in testing.TOLERANCES.items()}


def test_compare_names_the_first_mismatching_element():
    want = torch.zeros(3, 2)
    got = want.clone()
    got[1, 1] = 0.5
    with pytest.raises(testing.Mismatch, match=r"out\[1, 1\] = 0\.5, the reference gives 0\.0 \(1 of 6"):
        testing.compare(got, want, "out")
    testing.compare(want + 1e-7, want, "out")  # within fp32 tolerance
    with pytest.raises(testing.Mismatch, match="exactly"):
        testing.compare(torch.tensor([1, 2]), torch.tensor([1, 3]), "ids")


# ---------------------------------------------------------------------------
# The command line and the pytest door, on the reference backend


def test_reference_passes_the_quick_kit(capsys):
    code, out, err = run_cli(capsys, "backends", "check", "reference", "--device", "cpu", "--quick", "--json")
    assert code == 0, out + err
    data = json.loads(out)
    assert data["passed"] is True and data["device"] == "cpu" and data["quick"] is True
    results = {r["op"]: r for r in data["results"]}
    assert set(results) == DISPATCHED
    for r in results.values():
        assert (r["backend"], r["status"], r["message"]) == ("reference", "pass", "")
        assert r["scenarios"] == len(testing.QUICK) and r["declined"] == 0


def test_pytest_door_runs_from_any_directory(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ENV_VARS}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           "-p", "megablocks_core.testing.pytest_plugin", "--pyargs", "megablocks_core.testing",
           "--megablocks-backend", "reference", "--megablocks-device", "cpu", "--megablocks-quick",
           "-k", "histogram or scatter or loads"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # histogram, scatter, scatter_wgrad, padded_scatter(+_wgrad), binned_scatter(+_wgrad), loads
    assert "8 passed" in proc.stdout, proc.stdout


# ---------------------------------------------------------------------------
# Plugins that must fail, and those that cannot run here

OFF_BY_ONE = '''
def gather_off_by_one(x, indices, bin_ids, weights, bins, top_k):
    # Reads the next token's row: the classic off-by-one.
    return _reference.gather(torch.roll(x, -1, 0), indices, bin_ids, weights, bins, top_k)
'''


def test_a_wrong_gather_fails_the_kit_and_names_the_op(plugins, capsys):
    plugins.add("offbyone", permutation(
        '[Kernel(op="gather", fn=gather_off_by_one, devices=("cpu",), priority=10)]', OFF_BY_ONE))
    plugins.reload()
    code, out, err = run_cli(capsys, "backends", "check", "offbyone", "--quick", "--json")
    assert code == 1
    data = json.loads(out)
    assert data["passed"] is False
    results = {r["op"]: r for r in data["results"]}
    assert results["gather"]["status"] == "fail"
    assert results["gather"]["message"].startswith("gather (tokens=16 experts=4")
    assert "forward output 'out'[" in results["gather"]["message"]
    assert {op for op, r in results.items() if r["status"] == "not provided"} == DISPATCHED - {"gather"}

    code, out, err = run_cli(capsys, "backends", "check", "offbyone", "--quick")
    assert code == 1
    assert re.search(r"^gather\s+FAIL$", out, re.MULTILINE)
    assert re.search(r"^scatter\s+not provided$", out, re.MULTILINE)
    assert "\nFAIL offbyone: gather (tokens=16" in out
    assert "0 passed, 1 failed, 18 not provided" in out


def test_a_kernel_that_raises_or_mutates_its_input_fails(plugins):
    plugins.add("sloppy", permutation(
        '[Kernel(op="gather", fn=gather_in_place, devices=("cpu",)),'
        ' Kernel(op="scatter", fn=scatter_raises, devices=("cpu",))]', '''
def gather_in_place(x, indices, bin_ids, weights, bins, top_k):
    out = _reference.gather(x, indices, bin_ids, weights, bins, top_k)
    x.zero_()
    return out

def scatter_raises(*args):
    raise RuntimeError("kernel launch failed")
'''))
    plugins.reload()
    results = {r.op: r for r in testing.check(["sloppy"], quick=True, ops=["gather", "scatter", "gmm"])}
    assert results["gather"].status == "fail" and "modified its input 'x'" in results["gather"].message
    assert results["scatter"].status == "fail"
    assert "raised RuntimeError: kernel launch failed" in results["scatter"].message
    assert results["gmm"].status == "not provided"
    assert not testing.passed(list(results.values()))


def test_a_backend_that_cannot_run_here_is_unavailable_not_failed(plugins, capsys):
    plugins.add("gpuonly", permutation('[Kernel(op="gather", fn=recording("gather"), devices=("cuda",))]'))
    plugins.add("bf16only", permutation(
        '[Kernel(op="gather", fn=recording("gather"), devices=("cpu",), dtypes={"x": {torch.bfloat16}})]'))
    plugins.reload()
    code, out, err = run_cli(capsys, "backends", "check", "gpuonly", "bf16only", "--quick", "--json")
    results = {(r["backend"], r["op"]): r for r in json.loads(out)["results"]}
    assert results["gpuonly", "gather"]["status"] == "unavailable"
    assert "serves cuda, not cpu" in results["gpuonly", "gather"]["message"]
    # The bf16 scenario runs; the others are declined, not failed.
    assert results["bf16only", "gather"]["status"] == "pass"
    assert results["bf16only", "gather"]["scenarios"] == 1
    assert results["bf16only", "gather"]["declined"] == len(testing.QUICK) - 1
    # Named, but nothing of gpuonly could be checked here: that is not a pass.
    assert code == 1 and "nothing of gpuonly could be checked on cpu" in err


def test_a_broken_plugin_fails_and_an_unknown_one_is_an_error(plugins, capsys):
    plugins.add("kaboom", "raise ImportError('kaboom on import')\n")
    plugins.reload()
    code, out, err = run_cli(capsys, "backends", "check", "kaboom", "--quick", "--json")
    assert code == 1
    [result] = json.loads(out)["results"]
    assert result["op"] == "*" and result["status"] == "fail" and "kaboom on import" in result["message"]
    code, out, err = run_cli(capsys, "backends", "check", "nosuch", "--quick")
    assert code == 2 and "nosuch" in err and "not installed" in err


# ---------------------------------------------------------------------------
# The example plugin: a real wheel in a fresh environment


def test_example_plugin_installed_as_a_wheel_is_listed_ranked_and_conforms(tmp_path):
    source = tmp_path / "src"
    shutil.copytree(EXAMPLE, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                    "-q", "-w", str(wheels), str(source)], check=True, capture_output=True)
    [wheel] = wheels.glob("megablocks_example_plugin-*.whl")
    python = fresh_env(tmp_path)
    subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheel)],
                   check=True, capture_output=True)

    env = {k: v for k, v in os.environ.items() if k not in ENV_VARS}
    env["MEGABLOCKS_PLUGINS"] = "reference,example"  # triton (under TRITON_INTERPRET=1) would outrank it

    def megablocks(*argv: str) -> tuple[int, dict]:
        proc = subprocess.run(
            [str(python), "-c", "import sys; from megablocks_core.cli import main; sys.exit(main(sys.argv[1:]))",
             *argv], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
        return proc.returncode, json.loads(proc.stdout or "null")

    code, listing = megablocks("backends", "list", "--json")
    plugins = {p["name"]: p for p in listing["plugins"]}
    assert code == 0 and plugins["example"]["status"] == "ok"
    assert plugins["example"]["distribution"] == "megablocks-example-plugin"
    assert plugins["example"]["ops"] == ["histogram", "inclusive_cumsum"]
    assert plugins["example"]["device_kinds"] == ["cpu"]

    code, trace = megablocks("backends", "explain", "histogram", "--device", "cpu", "--json")
    assert code == 0 and trace["winner"] == "example" and trace["why"] == "highest priority"
    # It declares int32/int64 keys only: int16 calls go to the reference.
    code, trace = megablocks("backends", "explain", "histogram", "--dtype", "int16", "--json")
    assert code == 0 and trace["winner"] == "reference"
    rejected = {c["backend"]: c["reason"] for c in trace["candidates"] if not c["accepted"]}
    assert rejected == {"example": "x must be int32, int64, got int16"}
    # Not on other devices ("meta" stands in for an accelerator this host may not have).
    code, trace = megablocks("backends", "explain", "histogram", "--device", "meta", "--json")
    assert trace["winner"] == "reference"

    code, report = megablocks("backends", "check", "example", "--device", "cpu", "--quick", "--json")
    assert code == 0 and report["passed"] is True, report
    results = {r["op"]: r for r in report["results"]}
    assert {op for op, r in results.items() if r["status"] == "pass"} == {"histogram", "inclusive_cumsum"}
    assert {op for op, r in results.items() if r["status"] == "not provided"} == \
        DISPATCHED - {"histogram", "inclusive_cumsum"}
    assert results["histogram"]["declined"] == 1  # the int16 scenario
