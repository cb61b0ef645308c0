"""FP8 grouped GEMMs beside our bf16 ones and the peers, per GEMM of an expert MLP and for the
dMoE layer's training step, with each result's error against a float32 reference.

Per shape (``megablocks_core.shapes``: mixtral, qwen3, dsv3; T tokens, H hidden, F ffn, E
experts, top_k K), the two GEMMs of an expert MLP: ``up`` (the tokens read through the routing,
(T*K, H) x (E, H, F): gather_gmm) and ``down`` ((T*K, F) x (E, F, H): gmm). A data gradient has
one of these two shapes with the weights transposed, which the FP8 path quantizes into the same
layout, so these two cover forward and dgrad. Providers:

* ``bf16``: our gather_gmm / gmm; ``torch-bf16``: ``torch._grouped_mm`` (rows gathered first);
* ``fp8-<format>``: our scaled op on quantized operands (the GEMM alone), ``+quant`` with the
  row operand's quantization, ``+quant+weights`` with the weights' too (what a step pays
  without ``Recipe.cache_weights``);
* ``torch-fp8``: ``torch._scaled_grouped_mm`` rowwise (the GEMM alone), ``+quant`` with the
  rowwise quantization in eager torch ops (its usual companion);
* ``dense-bf16`` / ``dense-fp8``: one dense matmul of the same FLOPs (``torch.mm``,
  ``torch._scaled_mm`` rowwise): the rate the GEMMs are measured against.

Then each quantization pass alone against its ideal bytes at the copy bandwidth, and the layer
(``--layer``): a dMoE (GLU, SiLU) forward + backward in bf16 and in each FP8 recipe (uncached,
``+cached`` weights, and ``+cached+updated``: cached, with the weights changed every step as an
optimizer's update changes them; ``+wgrad``: the weight gradients in FP8 too, rowwise), with its
output's and gradients' error against a float32 copy of the layer. On a GPU also: the peak memory
allocated while the recipe's steps ran (``peak_gib``, the layer, its input and the error check's
float32 results included) and in one more step's forward alone (``forward_peak_gib``), and how
often the allocator had to free its cached blocks to serve an allocation after the first step
(``alloc_retries``). ``--kernels N`` adds one profiled step's N costliest kernels (``kernels``:
name, calls, µs).

Usage (GPU): ``python benchmarks/fp8_gemm.py --out fp8.jsonl [--shapes qwen3,dsv3,mixtral]
[--layer] [--tokens T] [--experts E]``; ``--experts`` below the shape's times one rank's slice
under expert parallelism (the same tokens and top_k, more rows per expert), and the rows name
such a shape ``<shape>-T<tokens>-E<experts>``. One JSON object per line, printed as measured. ``--device cpu --tiny`` runs the same
code at a tiny shape on the CPU (a smoke test: timings there mean nothing).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import torch

import megablocks_core.ops as ops
from megablocks_core.formats import FORMAT_NAMES, FORMATS
from megablocks_core.shapes import SHAPES

FP8_MAX = 448.0


def _timer(device: torch.device, reps: int) -> Callable[[Callable[[], Any]], float]:
    """Median µs of a call."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3

    def cpu(fn: Callable[[], Any]) -> float:
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2] * 1e6

    return cpu


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want||, in float32 one slice at a time (a dsv3 weight's gradient in
    float64 would take 60 GB)."""
    num = den = 0.0
    got, want = got.detach(), want.detach()
    for g, w in zip(got.split(1), want.split(1), strict=True):
        w = w.float()
        num += float((g.float() - w).square().sum())
        den += float(w.square().sum())
    return (num / max(den, 1e-60)) ** 0.5


def _rowwise_torch(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rowwise FP8 quantization in eager torch ops (amax, divide, clamp, cast)."""
    amax = x.abs().amax(dim=dim, keepdim=True).float().clamp_min(1e-12)
    scale = amax / FP8_MAX
    data = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return data, scale.squeeze(dim)


_SINK: list[Any] = []


