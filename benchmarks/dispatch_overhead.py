"""Eager per-call overhead of ``megablocks_core.ops.X`` over calling the chosen kernel directly.

The core's cost per call (signature cache lookup, shape rules, autograd decision)
is a few microseconds, far below the run-to-run noise of even a tiny real kernel.
So the benchmark installs, for its own process only, a ``null`` backend whose
kernels return a preallocated tensor, forces it with ``use_backend("null")``, and
times ``ops.X(...)`` against calling that same kernel directly, alternating the
two. It also reports the same difference with the reference kernels, for scale.

Each op's kernel-order arguments are built from its contract (``megablocks_core.contracts``)
and the public function's own signature, so the direct call passes exactly what ``ops.X``
passes its kernel. One run takes ``--samples`` samples of ``--calls`` calls per op and keeps
their median; the whole measurement is repeated ``--repeats`` times and every figure is given
as the median over the runs with its spread (min, max, quartiles, and each run's value).

Usage: ``python benchmarks/dispatch_overhead.py [--json] [--repeats N] [--device cuda]``.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

import megablocks_core
from megablocks_core import contracts, dispatch, ops
from megablocks_core.schema import OpContract, TensorArg

#: case name → (public function, its positional arguments); the name is the op's.
Cases = dict[str, tuple[Callable[..., Any], tuple[Any, ...]]]


def kernel_args(
    contract: OpContract, public: Callable[..., Any], public_args: Sequence[Any]
) -> tuple[Any, ...]:
    """The kernel-order arguments ``public(*public_args)`` hands its kernel: the public
    function's defaults for the arguments not given, None for each kernel-only tensor argument
    (``TensorArg.public`` False). Fails if the public signature and the contract disagree."""
    bound = inspect.signature(public).bind(*public_args)
    bound.apply_defaults()
    values = bound.arguments
    expected = [a.name for a in contract.public_args]
    if list(values) != expected:
        raise TypeError(f"{contract.name}: public parameters {list(values)}, contract {expected}")
    return tuple(
        None if isinstance(a, TensorArg) and not a.public else values[a.name] for a in contract.args
    )


def _per_call_ns(fn: Callable[[], Any], calls: int, sync: Callable[[], None]) -> float:
    start = time.perf_counter_ns()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter_ns() - start) / calls


def _paired(
    op: Callable[[], Any],
    direct: Callable[[], Any],
    calls: int,
    samples: int,
    sync: Callable[[], None],
) -> tuple[float, float, float]:
    """Median op time, direct time and overhead (ns per call) over ``samples`` samples, timing
    the two alternately so that drifting machine load hits both alike."""
    ops_ns, direct_ns, diffs = [], [], []
    for _ in range(samples):
        t_op, t_direct = _per_call_ns(op, calls, sync), _per_call_ns(direct, calls, sync)
        ops_ns.append(t_op)
        direct_ns.append(t_direct)
        diffs.append(t_op - t_direct)
    return statistics.median(ops_ns), statistics.median(direct_ns), statistics.median(diffs)


def cases(device: torch.device) -> Cases:
    """Tiny inputs on ``device`` for each op timed (``batch_sizes`` of gmm on the CPU, the
    MegaBlocks convention, whose host-side checks are part of what is measured)."""
    tokens, top_k, experts, hidden = 4, 2, 4, 8
    gen = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device)

    top = (torch.arange(tokens * top_k, dtype=torch.int32) % experts).to(device)
    bin_ids, indices = ops.sort(top, 2)
    counts = ops.histogram(top, experts)
    bins = ops.inclusive_cumsum(counts, 0)
    padded = ops.inclusive_cumsum(ops.round_up(counts, 4), 0)
    x, rows, scores = randn(tokens, hidden), randn(tokens * top_k, hidden), randn(tokens, experts)
    weights = torch.rand(tokens * top_k, generator=gen).to(device)
    expert_weights = randn(experts, hidden, hidden)
    return {
        "sort": (ops.sort, (top, 2)),
        "histogram": (ops.histogram, (top, experts)),
        "inclusive_cumsum": (ops.inclusive_cumsum, (counts, 0)),
        "route": (ops.route, (top, experts, 4)),
        "router_topk": (ops.router_topk, (scores, top_k, True)),
        "gather": (ops.gather, (x, indices, bin_ids, bins, top_k)),
        "scatter": (ops.scatter, (rows, indices, bin_ids, weights, bins, top_k)),
        "padded_gather": (ops.padded_gather, (x, indices, bin_ids, bins, padded, top_k)),
        "gmm": (ops.gmm, (rows, expert_weights, counts.long().cpu())),
        "gather_gmm": (ops.gather_gmm, (x, expert_weights, indices, bin_ids, bins, top_k)),
        "gmm_scatter": (
            ops.gmm_scatter,
            (rows, expert_weights, indices, bin_ids, weights, bins, top_k),
        ),
        "glu": (ops.glu, (randn(tokens * top_k, 2 * hidden), "silu")),
    }


NULL_PLUGIN = """
from megablocks_core import Kernel, contracts, hookimpl

OUT = {}  # op -> tensor returned by every call


def _kernel(op):
    def null(*args):
        return OUT[op]
    # Forced by use_backend: no tier needed; an op with a format takes every one.
    contract = contracts.BY_NAME[op]
    formats = contract.arg("format").choices if "format" in contract.arg_names else ()
    return Kernel(op=op, fn=null, devices=("any",), formats=formats)


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


