"""`megablocks bench` on the CPU at a tiny shape: every row present, checked, and the JSON parseable."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
import types
from pathlib import Path

import pytest
import torch

from megablocks_core import cli, use_backend
from megablocks_core.cli import main

bench = cli.load_benchmark()  # benchmarks/bench.py of this checkout


#: host: CUDA only; layer: its rows under the Triton interpreter take half a minute, and the
#: layer item has its own tests below (on the reference backend).
TINY_RUN_OPS = [op for op in bench.OPS if op not in ("host", "layer")]


@pytest.mark.slow
def test_bench_tiny_on_cpu(tmp_path, capsys):
    path = tmp_path / "bench.json"
    argv = ["bench", "--shapes", "tiny", "--ops", ",".join(TINY_RUN_OPS), "--device", "cpu"]
    code = main([*argv, "--quick", "--dtype", "float32", "--json", str(path)])
    out = capsys.readouterr().out
    assert code == 0, out
    data = json.loads(path.read_text())
    rows = data["results"]
    assert {r["op"] for r in rows} == {"copy", *TINY_RUN_OPS}
    ours = [r for r in rows if r["kind"] == "ours"]
    assert {r["op"] for r in ours} == set(TINY_RUN_OPS)
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


def _final_table(out: str) -> list[str]:
    """The lines of the ops table printed at the end (after the rows streamed as measured)."""
    lines = out.splitlines()
    return lines[lines.index(bench.OPS_HEADER) :]


def test_bench_on_the_cpu_defaults_to_the_tiny_shape_and_says_so(capsys):
    code = main(["bench", "--ops", "gather", "--device", "cpu", "--quick", "--no-peers"])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    assert "on the CPU the default shape is tiny" in err and "--shapes mixtral,qwen3,dsv3" in err
    table = _final_table(out)[1:]
    assert {line.split()[0] for line in table if line.strip()} == {"tiny"}
    assert {line.split()[1] for line in table if line.strip()} == {"copy", "gather"}


def test_each_row_is_printed_as_soon_as_it_is_measured(capsys):
    """Every row comes out as a ``result:`` line before the next one is measured (each table's
    header before its first row), the same line as in the tables printed at the end."""
    out_before = []  # stdout so far, taken as each row comes out of the run (before it's printed)

    def measured():
        for r in bench.run(
            ["tiny"], [], ["gather", "layer"], torch.device("cpu"), torch.float32,
            quick=True, peers=False, log=lambda _: None, layer_experts=["mlp"],
        ):  # fmt: skip
            out_before.append(capsys.readouterr().out)
            yield r

    with use_backend("reference"):  # the streaming is under test, not the interpreter
        results = list(bench.stream(measured()))
    per_row = [*out_before[1:], capsys.readouterr().out]  # what each row printed
    assert out_before[0] == ""
    ops = [r for r in results if r.layer is None]
    layers = [r for r in results if r.layer is not None]
    assert [r.op for r in ops] == ["copy"] + ["gather"] * (len(ops) - 1) and len(ops) >= 2
    assert [r.provider for r in layers] == [
        bench.OUR_LAYER,
        bench.OUR_UNFUSED_LAYER,
        bench.OUR_ACCUMULATION_FUSED_LAYER,
    ]
    table = bench.format_table(results).splitlines()
    ops_rows = table[1 : 1 + len(ops)]
    layer_rows = table[table.index(bench.LAYER_HEADER) + 1 :]
    want = [[bench.OPS_HEADER, ops_rows[0]], *([row] for row in ops_rows[1:])]
    want += [[bench.LAYER_HEADER, layer_rows[0]], *([row] for row in layer_rows[1:])]
    assert per_row == ["".join(f"{bench.STREAMED}{line}\n" for line in lines) for lines in want]


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


# --- the layer item ---------------------------------------------------------------------------

LAYER_FIELDS = {
    "experts",
    "step_ms",
    "fwd_ms",
    "floor_ms",
    "fwd_floor_ms",
    "efficiency",
    "fwd_efficiency",
    "activation_mib",
    "peak_mib",
    "step_vs_megablocks",
    "fwd_vs_megablocks",
    "activation_vs_megablocks",
    "peak_vs_megablocks",
    "cold_floor_ms",
    "floor_after_ms",
}


def _run_layer(device="cpu", dtype=torch.float32, kinds=("mlp", "glu"), shape="tiny"):
    # The reference backend: the layer item's machinery is under test, not the Triton interpreter.
    with use_backend("reference"):
        return list(
            bench.run(
                [shape],
                [],
                ["layer"],
                torch.device(device),
                dtype,
                quick=True,
                log=lambda _: None,
                layer_experts=list(kinds),
            )
        )


@pytest.mark.parametrize("glu", [False, True])
@pytest.mark.parametrize("shape", [(64, 32, 48, 2), (16384, 7168, 2048, 8), (7, 5, 3, 1)])
def test_expert_gemms_are_forward_dgrad_and_wgrad_of_each_expert_matrix(glu, shape):
    tokens, hidden, ffn, top_k = shape
    rows = tokens * top_k
    # Independently: a matrix (fan_in, fan_out) applied to `rows` rows costs its forward
    # (rows, fan_out, fan_in), its dgrad (rows, fan_in, fan_out), its wgrad (fan_in, fan_out, rows).
    matrices = [(hidden, ffn)] * (2 if glu else 1) + [(ffn, hidden)]
    want_forward = sorted((rows, o, i) for i, o in matrices)
    want_all = sorted(
        [(rows, o, i) for i, o in matrices]
        + [(rows, i, o) for i, o in matrices]
        + [(i, o, rows) for i, o in matrices]
    )
    gemms = bench.expert_gemms(tokens, hidden, ffn, top_k, glu)
    assert len(gemms) == (9 if glu else 6)
    assert sorted(mnk for _, mnk in gemms) == want_all
    assert sorted(mnk for name, mnk in gemms if name.endswith(" forward")) == want_forward
    flops = sum(2 * m * n * k for _, (m, n, k) in gemms)
    assert flops == (9 if glu else 6) * 2 * rows * hidden * ffn


@pytest.mark.parametrize("glu", [False, True])
def test_the_floor_runs_each_expert_gemm_as_a_dense_matmul(glu):
    tokens, hidden, ffn, top_k = 10, 6, 14, 3
    gemms = bench.expert_gemms(tokens, hidden, ffn, top_k, glu)
    dense = bench.DenseGemms(gemms, torch.device("cpu"), torch.float64)
    shapes = lambda products: [(a.shape[0], b.shape[1], a.shape[1]) for a, b, _ in products]  # noqa: E731
    assert shapes(dense.step_products) == [mnk for _, mnk in gemms]
    assert shapes(dense.forward_products) == [mnk for n, mnk in gemms if n.endswith(" forward")]
    assert len(dense.forward_products) == (3 if glu else 2)
    for _, _, out in dense.step_products:
        out.fill_(math.nan)
    dense.forward()
    for a, b, out in dense.forward_products:
        assert torch.equal(out, a @ b)
    dense.step()
    for a, b, out in dense.step_products:
        assert torch.equal(out, a @ b)


def test_the_layer_timer_alternates_the_functions_it_times():
    calls = []
    timer = bench._layer_timer(torch.device("cpu"), quick=False)
    times = timer([lambda: calls.append("layer"), lambda: calls.append("dense")], 2)
    assert calls == ["layer", "dense"] * (2 + 5)  # warm-up rounds, then 5 timed rounds
    assert len(times) == 2 and all(t >= 0 for t in times)


def test_every_layer_row_of_a_shape_is_compared_with_one_floor():
    results = [r for r in _run_layer() if r.op == "layer"]
    for kind in ("mlp", "glu"):
        rows = [r.layer for r in results if r.layer.experts == kind]
        assert len(rows) == 3
        assert len({f.floor_ms for f in rows}) == 1 and len({f.fwd_floor_ms for f in rows}) == 1
        assert (
            len({f.cold_floor_ms for f in rows}) == 1 and len({f.floor_after_ms for f in rows}) == 1
        )
        assert all(f.cold_floor_ms > 0 and f.floor_after_ms > 0 for f in rows)


def test_layer_item_on_the_cpu_reports_times_and_floor_and_no_memory():
    results = _run_layer()
    assert [r.op for r in results] == ["copy"] + ["layer"] * 6
    for variant in (bench.OUR_UNFUSED_LAYER, bench.OUR_ACCUMULATION_FUSED_LAYER):
        rows = [r for r in results if r.provider == variant]
        assert [r.layer.experts for r in rows] == ["mlp", "glu"]
        assert all(r.check == "ok" and r.kind == "ours" and r.layer.step_ms > 0 for r in rows)
    mlp, glu = (r for r in results if r.provider == bench.OUR_LAYER)
    tokens, hidden, ffn, _, top_k = bench.SHAPES["tiny"]
    for row, kind, gemms in ((mlp, "mlp", 6), (glu, "glu", 9)):
        figures = row.layer
        assert row.provider == bench.OUR_LAYER and row.kind == "ours" and row.check == "ok"
        assert figures.experts == kind
        assert figures.step_ms > 0 and figures.fwd_ms > 0
        assert figures.floor_ms > 0 and figures.fwd_floor_ms > 0
        assert figures.efficiency == pytest.approx(figures.floor_ms / figures.step_ms)
        assert figures.fwd_efficiency == pytest.approx(figures.fwd_floor_ms / figures.fwd_ms)
        assert figures.activation_mib is None and figures.peak_mib is None and row.peak_mb is None
        assert figures.step_vs_megablocks is None  # no MegaBlocks on the CPU
        assert row.us == pytest.approx(figures.step_ms * 1e3)
        assert row.vs_limit == pytest.approx(figures.step_ms / figures.floor_ms)
        flops = gemms * 2 * tokens * top_k * hidden * ffn
        assert row.unit == "TFLOP/s"
        assert row.rate == pytest.approx(flops / (figures.step_ms * 1e-3) / 1e12)


def test_layer_item_json_and_table(tmp_path, capsys):
    path = tmp_path / "bench.json"
    argv = ["bench", "--ops", "gather,layer", "--layer-experts", "glu", "--device", "cpu"]
    argv += ["--quick", "--dtype", "float32", "--no-peers", "--json", str(path)]
    with use_backend("reference"):
        code = main(argv)
    out = capsys.readouterr().out
    assert code == 0, out
    data = json.loads(path.read_text())
    assert data["meta"]["layer_experts"] == ["glu"]
    variants = (bench.OUR_UNFUSED_LAYER, bench.OUR_ACCUMULATION_FUSED_LAYER)
    by_op = {r["op"]: r for r in data["results"] if r["provider"] not in variants}
    # Other ops' rows keep their fields; only layer rows carry the layer object.
    common = {"shape", "op", "provider", "kind", "us", "rate", "unit", "vs_limit", "check"}
    assert set(by_op["gather"]) == common | {"peak_mb"}
    layer = by_op["layer"]
    assert set(layer) == common | {"peak_mb", "layer"}
    assert set(layer["layer"]) == LAYER_FIELDS
    assert layer["layer"]["experts"] == "glu" and layer["layer"]["activation_mib"] is None
    lines = _final_table(out)
    header = lines.index(next(line for line in lines if line.startswith("layer ")))
    assert "step ms" in lines[header] and "peak MiB" in lines[header]
    row = lines[header + 1].split()
    assert row[:5] == ["tiny", "glu", "megablocks-core", "dMoE", "ours"]
    assert float(row[5]) == pytest.approx(layer["layer"]["step_ms"], rel=1e-3, abs=1e-3)
    assert row[-1] == "ok" and row.count("-") == 6  # two memory fields, four ratios
    # The ops table above it is unchanged in form: a layer row never appears there.
    assert {line.split()[1] for line in lines[1:header] if line.strip()} == {"copy", "gather"}


def test_layer_experts_must_be_known(capsys):
    argv = ["bench", "--ops", "layer", "--layer-experts", "swiglu", "--device", "cpu"]
    assert main(argv) == 2
    assert "unknown --layer-experts ['swiglu']; known: mlp, glu" in capsys.readouterr().err


class _FakeMegaBlocksLayer(torch.nn.Module):
    """Stands in for MegaBlocks' dMoE: (T, 1, H) → (T, 1, H), one weight."""

    def __init__(self, args):
        super().__init__()
        if args.mlp_type == "glu" and args.hidden_size == 32:
            raise RuntimeError("this fake rejects GLU")
        self.w = torch.nn.Parameter(torch.eye(args.hidden_size))

    def forward(self, x):
        return x @ self.w


