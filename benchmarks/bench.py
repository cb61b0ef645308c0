"""``megablocks bench``: every installed provider of each op, side by side with peers and the limit.

For each shape it builds realistic routing (softmax top-k of random logits), then for each op:

- times every backend that can serve the op on the device, through ``megablocks_core.ops`` with that
  backend forced (so the figure includes what a caller pays, dispatch included);
- times the peers that are importable: plain torch, MegaBlocks' ops, grouped_gemm;
- checks each result against the reference backend's before timing it;
- reports µs, GB/s (or TFLOP/s for gmm) and the ratio to a limit measured in the same run: a device
  copy of the op's ideal bytes for memory-bound ops, a dense matmul of the same FLOPs for gmm.

On the CPU it times with ``time.perf_counter`` (for smoke tests) and, unless shapes are given,
uses the ``tiny`` shape (the model shapes need tens of GB and minutes per op there); on GPUs with
``triton.testing.do_bench`` (median) when Triton is installed, else CUDA events. Each shape builds
only the inputs its chosen ops need (the dsv3 expert weights alone are 7.5 GB in bfloat16).

The ``host`` item (CUDA only): each op's host µs per eager call beside the GPU µs of the same call
replayed in a CUDA graph, at 1, 16 and 128 tokens with each shape's widths, the dMoE forward
included, and MegaBlocks' ops and dMoE on the same inputs when installed (rows carry ours /
MegaBlocks' host time); see :func:`_host_rows` and benchmarks/host_cost.py.

The ``layer`` item: a training step of :class:`megablocks_core.layers.DroplessMoE` (the default
ranking for every op, no load-balancing loss) for each kind of expert in ``--layer-experts``
(``mlp``: ``act(x @ w1) @ w2``; ``glu``: ``act(x @ w1) * (x @ v1) @ w2``), beside MegaBlocks' own
``dMoE`` (``mlp_impl="grouped"``, ``mlp_type`` the same kind) when ``megablocks`` is importable.
Both take the case's ``(T, H)`` tokens as a leaf that requires grad and a fixed upstream gradient
of the output's shape (``out.backward(grad)``). Our output is checked against the reference
backend's first (MegaBlocks' layer has its own weights: ``n/a``). The step is timed in its steady
state: gradients of the weights and the input accumulate into the existing ``.grad`` (never zeroed),
and the first steps (check, warm-up) have allocated them. Our layer has three rows per kind of
expert: ``megablocks-core dMoE`` (the default), ``ours, unfused`` (``fuse_permutation=False``:
gather, gmm and scatter as separate ops) and ``ours, grad accumulation fused``
(``grad_accumulation_fusion=True``: the weight-gradient GEMMs add into the existing ``.grad``
instead of autograd adding each expert weight's gradient in a separate pass). A layer row (``op == "layer"``) carries,
besides the common fields (``us``: step time; ``rate``: TFLOP/s of the expert GEMMs at that time;
``vs_limit``: step time / GEMM floor; ``peak_mb``: as ``peak_mib``), a ``layer`` object:

- ``experts``: ``"mlp"`` or ``"glu"``;
- ``step_ms``: forward + backward; on CUDA the median of per-step CUDA-event times over repeated
  steps launched back to back after warm-up (host time the GPU waits for is included);
- ``fwd_ms``: the forward alone with autograd recording (the graph is built, then dropped without
  backward: what a training forward costs), timed the same way;
- ``floor_ms``: the expert GEMMs of a step — forward, input gradient (dgrad) and weight gradient
  (wgrad) of each expert matrix, 6 with ``mlp`` and 9 with ``glu`` — each as a dense
  ``torch.matmul`` of the same ``(m, n, k)`` in the run's dtype (:func:`expert_gemms` lists them;
  the router and permutation are not in the floor), run back to back as one call
  (:class:`DenseGemms`). It is the **sustained** floor: on CUDA the dense GEMMs run back to back
  for ``SUSTAIN_S`` seconds before they are timed, so the GPU is at the clock a training loop holds
  (an H200 drops from ~1980 MHz to ~1545 MHz at its power cap); it is measured once per (shape,
  experts) before the rows and used for every row (ours and MegaBlocks'), so efficiencies compare
  across rows. Each row is timed the same way: its step runs for ``SUSTAIN_S`` seconds first;
- ``cold_floor_ms``: the same dense GEMMs timed after an idle second, a short burst (the clock of
  a GEMM benchmarked alone), beside it for scale;
- ``floor_after_ms``: the sustained floor measured again after the last row of the (shape,
  experts): how far the floor drifted during the rows;
- ``fwd_floor_ms``: the sustained floor of the 2 / 3 forward GEMMs;
- ``efficiency`` = ``floor_ms / step_ms``; ``fwd_efficiency`` = ``fwd_floor_ms / fwd_ms`` (1 would
  be every other part of the layer free and the grouped GEMMs at dense speed);
- ``activation_mib``: ``torch.cuda.memory_allocated()`` right after the forward returns minus just
  before it, in a later step (gradients already allocated): what the step holds for backward plus
  the output;
- ``peak_mib``: ``torch.cuda.max_memory_allocated()`` during one forward + backward (peak stats
  reset before) minus what was allocated before the step;
- ``step_vs_megablocks``, ``fwd_vs_megablocks``, ``activation_vs_megablocks``,
  ``peak_vs_megablocks``: ours / MegaBlocks' for the same shape and experts (on our rows, when both
  ran; lower is better).

Memory fields are null off CUDA (no device memory statistics); times are ms. On the CPU the layer
item runs at the ``tiny`` shape with ``time.perf_counter``. The table prints the layer rows apart,
one line per (shape, experts, provider).

Output: each row is printed to stdout as soon as it is measured (flushed), as a line ``result: ``
followed by its table row (a layer row before MegaBlocks' has run, so without the ratios to it);
the first row of each table brings its header the same way. At the end come the tables, whole,
and ``--json`` writes the JSON. Progress lines go to stderr.

It lives in the source checkout, not in the package: ``megablocks bench`` loads this file from the
checkout that holds ``megablocks_core`` (:func:`megablocks_core.cli.load_benchmark`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from megablocks_core import contracts, dispatch, entries, explain, ops, use_backend
from megablocks_core.cli import CLIError
from megablocks_core.devices import describe
from megablocks_core.layers import DroplessMoE
from megablocks_core.shapes import SHAPES

#: The shapes a run uses when none is given: model shapes on accelerators, ``tiny`` on the CPU.
DEFAULT_SHAPES = ("mixtral", "qwen3", "dsv3")
CPU_DEFAULT_SHAPES = ("tiny",)
OPS = (
    "routing",
    "gather",
    "scatter",
    "padded_gather",
    "padded_scatter",
    "scatter_wgrad",
    "gmm",
    "gmm_train",
    "layer",
    "host",
)
#: Seconds a layer row's step (and the floor's dense GEMMs) run back to back before they are timed
#: on CUDA, so every figure of the layer item is taken at the GPU's sustained clock.
SUSTAIN_S = 2.0
#: The host item's token counts (decode and small-batch sizes; CUDA only).
HOST_TOKENS = (1, 16, 128)
BLOCK = 128  # padding block for padded ops, as MegaBlocks' sparse path
#: The kinds of expert MLP the layer item runs (``--layer-experts``): MegaBlocks' ``mlp_type``.
LAYER_EXPERTS = ("mlp", "glu")
OUR_LAYER = "megablocks-core dMoE"
OUR_UNFUSED_LAYER = "ours, unfused"
OUR_ACCUMULATION_FUSED_LAYER = "ours, grad accumulation fused"
MEGABLOCKS_LAYER = "megablocks dMoE (grouped)"


@dataclass
class LayerFigures:
    """The layer item's figures for one (shape, experts, provider): ms and MiB (see the module doc)."""

    experts: str  # "mlp" or "glu"
    step_ms: float  # forward + backward, gradients accumulating into the existing .grad
    fwd_ms: float  # forward alone, autograd recording, no backward
    floor_ms: float  # the step's expert GEMMs at dense-matmul speed, sustained clocks
    fwd_floor_ms: float  # the forward's expert GEMMs at dense-matmul speed, sustained clocks
    efficiency: float  # floor_ms / step_ms
    fwd_efficiency: float  # fwd_floor_ms / fwd_ms
    activation_mib: float | None  # held after the forward (saved for backward + output); CUDA only
    peak_mib: float | None  # peak of one step above what was allocated before it; CUDA only
    cold_floor_ms: float | None = None  # floor_ms's GEMMs timed after an idle second
    floor_after_ms: float | None = None  # the sustained floor again, after the (shape, experts)
    # ours / MegaBlocks' at the same shape and experts (our rows, when both ran): lower is better
    step_vs_megablocks: float | None = None
    fwd_vs_megablocks: float | None = None
    activation_vs_megablocks: float | None = None
    peak_vs_megablocks: float | None = None