@hookimpl
def megablocks_activation_kernels():
    return _family("activation")
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


def measure(
    the_cases: Cases, calls: int, samples: int, backend: str, device: torch.device
) -> dict[str, dict[str, Any]]:
    """One run: op → backend label and median µs per call of ``ops.X``, of the kernel called
    directly, and of their difference."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    results = {}
    with megablocks_core.use_backend(backend):
        for name, (public, public_args) in the_cases.items():
            contract = contracts.BY_NAME[name]
            args = kernel_args(contract, public, public_args)
            public(*public_args)  # ranks once and fills the cache
            dtypes = {
                a.name: v.dtype
                for a, v in zip(contract.args, args, strict=True)
                if isinstance(a, TensorArg) and v is not None
            }
            chosen = dispatch.explain(name, device, dtypes).winner
            assert chosen is not None and chosen.backend == backend, (name, chosen)
            t_op, t_direct, overhead = _paired(
                lambda p=public, a=public_args: p(*a),
                lambda d=chosen.fn, a=args: d(*a),
                calls,
                samples,
                sync,
            )
            results[name] = {
                "backend": chosen.label,
                "op_us": t_op / 1e3,
                "direct_us": t_direct / 1e3,
                "overhead_us": overhead / 1e3,
            }
    return results


def spread(values: Sequence[float]) -> dict[str, Any]:
    """Median, min, max and quartiles of one figure over the runs, and each run's value."""
    ordered = sorted(values)
    median = statistics.median(ordered)
    if len(ordered) > 1:
        q1, _, q3 = statistics.quantiles(ordered, n=4, method="inclusive")
        # the interpolation can land one ulp outside its neighbours when runs tie
        q1, q3 = min(max(q1, ordered[0]), median), max(min(q3, ordered[-1]), median)
    else:
        q1 = q3 = ordered[0]
    return {
        "median": median,
        "min": ordered[0],
        "max": ordered[-1],
        "q1": q1,
        "q3": q3,
        "runs": list(values),
    }


def summarize(runs: Sequence[dict[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per op, each figure as its :func:`spread` over the runs."""
    return [
        {
            "op": name,
            "backend": first["backend"],
            **{
                figure: spread([run[name][figure] for run in runs])
                for figure in ("op_us", "direct_us", "overhead_us")
            },
        }
        for name, first in runs[0].items()
    ]


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--calls", type=int, default=500, help="calls per timing sample")
    parser.add_argument(
        "--samples", type=int, default=41, help="timing samples per run (their median is kept)"
    )
    parser.add_argument(
        "--repeats", type=int, default=5, help="runs of the whole measurement (median and spread)"
    )
    parser.add_argument(
        "--device", default="cpu", help="where the inputs live (cpu, cuda); default cpu"
    )
    args = parser.parse_args(argv)
    if min(args.calls, args.samples, args.repeats) < 1:
        parser.error("--calls, --samples and --repeats must be at least 1")
    device = torch.device(args.device)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        null = install_null_backend(Path(folder))
        with megablocks_core.use_backend("reference"):  # the null kernels have no results yet
            the_cases = cases(device)
        for name, (public, public_args) in the_cases.items():
            with megablocks_core.use_backend("reference"):
                null.OUT[name] = public(*public_args)  # a correctly shaped result to return
        null_runs, reference_runs = [], []
        for _ in range(args.repeats):
            null_runs.append(measure(the_cases, args.calls, args.samples, "null", device))
            reference_runs.append(
                measure(the_cases, max(args.calls // 10, 1), args.samples, "reference", device)
            )
    median_overhead = spread(
        [statistics.median(r["overhead_us"] for r in run.values()) for run in null_runs]
    )
    meta = {
        "torch": torch.__version__,
        "megablocks_core": megablocks_core.__version__,
        "python": sys.version.split()[0],
        "threads": 1,
        "device": _device_name(device),
        "calls": args.calls,
        "samples": args.samples,
        "repeats": args.repeats,
    }
    null_kernels, reference_kernels = summarize(null_runs), summarize(reference_runs)
    if args.json:
        report = {
            "meta": meta,
            "null_kernels": null_kernels,
            "reference_kernels": reference_kernels,
            "median_overhead_us": median_overhead,
        }
        print(json.dumps(report, indent=2))
        return 0
    print(
        f"{args.repeats} runs of {args.samples} samples x {args.calls} calls on "
        f"{meta['device']}: medians over the runs, [min, max] of the overhead"
    )
    print(f"{'op':<18}{'backend':<12}{'ops.X µs':>10}{'kernel µs':>11}{'overhead µs':>13}  spread")
    for r in null_kernels + reference_kernels:
        over = r["overhead_us"]
        print(
            f"{r['op']:<18}{r['backend']:<12}{r['op_us']['median']:>10.2f}"
            f"{r['direct_us']['median']:>11.2f}{over['median']:>13.2f}"
            f"  [{over['min']:.2f}, {over['max']:.2f}]"
        )
    print(
        f"median dispatch overhead over the ops (null kernels): {median_overhead['median']:.2f} µs "
        f"(runs: {median_overhead['min']:.2f} to {median_overhead['max']:.2f})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
