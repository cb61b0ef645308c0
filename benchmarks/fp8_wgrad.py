"""Would FP8 weight gradients pay? The expert weights' gradient GEMMs in bf16 (ours, and torch's
``_grouped_mm``) beside ``torch._scaled_grouped_mm`` on rowwise FP8 operands, with the
quantization those operands need (JSON out).

A weight gradient reduces over the routed rows: out[e] = a[rows of e].T @ grad[rows of e]. In
FP8 both operands must be quantized along the rows (one scale per column per expert) and stored
with the rows contiguous: a transposing quantization of a (rows, m) and grad (rows, n), which
reads 2 bytes and writes 1 per element, once per step. Per GEMM (each shape's w1 and w2
gradients, uniform routing of T tokens): µs and TFLOP/s of our bf16 ``gmm_weight_grad``,
torch's bf16 ``_grouped_mm`` and its FP8 ``_scaled_grouped_mm`` (the GEMM alone, on operands
quantized beforehand), the time of our quantize ops over the same bytes with the same scales
(``ops.quantize`` of each expert's block of rows, transposed: torch wants every expert's rows in
one matrix, a layout no op of ours writes yet), and the FP8 path's total against ours in bf16;
with each result's relative error against float32 (Frobenius norm).

Usage (H200): ``python benchmarks/fp8_wgrad.py [--shapes qwen3,dsv3] [--json PATH]``.
``--device cpu --tokens 64`` is a smoke run (no torch FP8 kernel there: its columns are empty).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

import torch
from scaled_gmm_providers import _timer  # benchmarks/ (this script's directory)

import megablocks_core.ops as ops
from megablocks_core.calls import call
from megablocks_core.shapes import SHAPES

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0


def per_expert_rowwise(t: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, c) -> its transpose (c, rows) in E4M3, rows contiguous, and float32 scales (c *
    experts,) in torch's order for 2-D operands (expert-major): each column's amax over each
    expert's rows (uniform groups)."""
    rows, cols = t.shape
    blocks = t.float().view(experts, rows // experts, cols)
    scale = (blocks.abs().amax(1) / E4M3_MAX).clamp_min(2.0**-126)  # (experts, cols)
    data = (blocks / scale[:, None, :]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return data.view(rows, cols).t().contiguous(), scale.reshape(-1).contiguous()


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want).norm() / want.norm().clamp_min(1e-30))


def run(name: str, device: torch.device, tokens: int | None) -> list[dict[str, Any]]:
    t, hidden, ffn, experts, top_k = SHAPES[name]
    tokens = tokens or t
    rows = tokens * top_k // experts * experts  # uniform groups
    gen = torch.Generator(device=device).manual_seed(0)
    out = []
    for which, (m, n) in (("w1", (hidden, ffn)), ("w2", (ffn, hidden))):
        a = torch.randn(rows, m, device=device, generator=gen).bfloat16()
        grad = torch.randn(rows, n, device=device, generator=gen).bfloat16()
        row = one_gemm(a, grad, experts, _timer(device))
        row = {"shape": name, "gemm": f"{which} wgrad", **row}
        print(json.dumps(row), flush=True)
        out.append(row)
    return out


def one_gemm(
    a: torch.Tensor, grad: torch.Tensor, experts: int, timer: Callable[[Callable[[], Any]], float]
) -> dict[str, Any]:
    """One weight gradient's row: a (rows, m) and grad (rows, n) in uniform expert groups."""
    rows, m = a.shape
    n = grad.shape[1]
    counts = torch.full((experts,), rows // experts, dtype=torch.int64)
    offs = torch.cumsum(counts, 0).to(torch.int32).to(a.device)
    flops = 2.0 * rows * m * n
    groups = zip(a.split(rows // experts), grad.split(rows // experts), strict=True)
    want = torch.stack([x.float().t() @ g.float() for x, g in groups])
    row: dict[str, Any] = {"rows": rows, "m": m, "n": n}

    def ours() -> torch.Tensor:
        return call("gmm_weight_grad", a, grad, counts)

    row["bf16_us"] = timer(ours)
    row["bf16_error"] = _error(ours(), want)
    if a.is_cuda:
        grouped = getattr(torch, "_grouped_mm", None)
        scaled = getattr(torch, "_scaled_grouped_mm", None)
        qa, sa = per_expert_rowwise(a, experts)
        qg, sg = per_expert_rowwise(grad, experts)
        peers: dict[str, Callable[[], torch.Tensor]] = {}
        if grouped is not None:
            peers["torch_bf16"] = lambda: grouped(a.t(), grad, offs=offs, out_dtype=torch.bfloat16)
        if scaled is not None:
            peers["torch_fp8"] = lambda: scaled(
                qa, qg.t(), sa, sg, offs=offs, out_dtype=torch.bfloat16
            )
        for key, fn in peers.items():
            try:
                row[f"{key}_error"] = _error(fn(), want)
                row[f"{key}_us"] = timer(fn)
            except RuntimeError as exc:
                row[f"{key}_refused"] = str(exc).splitlines()[0]
    # Our quantize over the same bytes with the same scales: each expert's block of rows
    # reduced, the codes written with the rows contiguous, (experts, columns, rows) per block
    # (torch takes the rows of every expert in one (columns, rows) matrix instead).
    row["quantize_us"] = sum(
        timer(lambda v=v: ops.quantize(v.view(experts, rows // experts, -1).transpose(1, 2), 2,
                                       "fp8_rowwise"))
        for v in (a, grad)
    )  # fmt: skip
    for key in ("bf16", "torch_bf16", "torch_fp8"):
        if f"{key}_us" in row:
            row[f"{key}_tflops"] = flops / row[f"{key}_us"] / 1e6
    if "torch_fp8_us" in row:
        row["fp8_total_us"] = row["torch_fp8_us"] + row["quantize_us"]
        row["fp8_total_vs_bf16"] = row["bf16_us"] / row["fp8_total_us"]
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="qwen3,dsv3")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tokens", type=int, help="tokens per batch (default: each shape's)")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    rows = [r for name in args.shapes.split(",") for r in run(name, device, args.tokens)]
    meta = {"torch": torch.__version__, "argv": sys.argv[1:]}
    if device.type == "cuda":
        meta["gpu"] = torch.cuda.get_device_name(device)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
