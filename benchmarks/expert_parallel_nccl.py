"""Expert parallelism over W ranks: equality, step time, bytes exchanged, scaling efficiency.

On a host with W >= 2 GPUs, NCCL (keep NCCL's NVLink multicast off there: NCCL_NVLS_ENABLE=0)::

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node=2 benchmarks/expert_parallel_nccl.py --json ep.json

On the CPU with gloo, at a tiny shape (a check that the script and the layer run)::

    torchrun --nproc-per-node=2 benchmarks/expert_parallel_nccl.py --device cpu

Each rank draws its own T tokens (seeded by rank). For each shape (default: qwen3 and dsv3 on GPUs,
in bf16; tiny on the CPU, in float32; MLP experts unless --glu):

1. equality: the expert-parallel layer's output, input gradient, load-balancing loss and router
   gradient equal the one-device layer's with all experts (same seed) on this rank's tokens; its
   local expert gradients equal the one-device layer's summed over all ranks' tokens (reduced to
   the rank holding them); errors relative to the reference's largest magnitude, for every
   --chunks value and for the per-(token, expert) baseline exchange
   (``parallel.expert_parallel_apply``).
2. step time (forward + backward, median of --steps after 3 warm-ups; CUDA events on GPUs,
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

Rank 0 prints a summary and the JSON (``--json`` writes it too). Exit status 1 if an equality
check fails.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist

from megablocks_core import ops
from megablocks_core.layers import DroplessMoE, load_balancing_loss
from megablocks_core.layers.parallel import expert_parallel_apply
from megablocks_core.layers.shapes import SHAPES

TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 1e-2, torch.float32: 1e-4, torch.float64: 1e-9}
WARMUP = 3
Step = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def baseline_forward(layer: DroplessMoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The sharded layer's forward with one row per (token, expert) on the link (the old exchange)."""
    probs, weights, top_experts = layer.route(x)
    with torch.no_grad():
        indices, bin_ids, counts, bins, _ = ops.route(
            top_experts.flatten(), layer.num_experts, layer.block_size
        )
    rows = ops.gather(x, indices, bin_ids, bins, layer.top_k)
    assert layer.expert_parallel_group is not None
    rows = expert_parallel_apply(rows, counts, layer.experts, layer.expert_parallel_group)
    out = ops.scatter(rows, indices, bin_ids, weights.flatten(), bins, layer.top_k)
    coefficient = layer.load_balancing_loss_coefficient
    return out, load_balancing_loss(counts, probs, layer.top_k, coefficient)


