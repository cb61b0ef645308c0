"""``megablocks demo``: train a tiny MoE model on synthetic data and show which backend ran each op.

The task is one a mixture of experts suits: every input comes from one of a few clusters and each
cluster needs its own linear map (``y = A_c x``). The model is ``Linear → dMoE (residual) → Linear``;
training minimises the mean squared error plus the router's load-balancing loss with AdamW. The run
prints progress, checks that the loss on a fixed held-out batch fell by a margin that fits the
number of steps (see :func:`required_fraction`; exit status 1 otherwise; not judged below
:data:`MIN_JUDGED_TOKENS` tokens a step) and ends with the dispatch summary
(:func:`megablocks_core.dispatch.served`). ``megablocks demo`` runs it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch

from . import dispatch, use_backend
from .dispatch import served
from .layers import DroplessMoE, MoEConfig

#: A long enough run must end below this fraction of its first loss.
REQUIRED_DROP = 0.5
#: Each step must take at least this fraction off the first loss until REQUIRED_DROP is reached:
#: with the default settings a step takes 10-20 % off early on, so a short run is judged fairly.
DROP_PER_STEP = 0.05
#: The loss is judged on one batch of this many tokens, drawn before training and held out of it:
#: the training batches' own losses differ by the batch (a step's loss could rise while the
#: model improved, or fall by luck).
HELD_OUT_TOKENS = 256
#: Below this many tokens a step, training itself is too noisy for any margin (a run of 15 steps
#: of 4 tokens can end above its start), so the result is shown but not judged.
MIN_JUDGED_TOKENS = 8
#: The task's clusters (one per expert, at most this many): with more, the task is slower to learn
#: than the margin expects of a short run, and the demo is about routing, not capacity.
MAX_CLUSTERS = 8


def required_fraction(steps: int) -> float:
    """The fraction of its first loss a run of ``steps`` steps must end below: 0.95 after 2 steps,
    0.8 after 5, 0.5 from 11 steps on."""
    return max(REQUIRED_DROP, 1.0 - DROP_PER_STEP * (steps - 1))


class TinyMoEModel(torch.nn.Module):
    """Input projection → dropless MoE with a residual connection → output head."""

    def __init__(
        self,
        features: int,
        hidden: int,
        ffn: int,
        experts: int,
        top_k: int,
        dtype: torch.dtype,
        device: torch.device,
        seed: int,
        fp8: str | None = None,
    ) -> None:
        super().__init__()
        with torch.random.fork_rng(
            devices=[]
        ):  # seed the two Linear layers, leave the caller's RNG alone
            torch.manual_seed(seed)
            self.proj = torch.nn.Linear(features, hidden, dtype=dtype, device=device)
            self.head = torch.nn.Linear(hidden, features, dtype=dtype, device=device)
        # The MoE seeds its own generator.
        config = MoEConfig(
            hidden, ffn, experts, top_k, glu=True, seed=seed, dtype=dtype, device=device, fp8=fp8
        )
        self.moe = DroplessMoE(config)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.proj(x)
        moe_out, aux_loss = self.moe(h)
        return self.head(h + moe_out), aux_loss


class ClusterTask:
    """Batches of (x, A_c x): x near one of ``clusters`` centres, A_c that cluster's random map."""

    def __init__(self, features: int, clusters: int, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self.centres = 2.0 * torch.randn(clusters, features, generator=self.generator)
        self.maps = (
            torch.randn(clusters, features, features, generator=self.generator) / features**0.5
        )

    def batch(self, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        cluster = torch.randint(0, len(self.centres), (tokens,), generator=self.generator)
        x = self.centres[cluster] + 0.5 * torch.randn(
            tokens, self.centres.shape[1], generator=self.generator
        )
        return x, torch.einsum("tf,tfg->tg", x, self.maps[cluster])


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """Tensors this small gain nothing from intra-op threads; on a busy machine they cost 100x."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def run(
    steps: int = 40,
    device: str = "cpu",
    dtype: str = "float32",
    backend: str | None = None,
    tokens: int = 256,
    features: int = 16,
    hidden: int = 32,
    ffn: int = 64,
    experts: int = 8,
    top_k: int = 2,
    lr: float = 1e-2,
    seed: int = 0,
    log_every: int = 5,
    fp8: str | None = None,
) -> int:
    """Train and report; 0 if the held-out loss fell below :func:`required_fraction` of its value
    before training (or the run has too few tokens a step to judge), else 1. ``fp8``: a format
    name (:data:`megablocks_core.formats.FORMAT_NAMES`) runs the experts' GEMMs in FP8 with that
    format's recipe defaults."""
    if steps < 2:
        raise ValueError(f"demo: --steps must be at least 2, got {steps}")
    dev, dt = torch.device(device), getattr(torch, dtype)
    model = TinyMoEModel(features, hidden, ffn, experts, top_k, dt, dev, seed, fp8)
    task = ClusterTask(features, clusters=min(experts, MAX_CLUSTERS), seed=seed + 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    print("megablocks-core demo: training a tiny dropless-MoE model on synthetic clustered data")
    print(
        f"tokens/step={tokens} features={features} hidden={hidden} ffn={ffn} experts={experts} "
        f"top_k={top_k} glu=yes dtype={dtype} fp8={fp8 or 'off'} device={dev} "
        f"backend={backend or 'ranked'} steps={steps}"
    )

    losses: list[float] = []
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        if backend:
            stack.enter_context(use_backend(*backend.split(",")))
        if interpreted(dev, dt):
            print(
                "note: the Triton interpreter serves the layer's ops on the CPU (TRITON_INTERPRET="
                "1): tens of seconds a step; `--backend reference` takes well under one"
            )
        print()
        if dev.type == "cpu":
            stack.enter_context(_one_thread())
        held_out = tuple(t.to(device=dev, dtype=dt) for t in task.batch(HELD_OUT_TOKENS))
        first = _loss(model, *held_out)
        for step in range(1, steps + 1):
            tick = time.perf_counter()
            x, y = (t.to(device=dev, dtype=dt) for t in task.batch(tokens))
            out, aux_loss = model(x)
            loss = torch.nn.functional.mse_loss(out.float(), y.float())
            optimizer.zero_grad(set_to_none=True)
            (loss + aux_loss).backward()
            optimizer.step()
            losses.append(loss.item())  # host reads, for the log
            if step == 1 or step % log_every == 0 or step == steps:
                rate = tokens / (time.perf_counter() - tick)
                print(
                    f"step {step:4d}/{steps}  loss {losses[-1]:8.4f}  aux {aux_loss.item():.4f}  "
                    f"{rate:9.0f} tokens/s"
                )
        last = _loss(model, *held_out)
    elapsed = time.perf_counter() - started

    required = required_fraction(steps)
    judged = tokens >= MIN_JUDGED_TOKENS
    ok = last <= required * first
    print(
        f"\nloss on {HELD_OUT_TOKENS} held-out tokens: {first:.4f} before training → {last:.4f} "
        f"after, {last / first:.1%} of the start; {elapsed:.1f} s, "
        f"{steps * tokens / elapsed:.0f} tokens/s overall"
    )
    print("\nbackends that served each op:")
    for op, labels in sorted(served().items()):
        print(f"  {op:<18} {', '.join(labels)}")
    if not judged:
        result = (
            f"not judged: with fewer than {MIN_JUDGED_TOKENS} tokens a step the loss need not fall"
        )
    elif ok:
        result = "ok, the loss fell"
    else:
        result = (
            f"FAILED: the loss did not fall below {required:.0%} of its start "
            f"(expected of {steps} steps)"
        )
    print("\nresult: " + result)
    return 0 if ok or not judged else 1


def interpreted(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the Triton backend would serve the layer's grouped GEMMs on ``device`` under the
    policy in force: on the CPU that is its interpreter, far slower than the reference."""
    if device.type != "cpu":
        return False
    winner = dispatch.explain("gmm", device, {"a": dtype, "b": dtype}).winner
    return winner is not None and winner.backend == "triton"


def _loss(model: TinyMoEModel, x: torch.Tensor, y: torch.Tensor) -> float:
    """The task's loss (mean squared error) of ``model`` on one batch, without training."""
    with torch.no_grad():
        out, _ = model(x)
        return torch.nn.functional.mse_loss(out.float(), y.float()).item()
