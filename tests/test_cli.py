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
from fake_plugins import ENV_VARS, ONLY_REFERENCE, kernels_body, permutation

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
    assert all(k["tier"] == "portable" and k["devices"] == ["any"] for k in ref["kernels"])
    assert all("priority" not in k for k in ref["kernels"])


def test_backends_list_shows_a_broken_plugin_with_its_reason(capsys, plugins):
    plugins.add("bad", "raise ImportError('kaboom on import')\n", version="2.3")
    plugins.add(
        "nowidget",
        permutation(
            "[Kernel(op='gather', fn=recording('gather'), devices=('cpu',), tier=Tier.GENERIC_ACCELERATOR)]",
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


def test_list_and_explain_show_a_kernel_that_did_not_load(capsys, plugins):
    plugins.add(
        "half",
        permutation(
            "[KernelProblem(op='scatter', reason='no dtypes declared for it'), "
            "Kernel(op='gather', fn=recording('gather'), devices=('cpu',))]",
            extra="from megablocks_core.plugin import KernelProblem",
        ),
    )
    plugins.reload()
    code, out, _ = run(capsys, "backends", "list")
    assert code == 0
    row = next(line.split() for line in out.splitlines() if line.startswith("half "))
    assert row[3:] == ["ok", "cpu", "1"]  # the plugin loaded, with its one other op
    assert "half: its kernel for 'scatter' did not load: no dtypes declared for it" in out

    code, out, _ = run(capsys, "backends", "explain", "scatter")
    assert code == 0  # the reference serves it
    assert "not loaded: half's kernel for 'scatter': no dtypes declared for it" in out
    code, out, _ = run(capsys, "backends", "explain", "scatter", "--json")
    assert json.loads(out)["not_loaded"] == [
        {"backend": "half", "variant": "", "reason": "no dtypes declared for it"}
    ]
    code, out, _ = run(capsys, "backends", "explain", "gather")
    assert "not loaded" not in out


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
    assert "winner: reference (highest tier)" in out
    assert "portable fallback" not in out
    ref_row = next(line for line in lines if line.startswith("reference "))
    assert "yes" in ref_row.split() and "chosen: highest tier" in ref_row


def test_explain_json(capsys):
    code, out, err = run(capsys, "backends", "explain", "gather", "--dtype", "x=bfloat16", "--json")
    assert code == 0 and err == ""
    data = json.loads(out)
    assert data["op"] == "gather" and data["device_kind"] == "cpu"
    assert data["dtypes"] == {"x": "bfloat16"}
    assert data["winner"] == "reference" and data["why"] == "highest tier"
    assert data["fallback"] is False and data["error"] is None
    assert data["policy"] == "default ranking"
    assert isinstance(data["candidates"], list) and data["candidates"]
    ref = next(c for c in data["candidates"] if c["backend"] == "reference")
    assert ref["accepted"] is True and ref["devices"] == ["any"] and ref["tier"] == "portable"
    assert ref["reason"] == "chosen: highest tier"


def test_explain_shows_a_fake_winner_and_the_rejection_reasons(capsys, plugins):
    plugins.add(
        "fast",
        permutation(
            "[Kernel(op='gather', fn=recording('gather'), devices=('cpu',), tier=Tier.GENERIC_ACCELERATOR,"
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
    assert "winner: reference (highest tier (portable fallback))" in out
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
def test_explain_on_a_cuda_device_this_host_lacks(capsys):
    """explain describes a device without touching it: a CUDA device this host does not have is
    shown as such (what this installation would choose there), not refused."""
    code, out, err = run(capsys, "backends", "explain", "gather", "--device", "cuda:0")
    assert code == 0 and err == ""
    assert out.startswith("gather on cuda:0 (not present on this host)"), out
    assert "winner: reference" in out
    code, out, _ = run(capsys, "backends", "explain", "gmm", "--device", "cuda", "--json")
    assert code == 0 and json.loads(out)["device"] == "cuda (not present on this host)"
    # a command that runs ops there still refuses it
    code, _, err = run(capsys, "backends", "check", "--device", "cuda:0")
    assert code == 2 and "device 'cuda:0'" in err and "not available" in err


def test_explain_on_a_malformed_device(capsys):
    code, out, err = run(capsys, "backends", "explain", "gather", "--device", "gpu0")
    assert code == 2 and out == ""
    assert "device 'gpu0'" in err


@pytest.mark.parametrize(
    "op, shape, message",
    [
        ("gmm", "a=12xfoo", "sizes must be integers joined by x, got '12xfoo'"),
        ("gmm", "garbage", "expected ARG=DIMxDIM…"),
        ("gmm", "a=", "expected ARG=DIMxDIM…"),
        ("gmm", "=8x8", "expected ARG=DIMxDIM…"),
        ("gmm", "a=8x-1", "sizes must be at least 0, got '8x-1'"),
        ("gmm", "a=8x8x8", "a is a 2-D tensor"),
        ("gmm", "trans_b=1", "gmm has no tensor argument 'trans_b'"),
        ("gather", "a=3x4", "gather has no tensor argument 'a' (it has x, indices"),
    ],
)
def test_explain_rejects_a_malformed_shape(capsys, op, shape, message):
    # gmm and gather on this registry have no shape-dependent choice: a bad --shape must still
    # be an error, not ignored.
    code, out, err = run(capsys, "backends", "explain", op, "--shape", shape)
    assert code == 2 and out == ""
    assert err.startswith(f"megablocks: error: --shape {shape!r}: ") and message in err, err
    assert err.count("\n") == 1


def test_explain_rejects_a_shape_given_twice(capsys):
    code, out, err = run(
        capsys, "backends", "explain", "gmm", "--shape", "a=8x8", "--shape", "a=4x4"
    )
    assert code == 2 and out == ""
    assert "--shape 'a=4x4': a is given twice" in err


#: A grouped-GEMM backend whose shape predicate reads b: its choice depends on b's shape.
READS_B = kernels_body(
    "megablocks_grouped_gemm_kernels",
    "[Kernel(op='gmm', fn=recording('gmm'), devices=('cpu',), tier=Tier.GENERIC_ACCELERATOR,"
    " supports=lambda device, call: None if call['b'].shape[0] < 64 else 'too many experts')]",
)


def test_explain_refuses_a_shape_that_leaves_out_what_the_choice_reads(capsys, plugins):
    plugins.add("picky", READS_B)
    plugins.reload()
    code, out, err = run(capsys, "backends", "explain", "gmm", "--shape", "a=64x32")
    assert code == 2 and out == ""
    assert err.startswith("megablocks: error: --shape: ") and "b" in err, err
    assert "--shape b=" in err and err.count("\n") == 1, err
    code, out, err = run(
        capsys, "backends", "explain", "gmm", "--shape", "a=64x32", "--shape", "b=4x32x16",
        "--shape", "batch_sizes=4",
    )  # fmt: skip
    assert code == 0 and err == "", err
    assert out.splitlines()[-1] == "a=64x32 b=4x32x16 batch_sizes=4: picky (highest tier)"


@pytest.mark.parametrize(
    "dtypes, message",
    [
        (("bfloat16", "float16"), "--dtype 'float16': x is given bfloat16 and float16"),
        (("x=float16", "x=float32"), "--dtype 'x=float32': x is given float16 and float32"),
    ],
)
def test_explain_refuses_two_dtypes_for_one_argument(capsys, dtypes, message):
    argv = [a for d in dtypes for a in ("--dtype", d)]
    code, out, err = run(capsys, "backends", "explain", "gather", *argv)
    assert code == 2 and out == ""
    assert err.startswith("megablocks: error: ") and message in err, err


def test_explain_dtype_of_one_argument_overrides_the_dtype_of_all(capsys):
    for argv in (("float32", "x=bfloat16"), ("x=bfloat16", "float32"), ("float32", "int32")):
        options = [a for d in argv for a in ("--dtype", d)]
        code, out, _ = run(capsys, "backends", "explain", "gather", *options, "--json")
        assert code == 0
        dtypes = json.loads(out)["dtypes"]
        if "int32" in argv:
            assert dtypes["x"] == "float32" and dtypes["indices"] == "int32"
        else:
            assert dtypes["x"] == "bfloat16" and dtypes["weights"] == "float32"


def test_explain_shows_the_choice_for_a_shape_that_changes_nothing(capsys):
    code, out, err = run(capsys, "backends", "explain", "gather", "--shape", "x=3x4")
    assert code == 0 and err == ""
    assert out.splitlines()[-1] == "x=3x4: reference (highest tier)"
    code, out, _ = run(capsys, "backends", "explain", "gather", "--shape", " x = 3X4 ", "--json")
    assert code == 0
    assert json.loads(out)["call"] == {
        "shapes": {"x": [3, 4]},
        "kernel": "reference",
        "why": "highest tier",
    }


# ---------------------------------------------------------------------------
# backends check


def test_check_on_meta_is_an_error_not_a_pass(capsys):
    code, out, err = run(capsys, "backends", "check", "--device", "meta")
    assert code == 2 and out == ""
    assert err == (
        "megablocks: error: device 'meta': meta tensors hold no data, so no op can run there\n"
    )


def test_check_with_only_the_oracle_installed_checks_nothing_and_fails(capsys):
    code, out, err = run(capsys, "backends", "check")
    assert code == 1
    assert "0 passed" in out
    assert err == (
        "megablocks: nothing was checked on cpu: no backend but the reference "
        "(the kit's oracle) is installed and enabled\n"
    )
    code, out, err = run(capsys, "backends", "check", "--json")
    data = json.loads(out)
    assert code == 1 and data["passed"] is False and data["scenarios"] == 0
    assert "nothing was checked on cpu" in err


def test_check_of_the_oracle_alone_fails(capsys):
    code, _, err = run(capsys, "backends", "check", "reference")
    assert code == 1
    assert err == "megablocks: nothing of reference could be checked on cpu\n"


def test_check_where_no_backend_can_run_fails(capsys, plugins):
    plugins.add(
        "nowidget",
        permutation(
            "[Kernel(op='gather', fn=recording('gather'), devices=('cpu',), tier=Tier.GENERIC_ACCELERATOR)]",
            extra="@hookimpl\ndef megablocks_unavailable_reason():\n    return 'no widget'\n",
        ),
    )
    plugins.reload()
    code, out, err = run(capsys, "backends", "check", "--quick")
    assert code == 1
    assert "nowidget: unavailable here: no widget" in out
    assert err == "megablocks: nothing was checked on cpu: none of nowidget could run an op here\n"


def test_check_passes_when_something_was_compared(capsys, monkeypatch):
    from megablocks_core import testing

    monkeypatch.setattr(
        testing, "check", lambda *a, **k: [testing.Result("gather", "fake", "pass", scenarios=3)]
    )
    code, out, err = run(capsys, "backends", "check", "--json")
    assert code == 0 and err == ""
    assert json.loads(out)["passed"] is True and json.loads(out)["scenarios"] == 3


def test_check_ops_limits_the_kit_to_the_named_ops(capsys, monkeypatch):
    from megablocks_core import testing

    asked: list[object] = []

    def check(*args: object, ops: object = None, **kw: object) -> list[testing.Result]:
        asked.append(ops)
        return [testing.Result("gather", "fake", "pass", scenarios=3)]

    monkeypatch.setattr(testing, "check", check)
    code, _, _ = run(capsys, "backends", "check", "--ops", "gather, sort", "--json")
    assert code == 0 and asked == [["gather", "sort"]]
    code, _, _ = run(capsys, "backends", "check", "--json")
    assert code == 0 and asked[-1] is None


def test_check_shows_each_op_as_it_is_checked_on_a_terminal(capsys, monkeypatch, plugins):
    from megablocks_core import testing
    from megablocks_core.testing import kit

    plugins.add("fast", permutation("[]"))
    plugins.reload()
    verdicts = {"gather": "pass", "sort": "not provided"}

    def check_op(name, op, device, quick):  # the kit's verdicts, without running it
        return testing.Result(op, name, verdicts[op], scenarios=1, seconds=0.5)

    monkeypatch.setattr(kit, "check_op", check_op)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    code, out, err = run(capsys, "backends", "check", "fast", "--quick", "--ops", "gather,sort")
    assert code == 0, out
    assert (
        err == "checked gather on fast: pass (0.5 s)\nchecked sort on fast: not provided (0.5 s)\n"
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (("nosuch",), "backend(s) nosuch not installed (installed: "),
        (("--device", "meta"), "device 'meta': meta tensors hold no data"),
        (("--ops", "gather,nosuch"), "--ops: nosuch (dispatched ops: sort, "),
        (("--ops", ","), "--ops: no op named"),
    ],
)
def test_check_usage_errors(capsys, argv, message):
    code, out, err = run(capsys, "backends", "check", *argv)
    assert code == 2 and out == ""
    assert err.startswith("megablocks: error: ") and message in err


def test_check_without_the_oracle_is_a_usage_error(capsys):
    mb.reload({"MEGABLOCKS_PLUGINS": "triton"})
    code, out, err = run(capsys, "backends", "check")
    assert code == 2 and out == ""
    assert "install megablocks-reference" in err


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
        (("demo", "--device", "meta"), "device 'meta': meta tensors hold no data"),
        (("demo", "--seed", str(2**64)), f"--seed must be at most {2**63 - 1}, got {2**64}"),
        (("demo", "--seed", "-1"), "--seed must be at least 0, got -1"),
        (("demo", "--tokens", str(10**13)), f"--tokens must be at most 65536, got {10**13}"),
        (("demo", "--experts", "100000"), "--experts must be at most 256, got 100000"),
        (("demo", "--top-k", "0"), "--top-k must be at least 1, got 0"),
        (
            ("demo", "--tokens", "65536", "--top-k", "8"),
            "--tokens × --top-k (65536 × 8) must be at most 262144",
        ),
        (("demo", "--backend", "gather=nosuch"), "--backend: nosuch not installed"),
        (("demo", "--backend", "gmm=nosuch/variant"), "--backend: nosuch/variant not installed"),
        (("demo", "--backend", "gatherz=reference"), "--backend 'gatherz=reference': unknown op"),
        (("demo", "--backend", "gather="), "--backend 'gather=': no backend after gather="),
        (("demo", "--backend", ","), "--backend ',' names no backend"),
        (("bench", "--device", "xpu"), "device 'xpu': torch sees no xpu device"),
        (("bench", "--device", "meta"), "device 'meta': meta tensors hold no data"),
        (("bench", "--shape", "1,2,x", "--device", "cpu"), "--shape takes T,H,F,E,K"),
        (("bench", "--shapes", ",", "--device", "cpu"), "--shapes ',' names no shape"),
        (("bench", "--shapes", "tiny", "--ops", ",", "--device", "cpu"), "--ops ',' names no op"),
        (("backends", "check", "--device", "xpu"), "device 'xpu': torch sees no xpu device"),
        (("backends", "compile", "--target", ""), "--target '' names no target"),
        (("backends", "compile", "--target", "sm_90a", "--target", ","), "--target ',' names no"),
        (("backends", "compile", "--shapes", ""), "--shapes '' names no shape"),
        (("backends", "compile", "--ops", "nosuch"), "--ops: unknown op(s) 'nosuch'"),
        (("backends", "compile", "--ops", ","), "--ops ',' names no op"),
        (("backends", "compile", "--jobs", "-1"), "--jobs must be at least 1, got -1"),
        (("backends", "compile", "--jobs", "0"), "--jobs must be at least 1, got 0"),
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


@pytest.mark.parametrize("tokens", [8, 16])
def test_a_two_step_demo_of_few_tokens_passes_when_its_loss_falls(capsys, tokens):
    code, out, _ = run(
        capsys, "demo", "--steps", "2", "--tokens", str(tokens), "--backend", "reference"
    )
    assert code == 0, out
    assert out.rstrip().splitlines()[-1] == "result: ok, the loss fell"


@pytest.mark.parametrize("experts", [64, 256])
def test_a_demo_with_many_experts_passes(capsys, experts):
    code, out, _ = run(
        capsys, "demo", "--experts", str(experts), "--steps", "11", "--backend", "reference"
    )
    assert code == 0, out


@pytest.mark.parametrize("fmt", ["fp8_rowwise", "fp8_blockwise"])
def test_a_demo_in_fp8_trains_through_the_scaled_gemms(capsys, fmt):
    code, out, _ = run(capsys, "demo", "--fp8", fmt, "--steps", "11", "--backend", "reference")
    assert code == 0, out
    assert f"fp8={fmt}" in out.splitlines()[1]
    served = {
        line.split()[0]
        for line in out.split("backends that served each op:")[1].splitlines()[1:]
        if line.startswith("  ")
    }
    # the forward's GEMMs ran scaled on quantized rows; the weight gradients in the inputs' dtype
    assert {"quantize", "scaled_gather_gmm", "scaled_gmm_scatter", "gmm_weight_grad"} <= served
    assert out.rstrip().splitlines()[-1] == "result: ok, the loss fell"


def test_a_demo_of_too_few_tokens_a_step_is_not_judged(capsys):
    code, out, _ = run(capsys, "demo", "--steps", "15", "--tokens", "2", "--backend", "reference")
    assert code == 0, out
    assert out.rstrip().splitlines()[-1].startswith("result: not judged: with fewer than 8 tokens")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton interpreter")
@pytest.mark.parametrize("backend, warned", [("triton", True), ("reference", False)])
def test_demo_warns_when_the_triton_interpreter_will_serve_the_cpu(
    capsys, monkeypatch, backend, warned
):
    from megablocks_core import demo

    mb.reload({"MEGABLOCKS_PLUGINS": "reference,triton"})

    class Stop(Exception):
        pass

    def stop(self, tokens):
        raise Stop

    monkeypatch.setattr(demo.ClusterTask, "batch", stop)  # nothing is trained
    with pytest.raises(Stop):
        main(["demo", "--backend", backend])
    out = capsys.readouterr().out
    assert ("note: the Triton interpreter serves the layer's ops on the CPU" in out) == warned


def test_demo_success_rule_fits_the_step_count():
    from megablocks_core.demo import required_fraction

    assert required_fraction(2) == pytest.approx(0.95)
    assert required_fraction(5) == pytest.approx(0.8)
    assert required_fraction(11) == required_fraction(40) == 0.5


@pytest.mark.parametrize(
    "spec, force, prefer, per_op",
    [
        ("gather=reference", None, (), (("gather", "reference"),)),
        ("gather=reference,reference", "reference", (), (("gather", "reference"),)),
        ("reference, reference", None, ("reference", "reference"), ()),
    ],
)
def test_demo_backend_takes_what_megablocks_backend_takes(
    capsys, monkeypatch, spec, force, prefer, per_op
):
    from megablocks_core import demo

    policies = []
    batch = demo.ClusterTask.batch

    def recording_batch(self, tokens):
        policies.append(mb.current_policy())
        return batch(self, tokens)

    monkeypatch.setattr(demo.ClusterTask, "batch", recording_batch)
    code, out, err = run(capsys, "demo", "--steps", "2", "--backend", spec)
    assert code == 0 and err == "", err
    expected = mb.Policy.parse(spec)
    assert (expected.force, expected.prefer, expected.per_op) == (force, prefer, per_op)
    assert {(p.force, p.prefer, p.per_op) for p in policies} == {(force, prefer, per_op)}


# ---------------------------------------------------------------------------
# user errors versus bugs


@pytest.mark.parametrize("error", [ValueError, RuntimeError, KeyError, TypeError])
def test_an_internal_error_propagates_with_its_traceback(capsys, monkeypatch, error):
    def broken() -> str:
        raise error("a bug in the command")

    monkeypatch.setattr("megablocks_core.docgen.render_markdown", broken)
    with pytest.raises(error, match="a bug in the command"):
        main(["contracts"])
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    "error",
    [mb.ContractError, mb.ContractTypeError, mb.NoKernelError, mb.PluginLoadError],
)
def test_an_input_the_ops_reject_is_a_user_error(capsys, monkeypatch, error):
    def rejected() -> str:
        raise error("megablocks_core.ops.gather: x must be 2-D")

    monkeypatch.setattr("megablocks_core.docgen.render_markdown", rejected)
    code, out, err = run(capsys, "contracts")
    assert code == 2 and out == ""
    assert err == "megablocks: error: megablocks_core.ops.gather: x must be 2-D\n"


def test_a_bad_megablocks_backend_is_a_user_error(capsys, monkeypatch):
    monkeypatch.setenv("MEGABLOCKS_BACKEND", "gatherz=reference")
    code, out, err = run(capsys, "backends", "list")
    assert code == 2 and out == ""
    assert err.startswith("megablocks: error: MEGABLOCKS_BACKEND='gatherz=reference' names unknown")


@pytest.mark.parametrize("value", ["maybe", "2", "-1"])
def test_a_bad_megablocks_check_is_a_user_error(capsys, monkeypatch, value):
    monkeypatch.setenv("MEGABLOCKS_CHECK", value)
    code, out, err = run(capsys, "backends", "list")
    assert code == 2 and out == ""
    assert err.startswith(f"megablocks: error: MEGABLOCKS_CHECK={value!r}"), err


def test_console_script_shows_the_traceback_of_a_bug(tmp_path):
    # sitecustomize runs before the console script: it breaks the command from outside.
    (tmp_path / "sitecustomize.py").write_text(
        "import megablocks_core.docgen as d\n"
        "def broken():\n    raise RuntimeError('a bug in the command')\n"
        "d.render_markdown = broken\n"
    )
    script = Path(sys.executable).with_name("megablocks")
    env = {k: v for k, v in os.environ.items() if k not in ENV_VARS}
    env["PYTHONPATH"] = str(tmp_path)
    result = subprocess.run(
        [str(script), "contracts"], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 1, result.stderr
    assert "Traceback" in result.stderr and "RuntimeError: a bug in the command" in result.stderr
    assert "megablocks: error:" not in result.stderr