def _emit(row: dict) -> None:
    """Print one result and append it to the output file at once (a run cut short keeps it)."""
    print(json.dumps(row), flush=True)
    for f in _SINK:
        f.write(json.dumps(row) + "\n")
        f.flush()


def _gemm_rows(name: str, shape: tuple[int, ...], device: torch.device, args: Any) -> list[dict]:
    tokens, hidden, ffn, experts, top_k = shape
    gen = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(tokens, experts, device=device, generator=gen)
    _, top = ops.router_topk(logits, top_k, True)
    indices, bin_ids, counts, bins, _ = ops.route(top.flatten(), experts, 128)
    rows = tokens * top_k
    x = torch.randn(tokens, hidden, device=device, generator=gen).bfloat16()
    w1 = (torch.randn(experts, hidden, ffn, device=device, generator=gen) / hidden**0.5).bfloat16()
    h = torch.randn(rows, ffn, device=device, generator=gen).bfloat16()
    w2 = (torch.randn(experts, ffn, hidden, device=device, generator=gen) / ffn**0.5).bfloat16()
    gathered = ops.gather(x, indices, bin_ids, bins, top_k)
    offs = bins.int()
    time_us = _timer(device, args.reps)
    out: list[dict] = []

    def emit(**row: Any) -> None:
        row = {"shape": name, **row}
        _emit(row)
        out.append(row)

    routing = (indices, bin_ids, bins, top_k)
    gemms = {
        # name: (row operand as the op reads it, weights, k, n, bf16 call, float32 reference)
        "up": (x, w1, hidden, ffn),
        "down": (h, w2, ffn, hidden),
    }
    for gemm, (a, w, k, n) in gemms.items():
        flops = 2.0 * rows * k * n
        a_rows = gathered if gemm == "up" else a
        reference = ops.gmm(a_rows.float(), w.float(), counts, False)

        def bf16_call(a: torch.Tensor = a, w: torch.Tensor = w, gemm: str = gemm) -> torch.Tensor:
            if gemm == "up":
                return ops.gather_gmm(a, w, *routing)
            return ops.gmm(a, w, counts)

        result = bf16_call()
        us = time_us(bf16_call)
        emit(
            gemm=gemm,
            provider="bf16",
            us=us,
            tflops=flops / us / 1e6,
            error=_rel(result, reference),
        )
        if device.type == "cuda":
            want = torch._grouped_mm(a_rows, w, offs=offs)
            us = time_us(lambda a_rows=a_rows, w=w: torch._grouped_mm(a_rows, w, offs=offs))
            error = _rel(want, reference)
            emit(gemm=gemm, provider="torch-bf16", us=us, tflops=flops / us / 1e6, error=error)
        for fmt in FORMAT_NAMES:
            qa, sa = ops.quantize(a, 1, fmt)
            qw, sw = ops.quantize(w.transpose(1, 2), 2, fmt)

            def scaled(qa=qa, sa=sa, qw=qw, sw=sw, gemm=gemm, fmt=fmt) -> torch.Tensor:
                if gemm == "up":
                    return ops.scaled_gather_gmm(qa, sa, qw, sw, *routing, True, None, fmt)
                return ops.scaled_gmm(qa, sa, qw, sw, counts, True, fmt)

            def with_rows(qw=qw, sw=sw, gemm=gemm, fmt=fmt, a=a) -> torch.Tensor:
                qa, sa = ops.quantize(a, 1, fmt)
                if gemm == "up":
                    return ops.scaled_gather_gmm(qa, sa, qw, sw, *routing, True, None, fmt)
                return ops.scaled_gmm(qa, sa, qw, sw, counts, True, fmt)

            def with_weights(gemm=gemm, fmt=fmt, a=a, w=w) -> torch.Tensor:
                qw, sw = ops.quantize(w.transpose(1, 2), 2, fmt)
                qa, sa = ops.quantize(a, 1, fmt)
                if gemm == "up":
                    return ops.scaled_gather_gmm(qa, sa, qw, sw, *routing, True, None, fmt)
                return ops.scaled_gmm(qa, sa, qw, sw, counts, True, fmt)

            error = _rel(scaled(), reference)
            for provider, fn in (
                (f"fp8-{fmt}", scaled),
                (f"fp8-{fmt}+quant", with_rows),
                (f"fp8-{fmt}+quant+weights", with_weights),
            ):
                us = time_us(fn)
                emit(gemm=gemm, provider=provider, us=us, tflops=flops / us / 1e6, error=error)
        if device.type == "cuda":
            qa, sa = _rowwise_torch(a_rows, 1)
            qwt, swt = _rowwise_torch(w.transpose(1, 2).contiguous(), 2)  # (E, n, k), per n

            def torch_fp8(qa=qa, sa=sa, qwt=qwt, swt=swt) -> torch.Tensor:
                return torch._scaled_grouped_mm(
                    qa, qwt.transpose(1, 2), sa, swt, offs=offs, out_dtype=torch.bfloat16
                )

            def torch_fp8_quant(a_rows=a_rows, qwt=qwt, swt=swt) -> torch.Tensor:
                qa, sa = _rowwise_torch(a_rows, 1)
                return torch._scaled_grouped_mm(
                    qa, qwt.transpose(1, 2), sa, swt, offs=offs, out_dtype=torch.bfloat16
                )

            error = _rel(torch_fp8(), reference)
            for provider, fn in (("torch-fp8", torch_fp8), ("torch-fp8+quant", torch_fp8_quant)):
                us = time_us(fn)
                emit(gemm=gemm, provider=provider, us=us, tflops=flops / us / 1e6, error=error)
            dense_a = torch.randn(rows, k, device=device, generator=gen).bfloat16()
            dense_b = (torch.randn(n, k, device=device, generator=gen) / k**0.5).bfloat16()
            us = time_us(lambda dense_a=dense_a, dense_b=dense_b: dense_a @ dense_b.t())
            emit(gemm=gemm, provider="dense-bf16", us=us, tflops=flops / us / 1e6)
            qa, sa = _rowwise_torch(dense_a, 1)
            qb, sb = _rowwise_torch(dense_b, 1)
            us = time_us(
                lambda qa=qa, qb=qb, sa=sa, sb=sb: torch._scaled_mm(
                    qa, qb.t(), sa[:, None], sb[None, :], out_dtype=torch.bfloat16
                )
            )
            emit(gemm=gemm, provider="dense-fp8", us=us, tflops=flops / us / 1e6)

    for row in quantize_rows(x, h, w1, w2, time_us):
        emit(**row)
    return out


