"""Expert parallelism over W ranks: equality, step time, bytes exchanged, scaling efficiency.

On a host with W >= 2 GPUs, NCCL (keep NCCL's NVLink multicast off there: NCCL_NVLS_ENABLE=0)::

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node=2 benchmarks/expert_parallel_nccl.py \
        --json ep.json --timeout 540

``--quick`` first (qwen3 only, chunks 1 and 2, 2 warm-ups and 5 timed steps) to see that it runs
and how long the kernels take to compile. On the CPU with gloo, at a tiny shape (a check that the
script and the layer run)::

    torchrun --nproc-per-node=2 benchmarks/expert_parallel_nccl.py --device cpu

Each rank draws its own T tokens (seeded by rank). For each shape (default: qwen3 and dsv3 on GPUs,
in bf16; tiny on the CPU, in float32; MLP experts unless --glu):

1. equality: the expert-parallel layer's output, input gradient, load-balancing loss and router
   gradient equal the one-device layer's with all experts (same seed) on this rank's tokens; its
   local expert gradients equal the one-device layer's summed over all ranks' tokens (reduced to
   the rank holding them); errors relative to the reference's largest magnitude, for every
   --chunks value and for the per-(token, expert) baseline exchange
   (``parallel.expert_parallel_apply``).
2. step time (forward + backward, median of --steps after --warmup steps; CUDA events on GPUs,
   all ranks started together) of: one device with all experts on T tokens and on W*T tokens
   (the global work of the W ranks), the baseline exchange, and the layer for each --chunks
   value; peak memory of each (GPUs; both layers' parameters included in every figure); and the
   device→host syncs of one forward and of its backward (GPUs: CUDA's sync debug mode).
3. bytes each rank sends to the other ranks in one training step (forward and backward), from
   this step's split sizes: the baseline's one row per (token, expert) pair against the layer's
   one row per (token, rank) plus its routing metadata; and the row exchanges of one step timed
   alone (no computation) with each scheme's split sizes.
4. scaling efficiency: ``one_device(W*T) / (W * ep_step)`` (1 = W ranks are W times as fast as
   one device on the same global work).
5. with ``--profile``: each scheme's step under torch.profiler on every rank, device time per
   part of the layer (expert GEMMs, weight gradients, permutation, communication, ...: the
   parts of ``benchmarks/step_profile.py``), in the JSON's ``per_rank[r].profile_ms_per_step``.

Progress: rank 0 prints (flushed) a line before each phase ("compiling/warming up ...",
"timing ...") and one line per measured figure as soon as it is measured (equality errors and step
times are the worst over the ranks), a summary per shape when the shape is done, and the JSON at
the end (``--json`` writes it too, after every shape: ``"complete": false`` until the last). The
first call of each layer compiles its kernels (Triton: in every process); the equality lines (and
the JSON's ``first_call_s_slowest_rank``) give its time. ``--timeout S``: after S seconds every rank prints the phase it is in and the Python
stacks of its threads, and exits with status 3 (a run cut short keeps the lines printed so far).
Exit status 1 if an equality check fails.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import inspect
import json
import math
import os
import statistics
import sys
import threading
import time
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist

from megablocks_core.layers import DroplessMoE
from megablocks_core.layers.moe import expert_parallel_baseline
from megablocks_core.layers.parallel import _RoutingLayout
from megablocks_core.shapes import SHAPES

TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 1e-2, torch.float32: 1e-4, torch.float64: 1e-9}
#: Exit status when --timeout expires.
TIMEOUT_EXIT = 3
#: Seconds between a rank's timeout report and its exit: the first rank to exit makes torchrun
#: stop the others, which should have printed their own phase by then.
REPORT_GRACE_S = 5.0
#: faulthandler's own dump and exit this long after --timeout, should the watchdog thread not get
#: the interpreter (a call that blocks without releasing it).
BACKSTOP_S = 30.0
Step = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class Progress:
    """Rank 0's progress lines, and the phase each rank is in for the --timeout watchdog."""

    def __init__(self, rank: int, timeout: float | None) -> None:
        self.rank = rank
        self.started = time.monotonic()
        self.phase, self.phase_started = "start-up", self.started
        self.detail = ""  # where in the phase (a step number), for the watchdog only
        self._done, self._fired = threading.Event(), threading.Event()
        if timeout:
            threading.Thread(
                target=self._watch, args=(timeout,), name="ep-watchdog", daemon=True
            ).start()
            faulthandler.dump_traceback_later(timeout + BACKSTOP_S, exit=True)

    def say(self, text: str) -> None:
        """One line on rank 0, flushed at once (a run killed later keeps it)."""
        if self.rank == 0:
            print(f"[ep {time.monotonic() - self.started:7.1f}s] {text}", flush=True)

    def enter(self, phase: str) -> None:
        """Start a phase: the watchdog names it; rank 0 prints it."""
        self.phase, self.phase_started, self.detail = phase, time.monotonic(), ""
        self.say(f"{phase} ...")

    def at_step(self, step: int, total: int) -> None:
        """Note the step under way (a hang stops at one step; a slow run moves on)."""
        self.detail = f", at step {step + 1} of {total}"

    def close(self) -> None:
        self._done.set()
        faulthandler.cancel_dump_traceback_later()
        if self._fired.is_set():  # finished within the report's grace: still a timeout
            raise SystemExit(TIMEOUT_EXIT)

    def _watch(self, timeout: float) -> None:
        if self._done.wait(timeout):
            return
        self._fired.set()
        now = time.monotonic()
        print(
            f"[ep rank {self.rank}] TIMEOUT: --timeout {timeout:g} s reached in phase "
            f"'{self.phase}' (in it for {now - self.phase_started:.0f} s{self.detail}); "
            "Python stacks follow",
            flush=True,
        )
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        time.sleep(REPORT_GRACE_S)
        os._exit(TIMEOUT_EXIT)


