"""Expert parallelism (megablocks_core.layers.parallel) on CPU with gloo: W processes vs one process.

One spawn per world size runs every case (process start-up dominates the cost); each child saves
its results, or its traceback, to a file that the parent compares with the single-process layer
(all experts, same seed) run rank by rank on the same tokens. Loopback only, a free port chosen by
the parent, timeouts on the process group and on the join: a hang fails the test, never blocks.

The child also records every ``all_to_all_single`` (dtype, row shape, split sizes, async or not),
which the parent checks: the row exchanges' split sizes against a Python count of each chunk's
(token, rank) pairs (each token is sent once per rank it needs), and what NCCL needs but gloo
forgives or hides: every rank of a group issues the same exchanges in the same order, forward and
backward, with matching split sizes (a mismatch hangs NCCL), split sizes as Python ints, dense
tensors, and every asynchronous exchange waited before its output is read and before the call
returns. To catch a read before ``wait()``, the child's asynchronous exchanges fill their output
with garbage when started and only run at ``wait()``.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

import megablocks_core
from megablocks_core.layers import DroplessMoE, MoEConfig
from megablocks_core.layers.moe import expert_parallel_baseline, expert_seed
from megablocks_core.layers.parallel import DEFAULT_CHUNKS, expert_parallel_moe
from megablocks_core.policy import overrides

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
    chunks: int | None = None  # the layer's expert_parallel_chunks; None: its default
    baseline: bool = False  # run moe.expert_parallel_baseline (one row per (token, expert))
    dispatch: str = "alltoall"  # the layer's expert_parallel_dispatch

    def ep(self) -> int:
        return self.ep_size or len(self.tokens)


CASES = {
    2: [
        Case("k1-mlp", 4, 1, False, (5, 7)),
        Case("k2-glu", 4, 2, True, (6, 4), normalize=1.0),
        Case("k2-rank-without-tokens", 4, 2, False, (7, 0)),
        Case("k1-glu-rank-experts-starved", 4, 1, True, (5, 6), starve=True),
        Case("k2-rank-experts-starved", 4, 2, True, (4, 3), starve=True, chunks=3),
        Case("E8-k4-glu", 8, 4, True, (5, 3)),
        Case("E8-k8-chunks1", 8, 8, True, (6, 5), chunks=1),
        Case("E8-k8-more-chunks-than-tokens", 8, 8, False, (3, 0), chunks=5),
        Case("k2-chunks4", 4, 2, True, (9, 8), chunks=4),
        Case("baseline-k2-glu", 4, 2, True, (6, 0), baseline=True),
        Case("allgather-k2-glu", 4, 2, True, (6, 6), normalize=1.0, dispatch="allgather"),
        Case("allgather-E8-k8", 8, 8, False, (5, 5), dispatch="allgather"),
        Case("allgather-k1-starved", 4, 1, True, (4, 4), starve=True, dispatch="allgather"),
        Case("allgather-no-tokens", 4, 2, False, (0, 0), dispatch="allgather"),
    ],
    4: [
        Case("W4-k2-glu", 8, 2, True, (4, 0, 5, 3)),
        Case("W4-k1-starved", 8, 1, False, (3, 4, 0, 2), starve=True),
        Case("W4-k8-chunks3", 8, 8, True, (4, 0, 5, 2), chunks=3),
        Case("W4-k1-more-chunks-than-tokens", 8, 1, False, (3, 4, 0, 2), chunks=6),
        # 2 data-parallel replicas × 2-way expert parallelism (dist.new_group, as in the docs)
        Case("W4-dp2-ep2-k2", 4, 2, True, (3, 5, 4, 0), ep_size=2),
        Case("W4-allgather-k8-glu", 8, 8, True, (4, 4, 4, 4), dispatch="allgather"),
        Case("W4-dp2-ep2-allgather", 4, 2, False, (3, 3, 5, 5), ep_size=2, dispatch="allgather"),
    ],
}


def make_layer(case: Case, group: object | None = None) -> DroplessMoE:
    layer = DroplessMoE(
        MoEConfig(
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
            expert_parallel_chunks=case.chunks,
            expert_parallel_dispatch=case.dispatch,
        )
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
    return {n: getattr(layer, n) for n in ("w1", "w2")}


def _poison(t: torch.Tensor) -> None:
    """Garbage in an exchange's output until it is waited: NaN, or all bits set."""
    t.fill_(float("nan") if t.is_floating_point() else torch.iinfo(t.dtype).max)


