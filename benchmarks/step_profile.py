"""Where a dMoE training step's time goes: device time per kernel, grouped by the layer's parts.

Runs ``DroplessMoE`` forward + backward under ``torch.profiler`` for a few steps after warm-up and
reports, per step, each kernel's time and count and their sum per part of the layer. The
backward starts from a fixed upstream gradient of the output (``out.backward(grad)``, what a
model's next layer hands back; as ``megablocks bench --ops layer``), so every kernel is the
layer's own; ``--float-loss`` takes the loss ``out.float().square().mean() + aux`` instead (the
harness of runs before 2026-12-01, whose own kernels then land in ``copies``, ``activations``
or ``other``). Parts:

* ``expert GEMMs``: the grouped GEMMs (``_gmm_kernel``: forward and x-gradients, and the FP8
  ``_scaled_gmm_kernel``; another provider's grouped kernels, its weight gradients included),
  ``weight gradients`` (``_gmm_wgrad_kernel``), ``quantization`` (``--fp8``: the operands'
  quantize passes);
* ``permutation`` (gathers, scatters, the inverse permutation), ``top-k weights' gradient``
  (the row dots, ``_wgrad_kernel``), ``routing`` (router top-k, sort, histogram, scans),
  ``activations`` (GELU, SiLU, ReLU, the gate × up product, ``activation_backward``: the MLP's
  activation in backward with the rows' weighting and the top-k weights' gradient), ``copies`` (dtype casts and
  copies), ``dense GEMMs`` (the router's matmuls), ``communication`` (NCCL), ``other``.

Parts go by kernel name only.

On a GPU the times are the CUDA kernels'; on the CPU (no CUDA) the operators' own CPU time, so
the script runs anywhere (the CPU figures say little about a GPU). The step time beside it comes
from CUDA events (or the wall clock) over steps run without the profiler; on a GPU, the peak
of allocated memory over those steps (``peak_allocated_mib``: the layer's parameters, input and
gradients included) beside it.

    python benchmarks/step_profile.py [--shape qwen3] [--glu] [--fuse-grad-accumulation]
        [--fp8 fp8_rowwise [--cache-weights] [--gather-first on|off]] [--tokens N] [--steps 3] [--float-loss]
        [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from megablocks_core.fp8 import Recipe
from megablocks_core.layers import DroplessMoE
from megablocks_core.shapes import SHAPES

#: (part, name fragments), first match wins; names are lower-cased kernel or operator names.
PARTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("communication", ("nccl", "rccl", "all_to_all", "allgather", "reduce_scatter")),
    ("quantization", ("quantize",)),
    ("weight gradients", ("gmm_wgrad", "weight_grad")),
    ("top-k weights' gradient", ("_wgrad_kernel", "scatter_wgrad")),
    ("expert GEMMs", ("_gmm_kernel", "gather_gmm", "gmm_scatter", "grouped", "::gmm")),
    ("routing", ("router", "topk", "sort", "histogram", "scan", "cumsum", "softmax", "counting")),
    ("permutation", ("gather", "scatter", "_inverse", "index_select", "index_copy")),
    (
        "activations",
        ("gelu", "silu", "relu", "glu", "sigmoid", "activation", "::mul", "mulfunctor"),
    ),
    ("copies", ("copy", "::to", "memcpy", "memset", "fill")),
    ("dense GEMMs", ("gemm", "nvjet", "cutlass", "matmul", "::mm", "addmm", "linear")),
)


def part_of(name: str) -> str:
    """The layer part a kernel or operator name belongs to (``other`` when none matches)."""
    lowered = name.lower()
    for part, fragments in PARTS:
        if any(fragment in lowered for fragment in fragments):
            return part
    return "other"


def make_layer(
    args: argparse.Namespace, device: torch.device
) -> tuple[DroplessMoE, torch.Tensor, torch.Tensor | None]:
    """The layer, its input and the upstream gradient of its output (None: ``--float-loss``)."""
    tokens, hidden, ffn, experts, top_k = SHAPES[args.shape]
    tokens = args.tokens or tokens
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    layer = DroplessMoE(
        hidden_size=hidden,
        ffn_hidden_size=ffn,
        num_experts=experts,
        top_k=top_k,
        glu=args.glu,
        activation="silu" if args.glu else "gelu",
        dtype=dtype,
        device=device,
        grad_accumulation_fusion=args.fuse_grad_accumulation,
        fp8=None if args.fp8 is None else Recipe(args.fp8, cache_weights=args.cache_weights),
    )
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=gen).to(device, dtype)
    grad = None if args.float_loss else torch.randn(tokens, hidden, generator=gen).to(device, dtype)
    return layer, x.requires_grad_(), grad


def step(layer: DroplessMoE, x: torch.Tensor, grad: torch.Tensor | None) -> None:
    out, aux = layer(x)
    if grad is None:
        (out.float().square().mean() + aux).backward()
    elif aux.requires_grad:  # the load-balancing loss joins the upstream gradient
        torch.autograd.backward([out, aux], [grad, torch.ones_like(aux)])
    else:
        out.backward(grad)


def step_ms(
    layer: DroplessMoE,
    x: torch.Tensor,
    grad: torch.Tensor | None,
    steps: int,
    device: torch.device,
) -> float:
    """Mean time of one step (gradients accumulate into ``.grad`` as in gradient accumulation)."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            step(layer, x, grad)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / steps
    begin = time.perf_counter()
    for _ in range(steps):
        step(layer, x, grad)
    return (time.perf_counter() - begin) * 1e3 / steps


