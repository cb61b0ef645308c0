"""Expert parallelism (megablocks_core.layers.parallel) on CPU with gloo: W processes vs one process.

One spawn per world size runs every case (process start-up dominates the cost); each child saves
its results, or its traceback, to a file that the parent compares with the single-process layer
(all experts, same seed) run rank by rank on the same tokens. Loopback only, a free port chosen by
the parent, timeouts on the process group and on the join: a hang fails the test, never blocks.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

import megablocks_core
from megablocks_core.layers import DroplessMoE

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="needs torch.distributed with gloo",
)

HIDDEN, FFN = 6, 5
JOIN_TIMEOUT_S = 120.0  # whole spawn; the process group's own timeout is shorter


@dataclass(frozen=True)
class Case:
    name: str
    experts: int
    top_k: int
    glu: bool
    tokens: tuple[int, ...]  # tokens per rank (its length is the world size)
    starve: bool = False  # route every token to rank 0's experts only
    normalize: float | None = None
    ep_size: int | None = None  # expert-parallel groups of consecutive ranks; None: the world

    def ep(self) -> int:
        return self.ep_size or len(self.tokens)


CASES = {
    2: [
        Case("k1-mlp", 4, 1, False, (5, 7)),
        Case("k2-glu", 4, 2, True, (6, 4), normalize=1.0),
        Case("k2-rank-without-tokens", 4, 2, False, (7, 0)),
        Case("k1-glu-rank-experts-starved", 4, 1, True, (5, 6), starve=True),
        Case("k2-rank-experts-starved", 4, 2, True, (4, 3), starve=True),
        Case("E8-k4-glu", 8, 4, True, (5, 3)),
    ],
    4: [
        Case("W4-k2-glu", 8, 2, True, (4, 0, 5, 3)),
        Case("W4-k1-starved", 8, 1, False, (3, 4, 0, 2), starve=True),
        # 2 data-parallel replicas × 2-way expert parallelism (dist.new_group, as in the docs)
        Case("W4-dp2-ep2-k2", 4, 2, True, (3, 5, 4, 0), ep_size=2),
    ],
}


def make_layer(case: Case, group: object | None = None) -> DroplessMoE:
    layer = DroplessMoE(
        HIDDEN,
        FFN,
        case.experts,
        case.top_k,
        glu=case.glu,
        seed=11,
        normalize_expert_weights=case.normalize,
        dtype=torch.float64,
        load_balancing_loss_coefficient=0.1,
        expert_parallel_group=group,
    )
    # A larger router than the 0.02 default: clear top-k choices, no near-ties between experts.
    with torch.no_grad():
        layer.router.copy_(
            torch.randn(
                layer.router.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(7)
            )
        )
        if case.starve:  # feature 0 is a constant 1 (see tokens): it vetoes other ranks' experts
            local = case.experts // case.ep()
            layer.router[local:, 0] = -50.0
    return layer


def tokens(case: Case, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank's input and the output gradient it back-propagates, the same in parent and child."""
    g = torch.Generator().manual_seed(100 * rank + len(case.name))
    x = torch.randn(case.tokens[rank], HIDDEN, dtype=torch.float64, generator=g)
    if case.starve:
        x[:, 0] = 1.0
    return x, torch.randn(x.shape, dtype=torch.float64, generator=g)


def expert_params(layer: DroplessMoE) -> dict[str, torch.Tensor]:
    return {n: p for n in ("w1", "v1", "w2") if (p := getattr(layer, n)) is not None}


