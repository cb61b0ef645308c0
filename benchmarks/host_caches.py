"""Host time of the per-call work the host caches and the bias epilogue removed, on the CPU.

Each case times one piece of host work done on every call of a MoE block, before and after,
alternating the two (``--samples`` samples of ``--calls`` calls each, the median kept):

* ``counts_from_bins``: the group sizes the fused ops' backward derives from ``bins`` (a dozen
  small tensor ops), computed anew against remembered for the same ``bins`` (each fused op and
  bias of one step asks for them);
* ``gluon_wgrad_launch``: the Hopper Gluon weight gradient's launch on the host, its three NVMMA
  shared layouts built per call against cached (the launch itself only recorded, as the compile
  gate records it: no GPU needed);
* ``served_bias``: what the core did per forward around a grouped GEMM that did not take the
  bias (GPT-OSS's two GEMMs, ``megablocks_core.bias``), against nothing now that the Triton
  kernels add it in their epilogue;
* ``fp8_validation``: the argument checks of one forward's FP8 functions (``fp8.gather_gmm``,
  ``fp8.gmm_scatter``), each contract validated whole on every call against once per call
  shape (``entries.validator``, as the ops' entries do).

No GPU time is involved: these are the host's share only, on one intra-op thread (on a GPU host
the same work costs less in absolute terms; what carries over is which work is gone). One JSON
object per case on stdout.

Usage: ``python benchmarks/host_caches.py [--calls N] [--samples N] [--tokens T]``.
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


def _per_call_us(fn: Callable[[], Any], calls: int) -> float:
    start = time.perf_counter_ns()
    for _ in range(calls):
        fn()
    return (time.perf_counter_ns() - start) / calls / 1e3


def paired(
    before: Callable[[], Any], after: Callable[[], Any], calls: int, samples: int
) -> dict[str, float]:
    """Median µs per call of ``before`` and ``after``, sampled alternately."""
    before(), after()  # first calls: imports, caches
    firsts, seconds = [], []
    for _ in range(samples):
        firsts.append(_per_call_us(before, calls))
        seconds.append(_per_call_us(after, calls))
    old, new = statistics.median(firsts), statistics.median(seconds)
    return {"before_us": old, "after_us": new, "saved_us": old - new}


def counts_case(experts: int, rows: int) -> tuple[Callable[[], Any], Callable[[], Any]]:
    from megablocks_core.autograd import gmm as rules

    sizes = torch.full((experts,), rows // experts, dtype=torch.int32)
    bins = sizes.cumsum(0).int()

    def anew() -> Any:
        rules._LAST_COUNTS = None
        return rules._counts_from_bins(bins, rows)

    def remembered() -> Any:
        return rules._counts_from_bins(bins, rows)

    return anew, remembered


def gluon_case(tokens: int) -> tuple[Callable[[], Any], Callable[[], Any]] | None:
    """The weight gradient of Qwen3's first GEMM at ``tokens`` tokens (top-k 8), on meta
    tensors standing for an H200's; None where Gluon does not import."""
    try:
        from megablocks_triton import hopper_wgrad
        from megablocks_triton.launch import record_launches
    except ImportError:
        return None
    from megablocks_core.plugin import DeviceInfo

    h200 = DeviceInfo(kind="cuda", type="cuda", arch="sm_90", capability=(9, 0))
    rows, hidden, ffn, experts = tokens * 8, 2048, 1536, 128
    meta = {"dtype": torch.bfloat16, "device": "meta"}
    a, grad = torch.empty(rows, hidden, **meta), torch.empty(rows, ffn, **meta)
    out = torch.empty(experts, hidden, ffn, **meta)
    sizes = torch.empty(experts, dtype=torch.int32, device="meta")
    recorder = record_launches(h200)

    def launch() -> None:
        recorder.launches.clear()
        hopper_wgrad.launch(a, grad, sizes, out, accumulate=False, block_e=128, num_sms=132)

    def rebuilt() -> None:
        hopper_wgrad.shared_layout.cache_clear()
        with recorder:
            launch()

    def cached() -> None:
        with recorder:
            launch()

    return rebuilt, cached


