"""The quantization passes alone, against their ideal bytes (JSON out): ``ops.quantize`` of the
tokens (T, H), the sorted rows (T * top_k, F), the up weights as the FP8 path reads them (w1
transposed) and the down weights, in every format, at each shape's T (``megablocks_core.shapes``).

The ideal is 3 bytes an element (read bf16, write FP8; the scales are noise) at the copy
bandwidth measured in the same run (a clone of a T * top_k * H * 2-byte buffer). GPU µs per pass:
20 passes between two events, the median of 5. ``--label`` tags the rows (a variant of the
kernel being compared). Usage: ``python benchmarks/quantize_passes.py [--shapes qwen3,dsv3]
[--label NAME] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from typing import Any

import torch

from megablocks_core import ops
from megablocks_core.formats import FORMAT_NAMES
from megablocks_core.shapes import SHAPES


def gpu_us(fn: Callable[[], Any], calls: int = 20) -> float:
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


def rows_of(name: str, label: str) -> list[dict[str, Any]]:
    tokens, hidden, ffn, experts, top_k = SHAPES[name]
    device = torch.device("cuda")
    rows = tokens * top_k
    x = torch.randn(tokens, hidden, device=device).bfloat16()
    w1 = torch.randn(experts, hidden, ffn, device=device).bfloat16()
    h = torch.randn(rows, ffn, device=device).bfloat16()
    w2 = torch.randn(experts, ffn, hidden, device=device).bfloat16()
    buffer = torch.empty(rows * hidden * 2, dtype=torch.uint8, device=device)
    bandwidth = 2 * buffer.numel() / gpu_us(buffer.clone)  # bytes per µs, read + write
    out = []
    for fmt in FORMAT_NAMES:
        for what, tensor, dim in (
            ("tokens", x, 1),
            ("rows", h, 1),
            ("w1-transposed", w1.transpose(1, 2), 2),
            ("w2", w2, 1),
        ):
            us = gpu_us(lambda t=tensor, d=dim, f=fmt: ops.quantize(t, d, f))
            ideal = tensor.numel() * 3 / bandwidth
            row = {"variant": label, "shape": name, "quantize": what, "format": fmt, "us": us,
                   "ideal_us": ideal, "ratio": us / ideal}  # fmt: skip
            print(label, name, what, fmt, round(us, 1), round(us / ideal, 2), flush=True)
            out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="qwen3,dsv3")
    parser.add_argument("--label", default="")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    rows = [row for name in args.shapes.split(",") for row in rows_of(name, args.label)]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
