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
from fake_plugins import ENV_VARS, kernels_body, permutation
from venvs import fresh_env

from megablocks_core import contracts, testing, validation
from megablocks_core.cli import main
from megablocks_core.plugin import family_ops

pytestmark = pytest.mark.usefixtures("only_reference")

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "megablocks-example-plugin"
DISPATCHED = {c.name for c in contracts.ALL if c.dispatched}
HOOKS = {
    "routing": "megablocks_routing_kernels",
    "permutation": "megablocks_permutation_kernels",
    "grouped_gemm": "megablocks_grouped_gemm_kernels",
    "activation": "megablocks_activation_kernels",
    "quantization": "megablocks_quantization_kernels",
}
#: The formats a kernel of an op with a ``format`` argument declares (all of them).
FORMATS = tuple(contracts.scaled.FORMAT.choices)


def every_op(fns: dict[str, str] | None = None, extra: str = "") -> str:
    """A plugin body that provides every dispatched op on the CPU: ``recording(op)`` (the reference's
    kernel, recorded) unless ``fns`` names another function for the op."""
    fns = fns or {}
    body = extra
    for family, hook in HOOKS.items():
        kernels = ", ".join(
            f"Kernel(op={op!r}, fn={fns.get(op, f'recording({op!r})')}, devices=('cpu',)"
            + (f", formats={FORMATS!r})" if "format" in contracts.BY_NAME[op].arg_names else ")")
            for op in family_ops(family)
        )
        body += kernels_body(hook, f"[{kernels}]")
    return body


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


@pytest.mark.parametrize("scenario", testing.FULL + testing.DEVICE_SIZED, ids=lambda s: s.name)
def test_every_sample_satisfies_its_contract_in_checked_mode(scenario):
    r = testing.routing(scenario)
    for op in testing.DISPATCHED:
        if not testing.applies(scenario, op):
            continue
        args = testing.sample(op, r)
        validation.validate(contracts.BY_NAME[op], args, checked_mode=True)
        if scenario.non_contiguous:
            assert not all(
                a.is_contiguous() for a in args if isinstance(a, torch.Tensor) and a.numel() > 1
            )


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
    assert any(s.sizes_on_device for s in testing.QUICK)
    assert any(s.block_size == 128 for s in testing.FULL)
    # Sorted rows past bins[-1] (expert parallelism's pairs of other ranks' experts), for the ops
    # that take them, one scenario with every pair unrouted.
    unrouted = [s for s in testing.FULL if s.unrouted]
    assert any(s.unrouted == s.tokens * s.top_k for s in unrouted)
    assert any(s.unrouted < s.tokens * s.top_k for s in unrouted)
    assert any(s.sizes_on_device for s in unrouted) and any(s.trans_b for s in unrouted)
    assert any(s.unrouted for s in testing.DEVICE_SIZED)


def test_accelerators_get_the_device_sized_scenarios_too():
    assert testing.scenarios(quick=True, device="cuda:0") == testing.QUICK
    assert testing.scenarios(device="cpu") == testing.FULL
    assert testing.scenarios(device="cuda:0") == testing.FULL + testing.DEVICE_SIZED
    sized = testing.DEVICE_SIZED
    assert max(s.tokens for s in sized) >= 4096 and max(s.hidden for s in sized) >= 2048
    assert {s.block_size for s in sized} == {128}
    assert any(s.tokens == 0 for s in sized) and any(s.hidden % 2 for s in sized)
    assert {torch.float32, torch.float16, torch.bfloat16} <= {s.dtype for s in sized}
    assert {True, False} == {s.trans_b for s in sized} == {s.sizes_on_device for s in sized}


def test_tolerance_table_is_the_documented_one():
    doc = (ROOT / "docs" / "writing-a-plugin.md").read_text()
    rows = dict(re.findall(r"^\| `(\w+)` \| ([0-9.e-]+) \|$", doc, re.MULTILINE))
    assert {name: float(tol) for name, tol in rows.items()} == {
        str(d).removeprefix("torch."): t for d, t in testing.TOLERANCES.items()
    }