def kernel_times(
    run: Callable[[], None], steps: int, device: torch.device
) -> dict[str, dict[str, float]]:
    """{name: {"ms": per step, "calls": per step}} of every kernel (CUDA) or operator (CPU) over
    ``steps`` calls of ``run`` (one training step each)."""
    on_gpu = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            run()
        if on_gpu:
            torch.cuda.synchronize()
    totals: dict[str, dict[str, float]] = defaultdict(lambda: {"ms": 0.0, "calls": 0.0})
    for event in prof.key_averages():
        if on_gpu:
            if event.device_type != torch.autograd.DeviceType.CUDA:
                continue
            self_us = event.self_device_time_total
        else:
            self_us = event.self_cpu_time_total
        if self_us <= 0:
            continue
        totals[event.key]["ms"] += self_us / 1e3 / steps
        totals[event.key]["calls"] += event.count / steps
    return dict(totals)


def summarise(kernels: dict[str, dict[str, float]]) -> dict[str, float]:
    """ms per step of each layer part, largest first."""
    parts: dict[str, float] = defaultdict(float)
    for name, row in kernels.items():
        parts[part_of(name)] += row["ms"]
    return dict(sorted(parts.items(), key=lambda item: -item[1]))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3")
    parser.add_argument("--tokens", type=int, default=None, help="default: the shape's")
    parser.add_argument("--glu", action="store_true", help="gated (SwiGLU) experts")
    parser.add_argument("--fuse-grad-accumulation", action="store_true")
    parser.add_argument("--fp8", choices=("fp8_rowwise", "fp8_blockwise"), default=None)
    parser.add_argument(
        "--cache-weights", action="store_true", help="with --fp8: keep the quantized weights"
    )
    parser.add_argument(
        "--gather-first",
        choices=("on", "off"),
        default=None,
        help="with --fp8: the triton backend's scaled.GATHER_FIRST (default: its own, on): "
        "gathered rows copied first, for the plain rows' kernel (the copies are filed under "
        "permutation), or the gathering kernels",
    )
    parser.add_argument(
        "--float-loss",
        action="store_true",
        help="backward from out.float().square().mean() + aux (the harness before 2026-12-01)",
    )
    parser.add_argument("--steps", type=int, default=3, help="profiled (and timed) steps")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--top", type=int, default=20, help="kernels printed")
    parser.add_argument("--json", default=None, help="write the result here")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    if args.gather_first is not None and args.fp8 is None:
        parser.error("--gather-first takes --fp8")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.gather_first is None:
        return profile_step(args)
    from megablocks_triton import scaled

    with scaled.gather_first(args.gather_first == "on"):
        return profile_step(args)


def gather_first_setting() -> bool | None:
    """Whether the triton backend copies gathered FP8 rows first during the step
    (scaled.GATHER_FIRST; None without that backend)."""
    try:
        from megablocks_triton import scaled
    except ImportError:
        return None
    return scaled.GATHER_FIRST


def profile_step(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    layer, x, grad = make_layer(args, device)
    for _ in range(args.warmup):
        step(layer, x, grad)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    timed = step_ms(layer, x, grad, args.steps, device)
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    kernels = kernel_times(lambda: step(layer, x, grad), args.steps, device)
    parts = summarise(kernels)
    result = {
        "shape": args.shape,
        "tokens": x.shape[0],
        "glu": args.glu,
        "fuse_grad_accumulation": args.fuse_grad_accumulation,
        "fp8": args.fp8,
        "cache_weights": args.cache_weights,
        "gather_first": gather_first_setting() if args.fp8 else None,
        "harness": "float loss" if args.float_loss else "upstream gradient",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "time_kind": "CUDA kernels" if device.type == "cuda" else "CPU operators (self time)",
        "step_ms": timed,
        "peak_allocated_mib": peak,
        "busy_ms": sum(parts.values()),
        "parts_ms": parts,
        "kernels": dict(sorted(kernels.items(), key=lambda item: -item[1]["ms"])),
    }
    print(
        f"{args.shape} T={x.shape[0]} glu={args.glu} fused accumulation="
        f"{args.fuse_grad_accumulation} on {result['device']}: step {timed:.3f} ms, "
        f"{result['time_kind']} {result['busy_ms']:.3f} ms per step"
        + ("" if peak is None else f", peak allocated {peak:.0f} MiB")
    )
    for part, ms in parts.items():
        print(f"  {part:<26} {ms:9.3f} ms")
    print(f"top {args.top} ({result['time_kind']}, per step):")
    for name, row in list(result["kernels"].items())[: args.top]:
        print(f"  {row['ms']:9.3f} ms  x{row['calls']:5.1f}  [{part_of(name)}] {name[:80]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
