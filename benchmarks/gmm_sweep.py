"""Tile-config sweep of the Triton grouped GEMM against torch._grouped_mm and a dense matmul.

GPU only. For each benchmark shape (bf16 forward, (T*K, H) x (E, H, F)) it times the default
config and each candidate, checks every result against torch._grouped_mm, and appends one JSON
line per measurement to ``--out`` as it goes (so a run cut short still leaves its data).

Usage: ``python benchmarks/gmm_sweep.py --out sweep.jsonl [--shapes mixtral,qwen3,dsv3]``.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from megablocks_triton import gmm as G
from triton.testing import do_bench

from megablocks_core.shapes import SHAPES

# BM, BN, BK, GROUP_M, WARPS, STAGES, PROGRAMS_PER_SM
CANDIDATES = [
    (128, 256, 64, 8, 8, 3, 1),
    (128, 128, 64, 8, 4, 4, 1),
    (128, 128, 64, 8, 8, 4, 1),
    (128, 256, 64, 8, 8, 4, 1),
    (256, 128, 64, 8, 8, 3, 1),
    (64, 256, 64, 8, 4, 4, 1),
    (128, 128, 64, 8, 4, 4, 2),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--shapes", default="mixtral,qwen3,dsv3")
    args = parser.parse_args()
    out = open(args.out, "a")  # noqa: SIM115 - kept open to stream lines as they are measured

    def emit(**row: object) -> None:
        out.write(json.dumps(row) + "\n")
        out.flush()
        print(row, flush=True)

    for name in args.shapes.split(","):
        tokens, hidden, ffn, experts, top_k = SHAPES[name]
        gen = torch.Generator(device="cuda").manual_seed(0)
        logits = torch.randn(tokens, experts, device="cuda", generator=gen)
        top = torch.topk(logits, top_k).indices.flatten()
        counts = torch.bincount(top, minlength=experts)
        a = torch.randn(tokens * top_k, hidden, device="cuda", generator=gen).bfloat16()
        b = (
            torch.randn(experts, hidden, ffn, device="cuda", generator=gen) / hidden**0.5
        ).bfloat16()
        flops = 2.0 * tokens * top_k * hidden * ffn
        offs = counts.cumsum(0).int()
        want = torch._grouped_mm(a, b, offs=offs)
        dense_us = do_bench(lambda a=a, w=b[0]: a @ w, return_mode="median") * 1e3
        emit(shape=name, provider="dense", us=dense_us, tflops=flops / dense_us / 1e6)
        gm_us = (
            do_bench(lambda a=a, b=b, o=offs: torch._grouped_mm(a, b, offs=o), return_mode="median")
            * 1e3
        )
        emit(shape=name, provider="torch._grouped_mm", us=gm_us, tflops=flops / gm_us / 1e6)
        for cand in [None, *CANDIDATES]:
            config = None if cand is None else G.GmmConfig(*cand)
            for tma in (False, True):
                if cand is None and tma:
                    continue
                if config is not None:
                    config = G.GmmConfig(*cand, use_tma=tma)
                label = (
                    "default"
                    if cand is None
                    else ",".join(map(str, cand)) + (" tma" if tma else "")
                )
                try:
                    got = G.gmm(a, b, counts, False, config=config)
                    err = float((got.float() - want.float()).norm() / want.float().norm())
                    us = (
                        do_bench(
                            lambda a=a, b=b, n=counts, c=config: G.gmm(a, b, n, False, config=c),
                            return_mode="median",
                        )
                        * 1e3
                    )
                    emit(
                        shape=name,
                        provider=f"triton {label}",
                        us=us,
                        tflops=flops / us / 1e6,
                        rel_err=err,
                        vs_dense=dense_us / us,
                    )
                except Exception as exc:  # a config the compiler rejects is data too
                    emit(
                        shape=name,
                        provider=f"triton {label}",
                        error=f"{type(exc).__name__}: {exc}"[:300],
                    )
    out.close()


if __name__ == "__main__":
    os.environ.setdefault("TRITON_INTERPRET", "0")
    main()