def test_compare_names_the_first_mismatching_element():
    want = torch.zeros(3, 2)
    got = want.clone()
    got[1, 1] = 0.5
    with pytest.raises(
        testing.Mismatch, match=r"out\[1, 1\] = 0\.5, the reference gives 0\.0 \(1 of 6"
    ):
        testing.compare(got, want, "out")
    testing.compare(want + 1 + 1e-7, want + 1, "out")  # within fp32 tolerance
    with pytest.raises(testing.Mismatch, match="exactly"):
        testing.compare(torch.tensor([1, 2]), torch.tensor([1, 3]), "ids")


def test_compare_holds_rows_of_zeros_to_exact_zeros():
    # Padding rows, empty experts' weight gradients: the contract says 0, not "about 0".
    want = torch.ones(3, 4)
    want[1] = 0
    got = want.clone()
    got[1, 2] = 2.0**-20  # within any tolerance, but not 0
    with pytest.raises(
        testing.Mismatch,
        match=r"out\[1, 2\] = 9\.5367431640625e-07 in a row that the reference gives as exact zeros",
    ):
        testing.compare(got, want, "out")
    testing.compare(got.flatten(), want.flatten(), "out")  # 1-D: elements, not rows
    want[0, 0] = 0  # a single zero among values is a value like any other
    near = want.clone()
    near[0] += 1e-7
    testing.compare(near, want, "out")


# ---------------------------------------------------------------------------
# The command line and the pytest door


def test_the_oracle_is_never_compared_with_itself(capsys):
    # Only the reference is enabled here: nothing to check, one line that says why, and (having
    # proven nothing) the command fails.
    code, out, err = run_cli(capsys, "backends", "check", "--device", "cpu", "--quick", "--json")
    assert code == 1, out + err
    data = json.loads(out)
    assert data["passed"] is False and data["scenarios"] == 0
    assert {r["status"] for r in data["results"]} == {"unavailable"}  # the others are disabled
    assert [r for r in data["results"] if r["backend"] == "reference"] == [
        {
            "op": "*",
            "backend": "reference",
            "status": "unavailable",
            "message": testing.ORACLE_SKIPPED,
            "scenarios": 0,
            "declined": 0,
            "seconds": 0.0,
        }
    ]
    assert "independent numpy oracle" in testing.ORACLE_SKIPPED
    code, out, err = run_cli(capsys, "backends", "check", "--quick")
    assert code == 1 and f"reference: unavailable here: {testing.ORACLE_SKIPPED}" in out
    assert "no backend but the reference" in err
    # Named, it is skipped the same way; having proven nothing, the command fails.
    code, out, err = run_cli(capsys, "backends", "check", "reference", "--quick")
    assert (
        code == 1
        and testing.ORACLE_SKIPPED in out
        and "nothing of reference could be checked" in err
    )
    assert testing.check_op("reference", "gather").message == testing.ORACLE_SKIPPED


@pytest.mark.slow
def test_pytest_door_runs_from_any_directory(plugins, tmp_path):
    plugins.add("mirror", every_op())
    env = {k: v for k, v in os.environ.items() if k not in ENV_VARS}
    env["PYTHONPATH"] = os.pathsep.join([str(plugins.site()), env.get("PYTHONPATH", "")])
    env["MEGABLOCKS_PLUGINS"] = "reference,mirror"
    # No --megablocks-backend: every installed backend but the oracle, i.e. mirror alone.
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-v",
        "-p",
        "no:cacheprovider",
        "-p",
        "megablocks_core.testing.pytest_plugin",
        "--pyargs",
        "megablocks_core.testing",
        "--megablocks-device",
        "cpu",
        "--megablocks-quick",
        "-k",
        "histogram or scatter or loads",
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    passed = set(re.findall(r"::(test_\w+\[[\w-]+\]) PASSED", proc.stdout))
    assert {t for t in passed if "mirror" in t} == {
        "test_backend_loads[mirror]",
        *(
            f"test_op_conforms[mirror-{op}]"
            for op in (
                "histogram",
                "scatter",
                "scatter_wgrad",
                "padded_scatter",
                "padded_scatter_wgrad",
                "binned_scatter",
                "binned_scatter_wgrad",
                "gmm_scatter",
                "scaled_gmm_scatter",
            )
        ),
    }, proc.stdout
    assert "[reference" not in proc.stdout, proc.stdout  # the oracle is not one of the defaults


