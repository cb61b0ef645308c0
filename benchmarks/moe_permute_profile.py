"""Where a moe_permute forward's time goes: each form through ``megablocks_core.ops``, op by op.

For each form (the mask and index maps, with probs, padded to 128 with a static bound; the map
build alone; the permute alone) at a shape's (T, H, E, K): the call's time as
``benchmarks/megatron_permute.py`` times it (``do_bench``, median, µs), the device time of each
kernel it launches (``torch.profiler``, averaged over 20 calls), the host time to issue one call
(the GPU idle before it), and the ideal-bytes limit (the tokens read and the permuted rows
written once, at the bandwidth of a device copy measured in the same run). A call much slower
than its kernels' sum is waiting on the host. The last form, a memset of the permuted rows,
times their writes alone (most of the bytes).

Usage: ``python benchmarks/moe_permute_profile.py [--shapes mixtral,qwen3,dsv3] [--json PATH]``
(CUDA; ``--device cpu --tokens 64`` is a smoke run: no kernel times there).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

import megablocks_core.ops as ops
from megablocks_core.shapes import SHAPES

#: Calls profiled per form (the kernels' device times are their average).
PROFILED_CALLS = 20
PAD = 128


def _timer(device: torch.device) -> Callable[[Callable[[], Any]], float]:
    if device.type == "cuda":
        from triton.testing import do_bench

        return lambda fn: float(do_bench(fn, warmup=25, rep=200, return_mode="median")) * 1e3
    return lambda fn: _host_us(fn, device, calls=3)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _host_us(fn: Callable[[], Any], device: torch.device, calls: int = 50) -> float:
    """Median time to issue one call with the device idle before it."""
    fn()
    samples = []
    for _ in range(calls):
        _sync(device)
        began = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - began) * 1e6)
    _sync(device)
    return statistics.median(samples)


def _kernels(fn: Callable[[], Any], device: torch.device) -> dict[str, float]:
    """Device µs per call of each kernel the call launches (none on the CPU)."""
    if device.type != "cuda":
        return {}
    from torch.profiler import ProfilerActivity, profile

    fn()
    _sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED_CALLS):
            fn()
        _sync(device)
    out = {}
    for event in prof.key_averages():
        total = getattr(event, "device_time_total", 0) or getattr(event, "cuda_time_total", 0)
        if total > 0 and event.count >= PROFILED_CALLS:
            out[event.key[:60]] = total / PROFILED_CALLS
    return out


def run_shape(
    name: str, tokens: int, hidden: int, experts: int, top_k: int, device: torch.device
) -> list[dict[str, Any]]:
    timer = _timer(device)
    gen = torch.Generator().manual_seed(0)
    scores = torch.softmax(torch.randn(tokens, experts, generator=gen), -1)
    top_probs, ids = torch.topk(scores, top_k, dim=-1)
    mask = torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, ids, True)
    probs = torch.zeros(tokens, experts).scatter_(1, ids, top_probs)
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
    x, mask, probs, ids = (t.to(device) for t in (x, mask, probs, ids))
    rows = tokens * top_k
    src = torch.randn(rows, hidden, device=device, dtype=x.dtype)
    dst = torch.empty_like(src)
    bandwidth = 2 * src.numel() * src.element_size() / timer(lambda s=src, d=dst: d.copy_(s))
    del src, dst
    limit_us = (tokens + rows) * hidden * x.element_size() / bandwidth
    bound = rows + experts * (PAD - 1)
    mask_map = ops.moe_permute_map(mask, experts, rows)[0]
    written = torch.empty(rows, hidden, device=device, dtype=x.dtype)
    index_map = ops.moe_permute_map(ids, experts, rows)[0]

    def with_probs() -> Any:
        row_map = ops.moe_permute_map(mask, experts, rows)[0]
        return ops.moe_permute(x, row_map, rows), ops.moe_permute_probs(probs, row_map, rows)

    forms: dict[str, Callable[[], Any]] = {
        "mask": lambda: ops.moe_permute(x, ops.moe_permute_map(mask, experts, rows)[0], rows),
        "mask + probs": with_probs,
        "index": lambda: ops.moe_permute(x, ops.moe_permute_map(ids, experts, rows)[0], rows),
        f"mask, padded to {PAD} (static bound)": lambda: ops.moe_permute(
            x, ops.moe_permute_map(mask, experts, bound, PAD)[0], bound
        ),
        "map only, mask": lambda: ops.moe_permute_map(mask, experts, rows),
        "map only, index": lambda: ops.moe_permute_map(ids, experts, rows),
        "permute only, mask map": lambda: ops.moe_permute(x, mask_map, rows),
        "permute only, index map": lambda: ops.moe_permute(x, index_map, rows),
        # The permuted rows' writes alone (a memset of the output): what this device's memory
        # gives the bulk of the bytes, beside the limit (reads and writes at a copy's bandwidth).
        "writes alone: zero the output": lambda: written.zero_(),
    }
    out = []
    for form, fn in forms.items():
        kernels = _kernels(fn, device)
        row = {
            "shape": name,
            "form": form,
            "us": timer(fn),
            "kernels_us": sum(kernels.values()),
            "host_us": _host_us(fn, device),
            "limit_us": limit_us,
            "kernels": kernels,
        }
        row["vs_limit"] = row["us"] / limit_us
        print(json.dumps(row), file=sys.stderr, flush=True)
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="mixtral,qwen3,dsv3")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tokens", type=int, help="override every shape's token count")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    rows: list[dict[str, Any]] = []
    for name in args.shapes.split(","):
        tokens, hidden, _, experts, top_k = SHAPES[name]
        rows += run_shape(name, args.tokens or tokens, hidden, experts, top_k, device)
    for r in rows:
        print(
            f"{r['shape']:<8}{r['form']:<36}{r['us']:>9.1f} us  kernels {r['kernels_us']:>8.1f}"
            f"  host {r['host_us']:>7.1f}  x{r['vs_limit']:.2f}"
        )
    if args.json:
        meta = {
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__,
        }
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
