"""The H200 benchmarks' scripts on the CPU: their checks compare what they claim to compare.

benchmarks/transformers_experts.py (transformers' experts implementations side by side) and
benchmarks/megatron_permute.py (Megatron-Core's fused permutation on ours against its unfused
path) each check our result against the other implementation's before timing it; here they run
at tiny widths on the reference backend, and a wrong result must show in their check column.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any
from unittest import mock

import pytest
import torch
from triton_interpreter import interpreting

import megablocks_core
from megablocks_core.formats import FORMAT_NAMES
from megablocks_core.shapes import SHAPES

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def transformers_script() -> ModuleType:
    pytest.importorskip("transformers")
    return _script("transformers_experts")


def _tiny_run(script: ModuleType, tmp_path: Path, models: str) -> dict:
    path = tmp_path / "out.json"
    argv = ["--device", "cpu", "--tiny", "--tokens", "24", "--models", models, "--sustain", "0"]
    implementations = "grouped_mm,megablocks,megablocks-fused,eager"
    argv += ["--implementations", implementations, "--reps", "1", "--json", str(path)]
    with megablocks_core.use_backend("reference"):
        assert script.main(argv) == 0
    return json.loads(path.read_text())


def test_transformers_experts_checks_every_implementation_against_grouped_mm(
    transformers_script, tmp_path
):
    result = _tiny_run(transformers_script, tmp_path, "qwen3,gpt_oss")
    rows = result["rows"]
    assert {(r["model"], r["implementation"]) for r in rows} == {
        (m, i)
        for m in ("qwen3", "gpt_oss")
        for i in ("grouped_mm", "megablocks", "megablocks-fused", "eager")
    }
    assert {r["item"] for r in rows} == {"experts", "block", "train"}
    for r in rows:
        assert r["ms"] > 0
        assert (
            r["check"] == "reference"
            if r["implementation"] == "grouped_mm"
            else (r["check"].startswith("ok"))
        ), r
    ratios = {(r["model"], r["item"], r["implementation"]) for r in result["ratios"]}
    assert ratios == {
        (m, i, ours)
        for m in ("qwen3", "gpt_oss")
        for i in ("experts", "block", "train")
        for ours in ("megablocks", "megablocks-fused")
    }


def test_transformers_experts_check_catches_a_wrong_result(
    transformers_script, tmp_path, monkeypatch
):
    from megablocks_core.integrations import transformers as hf

    right = hf.experts_forward

    def off_by_a_bit(*args, **kwargs):
        return right(*args, **kwargs) * 1.1

    monkeypatch.setattr(hf, "experts_forward", off_by_a_bit)
    hf.register()  # the registered forward is looked up at registration
    try:
        rows = _tiny_run(transformers_script, tmp_path, "qwen3")["rows"]
    finally:
        monkeypatch.undo()
        hf.register()
    ours = [r for r in rows if r["implementation"].startswith("megablocks")]
    assert len(ours) == 6 and all(r["check"].startswith("off by") for r in ours)


def test_transformers_experts_decode_preset_times_the_block_forward_beside_its_host_time(
    transformers_script, tmp_path
):
    """--decode: the MoE block's forward at small token counts, every row with its host time
    beside its time and checked against grouped_mm; on the CPU the CUDA-graph rows are errors
    saying so, and the others still run."""
    path = tmp_path / "decode.json"
    argv = ["--device", "cpu", "--tiny", "--decode", "--tokens", "1,8", "--models", "gpt_oss"]
    argv += ["--implementations", "grouped_mm,megablocks", "--sustain", "0", "--reps", "1"]
    with megablocks_core.use_backend("reference"):
        assert transformers_script.main([*argv, "--json", str(path)]) == 0
    result = json.loads(path.read_text())
    rows = {(r["tokens"], r["item"], r["implementation"]): r for r in result["rows"]}
    assert set(rows) == {
        (t, item, i)
        for t in (1, 8)
        for item in ("forward", "forward_graph")
        for i in ("grouped_mm", "megablocks")
    }
    for (_, item, _), r in rows.items():
        if item == "forward_graph":
            assert r["check"].startswith("error") and "CUDA" in r["check"], r
            continue
        assert r["ms"] > 0 and r["host_ms"] > 0, r
        assert r["check"] == "reference" or r["check"].startswith("ok"), r
    ratios = {(r["tokens"], r["item"]): r for r in result["ratios"]}
    assert set(ratios) == {(1, "forward"), (8, "forward")}
    assert all(r["host_ms"] > 0 and r["grouped_mm_host_ms"] > 0 for r in ratios.values())


def test_transformers_experts_decode_preset_defaults(transformers_script, monkeypatch):
    seen = {}
    monkeypatch.setattr(
        transformers_script, "run", lambda args: seen.update(args=args) or {"ratios": []}
    )
    monkeypatch.setattr(transformers_script, "_write", lambda *a: None)
    transformers_script.main(["--decode", "--models", "qwen3"])
    args = seen["args"]
    assert args.tokens == [1, 8, 64, 512, 4096]
    assert args.items == ["forward", "forward_graph"]
    assert args.implementations == ["megablocks", "grouped_mm", "batched_mm"]
    seen.clear()
    transformers_script.main(["--models", "qwen3"])  # without it: the training items
    assert seen["args"].items == ["experts", "block", "train"]
    assert seen["args"].tokens == [4096, 16384]


def test_host_caches_reports_each_case_before_and_after(capsys):
    script = _script("host_caches")
    assert script.main(["--calls", "2", "--samples", "1", "--tokens", "4"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    cases = ["counts_from_bins", "gluon_wgrad_launch", "served_bias", "fp8_validation"]
    assert [r["case"] for r in rows] == cases
    for r in rows:
        if "skipped" not in r:
            assert r["before_us"] > 0 and r["after_us"] > 0, r
            assert r["saved_us"] == pytest.approx(r["before_us"] - r["after_us"])


def test_megatron_permute_checks_ours_against_megatrons_unfused_path(tmp_path, capsys):
    pytest.importorskip("megatron.core")
    script = _script("megatron_permute")
    path = tmp_path / "out.json"
    with megablocks_core.use_backend("reference"):
        assert (
            script.main(
                ["--device", "cpu", "--tokens", "40", "--shapes", "qwen3", "--json", str(path)]
            )
            == 0
        )
    rows = json.loads(path.read_text())["rows"]
    ours = [r for r in rows if r["provider"].startswith("megablocks-core")]
    assert {r["op"] for r in ours} >= {
        "permute, mask",
        "permute, mask + probs",
        "unpermute, mask + probs",
        "permute, index",
        "unpermute, index + probs",
        "round trip fwd+bwd",
        "permute, mask + probs, padded to 16, static bound",  # checked against TE's padded API
    }
    for r in ours:  # every part of a check "ok" ("ok; probs ok"), or nothing to compare
        parts = [part.strip() for part in r["check"].split(";")]
        assert r["check"] == "n/a" or all(p in ("ok", "probs ok") for p in parts), r
        assert r["us"] > 0
        assert (r["vs_limit"] is None) == (r["limit_us"] is None)
    assert torch.isfinite(torch.tensor([r["us"] for r in rows])).all()


def test_gate_vs_gpu_lists_the_gate_keys_on_the_cpu_and_compares_sets():
    """The GPU half needs a GPU; the gate's half (the simulated H200's jobs as keys, compiled
    Triton: outside the interpreter) and the comparison run here."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    script = str(BENCHMARKS / "gate_vs_gpu.py")
    argv = [sys.executable, script, "--gate-only", "sm_90a", "--shapes", "decode"]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    keys = json.loads(done.stdout)
    assert len(keys) > 20 and len(set(keys)) == len(keys)
    assert any(k.startswith("gmm._gmm_kernel ") for k in keys)
    assert any(k.startswith("routing._histogram_kernel ") for k in keys)
    compare = _script("gate_vs_gpu").compare
    gate = {("a._k", "h1", 4, 3): "gmm: x", ("a._k", "h2", 8, 3): "gmm: y"}
    got = compare({("a._k", "h1", 4, 3), ("b._new", "h3", 4, 2)}, gate)
    assert got["ran"] == 2 and got["gated"] == 2
    assert got["ran_not_gated"] == ["b._new w4 s2 h3"]
    assert got["gated_not_ran"] == ["gmm: y (a._k w8 s3)"]
    assert got["warps_differ"] == []
    # The same variant reporting more warps (a warp-specialized kernel's workers) still matches.
    got = compare({("a._k", "h1", 4, 3), ("a._k", "h2", 12, 3)}, gate)
    assert got["ran_not_gated"] == [] and got["gated_not_ran"] == []
    assert got["warps_differ"] == ["a._k w12 s3 h2 (gated w8)"]