# ---------------------------------------------------------------------------
# Plugins that must fail, and those that cannot run here

OFF_BY_ONE = """
def gather_off_by_one(x, indices, bin_ids, weights, bins, top_k):
    # Reads the next token's row: the classic off-by-one.
    return _reference.gather(torch.roll(x, -1, 0), indices, bin_ids, weights, bins, top_k)
"""


def test_a_wrong_gather_fails_gathers_check_and_no_other(plugins, capsys):
    # Every op provided, only gather wrong: scatter's backward runs a gather, and would fail too
    # if the kit did not keep every op but the one under test on the reference.
    plugins.add("offbyone", every_op({"gather": "gather_off_by_one"}, OFF_BY_ONE))
    plugins.reload()
    code, out, err = run_cli(capsys, "backends", "check", "--device", "cpu", "--quick", "--json")
    assert code == 1
    data = json.loads(out)
    assert data["passed"] is False and data["device"] == "cpu" and data["quick"] is True
    results = {r["op"]: r for r in data["results"] if r["backend"] == "offbyone"}
    assert results["gather"]["status"] == "fail"
    assert results["gather"]["message"].startswith("gather (tokens=16 experts=4")
    assert "forward output 'out'[" in results["gather"]["message"]
    del results["gather"]
    assert set(results) == DISPATCHED - {"gather"}
    for op, r in results.items():
        assert (r["status"], r["message"]) == ("pass", ""), r
        applicable = [s for s in testing.QUICK if testing.applies(s, op)]
        assert r["scenarios"] == len(applicable) and r["declined"] == 0
    # The kernels checked were the plugin's own; the oracle (not named) only gave its line.
    assert set(plugins.calls("offbyone")) == DISPATCHED - {"gather"}
    assert [r["op"] for r in data["results"] if r["backend"] == "reference"] == ["*"]

    code, out, err = run_cli(capsys, "backends", "check", "offbyone", "--quick")
    assert code == 1
    assert re.search(r"^gather\s+FAIL$", out, re.MULTILINE)
    assert re.search(r"^scatter\s+pass$", out, re.MULTILINE)
    assert "\nFAIL offbyone: gather (tokens=16" in out
    assert f"{len(DISPATCHED) - 1} passed, 1 failed, 0 not provided" in out


PADDING_NOT_ZERO = """
def padded_gather_dirty(x, indices, bin_ids, weights, bins, padded_bins, top_k):
    out = _reference.padded_gather(x, indices, bin_ids, weights, bins, padded_bins, top_k)
    return torch.where(out == 0, torch.full_like(out, 2.0**-24), out)  # within tolerance, not zero
"""


def test_padding_rows_that_are_almost_zero_fail(plugins):
    plugins.add(
        "dirty",
        permutation(
            "[Kernel(op='padded_gather', fn=padded_gather_dirty, devices=('cpu',))]",
            PADDING_NOT_ZERO,
        ),
    )
    plugins.reload()
    [result] = testing.check(["dirty"], quick=True, ops=["padded_gather"])
    assert result.status == "fail" and "gives as exact zeros" in result.message, result.message


VARIANTS = """
def gmm_good(a, b, batch_sizes, trans_b):
    CALLS.append("good")
    return _reference.gmm(a, b, batch_sizes, trans_b)

def gmm_also_good(a, b, batch_sizes, trans_b):
    CALLS.append("also_good")
    return _reference.gmm(a, b, batch_sizes, trans_b)

def gmm_bad(a, b, batch_sizes, trans_b):
    return _reference.gmm(a, b, batch_sizes, trans_b) * 1.01
"""


def gmm_variants(*variants: tuple[str, str, str]) -> str:
    kernels = ", ".join(
        f"Kernel(op='gmm', fn={fn}, devices=({device!r},), variant={name!r})"
        for name, fn, device in variants
    )
    return kernels_body("megablocks_grouped_gemm_kernels", f"[{kernels}]", VARIANTS)


