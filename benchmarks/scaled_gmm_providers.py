"""FP8 scaled_gmm providers side by side: triton's kernels, ``torch._scaled_grouped_mm``, and the
one the core's ranking picks, on the same quantized operands.

Each model's two expert GEMMs (up: hidden to ffn, two ffn for gated experts; down: ffn to hidden)
on plain rows (no gather), ``fp8_rowwise``, b stored (E, n, k), uniform groups of the rows a
16384-token batch gives each expert, and an eighth of that. Per row: µs and TFLOP/s of each
(the GEMM alone, ``do_bench`` median), the largest difference of torch's output from triton's
relative to the output's largest element, and which provider ``ops.scaled_gmm`` chose. The
triton backend's own choice (``triton``: on Hopper the warp-specialized Gluon kernel where its
launch path takes it, ``triton_kernel`` says which) is timed beside its Triton kernel forced
(``triton_plain``); their outputs must be equal bit for bit.

``--gather``: the same GEMMs with their rows gathered from the tokens (``scaled_gather_gmm``, as
an FP8 layer's up projection and the gradient of its down projection run them; softmax-free
uniform top-k routing of 16384 tokens and an eighth of that): the gathering kernels
(``scaled.GATHER_FIRST`` off: the triton backend's choice of them beside its Triton kernel;
torch has no gathering FP8 GEMM) and the rows copied into sorted order first for the plain
rows' kernel (``GATHER_FIRST`` on, the rowwise format's default, ``gather_first_*``: the copies'
time included).

``--format fp8_blockwise``: the blockwise format instead (no torch peer).

``--bias``: plain rows also timed with a per-expert bias (``triton_bias_us``, the triton
backend's choice): what the bias adds to the GEMM.

``--gluon-max-k K``: the arch table's ``gluon_scaled_max_k`` replaced by K for this run, to
measure the Gluon kernel beside the Triton one at depths the table keeps from it (the
``*-dgrad`` GEMMs are the data gradients' shapes: k and n of the forward swapped).

Usage (H200): ``python benchmarks/scaled_gmm_providers.py [--gemms qwen3-up,...] [--gather]
[--format F] [--json PATH]``.
``--device cpu --tiny`` is a smoke run of the same code (triton's kernel under the interpreter
when TRITON_INTERPRET=1; torch's has no CPU kernel, so its columns are empty there).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

import megablocks_core
import megablocks_core.ops as ops
from megablocks_core.contracts import BY_NAME
from megablocks_core.dispatch import describe_call, explain, explain_call

try:
    from megablocks_triton import scaled
except ImportError:  # pragma: no cover - the triton backend is what this compares
    raise SystemExit("needs megablocks-triton") from None


def time_triton_kernels(
    name: str,
    op: Callable[[], torch.Tensor],
    op_name: str,
    row: dict[str, Any],
    flops: float,
    timer: Callable[[Callable[[], Any]], float],
) -> torch.Tensor:
    """The triton backend's choice for ``op`` and its Triton kernel forced, on the same call:
    which kernel it chose (``triton_kernel``), their outputs checked equal, µs and TFLOP/s of
    each (``triton_*``, ``triton_plain_*``). Returns the output."""

    def triton() -> torch.Tensor:
        with megablocks_core.use_backend(**{op_name: "triton"}):
            return op()

    def triton_plain() -> torch.Tensor:
        scaled.WARP_SPECIALIZED = False
        try:
            return triton()
        finally:
            scaled.WARP_SPECIALIZED = True

    scaled._SCALED_PLANS.clear()  # this call's plan only, to tell which kernel it chose
    reference = triton()
    gluon = any(isinstance(p, scaled._WarpSpecializedPlan) for p in scaled._SCALED_PLANS.values())
    row["triton_kernel"] = "gluon" if gluon else "triton"
    if not torch.equal(triton_plain(), reference):
        raise SystemExit(f"{name}: the Gluon kernel's output differs from the Triton kernel's")
    for key, fn in (("triton", triton), ("triton_plain", triton_plain)):
        row[key + "_us"] = timer(fn)
        row[key + "_tflops"] = flops / row[key + "_us"] / 1e6
    return reference


#: name -> (experts, k, n, rows per expert at 16384 tokens)
GEMMS: dict[str, tuple[int, int, int, int]] = {
    "qwen3-up": (128, 2048, 1536, 1024),
    "qwen3-down": (128, 768, 2048, 1024),
    "olmoe-up": (64, 2048, 2048, 2048),
    "olmoe-down": (64, 1024, 2048, 2048),
    "dsv3-up": (256, 7168, 4096, 512),
    "dsv3-down": (256, 2048, 7168, 512),
    "mixtral-up": (8, 4096, 28672, 4096),
    "mixtral-down": (8, 14336, 4096, 4096),
    "dsv3-up-dgrad": (256, 4096, 7168, 512),
    "dsv3-down-dgrad": (256, 7168, 2048, 512),
    "mixtral-up-dgrad": (8, 28672, 4096, 4096),
    "mixtral-down-dgrad": (8, 4096, 14336, 4096),
    "gpt_oss-up": (32, 2880, 5760, 2048),
    "gpt_oss-down": (32, 2880, 2880, 2048),
}
TINY = {"tiny": (4, 64, 48, 32)}
#: The operands' format unless ``--format`` says: torch's peer takes fp8_rowwise only.
FORMAT = "fp8_rowwise"


def _timer(device: torch.device) -> Callable[[Callable[[], Any]], float]:
    if device.type == "cuda":
        from triton.testing import do_bench

        return lambda fn: float(do_bench(fn, warmup=10, rep=100, return_mode="median")) * 1e3
    import time

    def cpu(fn: Callable[[], Any]) -> float:
        began = time.perf_counter()
        fn()
        return (time.perf_counter() - began) * 1e6

    return cpu


def _operands(
    rows: int, shape: tuple[int, int, int, int], fmt: str, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Generator]:
    """(qa, sa, qb, sb, generator): ``rows`` random rows of k and the experts' (E, n, k)
    matrices, quantized in ``fmt`` (the generator goes on to draw the routing)."""
    experts, k, n, _ = shape
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(rows, k, device=device, generator=gen).bfloat16()
    w = (torch.randn(experts, n, k, device=device, generator=gen) / k**0.5).bfloat16()
    qa, sa = ops.quantize(a, 1, fmt, "e4m3fn")
    qb, sb = ops.quantize(w, 2, fmt, "e4m3fn")
    return qa, sa, qb, sb, gen


def run_gemm(
    name: str,
    shape: tuple[int, int, int, int],
    divisor: int,
    device: torch.device,
    fmt: str = FORMAT,
    bias: bool = False,
) -> dict[str, Any]:
    experts, k, n, per_expert = shape
    rows_per_expert = max(per_expert // divisor, 1)
    timer = _timer(device)
    qa, sa, qb, sb, _ = _operands(experts * rows_per_expert, shape, fmt, device)
    sizes = torch.full((experts,), rows_per_expert, dtype=torch.int32, device=device)
    args = (qa, sa, qb, sb, sizes, True, fmt, "bfloat16")
    flops = 2.0 * experts * rows_per_expert * k * n
    row: dict[str, Any] = {"gemm": name, "rows_per_expert": rows_per_expert, "format": fmt}

    reference = time_triton_kernels(
        name, lambda: ops.scaled_gmm(*args), "scaled_gmm", row, flops, timer
    )
    if bias:
        per_expert_bias = torch.randn(experts, n, device=device).bfloat16()
        with megablocks_core.use_backend(scaled_gmm="triton"):
            row["triton_bias_us"] = timer(lambda: ops.scaled_gmm(*args, per_expert_bias))
        row["bias_cost"] = row["triton_bias_us"] / row["triton_us"]
    scaled_grouped_mm = getattr(torch, "_scaled_grouped_mm", None)
    if device.type == "cuda" and scaled_grouped_mm is not None and fmt == "fp8_rowwise":
        offs = torch.cumsum(sizes, 0, dtype=torch.int32)

        def torch_fp8() -> torch.Tensor:
            return scaled_grouped_mm(  # type: ignore[no-any-return]
                qa, qb.transpose(1, 2), sa.view(-1), sb.view(experts, n), offs=offs,
                out_dtype=torch.bfloat16,
            )  # fmt: skip

        got = torch_fp8().float()
        scale = reference.float().abs().max().clamp_min(1e-30)
        row["torch_max_rel_diff"] = float((got - reference.float()).abs().max() / scale)
        row["torch_us"] = timer(torch_fp8)
        row["torch_tflops"] = flops / row["torch_us"] / 1e6
        row["torch_speedup"] = row["triton_us"] / row["torch_us"]
    trace = explain("scaled_gmm", qa.device, {"a": qa.dtype, "b": qb.dtype})
    kernel, _ = explain_call(trace, describe_call(BY_NAME["scaled_gmm"], args))
    row["ranked"] = None if kernel is None else f"{kernel.backend}:{kernel.variant or 'default'}"
    row["ranked_us"] = timer(lambda: ops.scaled_gmm(*args))
    return row


def run_gathered(
    name: str,
    shape: tuple[int, int, int, int],
    divisor: int,
    device: torch.device,
    fmt: str = FORMAT,
) -> dict[str, Any]:
    experts, k, n, per_expert = shape
    batch = TOKENS if name != "tiny" else 64
    top_k = max(per_expert * experts // batch, 1)
    tokens = max(batch // divisor, 1)
    timer = _timer(device)
    qx, sx, qw, sw, gen = _operands(tokens, shape, fmt, device)
    choice = torch.rand(tokens, experts, device=device, generator=gen).topk(top_k, 1).indices
    ids = torch.sort(choice.flatten(), stable=True).indices.int()
    bins = torch.cumsum(torch.bincount(choice.flatten(), minlength=experts), 0).int()
    args = (qx, sx, qw, sw, ids, ids, bins, top_k, True, None, fmt, "bfloat16")
    flops = 2.0 * tokens * top_k * k * n
    row: dict[str, Any] = {
        "gemm": name, "tokens": tokens, "top_k": top_k, "rows_per_expert": tokens * top_k // experts,
        "format": fmt,
    }  # fmt: skip
    with scaled.gather_first(False):
        reference = time_triton_kernels(
            name, lambda: ops.scaled_gather_gmm(*args), "scaled_gather_gmm", row, flops, timer
        )
    time_gather_first(name, lambda: ops.scaled_gather_gmm(*args), reference, row, flops, timer)
    return row


def time_gather_first(
    name: str,
    op: Callable[[], torch.Tensor],
    reference: torch.Tensor,
    row: dict[str, Any],
    flops: float,
    timer: Callable[[Callable[[], Any]], float],
) -> None:
    """The triton backend's gathered GEMM with ``scaled.GATHER_FIRST`` on: whether it copied
    the rows first (``gather_first_taken``: where plain rows of the shape take the Gluon
    kernel), its output checked equal to ``reference``, µs and TFLOP/s (copies included) and
    the speedup over the call without it (``triton_us``)."""
    with scaled.gather_first(True), megablocks_core.use_backend(scaled_gather_gmm="triton"):
        got = op()
        row["gather_first_taken"] = any(
            isinstance(p, scaled._GatherFirstPlan) for p in scaled._SCALED_PLANS.values()
        )
        if not torch.equal(got, reference):
            raise SystemExit(f"{name}: the rows copied first give another output")
        row["gather_first_us"] = timer(op)
    row["gather_first_tflops"] = flops / row["gather_first_us"] / 1e6
    row["gather_first_speedup"] = row["triton_us"] / row["gather_first_us"]


@contextlib.contextmanager
def gluon_max_k(max_k: int | None) -> Iterator[None]:
    """The Gluon kernel's k bound replaced inside the block (None: the arch table's); the plans
    made with either bound are dropped on the way in and out."""
    table_row = scaled.arch_tuning

    def patched(info: Any) -> Any:
        return dataclasses.replace(table_row(info), gluon_scaled_max_k=max_k)

    if max_k is not None:
        scaled.arch_tuning = patched
    scaled._SCALED_PLANS.clear()
    try:
        yield
    finally:
        scaled.arch_tuning = table_row
        scaled._SCALED_PLANS.clear()


#: The batch the GEMMS' rows per expert are of.
TOKENS = 16384


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gemms", default=",".join(GEMMS))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="one tiny GEMM (a smoke run)")
    parser.add_argument("--gather", action="store_true", help="rows gathered from the tokens")
    parser.add_argument("--format", default=FORMAT, choices=("fp8_rowwise", "fp8_blockwise"))
    parser.add_argument("--bias", action="store_true", help="plain rows timed with a bias too")
    parser.add_argument("--gluon-max-k", type=int, metavar="K")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    table = TINY if args.tiny else {g: GEMMS[g] for g in args.gemms.split(",")}
    rows = []
    with gluon_max_k(args.gluon_max_k):
        for name, shape in table.items():
            for divisor in (1, 8):
                if args.gather:
                    rows.append(run_gathered(name, shape, divisor, device, args.format))
                else:
                    rows.append(run_gemm(name, shape, divisor, device, args.format, args.bias))
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    for r in rows:
        if args.gather:
            print(
                f"{r['gemm']:<14}{r['rows_per_expert']:>6} rows/expert (gathered)  triton "
                f"{r['triton_tflops']:>6.0f} TFLOP/s ({r['triton_kernel']}; Triton kernel "
                f"{r['triton_plain_tflops']:.0f}; rows copied first "
                f"{r['gather_first_tflops']:.0f}{'' if r['gather_first_taken'] else ', not taken'})"
            )
            continue
        torch_part = (
            f"torch {r['torch_tflops']:>6.0f} ({r['torch_speedup']:.2f}x)"
            if "torch_us" in r
            else ""
        )
        print(
            f"{r['gemm']:<14}{r['rows_per_expert']:>6} rows/expert  triton "
            f"{r['triton_tflops']:>6.0f} TFLOP/s ({r['triton_kernel']}; Triton kernel "
            f"{r['triton_plain_tflops']:.0f})  {torch_part:<24} ranked {r['ranked']}"
            + (f"  with a bias {r['bias_cost']:.3f}x" if "bias_cost" in r else "")
        )
    if args.json:
        meta = {
            "gluon_max_k": args.gluon_max_k,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__,
        }
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
