"""`megablocks bench` on the CPU at a tiny shape: every row present, checked, and the JSON parseable."""

from __future__ import annotations

import json

from megablocks_core import bench
from megablocks_core.cli import main


def test_bench_tiny_on_cpu(tmp_path, capsys):
    path = tmp_path / "bench.json"
    code = main(["bench", "--shapes", "tiny", "--device", "cpu", "--quick", "--dtype", "float32",
                 "--json", str(path)])
    out = capsys.readouterr().out
    assert code == 0, out
    data = json.loads(path.read_text())
    rows = data["results"]
    assert {r["op"] for r in rows} == {"copy", *bench.OPS}
    ours = [r for r in rows if r["kind"] == "ours"]
    assert {r["op"] for r in ours} == set(bench.OPS)
    assert all(r["check"] == "ok" and r["us"] > 0 for r in ours), ours
    assert any(r["provider"] == "torch" and r["op"] == "gather" and r["check"] == "ok" for r in rows)
    gather = next(r for r in ours if r["op"] == "gather")
    assert gather["unit"] == "GB/s" and gather["vs_limit"] > 0
    assert "tiny" in out and "gather" in out


def test_bench_rejects_unknown_shape_and_op(capsys):
    assert main(["bench", "--shapes", "huge", "--device", "cpu"]) == 2
    assert "unknown shape" in capsys.readouterr().err
    assert main(["bench", "--shapes", "tiny", "--ops", "nope", "--device", "cpu"]) == 2
    assert "unknown op" in capsys.readouterr().err
    assert main(["bench", "--shape", "1,2,3", "--device", "cpu"]) == 2
