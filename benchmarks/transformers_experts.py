"""transformers' experts implementations side by side: ``"megablocks"`` against ``"grouped_mm"``,
``"batched_mm"`` and ``"eager"`` on real MoE widths.

Each model is built from its config class (no hub access) with one decoder layer, a small
vocabulary (``--vocab``, so the LM head does not dominate the step) and random weights, in bf16, on
one device; the same model (the same weights) serves every implementation in turn
(``model.set_experts_implementation``). For each (model, tokens, implementation) three items:

- ``experts``: the Experts module alone — forward on ``(T, H)`` tokens with a fixed top-k routing
  (softmax top-k of random logits) and backward with a fixed upstream gradient, into the input,
  the routing weights and the expert weights;
- ``block``: the decoder layer's MoE block (its router and its experts), forward + backward from a
  ``(1, T, H)`` input;
- ``train``: a whole training step of the one-layer causal LM (``(T / seq, seq)`` token ids,
  loss, backward, an AdamW step);
- ``forward`` (not run unless asked, e.g. by ``--decode``): the MoE block's forward alone, under
  ``torch.no_grad()`` (inference and decode);
- ``forward_graph`` (likewise, CUDA only): that forward captured once in a CUDA graph and
  replayed: what is left of a step once the host no longer issues its kernels one by one.

Gradients accumulate into the existing ``.grad`` (never zeroed: the steady state). Times are the
median of per-step CUDA-event times over steps launched back to back, after the step has run for
``--sustain`` seconds (the GPU at its sustained clock); ``peak_mib`` is the peak allocated during
one step above what was allocated before it. ``check``: each implementation's block output and
input gradient against ``grouped_mm``'s on the same weights and input (max abs difference over
the reference's max abs, bf16 tolerance 2e-2). An implementation that fails (out of memory:
``batched_mm`` gathers a weight matrix per routed token) is a row with the error.

``megablocks-fused``: ``megablocks`` with the expert weights' gradient-accumulation fusion
(each micro-batch's gradient added by the weight-gradient GEMM, not by autograd).

``host_ms``: the median host time to issue one step; a step whose host time reaches its device
time is host-bound (the GPU waits between kernels). ``ratios`` pairs each megablocks row with
grouped_mm's row of the same model, tokens and item (speed-up, host time of each).

``--decode``: the small-batch preset, the MoE block's forward (eager and replayed from a CUDA
graph) at 1, 8, 64, 512 and 4096 tokens for megablocks, grouped_mm and batched_mm (peers in the
same run; ``--tokens``, ``--items`` and ``--implementations`` still override it).

``--profile``: for ``megablocks`` and ``grouped_mm`` at every token count, the experts and block
steps' device time by kernel (torch.profiler, the top entries); the sum over every kernel against
the step's time says how long the GPU sat idle.

Usage: ``python benchmarks/transformers_experts.py [--models qwen3,olmoe,mixtral,gpt_oss]
[--tokens 4096,16384] [--json PATH] [--profile] [--decode]``; ``--device cpu --tiny`` is a smoke
run.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

#: "megablocks" with its expert weights opted in to gradient-accumulation fusion
#: (``megablocks_core.integrations.transformers.fuse_grad_accumulation``): what a training loop
#: that accumulates gradients over micro-batches can ask for.
FUSED = "megablocks-fused"
IMPLEMENTATIONS = ("megablocks", FUSED, "grouped_mm", "batched_mm", "eager")
ITEMS = ("experts", "block", "train", "forward", "forward_graph")
#: The items a run times unless told otherwise.
DEFAULT_ITEMS = ("experts", "block", "train")
#: ``--decode``: token counts, items and implementations of the small-batch preset.
DECODE_TOKENS = (1, 8, 64, 512, 4096)
DECODE_ITEMS = ("forward", "forward_graph")
DECODE_IMPLEMENTATIONS = ("megablocks", "grouped_mm", "batched_mm")
#: The implementations ``--profile`` profiles (their experts and block steps, every token count).
PROFILED = ("megablocks", "grouped_mm")
SEQUENCE = 4096  # tokens per sequence in the train item
TOLERANCE = 2e-2

#: Model → (config class, the widths of the real model; attention as the model's).
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3": (  # Qwen3-30B-A3B
        "Qwen3MoeConfig",
        dict(
            hidden_size=2048,
            moe_intermediate_size=768,
            num_experts=128,
            num_experts_per_tok=8,
            norm_topk_prob=True,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
        ),
    ),
    "olmoe": (  # OLMoE-1B-7B
        "OlmoeConfig",
        dict(
            hidden_size=2048,
            intermediate_size=1024,
            num_experts=64,
            num_experts_per_tok=8,
            num_attention_heads=16,
            num_key_value_heads=16,
        ),
    ),
    "mixtral": (  # Mixtral-8x7B
        "MixtralConfig",
        dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_local_experts=8,
            num_experts_per_tok=2,
            num_attention_heads=32,
            num_key_value_heads=8,
        ),
    ),
    "gpt_oss": (  # GPT-OSS-20B: biases and the clamped SwiGLU
        "GptOssConfig",
        dict(
            hidden_size=2880,
            intermediate_size=2880,
            num_local_experts=32,
            num_experts_per_tok=4,
            num_attention_heads=64,
            num_key_value_heads=8,
            head_dim=64,
            layer_types=["full_attention"],
        ),
    ),
}
#: The widths of ``--tiny`` (smoke runs on the CPU).
TINY = dict(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16)


@dataclass
class Row:
    model: str
    tokens: int
    item: str
    implementation: str
    ms: float
    peak_mib: float | None
    check: str
    spread_ms: tuple[float, float] | None = None  # [min, max] of the timed steps
    host_ms: float | None = None  # median host time to issue one step (>= ms: host-bound)


def build_model(name: str, vocab: int, device: torch.device, tiny: bool) -> Any:
    import transformers

    config_class, widths = MODELS[name]
    widths = dict(widths)
    if tiny:
        widths.update(TINY)
        for key in ("intermediate_size", "moe_intermediate_size"):
            if key in widths:
                widths[key] = 48
        for key in ("num_experts", "num_local_experts"):
            if key in widths:
                widths[key] = min(widths[key], 8)
        widths["num_experts_per_tok"] = min(widths["num_experts_per_tok"], 2)
    config = getattr(transformers, config_class)(
        **widths, num_hidden_layers=1, vocab_size=vocab, max_position_embeddings=SEQUENCE
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return model.to(device).train()


def _layer(model: Any) -> Any:
    return model.model.layers[0]


def _block(model: Any) -> torch.nn.Module:
    return _layer(model).mlp


def _experts(model: Any) -> torch.nn.Module:
    return _block(model).experts


def _first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def _steps(
    model: Any, tokens: int, device: torch.device, items: tuple[str, ...] = DEFAULT_ITEMS
) -> dict[str, tuple[Callable[[], Any], Callable[[], torch.Tensor]]]:
    """item → (step, forward): ``step`` runs forward + backward (+ the optimizer for train; the
    forward items: the forward alone); ``forward`` the forward alone (the check's output).
    ``forward_graph`` is captured here (a CUDA graph of the no-grad block forward) when
    ``items`` asks for it."""
    config = model.config
    hidden = config.hidden_size
    experts_count = getattr(config, "num_experts", None) or config.num_local_experts
    top_k = config.num_experts_per_tok
    generator = torch.Generator(device="cpu").manual_seed(1)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(device, torch.bfloat16)

    x = randn(tokens, hidden).requires_grad_()
    probs = torch.softmax(torch.randn(tokens, experts_count, generator=generator), -1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).to(device, torch.bfloat16).requires_grad_()
    ids = ids.to(device)
    experts, block = _experts(model), _block(model)
    grad = randn(tokens, hidden)
    block_x = randn(1, tokens, hidden).requires_grad_()
    block_grad = grad.view(1, tokens, hidden)

    def experts_forward() -> torch.Tensor:
        return _first(experts(x, ids, weights))

    def experts_step() -> None:
        experts_forward().backward(grad)

    def block_forward() -> torch.Tensor:
        return _first(block(block_x))

    def block_step() -> None:
        block_forward().backward(block_grad)

    sequences = max(1, tokens // SEQUENCE)
    seq = tokens // sequences
    input_ids = torch.randint(0, config.vocab_size, (sequences, seq), generator=generator).to(
        device
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)

    def train_forward() -> torch.Tensor:
        return model(input_ids=input_ids, labels=input_ids).loss

    def train_step() -> None:
        train_forward().backward()
        optimizer.step()

    def inference() -> torch.Tensor:
        with torch.no_grad():
            return block_forward()

    steps = {
        "experts": (experts_step, experts_forward),
        "block": (block_step, block_forward),
        "train": (train_step, train_forward),
        "forward": (inference, inference),
    }
    if "forward_graph" in items:
        replay = captured(inference, device)
        steps["forward_graph"] = (replay, replay)
    return steps


def captured(forward: Callable[[], torch.Tensor], device: torch.device) -> Callable[[], Any]:
    """``forward`` captured in a CUDA graph (after warm-up runs on a side stream, as torch's
    docs ask), as a function that replays it and returns the graph's output tensor. Raises on
    the CPU, and for a forward that cannot be captured (one that syncs with the host)."""
    if device.type != "cuda":
        raise RuntimeError("CUDA graphs need a CUDA device")
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):  # kernel choice, compilation and the allocator's pools, once
            forward()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = forward()

    def replay() -> torch.Tensor:
        graph.replay()
        return out

    return replay


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_step(
    step: Callable[[], Any], device: torch.device, sustain_s: float, reps: int
) -> tuple[float, float, float, float]:
    """(median, min, max) ms per step, after warm-up for ``sustain_s`` seconds, and the median
    host time to issue one step (on the CPU, the same as the step's time)."""
    step()
    _sync(device)
    began = time.perf_counter()
    step()
    _sync(device)
    once = time.perf_counter() - began
    reps = max(3, min(reps, int(4.0 / max(once, 1e-6))))  # slow implementations: fewer steps
    began = time.perf_counter()
    while time.perf_counter() - began < sustain_s and once < sustain_s:
        step()
        _sync(device)
    times = []
    host = []
    if device.type == "cuda":
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(reps)
        ]
        for start, end in events:
            began = time.perf_counter()
            start.record()
            step()
            end.record()
            host.append((time.perf_counter() - began) * 1e3)
        _sync(device)
        times = [start.elapsed_time(end) for start, end in events]
    else:
        for _ in range(reps):
            began = time.perf_counter()
            step()
            times.append((time.perf_counter() - began) * 1e3)
        host = times
    return statistics.median(times), min(times), max(times), statistics.median(host)


def peak_mib(step: Callable[[], Any], device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    _sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    step()
    _sync(device)
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = want.float().abs().max().item()
    return (got.float() - want.float()).abs().max().item() / max(scale, 1e-30)


def block_outputs(model: Any, tokens: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """The MoE block's output and the gradient of its input, for a fixed input and gradient."""
    generator = torch.Generator(device="cpu").manual_seed(2)
    hidden = model.config.hidden_size
    x = torch.randn(1, tokens, hidden, generator=generator).to(device, torch.bfloat16)
    x.requires_grad_()
    grad = torch.randn(1, tokens, hidden, generator=generator).to(device, torch.bfloat16)
    out = _first(_block(model)(x))
    out.backward(grad)
    model.zero_grad(set_to_none=True)
    assert x.grad is not None
    return out.detach(), x.grad


def profile_block(step: Callable[[], Any], device: torch.device, top: int) -> list[dict[str, Any]]:
    """A step's device time by kernel, per step (µs): the total over every kernel, then
    the ``top`` largest. Only device events count (an operator's row would count its kernels
    again)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    steps = 5
    step()
    _sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        _sync(device)
    rows = [
        {
            "name": event.key[:120],
            "device_us_per_step": event.self_device_time_total / steps,
            "calls_per_step": event.count / steps,
        }
        for event in prof.key_averages()
        if getattr(event, "device_type", None) == DeviceType.CUDA
        and event.self_device_time_total > 0
    ]
    rows.sort(key=lambda r: -r["device_us_per_step"])
    total = sum(r["device_us_per_step"] for r in rows)
    return [
        {"name": "(every kernel)", "device_us_per_step": total, "calls_per_step": None},
        *rows[:top],
    ]


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every (model, tokens, implementation, item); with ``--json`` the file is rewritten after
    each model, so a run cut short keeps what it measured."""
    import megablocks_core.integrations.transformers as hf  # registers "megablocks"

    device = torch.device(args.device)
    rows: list[Row] = []
    profiles: dict[str, Any] = {}
    for name in args.models:
        model = build_model(name, args.vocab, device, args.tiny)
        # Each implementation starts from the same weights: the train item's optimizer steps
        # move them, and a router weight moved by 1e-5 flips the top-k of near-tied tokens.
        initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
        for tokens in args.tokens:
            reference: tuple[torch.Tensor, ...] | None = None
            # grouped_mm first: every other implementation is checked against its result.
            order = ["grouped_mm"] + [i for i in args.implementations if i != "grouped_mm"]
            if tokens > args.eager_tokens:  # eager is 20-60x slower: timed at the small counts
                order = [i for i in order if i != "eager"]
            for implementation in order:
                model.set_experts_implementation(
                    "megablocks" if implementation == FUSED else implementation
                )
                hf.fuse_grad_accumulation(model, enabled=implementation == FUSED)
                model.load_state_dict(initial)
                log = f"[{name} T={tokens}] {implementation}"
                try:
                    outputs = block_outputs(model, tokens, device)
                except Exception as exc:
                    error = f"error: {type(exc).__name__}: {str(exc)[:160]}"
                    print(f"{log}: {error}", file=sys.stderr, flush=True)
                    for item in args.items:
                        rows.append(Row(name, tokens, item, implementation, math.nan, None, error))
                    model.zero_grad(set_to_none=True)
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                    continue
                if implementation == "grouped_mm":
                    reference = outputs
                    check = "reference"
                else:
                    assert reference is not None
                    errors = [
                        _relative_error(g, w) for g, w in zip(outputs, reference, strict=True)
                    ]
                    worst = max(errors)
                    check = "ok" if worst <= TOLERANCE else f"off by {worst:.3g}"
                    check += f" (out {errors[0]:.2e}, dx {errors[1]:.2e})"
                del outputs
                if implementation not in args.implementations:
                    continue
                try:
                    steps = _steps(model, tokens, device, tuple(args.items))
                except Exception as exc:  # forward_graph's capture failed: the others still run
                    print(f"{log}: capture failed: {exc}", file=sys.stderr, flush=True)
                    rows.append(_error_row(name, tokens, "forward_graph", implementation, exc))
                    steps = _steps(model, tokens, device)
                for item in args.items:
                    if item not in steps:  # its error row is written above
                        continue
                    step, _ = steps[item]
                    print(f"{log} {item}", file=sys.stderr, flush=True)
                    try:
                        median, low, high, host = time_step(step, device, args.sustain, args.reps)
                        peak = peak_mib(step, device)
                        row = Row(name, tokens, item, implementation, median, peak, check)
                        row.spread_ms = (low, high)
                        row.host_ms = host
                    except Exception as exc:
                        row = _error_row(name, tokens, item, implementation, exc)
                    rows.append(row)
                    print(f"  {asdict(row)}", file=sys.stderr, flush=True)
                if args.profile and implementation in PROFILED:
                    for item in ("experts", "block"):
                        profiles[f"{name}/{tokens}/{implementation}/{item}"] = profile_block(
                            steps[item][0], device, args.profile_top
                        )
                del steps
                model.zero_grad(set_to_none=True)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        del model, initial
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if args.json:
            _write(args.json, _result(args, device, rows, profiles))
    return _result(args, device, rows, profiles)


def _error_row(model: str, tokens: int, item: str, implementation: str, exc: Exception) -> Row:
    error = f"error: {type(exc).__name__}: {str(exc)[:160]}"
    return Row(model, tokens, item, implementation, math.nan, None, error)


def _write(path: str, result: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


def _result(
    args: argparse.Namespace, device: torch.device, rows: list[Row], profiles: dict[str, Any]
) -> dict[str, Any]:
    return {
        "meta": {
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "transformers": __import__("transformers").__version__,
            "vocab": args.vocab,
            "sustain_s": args.sustain,
            "models": {n: MODELS[n][1] for n in args.models},
        },
        "rows": [asdict(r) for r in rows],
        "ratios": ratios(rows),
        "profiles": profiles,
    }


def ratios(rows: list[Row]) -> list[dict[str, Any]]:
    """Per (model, tokens, item): grouped_mm's time / megablocks' (speed-up), megablocks' peak
    memory / grouped_mm's, and each one's host time to issue the step."""
    by_key = {(r.model, r.tokens, r.item, r.implementation): r for r in rows}
    out = []
    for (model, tokens, item, implementation), ours in by_key.items():
        if implementation not in ("megablocks", FUSED):
            continue
        theirs = by_key.get((model, tokens, item, "grouped_mm"))
        if theirs is None or math.isnan(ours.ms) or math.isnan(theirs.ms):
            continue
        memory = (
            ours.peak_mib / theirs.peak_mib
            if ours.peak_mib is not None and theirs.peak_mib
            else None
        )
        out.append(
            {
                "model": model,
                "tokens": tokens,
                "item": item,
                "implementation": implementation,
                "speedup_vs_grouped_mm": theirs.ms / ours.ms,
                "peak_vs_grouped_mm": memory,
                "host_ms": ours.host_ms,
                "grouped_mm_host_ms": theirs.host_ms,
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--tokens")
    parser.add_argument("--implementations")
    parser.add_argument("--items")
    parser.add_argument(
        "--decode",
        action="store_true",
        help="the MoE block's forward, eager and from a CUDA graph, at 1 to 4096 tokens",
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--sustain", type=float, default=1.0, help="seconds of warm-up per row")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--tiny", action="store_true", help="tiny widths (a smoke run)")
    parser.add_argument(
        "--eager-tokens", type=int, default=4096, help="time eager only up to this many tokens"
    )
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--profile-top", type=int, default=15)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    preset = (
        (DECODE_TOKENS, DECODE_IMPLEMENTATIONS, DECODE_ITEMS)
        if args.decode
        else ((4096, 16384), IMPLEMENTATIONS, DEFAULT_ITEMS)
    )
    args.models = args.models.split(",")
    args.tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else list(preset[0])
    args.implementations = (
        args.implementations.split(",") if args.implementations else list(preset[1])
    )
    args.items = args.items.split(",") if args.items else list(preset[2])
    unknown = set(args.models) - set(MODELS) or set(args.implementations) - set(IMPLEMENTATIONS)
    if unknown or set(args.items) - set(ITEMS):
        parser.error(f"unknown: {sorted(unknown or set(args.items) - set(ITEMS))}")
    result = run(args)
    for r in result["ratios"]:
        print(json.dumps(r))
    if args.json:
        _write(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