def worst_over_ranks(values: list[float], device: torch.device) -> list[float]:
    """Each value's maximum over the ranks (NaN counts as +inf: a NaN error must fail)."""
    clean = [math.inf if math.isnan(v) else v for v in values]
    t = torch.tensor(clean, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


class Clock:
    """Wall time of a region: CUDA events on GPUs, perf_counter after the work on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def time_ms(
        self,
        fn: Callable[[], None],
        steps: int,
        warmup: int,
        together: bool,
        on_step: Callable[[int, int], None] | None = None,
    ) -> float:
        times = []
        for i in range(steps + warmup):
            if on_step is not None:
                on_step(i, steps + warmup)
            if together:
                dist.barrier()
            self.sync()
            if self.cuda:
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                elapsed = start.elapsed_time(end)
            else:
                begin = time.perf_counter()
                fn()
                elapsed = 1e3 * (time.perf_counter() - begin)
            if i >= warmup:
                times.append(elapsed)
        return statistics.median(times)


def max_rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().float(), want.detach().float()
    if want.numel() == 0:
        return 0.0
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def size(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


def step_fn(
    step: Step, parameters: list[torch.nn.Parameter], x: torch.Tensor
) -> Callable[[], None]:
    def run() -> None:
        out, aux = step(x)
        (out.float().square().mean() + aux).backward()
        for p in parameters:
            p.grad = None

    return run


def host_syncs(step: Step, parameters: list[torch.nn.Parameter], x: torch.Tensor) -> dict:
    """Device→host syncs of one forward and of its backward (CUDA's sync debug mode warnings)."""
    counts = {}
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")

        def syncs() -> int:
            return sum("synchroniz" in str(w.message) for w in caught)

        torch.cuda.set_sync_debug_mode("warn")
        try:
            out, aux = step(x)
            counts["forward"] = syncs()
            (out.float().square().mean() + aux).backward()
            counts["backward"] = syncs() - counts["forward"]
        finally:
            torch.cuda.set_sync_debug_mode(0)
    for p in parameters:
        p.grad = None
    return counts


def exchange_counts(top_experts: torch.Tensor, experts: int, world: int) -> torch.Tensor:
    """(W, W, 2): [source, destination] = (tokens with an expert there, (token, expert) pairs)."""
    ranks = top_experts.long() // (experts // world)
    per_rank = torch.stack(
        [torch.stack([(ranks == r).any(1).sum(), (ranks == r).sum()]) for r in range(world)]
    )
    everyone = [torch.empty_like(per_rank) for _ in range(world)]
    dist.all_gather(everyone, per_rank)
    return torch.stack(everyone).cpu()


def bytes_per_step(
    counts: torch.Tensor,
    rank: int,
    hidden: int,
    top_k: int,
    dtype: torch.dtype,
    weights_dtype: torch.dtype,
    tokens: int,
) -> dict[str, int]:
    """Bytes ``rank`` sends to the other ranks in one forward + backward, for both exchanges
    (without the split-size exchange: E/W int64 per rank for the baseline, 2 int64 per chunk and
    rank for the layer). ``dtype``: the tokens'; ``weights_dtype``: the top-k weights'."""
    world, itemsize = counts.shape[0], dtype.itemsize
    others = [r for r in range(world) if r != rank]
    tokens_out = sum(int(counts[rank, r, 0]) for r in others)
    tokens_in = sum(int(counts[s, rank, 0]) for s in others)
    pairs_out = sum(int(counts[rank, r, 1]) for r in others)
    pairs_in = sum(int(counts[s, rank, 1]) for s in others)
    row = hidden * itemsize
    # Baseline: rows out and results back, forward and again backward.
    baseline = 2 * (pairs_out + pairs_in) * row
    # Layer: forward: rows with their routing (ids int32, weights; padded) out, partials back;
    # backward: the partials' gradient out, the rows' and the weights' gradients back.
    routing = _RoutingLayout(top_k, weights_dtype).row_bytes
    weights_grad = top_k * weights_dtype.itemsize
    dedup = (
        tokens_out * (row + routing)
        + tokens_in * row
        + tokens_out * row
        + tokens_in * (row + weights_grad)
    )
    # All-gather dispatch: every token to each other rank: the rows and their routing in, the
    # partials by reduce-scatter; backward: the output gradient in, the rows' and the weights'
    # gradients by reduce-scatter.
    allgather = (world - 1) * tokens * (4 * row + routing + weights_grad)
    return {
        "baseline_bytes": baseline,
        "dedup_bytes": dedup,
        "allgather_bytes": allgather,
        "rows_out_baseline": pairs_out,
        "rows_out_dedup": tokens_out,
        "rows_in_baseline": pairs_in,
        "rows_in_dedup": tokens_in,
    }


def exchanges_alone_ms(
    clock: Clock,
    counts: torch.Tensor,
    rank: int,
    hidden: int,
    dtype,
    device,
    steps: int,
    warmup: int,
    column: int,
    on_step: Callable[[int, int], None] | None = None,
) -> float:
    """The four row exchanges of one step (two forward, two backward), no computation."""
    world = counts.shape[0]
    out_splits = [int(counts[rank, r, column]) for r in range(world)]
    in_splits = [int(counts[s, rank, column]) for s in range(world)]
    rows_out = torch.randn(sum(out_splits), hidden, device=device, dtype=dtype)
    rows_in = torch.empty(sum(in_splits), hidden, device=device, dtype=dtype)

    def exchanges() -> None:
        for _ in range(2):
            dist.all_to_all_single(rows_in, rows_out, in_splits, out_splits)
            dist.all_to_all_single(rows_out, rows_in, out_splits, in_splits)

    return clock.time_ms(exchanges, steps, warmup, together=True, on_step=on_step)


def peak_mib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None


def run_shape(
    args: argparse.Namespace, name: str, device: torch.device, clock: Clock, progress: Progress
) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    tokens, hidden, ffn, experts, top_k = SHAPES[name]
    tokens = args.tokens or tokens
    dtype = getattr(torch, args.dtype)
    say = progress.say
    progress.enter(f"{name}: building the one-device and the sharded layer ({tokens} tokens/rank)")
    gen = torch.Generator(device=device).manual_seed(1000 + rank)
    x = torch.randn(tokens, hidden, device=device, dtype=dtype, generator=gen)
    grad_out = torch.randn(x.shape, device=device, dtype=dtype, generator=gen)
    kwargs = dict(top_k=top_k, glu=args.glu, seed=0, dtype=dtype, device=device)
    full = DroplessMoE(hidden_size=hidden, ffn_hidden_size=ffn, num_experts=experts, **kwargs)
    # The sharded layer is the full one's slice (as its own initialisation would draw it, on the
    # CPU): build it on the meta device and copy the slice on the device, which is quicker.
    meta = {**kwargs, "device": "meta"}
    sharded = DroplessMoE(
        hidden_size=hidden,
        ffn_hidden_size=ffn,
        num_experts=experts,
        expert_parallel_group=dist.group.WORLD,
        **meta,
    )
    sharded.to_empty(device=device)
    lo, hi = sharded.expert_offset, sharded.expert_offset + sharded.num_local_experts
    expert_names = ["w1", "w2"]
    with torch.no_grad():
        sharded.router.copy_(full.router)
        for n in expert_names:
            getattr(sharded, n).copy_(getattr(full, n)[lo:hi])

    def first_call(step: Step) -> tuple[float, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Forward and backward of x (a new leaf) against grad_out: the seconds it took (the
        slowest rank's; the first call compiles kernels), the leaf, the output and the loss."""
        clock.sync()
        began = time.perf_counter()
        leaf = x.clone().requires_grad_()
        out, aux = step(leaf)
        (out * grad_out).float().sum().add(aux).backward()
        clock.sync()
        seconds = worst_over_ranks([time.perf_counter() - began], device)[0]
        return seconds, leaf, out.detach(), aux.detach()

    # 1. Equality with the one-device layer.
    progress.enter(
        f"{name}: compiling/warming up: one-device layer, forward + backward (the reference)"
    )
    first_call_s = {}
    first_call_s["one_device"], x_full, out_full, aux_full = first_call(full)
    say(f"{name}: one-device reference: first call {first_call_s['one_device']:.1f} s")
    # Every rank's tokens reach this rank's experts: the sum over ranks of the reference's
    # gradient for them (one shard at a time, in float32, to the rank that holds it).
    progress.enter(f"{name}: reducing the reference's expert gradients to their ranks")
    want_experts = {}
    for n in expert_names:
        grad = getattr(full, n).grad
        for r in range(world):
            shard = grad[r * (hi - lo) : (r + 1) * (hi - lo)].float()
            dist.reduce(shard, dst=r)
            if r == rank:
                want_experts[n] = shard
    want_router, want_x = full.router.grad, x_full.grad
    full.zero_grad(set_to_none=True)
    schemes: dict[str, Step] = {"baseline": lambda t: expert_parallel_baseline(sharded, t)}
    for chunks in args.chunks:

        def layer_step(t: torch.Tensor, chunks: int = chunks) -> tuple[torch.Tensor, torch.Tensor]:
            sharded.expert_parallel_dispatch, sharded.expert_parallel_chunks = "alltoall", chunks
            return sharded(t)

        schemes[f"chunks{chunks}"] = layer_step

    def allgather_step(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        sharded.expert_parallel_dispatch, sharded.expert_parallel_chunks = "allgather", 1
        return sharded(t)

    schemes["allgather"] = allgather_step
    tolerance = TOLERANCE[dtype]
    worst: dict[str, dict[str, float]] = {}
    for scheme, step in schemes.items():
        progress.enter(
            f"{name}: compiling/warming up + equality: {scheme}, forward + backward over {world} "
            "ranks"
        )
        first_call_s[scheme], x_ep, out_ep, aux_ep = first_call(step)
        errors = {
            "out": max_rel(out_ep, out_full),
            "x.grad": max_rel(x_ep.grad, want_x),
            "aux_loss": max_rel(aux_ep, aux_full),
            "router.grad": max_rel(sharded.router.grad, want_router),
        }
        for n in expert_names:
            errors[f"{n}.grad"] = max_rel(getattr(sharded, n).grad, want_experts[n])
        sharded.zero_grad(set_to_none=True)
        worst[scheme] = dict(
            zip(errors, worst_over_ranks(list(errors.values()), device), strict=True)
        )
        ok = all(v <= tolerance for v in worst[scheme].values())
        say(
            f"{name} equality {scheme}: {'ok' if ok else 'FAILED'} (tolerance {tolerance:g}; "
            "worst over ranks) "
            + " ".join(f"{k}={v:.1e}" for k, v in worst[scheme].items())
            + f"; first call {first_call_s[scheme]:.1f} s"
        )
    del x_full, out_full, out_ep, x_ep, want_experts, want_router, want_x
    passed = all(v <= tolerance for s in worst.values() for v in s.values())

    # 2. Step times and peak memory.
    def timed(
        key: str, step: Step, layer: DroplessMoE, inputs: torch.Tensor, together: bool
    ) -> dict:
        progress.enter(
            f"{name}: timing {key} ({args.warmup} warm-up + {args.steps} steps"
            + (", ranks together" if together else ", each rank alone")
            + ")"
        )
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        ms = clock.time_ms(
            step_fn(step, list(layer.parameters()), inputs),
            args.steps,
            args.warmup,
            together,
            on_step=progress.at_step,
        )
        figures = {"ms": ms, "peak_mib": peak_mib(device)}
        slowest[key], peak = worst_over_ranks([ms, figures["peak_mib"] or 0.0], device)
        line = f"{name} {key}: {slowest[key]:.2f} ms (slowest rank)"
        if key.startswith("ep_"):  # one_device_WT is timed first
            efficiency = slowest["one_device_WT"] / (world * slowest[key])
            line += f", scaling efficiency {efficiency:.2f}"
        if figures["peak_mib"] is not None:
            line += f", peak {peak:.0f} MiB"
        say(line)
        return figures

    slowest: dict[str, float] = {}
    x_global = torch.cat([x] * world)
    steps_ms = {"one_device_T": timed("one_device_T", full, full, x, together=False)}
    steps_ms["one_device_WT"] = timed("one_device_WT", full, full, x_global, together=False)
    del x_global
    for scheme, step in schemes.items():
        steps_ms[f"ep_{scheme}"] = timed(f"ep_{scheme}", step, sharded, x, together=True)

    syncs = None
    if device.type == "cuda":
        syncs = {}
        for scheme, step in schemes.items():
            progress.enter(f"{name}: counting host syncs of {scheme}")
            syncs[scheme] = host_syncs(step, list(sharded.parameters()), x)
            say(
                f"{name} host syncs of {scheme} on rank 0: forward {syncs[scheme]['forward']}, "
                f"backward {syncs[scheme]['backward']}"
            )

    # Where each scheme's step goes on every rank (--profile): device time per part of the layer.
    profiles = None
    if args.profile:
        from step_profile import kernel_times, summarise  # benchmarks/, beside this script

        profiles = {}
        for scheme, step in schemes.items():
            progress.enter(f"{name}: profiling {scheme} ({args.steps} steps, ranks together)")
            run = step_fn(step, list(sharded.parameters()), x)
            clock.sync()
            profiles[scheme] = summarise(kernel_times(run, args.steps, device))
            say(
                f"{name} profile of {scheme} on rank 0, ms per step: "
                + ", ".join(f"{part} {ms:.2f}" for part, ms in profiles[scheme].items())
            )

    # 3. Bytes and exchanges alone, from this step's routing.
    progress.enter(f"{name}: exchange sizes of one step")
    with torch.no_grad():
        _, top_weights, top = sharded.route(x)
    counts = exchange_counts(top, experts, world)
    per_rank_bytes = bytes_per_step(
        counts, rank, hidden, top_k, x.dtype, top_weights.dtype, x.shape[0]
    )
    b = per_rank_bytes
    say(
        f"{name} bytes sent per step by rank 0: baseline {size(b['baseline_bytes'])}, "
        f"dedup {size(b['dedup_bytes'])}, allgather {size(b['allgather_bytes'])}; rows out {b['rows_out_baseline']} -> "
        f"{b['rows_out_dedup']}"
    )
    alone = {}
    for scheme, column in (("baseline", 1), ("dedup", 0)):
        progress.enter(f"{name}: timing the row exchanges alone, {scheme} split sizes")
        alone[scheme] = exchanges_alone_ms(
            clock,
            counts,
            rank,
            hidden,
            dtype,
            device,
            args.steps,
            args.warmup,
            column,
            on_step=progress.at_step,
        )
        alone_ms = worst_over_ranks([alone[scheme]], device)[0]
        say(f"{name} row exchanges alone, {scheme}: {alone_ms:.2f} ms (slowest rank)")

    progress.enter(f"{name}: gathering every rank's figures")
    everyone: list[dict] = [{} for _ in range(world)]
    dist.all_gather_object(
        everyone,
        {
            "steps": steps_ms,
            "bytes": per_rank_bytes,
            "exchanges_alone_ms": alone,
            "host_syncs_per_call": syncs,
            "profile_ms_per_step": profiles,
        },
    )
    one_wt = max(r["steps"]["one_device_WT"]["ms"] for r in everyone)
    ep_ms = {k: max(r["steps"][k]["ms"] for r in everyone) for k in steps_ms if k.startswith("ep_")}
    return {
        "shape": name,
        "tokens_per_rank": tokens,
        "hidden": hidden,
        "ffn": ffn,
        "experts": experts,
        "top_k": top_k,
        "glu": args.glu,
        "dtype": args.dtype,
        "equality": {"max_rel_error": worst, "tolerance": tolerance, "passed": passed},
        "first_call_s_slowest_rank": first_call_s,
        "step_ms_slowest_rank": {
            "one_device_T": max(r["steps"]["one_device_T"]["ms"] for r in everyone),
            "one_device_WT": one_wt,
            **ep_ms,
        },
        "scaling_efficiency": {k: one_wt / (world * v) for k, v in ep_ms.items()},
        "per_rank": everyone,
    }


def summary(result: dict, world: int) -> str:
    lines = [
        f"== {result['shape']}: {result['tokens_per_rank']} tokens/rank, H={result['hidden']} "
        f"F={result['ffn']} E={result['experts']} K={result['top_k']} {result['dtype']}, W={world}",
        f"equality passed: {result['equality']['passed']} (tolerance {result['equality']['tolerance']})",
    ]
    for scheme, errs in result["equality"]["max_rel_error"].items():
        lines.append(f"  {scheme:10s} " + " ".join(f"{k}={v:.1e}" for k, v in errs.items()))
    lines.append("step ms (slowest rank) / scaling efficiency / peak MiB per rank:")
    steps = result["step_ms_slowest_rank"]
    for key, ms in steps.items():
        eff = result["scaling_efficiency"].get(key)
        peaks = [r["steps"][key]["peak_mib"] for r in result["per_rank"]]
        lines.append(
            f"  {key:22s} {ms:9.2f}"
            + (f"   eff {eff:5.2f}" if eff is not None else "            ")
            + (f"   peak {max(peaks):9.0f}" if peaks[0] is not None else "")
        )
    syncs = result["per_rank"][0]["host_syncs_per_call"]
    if syncs is not None:
        lines.append(
            "host syncs per call on rank 0 (forward/backward): "
            + ", ".join(f"{k} {v['forward']}/{v['backward']}" for k, v in syncs.items())
        )
    lines.append("bytes sent to other ranks per step, per rank (baseline -> dedup, ratio):")
    for r, per in enumerate(result["per_rank"]):
        b = per["bytes"]
        alone = per["exchanges_alone_ms"]
        lines.append(
            f"  rank {r}: {size(b['baseline_bytes'])} -> {size(b['dedup_bytes'])} "
            f"({b['baseline_bytes'] / max(b['dedup_bytes'], 1):.2f}x); rows out "
            f"{b['rows_out_baseline']} -> {b['rows_out_dedup']}; row exchanges alone "
            f"{alone['baseline']:.2f} -> {alone['dedup']:.2f} ms"
        )
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None)
    parser.add_argument(
        "--shapes", nargs="+", choices=sorted(SHAPES), default=None,
        help="default: qwen3 dsv3 on GPUs (--quick: qwen3), tiny on the CPU",
    )  # fmt: skip
    parser.add_argument(
        "--tokens", type=int, default=None, help="tokens per rank (default: shape's)"
    )
    parser.add_argument(
        "--chunks", type=int, nargs="+", default=None, help="default: 1 2 4 (--quick: 1 2)"
    )
    parser.add_argument(
        "--steps", type=int, default=None,
        help="timed steps per figure, after the warm-up (default: 20 on GPUs, 3 on the CPU; "
        "--quick: 5)",
    )  # fmt: skip
    parser.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="warm-up steps before timing (default 3; --quick: 2)",
    )
    parser.add_argument(
        "--quick", action="store_true",
        help="a first look: one shape (qwen3 on GPUs), chunks 1 2, 2 warm-up and 5 timed steps "
        "(flags given explicitly still win)",
    )  # fmt: skip
    parser.add_argument(
        "--timeout", type=float, default=None, metavar="SECONDS",
        help="after this many seconds every rank prints the phase it is in and its Python "
        f"stacks, and exits with status {TIMEOUT_EXIT} (default: no limit)",
    )  # fmt: skip
    parser.add_argument(
        "--dtype", default=None, choices=("bfloat16", "float16", "float32", "float64")
    )
    parser.add_argument("--glu", action="store_true", help="gated experts (default: MLP)")
    parser.add_argument(
        "--profile", action="store_true",
        help="also profile each scheme's step (torch.profiler, every rank): device time per part "
        "of the layer, as benchmarks/step_profile.py sorts them",
    )  # fmt: skip
    parser.add_argument("--json", default=None, help="rank 0 writes the results here")
    args = parser.parse_args()
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    on_gpu = args.device == "cuda"
    if args.shapes is None:
        args.shapes = ["tiny"] if not on_gpu else ["qwen3"] if args.quick else ["qwen3", "dsv3"]
    args.chunks = args.chunks or ([1, 2] if args.quick else [1, 2, 4])
    if args.steps is None:
        args.steps = 5 if args.quick else 20 if on_gpu else 3
    if args.warmup is None:
        args.warmup = 2 if args.quick else 3
    args.dtype = args.dtype or ("bfloat16" if on_gpu else "float32")
    if args.steps < 1 or args.warmup < 0 or min(args.chunks) < 1:
        parser.error("--steps and --chunks must be >= 1, --warmup >= 0")
    return args


def main() -> int:
    args = parse_args()
    on_gpu = args.device == "cuda"
    rank = int(os.environ.get("RANK", 0))
    progress = Progress(rank, args.timeout)
    progress.enter(
        f"init: {'nccl' if on_gpu else 'gloo'} process group; shapes {' '.join(args.shapes)}, "
        f"chunks {' '.join(map(str, args.chunks))}, {args.warmup} warm-up + {args.steps} "
        "timed steps"
    )
    init: dict = {}
    if on_gpu:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
        if "device_id" in inspect.signature(dist.init_process_group).parameters:
            init["device_id"] = device  # binds NCCL to this rank's GPU (and barrier() to it)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if on_gpu else "gloo", **init)
    rank, world = dist.get_rank(), dist.get_world_size()
    # torchrun sets one thread per process; the layers draw their parameters on the CPU (about
    # 4·10⁹ values per expert tensor at dsv3), which takes minutes on one thread.
    if on_gpu:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    clock = Clock(device)
    report = {
        "world": world,
        "device": torch.cuda.get_device_name(device) if on_gpu else "cpu",
        "backend": dist.get_backend(),
        "torch": torch.__version__,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if on_gpu else None,
        "chunks": args.chunks,
        "steps": args.steps,
        "warmup": args.warmup,
        "quick": args.quick,
        "complete": False,
        "results": [],
    }

    def write_json() -> None:
        if rank == 0 and args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=2)

    for name in args.shapes:
        result = run_shape(args, name, device, clock, progress)
        report["results"].append(result)
        if rank == 0:
            print(summary(result, world), flush=True)
        write_json()  # a run cut short keeps the shapes done
    report["complete"] = True
    if rank == 0:
        print(json.dumps(report, indent=2), flush=True)
    write_json()
    passed = all(r["equality"]["passed"] for r in report["results"])
    progress.enter("shutting down")
    dist.barrier()
    gc.collect()  # no layer may keep the process group alive past its destruction (gloo aborts)
    dist.destroy_process_group()
    progress.close()
    if not passed:
        print(
            f"rank {rank}: the expert-parallel layer differs from the one-device layer",
            file=sys.stderr,
        )
    return 0 if passed else 1


if __name__ == "__main__":
    code = main()
    # Everything is written and the group destroyed: leave without the interpreter's teardown,
    # where gloo's worker threads now and then abort a process that has passed ("terminate
    # called without an active exception"), as the tests' gloo workers do.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