@dataclass
class Result:
    shape: str
    op: str
    provider: str
    kind: str  # "ours" (a backend through the ops API), "peer", or "limit"
    us: float
    rate: float | None  # GB/s for memory-bound ops, TFLOP/s for gmm
    unit: str
    vs_limit: (
        float | None
    )  # time / limit time (memory ops) or limit rate / rate (gmm): lower is better
    check: str  # "ok", "n/a" or what failed
    peak_mb: float | None = None  # the layer item: peak device memory of one step above its inputs
    layer: LayerFigures | None = None  # the layer item's figures (absent from other rows' JSON)
    vs_megablocks: float | None = None  # the host item: our host µs / MegaBlocks' (same run)


def _timer(device: torch.device, quick: bool) -> Callable[[Callable[[], Any]], float]:
    if device.type == "cuda":
        try:
            from triton.testing import do_bench

            return lambda fn: (
                float(
                    do_bench(
                        fn,
                        warmup=10 if quick else 25,
                        rep=40 if quick else 200,
                        return_mode="median",
                    )
                )
                * 1e3
            )
        except ImportError:
            return lambda fn: _event_time(fn, 5 if quick else 50)

    def cpu_time(fn: Callable[[], Any]) -> float:
        fn()
        samples = []
        for _ in range(3 if quick else 15):
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
        return statistics.median(samples) * 1e6

    return cpu_time


