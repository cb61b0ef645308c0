"""Bad data: inputs that pass the always-on checks but break an op's data rules.

Outside checked mode (``MEGABLOCKS_CHECK`` unset) the core never reads tensor data before a
kernel runs, so indices out of range, duplicate indices, bins that are not a cumulative sum or
group sizes that do not add up reach the kernels. Every backend must then stay memory-safe and
return the op's documented safe result (the ``edge_cases`` of each contract): this module holds
named cases per op and checks, for each:

* no crash, and no exception other than the core's ``ContractError``/``ContractTypeError``
  naming the op (a case marked ``must_raise`` has no safe result and must raise one);
* outputs of the contract's shape, dtype and device;
* values only from the documented safe result: exactly the defined values where the contract
  defines them, else every element 0 or taken from the candidates the contract allows;
* a valid call of the same op afterwards still matches the reference (catches heap corruption
  that only surfaces later).

``run(backend, device)`` runs every case a backend serves and returns the failures. Crashes
kill the process: run the cases of a backend that might crash in a subprocess each
(``python -c`` with :func:`run_case`), as ``tests/test_bad_data.py`` does.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..contracts import BY_NAME
from ..dispatch import registry
from ..entries import ENTRIES
from ..policy import use_backend
from ..ranking import NoKernelError
from ..validation import ContractError, ContractTypeError
from . import moe_permute_cases
from .kit import REFERENCE, TOLERANCES, Mismatch, call_on_copies, check_meta, compare

__all__ = [
    "CASES",
    "BadCase",
    "Declined",
    "Failure",
    "case_names",
    "check_call",
    "check_result",
    "run",
    "run_case",
]

Args = tuple[Any, ...]

#: Candidate combinations enumerated per output row before the value check gives up on a row.
MAX_COMBINATIONS = 4096


@dataclass(frozen=True)
class BadCase:
    """One bad call: ``build(device)`` gives the kernel-order arguments."""

    name: str
    """``op/what is wrong``, e.g. ``gather/index out of range``."""
    op: str
    build: Callable[[torch.device], Args]
    must_raise: bool = False
    """No safe result can be defined (e.g. a negative output size): a ContractError is required."""


class Declined(Exception):
    """The backend does not serve this call (device, dtype or shape): nothing to check."""


@dataclass(frozen=True)
class Failure:
    case: str
    backend: str
    message: str

    def __str__(self) -> str:
        return f"{self.backend}: {self.case}: {self.message}"


# ---------------------------------------------------------------------------
# Valid routing of a few tokens, then mutations of it


@dataclass
class _Routing:
    x: torch.Tensor
    top_experts: torch.Tensor
    indices: torch.Tensor
    bin_ids: torch.Tensor
    bins: torch.Tensor
    padded_bins: torch.Tensor
    weights: torch.Tensor
    top_k: int
    num_experts: int
    extra: dict[str, Any] = field(default_factory=dict)


def _routing(
    device: torch.device,
    tokens: int = 5,
    top_k: int = 2,
    experts: int = 3,
    hidden: int = 8,
    seed: int = 0,
    dtype: torch.dtype = torch.int32,
    block: int = 4,
) -> _Routing:
    gen = torch.Generator().manual_seed(seed)
    n = tokens * top_k
    top_experts = torch.randint(0, experts, (n,), generator=gen)
    order = torch.sort(top_experts, stable=True).indices
    counts = torch.bincount(top_experts, minlength=experts)
    bins = torch.cumsum(counts, 0)
    padded = torch.cumsum((counts + block - 1) // block * block, 0)
    x = torch.randn(tokens, hidden, generator=gen)
    weights = torch.rand(n, generator=gen) + 0.5

    def dev(t: torch.Tensor, dt: torch.dtype = dtype) -> torch.Tensor:
        return t.to(device=device, dtype=dt)

    return _Routing(
        dev(x, torch.float32),
        dev(top_experts),
        dev(order),
        dev(top_experts[order]),
        dev(bins),
        dev(padded),
        dev(weights, torch.float32),
        top_k,
        experts,
    )


def _set(t: torch.Tensor, i: int, value: int) -> torch.Tensor:
    t = t.clone()
    t[i] = value
    return t


def _values(t: torch.Tensor, values: Sequence[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=t.dtype, device=t.device)


#: Mutations of (indices, bins, padded_bins): name -> function of the routing returning new ones.
_Mut = Callable[[_Routing], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def _idx(fn: Callable[[_Routing], torch.Tensor]) -> _Mut:
    return lambda r: (fn(r), r.bins, r.padded_bins)


def _bins(fn: Callable[[_Routing], Sequence[int]]) -> _Mut:
    return lambda r: (r.indices, _values(r.bins, fn(r)), r.padded_bins)


def _padded(fn: Callable[[_Routing], Sequence[int]]) -> _Mut:
    return lambda r: (r.indices, r.bins, _values(r.padded_bins, fn(r)))


def _n(r: _Routing) -> int:
    return r.indices.shape[0]


INDEX_MUTATIONS: dict[str, _Mut] = {
    "index out of range": _idx(lambda r: _set(r.indices, 3, _n(r) + 7)),
    "negative index": _idx(lambda r: _set(r.indices, 0, -3)),
    "index far out of range": _idx(lambda r: _set(r.indices, 1, 2**31 - 1)),
    "duplicate index": _idx(lambda r: _set(r.indices, 2, int(r.indices[_n(r) - 1]))),
    "all indices equal": _idx(lambda r: torch.zeros_like(r.indices)),
}
BINS_MUTATIONS: dict[str, _Mut] = {
    "bins too short": _bins(lambda r: [1, 2, 3]),
    "bins past the rows": _bins(lambda r: [4, 9, _n(r) + 50]),
    "bins decreasing": _bins(lambda r: [_n(r), 2, _n(r)]),
    "negative bins": _bins(lambda r: [-6, -1, _n(r)]),
}
PADDED_MUTATIONS: dict[str, _Mut] = {
    "padded_bins too small": _padded(lambda r: [1, 2, 3]),
    "padded_bins decreasing": _padded(lambda r: [12, 4, 8]),
    "negative padded_bins": _padded(lambda r: [-8, -4, 12]),
}


def _first_rows(r: _Routing) -> int:
    """The sorted-row count of the "first rows" cases (of the ops that take one): 3 short of all."""
    return _n(r) - 3


def _permutation_args(
    op: str, r: _Routing, mut: _Mut, weighted: bool, row_count: int | None = None
) -> Args:
    indices, bins, padded = mut(r)
    w = r.weights if weighted else None
    n, hidden, k = indices.shape[0], r.x.shape[1], r.top_k
    gen = torch.Generator().manual_seed(1)

    def rows(count: int) -> torch.Tensor:
        return torch.randn(count, hidden, generator=gen).to(r.x.device)

    grad = rows(n // k)
    padded_rows = rows(max(int(padded[-1]), 0) if padded.numel() else 0)
    bin_size = 3
    binned = torch.randn(bins.shape[0], bin_size, hidden, generator=gen).to(r.x.device)
    return {
        "gather": lambda: (r.x, indices, r.bin_ids, w, bins, k, row_count),
        "scatter": lambda: (rows(n), indices, r.bin_ids, w, bins, k),
        "scatter_wgrad": lambda: (rows(n), grad, indices, r.bin_ids, bins, k),
        "padded_gather": lambda: (r.x, indices, r.bin_ids, w, bins, padded, k),
        "padded_scatter": lambda: (padded_rows, indices, r.bin_ids, w, bins, padded, k),
        "padded_scatter_wgrad": lambda: (padded_rows, grad, indices, r.bin_ids, bins, padded, k),
        "binned_gather": lambda: (r.x, indices, w, bins, bin_size, k),
        "binned_scatter": lambda: (binned, indices, w, bins, k),
        "binned_scatter_wgrad": lambda: (binned, grad, indices, bins, k),
    }[op]()


PLAIN_OPS = ("gather", "scatter", "scatter_wgrad")
PADDED_OPS = ("padded_gather", "padded_scatter", "padded_scatter_wgrad")
BINNED_OPS = ("binned_gather", "binned_scatter", "binned_scatter_wgrad")
_WEIGHTED = {
    "gather",
    "scatter",
    "padded_gather",
    "padded_scatter",
    "binned_gather",
    "binned_scatter",
}


def _permutation_cases() -> list[BadCase]:
    cases = []
    for op in (*PLAIN_OPS, *PADDED_OPS, *BINNED_OPS):
        muts = dict(INDEX_MUTATIONS)
        if op not in PLAIN_OPS:
            muts |= BINS_MUTATIONS
        if op in PADDED_OPS:
            muts |= PADDED_MUTATIONS
        # Scatters with layouts nothing pins down are checked row by row: one copy per token.
        top_k = 1 if op not in PLAIN_OPS and op.endswith(("scatter", "wgrad")) else 2
        for what, mut in muts.items():
            for weighted in (False, True) if op in _WEIGHTED else (False,):
                name = f"{op}/{what}" + (" (weighted)" if weighted else "")

                def build(
                    device: torch.device,
                    op: str = op,
                    mut: _Mut = mut,
                    weighted: bool = weighted,
                    top_k: int = top_k,
                ) -> Args:
                    return _permutation_args(op, _routing(device, top_k=top_k), mut, weighted)

                cases.append(BadCase(name, op, build))
        if op in PADDED_OPS:

            def shorter(device: torch.device, op: str = op, top_k: int = top_k) -> Args:
                args = _permutation_args(
                    op,
                    _routing(device, top_k=top_k),
                    lambda r: (r.indices, r.bins, r.padded_bins),
                    False,
                )
                return (args[0][:2], *args[1:]) if op != "padded_gather" else args

            if op != "padded_gather":
                cases.append(BadCase(f"{op}/x shorter than padded_bins[-1]", op, shorter))
    for what, mut in INDEX_MUTATIONS.items():  # the first sorted rows only (a row count)
        for weighted in (False, True):

            def first(device: torch.device, mut: _Mut = mut, weighted: bool = weighted) -> Args:
                r = _routing(device)
                return _permutation_args("gather", r, mut, weighted, _first_rows(r))

            name = f"gather/{what}, first rows" + (" (weighted)" if weighted else "")
            cases.append(BadCase(name, "gather", first))
    cases.append(
        BadCase(
            "padded_gather/padded_bins ending negative",
            "padded_gather",
            must_raise=True,
            build=lambda d: _permutation_args(
                "padded_gather", _routing(d), _padded(lambda r: [4, 8, -2]), False
            ),
        )
    )
    cases.append(
        BadCase(
            "gather/int64 index wrapping to a valid int32",
            "gather",
            build=lambda d: _permutation_args(
                "gather",
                _routing(d, dtype=torch.int64),
                _idx(lambda r: _set(r.indices, 4, 2**32 + 1)),
                True,
            ),
        )
    )
    return cases


def _routing_cases() -> list[BadCase]:
    def top(
        device: torch.device, values: Sequence[int], dtype: torch.dtype = torch.int32
    ) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    def grad_of(device: torch.device) -> torch.Tensor:
        return torch.randn(2, 12, generator=torch.Generator().manual_seed(3)).to(device)

    bins_cases = {"decreasing": [9, 3, 12], "past the columns": [4, 8, 40], "negative": [-5, 2, 12]}
    cases = [
        BadCase(
            "route/expert id too large", "route", lambda d: (top(d, [0, 2, 7, 1, 1, 3, 0, 2]), 3, 4)
        ),
        BadCase(
            "route/negative expert id", "route", lambda d: (top(d, [0, -1, 2, 1, -5, 0]), 3, 4)
        ),
        BadCase(
            "route/huge int64 expert id",
            "route",
            lambda d: (top(d, [1, 2**33 + 1, 0, 2, -(2**40)], torch.int64), 3, 2),
        ),
        BadCase("route/all ids out of range", "route", lambda d: (top(d, [5, 6, -1, 9]), 3, 4)),
        BadCase("sort/keys past end_bit", "sort", lambda d: (top(d, [3, 17, 1, 40, 2, 0]), 2)),
        BadCase("sort/negative keys", "sort", lambda d: (top(d, [3, -4, 1, -1, 2, 0]), 2)),
        BadCase(
            "histogram/keys out of range", "histogram", lambda d: (top(d, [0, 5, -1, 2, 2**20]), 3)
        ),
        BadCase(
            "topology/padded_bins not whole blocks",
            "topology",
            lambda d: (top(d, [3, 9, 16]), 4, 4, 2),
        ),
        BadCase(
            "topology/padded_bins decreasing", "topology", lambda d: (top(d, [12, 4, 16]), 4, 4, 2)
        ),
        BadCase(
            "topology/rows past padded_bins", "topology", lambda d: (top(d, [4, 8, 8]), 4, 5, 3)
        ),
    ]

    def replicate_args(device: torch.device, bins: Sequence[int]) -> Args:
        return grad_of(device)[:, :3].contiguous(), top(device, bins), 12

    def replicate_backward_args(device: torch.device, bins: Sequence[int]) -> Args:
        return grad_of(device), top(device, bins)

    for what, values in bins_cases.items():
        cases.append(
            BadCase(
                f"replicate/bins {what}",
                "replicate",
                functools.partial(replicate_args, bins=values),
            )
        )
        cases.append(
            BadCase(
                f"replicate_backward/bins {what}",
                "replicate_backward",
                functools.partial(replicate_backward_args, bins=values),
            )
        )
    return cases


GMM_OPS = ("gmm", "gmm_weight_grad", "gmm_weight_grad_accumulate")


def _gmm_cases() -> list[BadCase]:
    def gmm_args(device: torch.device, sizes: Sequence[int], op: str, bias: bool = False) -> Args:
        gen = torch.Generator().manual_seed(4)
        a = torch.randn(12, 8, generator=gen).to(device)
        batch = torch.tensor(sizes, dtype=torch.int64, device=device)
        if op == "gmm":
            b = torch.randn(3, 8, 5, generator=gen).to(device)
            if bias:  # rows of no group get no bias either
                return a, b, batch, False, torch.randn(3, 5, generator=gen).to(device)
            return a, b, batch, False
        grad = torch.randn(12, 5, generator=gen).to(device)
        if op == "gmm_weight_grad_accumulate":  # the gradient added to: random, not zero
            return a, grad, batch, torch.randn(len(sizes), 8, 5, generator=gen).to(device)
        return a, grad, batch

    # Sizes summing short of the rows are valid (the rows past the last group belong to none):
    # the conformance kit's scenarios with unrouted pairs check them.
    sizes = {
        "sizes summing past the rows": [6, 6, 9],
        "negative size": [-4, 10, 6],
        "huge size": [2**40, 1, 1],
    }
    return [
        BadCase(f"{op}/{what}", op, functools.partial(gmm_args, sizes=s, op=op))
        for op in GMM_OPS
        for what, s in sizes.items()
    ] + [
        BadCase(
            f"gmm/{what}, bias", "gmm", functools.partial(gmm_args, sizes=s, op="gmm", bias=True)
        )
        for what, s in sizes.items()
    ]


FUSED_OPS = ("gather_gmm", "gmm_scatter")


def _fused_args(
    op: str, r: _Routing, mut: _Mut, rows: int | None = None, bias: bool = False
) -> Args:
    indices, bins, _ = mut(r)
    gen = torch.Generator().manual_seed(7)
    n, hidden, ffn, k = indices.shape[0], r.x.shape[1], 6, r.top_k

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(r.x.device)

    if op == "gather_gmm":
        w = rand(bins.shape[0], hidden, ffn)
        gathering = (r.x, w, indices, r.bin_ids, bins, k, False, rows)
        return (*gathering, rand(bins.shape[0], ffn)) if bias else gathering
    b = rand(bins.shape[0], ffn, hidden)
    x = rand(n if rows is None else rows, ffn)
    scattering = (x, b, indices, r.bin_ids, r.weights, bins, k, False, None, rows)
    return (*scattering, rand(bins.shape[0], hidden)) if bias else scattering


def _fused_cases() -> list[BadCase]:
    def build(device: torch.device, op: str, mut: _Mut, first: bool, bias: bool = False) -> Args:
        r = _routing(device)
        return _fused_args(op, r, mut, _first_rows(r) if first else None, bias)

    # With a row count (first rows), "bins past the rows" also ends past it: groups cut there.
    return [
        BadCase(
            f"{op}/{what}" + (", first rows" if first else ""),
            op,
            functools.partial(build, op=op, mut=mut, first=first),
        )
        for op in FUSED_OPS
        for first in (False, True)
        for what, mut in {**INDEX_MUTATIONS, **BINS_MUTATIONS}.items()
        # Which row a duplicated id reads is unspecified for a scatter: no one safe value.
        if not (op == "gmm_scatter" and ("duplicate" in what or "equal" in what))
        # bins ending before the last row are valid for the fused ops (rows routed to no
        # expert; the kit's scenarios with unrouted pairs check them).
        and what != "bins too short"
    ] + [
        # A per-expert bias: added to the groups as the kernel reads them, and to no other row.
        BadCase(
            f"{op}/{what}, bias",
            op,
            functools.partial(build, op=op, mut=mut, first=False, bias=True),
        )
        for op in FUSED_OPS
        for what, mut in BINS_MUTATIONS.items()
        if what != "bins too short"
    ]


def _moe_permute_cases() -> list[BadCase]:
    return [BadCase(name, op, build) for name, op, build in moe_permute_cases.cases()]


CASES: tuple[BadCase, ...] = (
    *_routing_cases(),
    *_permutation_cases(),
    *_gmm_cases(),
    *_fused_cases(),
    *_moe_permute_cases(),
)
_BY_NAME = {c.name: c for c in CASES}


def case_names(op: str | None = None) -> list[str]:
    return [c.name for c in CASES if op is None or c.op == op]


# ---------------------------------------------------------------------------
# The documented safe results


def _cumulative(t: torch.Tensor) -> bool:
    return t.numel() == 0 or (bool(t[0] >= 0) and bool((t[1:] >= t[:-1]).all()))


def _placements(op: str, args: dict[str, Any], n: int) -> tuple[list[int | None], bool]:
    """Layout row of each sorted row (None: dropped), and whether the layout is pinned down
    (cumulative bins, and padded_bins with room for every expert) so rows cannot collide."""
    if op in PLAIN_OPS:
        return list(range(n)), True
    bins = [int(v) for v in args["bins"].tolist()]
    starts = [0, *bins[:-1]]
    sane = _cumulative(args["bins"])
    places: list[int | None] = []
    bin_size = args["bin_size"] if "bin_size" in args else args["x"].shape[1]
    if op in PADDED_OPS:
        padded = [int(v) for v in args["padded_bins"].tolist()]
        pstarts = [0, *padded[:-1]]
        rows = args["x"].shape[0] if op != "padded_gather" else max(padded[-1] if padded else 0, 0)
        sane = (
            sane
            and _cumulative(args["padded_bins"])
            and all(padded[e] - pstarts[e] >= min(bins[e], n) - starts[e] for e in range(len(bins)))
        )
    for p in range(n):
        e = sum(1 for b in bins if b <= p) if sane else len(bins)
        if e >= len(bins):
            places.append(None)
            continue
        j = p - starts[e]
        if op in PADDED_OPS:
            dest = pstarts[e] + j
            places.append(dest if 0 <= dest < rows else None)
        else:
            places.append(e * bin_size + j if j < bin_size else None)
    return places, sane


def _row_value(args: dict[str, Any], f: int, n: int, top_k: int) -> torch.Tensor:
    """What a gather writes for flat id f: x[f // top_k] (weighted), or 0 for an id out of range."""
    x = args["x"].double().cpu()
    if not 0 <= f < n:
        return torch.zeros(x.shape[-1], dtype=torch.float64)
    w = args.get("weights")
    return x[f // top_k] * (float(w[f]) if w is not None else 1.0)


def _members(got: torch.Tensor, candidates: torch.Tensor, tol: float) -> bool:
    """Every element of got (rows, H) equals the same column's element of some candidate row."""
    if got.numel() == 0:
        return True
    diff = (got[:, None, :] - candidates[None, :, :]).abs()
    scale = tol * (1 + candidates.abs().max().item())
    return bool((diff.min(dim=1).values <= scale).all())


def _check_gather(op: str, args: dict[str, Any], out: torch.Tensor, tol: float) -> None:
    indices = [int(v) for v in args["indices"].tolist()]
    n, k = len(indices), args["top_k"]
    got = out.double().cpu().reshape(-1, out.shape[-1])
    places, sane = _placements(op, args, n)
    if sane:
        want = torch.zeros_like(got)
        for p, dest in enumerate(places):
            if dest is not None and dest < want.shape[0]:  # a row count keeps the first rows
                want[dest] = _row_value(args, indices[p], n, k)
        compare(
            out.cpu().reshape(got.shape), want.to(out.dtype), "output", "the documented safe result"
        )
        return
    rows = [_row_value(args, f, n, k) for f in range(n)]
    candidates = torch.stack([torch.zeros(got.shape[1], dtype=torch.float64), *rows])
    if not _members(got, candidates, tol):
        raise Mismatch("an output element is neither 0 nor taken from a (weighted) row of x")


def _layout_rows(op: str, args: dict[str, Any]) -> torch.Tensor:
    x = args["x"].double().cpu()
    return x.reshape(-1, x.shape[-1])


def _copy_candidates(op: str, args: dict[str, Any]) -> list[list[torch.Tensor]]:
    """For each flat id f, the rows its copy may read (before weighting)."""
    indices = [int(v) for v in args["indices"].tolist()]
    n = len(indices)
    layout = _layout_rows(op, args)
    zero = torch.zeros(layout.shape[1], dtype=torch.float64)
    places, sane = _placements(op, args, n)
    if not sane:
        return [[zero, *layout] for _ in range(n)]
    hint_off = _bin_ids_disagree(op, args, n)
    naming: list[list[torch.Tensor]] = [[] for _ in range(n)]
    for p, f in enumerate(indices):
        if 0 <= f < n:
            dest = places[p]
            naming[f].append(layout[dest] if dest is not None and dest < layout.shape[0] else zero)
            if p in hint_off:  # a backend that reads bin_ids may drop this copy instead
                naming[f].append(zero)
    return [rows or [zero] for rows in naming]


def _bin_ids_disagree(op: str, args: dict[str, Any], n: int) -> set[int]:
    """Sorted rows p of a padded op whose bin_ids[p] = e is contradicted by bins
    (not bins[e-1] <= p < bins[e])."""
    if op not in PADDED_OPS or args.get("bin_ids") is None:
        return set()
    bins = [int(v) for v in args["bins"].tolist()]
    starts = [0, *bins[:-1]]
    ids = [int(v) for v in args["bin_ids"].tolist()]
    return {
        p
        for p in range(min(n, len(ids)))
        if not (0 <= ids[p] < len(bins) and starts[ids[p]] <= p < bins[ids[p]])
    }


def _check_scatter(op: str, args: dict[str, Any], out: torch.Tensor, tol: float) -> None:
    k = args["top_k"]
    w = args.get("weights")
    cands = _copy_candidates(op, args)
    got = out.double().cpu()
    for t in range(got.shape[0]):
        options = [
            [c * (float(w[t * k + j]) if w is not None else 1.0) for c in cands[t * k + j]]
            for j in range(k)
        ]
        if torch.tensor([len(o) for o in options]).prod() > MAX_COMBINATIONS:
            continue
        sums = torch.stack([torch.stack(combo).sum(0) for combo in itertools.product(*options)])
        if not _members(got[t : t + 1], sums, tol) or not any(
            torch.allclose(got[t], s, rtol=tol, atol=tol * (1 + s.abs().max().item())) for s in sums
        ):
            raise Mismatch(
                f"row {t} is not the sum of its copies' rows (one row naming each flat id, "
                "0 for an id no row names)"
            )


def _check_wgrad(op: str, args: dict[str, Any], out: torch.Tensor, tol: float) -> None:
    k = args["top_k"]
    grad = args["grad"].double().cpu()
    got = out.double().cpu()
    for f, rows in enumerate(_copy_candidates(op, args)):
        dots = torch.stack([r @ grad[f // k] for r in rows])
        scale = tol * (1 + dots.abs().max().item())
        if not bool(((dots - got[f]).abs() <= scale).any()):
            raise Mismatch(
                f"weights_grad[{f}] = {got[f].item()} is not the dot of grad with a row "
                "naming that flat id (or 0)"
            )


def _check_route(args: dict[str, Any], out: tuple[torch.Tensor, ...]) -> None:
    top, experts, block = args["top_experts"].cpu(), args["num_experts"], args["block_size"]
    keys = [int(v) if 0 <= v < experts else experts for v in top.tolist()]
    order = sorted(range(len(keys)), key=lambda i: (keys[i], i))
    counts = torch.tensor([keys.count(e) for e in range(experts)], dtype=torch.int32)
    padded = torch.cumsum((counts + block - 1) // block * block, 0).int()
    wants = (
        torch.tensor(order, dtype=top.dtype),
        top[order],
        counts,
        torch.cumsum(counts, 0).int(),
        padded,
    )
    for name, got, want in zip(
        ("indices", "bin_ids", "tokens_per_expert", "bins", "padded_bins"), out, wants, strict=True
    ):
        compare(
            got.cpu(),
            want,
            f"output '{name}'",
            "the documented safe result (ids out of range last)",
        )


def _check_routing(op: str, args: dict[str, Any], out: Any) -> None:
    if op == "route":
        _check_route(args, out)
    elif op == "sort":
        values, indices = (t.cpu() for t in out)
        x = args["x"].cpu()
        if sorted(indices.tolist()) != list(range(x.shape[0])):
            raise Mismatch("sort's indices are not a permutation")
        compare(values, x[indices.long()], "values", "x[indices]")
    elif op == "histogram":
        keys = args["x"].cpu().tolist()
        want = torch.tensor([keys.count(b) for b in range(args["num_bins"])], dtype=torch.int32)
        compare(out.cpu(), want, "counts", "the count of keys in range")
    elif op == "topology":
        cols = args["output_block_columns"]
        experts = args["padded_bins"].shape[0]
        got = out.cpu().long().view(-1, cols)
        if bool(((got < 0) | (got >= (experts + 1) * cols)).any()) or bool(
            (got % cols != torch.arange(cols)).any()
        ):
            raise Mismatch("a column index is not e * columns + j for an expert e in [0, experts]")
    elif op == "replicate":
        x = args["x"].double().cpu()
        got = out.double().cpu()
        for b in range(got.shape[0]):
            allowed = torch.cat([x[b], torch.zeros(1, dtype=torch.float64)])
            if not bool((got[b][:, None] == allowed[None, :]).any(1).all()):
                raise Mismatch(f"row {b} holds a value that is neither 0 nor one of x[{b}]")
    elif op == "replicate_backward" and not bool(torch.isfinite(out).all()):
        raise Mismatch("a bin sum is not finite")


def _check_gmm(op: str, args: dict[str, Any], out: torch.Tensor) -> None:
    """``out``: gmm's or gmm_weight_grad's output, or the gradient gmm_weight_grad_accumulate
    wrote in place (``args["out"]`` holds its value before the call)."""
    a = args["a"].double().cpu()
    rows, start, groups = a.shape[0], 0, []
    for size in args["batch_sizes"].cpu().tolist():
        size = min(max(size, 0), rows - start)
        groups.append((start, size))
        start += size
    if op == "gmm":
        b = args["b"].double().cpu()
        bias = args.get("bias")
        want = torch.zeros(rows, b.shape[1] if args["trans_b"] else b.shape[2], dtype=torch.float64)
        for e, (s, size) in enumerate(groups):
            want[s : s + size] = a[s : s + size] @ (b[e].t() if args["trans_b"] else b[e])
            if bias is not None:
                want[s : s + size] += bias[e].double().cpu()
    else:
        g = args["grad"].double().cpu()
        want = torch.stack([a[s : s + size].t() @ g[s : s + size] for s, size in groups])
        if op == "gmm_weight_grad_accumulate":
            want += args["out"].double().cpu()  # an expert without rows: exactly out[e]
    compare(
        out.cpu(),
        want.to(out.dtype),
        "output",
        "the documented safe result (negative sizes 0, groups cut at the last row)",
    )


def _check_fused(op: str, args: Args, out: torch.Tensor) -> None:
    # A fused op is defined by its composition: the reference runs exactly that, and for these
    # cases (no duplicated id a scatter would have to choose between) its result is unique.
    with use_backend(REFERENCE):
        want = ENTRIES[op](*args)
    compare(out.cpu(), want.cpu(), "output", "the composition on the reference")


def check_result(op: str, args: Args, out: Any, written: tuple[torch.Tensor, ...] = ()) -> None:
    """Raise :class:`Mismatch` unless ``out`` is the documented safe result of ``op`` on ``args``
    (shape, dtype and device from the contract, then values). For an op that writes arguments in
    place, ``out`` is what it returned (None) and ``written`` those arguments after the call
    (``args`` holds them as they were before: see :func:`kit.call_on_copies`)."""
    contract = BY_NAME[op]
    check_meta(contract, args, out)
    bound = contract.bind(args)
    if contract.mutated:
        if len(written) != len(contract.mutated):
            raise TypeError(f"check_result({op!r}): pass what the call wrote in place")
        (after,) = written  # gmm_weight_grad_accumulate's out, the only such op
        if after.shape != bound["out"].shape or after.dtype != bound["out"].dtype:
            raise Mismatch(f"'out' became {tuple(after.shape)} {after.dtype}")
        _check_gmm(op, bound, after)
        return
    outs = out if isinstance(out, tuple) else (out,)
    tol = TOLERANCES.get(outs[0].dtype, 0.0)
    if op in moe_permute_cases.OPS:
        try:
            moe_permute_cases.check(op, bound, out)
        except AssertionError as exc:
            raise Mismatch(str(exc).splitlines()[0]) from None
    elif op in ("gather", "padded_gather", "binned_gather"):
        _check_gather(op, bound, out, tol)
    elif op in ("scatter", "padded_scatter", "binned_scatter"):
        _check_scatter(op, bound, out, tol)
    elif op.endswith("wgrad"):
        _check_wgrad(op, bound, out, tol)
    elif op in GMM_OPS:
        _check_gmm(op, bound, out)
    elif op in FUSED_OPS:
        _check_fused(op, args, out)
    else:
        _check_routing(op, bound, out)


# ---------------------------------------------------------------------------
# Running the cases


def _valid_args(op: str, device: torch.device) -> Args:
    """A valid call of ``op`` of the same kind, run after each bad one."""
    if op in moe_permute_cases.OPS:
        return moe_permute_cases.valid_args(op, device)
    if op in FUSED_OPS:
        return _fused_args(
            op, _routing(device, seed=5), lambda r: (r.indices, r.bins, r.padded_bins)
        )
    if op in BY_NAME and any(op in group for group in (PLAIN_OPS, PADDED_OPS, BINNED_OPS)):
        return _permutation_args(
            op,
            _routing(device, seed=5),
            lambda r: (r.indices, r.bins, r.padded_bins),
            op in _WEIGHTED,
        )
    gen = torch.Generator().manual_seed(6)
    top = torch.randint(0, 3, (10,), generator=gen).to(device=device, dtype=torch.int32)
    counts = torch.bincount(top.long().cpu(), minlength=3)
    bins = torch.cumsum(counts, 0).to(device=device, dtype=torch.int32)
    a = torch.randn(10, 8, generator=gen).to(device)
    return {
        "route": (top, 3, 4),
        "sort": (top, 2),
        "histogram": (top, 3),
        "topology": (torch.tensor([4, 8, 16], dtype=torch.int32, device=device), 4, 4, 2),
        "replicate": (a[:2, :3].contiguous(), bins, 10),
        "replicate_backward": (a[:2].contiguous(), bins),
        "gmm": (a, torch.randn(3, 8, 5, generator=gen).to(device), counts.to(device), False),
        "gmm_weight_grad": (a, torch.randn(10, 5, generator=gen).to(device), counts.to(device)),
        "gmm_weight_grad_accumulate": (
            a,
            torch.randn(10, 5, generator=gen).to(device),
            counts.to(device),
            torch.randn(3, 8, 5, generator=gen).to(device),
        ),
    }[op]


def _force(backend: str, op: str) -> Any:
    return (
        use_backend(REFERENCE)
        if backend == REFERENCE
        else use_backend(backend, REFERENCE, **{op: backend})
    )


def check_call(backend: str, op: str, args: Args, must_raise: bool = False) -> str | None:
    """Call ``op`` on ``backend`` with (possibly bad) kernel-order ``args``; None when the
    outcome is allowed (the documented safe result, or the core's error naming the op), else
    what is wrong. Also for generated inputs (e.g. hypothesis)."""
    try:
        with _force(backend, op):
            out, written = call_on_copies(ENTRIES[op], BY_NAME[op], args)
    except NoKernelError as exc:
        raise Declined(str(exc)) from None
    except (ContractError, ContractTypeError) as exc:
        return (
            None if f"ops.{op}" in str(exc) else f"{type(exc).__name__} does not name the op: {exc}"
        )
    except Exception as exc:
        return (
            f"raised {type(exc).__name__} (only the core's ContractError/ContractTypeError may be "
            f"raised): {str(exc)[:300]}"
        )
    if must_raise:
        return "returned; no safe result exists, a ContractError is required"
    try:
        check_result(op, args, out, written)
    except Mismatch as exc:
        return str(exc)
    return None


def run_case(backend: str, name: str, device: torch.device | str = "cpu") -> Failure | None:
    """Run one case on ``backend``; None when it holds. A crash kills the calling process.
    Raises :class:`Declined` when the backend does not serve the call."""
    case = _BY_NAME[name]
    device = torch.device(device)
    contract = BY_NAME[case.op]
    call = ENTRIES[case.op]
    valid = _valid_args(case.op, device)
    with use_backend(REFERENCE):
        want, want_written = call_on_copies(call, contract, valid)
    problem = check_call(backend, case.op, case.build(device), case.must_raise)
    if problem is not None:
        return Failure(name, backend, problem)
    try:
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # a device fault surfaces here, named by this case
        with _force(backend, case.op):
            again, again_written = call_on_copies(call, contract, valid)
        outs = (again if isinstance(again, tuple) else (again,)) if contract.outputs else ()
        wants = (want if isinstance(want, tuple) else (want,)) if contract.outputs else ()
        for got, w in zip((*outs, *again_written), (*wants, *want_written), strict=True):
            compare(got, w, "the valid call after it")
    except Exception as exc:
        return Failure(
            name, backend, f"a valid call after it failed: {type(exc).__name__}: {str(exc)[:300]}"
        )
    return None


def _serves(backend: str, op: str) -> bool:
    record = registry().plugins.get(backend)
    return record is not None and record.status == "ok" and op in record.ops


def run(
    backend: str,
    device: torch.device | str = "cpu",
    ops: Sequence[str] | None = None,
    names: Sequence[str] | None = None,
) -> tuple[list[Failure], int]:
    """Run the bad-data cases of every op ``backend`` provides (or of ``ops`` / the cases
    ``names``) on ``device``. Returns (failures, cases run)."""
    if backend not in registry().plugins:
        raise ValueError(f"backend {backend!r} is not installed")
    failures, ran = [], 0
    for case in CASES:
        if (names is not None and case.name not in names) or (
            ops is not None and case.op not in ops
        ):
            continue
        if not _serves(backend, case.op):
            continue
        try:
            failure = run_case(backend, case.name, device)
        except Declined:
            continue
        ran += 1
        if failure is not None:
            failures.append(failure)
    return failures, ran