def test_megablocks_rows_ratios_and_failures(monkeypatch, capsys):
    seen = []

    def arguments(**kwargs):
        seen.append(kwargs)
        return types.SimpleNamespace(**kwargs)

    fake = (
        types.SimpleNamespace(dMoE=_FakeMegaBlocksLayer),
        types.SimpleNamespace(Arguments=arguments),
    )
    monkeypatch.setattr(bench, "_megablocks_layer_modules", lambda device: fake)
    results = _run_layer()
    variants = (bench.OUR_UNFUSED_LAYER, bench.OUR_ACCUMULATION_FUSED_LAYER)
    results = [r for r in results if r.provider not in variants]
    assert [(r.provider, r.layer.experts) for r in results[1:]] == [
        (bench.OUR_LAYER, "mlp"),
        (bench.MEGABLOCKS_LAYER, "mlp"),
        (bench.OUR_LAYER, "glu"),
        (bench.MEGABLOCKS_LAYER, "glu"),
    ]
    assert [(k["mlp_type"], k["mlp_impl"], k["moe_top_k"]) for k in seen] == [
        ("mlp", "grouped", 2),
        ("glu", "grouped", 2),
    ]
    ours_mlp, mb_mlp, ours_glu, mb_glu = results[1:]
    assert mb_mlp.kind == "peer" and mb_mlp.check == "n/a" and mb_mlp.layer.step_ms > 0
    assert ours_mlp.layer.step_vs_megablocks == pytest.approx(
        ours_mlp.layer.step_ms / mb_mlp.layer.step_ms
    )
    assert ours_mlp.layer.fwd_vs_megablocks == pytest.approx(
        ours_mlp.layer.fwd_ms / mb_mlp.layer.fwd_ms
    )
    assert ours_mlp.layer.activation_vs_megablocks is None  # no memory figures on the CPU
    assert mb_mlp.layer.step_vs_megablocks is None  # ratios live on our rows
    # A peer that fails is a row with the error; ours keeps no ratio.
    assert mb_glu.check.startswith("error: RuntimeError: this fake rejects GLU")
    assert math.isnan(mb_glu.layer.step_ms) and math.isnan(mb_glu.layer.efficiency)
    assert (
        mb_glu.layer.floor_ms == ours_glu.layer.floor_ms
    )  # the floor is the shape's, not the row's
    assert ours_glu.check == "ok" and ours_glu.layer.step_vs_megablocks is None
    table = bench.format_table(results)
    ours_line = next(
        line for line in table.splitlines() if line.startswith("tiny     mlp     mega")
    )
    assert f"{ours_mlp.layer.step_vs_megablocks:.2f}x" in ours_line