def test_every_variant_of_a_backend_is_forced_in_turn(plugins):
    plugins.add(
        "twogood",
        gmm_variants(
            ("a", "gmm_good", "cpu"), ("b", "gmm_also_good", "cpu"), ("gpu", "gmm_good", "cuda")
        ),
    )
    plugins.add("onebad", gmm_variants(("a", "gmm_good", "cpu"), ("z", "gmm_bad", "cpu")))
    plugins.reload()
    results = {r.backend: r for r in testing.check(["twogood", "onebad"], quick=True, ops=["gmm"])}
    good = results["twogood"]
    assert good.status == "pass" and good.scenarios == 2 * len(testing.QUICK)
    assert {"good", "also_good"} <= set(plugins.calls("twogood"))
    assert good.message.startswith("not checked here: twogood/gpu: ") and "cuda" in good.message
    bad = results["onebad"]
    assert bad.status == "fail" and bad.message.startswith("gmm via onebad/z (tokens=16"), (
        bad.message
    )


def test_a_kernel_that_raises_or_mutates_its_input_fails(plugins):
    plugins.add(
        "sloppy",
        permutation(
            '[Kernel(op="gather", fn=gather_in_place, devices=("cpu",)),'
            ' Kernel(op="scatter", fn=scatter_raises, devices=("cpu",))]',
            """
def gather_in_place(x, indices, bin_ids, weights, bins, top_k):
    out = _reference.gather(x, indices, bin_ids, weights, bins, top_k)
    x.zero_()
    return out

def scatter_raises(*args):
    raise RuntimeError("kernel launch failed")
""",
        ),
    )
    plugins.reload()
    results = {
        r.op: r for r in testing.check(["sloppy"], quick=True, ops=["gather", "scatter", "gmm"])
    }
    assert (
        results["gather"].status == "fail" and "modified its input 'x'" in results["gather"].message
    )
    assert results["scatter"].status == "fail"
    assert "raised RuntimeError: kernel launch failed" in results["scatter"].message
    assert results["gmm"].status == "not provided"
    assert not testing.passed(list(results.values()))


ACCUMULATORS = """
def overwrites(a, grad, batch_sizes, out):
    out.copy_(_reference.gmm_weight_grad(a, grad, batch_sizes))  # forgets what was there

def returns_out(a, grad, batch_sizes, out):
    _reference.gmm_weight_grad_accumulate(a, grad, batch_sizes, out)
    return out

def also_scales_a(a, grad, batch_sizes, out):
    _reference.gmm_weight_grad_accumulate(a, grad, batch_sizes, out)
    a.mul_(2)

def adds(a, grad, batch_sizes, out):
    CALLS.append("adds")
    out += _reference.gmm_weight_grad(a.to(out.dtype), grad.to(out.dtype), batch_sizes)
"""


def test_an_op_that_writes_in_place_is_checked_on_what_it_wrote(plugins):
    """gmm_weight_grad_accumulate writes out: the kit compares the written out with the
    composition's on a copy, requires None back, and still rejects writes to any other input."""
    op = "gmm_weight_grad_accumulate"
    for name in ("overwrites", "returns_out", "also_scales_a", "adds"):
        plugins.add(
            name,
            kernels_body(
                "megablocks_grouped_gemm_kernels",
                f"[Kernel(op={op!r}, fn={name}, devices=('cpu',))]",
                ACCUMULATORS,
            ),
        )
    plugins.reload()
    results = {r.backend: r for r in testing.check(None, quick=True, ops=[op])}
    overwrite = results["overwrites"].message
    assert results["overwrites"].status == "fail", overwrite
    assert "forward 'out' (written in place)[" in overwrite and "the reference gives" in overwrite
    assert results["returns_out"].status == "fail"
    assert "returned a Tensor; the contract says None" in results["returns_out"].message
    assert results["also_scales_a"].status == "fail"
    assert "modified its input 'a'" in results["also_scales_a"].message
    good = results["adds"]
    assert good.status == "pass" and good.scenarios == len(testing.QUICK), good
    assert plugins.calls("adds")  # its own kernel was checked, not the reference's