def quantize_rows(
    x: torch.Tensor,
    h: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    time_us: Callable[[Callable[[], Any]], float],
    copy_us: Callable[[Callable[[], Any]], float] | None = None,
) -> list[dict[str, Any]]:
    """The quantization passes alone, in every format, against their ideal bytes at the copy
    bandwidth (a clone of a rows * hidden * 2-byte buffer, timed by ``copy_us``, else alike):
    the tokens x, the sorted rows h, the up weights w1 as the FP8 path reads them (transposed)
    and the down weights w2; then each weight in both layouts (quantize_both_ways against two
    quantize calls)."""
    big = torch.empty(h.shape[0] * x.shape[1] * 2, dtype=torch.uint8, device=x.device)
    bandwidth = 2 * big.numel() / (copy_us or time_us)(big.clone)  # bytes per µs, read + write
    rows = []
    for fmt in FORMAT_NAMES:
        for what, tensor, dim in (
            ("tokens", x, 1),
            ("rows", h, 1),
            ("w1-transposed", w1.transpose(1, 2), 2),
            ("w2", w2, 1),
        ):
            us = time_us(lambda t=tensor, d=dim, f=fmt: ops.quantize(t, d, f))
            ideal = tensor.numel() * 3 / bandwidth  # read 2 bytes, write 1 (scales: noise)
            rows.append({"quantize": what, "format": fmt, "us": us, "ideal_us": ideal,
                         "ratio": us / ideal})  # fmt: skip
        # Each weight in both layouts, as a step that updates it pays with cache_weights: one
        # quantize_both_ways against two quantize calls (ideal: read 2 bytes, write 1 + 1).
        for name, w in (("w1", w1), ("w2", w2)):
            ideal = w.numel() * 4 / bandwidth
            for what, both in (
                ("both-ways", lambda w=w, f=fmt: ops.quantize_both_ways(w, f)),
                ("two-calls", lambda w=w, f=fmt: (
                    ops.quantize(w, 2, f), ops.quantize(w.transpose(1, 2), 2, f))),
            ):  # fmt: skip
                us = time_us(both)
                rows.append({"quantize": f"{name}-{what}", "format": fmt, "us": us,
                             "ideal_us": ideal, "ratio": us / ideal})  # fmt: skip
    return rows


