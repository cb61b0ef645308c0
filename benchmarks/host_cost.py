"""Host time per eager call beside GPU time, for the small-batch regime (JSON lines out).

For each op at a decode-sized shape (default T=128 tokens, H=2048, F=768, E=128, top_k=8,
qwen3 widths; ``--tokens 1 16 128`` for several, the case names then end in ``_T<tokens>``),
the forward grouped GEMMs the dMoE layer calls (``gather_gmm``, ``gmm`` and ``gmm_scatter`` with
device counts, bf16) included, it reports:

* ``host_us``: wall time per call of N back-to-back eager calls without a sync in between
  (what the Python side costs while the GPU keeps up; the GPU work is a few µs);
* ``gpu_us``: time per replay of the same call captured in a CUDA graph (no host work);

the dMoE layer's forward (``--layer``) at T = 1, 16, 128: eager and CUDA-graph µs; and
(``--gmm``) ``ops.gmm``'s eager time with CPU counts beside device counts at the benchmark shapes.

When MegaBlocks is importable (built from ``.peers/`` by ``benchmarks/gpu_session.sh``) the same
run times its ops on the same inputs (``megablocks_<op>`` rows: sort, histogram, the cumsums,
gather, scatter, and its ``route`` equivalent sort + histogram + inclusive_cumsum) and its dMoE's
forward (``megablocks_dmoe_forward_T<tokens>``, grouped MLP, eval, no grad); each of our rows
then carries ``vs_megablocks`` = our host µs / MegaBlocks' (the machines are noisy: only ratios
within one run compare).

    python benchmarks/host_cost.py [--tokens 128 ...] [--calls 2000] [--layer] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import torch


def host_us(fn: Callable[[], Any], calls: int) -> float:
    """Host µs per call: best of 3 runs of ``calls`` back-to-back calls without a sync."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        elapsed = time.perf_counter() - start
        torch.cuda.synchronize()
        best = min(best, elapsed / calls * 1e6)
    return best


