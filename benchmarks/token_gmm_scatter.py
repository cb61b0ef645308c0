"""gmm_scatter at a few tokens: the one-launch path beside the tiled one (JSON out).

For each model's expert widths (experts, top_k, hidden, ffn, its gated activation and bias) and
token count, through ``megablocks_core.ops.gmm_scatter`` (validation included, as a user calls
it) under the default launch policy and under one with the one-launch path off: the relative
error of each against float64 on the GPU, GPU µs per call (a CUDA graph of 20 calls replayed;
the median of 10 replays), host µs to issue one call (``--calls`` back to back, no sync; the
median of 5 runs, as ``decode_host``), and whether
the default policy took the one-launch path. Usage: ``python benchmarks/token_gmm_scatter.py
[--models qwen3,olmoe,gpt_oss,mixtral] [--tokens 1,2,4,8,16] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from megablocks_triton.config import LaunchConfigs, use_launch_configs

from megablocks_core import ops

#: (experts, top_k, hidden, ffn, activation, bias) of each model's experts.
SHAPES: dict[str, tuple[int, int, int, int, str, bool]] = {
    "qwen3": (128, 8, 2048, 768, "swiglu", False),
    "olmoe": (64, 8, 2048, 1024, "swiglu", False),
    "gpt_oss": (32, 4, 2880, 2880, "swiglu_oai_interleaved", True),
    "mixtral": (8, 2, 4096, 14336, "swiglu", False),
}


class Tiled(LaunchConfigs):
    """The default launch policy with the one-launch path off."""

    def token_gmm_scatter(self, *args: int) -> None:
        return None


def reference(x: torch.Tensor, activation: str) -> torch.Tensor:
    """act(x) in float64."""
    x = x.double()
    if activation == "swiglu_oai_interleaved":
        gate, up = x[:, 0::2].clamp(max=7.0), x[:, 1::2].clamp(-7.0, 7.0)
        return gate * torch.sigmoid(1.702 * gate) * (up + 1.0)
    gate, up = x.chunk(2, dim=1)
    return torch.nn.functional.silu(gate) * up


def host_us(call: Callable[[], Any], calls: int) -> float:
    for _ in range(20):
        call()
    torch.cuda.synchronize()
    runs = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        runs.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(runs)


def device_us(call: Callable[[], Any], repeat: int = 20) -> float:
    """GPU µs per call: ``repeat`` calls captured in one graph (per-launch gaps included, as a
    graph of a whole block has them), the median of 10 replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeat):
            call()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / repeat)
    return statistics.median(times)


def row(model: str, tokens: int, trans_b: bool, calls: int) -> dict[str, Any]:
    experts, top_k, hidden, ffn, activation, has_bias = SHAPES[model]
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(tokens)
    scores = torch.rand(tokens, experts, device=device, generator=gen)
    top = scores.topk(top_k, dim=1).indices.reshape(-1).to(torch.int32)
    indices, bin_ids, _, bins, _ = ops.route(top, experts, 128)
    x = torch.randn(tokens * top_k, 2 * ffn, device=device, generator=gen, dtype=torch.bfloat16)
    shape = (experts, hidden, ffn) if trans_b else (experts, ffn, hidden)
    b = (torch.randn(shape, device=device, generator=gen) / ffn**0.5).to(torch.bfloat16)
    weights = torch.rand(tokens * top_k, device=device, generator=gen).to(torch.bfloat16)
    bias = torch.randn(experts, hidden, device=device, generator=gen).to(torch.bfloat16)
    bias_arg = bias if has_bias else None

    def call() -> torch.Tensor:
        return ops.gmm_scatter(
            x, b, indices, bin_ids, weights, bins, top_k, trans_b, activation, None, bias_arg
        )

    # float64: out[t] = sum_k w * (act(x[i]) @ b[e] + bias[e]), e of sorted row i from bin_ids.
    act = reference(x, activation)
    mats = b.double()[bin_ids.long()]
    products = torch.einsum("rk,rnk->rn" if trans_b else "rk,rkn->rn", act, mats)
    if has_bias:
        products = products + bias.double()[bin_ids.long()]
    want = torch.zeros(tokens, hidden, dtype=torch.float64, device=device)
    want.index_add_(0, indices.long() // top_k, products * weights.double()[indices.long(), None])

    policy = LaunchConfigs()
    taken = policy.token_gmm_scatter(tokens, top_k, ffn, hidden, 2, trans_b) is not None
    out: dict[str, Any] = {
        "model": model, "tokens": tokens, "trans_b": trans_b, "one_launch_taken": taken,
    }  # fmt: skip
    for name, policy in (("default", LaunchConfigs()), ("tiled", Tiled())):
        with use_launch_configs(policy):
            got = call().double()
            err = float((got - want).norm() / want.norm())
            out[name] = {"rel_err": err, "gpu_us": device_us(call), "host_us": host_us(call, calls)}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="qwen3,olmoe,gpt_oss,mixtral")
    parser.add_argument("--tokens", default="1,2,4,8,16")
    parser.add_argument("--layouts", default="trans_b,plain")
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    rows = []
    for model in args.models.split(","):
        for tokens in (int(t) for t in args.tokens.split(",")):
            for layout in args.layouts.split(","):
                result = row(model, tokens, layout == "trans_b", args.calls)
                rows.append(result)
                d, t = result["default"], result["tiled"]
                print(
                    f"{model:8s} T={tokens:<3d} {layout:8s} one-launch={result['one_launch_taken']!s:5s}"
                    f" gpu {d['gpu_us']:7.1f} vs {t['gpu_us']:7.1f} us"
                    f"  host {d['host_us']:6.1f} vs {t['host_us']:6.1f} us"
                    f"  err {d['rel_err']:.2e} vs {t['rel_err']:.2e}",
                    flush=True,
                )
    if args.json:
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