def _child(rank: int, world: int, port: int, outdir: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = _loopback_interface()  # loopback only
    torch.set_num_threads(1)  # two busy cores are shared by every process
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        results: dict[str, object] = {}
        groups, dp_groups = {world: dist.group.WORLD}, {}
        for ep in sorted({c.ep() for c in CASES[world]} - {world}):
            for first in range(0, world, ep):  # every rank creates every group, in order
                group = dist.new_group(list(range(first, first + ep)))
                if rank // ep == first // ep:
                    groups[ep] = group
            for shard in range(ep):  # the ranks holding the same expert shard
                group = dist.new_group(list(range(shard, world, ep)))
                if rank % ep == shard:
                    dp_groups[ep] = group
        with megablocks_core.use_backend("reference"):
            for case in CASES[world]:
                group = groups[case.ep()]
                layer = make_layer(case, group)
                x, grad = tokens(case, rank)
                x.requires_grad_()
                out, aux = layer(x)
                ((out * grad).sum() + aux).backward()
                router_grad = layer.router.grad.clone()
                dist.all_reduce(router_grad, group=group)  # as data parallelism would
                expert_grads_dp = {}
                if case.ep() in dp_groups:  # the docs' recipe: sum over the shard's replicas
                    for name, p in expert_params(layer).items():
                        expert_grads_dp[name] = p.grad.clone()
                        dist.all_reduce(expert_grads_dp[name], group=dp_groups[case.ep()])
                results[case.name] = {
                    "expert_grads_dp": expert_grads_dp,
                    "out": out.detach(),
                    "aux": aux.detach(),
                    "x_grad": x.grad,
                    "router_grad": router_grad,
                    "offset": layer.expert_offset,
                    "expert_grads": {n: p.grad for n, p in expert_params(layer).items()},
                    "expert_values": {n: p.detach() for n, p in expert_params(layer).items()},
                }
            try:  # an indivisible expert count is refused before any collective
                DroplessMoE(HIDDEN, FFN, 2 * world + 1, 1, expert_parallel_group=dist.group.WORLD)
                results["indivisible"] = "accepted"
            except ValueError as error:
                results["indivisible"] = str(error)
        torch.save(results, Path(outdir, f"rank{rank}.pt"))
    except BaseException:
        Path(outdir, f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def _loopback_interface() -> str:
    names = [name for _, name in socket.if_nameindex()]
    return next((n for n in ("lo", "lo0") if n in names), names[0])


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(world: int, outdir: Path) -> list[dict]:
    context = mp.start_processes(
        _child,
        args=(world, _free_port(), str(outdir)),
        nprocs=world,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    try:
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{world} expert-parallel processes did not finish in {JOIN_TIMEOUT_S:.0f} s"
                )
    except Exception as error:
        errors = "\n".join(p.read_text() for p in sorted(outdir.glob("*.err")))
        raise AssertionError(f"{error}\n{errors}") from error
    finally:
        for process in context.processes:  # only the children started above
            if process.is_alive():
                process.kill()
    return [torch.load(outdir / f"rank{r}.pt") for r in range(world)]


_results: dict[int, list[dict]] = {}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    def get(world: int) -> list[dict]:
        if world not in _results:
            _results[world] = _run(world, tmp_path_factory.mktemp(f"ep{world}"))
        return _results[world]

    return get


def _reference(case: Case, ranks: range) -> tuple[DroplessMoE, list[tuple[torch.Tensor, ...]]]:
    """The single-process layer on each rank's tokens; its loss is the sum of the per-rank losses."""
    layer = make_layer(case)
    per_rank, loss = [], 0
    with megablocks_core.use_backend("reference"):
        for rank in ranks:
            x, grad = tokens(case, rank)
            x.requires_grad_()
            out, aux = layer(x)
            loss = loss + (out * grad).sum() + aux
            per_rank.append((x, out, aux))
        loss.backward()
    return layer, per_rank


ALL = [(world, case) for world, cases in CASES.items() for case in cases]


@pytest.mark.slow
@pytest.mark.parametrize(("world", "case"), ALL, ids=[c.name for _, c in ALL])
def test_matches_single_process(results, world, case):
    got = results(world)
    ep = case.ep()
    for first in range(0, world, ep):  # each expert-parallel group is one single-process layer
        _check_group(case, got, range(first, first + ep))
    if ep < world:  # summed over data-parallel replicas: the single-process layer on all tokens
        layer, _ = _reference(case, range(world))
        local = case.experts // ep
        for rank in range(world):
            shard = slice(rank % ep * local, (rank % ep + 1) * local)
            for name, p in expert_params(layer).items():
                torch.testing.assert_close(
                    got[rank][case.name]["expert_grads_dp"][name],
                    p.grad[shard],
                    rtol=1e-10,
                    atol=1e-12,
                )


def _check_group(case: Case, got: list[dict], ranks: range) -> None:
    layer, per_rank = _reference(case, ranks)
    local = case.experts // len(ranks)
    close = {"rtol": 1e-10, "atol": 1e-12}
    for rank, (x, out, aux) in zip(ranks, per_rank, strict=True):
        res = got[rank][case.name]
        shard = slice((rank - ranks[0]) * local, (rank - ranks[0] + 1) * local)
        assert res["offset"] == shard.start
        torch.testing.assert_close(res["out"], out.detach(), **close)
        torch.testing.assert_close(res["aux"], aux.detach(), **close)
        torch.testing.assert_close(res["x_grad"], x.grad, **close)
        # The router is replicated: the sum of the ranks' gradients is the reference's.
        torch.testing.assert_close(res["router_grad"], layer.router.grad, **close)
        for name, p in expert_params(layer).items():
            assert torch.equal(res["expert_values"][name], p.detach()[shard]), name
            torch.testing.assert_close(res["expert_grads"][name], p.grad[shard], **close)
    if case.starve:  # the other ranks' experts really got nothing: exactly-zero gradients
        for rank in ranks[1:]:
            assert all(not g.any() for g in got[rank][case.name]["expert_grads"].values())
    for rank in ranks:
        if case.tokens[rank] == 0:
            assert got[rank][case.name]["out"].shape == (0, HIDDEN)


@pytest.mark.parametrize("world", list(CASES))
def test_indivisible_experts_rejected(results, world):
    for res in results(world):
        assert "not divisible" in res["indivisible"]


def test_single_process_layer_unchanged():
    """Without a group: all experts, offset 0, the same values as before expert parallelism."""
    layer = DroplessMoE(HIDDEN, FFN, 4, 2, glu=True, seed=3)
    assert layer.num_local_experts == 4 and layer.expert_offset == 0
    g = torch.Generator().manual_seed(3)
    for p in (layer.router, layer.w1, layer.v1, layer.w2):
        assert torch.equal(p.detach(), torch.randn(p.shape, generator=g) * 0.02)
