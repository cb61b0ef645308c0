"""The quantization passes alone, against their ideal bytes (JSON out): ``ops.quantize`` of the
tokens (T, H), the sorted rows (T * top_k, F), the up weights as the FP8 path reads them (w1
transposed) and the down weights, in every format, at each shape's T (``megablocks_core.shapes``).

``fp8_gemm.quantize_rows`` (its rows, timed alone): the ideal is 3 bytes an element (read bf16,
write FP8; the scales are noise) at the copy bandwidth measured in the same run. GPU µs per pass:
20 passes between two events, the median of 5. Issued one by one, a pass shorter than its host
time measures the host; ``--graphs`` replays the 20 passes as one CUDA graph instead, which is
the device's time alone (the copy that gives the bandwidth is timed as usual: 20 clones in a graph
gave 17 % less bandwidth on an H100). ``--label`` tags the rows (a variant of the kernel
being compared). Usage: ``python benchmarks/quantize_passes.py [--shapes qwen3,dsv3] [--graphs]
[--label NAME] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from typing import Any

import torch
from fp8_gemm import quantize_rows  # benchmarks/fp8_gemm.py (this script's directory)
from token_gmm_scatter import device_us  # 20 calls in one CUDA graph, the median replay

from megablocks_core.shapes import SHAPES


def gpu_us(fn: Callable[[], Any], calls: int = 20) -> float:
    """µs per call of ``fn``, issued ``calls`` times between two events."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def rows_of(name: str, label: str, graphs: bool = False) -> list[dict[str, Any]]:
    tokens, hidden, ffn, experts, top_k = SHAPES[name]
    device = torch.device("cuda")
    rows = tokens * top_k
    x = torch.randn(tokens, hidden, device=device).bfloat16()
    w1 = torch.randn(experts, hidden, ffn, device=device).bfloat16()
    h = torch.randn(rows, ffn, device=device).bfloat16()
    w2 = torch.randn(experts, ffn, hidden, device=device).bfloat16()
    out = []
    timing = "graph" if graphs else "events"
    for row in quantize_rows(x, h, w1, w2, device_us if graphs else gpu_us, copy_us=gpu_us):
        out.append({"variant": label, "shape": name, "timing": timing, **row})
        print(label, timing, name, row["quantize"], row["format"], round(row["us"], 1),
              round(row["ratio"], 2), flush=True)  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="qwen3,dsv3")
    parser.add_argument("--label", default="")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument(
        "--graphs", action="store_true", help="time each pass in a CUDA graph (no host time)"
    )
    args = parser.parse_args(argv)
    rows = [
        row for name in args.shapes.split(",") for row in rows_of(name, args.label, args.graphs)
    ]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