def test_megablocks_ratios_are_ours_over_theirs():
    def figures(step, fwd, act, peak):
        return bench.LayerFigures("mlp", step, fwd, 1.0, 0.5, 1 / step, 0.5 / fwd, act, peak)

    ours, theirs = figures(30.0, 10.0, 2048.0, 4096.0), figures(40.0, 8.0, 1024.0, None)
    bench.add_megablocks_ratios(ours, theirs)
    assert ours.step_vs_megablocks == 0.75 and ours.fwd_vs_megablocks == 1.25
    assert ours.activation_vs_megablocks == 2.0 and ours.peak_vs_megablocks is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_layer_item_memory_on_cuda():
    results = _run_layer(device="cuda", dtype=torch.bfloat16)
    tokens, hidden, *_ = bench.SHAPES["tiny"]
    output_mib = tokens * hidden * 2 / 2**20
    for row in results[1:]:
        figures = row.layer
        assert row.check == "ok", row
        # The forward holds at least its output; the step's peak includes the forward's end state.
        assert figures.activation_mib >= output_mib
        assert figures.peak_mib >= figures.activation_mib
        assert row.peak_mb == figures.peak_mib


def test_host_item_needs_cuda_and_says_so():
    said = []
    rows = list(
        bench.run(["tiny"], [], ["host"], torch.device("cpu"), torch.float32, log=said.append)
    )
    assert rows == [] and any("needs a CUDA device" in s for s in said)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_host_item_on_cuda_times_every_case_eager_and_in_a_graph():
    rows = list(
        bench.run(
            ["tiny"], [], ["host"], torch.device("cuda"), torch.bfloat16, quick=True, peers=False
        )
    )
    ours = {(r.shape, r.op, r.provider): r for r in rows if r.kind == "ours"}
    for tokens in bench.HOST_TOKENS:
        for op in ("sort", "route", "router_topk", "gather", "scatter", "gmm", "dmoe_forward"):
            eager = ours[(f"tiny:{tokens}", op, "ours")]
            graph = ours[(f"tiny:{tokens}", op, "ours (CUDA graph)")]
            assert eager.us > 0 and graph.us > 0 and eager.check == "ok", (eager, graph)
    assert all(r.vs_megablocks is None for r in rows)  # no peers asked for