def test_gate_vs_gpu_says_it_needs_a_gpu(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _script("gate_vs_gpu").main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_moe_permute_profile_times_every_form(tmp_path):
    script = _script("moe_permute_profile")
    path = tmp_path / "out.json"
    argv = ["--device", "cpu", "--tokens", "16", "--shapes", "tiny", "--json", str(path)]
    assert script.main(argv) == 0
    rows = json.loads(path.read_text())["rows"]
    assert {r["form"] for r in rows} == {
        "mask",
        "mask + probs",
        "index",
        "mask, padded to 128 (static bound)",
        "map only, mask",
        "map only, index",
        "permute only, mask map",
        "permute only, index map",
        "writes alone: zero the output",
    }
    for r in rows:
        assert r["us"] > 0 and r["host_us"] > 0 and r["limit_us"] > 0
        assert r["vs_limit"] == pytest.approx(r["us"] / r["limit_us"])
        assert r["kernels"] == {} and r["kernels_us"] == 0  # no device kernels on the CPU


def test_scaled_gmm_providers_reports_the_ranked_provider(tmp_path):
    script = _script("scaled_gmm_providers")
    path = tmp_path / "out.json"
    assert script.main(["--device", "cpu", "--tiny", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())["rows"]
    assert [r["rows_per_expert"] for r in rows] == [32, 4]
    for r in rows:  # torch's kernel has no CPU implementation: only triton's columns
        assert r["triton_us"] > 0 and "torch_us" not in r
        assert r["ranked"] is not None and r["ranked"].startswith("triton")


def test_scaled_gmm_providers_replaces_the_gluon_bound_only_for_its_run_and_times_a_bias(tmp_path):
    script = _script("scaled_gmm_providers")
    scaled = script.scaled
    table_row = scaled.arch_tuning
    seen = []
    with script.gluon_max_k(5):
        seen.append(scaled.arch_tuning(scaled.device_info(torch.device("cpu"))))
    assert seen[0].gluon_scaled_max_k == 5 and scaled.arch_tuning is table_row
    path = tmp_path / "out.json"
    argv = ["--device", "cpu", "--tiny", "--gluon-max-k", "7", "--bias", "--json", str(path)]
    assert script.main(argv) == 0
    result = json.loads(path.read_text())
    assert result["meta"]["gluon_max_k"] == 7
    assert all(r["triton_bias_us"] > 0 and r["bias_cost"] > 0 for r in result["rows"])
    assert scaled.arch_tuning is table_row


def test_scaled_gmm_providers_times_gathered_rows(tmp_path, monkeypatch):
    script = _script("scaled_gmm_providers")
    path = tmp_path / "out.json"
    assert script.main(["--device", "cpu", "--tiny", "--gather", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())["rows"]
    assert [(r["tokens"], r["top_k"]) for r in rows] == [(64, 2), (8, 2)]
    for r in rows:  # the interpreter has no Gluon kernel: the Triton one every way
        assert r["triton_kernel"] == "triton" and r["triton_us"] > 0 and r["triton_plain_us"] > 0
        assert not r["gather_first_taken"] and r["gather_first_us"] > 0
    # The rows copied first where the rule is forced: taken, and their output checked equal.
    monkeypatch.setattr(script.scaled, "_gathers_first", lambda *a: True)
    assert script.main(["--device", "cpu", "--tiny", "--gather", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())["rows"]
    assert all(r["gather_first_taken"] and r["gather_first_us"] > 0 for r in rows)
    assert script.scaled.GATHER_FIRST  # the switch is left as it was (on)


def test_scaled_gmm_providers_takes_the_blockwise_format(tmp_path):
    script = _script("scaled_gmm_providers")
    path = tmp_path / "out.json"
    for gather in ([], ["--gather"]):
        argv = ["--device", "cpu", "--tiny", "--format", "fp8_blockwise", "--json", str(path)]
        assert script.main(argv + gather) == 0
        rows = json.loads(path.read_text())["rows"]
        assert rows and all(r["format"] == "fp8_blockwise" for r in rows)


def test_fp8_wgrad_reports_ours_in_bf16_and_fp8_with_their_errors(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # it imports its neighbour's timer
    script = _script("fp8_wgrad")
    path = tmp_path / "out.json"
    with megablocks_core.use_backend("reference"):
        argv = ["--device", "cpu", "--tokens", "32", "--shapes", "qwen3", "--json", str(path)]
        assert script.main(argv) == 0
    rows = json.loads(path.read_text())["rows"]
    assert [r["gemm"] for r in rows] == ["w1 wgrad", "w2 wgrad"]
    for r in rows:  # no torch grouped GEMM on the CPU: ours in bf16 and FP8, the quantize calls
        assert r["bf16_error"] < 1e-2 and 1e-3 < r["fp8_error"] < 0.1
        assert r["quantize_us"] > 0 and r["fp8_total_us"] > r["fp8_us"] > 0
        assert "torch_fp8_us" not in r
        # The gathered operand: read through the indices, the same bits as gather then quantize.
        assert r["gathered_quantize_equals"] and r["gathered_quantize_us"] > 0
        assert r["gathered_weighted"] == (r["gemm"] == "w2 wgrad")


def test_fp8_wgrad_routed_groups_are_uneven_and_their_errors_still_against_float32(
    tmp_path, monkeypatch
):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    script = _script("fp8_wgrad")
    counts = script.expert_counts(64, 8, 2, "routed")
    assert int(counts.sum()) == 128 and counts.unique().numel() > 1  # every row placed, unevenly
    assert torch.equal(script.expert_counts(64, 8, 2, "uniform"), torch.full((8,), 16))
    path = tmp_path / "out.json"
    argv = ["--device", "cpu", "--tokens", "32", "--shapes", "qwen3", "--routing", "routed"]
    with megablocks_core.use_backend("reference"):
        assert script.main([*argv, "--json", str(path)]) == 0
    rows = json.loads(path.read_text())["rows"]
    assert [r["routing"] for r in rows] == ["routed", "routed"]
    for r in rows:  # the float32 reference summed over the same uneven groups
        assert r["rows"] == 32 * 8 and r["bf16_error"] < 1e-2 and 1e-3 < r["fp8_error"] < 0.1
        assert r["gathered_quantize_equals"]
        # The groups moved to 128-row starts, zeros between them: the same gradient.
        assert r["aligned_rows"] % 128 == 0 and r["aligned_rows"] >= r["rows"]
        assert abs(r["fp8_aligned_error"] - r["fp8_error"]) < 1e-3 * r["fp8_error"]


def test_fp8_wgrad_s_aligned_groups_start_on_the_boundary_with_zero_rows_between(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    script = _script("fp8_wgrad")
    data = (torch.arange(16, dtype=torch.uint8) + 1).view(2, 8).view(torch.float8_e4m3fn)
    (moved,), padded = script._aligned_groups([data], torch.tensor([3, 0, 5]), 4)
    assert padded.tolist() == [4, 0, 8]
    got, rows = moved.view(torch.uint8), data.view(torch.uint8)
    assert got.shape == (2, 12)
    assert torch.equal(got[:, :3], rows[:, :3]) and torch.equal(got[:, 4:9], rows[:, 3:])
    assert not got[:, 3].any() and not got[:, 9:].any()


@pytest.mark.skipif(not interpreting(), reason="the Triton kernels on the CPU: the interpreter")
def test_fp8_wgrad_times_quantize_tiles_checked_against_the_ranked_kernel(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    script = _script("fp8_wgrad")
    path = tmp_path / "out.json"
    argv = ["--device", "cpu", "--shapes", "tiny", "--dtype", "float16"]
    argv += ["--json", str(path)]
    with megablocks_core.use_backend("reference"):  # the outputs the tiles must equal
        assert script.main([*argv, "--quantize-tiles", "16x128x4x1,32x64x2x3"]) == 0
    for row in json.loads(path.read_text())["rows"]:
        assert list(row["quantize_tiles"]) == ["16x128x4x1", "32x64x2x3"]
        assert all(t["equals"] and t["us"] > 0 for t in row["quantize_tiles"].values())
    with pytest.raises(SystemExit):
        script.main([*argv, "--quantize-tiles", "16x128x4"])


def test_fp8_loss_gap_reports_each_run_against_the_same_seeds_bf16(tmp_path):
    script = _script("fp8_loss_gap")
    path = tmp_path / "out.json"
    assert script.main(["--seeds", "5,6", "--steps", "2", "--json", str(path)]) == 0
    result = json.loads(path.read_text())
    assert [r["seed"] for r in result["rows"]] == [5, 6]
    runs = ["bf16+ulp", "float32", "fp8_rowwise", "fp8_blockwise", "fp8_rowwise+wgrad"]
    with megablocks_core.use_backend("reference"):
        for row in result["rows"]:
            assert list(row["gap_pct"]) == runs
            assert row["bf16_loss"] == script.final_loss("bf16", row["seed"], 2)
            rowwise = script.final_loss("fp8_rowwise", row["seed"], 2)
            assert row["gap_pct"]["fp8_rowwise"] == pytest.approx(
                100 * (rowwise / row["bf16_loss"] - 1)
            )
            # the perturbed start is another start, FP8 is not bf16, and FP8 weight gradients
            # move the weights otherwise
            assert row["gap_pct"]["bf16+ulp"] != 0 and row["gap_pct"]["fp8_rowwise"] != 0
            assert row["gap_pct"]["fp8_rowwise+wgrad"] != row["gap_pct"]["fp8_rowwise"]
    for run in runs:
        gaps = [r["gap_pct"][run] for r in result["rows"]]
        stats = result["summary"][run]
        assert stats["mean_pct"] == pytest.approx(sum(gaps) / 2) and stats["max_pct"] == max(gaps)
        assert stats["over_1pct"] == sum(g > 1 for g in gaps) and stats["seeds"] == 2
    layer = script.dMoE(script.MoEConfig(32, 64, 8, 2, glu=True, dtype=torch.bfloat16, seed=5))
    before = [p.detach().clone() for p in layer.parameters()]
    script._move_one_ulp(layer, 5)
    for old, new in zip(before, layer.parameters(), strict=True):
        moved = old != new
        assert 0.05 < moved.float().mean() < 0.15  # about one in ten
        assert torch.all(
            (new[moved].float() - old[moved].float()).abs() <= old[moved].float().abs() * 2**-7
        )


def test_decode_host_times_the_fp8_experts_beside_the_others(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # it imports transformers_experts
    script = _script("decode_host")
    path = tmp_path / "out.json"
    argv = ["--device", "cpu", "--tiny", "--models", "qwen3", "--tokens", "1,3", "--calls", "2"]
    argv += ["--runs", "1", "--fp8", "fp8_rowwise", "--json", str(path)]
    with megablocks_core.use_backend("reference"):
        megablocks_core.dispatch._served.clear()
        assert script.main(argv) == 0
        served = megablocks_core.dispatch.served()
    rows = json.loads(path.read_text())
    assert [(r["tokens"], r["implementation"]) for r in rows] == [
        (t, i) for t in (1, 3) for i in ("megablocks", "grouped_mm", "megablocks-fp8")
    ]
    assert all(r["block_host_ms"] > 0 and r["experts_host_ms"] > 0 for r in rows)
    assert {"quantize", "scaled_gather_gmm", "scaled_gmm_scatter"} <= set(served)


def test_fp8_gemm_s_layer_rows_check_each_recipe_against_float32_or_skip_the_check(tmp_path):
    script = _script("fp8_gemm")
    checked, timed = tmp_path / "checked.jsonl", tmp_path / "timed.jsonl"
    argv = ["--device", "cpu", "--tiny", "--layer", "--no-gemms", "--reps", "1"]
    with megablocks_core.use_backend("reference"):
        assert script.main([*argv, "--out", str(checked)]) == 0
        assert script.main([*argv, "--no-layer-errors", "--out", str(timed)]) == 0
    rows = [json.loads(line) for line in checked.read_text().splitlines()]
    kinds = ("", "+cached", "+cached+updated")
    assert [r["recipe"] for r in rows] == [
        "bf16",
        *(f"fp8_rowwise{kind}" for kind in kinds),
        *(f"fp8_rowwise{kind}+wgrad" for kind in kinds),  # the weight gradients in FP8 too
        *(f"fp8_blockwise{kind}" for kind in kinds),
    ]
    for r in rows:  # bf16 rounds to 3 significant digits; e4m3 keeps 2
        bound = 1e-2 if r["recipe"] == "bf16" else 1e-1
        assert all(r[f"error_{k}"] < bound for k in ("out", "dx", "dw1", "dw2")), r
    assert rows[1]["error_out"] > 3 * rows[0]["error_out"]  # the FP8 recipe did quantize
    rows = [json.loads(line) for line in timed.read_text().splitlines()]
    assert len(rows) == 10 and not any(k.startswith("error") for r in rows for k in r)
    assert not any("peak_gib" in r for r in rows)  # no allocator statistics on the CPU
    picked = tmp_path / "picked.jsonl"
    with megablocks_core.use_backend("reference"):
        chosen = "bf16,fp8_rowwise+cached+updated"
        assert (
            script.main([*argv, "--no-layer-errors", "--recipes", chosen, "--out", str(picked)])
            == 0
        )
        with pytest.raises(SystemExit, match="no recipe fp8"):
            script.main([*argv, "--recipes", "fp8", "--out", str(picked)])
    rows = [json.loads(line) for line in picked.read_text().splitlines()]
    assert [r["recipe"] for r in rows] == chosen.split(",")


def test_fp8_gemm_s_layer_rows_list_one_profiled_step_s_costliest_kernels(tmp_path):
    script = _script("fp8_gemm")
    path = tmp_path / "kernels.jsonl"
    argv = ["--device", "cpu", "--tiny", "--layer", "--no-gemms", "--no-layer-errors"]
    argv += ["--reps", "1", "--recipes", "bf16,fp8_rowwise", "--out", str(path)]
    with megablocks_core.use_backend("reference"):
        assert script.main([*argv, "--kernels", "4"]) == 0
        assert script.main(argv) == 0
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for row in rows[:2]:  # on the CPU, the ops: the costliest first
        times = [k["us"] for k in row["kernels"]]
        assert len(times) == 4 and times == sorted(times, reverse=True) and times[0] > 0
        assert all(k["calls"] >= 1 and k["name"] for k in row["kernels"])
    assert "kernels" not in rows[2] and "kernels" not in rows[3]  # only when asked


def test_fp8_gemm_s_expert_slice_times_the_named_shape_with_more_rows_per_expert(tmp_path):
    script = _script("fp8_gemm")
    path = tmp_path / "slice.jsonl"
    tokens, hidden, ffn, experts, top_k = SHAPES["tiny"]
    argv = ["--device", "cpu", "--tiny", "--layer", "--no-gemms", "--reps", "1", "--out", str(path)]
    seen: list[tuple[int, ...]] = []
    with mock.patch.object(script, "_layer_rows", lambda name, shape, *_: seen.append(shape)):
        assert script.main([*argv, "--experts", str(top_k), "--tokens", "32"]) == 0
    assert seen == [(32, hidden, ffn, top_k, top_k)]
    with megablocks_core.use_backend("reference"):
        assert script.main([*argv, "--experts", str(top_k), "--recipes", "bf16"]) == 0
    (row,) = [json.loads(line) for line in path.read_text().splitlines()]
    assert row["shape"] == f"tiny-T{tokens}-E{top_k}" and row["recipe"] == "bf16"
    with pytest.raises(SystemExit):  # fewer experts than each token picks
        script.main([*argv, "--experts", str(top_k - 1)])


def test_fp8_gemm_s_quantize_rows_time_each_weight_both_ways_beside_two_calls():
    script = _script("fp8_gemm")
    ran: list[Any] = []

    def time_us(fn: Any) -> float:
        ran.append(fn())
        return 1.0

    x, h = torch.randn(4, 8), torch.randn(8, 6)
    w1, w2 = torch.randn(2, 8, 6), torch.randn(2, 6, 8)
    with megablocks_core.use_backend("reference"):
        rows = script.quantize_rows(x, h, w1, w2, time_us)
    names = [(r["quantize"], r["format"]) for r in rows]
    for fmt in FORMAT_NAMES:
        for w in ("w1", "w2"):
            assert (f"{w}-both-ways", fmt) in names and (f"{w}-two-calls", fmt) in names
    both = [r for r in ran if isinstance(r, tuple) and len(r) == 4]
    assert both and all(r[0].shape == (2, 8, 6) or r[0].shape == (2, 6, 8) for r in both)