class Clock:
    """Wall time of a region: CUDA events on GPUs, perf_counter after the work on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def time_ms(self, fn: Callable[[], None], steps: int, together: bool) -> float:
        times = []
        for i in range(steps + WARMUP):
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
            if i >= WARMUP:
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
    counts: torch.Tensor, rank: int, hidden: int, top_k: int, itemsize: int
) -> dict[str, int]:
    """Bytes ``rank`` sends to the other ranks in one forward + backward, for both exchanges
    (without the split-size exchange: E/W int64 per rank for the baseline, 2 int64 per chunk and
    rank for the layer)."""
    world = counts.shape[0]
    others = [r for r in range(world) if r != rank]
    tokens_out = sum(int(counts[rank, r, 0]) for r in others)
    tokens_in = sum(int(counts[s, rank, 0]) for s in others)
    pairs_out = sum(int(counts[rank, r, 1]) for r in others)
    pairs_in = sum(int(counts[s, rank, 1]) for s in others)
    row = hidden * itemsize
    # Baseline: rows out and results back, forward and again backward.
    baseline = 2 * (pairs_out + pairs_in) * row
    # Layer: forward: rows + (ids int32, weights) out, partials back; backward: the partials'
    # gradient out, the rows' and the weights' gradients back.
    dedup = (
        tokens_out * (row + top_k * (4 + itemsize))
        + tokens_in * row
        + tokens_out * row
        + tokens_in * (row + top_k * itemsize)
    )
    return {
        "baseline_bytes": baseline,
        "dedup_bytes": dedup,
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
    column: int,
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

    return clock.time_ms(exchanges, steps, together=True)


def peak_mib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None


def run_shape(args: argparse.Namespace, name: str, device: torch.device, clock: Clock) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    tokens, hidden, ffn, experts, top_k = SHAPES[name]
    tokens = args.tokens or tokens
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator(device=device).manual_seed(1000 + rank)
    x = torch.randn(tokens, hidden, device=device, dtype=dtype, generator=gen)
    grad_out = torch.randn(x.shape, device=device, dtype=dtype, generator=gen)
    kwargs = dict(top_k=top_k, glu=args.glu, seed=0, dtype=dtype, device=device)
    full = DroplessMoE(hidden, ffn, experts, **kwargs)
    sharded = DroplessMoE(hidden, ffn, experts, expert_parallel_group=dist.group.WORLD, **kwargs)
    lo, hi = sharded.expert_offset, sharded.expert_offset + sharded.num_local_experts
    expert_names = [n for n in ("w1", "v1", "w2") if getattr(full, n) is not None]

    # 1. Equality with the one-device layer.
    x_full = x.clone().requires_grad_()
    out_full, aux_full = full(x_full)
    (out_full * grad_out).float().sum().add(aux_full).backward()
    # Every rank's tokens reach this rank's experts: the sum over ranks of the reference's
    # gradient for them (one shard at a time, in float32, to the rank that holds it).
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
    schemes: dict[str, Step] = {"baseline": lambda t: baseline_forward(sharded, t)}
    for chunks in args.chunks:

        def layer_step(t: torch.Tensor, chunks: int = chunks) -> tuple[torch.Tensor, torch.Tensor]:
            sharded.expert_parallel_chunks = chunks
            return sharded(t)

        schemes[f"chunks{chunks}"] = layer_step
    errors: dict[str, dict[str, float]] = {}
    for scheme, step in schemes.items():
        x_ep = x.clone().requires_grad_()
        out_ep, aux_ep = step(x_ep)
        (out_ep * grad_out).float().sum().add(aux_ep).backward()
        errors[scheme] = {
            "out": max_rel(out_ep, out_full),
            "x.grad": max_rel(x_ep.grad, want_x),
            "aux_loss": max_rel(aux_ep, aux_full),
            "router.grad": max_rel(sharded.router.grad, want_router),
        }
        for n in expert_names:
            errors[scheme][f"{n}.grad"] = max_rel(getattr(sharded, n).grad, want_experts[n])
        sharded.zero_grad(set_to_none=True)
    del x_full, out_full, out_ep, x_ep, want_experts, want_router, want_x
    gathered: list[dict] = [{} for _ in range(world)]
    dist.all_gather_object(gathered, errors)
    worst = {s: {k: max(e[s][k] for e in gathered) for k in errors[s]} for s in errors}
    tolerance = TOLERANCE[dtype]
    passed = all(v <= tolerance for s in worst.values() for v in s.values())

    # 2. Step times and peak memory.
    def timed(step: Step, layer: DroplessMoE, inputs: torch.Tensor, together: bool) -> dict:
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        ms = clock.time_ms(step_fn(step, list(layer.parameters()), inputs), args.steps, together)
        return {"ms": ms, "peak_mib": peak_mib(device)}

    x_global = torch.cat([x] * world)
    steps_ms = {
        "one_device_T": timed(full, full, x, together=False),
        "one_device_WT": timed(full, full, x_global, together=False),
    }
    del x_global
    for scheme, step in schemes.items():
        steps_ms[f"ep_{scheme}"] = timed(step, sharded, x, together=True)

    syncs = (
        {k: host_syncs(v, list(sharded.parameters()), x) for k, v in schemes.items()}
        if device.type == "cuda"
        else None
    )

    # 3. Bytes and exchanges alone, from this step's routing.
    with torch.no_grad():
        top = sharded.route(x)[2]
    counts = exchange_counts(top, experts, world)
    per_rank_bytes = bytes_per_step(counts, rank, hidden, top_k, x.element_size())
    alone = {
        "baseline": exchanges_alone_ms(clock, counts, rank, hidden, dtype, device, args.steps, 1),
        "dedup": exchanges_alone_ms(clock, counts, rank, hidden, dtype, device, args.steps, 0),
    }

    everyone: list[dict] = [{} for _ in range(world)]
    dist.all_gather_object(
        everyone,
        {
            "steps": steps_ms,
            "bytes": per_rank_bytes,
            "exchanges_alone_ms": alone,
            "host_syncs_per_call": syncs,
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None)
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=None)
    parser.add_argument(
        "--tokens", type=int, default=None, help="tokens per rank (default: shape's)"
    )
    parser.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument(
        "--dtype", default=None, choices=("bfloat16", "float16", "float32", "float64")
    )
    parser.add_argument("--glu", action="store_true", help="gated experts (default: MLP)")
    parser.add_argument("--json", default=None, help="rank 0 writes the results here")
    args = parser.parse_args()
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    on_gpu = args.device == "cuda"
    args.shapes = args.shapes or (["qwen3", "dsv3"] if on_gpu else ["tiny"])
    args.steps = args.steps or (20 if on_gpu else 3)
    args.dtype = args.dtype or ("bfloat16" if on_gpu else "float32")

    dist.init_process_group("nccl" if on_gpu else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if on_gpu:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    clock = Clock(device)
    results = [run_shape(args, name, device, clock) for name in args.shapes]
    report = {
        "world": world,
        "device": torch.cuda.get_device_name(device) if on_gpu else "cpu",
        "backend": dist.get_backend(),
        "torch": torch.__version__,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if on_gpu else None,
        "chunks": args.chunks,
        "steps": args.steps,
        "results": results,
    }
    if rank == 0:
        for result in results:
            print(summary(result, world))
        print(json.dumps(report, indent=2))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=2)
    passed = all(r["equality"]["passed"] for r in results)
    dist.barrier()
    gc.collect()  # no layer may keep the process group alive past its destruction (gloo aborts)
    dist.destroy_process_group()
    if not passed:
        raise SystemExit(
            f"rank {rank}: the expert-parallel layer differs from the one-device layer"
        )


if __name__ == "__main__":
    main()
