"""How far FP8 training ends from bf16's, against how far bf16 ends from itself (JSON out).

A small GLU dMoE (bf16 weights, hidden 32, ffn 64, 8 experts, top 2) fits a fixed random
teacher with Adam, the problem of ``tests/test_fp8.py``'s training test, once per seed and
run: ``bf16``; ``bf16+ulp``, the same start with one in ten weights moved by one bf16 ulp (the
noise of the problem itself: a start no one could tell apart ends this far away); ``float32``;
each FP8 format (its recipe's defaults: forward and data gradients in FP8); and ``<format>+wgrad``
for the formats that define FP8 weight gradients (``Recipe(weight_grad="fp8")``). Each run's
final loss is the mean squared error on the whole data set of the layer as trained (an FP8
layer evaluated in FP8), and its gap is relative to the same seed's bf16 loss. The summary
gives each run's mean gap over the seeds, its standard error, the largest gap and how many
seeds end more than 1 % above bf16.

Usage: ``python benchmarks/fp8_loss_gap.py [--seeds 5-12] [--steps 200] [--json PATH]``
(the reference backend on the CPU: about 10 s a run).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch

import megablocks_core
from megablocks_core import fp8
from megablocks_core.formats import FORMAT_NAMES, FORMATS
from megablocks_core.layers import MoEConfig, dMoE

HIDDEN, FFN, EXPERTS, TOP_K = 32, 64, 8, 2
SAMPLES, BATCH = 512, 64
#: The share of weights moved by one ulp in the ``bf16+ulp`` run.
PERTURBED = 0.1


def problem() -> tuple[torch.Tensor, torch.Tensor]:
    """The data and a fixed random teacher's targets (the same for every seed)."""
    torch.manual_seed(0)
    teacher = torch.nn.Sequential(
        torch.nn.Linear(HIDDEN, 64), torch.nn.Tanh(), torch.nn.Linear(64, HIDDEN)
    )
    data = torch.randn(SAMPLES, HIDDEN)
    with torch.no_grad():
        return data, teacher(data)


def _move_one_ulp(layer: torch.nn.Module, seed: int) -> None:
    """Add one to the bits of a random tenth of each bf16 weight (one ulp away from zero)."""
    gen = torch.Generator().manual_seed(1000 + seed)
    with torch.no_grad():
        for param in layer.parameters():
            if param.dtype == torch.bfloat16:
                moved = torch.rand(param.shape, generator=gen) < PERTURBED
                param.view(torch.int16).add_(moved.to(torch.int16))


def final_loss(run: str, seed: int, steps: int) -> float:
    """Train one run of one seed for ``steps`` steps; its loss on the whole data set."""
    data, target = problem()
    dtype = torch.float32 if run == "float32" else torch.bfloat16
    fmt, _, option = run.partition("+")
    weight_grad = "fp8" if option == "wgrad" else "input"
    recipe = fp8.Recipe(fmt, weight_grad=weight_grad) if fmt in FORMAT_NAMES else None
    config = MoEConfig(
        HIDDEN, FFN, EXPERTS, TOP_K, glu=True, activation="silu", fp8=recipe, seed=seed, dtype=dtype
    )
    layer = dMoE(config)
    if run == "bf16+ulp":
        _move_one_ulp(layer, seed)
    optimizer = torch.optim.Adam(layer.parameters(), lr=1e-3, eps=1e-6)
    for step in range(steps):
        start = (step * BATCH) % SAMPLES
        out, aux = layer(data[start : start + BATCH].to(dtype))
        loss = torch.nn.functional.mse_loss(out.float(), target[start : start + BATCH])
        optimizer.zero_grad()
        (loss + aux).backward()
        optimizer.step()
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(layer(data.to(dtype))[0].float(), target))


def summary(gaps: list[float]) -> dict[str, Any]:
    """Mean gap (%), its standard error, the largest and how many exceed 1 %."""
    return {
        "mean_pct": statistics.fmean(gaps),
        "stderr_pct": statistics.stdev(gaps) / len(gaps) ** 0.5 if len(gaps) > 1 else None,
        "max_pct": max(gaps),
        "over_1pct": sum(g > 1.0 for g in gaps),
        "seeds": len(gaps),
    }


def _seeds(text: str) -> list[int]:
    if "-" in text:
        first, last = text.split("-")
        return list(range(int(first), int(last) + 1))
    return [int(s) for s in text.split(",")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="5-12", help="a range (5-12) or a list (5,6,7)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--backend", default="reference")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    runs = ["bf16+ulp", "float32", *FORMAT_NAMES]
    runs += [f"{name}+wgrad" for name in FORMAT_NAMES if FORMATS[name].grouped_columns]
    rows = []
    started = time.perf_counter()
    with megablocks_core.use_backend(args.backend):
        for seed in _seeds(args.seeds):
            bf16 = final_loss("bf16", seed, args.steps)
            row: dict[str, Any] = {"seed": seed, "bf16_loss": bf16, "gap_pct": {}}
            for run in runs:
                row["gap_pct"][run] = 100.0 * (final_loss(run, seed, args.steps) / bf16 - 1.0)
            print(json.dumps(row), flush=True)
            rows.append(row)
    result = {
        "meta": {
            "torch": torch.__version__,
            "argv": sys.argv[1:] if argv is None else argv,
            "backend": args.backend,
            "steps": args.steps,
            "seconds": time.perf_counter() - started,
        },
        "rows": rows,
        "summary": {run: summary([r["gap_pct"][run] for r in rows]) for run in runs},
    }
    print(json.dumps(result["summary"], indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
