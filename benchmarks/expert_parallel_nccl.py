"""Expert parallelism on GPUs with NCCL: equality with the single-GPU layer, step time, all-to-all share.

Run on a host with W >= 2 GPUs (keep NCCL's NVLink multicast off there: NCCL_NVLS_ENABLE=0)::

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node=2 benchmarks/expert_parallel_nccl.py --json ep.json

Each rank draws its own tokens (seeded by rank) at the given shape (default: the qwen3 benchmark
shape, bf16, MLP experts as the benchmark's gmm). Checks, on every rank:

1. equality: the expert-parallel layer's output, input gradient and load-balancing loss equal the
   single-GPU layer's with all experts (same seed) on this rank's tokens; its local expert
   gradients equal the single-GPU layer's gradients for those experts summed over all ranks' tokens
   (an all-reduce of the reference's); bf16 tolerances, errors relative to the reference's max.
2. step time (forward + backward, CUDA events, median of --steps after warm-up) of
   (a) one GPU with all experts on T tokens, (b) W GPUs with E/W experts each on T tokens per rank,
   (c) one GPU with all experts on W*T tokens (the same global work as b).
3. the share of (b) spent in the all-to-all: the four row exchanges of one step (two forward, two
   backward) with this step's split sizes, timed alone (CUDA events, all ranks started together),
   over the step time; and, as a cross-check, the device time of NCCL kernels in a profiled step
   (that one also counts time spent waiting for the slower rank).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import torch.distributed as dist

from megablocks_core.layers import DroplessMoE
from megablocks_core.layers.shapes import SHAPES


def step_ms(layer: DroplessMoE, x: torch.Tensor, steps: int, sync_group: bool) -> float:
    """Median forward+backward time in ms (CUDA events; all ranks start each step together)."""
    times = []
    for i in range(steps + 3):
        if sync_group:
            dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out, aux = layer(x)
        (out.float().square().mean() + aux).backward()
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end))
        layer.zero_grad(set_to_none=True)
    return statistics.median(times)


def max_rel(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = want.float().abs().max().clamp_min(1e-30)
    return float((got.float() - want.float()).abs().max() / scale)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3", choices=sorted(SHAPES))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--json", default=None, help="rank 0 writes the results here")
    args = parser.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(device)
    tokens, hidden, ffn, experts, top_k = SHAPES[args.shape]
    dtype = torch.bfloat16

    gen = torch.Generator(device=device).manual_seed(1000 + rank)
    x = torch.randn(tokens, hidden, device=device, dtype=dtype, generator=gen)
    kwargs = dict(top_k=top_k, seed=0, dtype=dtype, device=device)
    full = DroplessMoE(hidden, ffn, experts, **kwargs)
    sharded = DroplessMoE(hidden, ffn, experts, expert_parallel_group=dist.group.WORLD, **kwargs)

    # 1. Equality with the single-GPU layer.
    x_full, x_ep = x.clone().requires_grad_(), x.clone().requires_grad_()
    grad_out = torch.randn(x.shape, device=device, dtype=dtype, generator=gen)
    out_full, aux_full = full(x_full)
    (out_full * grad_out).float().sum().add(aux_full).backward()
    out_ep, aux_ep = sharded(x_ep)
    (out_ep * grad_out).float().sum().add(aux_ep).backward()
    lo, hi = sharded.expert_offset, sharded.expert_offset + sharded.num_local_experts
    errors = {
        "out": max_rel(out_ep, out_full),
        "x.grad": max_rel(x_ep.grad, x_full.grad),
        "aux_loss": max_rel(aux_ep, aux_full),
        "router.grad": max_rel(sharded.router.grad, full.router.grad),
    }
    for name in ("w1", "w2"):
        want = getattr(full, name).grad.float()
        dist.all_reduce(want)  # every rank's tokens reach this rank's experts
        errors[f"{name}.grad"] = max_rel(getattr(sharded, name).grad, want[lo:hi])
    gathered: list[dict[str, float]] = [{} for _ in range(world)]
    dist.all_gather_object(gathered, errors)
    worst = {k: max(e[k] for e in gathered) for k in errors}
    tolerance = 2e-2  # bf16 outputs: sums of many bf16 products in a different order
    passed = all(v <= tolerance for v in worst.values())
    del x_full, x_ep, out_full, out_ep
    full.zero_grad(set_to_none=True)
    sharded.zero_grad(set_to_none=True)

    # 2. Step times.
    one_gpu_ms = step_ms(full, x, args.steps, sync_group=False)
    ep_ms = step_ms(sharded, x, args.steps, sync_group=True)
    x_global = torch.cat([x] * world)
    one_gpu_global_ms = step_ms(full, x_global, args.steps, sync_group=False)

    # 3a. The step's all-to-alls alone: same split sizes, rows of (hidden) bf16.
    with torch.no_grad():
        _, _, top = sharded.route(x)
        counts = torch.bincount(top.flatten().long(), minlength=experts).reshape(world, -1)
        recv = torch.empty_like(counts)
        dist.all_to_all_single(recv, counts)
        send_splits, recv_splits = counts.sum(1).tolist(), recv.sum(1).tolist()
    rows_out = torch.randn(sum(send_splits), hidden, device=device, dtype=dtype)
    rows_in = torch.empty(sum(recv_splits), hidden, device=device, dtype=dtype)

    def exchanges() -> None:  # forward: rows out, results back; backward: the same two, reversed
        for _ in range(2):
            dist.all_to_all_single(rows_in, rows_out, recv_splits, send_splits)
            dist.all_to_all_single(rows_out, rows_in, send_splits, recv_splits)

    a2a_times = []
    for i in range(args.steps + 3):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        exchanges()
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            a2a_times.append(start.elapsed_time(end))
    a2a_ms = statistics.median(a2a_times)

    # 3b. Cross-check: NCCL kernels' device time in profiled steps (warm, started together).
    from torch.profiler import ProfilerActivity, profile

    profiled = 5
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(profiled):
            dist.barrier()
            out, aux = sharded(x)
            (out.float().square().mean() + aux).backward()
            sharded.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
    events = prof.key_averages()
    nccl_us = sum(e.device_time_total for e in events if "nccl" in e.key.lower()) / profiled
    all_us = sum(e.device_time_total for e in events) / profiled
    shares: list[list[float]] = [[] for _ in range(world)]
    dist.all_gather_object(shares, [nccl_us, all_us, a2a_ms, float(sum(send_splits))])

    if rank == 0:
        result = {
            "shape": args.shape,
            "tokens_per_rank": tokens,
            "hidden": hidden,
            "ffn": ffn,
            "experts": experts,
            "top_k": top_k,
            "dtype": "bfloat16",
            "world": world,
            "gpu": torch.cuda.get_device_name(device),
            "torch": torch.__version__,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())),
            "equality": {"max_rel_error": worst, "tolerance": tolerance, "passed": passed},
            "step_ms": {
                "one_gpu_all_experts_T": one_gpu_ms,
                f"ep{world}_T_per_rank": ep_ms,
                f"one_gpu_all_experts_{world}T": one_gpu_global_ms,
            },
            "all_to_all_ms_per_step": [s[2] for s in shares],
            "all_to_all_share_of_ep_step": [s[2] / ep_ms for s in shares],
            "rows_sent_per_rank": [s[3] for s in shares],
            "profiled_nccl_kernel_us_per_step": [s[0] for s in shares],
            "profiled_device_kernel_us_per_step": [s[1] for s in shares],
        }
        print(json.dumps(result, indent=2))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
    dist.barrier()
    dist.destroy_process_group()
    if not passed:
        raise SystemExit(
            f"rank {rank}: expert-parallel layer differs from the single-GPU layer: {worst}"
        )


if __name__ == "__main__":
    main()
