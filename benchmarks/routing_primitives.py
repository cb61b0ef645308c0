"""Routing primitives per backend on one GPU: the evidence for the cuda/triton priorities.

For each benchmark shape and each installed GPU backend (and MegaBlocks' CUDA ops when
importable) it checks sort, histogram, inclusive_cumsum, exclusive_cumsum and topology against
the reference backend, then times each alone and the routing metadata sequence MegaBlocks runs
(sort(end_bit) + histogram + inclusive_cumsum + round_up + inclusive_cumsum), as GPU time of
CUDA-graph replays (launch costs excluded; a backend that syncs the host cannot be captured).

Usage: ``python benchmarks/routing_primitives.py --json out.json [--shapes mixtral,qwen3,dsv3]``
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

import torch
from bench import BLOCK  # benchmarks/bench.py (this script's directory is on sys.path)
from triton.testing import do_bench

import megablocks_core as mb
from megablocks_core import ops
from megablocks_core.shapes import SHAPES

PRIMITIVES = ("sort", "histogram", "inclusive_cumsum", "exclusive_cumsum", "topology", "sequence")


def graph_us(fn: Callable[[], Any]) -> float:
    """Median GPU time of one call, replayed from a CUDA graph of 20 calls."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(20):
            fn()
    return do_bench(graph.replay, return_mode="median") * 1e3 / 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="mixtral,qwen3,dsv3")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    try:
        import megablocks.ops as mbops
    except ImportError:
        mbops = None
    rows = []
    for name in args.shapes.split(","):
        tokens, _, _, experts, top_k = SHAPES[name]
        gen = torch.Generator(device="cuda").manual_seed(0)
        top = torch.topk(torch.randn(tokens, experts, device="cuda", generator=gen), top_k).indices
        x = top.flatten().int()
        end_bit = max((experts - 1).bit_length(), 1)
        counts = torch.bincount(x, minlength=experts).int()
        padded_bins = ops.inclusive_cumsum(ops.round_up(counts, BLOCK), 0)
        blocks = int(padded_bins[-1]) // BLOCK

        def calls(
            o: Any,
            x: torch.Tensor = x,
            end_bit: int = end_bit,
            experts: int = experts,
            counts: torch.Tensor = counts,
            padded_bins: torch.Tensor = padded_bins,
            blocks: int = blocks,
        ) -> dict[str, Callable[[], Any]]:
            return {
                "sort": lambda: o.sort(x, end_bit),
                "histogram": lambda: o.histogram(x, experts),
                "inclusive_cumsum": lambda: o.inclusive_cumsum(counts, 0),
                "exclusive_cumsum": lambda: o.exclusive_cumsum(counts, 0),
                "topology": lambda: o.topology(padded_bins, BLOCK, blocks, experts),
                "sequence": lambda: (
                    o.sort(x, end_bit),
                    o.inclusive_cumsum(o.histogram(x, experts), 0),
                    o.inclusive_cumsum(o.round_up(o.histogram(x, experts), BLOCK), 0),
                ),
            }

        # topology (E block columns here) has int16 column indices: E x E must fit (not at E=256).
        skip = set() if experts * experts <= 32768 else {"topology"}
        with mb.use_backend("reference"):
            want = {p: fn() for p, fn in calls(ops).items() if p not in skip | {"sequence"}}
        providers: dict[str, Any] = {b: b for b in ("cuda", "triton") if b in mb.registry().plugins}
        if mbops is not None:
            providers["megablocks"] = mbops
        for label, target in providers.items():
            for prim in PRIMITIVES:
                if prim in skip or (prim == "topology" and label == "megablocks"):
                    continue  # MegaBlocks' topology takes other arguments (its sparse path)
                if isinstance(target, str):
                    fn = calls(ops)[prim]
                    scope: Any = mb.use_backend(target)
                else:
                    fn = calls(target)[prim]
                    scope = torch.no_grad()
                with scope:
                    got = fn()
                    ok = "n/a"
                    if prim in want:
                        pairs = (
                            zip(got, want[prim], strict=True)
                            if isinstance(got, tuple)
                            else [(got, want[prim])]
                        )
                        ok = (
                            "ok"
                            if all(torch.equal(g.long(), w.long()) for g, w in pairs)
                            else "MISMATCH"
                        )
                    try:
                        us = graph_us(fn)
                    except RuntimeError as exc:  # a host sync cannot be captured
                        us, ok = float("nan"), f"{ok}; not capturable: {str(exc)[:80]}"
                row = {"shape": name, "provider": label, "op": prim, "graph_us": us, "check": ok}
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows},
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
