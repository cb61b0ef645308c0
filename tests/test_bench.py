"""`megablocks bench` on the CPU at a tiny shape: every row present, checked, and the JSON parseable."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from megablocks_core import cli
from megablocks_core.cli import main

bench = cli.load_benchmark()  # benchmarks/bench.py of this checkout


@pytest.mark.slow
def test_bench_tiny_on_cpu(tmp_path, capsys):
    path = tmp_path / "bench.json"
    code = main(
        [
            "bench",
            "--shapes",
            "tiny",
            "--device",
            "cpu",
            "--quick",
            "--dtype",
            "float32",
            "--json",
            str(path),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    data = json.loads(path.read_text())
    rows = data["results"]
    assert {r["op"] for r in rows} == {"copy", *bench.OPS}
    ours = [r for r in rows if r["kind"] == "ours"]
    assert {r["op"] for r in ours} == set(bench.OPS)
    assert all(r["check"] == "ok" and r["us"] > 0 for r in ours), ours
    assert any(
        r["provider"] == "torch" and r["op"] == "gather" and r["check"] == "ok" for r in rows
    )
    gather = next(r for r in ours if r["op"] == "gather")
    assert gather["unit"] == "GB/s" and gather["vs_limit"] > 0
    assert "tiny" in out and "gather" in out


def test_bench_rejects_unknown_shape_and_op(capsys):
    assert main(["bench", "--shapes", "huge", "--device", "cpu"]) == 2
    assert "unknown shape" in capsys.readouterr().err
    assert main(["bench", "--shapes", "tiny", "--ops", "nope", "--device", "cpu"]) == 2
    assert "unknown op" in capsys.readouterr().err
    assert main(["bench", "--shape", "1,2,3", "--device", "cpu"]) == 2


def test_bench_on_the_cpu_defaults_to_the_tiny_shape_and_says_so(capsys):
    code = main(["bench", "--ops", "gather", "--device", "cpu", "--quick", "--no-peers"])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    assert "on the CPU the default shape is tiny" in err and "--shapes mixtral,qwen3,dsv3" in err
    shapes = {line.split()[0] for line in out.splitlines()[1:] if line.strip()}
    assert shapes == {"tiny"}
    assert {line.split()[1] for line in out.splitlines()[1:] if line.strip()} == {"copy", "gather"}


def test_a_case_builds_expert_weights_only_for_gmm():
    case = bench.Case("tiny", bench.SHAPES["tiny"], torch.device("cpu"), torch.float32)
    assert "w1" not in vars(case) and "padded_rows" not in vars(case)
    results = list(
        bench.run(
            ["tiny"],
            [],
            ["gather"],
            torch.device("cpu"),
            torch.float32,
            quick=True,
            peers=False,
            log=lambda _: None,
        )
    )
    assert {r.op for r in results} == {"copy", "gather"}  # no gmm limit row: no weights built
    tokens, hidden, ffn, experts, _ = bench.SHAPES["tiny"]
    assert case.w1.shape == (experts, hidden, ffn) and case.w1.dtype == torch.float32
    assert case.rows.shape == (tokens * 2, hidden)


def test_the_benchmark_is_found_in_this_checkout():
    path = cli.benchmark_path()
    assert path is not None and path.parent.name == "benchmarks" and path.name == "bench.py"
    assert (path.parent.parent / "pyproject.toml").is_file()


def test_without_a_checkout_bench_is_a_one_line_error(monkeypatch, capsys):
    monkeypatch.setattr(cli, "benchmark_path", lambda: None)
    monkeypatch.delitem(sys.modules, cli.BENCHMARK_MODULE, raising=False)
    assert main(["bench", "--device", "cpu"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith("megablocks: error: ") and "runs from a source checkout" in err
