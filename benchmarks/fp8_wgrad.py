"""Do FP8 weight gradients pay? The expert weights' gradient GEMMs in bf16 (ours, and torch's
``_grouped_mm``) beside ours in FP8 and ``torch._scaled_grouped_mm``, with the quantization
the FP8 operands need (JSON out).

A weight gradient reduces over the routed rows: out[e] = a[rows of e].T @ grad[rows of e]. In
FP8 both operands are quantized along the rows (one scale per column per expert) and stored with
the rows contiguous: ``ops.quantize_transposed`` of a (rows, m) and grad (rows, n), which reads 2
bytes and writes 1 per element. Per GEMM (each shape's w1 and w2 gradients, T tokens routed
uniformly unless ``--routing`` says otherwise): µs and TFLOP/s of our bf16 ``gmm_weight_grad``,
our ``scaled_gmm_weight_grad`` (the kernel the ranking takes, and the Triton kernel beside it,
with whether their outputs are equal), torch's bf16 ``_grouped_mm`` and its FP8
``_scaled_grouped_mm`` on the same FP8 operands (the GEMMs alone), the two quantize calls' time
and bandwidth, and our FP8 total against ours in bf16; with each result's relative error against
float32 (Frobenius norm).

Usage (H200): ``python benchmarks/fp8_wgrad.py [--shapes qwen3,dsv3] [--json PATH]``.
``--routing routed`` spreads the rows over the experts as a random router does (uneven groups,
starting anywhere) instead of equally: a layer's groups, where the kernels meet partial chunks.
Each row also times the FP8 GEMM on the same quantized groups moved to start on 128-row
boundaries with zero rows between them (``fp8_aligned``: no partial chunk; the GEMM alone).
``--quantize-tiles 64x128x4x1,64x32x2x3`` also times the Triton ``quantize_transposed`` of both
operands at each (rows, columns) tile, warps and loop stages given, each checked bit for bit
against the ranked kernel's outputs.
Each row also times the GEMM's gathered operand (w1's rows of x; w2's output gradient, weighted)
as gather then ``quantize_transposed`` beside ``gather_quantize_transposed``, which reads the
token rows through the indices, and the FP8 total against bf16 with the gather each pays.
``--device cpu --tokens 64`` is a smoke run (no torch kernels there: their columns are empty).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
from scaled_gmm_providers import _timer  # benchmarks/ (this script's directory)

import megablocks_core.ops as ops
from megablocks_core import use_backend
from megablocks_core.calls import call

try:  # the Triton backend's switch between its two FP8 weight-gradient kernels
    from megablocks_triton import scaled as scaled_module
except ImportError:  # pragma: no cover - the Triton plugin is part of every benchmark setup
    scaled_module = None
from megablocks_core.shapes import SHAPES


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want).norm() / want.norm().clamp_min(1e-30))


Tile = tuple[int, int, int, int]


def run(
    name: str,
    device: torch.device,
    tokens: int | None,
    tiles: Sequence[Tile] = (),
    dtype: torch.dtype = torch.bfloat16,
    routing: str = "uniform",
) -> list[dict[str, Any]]:
    t, hidden, ffn, experts, top_k = SHAPES[name]
    tokens = tokens or t
    counts = expert_counts(tokens, experts, top_k, routing)
    rows = int(counts.sum())
    gen = torch.Generator(device=device).manual_seed(0)
    out = []
    for which, (m, n) in (("w1", (hidden, ffn)), ("w2", (ffn, hidden))):
        a = torch.randn(rows, m, device=device, generator=gen).to(dtype)
        grad = torch.randn(rows, n, device=device, generator=gen).to(dtype)
        row = {"routing": routing, **one_gemm(a, grad, counts, _timer(device))}
        # In the layer, w1's row operand is x's rows gathered, w2's the output gradient's rows
        # gathered and weighted: the FP8 recipe quantizes them as it reads them.
        gathered = (a, "a", False) if which == "w1" else (grad, "grad", True)
        row.update(gathered_operand(*gathered, top_k, counts, _timer(device)))
        row["fp8_gathered_total_vs_bf16"] = (row["bf16_us"] + row["gather_us"]) / (
            row["fp8_us"] + row[f"quantize_{'grad' if which == 'w1' else 'a'}_us"]
            + row["gathered_quantize_us"]
        )  # fmt: skip
        if tiles:
            row["quantize_tiles"] = _tile_sweep(a, grad, counts, tiles, _timer(device))
        row = {"shape": name, "gemm": f"{which} wgrad", **row}
        print(json.dumps(row), flush=True)
        out.append(row)
    return out


def expert_counts(tokens: int, experts: int, top_k: int, routing: str) -> torch.Tensor:
    """Rows per expert (int64, on the host): ``uniform``, tokens * top_k // experts each (every
    group starts on a multiple of it); ``routed``, each token's top_k of random logits, as a
    freshly initialised router spreads them (uneven groups, starting anywhere: the weight
    gradient's kernels then meet partial chunks at both ends of a group)."""
    if routing == "uniform":
        return torch.full((experts,), tokens * top_k // experts, dtype=torch.int64)
    gen = torch.Generator().manual_seed(0)
    picks = torch.randn(tokens, experts, generator=gen).topk(top_k, dim=1).indices
    return torch.bincount(picks.flatten(), minlength=experts)


def one_gemm(
    a: torch.Tensor,
    grad: torch.Tensor,
    counts: torch.Tensor,
    timer: Callable[[Callable[[], Any]], float],
) -> dict[str, Any]:
    """One weight gradient's row: a (rows, m) and grad (rows, n) in expert groups of ``counts``
    rows (on the host)."""
    rows, m = a.shape
    n = grad.shape[1]
    offs = torch.cumsum(counts, 0).to(torch.int32).to(a.device)
    flops = 2.0 * rows * m * n
    sizes = counts.tolist()
    groups = zip(a.split(sizes), grad.split(sizes), strict=True)
    want = torch.stack([x.float().t() @ g.float() for x, g in groups])
    row: dict[str, Any] = {"rows": rows, "m": m, "n": n}

    def ours() -> torch.Tensor:
        return call("gmm_weight_grad", a, grad, counts)

    row["bf16_us"] = timer(ours)
    row["bf16_error"] = _error(ours(), want)
    # Ours in FP8: both operands quantized per expert column, then the scaled weight gradient
    # (on Hopper the Gluon kernel where it serves; the Triton kernel beside it).
    qa, sa = ops.quantize_transposed(a, counts, "fp8_rowwise")
    qg, sg = ops.quantize_transposed(grad, counts, "fp8_rowwise")
    for key, v in (("a", a), ("grad", grad)):
        row[f"quantize_{key}_us"] = timer(
            lambda v=v: ops.quantize_transposed(v, counts, "fp8_rowwise")
        )
    row["quantize_us"] = row["quantize_a_us"] + row["quantize_grad_us"]
    row["quantize_gbps"] = rows * (m + n) * 3 / row["quantize_us"] / 1e3  # read 2, write 1

    def ours_fp8() -> torch.Tensor:
        return ops.scaled_gmm_weight_grad(qa, sa, qg, sg, counts, "fp8_rowwise")

    row["fp8_error"] = _error(ours_fp8(), want)
    row["fp8_us"] = timer(ours_fp8)
    gluon_out = ours_fp8()
    scaled_module.WGRAD_WARP_SPECIALIZED = False
    try:
        row["fp8_triton_us"] = timer(ours_fp8)
        row["fp8_triton_equals"] = bool(torch.equal(ours_fp8(), gluon_out))
    finally:
        scaled_module.WGRAD_WARP_SPECIALIZED = True
    row["fp8_total_us"] = row["fp8_us"] + row["quantize_us"]
    row["fp8_total_vs_bf16"] = row["bf16_us"] / row["fp8_total_us"]
    # The same quantized groups moved to starts on 128-row boundaries, zero rows between them:
    # what the GEMM alone would take if its operands were laid out so (no partial chunk).
    (pa, pg), padded = _aligned_groups((qa, qg), counts, ALIGNED_ROWS)
    row["aligned_rows"] = pa.shape[1]

    def aligned_fp8() -> torch.Tensor:
        return ops.scaled_gmm_weight_grad(pa, sa, pg, sg, padded, "fp8_rowwise")

    row["fp8_aligned_error"] = _error(aligned_fp8(), want)
    row["fp8_aligned_us"] = timer(aligned_fp8)
    if a.is_cuda:
        grouped = getattr(torch, "_grouped_mm", None)
        scaled = getattr(torch, "_scaled_grouped_mm", None)
        peers: dict[str, Callable[[], torch.Tensor]] = {}
        if grouped is not None:
            peers["torch_bf16"] = lambda: grouped(a.t(), grad, offs=offs, out_dtype=torch.bfloat16)
        if scaled is not None:  # the same FP8 operands: torch's scales are expert-major rows
            peers["torch_fp8"] = lambda: scaled(
                qa, qg.t(), sa.reshape(-1), sg.reshape(-1), offs=offs, out_dtype=torch.bfloat16
            )
        for key, fn in peers.items():
            try:
                row[f"{key}_error"] = _error(fn(), want)
                row[f"{key}_us"] = timer(fn)
            except RuntimeError as exc:
                row[f"{key}_refused"] = str(exc).splitlines()[0]
    for key in ("bf16", "torch_bf16", "torch_fp8", "fp8", "fp8_triton", "fp8_aligned"):
        if f"{key}_us" in row:
            row[f"{key}_tflops"] = flops / row[f"{key}_us"] / 1e6
    return row


#: The row boundary ``fp8_aligned`` starts each group on: the weight gradient's chunk depth.
ALIGNED_ROWS = 128


def _aligned_groups(
    operands: Sequence[torch.Tensor], counts: torch.Tensor, align: int
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Transposed operands (columns, rows) with each expert's group of rows moved to start on a
    multiple of ``align``, zero rows after it up to the next; and the groups' padded counts."""
    padded = (counts + align - 1) // align * align
    starts = torch.cumsum(padded, 0) - padded
    group = torch.repeat_interleave(torch.arange(counts.shape[0]), counts)
    within = torch.arange(int(counts.sum())) - (torch.cumsum(counts, 0) - counts)[group]
    target = (starts[group] + within).to(operands[0].device)
    moved = []
    for t in operands:
        out = torch.zeros(t.shape[0], int(padded.sum()), dtype=torch.uint8, device=t.device)
        out.index_copy_(1, target, t.view(torch.uint8))
        moved.append(out.view(t.dtype))
    return moved, padded


def gathered_operand(
    sorted_rows: torch.Tensor,
    which: str,
    weighted: bool,
    top_k: int,
    counts: torch.Tensor,
    timer: Callable[[Callable[[], Any]], float],
) -> dict[str, Any]:
    """An operand of ``sorted_rows``' shape read from token rows through a random permutation
    (groups of ``counts`` rows): µs of gather, of gather then quantize_transposed (what the
    weight gradient in bf16 gathers, and FP8 quantizes, before this op) and of
    gather_quantize_transposed, with whether the last two's outputs are equal."""
    rows, width = sorted_rows.shape
    gen = torch.Generator(device=sorted_rows.device).manual_seed(1)
    tokens = rows // top_k
    x = torch.randn(tokens, width, device=sorted_rows.device, generator=gen).to(sorted_rows.dtype)
    indices = torch.randperm(rows, device=x.device, generator=gen).int()
    weights = torch.rand(rows, device=x.device, generator=gen) if weighted else None
    bins = torch.cumsum(counts, 0).int().to(x.device)
    bin_ids = torch.repeat_interleave(torch.arange(counts.shape[0]), counts).to(x.device)
    gather = (x, indices, bin_ids.int(), weights, bins, top_k, None)

    def composed() -> tuple[torch.Tensor, torch.Tensor]:
        return ops.quantize_transposed(call("gather", *gather), counts, "fp8_rowwise")

    def fused() -> tuple[torch.Tensor, torch.Tensor]:
        return call(
            "gather_quantize_transposed", x, indices, weights, top_k, counts, None, "fp8_rowwise",
            None,
        )  # fmt: skip

    (want, want_scale), (got, got_scale) = composed(), fused()
    fused_us = timer(fused)
    return {
        "gathered_operand": which,
        "gathered_weighted": weighted,
        "gather_us": timer(lambda: call("gather", *gather)),
        "gather_then_quantize_us": timer(composed),
        "gathered_quantize_us": fused_us,
        "gathered_quantize_equals": bool(
            torch.equal(want.view(torch.uint8), got.view(torch.uint8))
            and torch.equal(want_scale, got_scale)
        ),
        "gathered_quantize_gbps": rows * width * 3 / fused_us / 1e3,  # read 2, write 1
    }


def _tile_sweep(
    a: torch.Tensor,
    grad: torch.Tensor,
    counts: torch.Tensor,
    tiles: Sequence[Tile],
    timer: Callable[[Callable[[], Any]], float],
) -> dict[str, dict[str, Any]]:
    """Both operands' Triton quantize_transposed at each tile: µs, and outputs equal to the
    ranked kernel's."""
    want = [ops.quantize_transposed(v, counts, "fp8_rowwise") for v in (a, grad)]
    module = scaled_module
    saved = (module.TRANSPOSED_TILE, module.TRANSPOSED_WARPS, module.TRANSPOSED_STAGES)
    out: dict[str, dict[str, Any]] = {}
    try:
        for rows, columns, warps, stages in tiles:
            module.TRANSPOSED_TILE, module.TRANSPOSED_WARPS = (rows, columns), warps
            module.TRANSPOSED_STAGES = stages
            module._TRANSPOSED_PLANS.clear()
            with use_backend("triton"):
                got = [ops.quantize_transposed(v, counts, "fp8_rowwise") for v in (a, grad)]
                us = sum(
                    timer(lambda v=v: ops.quantize_transposed(v, counts, "fp8_rowwise"))
                    for v in (a, grad)
                )
            equal = all(
                torch.equal(g.view(torch.uint8), w.view(torch.uint8)) and torch.equal(gs, ws)
                for (g, gs), (w, ws) in zip(got, want, strict=True)
            )
            out[f"{rows}x{columns}x{warps}x{stages}"] = {"us": us, "equals": equal}
    finally:
        module.TRANSPOSED_TILE, module.TRANSPOSED_WARPS, module.TRANSPOSED_STAGES = saved
        module._TRANSPOSED_PLANS.clear()
    return out


def _tiles(value: str) -> list[Tile]:
    tiles = []
    for item in value.split(","):
        parts = [int(p) for p in item.split("x")]
        if len(parts) != 4:
            raise argparse.ArgumentTypeError(f"a tile is ROWSxCOLUMNSxWARPSxSTAGES; got {item!r}")
        tiles.append((parts[0], parts[1], parts[2], parts[3]))
    return tiles


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="qwen3,dsv3")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tokens", type=int, help="tokens per batch (default: each shape's)")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument(
        "--quantize-tiles", type=_tiles, default=[], metavar="RxCxWxS,...",
        help="also time the Triton quantize_transposed at these tiles (rows x columns x warps x "
        "loop stages)",
    )  # fmt: skip
    parser.add_argument(
        "--dtype", choices=("bfloat16", "float16"), default="bfloat16",
        help="the operands' dtype (the CPU interpreter's Triton kernels take float16)",
    )  # fmt: skip
    parser.add_argument(
        "--routing", choices=("uniform", "routed"), default="uniform",
        help="rows per expert: equal (every group aligned), or as a random router spreads them",
    )  # fmt: skip
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    rows = [
        r
        for name in args.shapes.split(",")
        for r in run(name, device, args.tokens, args.quantize_tiles, dtype, args.routing)
    ]
    meta = {"torch": torch.__version__, "argv": sys.argv[1:]}
    if device.type == "cuda":
        meta["gpu"] = torch.cuda.get_device_name(device)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