#: The scaled GEMM's tile candidates: (BM, BN, BK, GROUP_M, WARPS, STAGES, PROGRAMS_PER_SM,
#: flatten).
SWEEP = (
    (128, 128, 128, 8, 8, 4, 1, False),
    (128, 128, 128, 8, 8, 4, 1, True),
    (128, 256, 128, 8, 8, 3, 1, False),
    (128, 256, 128, 8, 8, 3, 1, True),
    (128, 128, 128, 8, 8, 3, 2, False),
    (128, 128, 128, 8, 4, 4, 1, False),
    (128, 128, 256, 8, 8, 3, 1, False),
    (256, 128, 128, 8, 8, 3, 1, False),
)


def _sweep_rows(name: str, shape: tuple[int, ...], device: torch.device, args: Any) -> None:
    """Each candidate tile of the scaled GEMM (``down``: sorted rows, no gather), each format,
    with the sum promoted every 128 k (the default) or left in the MMA's own accumulator."""
    from megablocks_triton import scaled
    from megablocks_triton.config import GmmConfig

    tokens, hidden, ffn, experts, top_k = shape
    gen = torch.Generator(device=device).manual_seed(2)
    top = torch.topk(torch.randn(tokens, experts, device=device, generator=gen), top_k).indices
    counts = torch.bincount(top.flatten(), minlength=experts)
    rows = tokens * top_k
    time_us = _timer(device, args.reps)
    for k, n in ((hidden, ffn), (ffn, hidden)):
        a = torch.randn(rows, k, device=device, generator=gen).bfloat16()
        w = (torch.randn(experts, n, k, device=device, generator=gen) / k**0.5).bfloat16()
        flops = 2.0 * rows * k * n
        for fmt in FORMAT_NAMES:
            qa, sa = ops.quantize(a, 1, fmt)
            qw, sw = ops.quantize(w, 2, fmt)
            want = ops.scaled_gmm(qa, sa, qw, sw, counts, True, fmt, "float32")
            for tile in SWEEP:
                for promote in (True, False):
                    if fmt == "fp8_blockwise" and (not promote or tile[2] > 128):
                        continue  # blockwise promotes every scale block by definition
                    bm, bn, bk, group, warps, stages, per_sm, flatten = tile
                    scaled.CONFIG_OVERRIDE = GmmConfig(
                        bm, bn, bk, group_m=group, num_warps=warps, num_stages=stages,
                        programs_per_sm=per_sm, use_tma=True, flatten=flatten,
                    )  # fmt: skip
                    scaled.PROMOTE_EVERY = scaled.SCALE_BLOCK if promote else None
                    scaled._SCALED_PLANS.clear()
                    try:
                        got = ops.scaled_gmm(qa, sa, qw, sw, counts, True, fmt, "float32")
                        us = time_us(
                            lambda qa=qa, sa=sa, qw=qw, sw=sw, fmt=fmt: ops.scaled_gmm(
                                qa, sa, qw, sw, counts, True, fmt
                            )
                        )
                        error = _rel(got, want)
                        status = "ok"
                    except Exception as exc:  # a tile over the chip's limits: noted, go on
                        us, error, status = float("nan"), float("nan"), repr(exc)[:200]
                    _emit(
                        {
                            "shape": name, "sweep": f"k{k}n{n}", "format": fmt,
                            "tile": "x".join(map(str, tile)), "promote": promote, "us": us,
                            "tflops": flops / us / 1e6, "diff_vs_default": error, "status": status,
                        }
                    )  # fmt: skip
    scaled.CONFIG_OVERRIDE = None
    scaled.PROMOTE_EVERY = scaled.SCALE_BLOCK
    scaled._SCALED_PLANS.clear()