class _DeferredWork:
    """An asynchronous exchange that runs only at ``wait()`` (the latest moment NCCL may finish)."""

    def __init__(self, run) -> None:
        self._run, self.waited = run, False

    def wait(self, timeout=None) -> bool:
        if not self.waited:
            self._run()
            self.waited = True
        return True

    def is_completed(self) -> bool:
        return self.waited


def _check_exchanges(log: list[dict], pending: list[_DeferredWork], problems: list[str]) -> None:
    """Make this process's all_to_all_single log every call, note what NCCL would refuse, and
    defer asynchronous calls to their wait() with a poisoned output until then."""
    import torch.distributed as dist

    exchange = dist.all_to_all_single

    def checked(output, input, output_split_sizes=None, input_split_sizes=None, **kwargs):
        world = dist.get_world_size(kwargs.get("group"))
        splits = {}
        for name, tensor, given in (
            ("output", output, output_split_sizes),
            ("input", input, input_split_sizes),
        ):
            if not tensor.is_contiguous():
                problems.append(f"{name} not contiguous: {tuple(tensor.stride())}")
            if given is None:  # equal splits
                if tensor.shape[0] % world:
                    problems.append(f"{name}: {tensor.shape[0]} rows do not split {world} ways")
                given = [tensor.shape[0] // world] * world
            elif type(given) is not list or any(type(n) is not int for n in given):
                problems.append(f"{name} splits are not a list of Python ints: {given!r}")
            elif len(given) != world or sum(given) != tensor.shape[0]:
                problems.append(f"{name} splits {given} for {tensor.shape[0]} rows, {world} ranks")
            splits[name] = [int(n) for n in given]
        async_op = bool(kwargs.get("async_op", False))
        log.append(
            {
                "dtype": str(input.dtype),
                "row": list(input.shape[1:]),
                "out_row": list(output.shape[1:]),
                "in": splits["input"],
                "out": splits["output"],
                "async": async_op,
            }
        )
        if not async_op:
            return exchange(output, input, output_split_sizes, input_split_sizes, **kwargs)
        _poison(output)
        kwargs["async_op"] = False
        work = _DeferredWork(
            lambda: exchange(output, input, output_split_sizes, input_split_sizes, **kwargs)
        )
        pending.append(work)
        return work

    dist.all_to_all_single = checked


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
        log: list[dict] = []
        pending: list[_DeferredWork] = []
        problems: list[str] = []
        _check_exchanges(log, pending, problems)
        with megablocks_core.use_backend("reference"):
            for case in CASES[world]:
                group = groups[case.ep()]
                layer = make_layer(case, group)
                expert_rows = _record_rows(layer)
                x, grad = tokens(case, rank)
                x.requires_grad_()
                log.clear()
                pending.clear()
                out, aux = expert_parallel_baseline(layer, x) if case.baseline else layer(x)
                forward_splits = [  # the exchanges of rows (x's and the experts' outputs)
                    e["in"] for e in log if e["dtype"] == "torch.float64" and e["row"] == [HIDDEN]
                ]
                unwaited = [sum(not w.waited for w in pending)]
                ((out * grad).sum() + aux).backward()
                unwaited.append(sum(not w.waited for w in pending))
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
                    "forward_splits": forward_splits,
                    "expert_rows": expert_rows,
                    "exchanges": list(log),
                    "async_exchanges": len(pending),
                    "unwaited": unwaited,  # after the forward, after the backward
                    "problems": list(problems),
                }
                problems.clear()
            # The per-chunk graphs are freed by the first backward: a second one is refused
            # (on every rank, before any collective), with either dispatch.
            allgather = next(
                c for c in CASES[world] if c.dispatch == "allgather" and c.ep() == world
            )
            for key, case in (
                ("second_backward", CASES[world][0]),
                ("second_backward_allgather", allgather),
            ):
                layer = make_layer(case, dist.group.WORLD)
                out, aux = layer(tokens(case, rank)[0].requires_grad_())
                out.sum().backward(retain_graph=True)
                try:
                    out.sum().backward()
                    results[key] = "accepted"
                except RuntimeError as error:
                    results[key] = str(error)
            # dispatch='allgather' with different token counts: refused in checked mode (on
            # every rank, before the tokens are gathered).
            case = Case("unequal", 4, 2, False, (5, 3), dispatch="allgather")
            layer = make_layer(case, dist.group.WORLD)
            overrides.checked, checked = True, overrides.checked
            try:
                layer(torch.zeros(case.tokens[rank % 2], HIDDEN, dtype=torch.float64))
                results["allgather_unequal"] = "accepted"
            except ValueError as error:
                results["allgather_unequal"] = str(error)
            finally:
                overrides.checked = checked
            try:  # an indivisible expert count is refused before any collective
                DroplessMoE(
                    MoEConfig(HIDDEN, FFN, 2 * world + 1, 1, expert_parallel_group=dist.group.WORLD)
                )
                results["indivisible"] = "accepted"
            except ValueError as error:
                results["indivisible"] = str(error)
        torch.save(results, Path(outdir, f"rank{rank}.pt"))
    except BaseException:
        Path(outdir, f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()
    # Results are saved: leave without the interpreter's teardown, where gloo's worker threads
    # now and then abort the process ("terminate called without an active exception").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _record_rows(layer: DroplessMoE) -> list[int | None]:
    """The row count (``rows``) each call of the layer's fused experts gets, as it comes."""
    seen: list[int | None] = []
    fused = layer._fused_experts

    def recording(*args: object) -> torch.Tensor:
        seen.append(args[5])  # type: ignore[arg-type]
        return fused(*args)

    layer._fused_experts = recording  # type: ignore[method-assign]
    return seen


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


@pytest.mark.slow
@pytest.mark.parametrize(("world", "case"), ALL, ids=[c.name for _, c in ALL])
def test_exchanges_are_what_nccl_needs(results, world, case):
    """Every rank of a group issues the same exchanges in the same order, with split sizes that
    pair up (rank a sends rank b what b expects from a), all of them Python ints over dense
    tensors, and every asynchronous one is waited before the forward (backward) returns."""
    got = results(world)
    ep = case.ep()
    chunks = case.chunks or DEFAULT_CHUNKS
    for first in range(0, world, ep):
        ranks = range(first, first + ep)
        for rank in ranks:
            res = got[rank][case.name]
            assert res["problems"] == [], (rank, res["problems"])
            assert res["unwaited"] == [0, 0], rank
        logs = [got[rank][case.name]["exchanges"] for rank in ranks]
        # The layer: one exchange of counts, then per chunk rows, their routing and partials
        # back; backward per chunk: the partials' gradient out, the rows' and the weights' back.
        # The baseline: counts, rows and results (synchronous), then those two reversed.
        # The all-gather dispatch makes no all-to-all at all.
        want = 5 if case.baseline else 0 if case.dispatch == "allgather" else 1 + 6 * chunks
        assert [len(log) for log in logs] == [want] * ep
        asynchronous = [got[rank][case.name]["async_exchanges"] for rank in ranks]
        assert asynchronous == [0 if case.baseline or want == 0 else 6 * chunks] * ep
        for i, calls in enumerate(zip(*logs, strict=True)):
            kinds = {(c["dtype"], tuple(c["row"]), tuple(c["out_row"]), c["async"]) for c in calls}
            assert len(kinds) == 1, (i, calls)
            assert calls[0]["row"] == calls[0]["out_row"]
            for a in range(ep):
                for b in range(ep):
                    assert calls[a]["in"][b] == calls[b]["out"][a], (i, a, b, calls)


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
    tops = [layer.route(x.detach())[2].tolist() for x, _, _ in per_rank]
    for me, rank in enumerate(ranks):
        assert got[rank][case.name]["forward_splits"] == _expected_row_splits(case, tops, me)
        assert got[rank][case.name]["expert_rows"] == _expected_rows(case, tops, me)
    if case.starve:  # the other ranks' experts really got nothing: exactly-zero gradients
        for rank in ranks[1:]:
            assert all(not g.any() for g in got[rank][case.name]["expert_grads"].values())
    for rank in ranks:
        if case.tokens[rank] == 0:
            assert got[rank][case.name]["out"].shape == (0, HIDDEN)


def _expected_row_splits(case: Case, tops: list[list[list[int]]], me: int) -> list[list[int]]:
    """Input splits of the row exchanges in rank ``me``'s forward (``tops``: each group rank's
    top-k expert ids per token): each chunk's dispatch (tokens per destination rank), then each
    chunk's return (as many rows to each rank as it sent). The baseline sends one row per
    (token, expert) pair, then returns them."""
    world, local = len(tops), case.experts // len(tops)
    if case.baseline:
        pairs = [sum(e // local == r for token in tops[me] for e in token) for r in range(world)]
        back = [sum(e // local == me for token in tops[s] for e in token) for s in range(world)]
        return [pairs, back]
    if case.dispatch == "allgather":  # all-gather and reduce-scatter: no all-to-all
        return []
    chunks = case.chunks or DEFAULT_CHUNKS

    def sent(source: int, c: int) -> list[int]:
        n = len(tops[source])
        chunk = tops[source][c * n // chunks : (c + 1) * n // chunks]
        return [sum(any(e // local == r for e in token) for token in chunk) for r in range(world)]

    dispatch = [sent(me, c) for c in range(chunks)]
    return dispatch + [[sent(s, c)[me] for s in range(world)] for c in range(chunks)]


def _expected_rows(case: Case, tops: list[list[list[int]]], me: int) -> list[int | None]:
    """The row count rank ``me``'s fused experts get per call: per chunk, the (token, k) pairs of
    every group rank's tokens in that chunk whose expert ``me`` holds (its own pairs only); the
    all-gather dispatch knows no count (None); the baseline runs no fused experts."""
    if case.baseline:
        return []
    if case.dispatch == "allgather":
        return [None]
    local, chunks = case.experts // len(tops), case.chunks or DEFAULT_CHUNKS
    counts = []
    for c in range(chunks):
        pairs = 0
        for source in tops:
            n = len(source)
            chunk = source[c * n // chunks : (c + 1) * n // chunks]
            pairs += sum(e // local == me for token in chunk for e in token)
        counts.append(pairs)
    return counts


@pytest.mark.parametrize("world", list(CASES))
def test_second_backward_refused(results, world):
    for res in results(world):
        assert "retain_graph is not supported" in res["second_backward"]
        assert "retain_graph is not supported" in res["second_backward_allgather"]


@pytest.mark.parametrize("world", list(CASES))
def test_allgather_refuses_unequal_tokens_in_checked_mode(results, world):
    for res in results(world):
        assert "same number of tokens on every rank" in res["allgather_unequal"]


def test_bad_arguments_rejected_before_any_collective():
    x, weights = torch.zeros(3, HIDDEN), torch.zeros(3, 2)
    top = torch.zeros(3, 2, dtype=torch.int32)

    def call(**changes):
        args = {"x": x, "weights": weights, "top_experts": top, "chunks": 1} | changes
        expert_parallel_moe(
            args["x"],
            args["weights"],
            args["top_experts"],
            4,
            lambda x, weights, indices, bin_ids, bins: x,  # never reached
            [],
            None,
            chunks=args["chunks"],
        )

    for chunks in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="expert_parallel_moe: chunks must be an int >= 1"):
            call(chunks=chunks)
    with pytest.raises(ValueError, match="expert_parallel_moe: expected x"):
        call(top_experts=top[:, :1])
    with pytest.raises(ValueError, match="weights has 2 rows, x has 3"):
        call(weights=weights[:2], top_experts=top[:2])
    with pytest.raises(TypeError, match="integer top_experts"):
        call(top_experts=top.float())
    with pytest.raises(ValueError, match="expert_parallel_chunks must be an int >= 1"):
        DroplessMoE(MoEConfig(HIDDEN, FFN, 4, 2, expert_parallel_chunks=0))


@pytest.mark.parametrize("world", list(CASES))
def test_indivisible_experts_rejected(results, world):
    for res in results(world):
        assert "not divisible" in res["indivisible"]


def test_single_process_layer_unchanged():
    """Without a group: all experts, offset 0; the router drawn from the seed's generator and
    each expert's matrices from the documented per-expert seeds (which a rank with a group
    draws for its own experts only)."""
    layer = DroplessMoE(MoEConfig(HIDDEN, FFN, 4, 2, glu=True, seed=3))
    assert layer.num_local_experts == 4 and layer.expert_offset == 0
    router = torch.randn(layer.router.shape, generator=torch.Generator().manual_seed(3))
    assert torch.equal(layer.router.detach(), router * 0.02)
    gate, up = layer.w1[..., :FFN], layer.w1[..., FFN:]  # gated experts: side by side
    for matrix, p in enumerate((gate, up, layer.w2)):
        for e in range(4):
            g = torch.Generator().manual_seed(expert_seed(3, matrix, e))
            assert torch.equal(p[e].detach(), torch.randn(p.shape[1:], generator=g) * 0.02)


def _benchmark(*args: str) -> subprocess.CompletedProcess:
    """benchmarks/expert_parallel_nccl.py on 2 CPU processes (gloo, loopback)."""
    script = Path(__file__).parents[1] / "benchmarks" / "expert_parallel_nccl.py"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # not interpreted
    env |= {"GLOO_SOCKET_IFNAME": _loopback_interface(), "OMP_NUM_THREADS": "1"}
    env["MEGABLOCKS_BACKEND"] = "reference"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "2", str(script), "--device", "cpu", *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=JOIN_TIMEOUT_S)


@pytest.mark.slow
def test_benchmark_runs_with_gloo(tmp_path):
    """benchmarks/expert_parallel_nccl.py on the CPU: equality passes, bytes and times reported,
    each figure on its own line as soon as it is measured."""
    out = tmp_path / "ep.json"
    done = _benchmark("--steps", "1", "--chunks", "1", "3", "--profile", "--json", str(out))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["complete"] and report["warmup"] == 3 and report["steps"] == 1
    result = report["results"][0]
    assert result["equality"]["passed"]
    schemes = {"baseline", "chunks1", "chunks3", "allgather"}
    assert set(result["equality"]["max_rel_error"]) == schemes
    assert set(result["step_ms_slowest_rank"]) >= {"one_device_WT"} | {f"ep_{s}" for s in schemes}
    assert set(result["first_call_s_slowest_rank"]) == {"one_device"} | schemes
    for rank in result["per_rank"]:
        counts = rank["bytes"]
        # tiny: 64 tokens, top_k 2: at most 64 rows out of one, 128 of the other
        assert 0 < counts["rows_out_dedup"] <= min(64, counts["rows_out_baseline"])
        assert counts["rows_out_baseline"] <= 128
        # all-gather: all 64 tokens to the other rank: four exchanges of 64 float32 rows of 32,
        # plus each token's routing and weights' gradient (2 int32 ids, 2 + 2 float32 values)
        assert counts["allgather_bytes"] == 4 * 64 * 32 * 4 + 64 * (8 + 8 + 8)
        # --profile: every scheme's step, its time by part of the layer (CPU operators here)
        profile = rank["profile_ms_per_step"]
        assert set(profile) == schemes
        assert all(sum(parts.values()) > 0 for parts in profile.values())
        assert all(ms >= 0 for parts in profile.values() for ms in parts.values())
    # Rank 0 alone prints progress: a phase line, then the figure, before the shape's summary.
    lines = done.stdout.splitlines()
    summary = lines.index(next(line for line in lines if line.startswith("== tiny")))
    progress = [line.split("] ", 1)[1] for line in lines[:summary] if line.startswith("[ep ")]
    for key, ms in result["step_ms_slowest_rank"].items():
        timing = progress.index(next(p for p in progress if p.startswith(f"tiny: timing {key} ")))
        assert progress[timing + 1].startswith(f"tiny {key}: {ms:.2f} ms (slowest rank)")
    for scheme in schemes:
        assert sum(p.startswith(f"tiny equality {scheme}: ok ") for p in progress) == 1


@pytest.mark.slow
def test_benchmark_timeout_names_the_phase():
    """--timeout: a rank that reaches it says which phase it is in, and the run fails.

    Each rank reports and exits on its own; the first to exit makes torchrun stop the others, so
    on a loaded machine a rank whose watchdog runs late may be stopped before it reports: at least
    one rank must report, and every report must name a phase rank 0 announced."""
    done = _benchmark("--steps", "100000", "--chunks", "1", "--timeout", "3")
    assert done.returncode != 0
    assert "exitcode: 3" in done.stderr  # torchrun's report of the rank's status
    lines = done.stdout.splitlines()
    announced = [x.split("] ", 1)[1] for x in lines if x.startswith("[ep ") and x.endswith(" ...")]
    reports = [x for x in lines if x.startswith("[ep rank ") and "] TIMEOUT" in x]
    assert reports, (done.stdout[-3000:], done.stderr[-6000:])
    for line in reports:
        assert "--timeout 3 s reached in phase '" in line, line
        phase = line.split(" reached in phase '", 1)[1].split("' (in it for ", 1)[0]
        assert f"{phase} ..." in announced, (phase, announced)  # the phases rank 0 printed
    assert "in main" in done.stderr  # the Python stacks


def test_exchange_makes_its_input_dense_and_refuses_a_strided_output():
    """NCCL reads and writes raw pointers: a strided input is sent as a dense copy, and a
    strided output (never made here) is an internal error, raised before any collective."""
    import torch.distributed as dist

    from megablocks_core.layers import parallel

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        source = torch.arange(12.0).view(3, 4)
        strided = source.t()  # (4, 3), not contiguous
        out = torch.empty(4, 3)
        assert torch.equal(parallel._InFlight(out, strided, [4], [4], None).wait(), strided)
        with pytest.raises(RuntimeError, match=r"expert_parallel_moe: internal error.*contiguous"):
            parallel._InFlight(torch.empty(3, 4).t(), strided, [4], [4], None)
    finally:
        dist.destroy_process_group()


def test_baseline_needs_an_expert_parallel_layer():
    layer = DroplessMoE(MoEConfig(HIDDEN, 8, 4, top_k=2, seed=0, dtype=torch.float64))
    with pytest.raises(ValueError, match="no expert_parallel_group"):
        expert_parallel_baseline(layer, torch.zeros(3, HIDDEN, dtype=torch.float64))


def test_layer_refuses_an_unknown_dispatch_and_chunks_with_allgather():
    with pytest.raises(
        ValueError, match=r"expert_parallel_dispatch must be one of \('alltoall', 'allgather'\)"
    ):
        DroplessMoE(MoEConfig(HIDDEN, FFN, 4, 2, expert_parallel_dispatch="all2all"))
    with pytest.raises(ValueError, match="runs in one piece; expert_parallel_chunks must be"):
        DroplessMoE(
            MoEConfig(
                HIDDEN, FFN, 4, 2, expert_parallel_dispatch="allgather", expert_parallel_chunks=2
            )
        )
    x, weights = torch.zeros(3, HIDDEN), torch.zeros(3, 2)
    top = torch.zeros(3, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="dispatch must be one of"):
        expert_parallel_moe(x, weights, top, 4, None, [], None, dispatch="broadcast")
    with pytest.raises(ValueError, match="runs in one piece"):
        expert_parallel_moe(x, weights, top, 4, None, [], None, chunks=2, dispatch="allgather")