def graph_us(fn: Callable[[], Any], replays: int = 200) -> float:
    """GPU µs per replay of one call captured in a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays * 1e3


def op_cases(tokens: int, hidden: int, experts: int, top_k: int) -> dict[str, Callable[[], Any]]:
    from megablocks_core import ops

    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(tokens, experts, device="cuda", generator=gen)
    weights, top = torch.topk(logits.softmax(-1), top_k)
    top = top.flatten().int()
    weights = weights.flatten().to(torch.bfloat16)
    end_bit = max((experts - 1).bit_length(), 1)
    bin_ids, indices = ops.sort(top, end_bit)
    counts = ops.histogram(top, experts)
    bins = ops.inclusive_cumsum(counts, 0)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
    rows = ops.gather(x, indices, bin_ids, bins, top_k)
    cases: dict[str, Callable[[], Any]] = {
        "sort": lambda: ops.sort(top, end_bit),
        "histogram": lambda: ops.histogram(top, experts),
        "inclusive_cumsum": lambda: ops.inclusive_cumsum(counts, 0),
        "exclusive_cumsum": lambda: ops.exclusive_cumsum(counts, 0),
        "route": lambda: ops.route(top, experts, 128),
        "router_topk": lambda: ops.router_topk(logits, top_k, True),
        "gather": lambda: ops.gather(x, indices, bin_ids, bins, top_k),
        "scatter": lambda: ops.scatter(rows, indices, bin_ids, weights, bins, top_k),
    }
    mb = _megablocks("megablocks.ops")
    if mb is not None:

        def mb_route() -> Any:  # what a MegaBlocks layer calls for the metadata route returns
            mb_bins, mb_indices = mb.sort(top, end_bit)
            return mb_bins, mb_indices, mb.inclusive_cumsum(mb.histogram(top, experts), 0)

        cases.update(
            {
                "megablocks_sort": lambda: mb.sort(top, end_bit),
                "megablocks_histogram": lambda: mb.histogram(top, experts),
                "megablocks_inclusive_cumsum": lambda: mb.inclusive_cumsum(counts, 0),
                "megablocks_exclusive_cumsum": lambda: mb.exclusive_cumsum(counts, 0),
                "megablocks_route": mb_route,
                # MegaBlocks' router: softmax, torch.topk (its expert_weights, expert_indices)
                "megablocks_router_topk": lambda: torch.topk(logits.softmax(-1), top_k, dim=-1),
                "megablocks_gather": lambda: mb.gather(x, indices, bin_ids, bins, top_k),
                "megablocks_scatter": lambda: mb.scatter(
                    rows, indices, bin_ids, weights, bins, top_k
                ),
            }
        )
    return cases


def _megablocks(module: str) -> Any:
    """A MegaBlocks module, or None when MegaBlocks is not installed (or fails to import)."""
    try:
        import importlib

        return importlib.import_module(module)
    except Exception:
        return None


def grouped_gemm_cases(
    tokens: int, hidden: int, ffn: int, experts: int, top_k: int
) -> dict[str, Callable[[], Any]]:
    """The dMoE layer's grouped GEMMs at a decode-sized shape (bf16, routing from ``ops.route``,
    counts on the device): ``gather_gmm`` (x by w1), ``gmm`` and ``gmm_scatter`` (rows by w2)."""
    from megablocks_core import ops

    gen = torch.Generator(device="cuda").manual_seed(1)
    logits = torch.randn(tokens, experts, device="cuda", generator=gen)
    weights, top = torch.topk(logits.softmax(-1), top_k)
    weights = weights.flatten().to(torch.bfloat16)
    indices, bin_ids, counts, bins, _ = ops.route(top.flatten().int(), experts, 128)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
    w1 = torch.randn(experts, hidden, ffn, device="cuda", dtype=torch.bfloat16, generator=gen)
    w2 = torch.randn(experts, ffn, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
    h = torch.randn(tokens * top_k, ffn, device="cuda", dtype=torch.bfloat16, generator=gen)
    return {
        "gather_gmm": lambda: ops.gather_gmm(x, w1, indices, bin_ids, bins, top_k),
        "gmm": lambda: ops.gmm(h, w2, counts),
        "gmm_scatter": lambda: ops.gmm_scatter(h, w2, indices, bin_ids, weights, bins, top_k),
    }


def gmm_cases() -> dict[str, Callable[[], Any]]:
    """``ops.gmm`` forward at the three benchmark shapes, counts on the CPU vs on the device
    (eager: a CPU count tensor must reach the GPU without stalling the stream)."""
    from megablocks_core import ops

    shapes = {
        "mixtral": (16384, 4096, 14336, 8, 2),
        "qwen3": (16384, 2048, 768, 128, 8),
        "dsv3": (16384, 7168, 2048, 256, 8),
    }
    cases: dict[str, Callable[[], Any]] = {}
    for name, (tokens, hidden, ffn, experts, top_k) in shapes.items():
        rows = tokens * top_k
        counts = torch.full((experts,), rows // experts, dtype=torch.int64)
        counts[0] += rows - int(counts.sum())
        a = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(experts, hidden, ffn, device="cuda", dtype=torch.bfloat16) * 0.02
        device_counts = counts.cuda()
        cases[f"gmm_{name}_cpu_counts"] = lambda a=a, b=b, c=counts: ops.gmm(a, b, c)
        cases[f"gmm_{name}_device_counts"] = lambda a=a, b=b, c=device_counts: ops.gmm(a, b, c)
    return cases


def _eager_us(fn: Callable[[], Any], calls: int = 20) -> float:
    """µs per call of back-to-back eager calls, synchronised at the end (GPU-bound work)."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def layer_cases(
    hidden: int, ffn: int, experts: int, top_k: int, token_counts: tuple[int, ...] = (1, 16, 128)
) -> dict[str, Callable[[], Any]]:
    try:
        from megablocks_core.layers import dMoE
    except ImportError:
        from megablocks_core.moe import dMoE  # type: ignore[no-redef]

    layer = dMoE(hidden_size=hidden, ffn_hidden_size=ffn, num_experts=experts, top_k=top_k).to(
        device="cuda", dtype=torch.bfloat16
    )
    layer.eval()
    cases: dict[str, Callable[[], Any]] = {}
    for tokens in token_counts:
        x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)

        def forward(x: torch.Tensor = x) -> Any:
            with torch.no_grad():
                return layer(x)

        cases[f"dmoe_forward_T{tokens}"] = forward
    dmoe, arguments = (
        _megablocks("megablocks.layers.dmoe"),
        _megablocks("megablocks.layers.arguments"),
    )
    if dmoe is None or arguments is None:
        return cases
    try:  # MegaBlocks' grouped dMoE also needs the grouped_gemm package
        theirs = dmoe.dMoE(
            arguments.Arguments(
                hidden_size=hidden,
                ffn_hidden_size=ffn,
                moe_num_experts=experts,
                moe_top_k=top_k,
                mlp_impl="grouped",
                mlp_type="mlp",
                bias=False,
                return_bias=False,
                moe_loss_weight=0.0,
                bf16=True,
                fp16=False,  # MegaBlocks' Arguments default to fp16
                device=torch.device("cuda"),
            )
        )
    except Exception as exc:
        print(f"MegaBlocks' dMoE not measured: {type(exc).__name__}: {exc}", file=sys.stderr)
        return cases
    theirs.eval()
    for tokens in token_counts:
        x = torch.randn(tokens, 1, hidden, device="cuda", dtype=torch.bfloat16)

        def mb_forward(x: torch.Tensor = x) -> Any:
            with torch.no_grad():
                return theirs(x)

        cases[f"megablocks_dmoe_forward_T{tokens}"] = mb_forward
    return cases


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[128])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=768)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--layer", action="store_true", help="also the dMoE layer's forward")
    parser.add_argument(
        "--gmm",
        action="store_true",
        help="also ops.gmm eager time with CPU vs device counts (large shapes)",
    )
    parser.add_argument("--json", help="append JSON lines here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("host_cost.py: needs a CUDA/ROCm GPU", file=sys.stderr)
        return 2
    cases: dict[str, Callable[[], Any]] = {}
    for tokens in args.tokens:
        suffix = f"_T{tokens}" if len(args.tokens) > 1 else ""
        shaped = {
            **op_cases(tokens, args.hidden, args.experts, args.top_k),
            **grouped_gemm_cases(tokens, args.hidden, args.ffn, args.experts, args.top_k),
        }
        cases.update({name + suffix: fn for name, fn in shaped.items()})
    if args.layer:
        cases.update(layer_cases(args.hidden, args.ffn, args.experts, args.top_k))
    rows: list[dict[str, Any]] = []
    if args.gmm:
        for name, fn in gmm_cases().items():
            rows.append({"case": name, "eager_us": round(_eager_us(fn), 1)})
            print(f"{name:30s} eager {rows[-1]['eager_us']:9.1f} µs", flush=True)
        torch.cuda.empty_cache()
    for name, fn in cases.items():
        calls = args.calls if not name.startswith("dmoe") else max(args.calls // 10, 50)
        row: dict[str, Any] = {"case": name, "host_us": round(host_us(fn, calls), 2)}
        try:
            row["gpu_us"] = round(graph_us(fn), 2)
        except Exception:  # e.g. a peer that syncs the host cannot be captured
            row["gpu_us"] = None
        gpu = "n/a" if row["gpu_us"] is None else f"{row['gpu_us']:8.1f}"
        print(f"{name:32s} host {row['host_us']:8.1f} µs   gpu {gpu} µs", flush=True)
        rows.append(row)
    host = {row["case"]: row["host_us"] for row in rows if "host_us" in row}
    for row in rows:
        theirs = host.get(f"megablocks_{row['case']}")
        if theirs:
            row["vs_megablocks"] = round(row["host_us"] / theirs, 2)
            print(f"{row['case']:32s} host vs MegaBlocks {row['vs_megablocks']:.2f}", flush=True)
    if args.json:
        with open(args.json, "a") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