def _layer_rows(name: str, shape: tuple[int, ...], device: torch.device, args: Any) -> list[dict]:
    from megablocks_core.fp8 import Recipe
    from megablocks_core.layers import MoEConfig, dMoE

    tokens, hidden, ffn, experts, top_k = shape
    time_us = _timer(device, args.reps)
    config = MoEConfig(
        hidden, ffn, experts, top_k, glu=True, activation="silu", dtype=torch.bfloat16,
        device=device, seed=1,
    )  # fmt: skip
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(tokens, hidden, device=device, generator=gen)
    want: dict[str, torch.Tensor] = {}
    if args.layer_errors:
        # The float32 copy and its gradients are four times the bf16 weights (DeepSeek-V3's do
        # not fit beside them on one GPU): kept only as the four tensors the errors need.
        reference = dMoE(config, dtype=torch.float32)
        xr = x.clone().requires_grad_()
        out, _ = reference(xr)
        out.backward(torch.ones_like(out))
        want = {
            "out": out.detach(),
            "dx": xr.grad,
            "dw1": reference.w1.grad,
            "dw2": reference.w2.grad,
        }
        del reference, out, xr
    recipes: list[tuple[str, Any]] = [("bf16", None)]
    for fmt in FORMAT_NAMES:
        cached = Recipe(fmt, cache_weights=True)
        recipes += [
            (fmt, Recipe(fmt)),
            (f"{fmt}+cached", cached),
            (f"{fmt}+cached+updated", cached),
        ]
        if FORMATS[fmt].grouped_columns:  # the weight gradients in FP8 too
            cached = Recipe(fmt, cache_weights=True, weight_grad="fp8")
            recipes += [
                (f"{fmt}+wgrad", Recipe(fmt, weight_grad="fp8")),
                (f"{fmt}+cached+wgrad", cached),
                (f"{fmt}+cached+updated+wgrad", cached),
            ]
    if args.recipes is not None:
        unknown = set(args.recipes) - {label for label, _ in recipes}
        if unknown:
            raise SystemExit(f"--recipes: no recipe {', '.join(sorted(unknown))}")
        recipes = [(label, recipe) for label, recipe in recipes if label in args.recipes]
    rows = [
        _layer_row(name, label, dMoE(config, fp8=recipe), x, want, time_us, args.kernels)
        for label, recipe in recipes
    ]
    return rows


def _layer_row(
    name: str,
    label: str,
    layer: Any,
    x: torch.Tensor,
    want: dict[str, torch.Tensor],
    time_us: Any,
    kernels: int = 0,
) -> dict:
    """One recipe's training step, timed; the layer is freed on return (one on the GPU at a time).
    A ``+updated`` label: each step marks the weights changed (their version counters, as an
    optimizer step's in-place update does, without its time), so a cached recipe quantizes them
    again. ``kernels``: also one more step's costliest kernels (ops on the CPU), that many."""
    updated = "+updated" in label
    xb = x.bfloat16().requires_grad_()
    on_gpu = x.device.type == "cuda"
    if on_gpu:
        torch.cuda.reset_peak_memory_stats(x.device)

    def forward() -> torch.Tensor:
        if updated:
            for weight in (layer.w1, layer.w2):
                torch.autograd.graph.increment_version(weight)
        layer.zero_grad(set_to_none=True)
        xb.grad = None
        out, aux = layer(xb)
        return out.float().sum() + aux

    def step() -> None:
        forward().backward()

    step()
    retries = torch.cuda.memory_stats(x.device).get("num_alloc_retries", 0) if on_gpu else 0
    errors = {}
    if want:
        out, _ = layer(xb)
        got = {"out": out, "dx": xb.grad, "dw1": layer.w1.grad, "dw2": layer.w2.grad}
        errors = {f"error_{key}": _rel(got[key], want[key]) for key in want}
    row = {"shape": name, "layer": "glu-silu", "recipe": label, "us": time_us(step), **errors}
    if on_gpu:
        row["peak_gib"] = torch.cuda.max_memory_allocated(x.device) / 2**30
        # Allocations the caching allocator could serve only after freeing its cached blocks
        # (each a device synchronization) after the first step: a step near the memory's limit.
        row["alloc_retries"] = (
            torch.cuda.memory_stats(x.device).get("num_alloc_retries", 0) - retries
        )
        torch.cuda.reset_peak_memory_stats(x.device)  # one more step, its forward's peak alone
        loss = forward()
        row["forward_peak_gib"] = torch.cuda.max_memory_allocated(x.device) / 2**30
        loss.backward()
    if kernels:
        row["kernels"] = _costliest_kernels(step, on_gpu, kernels)
    _emit(row)
    return row


