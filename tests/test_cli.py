"""The ``megablocks`` command line, run in-process (plus one real console-script call)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import torch
from fake_plugins import ENV_VARS, ONLY_REFERENCE, permutation

import megablocks_core as mb
from megablocks_core import contracts
from megablocks_core.cli import main

pytestmark = pytest.mark.usefixtures("only_reference")

ROOT = Path(__file__).resolve().parents[1]


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# ---------------------------------------------------------------------------
# backends list


def test_backends_list_table(capsys):
    code, out, err = run(capsys, "backends", "list")
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].split() == ["backend", "distribution", "status", "devices", "ops"]
    assert set(lines[1]) <= {"-", " "}
    row = next(line.split() for line in lines if line.startswith("reference "))
    assert row == [
        "reference",
        "megablocks-reference",
        metadata.version("megablocks-reference"),
        "ok",
        "any",
        str(sum(c.dispatched for c in contracts.ALL)),
    ]


def test_backends_list_verbose_lists_ops(capsys):
    code, out, _ = run(capsys, "backends", "list", "-v")
    assert code == 0
    provides = next(line for line in out.splitlines() if line.startswith("reference provides:"))
    assert "gather" in provides and "gmm" in provides


def test_backends_list_json(capsys):
    code, out, err = run(capsys, "backends", "list", "--json")
    assert code == 0 and err == ""
    data = json.loads(out)
    assert data["core_version"] == mb.__version__
    plugins = {p["name"]: p for p in data["plugins"]}
    ref = plugins["reference"]
    assert ref["status"] == "ok" and ref["reason"] is None
    assert ref["distribution"] == "megablocks-reference"
    assert ref["device_kinds"] == ["any"]
    assert {"gather", "gmm", "scatter", "sort", "gmm_weight_grad"} <= set(ref["ops"])
    assert all(k["priority"] == 0 and k["devices"] == ["any"] for k in ref["kernels"])


def test_backends_list_shows_a_broken_plugin_with_its_reason(capsys, plugins):
    plugins.add("bad", "raise ImportError('kaboom on import')\n", version="2.3")
    plugins.add(
        "nowidget",
        permutation(
            "[Kernel(op='gather', fn=recording('gather'), devices=('cpu',), priority=100)]",
            extra="@hookimpl\ndef megablocks_unavailable_reason():\n    return 'no widget'\n",
        ),
    )
    plugins.reload()

    code, out, _ = run(capsys, "backends", "list")
    assert code == 0
    bad = next(line.split() for line in out.splitlines() if line.startswith("bad "))
    assert bad[:4] == ["bad", "megablocks-fake-bad", "2.3", "broken"]
    assert "bad: ImportError: kaboom on import" in out
    assert "nowidget: no widget" in out
    assert "unavailable here" in next(
        line for line in out.splitlines() if line.startswith("nowidget ")
    )
    assert "reference" in out

    code, out, _ = run(capsys, "backends", "list", "--json")
    data = {p["name"]: p for p in json.loads(out)["plugins"]}
    assert data["bad"]["status"] == "broken" and data["bad"]["version"] == "2.3"
    assert data["bad"]["reason"] == "ImportError: kaboom on import"
    assert data["bad"]["ops"] == [] and data["bad"]["distribution"] == "megablocks-fake-bad"
    assert data["nowidget"]["status"] == "unavailable" and data["nowidget"]["reason"] == "no widget"
    assert data["reference"]["status"] == "ok"


# ---------------------------------------------------------------------------
# backends explain


def test_explain_gather_bfloat16_on_cpu(capsys):
    code, out, err = run(
        capsys, "backends", "explain", "gather", "--device", "cpu", "--dtype", "bfloat16"
    )
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0] == "gather on cpu (CPU) with x=bfloat16, weights=bfloat16"
    assert lines[1] == "policy: default ranking"
    assert "winner: reference (highest priority)" in out
    assert "portable fallback" not in out
    ref_row = next(line for line in lines if line.startswith("reference "))
    assert "yes" in ref_row.split() and "chosen: highest priority" in ref_row


def test_explain_json(capsys):
    code, out, err = run(capsys, "backends", "explain", "gather", "--dtype", "x=bfloat16", "--json")
    assert code == 0 and err == ""
    data = json.loads(out)
    assert data["op"] == "gather" and data["device_kind"] == "cpu"
    assert data["dtypes"] == {"x": "bfloat16"}
    assert data["winner"] == "reference" and data["why"] == "highest priority"
    assert data["fallback"] is False and data["error"] is None
    assert data["policy"] == "default ranking"
    assert isinstance(data["candidates"], list) and data["candidates"]
    ref = next(c for c in data["candidates"] if c["backend"] == "reference")
    assert ref["accepted"] is True and ref["devices"] == ["any"] and ref["priority"] == 0
    assert ref["reason"] == "chosen: highest priority"


def test_explain_shows_a_fake_winner_and_the_rejection_reasons(capsys, plugins):
    plugins.add(
        "fast",
        permutation(
            "[Kernel(op='gather', fn=recording('gather'), devices=('cpu',), priority=50,"
            " dtypes={'x': {torch.float32}})]"
        ),
    )
    plugins.reload()
    _, out, _ = run(capsys, "backends", "explain", "gather", "--dtype", "float32", "--json")
    assert json.loads(out)["winner"] == "fast"
    _, out, _ = run(capsys, "backends", "explain", "gather", "--dtype", "bfloat16", "--json")
    data = json.loads(out)
    assert data["winner"] == "reference"
    fast = next(c for c in data["candidates"] if c["backend"] == "fast")
    assert fast["accepted"] is False and fast["reason"] == "x must be float32, got bfloat16"


def test_explain_mentions_the_portable_fallback(capsys):
    # xpu is described without touching a device, so this works on a CPU-only host
    code, out, _ = run(capsys, "backends", "explain", "gather", "--device", "xpu")
    assert code == 0
    assert "winner: reference (highest priority (portable fallback))" in out
    assert "note: this is the portable fallback" in out
    code, out, _ = run(capsys, "backends", "explain", "gather", "--device", "xpu", "--json")
    data = json.loads(out)
    assert data["fallback"] is True and data["device_kind"] == "xpu"
    code, out, _ = run(capsys, "backends", "explain", "gather", "--device", "cpu")
    assert "fallback" not in out


def test_explain_with_a_forced_backend_that_cannot_serve(capsys):
    mb.reload({**ONLY_REFERENCE, "MEGABLOCKS_BACKEND": "nope"})
    code, out, err = run(capsys, "backends", "explain", "gather", "--json")
    assert code == 1
    data = json.loads(out)
    assert data["winner"] is None and "'nope'" in data["error"] and "not installed" in data["error"]
    assert data["policy"] == "force nope (MEGABLOCKS_BACKEND)"
    code, out, err = run(capsys, "backends", "explain", "gather")
    assert code == 1
    assert "no winner:" in err and "'nope'" in err


def test_explain_unknown_op(capsys):
    code, out, err = run(capsys, "backends", "explain", "gatherz")
    assert code == 2
    assert out == ""
    assert err.startswith("megablocks: error: unknown op 'gatherz'")
    assert "gather" in err.split("ops:", 1)[1]


@pytest.mark.parametrize("dtype", ["bfloat17", "x=notadtype", "Tensor"])
def test_explain_unknown_dtype(capsys, dtype):
    code, out, err = run(capsys, "backends", "explain", "gather", "--dtype", dtype)
    assert code == 2 and out == ""
    assert "unknown dtype" in err


def test_explain_dtype_for_a_missing_argument(capsys):
    code, out, err = run(capsys, "backends", "explain", "gather", "--dtype", "y=float32")
    assert code == 2 and out == ""
    assert "gather has no tensor argument y" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a host without CUDA")
def test_explain_on_a_missing_cuda_device(capsys):
    code, out, err = run(capsys, "backends", "explain", "gather", "--device", "cuda:0")
    assert code == 2 and out == ""
    assert err.startswith("megablocks: error: device 'cuda:0'")
    assert "not available" in err


def test_explain_on_a_malformed_device(capsys):
    code, out, err = run(capsys, "backends", "explain", "gather", "--device", "gpu0")
    assert code == 2 and out == ""
    assert "device 'gpu0'" in err


# ---------------------------------------------------------------------------
# other commands


def test_contracts_output_equals_docs(capsys):
    code, out, err = run(capsys, "contracts")
    assert code == 0 and err == ""
    assert out == (ROOT / "docs" / "contracts.md").read_text()


def test_no_subcommand_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2
    assert "usage: megablocks" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["backends"])
    assert info.value.code == 2


def test_console_script_version():
    script = Path(sys.executable).with_name("megablocks")
    env = {k: v for k, v in os.environ.items() if k not in ENV_VARS}
    result = subprocess.run(
        [str(script), "--version"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"megablocks-core {mb.__version__}"


NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a host without CUDA")


@pytest.mark.parametrize(
    "argv, message",
    [
        pytest.param(
            ("demo", "--device", "cuda"),
            "device 'cuda': device cuda is not available",
            marks=NO_CUDA,
        ),
        (("demo", "--device", "xpu"), "device 'xpu': torch sees no xpu device"),
        (("demo", "--device", "gpu0"), "device 'gpu0': Invalid device string"),
        (("demo", "--steps", "1"), "--steps must be at least 2, got 1"),
        (("demo", "--tokens", "0"), "--tokens must be at least 1, got 0"),
        (("demo", "--top-k", "9"), "--top-k (9) cannot exceed --experts (8)"),
        (("demo", "--backend", "nosuch"), "--backend: nosuch not installed"),
        (("demo", "--experts", "0"), "--experts must be at least 1, got 0"),
        (("bench", "--device", "xpu"), "device 'xpu': torch sees no xpu device"),
        (("backends", "check", "--device", "xpu"), "device 'xpu': torch sees no xpu device"),
    ],
)
def test_user_mistakes_are_one_line_errors_with_status_2(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert err.startswith("megablocks: error: ") and message in err and err.count("\n") == 1, err


@pytest.mark.parametrize("steps", [2, 3, 5])
def test_a_short_demo_passes_when_its_loss_falls(capsys, steps):
    code, out, _ = run(capsys, "demo", "--steps", str(steps), "--backend", "reference")
    assert code == 0, out
    assert out.rstrip().splitlines()[-1] == "result: ok, the loss fell"


def test_demo_success_rule_fits_the_step_count():
    from megablocks_core.layers.demo import required_fraction

    assert required_fraction(2) == pytest.approx(0.95)
    assert required_fraction(5) == pytest.approx(0.8)
    assert required_fraction(11) == required_fraction(40) == 0.5
