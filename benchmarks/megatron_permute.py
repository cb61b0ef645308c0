"""Megatron-Core's token permutation: its fused path on megablocks-core against its own unfused
torch path, and both against the ideal-bytes limit.

Megatron-Core's ``moe_utils.permute`` / ``unpermute`` with ``fused=True`` call Transformer
Engine's functions; :func:`megablocks_core.integrations.megatron.install` serves them with
megablocks-core's ops. Each row calls Megatron's own function (``fused=True``: ours;
``fused=False``: Megatron's torch code) on the same routing: softmax top-k of random logits at the
shape's (T, H, E, K), bf16 tokens, fp32 probabilities. The index form (top-k expert ids) and the
padded form (each expert's rows rounded up to ``align``) go through
:mod:`megablocks_core.integrations.transformer_engine` (Megatron's unfused path has neither; for
padding it rewrites the routing map with ``pad_routing_map`` instead, a different computation,
timed beside for scale). Transformer Engine's padded signature reads the padded size on the host
(a sync inside the timed call); the ``static bound`` rows give the same permutation through the
core's ops with a bound known without it.

``limit_us``: the op's ideal bytes (each input read once, each output written once; the routing
map and indices not counted) at the bandwidth of a device copy of the permuted rows measured in
the same run; ``vs_limit`` = time / limit (target ≤ 1.2). ``check``: ours against Megatron's
unfused result (permute exact; unpermute within bf16 tolerance). ``round trip``: permute →
unpermute forward and backward (what a training step pays), ours / Megatron's.

Usage: ``python benchmarks/megatron_permute.py [--shapes mixtral,qwen3,dsv3] [--json PATH]``
(CUDA; ``--device cpu --tokens 64`` is a smoke run).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

import megablocks_core.ops as ops
from megablocks_core.integrations import megatron as mcore_adapter
from megablocks_core.integrations import transformer_engine as te
from megablocks_core.shapes import SHAPES

ALIGNS = (16, 128)


@dataclass
class Row:
    shape: str
    op: str
    provider: str
    us: float
    limit_us: float | None
    vs_limit: float | None
    check: str


def _timer(device: torch.device) -> Callable[[Callable[[], Any]], float]:
    if device.type == "cuda":
        from triton.testing import do_bench

        return lambda fn: float(do_bench(fn, warmup=25, rep=200, return_mode="median")) * 1e3

    def cpu(fn: Callable[[], Any]) -> float:
        fn()
        samples = []
        for _ in range(5):
            began = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - began) * 1e6)
        return statistics.median(samples)

    return cpu


def _compare(got: torch.Tensor, want: torch.Tensor, exact: bool) -> str:
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    if exact:
        return "ok" if torch.equal(got, want) else "differs"
    scale = want.float().abs().max().item()
    err = (got.float() - want.float()).abs().max().item() / max(scale, 1e-30)
    return "ok" if err <= 2e-2 else f"off by {err:.3g}"


def run_shape(
    name: str, tokens: int, hidden: int, experts: int, top_k: int, device: torch.device
) -> list[Row]:
    from megatron.core.transformer.moe import moe_utils

    timer = _timer(device)
    gen = torch.Generator(device="cpu").manual_seed(0)
    probs_full = torch.softmax(torch.randn(tokens, experts, generator=gen), -1)
    top_probs, ids = torch.topk(probs_full, top_k, dim=-1)
    mask = torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, ids, True)
    probs = torch.zeros(tokens, experts).scatter_(1, ids, top_probs)
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
    x, mask, probs, ids, top_probs = (t.to(device) for t in (x, mask, probs, ids, top_probs))
    rows = tokens * top_k
    es, ps = x.element_size(), probs.element_size()
    src = torch.randn(rows, hidden, device=device, dtype=x.dtype)
    dst = torch.empty_like(src)
    copy_us = timer(lambda s=src, d=dst: d.copy_(s))
    bandwidth = 2 * src.numel() * es / copy_us  # bytes per µs
    del src, dst
    out: list[Row] = []

    def add(op: str, provider: str, fn: Callable[[], Any], nbytes: int | None, check: str) -> None:
        us = timer(fn)
        limit = None if nbytes is None else nbytes / bandwidth
        out.append(Row(name, op, provider, us, limit, None if limit is None else us / limit, check))
        print(f"  {asdict(out[-1])}", file=sys.stderr, flush=True)

    def permute(fused: bool, with_probs: bool) -> Any:
        return moe_utils.permute(
            x, mask, probs=probs if with_probs else None, num_out_tokens=rows, fused=fused
        )

    permute_bytes = (tokens + rows) * hidden * es
    for with_probs in (False, True):
        op = "permute, mask" + (" + probs" if with_probs else "")
        nbytes = permute_bytes + (2 * rows * ps if with_probs else 0)
        want = permute(False, with_probs)
        got = permute(True, with_probs)
        check = _compare(got[0], want[0], exact=True)
        if with_probs:
            check += "; probs " + _compare(got[1], want[1], exact=True)
        add(
            op, "megablocks-core (fused=True)", lambda p=with_probs: permute(True, p), nbytes, check
        )
        add(op, "Megatron unfused", lambda p=with_probs: permute(False, p), nbytes, "reference")

    # Unpermute with probs (the combine): the permuted rows come from each path's own permute.
    permuted_ours, _, map_ours = permute(True, False)
    permuted_theirs, _, map_theirs = permute(False, False)

    def unpermute(fused: bool) -> torch.Tensor:
        rows_in, row_map = (permuted_ours, map_ours) if fused else (permuted_theirs, map_theirs)
        return moe_utils.unpermute(
            rows_in, row_map, x.shape, probs=probs, routing_map=mask, fused=fused
        )

    nbytes = (rows + tokens) * hidden * es + rows * ps
    check = _compare(unpermute(True), unpermute(False), exact=False)
    add(
        "unpermute, mask + probs",
        "megablocks-core (fused=True)",
        lambda: unpermute(True),
        nbytes,
        check,
    )
    add(
        "unpermute, mask + probs", "Megatron unfused", lambda: unpermute(False), nbytes, "reference"
    )

    # The index form: (tokens, top_k) expert ids, Transformer Engine's map_type="index".
    def permute_index() -> tuple[torch.Tensor, torch.Tensor]:
        return te.moe_permute(x, ids, rows, map_type="index", num_experts=experts)

    permuted_index, map_index = permute_index()
    check = _compare(permuted_index, permuted_ours, exact=True)  # the same expert-major order
    add("permute, index", "megablocks-core (TE API)", permute_index, permute_bytes, check)
    nbytes = (rows + tokens) * hidden * es + rows * ps
    got = te.moe_unpermute(permuted_index, map_index, top_probs, map_type="index")
    check = _compare(got, unpermute(False), exact=False)
    add(
        "unpermute, index + probs",
        "megablocks-core (TE API)",
        lambda: te.moe_unpermute(permuted_index, map_index, top_probs, map_type="index"),
        nbytes,
        check,
    )

    # The padded form: each expert's rows rounded up to `align`, padding rows zero.
    counts = mask.sum(0)
    for align in ALIGNS:
        padded_rows = int(((counts + align - 1) // align * align).sum())
        nbytes = tokens * hidden * es + padded_rows * hidden * es + 2 * rows * ps
        add(
            f"permute, mask + probs, padded to {align}",
            "megablocks-core (TE API)",
            lambda a=align: te.moe_permute_and_pad_with_probs(x, probs, mask, counts, a),
            nbytes,
            "n/a",
        )
        # The same without the host read: the core's ops with a static bound on the padded rows
        # (every row up to the bound written: the rows past the real count are zeros).
        bound = rows + experts * (align - 1)
        static_bytes = tokens * hidden * es + bound * hidden * es + 2 * rows * ps

        def static_padded(a: int = align, bound: int = bound) -> Any:
            row_map, _ = ops.moe_permute_map(mask, experts, bound, a)
            return ops.moe_permute(x, row_map, bound), ops.moe_permute_probs(probs, row_map, bound)

        te_rows, te_probs = te.moe_permute_and_pad_with_probs(x, probs, mask, counts, align)[:2]
        got_rows, got_probs = static_padded()
        check = _compare(got_rows[:padded_rows], te_rows, exact=True)
        check += "; probs " + _compare(got_probs[:padded_rows], te_probs, exact=True)
        if got_rows[padded_rows:].any() or got_probs[padded_rows:].any():
            check += "; rows past the padded count not zero"
        add(
            f"permute, mask + probs, padded to {align}, static bound",
            "megablocks-core (ops, no host read)",
            static_padded,
            static_bytes,
            check,
        )
        if hasattr(moe_utils, "pad_routing_map"):  # Megatron's way: more tokens, not zero rows

            def megatron_padded(a: int = align) -> Any:
                padded_map = moe_utils.pad_routing_map(mask, a)
                return moe_utils.permute(
                    x, padded_map, probs=probs, num_out_tokens=int(padded_map.sum()), fused=False
                )

            add(
                f"permute, mask + probs, padded to {align}",
                "Megatron unfused (pad_routing_map)",
                megatron_padded,
                None,
                "different padding",
            )

    # The round trip a training step pays: permute → unpermute, forward and backward.
    grad = torch.randn_like(x)

    def round_trip(fused: bool) -> None:
        xs = x.detach().requires_grad_()
        ws = probs.detach().requires_grad_()
        permuted, _, row_map = moe_utils.permute(xs, mask, num_out_tokens=rows, fused=fused)
        combined = moe_utils.unpermute(
            permuted, row_map, xs.shape, probs=ws, routing_map=mask, fused=fused
        )
        combined.backward(grad)

    ours_us, theirs_us = timer(lambda: round_trip(True)), timer(lambda: round_trip(False))
    out.append(
        Row(name, "round trip fwd+bwd", "megablocks-core (fused=True)", ours_us, None, None, "n/a")
    )
    out.append(Row(name, "round trip fwd+bwd", "Megatron unfused", theirs_us, None, None, "n/a"))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="mixtral,qwen3,dsv3")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tokens", type=int, help="override every shape's token count")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if not mcore_adapter.install():
        print("megatron-core is not installed", file=sys.stderr)
        return 2
    rows: list[Row] = []
    try:
        for name in args.shapes.split(","):
            tokens, hidden, _, experts, top_k = SHAPES[name]
            tokens = args.tokens or tokens
            print(f"[{name}] T={tokens} H={hidden} E={experts} K={top_k}", file=sys.stderr)
            rows += run_shape(name, tokens, hidden, experts, top_k, device)
    finally:
        mcore_adapter.uninstall()
    for r in rows:
        limit = f"{r.vs_limit:.2f}x" if r.vs_limit is not None else ""
        print(f"{r.shape:<8}{r.op:<54}{r.provider:<38}{r.us:>10.1f}{limit:>9}  {r.check}")
    if args.json:
        meta = {
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__,
        }
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": [asdict(r) for r in rows]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