def _costliest_kernels(step: Callable[[], Any], on_gpu: bool, count: int) -> list[dict]:
    """One profiled step's ``count`` costliest kernels (on the CPU, ops): name (cut at 90
    characters), calls and total µs, the costliest first; where a step's time goes beside the
    per-GEMM rows."""
    from torch.profiler import ProfilerActivity, profile

    activity = ProfilerActivity.CUDA if on_gpu else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        step()
        if on_gpu:
            torch.cuda.synchronize()
    events = prof.key_averages()
    key = "self_device_time_total" if on_gpu else "self_cpu_time_total"
    costliest = sorted(events, key=lambda e: getattr(e, key), reverse=True)[:count]
    return [{"name": e.key[:90], "calls": e.count, "us": getattr(e, key)} for e in costliest]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON lines file (appended)")
    parser.add_argument("--shapes", default="qwen3,dsv3,mixtral")
    parser.add_argument("--tokens", type=int, default=None, help="tokens (default: the shape's)")
    parser.add_argument(
        "--experts", type=int, default=None,
        help="experts (default: the shape's); fewer experts at the same tokens and top_k is one "
        "rank's slice under expert parallelism, with more rows per expert",
    )  # fmt: skip
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="the tiny shape only (smoke test)")
    parser.add_argument("--layer", action="store_true", help="also the dMoE training step")
    parser.add_argument("--no-gemms", action="store_true", help="skip the per-GEMM rows")
    parser.add_argument(
        "--no-layer-errors", dest="layer_errors", action="store_false",
        help="time the layer without its float32 copy (which DeepSeek-V3's memory cannot hold)",
    )  # fmt: skip
    parser.add_argument(
        "--recipes", type=lambda v: v.split(","), default=None,
        help="the layer's recipes, a comma list (default: all): bf16, <format>, "
        "<format>+cached, <format>+cached+updated (the weights changed every step), each "
        "rowwise one +wgrad (the weight gradients in FP8)",
    )  # fmt: skip
    parser.add_argument(
        "--kernels", type=int, default=0, metavar="N",
        help="the layer rows also list one profiled step's N costliest kernels (ops on the CPU)",
    )  # fmt: skip
    parser.add_argument("--reps", type=int, default=3, help="repetitions on the CPU")
    parser.add_argument("--sweep", action="store_true", help="also the scaled GEMM's tile sweep")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    names = ["tiny"] if args.tiny else args.shapes.split(",")
    with open(args.out, "a") as f:
        _SINK.append(f)
        try:
            for name in names:
                tokens, hidden, ffn, experts, top_k = SHAPES[name]
                if args.experts is not None and args.experts < top_k:
                    parser.error(f"--experts {args.experts} is fewer than {name}'s top_k {top_k}")
                tokens = tokens if args.tokens is None else args.tokens
                experts = experts if args.experts is None else args.experts
                shape = (tokens, hidden, ffn, experts, top_k)
                if shape != SHAPES[name]:  # the rows say which shape they timed
                    name = f"{name}-T{shape[0]}-E{shape[3]}"
                if args.sweep:
                    _sweep_rows(name, shape, device, args)
                if not args.no_gemms:
                    _gemm_rows(name, shape, device, args)
                if args.layer:
                    _layer_rows(name, shape, device, args)
        finally:
            _SINK.remove(f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