def _step_profile():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "step_profile.py"
    spec = importlib.util.spec_from_file_location("step_profile", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_step_profile_sorts_kernels_into_the_layers_parts():
    part_of = _step_profile().part_of
    names = {  # kernel names from an H200 profile of the layer's step
        "_gmm_kernel": "expert GEMMs",
        "_gmm_wgrad_kernel": "weight gradients",
        "_wgrad_kernel": "top-k weights' gradient",
        "_gather_kernel": "permutation",
        "_scatter_kernel": "permutation",
        "_counting_scatter_kernel": "routing",
        "_router_topk_kernel": "routing",
        "_activation_backward_kernel": "activations",
        "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)": "communication",
        "ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL": "communication",
        "void at::native::vectorized_elementwise_kernel<8, at::native::GeluCUDAKernelImpl": (
            "activations"
        ),
        "nvjet_sm90_tss_128x128_64x6_1x2_h_bz_TNT": "dense GEMMs",
        "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda": (
            "copies"
        ),
        "void at::native::reduce_kernel<512, 1>": "other",
        "_scaled_gmm_kernel": "expert GEMMs",
        "_quantize_kernel": "quantization",
    }
    assert {name: part_of(name) for name in names} == names


@pytest.mark.parametrize("harness", ["upstream gradient", "float loss"])
def test_step_profile_runs_on_the_cpu(tmp_path, capsys, harness):
    out = tmp_path / "profile.json"
    flags = ["--float-loss"] if harness == "float loss" else []
    with use_backend("reference"):  # the profile's bookkeeping is under test, not the interpreter
        result = _step_profile().main(
            ["--shape", "tiny", "--steps", "1", "--warmup", "1", "--json", str(out), *flags]
        )
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert result["harness"] == harness
    # Only the float loss squares the output: the default step runs the layer's own work.
    squares = [name for name in result["kernels"] if "pow" in name or "square" in name]
    assert bool(squares) == (harness == "float loss"), squares
    assert result["step_ms"] > 0 and result["busy_ms"] > 0
    assert sum(result["parts_ms"].values()) == pytest.approx(result["busy_ms"])
    assert sum(k["ms"] for k in result["kernels"].values()) == pytest.approx(result["busy_ms"])
    assert "step" in capsys.readouterr().out


def test_step_profile_gather_first_takes_fp8_and_restores_the_switch():
    pytest.importorskip("megablocks_triton")
    from megablocks_triton import scaled

    module = _step_profile()
    with pytest.raises(SystemExit):
        module.parse_args(["--gather-first", "on"])
    with pytest.raises(SystemExit):
        module.parse_args(["--fp8", "fp8_rowwise", "--gather-first"])
    default = scaled.GATHER_FIRST
    for setting, expected in ((None, default), ("on", True), ("off", False)):
        argv = ["--shape", "tiny", "--steps", "1", "--warmup", "0", "--fp8", "fp8_rowwise"]
        with use_backend("reference"):
            result = module.main(argv + (["--gather-first", setting] if setting else []))
        assert result["gather_first"] is expected and scaled.GATHER_FIRST is default