def test_bad_inputs_of_a_mutable_argument():
    r = testing.routing(testing.QUICK[0])
    args = testing.sample("gmm_weight_grad_accumulate", r)
    found = {
        (name, what): error
        for name, what, _, error in testing.bad_inputs(
            contracts.BY_NAME["gmm_weight_grad_accumulate"], args
        )
    }
    assert found[("out", "non-contiguous")] is ValueError
    assert found[("out", "dtype torch.int32")] is TypeError
    assert found[("out", "4-D")] is ValueError


def test_a_backend_that_cannot_run_here_is_unavailable_not_failed(plugins, capsys):
    plugins.add(
        "gpuonly", permutation('[Kernel(op="gather", fn=recording("gather"), devices=("cuda",))]')
    )
    plugins.add(
        "bf16only",
        permutation(
            '[Kernel(op="gather", fn=recording("gather"), devices=("cpu",), dtypes={"x": {torch.bfloat16}})]'
        ),
    )
    plugins.reload()
    code, out, err = run_cli(
        capsys, "backends", "check", "gpuonly", "bf16only", "--quick", "--json"
    )
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
    assert (
        result["op"] == "*"
        and result["status"] == "fail"
        and "kaboom on import" in result["message"]
    )
    code, out, err = run_cli(capsys, "backends", "check", "nosuch", "--quick")
    assert code == 2 and "nosuch" in err and "not installed" in err


# ---------------------------------------------------------------------------
# The example plugin: a real wheel in a fresh environment


@pytest.mark.slow
def test_example_plugin_installed_as_a_wheel_is_listed_ranked_and_conforms(tmp_path):
    source = tmp_path / "src"
    shutil.copytree(
        EXAMPLE, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__")
    )
    wheels = tmp_path / "wheels"
    subprocess.run(
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
            str(source),
        ],
        check=True,
        capture_output=True,
    )
    [wheel] = wheels.glob("megablocks_example_plugin-*.whl")
    python = fresh_env(tmp_path)
    subprocess.run(
        [str(python), "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheel)],
        check=True,
        capture_output=True,
    )

    env = {k: v for k, v in os.environ.items() if k not in ENV_VARS}
    env["MEGABLOCKS_PLUGINS"] = (
        "reference,example"  # triton (under TRITON_INTERPRET=1) would outrank it
    )

    def megablocks(*argv: str) -> tuple[int, dict]:
        proc = subprocess.run(
            [
                str(python),
                "-c",
                "import sys; from megablocks_core.cli import main; sys.exit(main(sys.argv[1:]))",
                *argv,
            ],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
        )
        return proc.returncode, json.loads(proc.stdout or "null")

    code, listing = megablocks("backends", "list", "--json")
    plugins = {p["name"]: p for p in listing["plugins"]}
    assert code == 0 and plugins["example"]["status"] == "ok"
    assert plugins["example"]["distribution"] == "megablocks-example-plugin"
    assert plugins["example"]["ops"] == ["histogram", "inclusive_cumsum"]
    assert plugins["example"]["device_kinds"] == ["cpu"]

    code, trace = megablocks("backends", "explain", "histogram", "--device", "cpu", "--json")
    assert code == 0 and trace["winner"] == "example" and trace["why"] == "highest tier"
    # It declares int32/int64 keys only: int16 calls go to the reference.
    code, trace = megablocks("backends", "explain", "histogram", "--dtype", "int16", "--json")
    assert code == 0 and trace["winner"] == "reference"
    rejected = {c["backend"]: c["reason"] for c in trace["candidates"] if not c["accepted"]}
    assert rejected == {"example": "x must be int32, int64, got int16"}
    # Not on other devices ("meta" stands in for an accelerator this host may not have).
    code, trace = megablocks("backends", "explain", "histogram", "--device", "meta", "--json")
    assert trace["winner"] == "reference"

    code, report = megablocks(
        "backends", "check", "example", "--device", "cpu", "--quick", "--json"
    )
    assert code == 0 and report["passed"] is True, report
    results = {r["op"]: r for r in report["results"]}
    assert {op for op, r in results.items() if r["status"] == "pass"} == {
        "histogram",
        "inclusive_cumsum",
    }
    assert {op for op, r in results.items() if r["status"] == "not provided"} == DISPATCHED - {
        "histogram",
        "inclusive_cumsum",
    }
    assert results["histogram"]["declined"] == 1  # the int16 scenario