def _event_time(fn: Callable[[], Any], reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def _peak_mb(fn: Callable[[], Any], device: torch.device) -> float | None:
    """Peak device memory of one call above what was allocated before it (CUDA only)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20


def _activation_mib(forward: Callable[[], Any], device: torch.device) -> float | None:
    """Device memory a forward leaves allocated when it returns: what it saved for backward plus its
    output (CUDA only). The output is dropped afterwards, which frees the graph."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    out = forward()
    held = torch.cuda.memory_allocated(device) - before
    del out
    return held / 2**20


#: ``timer(fns, warmup, sustain_s)`` → ms per call of each function (:func:`_layer_timer`).
LayerTimer = Callable[[Sequence[Callable[[], Any]], int, float], list[float]]


def _layer_timer(device: torch.device, quick: bool) -> LayerTimer:
    """ms per call of each of ``fns``: ``timer(fns, warmup, sustain_s)``.

    Warm-up: ``warmup`` rounds and, on CUDA, more until ``sustain_s`` seconds have passed, so the
    GPU reaches the clock it holds under a sustained load (an H200 at its power limit runs well
    below the clock of a short burst: docs/performance.md). Each round calls every function once,
    in order. On CUDA: calls launched back to back, a pair of CUDA events around each, the median
    per function (a call that makes the GPU wait for the host is charged for the wait).
    Elsewhere: ``time.perf_counter`` and no sustained warm-up.
    """
    reps = (10 if quick else 30) if device.type == "cuda" else (1 if quick else 5)

    def rounds(fns: Sequence[Callable[[], Any]], count: int) -> None:
        for _ in range(count):
            for fn in fns:
                fn()

    def timer(fns: Sequence[Callable[[], Any]], warmup: int, sustain_s: float = 0.0) -> list[float]:
        rounds(fns, warmup)
        if device.type == "cuda" and sustain_s > 0:
            began = time.perf_counter()
            torch.cuda.synchronize(device)
            while time.perf_counter() - began < sustain_s:
                rounds(fns, 1)
                torch.cuda.synchronize(device)  # the queue stays short: the time is the GPU's
        samples: list[list[float]] = [[] for _ in fns]
        if device.type != "cuda":
            for _ in range(reps):
                for fn, times in zip(fns, samples, strict=True):
                    began = time.perf_counter()
                    fn()
                    times.append((time.perf_counter() - began) * 1e3)
            return [statistics.median(times) for times in samples]
        torch.cuda.synchronize(device)
        stream = torch.cuda.current_stream(device)
        events = [
            [
                (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                for _ in fns
            ]
            for _ in range(reps)
        ]
        for round_events in events:
            for fn, (start, end) in zip(fns, round_events, strict=True):
                start.record(stream)
                fn()
                end.record(stream)
        torch.cuda.synchronize(device)
        return [
            statistics.median(
                round_events[i][0].elapsed_time(round_events[i][1]) for round_events in events
            )
            for i in range(len(fns))
        ]

    return timer


@dataclass(frozen=True)
class Floor:
    """The GEMM floor of one (shape, experts), ms: what every row of it is compared with."""

    step_ms: float  # sustained
    fwd_ms: float  # sustained
    cold_step_ms: float  # after an idle second


def measure_floor(
    gemms: list[tuple[str, tuple[int, int, int]]],
    device: torch.device,
    dtype: torch.dtype,
    timer: LayerTimer,
    sustain_s: float,
) -> Floor:
    """The dense GEMMs of ``gemms`` timed cold (after an idle second, a short burst) and then
    sustained (after ``sustain_s`` seconds of them back to back); their memory is freed on return."""
    dense = DenseGemms(gemms, device, dtype)
    if device.type == "cuda":
        dense.step()  # cuBLAS's first call picks its kernel
        torch.cuda.synchronize(device)
        time.sleep(1.0)
    (cold,) = timer([dense.step], 0, 0.0)
    (step,) = timer([dense.step], 1, sustain_s)
    (fwd,) = timer([dense.forward], 1, 0.0)  # right after: the clock is still the sustained one
    del dense
    _free_device_memory(device)
    return Floor(step, fwd, cold)


def _graph_time(fn: Callable[[], Any], timer: Callable[[Callable[[], Any]], float]) -> float:
    """Time ``fn`` replayed from a CUDA graph (NaN when it cannot be captured, e.g. it syncs)."""
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # warm-up outside the capture (allocator, autotuning, compilation)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    except Exception:
        torch.cuda.synchronize()
        return math.nan
    return timer(graph.replay)


def _close(got: Any, want: Any, tol: float) -> str:
    if got is None:  # a peer with its own weights: nothing to compare
        return "n/a"
    pairs = zip(got, want, strict=True) if isinstance(want, tuple) else [(got, want)]
    for g, w in pairs:
        if g.shape != w.shape:
            return f"shape {tuple(g.shape)} != {tuple(w.shape)}"
        # In slices, float64 sums: a whole-tensor float64 copy of a dsv3 weight gradient is 30 GB.
        diff2 = ref2 = 0.0
        for gs, ws in zip(g.reshape(-1).split(1 << 24), w.reshape(-1).split(1 << 24), strict=True):
            g32, w32 = gs.float(), ws.float()
            if not torch.isfinite(g32).all():
                return "non-finite values"
            diff2 += float((g32 - w32).double().square().sum())
            ref2 += float(w32.double().square().sum())
        err = math.sqrt(diff2) / max(math.sqrt(ref2), 1e-30) if w.numel() else 0.0
        if err > tol:
            return f"relative error {err:.1e} > {tol:.0e}"
    return "ok"


def _optional(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except Exception:  # a peer that is missing or fails to import is simply not compared
        return None


class Case:
    """Inputs for one shape: the routing at once, everything else on first use (so ``--ops gather``
    never allocates the expert weights)."""

    def __init__(
        self,
        name: str,
        shape: tuple[int, int, int, int, int],
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        tokens, hidden, _, experts, top_k = shape
        self.name, self.tokens, self.hidden, self.ffn, self.experts, self.top_k = name, *shape
        gen = torch.Generator(device=device).manual_seed(0)
        logits = torch.randn(tokens, experts, device=device, generator=gen)
        weights, top = torch.topk(logits.softmax(-1), top_k)
        self.top_experts = top.flatten().int()
        self.weights = weights.flatten().to(dtype)
        self.end_bit = max((experts - 1).bit_length(), 1)
        self.x = torch.randn(tokens, hidden, device=device, generator=gen, dtype=dtype)
        self.generator = gen
        with use_backend("reference"):
            self.bin_ids, self.indices = ops.sort(self.top_experts, self.end_bit)
            self.counts = ops.histogram(self.top_experts, experts)
            self.bins = ops.inclusive_cumsum(self.counts, 0)
            self.padded_bins = ops.inclusive_cumsum(ops.round_up(self.counts, BLOCK), 0)
        self.counts_cpu = self.counts.long().cpu()
        self.gmm_grad: torch.Tensor | None = None  # the "gmm_train" item's output gradient

    @functools.cached_property
    def rows(self) -> torch.Tensor:
        """The gathered rows (tokens * top_k, hidden)."""
        with use_backend("reference"):
            return ops.gather(self.x, self.indices, self.bin_ids, self.bins, self.top_k)

    @functools.cached_property
    def layer_grad(self) -> torch.Tensor:
        """The layer item's upstream gradient: fixed, (tokens, hidden) in the run's dtype."""
        gen = torch.Generator(device=self.x.device).manual_seed(2)
        return torch.randn(
            self.tokens, self.hidden, device=self.x.device, generator=gen, dtype=self.x.dtype
        )

    @functools.cached_property
    def padded_rows(self) -> torch.Tensor:
        with use_backend("reference"):
            return ops.padded_gather(
                self.x, self.indices, self.bin_ids, self.bins, self.padded_bins, self.top_k
            )

    @functools.cached_property
    def w1(self) -> torch.Tensor:
        """The experts' first weight matrices (experts, hidden, ffn), drawn in the run's dtype."""
        shape = (self.experts, self.hidden, self.ffn)
        weights = torch.randn(
            shape, device=self.x.device, generator=self.generator, dtype=self.x.dtype
        )
        return weights.div_(self.hidden**0.5)

    @property
    def permutation_bytes(self) -> int:
        """The ideal bytes of gather/scatter: every token row read once, every routed row written once."""
        return (
            self.tokens * self.hidden + self.tokens * self.top_k * self.hidden
        ) * self.x.element_size()

    @property
    def padded_permutation_bytes(self) -> int:
        """As permutation_bytes, with the padded layout's rows (padding rows are written too)."""
        rows = int(self.padded_bins[-1]) if self.padded_bins.numel() else 0
        return (self.tokens * self.hidden + rows * self.hidden) * self.x.element_size()

    @property
    def gmm_flops(self) -> float:
        return 2.0 * self.tokens * self.top_k * self.hidden * self.ffn


def _ours(case: Case) -> dict[str, Callable[[], Any]]:
    c = case
    return {
        "routing": lambda: ops.route(c.top_experts, c.experts, BLOCK),
        "gather": lambda: ops.gather(c.x, c.indices, c.bin_ids, c.bins, c.top_k),
        "scatter": lambda: ops.scatter(c.rows, c.indices, c.bin_ids, c.weights, c.bins, c.top_k),
        "padded_gather": lambda: ops.padded_gather(
            c.x, c.indices, c.bin_ids, c.bins, c.padded_bins, c.top_k
        ),
        "padded_scatter": lambda: ops.padded_scatter(
            c.padded_rows, c.indices, c.bin_ids, c.weights, c.bins, c.padded_bins, c.top_k
        ),
        "scatter_wgrad": lambda: entries.call(
            "scatter_wgrad", c.rows, c.x, c.indices, c.bin_ids, c.bins, c.top_k
        ),
        "gmm": lambda: ops.gmm(c.rows, c.w1, c.counts_cpu),
        "gmm_train": lambda: _gmm_train_step(c, lambda a, b: ops.gmm(a, b, c.counts_cpu)),
    }


def _gmm_train_step(
    case: Case, gmm: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
) -> tuple[torch.Tensor, ...]:
    """Forward and backward (dA and the variable-K dB) of one grouped GEMM; returns out, dA, dB."""
    if case.gmm_grad is None:
        gen = torch.Generator(device=case.x.device).manual_seed(1)
        case.gmm_grad = torch.randn(
            case.rows.shape[0], case.ffn, device=case.x.device, generator=gen
        ).to(case.x.dtype)
    a = case.rows.detach().requires_grad_()
    b = case.w1.detach().requires_grad_()
    out = gmm(a, b)
    out.backward(case.gmm_grad)
    assert a.grad is not None and b.grad is not None
    return out.detach(), a.grad, b.grad


def expert_gemms(
    tokens: int, hidden: int, ffn: int, top_k: int, glu: bool
) -> list[tuple[str, tuple[int, int, int]]]:
    """The expert GEMMs of one training step of the layer: ``(name, (m, n, k))`` for an
    ``(m, k) @ (k, n)`` product, over all experts at once (the grouped GEMMs' rows summed).

    Each expert matrix (w1, [v1,] w2) has a forward, an input gradient (dgrad) and a weight
    gradient (wgrad, whose k is the routed rows): 6 GEMMs for ``mlp``, 9 for ``glu``.
    """
    rows = tokens * top_k
    up = ["w1", "v1"] if glu else ["w1"]  # (hidden → ffn)
    forward = [(f"{w} forward", (rows, ffn, hidden)) for w in up]
    forward.append(("w2 forward", (rows, hidden, ffn)))
    backward = [("w2 dgrad", (rows, ffn, hidden)), ("w2 wgrad", (ffn, hidden, rows))]
    for w in up:
        backward += [(f"{w} dgrad", (rows, hidden, ffn)), (f"{w} wgrad", (hidden, ffn, rows))]
    return forward + backward


class DenseGemms:
    """The GEMM floor's dense matmuls: one ``torch.matmul`` into a preallocated output for each
    expert GEMM of a step (``gemms``, as :func:`expert_gemms` lists them), operands drawn once per
    distinct ``(m, n, k)``. :meth:`step` runs them all, :meth:`forward` the forward ones: timed
    beside the layer's step and forward, round by round, they give ``floor_ms`` and
    ``fwd_floor_ms`` at the clocks the layer ran at."""

    def __init__(
        self,
        gemms: list[tuple[str, tuple[int, int, int]]],
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        operands: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        for _, (m, n, k) in gemms:
            if (m, n, k) not in operands:
                operands[(m, n, k)] = (
                    torch.randn(m, k, device=device, dtype=dtype),
                    torch.randn(k, n, device=device, dtype=dtype),
                    torch.empty(m, n, device=device, dtype=dtype),
                )
        self.step_products = [operands[mnk] for _, mnk in gemms]
        self.forward_products = [operands[mnk] for name, mnk in gemms if name.endswith(" forward")]

    @staticmethod
    def _run(products: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
        for a, b, out in products:
            torch.matmul(a, b, out=out)

    def step(self) -> None:
        self._run(self.step_products)

    def forward(self) -> None:
        self._run(self.forward_products)


@dataclass
class _LayerUnderTest:
    """One layer with its input and upstream gradient: what the layer item runs."""

    forward: Callable[[], torch.Tensor]  # the output, with its autograd graph
    grad: torch.Tensor  # the output's upstream gradient

    def step(self) -> torch.Tensor:
        """Forward and backward; gradients accumulate into the existing ``.grad``."""
        out = self.forward()
        out.backward(self.grad)
        return out.detach()


def _our_layer(
    case: Case, glu: bool, fuse_permutation: bool = True, grad_accumulation_fusion: bool = False
) -> _LayerUnderTest:
    layer = DroplessMoE(
        hidden_size=case.hidden,
        ffn_hidden_size=case.ffn,
        num_experts=case.experts,
        top_k=case.top_k,
        glu=glu,
        dtype=case.x.dtype,
        device=case.x.device,
        load_balancing_loss_coefficient=0.0,  # as the MegaBlocks peer's moe_loss_weight=0
        fuse_permutation=fuse_permutation,
        grad_accumulation_fusion=grad_accumulation_fusion,
    )
    x = case.x.detach().clone().requires_grad_()
    return _LayerUnderTest(lambda: layer(x)[0], case.layer_grad)


def _megablocks_layer(case: Case, glu: bool, mb_dmoe: Any, mb_arguments: Any) -> _LayerUnderTest:
    """MegaBlocks' dMoE (grouped, same shape and expert kind, no bias or aux loss)."""
    dtype = case.x.dtype
    args = mb_arguments.Arguments(
        hidden_size=case.hidden,
        ffn_hidden_size=case.ffn,
        moe_num_experts=case.experts,
        moe_top_k=case.top_k,
        mlp_impl="grouped",
        mlp_type="glu" if glu else "mlp",
        bias=False,
        return_bias=False,
        moe_loss_weight=0.0,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        device=case.x.device,
    )
    layer = mb_dmoe.dMoE(args)
    x = case.x.detach().view(case.tokens, 1, case.hidden).clone().requires_grad_()

    def forward() -> torch.Tensor:
        out = layer(x)
        return out[0] if isinstance(out, tuple) else out

    return _LayerUnderTest(forward, case.layer_grad.view(case.tokens, 1, case.hidden))


def _megablocks_layer_modules(device: torch.device) -> tuple[Any, Any] | None:
    """MegaBlocks' ``layers.dmoe`` and ``layers.arguments`` modules, when importable (CUDA only)."""
    if device.type != "cuda":
        return None
    dmoe, arguments = (
        _optional("megablocks.layers.dmoe"),
        _optional("megablocks.layers.arguments"),
    )
    return None if dmoe is None or arguments is None else (dmoe, arguments)


def _ratio(ours: float | None, theirs: float | None) -> float | None:
    if ours is None or theirs is None or not theirs > 0:
        return None
    return ours / theirs


def add_megablocks_ratios(ours: LayerFigures, megablocks: LayerFigures) -> None:
    """Fill ours' ``*_vs_megablocks`` fields: ours / MegaBlocks' (None where either is missing)."""
    ours.step_vs_megablocks = _ratio(ours.step_ms, megablocks.step_ms)
    ours.fwd_vs_megablocks = _ratio(ours.fwd_ms, megablocks.fwd_ms)
    ours.activation_vs_megablocks = _ratio(ours.activation_mib, megablocks.activation_mib)
    ours.peak_vs_megablocks = _ratio(ours.peak_mib, megablocks.peak_mib)


def _free_device_memory(device: torch.device) -> None:
    if device.type == "cuda":  # the next layer's weights (GBs at dsv3) want the cached blocks back
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _layer_row(
    case: Case,
    kind: str,
    provider: str,
    provider_kind: str,
    build: Callable[[], _LayerUnderTest],
    timer: LayerTimer,
    gemms: list[tuple[str, tuple[int, int, int]]],
    floor: Floor,
    sustain_s: float,
) -> Result:
    """Build one layer, check it (ours), and time it at the sustained clock, against ``floor`` (the
    same for every row of the shape and experts); its memory is freed on return."""
    device = case.x.device
    under = build()
    if provider_kind == "ours":  # the first steps also allocate the .grad tensors
        with use_backend("reference"):
            want = under.step()
        check = _close(under.step(), want, 2e-2)
    else:  # its own weights: nothing to compare
        under.step()
        check = "n/a"
    # Warm-up: on the CPU (smoke tests, where a step may take seconds under the Triton interpreter)
    # the checked steps are enough.
    warmup = 3 if device.type == "cuda" else 0
    (step_ms,) = timer([under.step], warmup, sustain_s)
    (fwd_ms,) = timer([under.forward], warmup, 0.0)  # right after: still the sustained clock
    _free_device_memory(device)
    figures = LayerFigures(
        experts=kind,
        step_ms=step_ms,
        fwd_ms=fwd_ms,
        floor_ms=floor.step_ms,
        fwd_floor_ms=floor.fwd_ms,
        efficiency=floor.step_ms / step_ms,
        fwd_efficiency=floor.fwd_ms / fwd_ms,
        activation_mib=_activation_mib(under.forward, device),
        peak_mib=_peak_mb(under.step, device),
        cold_floor_ms=floor.cold_step_ms,
    )
    flops = sum(2.0 * m * n * k for _, (m, n, k) in gemms)
    return Result(
        case.name,
        "layer",
        provider,
        provider_kind,
        step_ms * 1e3,
        flops / (step_ms * 1e-3) / 1e12,  # TFLOP/s of the expert GEMMs over the whole step
        "TFLOP/s",
        step_ms / floor.step_ms,
        check,
        figures.peak_mib,
        figures,
    )


def _layer_results(
    case: Case,
    kinds: list[str],
    timer: LayerTimer,
    with_peers: bool,
    log: Callable[[str], None],
    sustain_s: float = SUSTAIN_S,
) -> Iterator[Result]:
    """The layer item at one shape: for each expert kind, its floor, then ours and MegaBlocks'
    rows (one layer at a time), then the floor again (``floor_after_ms``)."""
    megablocks = _megablocks_layer_modules(case.x.device) if with_peers else None
    device, dtype = case.x.device, case.x.dtype
    for kind in kinds:
        glu = kind == "glu"
        gemms = expert_gemms(case.tokens, case.hidden, case.ffn, case.top_k, glu)
        log(f"[{case.name}] layer ({kind}): the GEMM floor, cold and sustained")
        floor = measure_floor(gemms, device, dtype, timer, sustain_s)
        builders: list[tuple[str, str, Callable[[], _LayerUnderTest]]] = [
            (OUR_LAYER, "ours", functools.partial(_our_layer, case, glu)),
            # The same layer with gather/gmm/scatter as separate ops: what the fusion changes.
            (OUR_UNFUSED_LAYER, "ours", functools.partial(_our_layer, case, glu, False)),
            # The expert weight gradients added into the existing .grad by the wgrad GEMMs
            # (gmm_weight_grad_accumulate), not by autograd's separate add: the steady state
            # timed here is the one it speeds up.
            (
                OUR_ACCUMULATION_FUSED_LAYER,
                "ours",
                functools.partial(_our_layer, case, glu, True, True),
            ),
        ]
        if megablocks is not None:
            builders.append(
                (
                    MEGABLOCKS_LAYER,
                    "peer",
                    functools.partial(_megablocks_layer, case, glu, *megablocks),
                )
            )
        rows: list[Result] = []
        for provider, provider_kind, build in builders:
            log(f"[{case.name}] layer ({kind}): {provider}")
            try:
                row = _layer_row(
                    case,
                    kind,
                    provider,
                    provider_kind,
                    build,
                    timer,
                    gemms,
                    floor,
                    sustain_s,
                )
            except Exception as exc:  # a peer that rejects the shape is reported, not fatal
                failed = LayerFigures(
                    kind,
                    math.nan,
                    math.nan,
                    floor.step_ms,
                    floor.fwd_ms,
                    math.nan,
                    math.nan,
                    None,
                    None,
                    floor.cold_step_ms,
                )
                error = f"error: {type(exc).__name__}: {exc}"[:200]
                row = Result(
                    case.name,
                    "layer",
                    provider,
                    provider_kind,
                    math.nan,
                    None,
                    "",
                    None,
                    error,
                    layer=failed,
                )
            _free_device_memory(case.x.device)  # this layer's weights, before the next one's
            rows.append(row)
            yield row  # at once; ours' ratios to MegaBlocks' are filled in below
        after = measure_floor(gemms, device, dtype, timer, sustain_s)
        for r in rows:
            if r.layer is not None:
                r.layer.floor_after_ms = after.step_ms
        ran = {r.provider: r.layer for r in rows if r.layer and not r.check.startswith("error")}
        ours, theirs = ran.get(OUR_LAYER), ran.get(MEGABLOCKS_LAYER)
        if ours is not None and theirs is not None:
            add_megablocks_ratios(ours, theirs)


#: The op each benchmark item dispatches.
DISPATCHED = {
    "routing": "route",
    "gather": "gather",
    "scatter": "scatter",
    "padded_gather": "padded_gather",
    "padded_scatter": "padded_scatter",
    "scatter_wgrad": "scatter_wgrad",
    "gmm": "gmm",
    "gmm_train": "gmm",
}


def _peers(case: Case) -> dict[str, dict[str, Callable[[], Any]]]:
    """op → peer name → callable returning the same thing as ours (for the check)."""
    c = case
    peers: dict[str, dict[str, Callable[[], Any]]] = {op: {} for op in OPS}

    def torch_routing() -> tuple[torch.Tensor, ...]:
        bin_ids, indices = torch.sort(c.top_experts, stable=True)
        counts = torch.bincount(c.top_experts, minlength=c.experts).int()  # syncs on CUDA
        padded = ((counts + BLOCK - 1) // BLOCK * BLOCK).cumsum(0).int()
        return indices.int(), bin_ids, counts, counts.cumsum(0).int(), padded

    def torch_scatter() -> torch.Tensor:
        out = torch.zeros(c.tokens, c.hidden, device=c.x.device, dtype=torch.float32)
        scaled = c.rows.float() * c.weights.float()[c.indices.long()].unsqueeze(1)
        return out.index_add_(0, c.indices.long() // c.top_k, scaled).to(c.x.dtype)

    peers["routing"]["torch"] = torch_routing
    peers["gather"]["torch"] = lambda: c.x.index_select(0, c.indices.long() // c.top_k)
    peers["scatter"]["torch"] = torch_scatter
    if hasattr(torch, "_grouped_mm") and c.x.is_cuda:
        offsets = c.counts.cumsum(0).int()
        peers["gmm"]["torch._grouped_mm"] = lambda: torch._grouped_mm(c.rows, c.w1, offs=offsets)
        peers["gmm_train"]["torch._grouped_mm"] = lambda: _gmm_train_step(
            c, lambda a, b: torch._grouped_mm(a, b, offs=offsets)
        )

    def loop_gmm() -> torch.Tensor:
        return torch.cat(
            [a @ w for a, w in zip(c.rows.split(c.counts_cpu.tolist()), c.w1, strict=True)]
        )

    peers["gmm"]["torch loop"] = loop_gmm
    mb = _optional("megablocks.ops")
    if mb is not None and c.x.is_cuda:

        def mb_routing() -> tuple[torch.Tensor, ...]:
            bin_ids, indices = mb.sort(c.top_experts, c.end_bit)
            counts = mb.histogram(c.top_experts, c.experts)
            bins = mb.inclusive_cumsum(counts, 0)
            padded = mb.inclusive_cumsum(mb.round_up(counts, BLOCK), 0)
            return indices, bin_ids, counts, bins, padded

        peers["routing"]["megablocks"] = mb_routing
        peers["gather"]["megablocks"] = lambda: mb.gather(
            c.x, c.indices, c.bin_ids, c.bins, c.top_k
        )
        peers["scatter"]["megablocks"] = lambda: mb.scatter(
            c.rows, c.indices, c.bin_ids, c.weights, c.bins, c.top_k
        )
        peers["padded_gather"]["megablocks"] = lambda: mb.padded_gather(
            c.x, c.indices, c.bin_ids, c.bins, c.padded_bins, c.top_k
        )
        peers["padded_scatter"]["megablocks"] = lambda: mb.padded_scatter(
            c.padded_rows, c.indices, c.bin_ids, c.weights, c.bins, c.padded_bins, c.top_k
        )
    gg = _optional("grouped_gemm.ops")
    if gg is not None and c.x.is_cuda and c.x.dtype == torch.bfloat16:
        peers["gmm"]["grouped_gemm"] = lambda: gg.gmm(c.rows, c.w1, c.counts_cpu)
        peers["gmm_train"]["grouped_gemm"] = lambda: _gmm_train_step(
            c, lambda a, b: gg.gmm(a, b, c.counts_cpu)
        )
    return peers


def _providers(op: str, case: Case) -> list[str]:
    """Kernels (``backend`` or ``backend/variant``) that can serve this op's call on this device."""
    name = DISPATCHED[op]
    contract_dtypes = {"gmm": {"a": case.x.dtype, "b": case.x.dtype}}.get(name, {"x": case.x.dtype})
    if op == "routing":
        contract_dtypes = {"top_experts": case.top_experts.dtype}
    trace = explain(name, describe(case.x.device), contract_dtypes)
    labels = [c.kernel.label for c in trace.candidates if c.accepted]
    # Several backends for a grouped GEMM: also time what the default ranking picks per shape.
    default = ["default"] if op.startswith("gmm") and len(labels) > 1 else []
    return list(dict.fromkeys(labels)) + default


def _default_gmm(case: Case) -> str:
    """The gmm kernel the default ranking gives this case's forward call."""
    args = (case.rows, case.w1, case.counts_cpu, False)
    trace = explain("gmm", describe(case.x.device), {"a": case.x.dtype, "b": case.x.dtype})
    kernel, _ = dispatch.explain_call(trace, dispatch.describe_call(contracts.BY_NAME["gmm"], args))
    return kernel.label if kernel else "?"


def run(
    shapes: list[str],
    custom: list[tuple[int, int, int, int, int]],
    ops_wanted: list[str],
    device: torch.device,
    dtype: torch.dtype,
    quick: bool = False,
    peers: bool = True,
    log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True),
    layer_experts: Sequence[str] = LAYER_EXPERTS,
) -> Iterator[Result]:
    timer = _timer(device, quick)
    named = [(s, SHAPES[s]) for s in shapes] + [(",".join(map(str, c)), c) for c in custom]
    if "host" in ops_wanted:
        yield from _host_rows(named, device, quick, peers, log)
        ops_wanted = [op for op in ops_wanted if op != "host"]
        if not ops_wanted:
            return
    for label, shape in named:
        log(
            f"[{label}] building inputs T={shape[0]} H={shape[1]} F={shape[2]} E={shape[3]} K={shape[4]}"
        )
        case = Case(label, shape, device, dtype)
        copy_src = case.rows
        copy_dst = torch.empty_like(copy_src)
        copy_us = timer(lambda src=copy_src, dst=copy_dst: dst.copy_(src))
        bandwidth = 2 * copy_src.numel() * copy_src.element_size() / (copy_us * 1e-6)  # bytes/s
        del copy_dst
        yield Result(
            label,
            "copy",
            "device copy (T*K, H)",
            "limit",
            copy_us,
            bandwidth / 1e9,
            "GB/s",
            None,
            "n/a",
        )
        dense_rate = math.nan
        if any(o.startswith("gmm") for o in ops_wanted):
            dense_a = torch.randn(case.tokens * case.top_k, case.hidden, device=device, dtype=dtype)
            dense_us = timer(lambda a=dense_a, w=case.w1[0]: a @ w)
            del dense_a
            dense_rate = case.gmm_flops / (dense_us * 1e-6) / 1e12
            yield Result(
                label,
                "gmm",
                "dense mm, same FLOPs",
                "limit",
                dense_us,
                dense_rate,
                "TFLOP/s",
                None,
                "n/a",
            )
        ours, peer_fns = _ours(case), (_peers(case) if peers else {op: {} for op in OPS})
        for op in ops_wanted:
            if op == "layer":  # what a user gets: the default ranking for every op
                yield from _layer_results(
                    case, list(layer_experts), _layer_timer(device, quick), peers, log
                )
                continue
            with use_backend("reference"):
                want = ours[op]()
            tol = 0.0 if op in ("gather", "padded_gather", "routing") else 2e-2
            entries = [
                (b, "ours", ours[op], None if b == "default" else b) for b in _providers(op, case)
            ]
            entries += [(p, "peer", fn, None) for p, fn in peer_fns[op].items()]
            for provider, kind, fn, backend in entries:
                if (
                    backend == "reference"
                    and device.type != "cpu"
                    and not quick
                    and op.startswith("gmm")
                ):
                    continue  # the per-expert loop is a correctness oracle, not a contender
                log(f"[{label}] {op}: {provider}")

                def forced(backend: str | None = backend) -> Any:
                    return use_backend(backend) if backend else contextlib.nullcontext()

                with forced():
                    try:
                        check = _close(fn(), want, tol)
                        us = timer(fn)
                    except Exception as exc:  # a peer that rejects the shape is reported, not fatal
                        yield Result(
                            label,
                            op,
                            provider,
                            kind,
                            math.nan,
                            None,
                            "",
                            None,
                            f"error: {type(exc).__name__}: {exc}"[:200],
                        )
                        continue
                if op.startswith("gmm"):  # gmm_train: three GEMMs of equal FLOPs (forward, dA, dB)
                    rate = (3 if op == "gmm_train" else 1) * case.gmm_flops / (us * 1e-6) / 1e12
                    if provider == "default":
                        provider = f"default: {_default_gmm(case)}"
                    yield Result(
                        label, op, provider, kind, us, rate, "TFLOP/s", dense_rate / rate, check
                    )
                elif op == "routing":
                    yield Result(label, op, provider, kind, us, None, "", None, check)
                    if device.type == "cuda":  # GPU time alone, without Python launch costs
                        with forced():
                            graph_us = _graph_time(fn, timer)
                        yield Result(
                            label,
                            op,
                            f"{provider} (CUDA graph)",
                            kind,
                            graph_us,
                            None,
                            "",
                            None,
                            check if not math.isnan(graph_us) else "not capturable (host sync)",
                        )
                else:
                    nbytes = (
                        case.padded_permutation_bytes
                        if op.startswith("padded")
                        else case.permutation_bytes
                    )
                    rate = nbytes / (us * 1e-6) / 1e9
                    yield Result(
                        label,
                        op,
                        provider,
                        kind,
                        us,
                        rate,
                        "GB/s",
                        us / (nbytes / bandwidth * 1e6),
                        check,
                    )


def _host_rows(
    named: list[tuple[str, tuple[int, ...]]],
    device: torch.device,
    quick: bool,
    peers: bool,
    log: Callable[[str], None],
) -> Iterator[Result]:
    """The host item: what an eager call costs the host, beside its GPU time, at decode-sized
    token counts (:data:`HOST_TOKENS`) with each shape's widths, bf16 (benchmarks/host_cost.py's
    cases: routing, router_topk, permutation, the layer's grouped GEMMs, the dMoE forward; with
    peers, MegaBlocks' ops and dMoE on the same inputs). ``us``: host µs per call of back-to-back
    calls without a sync; a second row per case, "(CUDA graph)": the GPU µs of a replay. Our rows
    carry ``vs_megablocks`` (host µs, ours / MegaBlocks'). ``check`` "ok": the call ran, and its
    graph row was captured (values are the other items' and the test suite's job); a graph row
    that could not be captured (a host sync) says so, which fails one of ours."""
    if device.type != "cuda":
        log("[host] the host item needs a CUDA device: skipped")
        return
    host_cost = _sibling("host_cost")
    calls = 200 if quick else 1000
    for label, shape in named:
        _, hidden, ffn, experts, top_k = shape
        cases: dict[str, Callable[[], Any]] = {}
        for tokens in HOST_TOKENS:
            log(f"[{label}] host item, T={tokens}")
            shaped = {
                **host_cost.op_cases(tokens, hidden, experts, top_k),
                **host_cost.grouped_gemm_cases(tokens, hidden, ffn, experts, top_k),
            }
            cases.update({f"{name}@{tokens}": fn for name, fn in shaped.items()})
        layer = host_cost.layer_cases(hidden, ffn, experts, top_k, HOST_TOKENS)
        for name, fn in layer.items():  # "dmoe_forward_T16" -> "dmoe_forward@16"
            base, _, tokens_text = name.rpartition("_T")
            cases[f"{base}@{tokens_text}"] = fn
        rows: dict[str, Result] = {}
        for key, fn in cases.items():
            name, _, tokens_text = key.partition("@")
            theirs = name.startswith("megablocks_")
            if theirs and not peers:
                continue
            op = name.removeprefix("megablocks_")
            where = f"{label}:{tokens_text}"
            provider, kind = ("megablocks", "peer") if theirs else ("ours", "ours")
            n = max(calls // 10, 30) if op == "dmoe_forward" else calls
            rows[key] = Result(
                where, op, provider, kind, host_cost.host_us(fn, n), None, "", None, "ok"
            )
            try:
                graph_us = host_cost.graph_us(fn)
            except Exception:  # a peer that syncs the host cannot be captured
                graph_us = math.nan
            check = "ok" if not math.isnan(graph_us) else "not capturable (host sync)"
            graph = Result(
                where, op, f"{provider} (CUDA graph)", kind, graph_us, None, "", None, check
            )
            yield rows[key]
            yield graph
        for key, row in rows.items():
            peer = rows.get(f"megablocks_{key}")
            if row.kind == "ours" and peer is not None and peer.us > 0:
                row.vs_megablocks = row.us / peer.us
                log(f"[{label}] host {key}: {row.vs_megablocks:.2f}x MegaBlocks")


def _sibling(name: str) -> Any:
    """A module of this directory (benchmarks/), loaded by path: the CLI loads bench.py that way."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        f"megablocks_{name}", Path(__file__).with_name(f"{name}.py")
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


OPS_HEADER = f"{'shape':<10}{'op':<18}{'provider':<24}{'kind':<6}{'µs':>10}{'rate':>16}{'vs limit':>10}  check"
LAYER_HEADER = (
    f"{'layer':<9}{'experts':<8}{'provider':<31}{'kind':<6}{'step ms':>10}{'fwd ms':>10}"
    f"{'floor ms':>10}{'cold ms':>9}{'eff':>6}{'fwd eff':>8}{'act MiB':>9}{'peak MiB':>10}"
    f"  {'vs MegaBlocks: step fwd act peak':<34}check"
)
#: What starts the line ``main`` prints for each row as soon as it is measured.
STREAMED = "result: "


def format_row(r: Result) -> str:
    """One row of the ops table."""
    rate = f"{r.rate:.1f} {r.unit}" if r.rate is not None else ""
    vs = f"{r.vs_limit:.2f}x" if r.vs_limit is not None else ""
    peak = f"  peak {r.peak_mb:.0f} MiB" if r.peak_mb is not None else ""
    peer = f"  {r.vs_megablocks:.2f}x MegaBlocks" if r.vs_megablocks is not None else ""
    return (
        f"{r.shape:<10}{r.op:<18}{r.provider:<24}{r.kind:<6}{r.us:>10.1f}{rate:>16}{vs:>10}"
        f"  {r.check}{peak}{peer}"
    )


def format_layer_row(r: Result) -> str:
    """One row of the layer table; ratios are ours / MegaBlocks' ("-" until both ran)."""

    def num(value: float | None, spec: str, suffix: str = "") -> str:
        return "-" if value is None else f"{value:{spec}}{suffix}"

    f = r.layer
    assert f is not None
    ratios = " ".join(
        num(v, ".2f", "x")
        for v in (
            f.step_vs_megablocks,
            f.fwd_vs_megablocks,
            f.activation_vs_megablocks,
            f.peak_vs_megablocks,
        )
    )
    return (
        f"{r.shape:<9}{f.experts:<8}{r.provider:<31}{r.kind:<6}{f.step_ms:>10.3f}"
        f"{f.fwd_ms:>10.3f}{f.floor_ms:>10.3f}{num(f.cold_floor_ms, '.3f'):>9}{f.efficiency:>6.2f}{f.fwd_efficiency:>8.2f}"
        f"{num(f.activation_mib, '.0f'):>9}{num(f.peak_mib, '.0f'):>10}"
        f"  {ratios if r.kind == 'ours' else '':<34}{r.check}"
    )


def format_table(results: list[Result]) -> str:
    """The results as text: one table for the ops, then (if any) one for the layer item."""
    lines = [OPS_HEADER] + [format_row(r) for r in results if r.layer is None]
    layer_rows = [r for r in results if r.layer is not None]
    if layer_rows:
        lines += ["", format_layer_table(layer_rows)]
    return "\n".join(lines)


def format_layer_table(results: list[Result]) -> str:
    """The layer item: a line per (shape, experts, provider); ratios are ours / MegaBlocks'."""
    return "\n".join([LAYER_HEADER] + [format_layer_row(r) for r in results])


def stream(results: Iterator[Result], out: Any = None) -> Iterator[Result]:
    """``results``, each also printed (flushed) as soon as it comes: a line ``result: `` + its
    table row, after the table's header the first time a row of that table comes. A run that is
    killed keeps the rows measured so far; the tables at the end are printed whole."""
    headers = {False: OPS_HEADER, True: LAYER_HEADER}
    for r in results:
        layer = r.layer is not None
        header = headers.pop(layer, None)
        if header is not None:
            print(STREAMED + header, file=out, flush=True)
        print(STREAMED + (format_layer_row(r) if layer else format_row(r)), file=out, flush=True)
        yield r


def _as_json(result: Result) -> dict[str, Any]:
    """A result as a JSON object; only the layer item's rows have a ``layer`` key, only the host
    item's our rows with a MegaBlocks peer a ``vs_megablocks`` key."""
    row = asdict(result)
    for optional in ("layer", "vs_megablocks"):  # only the layer / host items' rows have them
        if row[optional] is None:
            del row[optional]
    return row


def main(args: Any) -> int:
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    shape_error = CLIError(f"--shape takes T,H,F,E,K (five integers), got {args.shape}")
    try:
        custom = [tuple(int(v) for v in s.split(",")) for s in args.shape]
    except ValueError:
        raise shape_error from None
    if any(len(c) != 5 for c in custom):
        raise shape_error
    defaults = CPU_DEFAULT_SHAPES if device.type == "cpu" else DEFAULT_SHAPES
    shapes = (
        [s for s in args.shapes.split(",") if s]
        if args.shapes
        else ([] if custom else list(defaults))
    )
    if not args.shapes and not custom and device.type == "cpu":
        print(
            f"megablocks bench: on the CPU the default shape is {', '.join(defaults)}; pass --shapes "
            f"{','.join(DEFAULT_SHAPES)} or --shape T,H,F,E,K to time larger ones",
            file=sys.stderr,
        )
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        raise CLIError(f"unknown shape(s) {unknown}; known: {', '.join(SHAPES)}")
    if not shapes and not custom:
        raise CLIError(f"--shapes {args.shapes!r} names no shape; known: {', '.join(SHAPES)}")
    wanted = [o for o in args.ops.split(",") if o] if args.ops else list(OPS)
    bad = [o for o in wanted if o not in OPS]
    if bad:
        raise CLIError(f"unknown op(s) {bad}; known: {', '.join(OPS)}")
    if not wanted:
        raise CLIError(f"--ops {args.ops!r} names no op; known: {', '.join(OPS)}")
    layer_experts = [
        k for k in getattr(args, "layer_experts", ",".join(LAYER_EXPERTS)).split(",") if k
    ]
    bad_kinds = [k for k in layer_experts if k not in LAYER_EXPERTS]
    if bad_kinds or not layer_experts:
        raise CLIError(
            f"unknown --layer-experts {bad_kinds or layer_experts}; known: {', '.join(LAYER_EXPERTS)}"
        )
    results = list(
        stream(
            run(
                shapes,
                custom,
                wanted,
                device,
                dtype,
                quick=args.quick,
                peers=not args.no_peers,
                layer_experts=layer_experts,
            )
        )
    )
    print(format_table(results))
    if args.json:
        meta = {
            "device": str(describe(device)),
            "dtype": args.dtype,
            "torch": torch.__version__,
            "quick": args.quick,
            "shapes": {s: SHAPES[s] for s in shapes},
            "layer_experts": layer_experts,
        }
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": [_as_json(r) for r in results]}, f, indent=2)
    failed = [r for r in results if r.kind == "ours" and r.check != "ok"]
    return 1 if failed else 0