def served_bias_case(tokens: int) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """GPT-OSS-20B's experts (32 experts, top-k 4) at ``tokens`` tokens, at a small width (the
    host work does not depend on it): the core's bias around gather_gmm and gmm_scatter."""
    from megablocks_core import bias

    experts, top_k, width = 32, 4, 16
    pairs = tokens * top_k
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, experts, (pairs,), generator=gen)
    bins = torch.bincount(ids, minlength=experts).cumsum(0).int()
    indices = torch.argsort(ids, stable=True).int()
    weights = torch.rand(pairs, generator=gen)
    first = torch.zeros(pairs, 2 * width)
    second = torch.zeros(tokens, width)
    args = {
        "bins": bins,
        "indices": indices,
        "weights": weights,
        "top_k": top_k,
        "rows": None,
    }
    first_bias, second_bias = torch.randn(experts, 2 * width), torch.randn(experts, width)

    def served() -> None:
        bias.serve_gather_gmm({**args, "bias": first_bias}, first)
        bias.serve_gmm_scatter({**args, "bias": second_bias}, second)

    def in_the_epilogue() -> None:
        return None

    return served, in_the_epilogue


def fp8_validation_case(tokens: int) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """The argument checks of the FP8 functions one dMoE forward calls (``fp8.gather_gmm`` and
    ``fp8.gmm_scatter``) at Qwen3's routing (128 experts, top-k 8; small widths, which the checks
    do not depend on): the contracts validated whole on every call, against validated once per
    call shape as the ops' entries do."""
    from megablocks_core import fp8, ops, validation
    from megablocks_core.contracts import BY_NAME

    experts, top_k, hidden, ffn = 128, 8, 32, 16
    gen = torch.Generator().manual_seed(0)
    top = torch.randint(0, experts, (tokens * top_k,), generator=gen, dtype=torch.int32)
    bin_ids, indices = ops.sort(top, experts.bit_length())
    bins = ops.inclusive_cumsum(ops.histogram(top, experts), 0)
    x, rows = torch.randn(tokens, hidden), torch.randn(tokens * top_k, 2 * ffn)
    w1, w2 = torch.randn(experts, hidden, 2 * ffn), torch.randn(experts, ffn, hidden)
    weights = torch.rand(tokens * top_k, generator=gen)
    options = (None,) * 4  # rows, bias, alpha, limit
    calls = (
        ("gather_gmm", (x, w1, indices, bin_ids, bins, top_k, False, None, None)),
        (
            "gmm_scatter",
            (rows, w2, indices, bin_ids, weights, bins, top_k, False, "swiglu", *options),
        ),
    )

    def whole() -> None:
        for name, args in calls:
            validation.validate(BY_NAME[name], args)

    def once_per_shape() -> None:
        for name, args in calls:
            fp8._VALIDATORS[name](args)

    return whole, once_per_shape


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--samples", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args(argv)
    # One intra-op thread: the tensors are tiny, and a thread pool's wake-ups on a busy host
    # would be measured instead of the work.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cases: dict[str, tuple[Callable[[], Any], Callable[[], Any]] | None] = {
            "counts_from_bins": counts_case(128, args.tokens * 8),
            "gluon_wgrad_launch": gluon_case(args.tokens),
            "served_bias": served_bias_case(args.tokens),
            "fp8_validation": fp8_validation_case(args.tokens),
        }
        for name, case in cases.items():
            row: dict[str, Any] = {"case": name, "tokens": args.tokens}
            if case is None:
                row["skipped"] = "not importable here"
            else:
                row.update(paired(*case, args.calls, args.samples))
            print(json.dumps(row), flush=True)
    finally:
        torch.set_num_threads(threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
