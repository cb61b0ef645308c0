"""Eager per-call overhead of ``megablocks_core.ops.X`` over calling the chosen kernel directly.

The core's cost per call (signature cache lookup, shape rules, autograd decision)
is a few microseconds, far below the run-to-run noise of even a tiny real kernel.
So the benchmark installs, for its own process only, a ``null`` backend whose
kernels return a preallocated tensor, forces it with ``use_backend("null")``, and
times ``ops.X(...)`` against calling that same kernel directly, alternating the
two. It also reports the same difference with the reference kernels, for scale.

Usage: ``python benchmarks/dispatch_overhead.py [--json]``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import megablocks_core
from megablocks_core import dispatch, ops


def _per_call_ns(fn: Callable[[], Any], calls: int) -> float:
    start = time.perf_counter_ns()
    for _ in range(calls):
        fn()
    return (time.perf_counter_ns() - start) / calls


def _paired(
    op: Callable[[], Any], direct: Callable[[], Any], calls: int, repeats: int
) -> tuple[float, float, float]:
    """Median op time, direct time and overhead, timing the two alternately so that
    drifting machine load hits both alike."""
    ops_ns, direct_ns, diffs = [], [], []
    for _ in range(repeats):
        t_op, t_direct = _per_call_ns(op, calls), _per_call_ns(direct, calls)
        ops_ns.append(t_op)
        direct_ns.append(t_direct)
        diffs.append(t_op - t_direct)
    return statistics.median(ops_ns), statistics.median(direct_ns), statistics.median(diffs)


def cases() -> dict[str, tuple[Callable[..., Any], tuple[Any, ...], tuple[Any, ...]]]:
    """op → (public function, public args, kernel-order args)."""
    tokens, top_k, experts, hidden = 4, 2, 4, 8
    top = torch.arange(tokens * top_k, dtype=torch.int32) % experts
    bin_ids, indices = ops.sort(top, 2)
    counts = ops.histogram(top, experts)
    bins = ops.inclusive_cumsum(counts, 0)
    padded = ops.inclusive_cumsum(ops.round_up(counts, 4), 0)
    x = torch.randn(tokens, hidden)
    rows = torch.randn(tokens * top_k, hidden)
    weights = torch.rand(tokens * top_k)
    a, b, sizes = (
        torch.randn(tokens * top_k, hidden),
        torch.randn(experts, hidden, hidden),
        counts.long(),
    )
    return {
        "sort": (ops.sort, (top, 2), (top, 2)),
        "histogram": (ops.histogram, (top, experts), (top, experts)),
        "inclusive_cumsum": (ops.inclusive_cumsum, (counts, 0), (counts, 0)),
        "gather": (
            ops.gather,
            (x, indices, bin_ids, bins, top_k),
            (x, indices, bin_ids, None, bins, top_k),
        ),
        "scatter": (
            ops.scatter,
            (rows, indices, bin_ids, weights, bins, top_k),
            (rows, indices, bin_ids, weights, bins, top_k),
        ),
        "padded_gather": (
            ops.padded_gather,
            (x, indices, bin_ids, bins, padded, top_k),
            (x, indices, bin_ids, None, bins, padded, top_k),
        ),
        "gmm": (ops.gmm, (a, b, sizes), (a, b, sizes, False)),
    }


NULL_PLUGIN = """
from megablocks_core import Kernel, contracts, hookimpl

OUT = {}  # op -> tensor returned by every call


def _kernel(op):
    def null(*args):
        return OUT[op]
    return Kernel(op=op, fn=null, devices=("cpu",), priority=-1)


def _family(name):
    return [_kernel(c.name) for c in contracts.ALL if c.family == name]


@hookimpl
def megablocks_routing_kernels():
    return _family("routing")


@hookimpl
def megablocks_permutation_kernels():
    return _family("permutation")


@hookimpl
def megablocks_grouped_gemm_kernels():
    return _family("grouped_gemm")
"""


def install_null_backend(folder: Path) -> Any:
    """Put a one-module distribution with a ``null`` entry point on sys.path and reload."""
    (folder / "megablocks_null_bench.py").write_text(NULL_PLUGIN)
    info = folder / "megablocks_null_bench-0.0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: megablocks-null-bench\nVersion: 0.0.0\n"
    )
    (info / "entry_points.txt").write_text("[megablocks.backends]\nnull = megablocks_null_bench\n")
    sys.path.insert(0, str(folder))
    importlib.invalidate_caches()
    megablocks_core.reload()
    return importlib.import_module("megablocks_null_bench")


def measure(calls: int, repeats: int, backend: str) -> list[dict[str, Any]]:
    results = []
    with megablocks_core.use_backend(backend):
        for name, (public, public_args, kernel_args) in cases().items():
            public(*public_args)  # ranks once and fills the cache
            chosen = dispatch.explain(
                name,
                "cpu",
                dispatch._call_dtypes(megablocks_core.contracts.BY_NAME[name], kernel_args),
            ).winner
            assert chosen is not None and chosen.backend == backend
            direct = chosen.fn
            t_op, t_direct, overhead = _paired(
                lambda p=public, a=public_args: p(*a),
                lambda d=direct, a=kernel_args: d(*a),
                calls,
                repeats,
            )
            results.append(
                {
                    "op": name,
                    "backend": chosen.label,
                    "op_us": t_op / 1e3,
                    "direct_us": t_direct / 1e3,
                    "overhead_us": overhead / 1e3,
                }
            )
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--calls", type=int, default=500, help="calls per timing sample")
    parser.add_argument("--repeats", type=int, default=41, help="timing samples (median taken)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        null = install_null_backend(Path(folder))
        for name, (public, public_args, _) in cases().items():
            with megablocks_core.use_backend("reference"):
                null.OUT[name] = public(*public_args)  # a correctly shaped result to return
        results = measure(args.calls, args.repeats, "null")
        reference = measure(max(args.calls // 10, 10), args.repeats, "reference")
    meta = {
        "torch": torch.__version__,
        "megablocks_core": megablocks_core.__version__,
        "python": sys.version.split()[0],
        "threads": 1,
    }
    if args.json:
        print(
            json.dumps(
                {"meta": meta, "null_kernels": results, "reference_kernels": reference}, indent=2
            )
        )
        return 0
    print(f"{'op':<18}{'backend':<12}{'ops.X µs':>10}{'kernel µs':>11}{'overhead µs':>13}")
    for r in results + reference:
        print(
            f"{r['op']:<18}{r['backend']:<12}{r['op_us']:>10.2f}{r['direct_us']:>11.2f}"
            f"{r['overhead_us']:>13.2f}"
        )
    print(
        f"median dispatch overhead (null kernels): "
        f"{statistics.median(r['overhead_us'] for r in results):.2f} µs"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
