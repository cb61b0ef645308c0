"""Host time to issue one MoE block's forward at decode sizes, the whole block beside its
experts call alone, for ``"megablocks"`` and transformers' ``"grouped_mm"`` (JSON out).

For each model (one decoder layer at its real widths, ``transformers_experts.build_model``),
token count and implementation: ``--calls`` forwards back to back under ``torch.no_grad()``
with no sync between them (the GPU's work at these sizes is far below the host's), wall time per
call; the median of ``--runs`` such runs. ``experts_host_ms`` calls the Experts module on a fixed
top-k routing, so the difference from ``block_host_ms`` is the block's router (transformers'
own). ``--fp8 FORMAT`` adds ``megablocks-fp8`` rows: ``"megablocks"`` with the experts' GEMMs in
FP8 (``integrations.transformers.use_fp8``, the weights quantized once while unchanged:
``Recipe(cache_weights=True)``, as inference would run it). Usage: ``python
benchmarks/decode_host.py [--models qwen3,gpt_oss] [--tokens 1,8,64] [--fp8 fp8_rowwise]
[--json PATH]``; ``--device cpu --tiny`` is a smoke run (its times mean nothing).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
import transformers_experts as bench

import megablocks_core.integrations.transformers as integration
from megablocks_core.formats import FORMAT_NAMES
from megablocks_core.fp8 import Recipe


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def host_ms(call: Callable[[], Any], calls: int, runs: int) -> float:
    """The median over ``runs`` of the wall ms per call of ``calls`` calls issued back to back."""
    for _ in range(30):
        call()
    _sync()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        times.append((time.perf_counter() - start) / calls * 1e3)
        _sync()
    return statistics.median(times)


def measure(
    block: torch.nn.Module,
    experts: torch.nn.Module,
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    calls: int,
    runs: int,
) -> dict[str, float]:
    """Host ms per forward of the block on ``x`` and of its experts on the same tokens."""
    tokens = x.view(-1, x.shape[-1])
    with torch.no_grad():
        return {
            "block_host_ms": host_ms(lambda: block(x), calls, runs),
            "experts_host_ms": host_ms(lambda: experts(tokens, ids, weights), calls, runs),
        }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="qwen3,gpt_oss")
    parser.add_argument("--tokens", default="1,8,64")
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--fp8", choices=FORMAT_NAMES, help="also megablocks in this format")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny widths (a smoke run)")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    implementations = ["megablocks", "grouped_mm"] + (["megablocks-fp8"] if args.fp8 else [])
    rows = []
    for name in args.models.split(","):
        model = bench.build_model(name, 4096, device, args.tiny)
        block, experts = bench._block(model), bench._experts(model)
        top_k = model.config.num_experts_per_tok
        for tokens in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(
                1, tokens, model.config.hidden_size, device=device, dtype=torch.bfloat16
            )
            ids = torch.stack(
                [torch.randperm(experts.num_experts, device=device)[:top_k] for _ in range(tokens)]
            )
            weights = torch.softmax(torch.randn(tokens, top_k, device=device), -1)
            weights = weights.to(torch.bfloat16)
            for implementation in implementations:
                fp8 = implementation == "megablocks-fp8"
                model.set_experts_implementation(implementation.removesuffix("-fp8"))
                integration.use_fp8(model, Recipe(args.fp8, cache_weights=True) if fp8 else None)
                row = {"model": name, "tokens": tokens, "implementation": implementation}
                row.update(measure(block, experts, x, ids, weights, args.calls, args.runs))
                print(row, flush=True)
                rows.append(row)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
