"""The bad-data cases (:mod:`.bad_data` checks them): valid routing of a few tokens, then
mutations of it, per op family, as named :class:`BadCase` records (:data:`CASES`); and the valid
call of each op run after a bad one."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import formats
from ..contracts import BY_NAME
from . import moe_permute_cases

Args = tuple[Any, ...]


@dataclass(frozen=True)
class BadCase:
    """One bad call: ``build(device)`` gives the kernel-order arguments."""

    name: str
    """``op/what is wrong``, e.g. ``gather/index out of range``."""
    op: str
    build: Callable[[torch.device], Args]
    must_raise: bool = False
    """No safe result can be defined (e.g. a negative output size): a ContractError is required."""


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


SCALED_OPS = ("scaled_gmm", "scaled_gather_gmm", "scaled_gmm_scatter")
#: A scaled GEMM op -> the 16-bit op whose bad-data cases it shares.
_SCALED_OF = {
    "scaled_gmm": "gmm",
    "scaled_gather_gmm": "gather_gmm",
    "scaled_gmm_scatter": "gmm_scatter",
}


def _scaled_args(op: str, args: Args, format: str) -> Args:
    """The scaled op's arguments for the 16-bit op's ``args``: its row operand and expert matrices
    quantized in ``format`` (the core's definition), the rest as they are."""
    fmt = formats.FORMATS[format]

    def quantized(x: torch.Tensor, reduce_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        block = fmt.block(x.dim(), reduce_dim)
        return formats.quantize(x, block, formats.encoding_of(None, x.device), fmt.power_of_two)

    a, b, *rest = args
    if op == "scaled_gmm":  # gmm(a, b, batch_sizes, trans_b[, bias])
        batch, trans_b = rest[0], rest[1]
        bias = rest[2:3]
        return (
            *quantized(a, 1), *quantized(b, 2 if trans_b else 1), batch, trans_b, format, None,
            *bias,
        )  # fmt: skip
    if op == "scaled_gather_gmm":  # (x, b, indices, bin_ids, bins, top_k, trans_b, rows[, bias])
        indices, bin_ids, bins, top_k, trans_b, rows = rest[:6]
        return (
            *quantized(a, 1), *quantized(b, 2 if trans_b else 1),
            indices, bin_ids, bins, top_k, trans_b, rows, format, "float32", *rest[6:7],
        )  # fmt: skip
    # gmm_scatter(x, b, indices, bin_ids, weights, bins, top_k, trans_b, activation, rows[, bias])
    indices, bin_ids, weights, bins, top_k, trans_b, _, rows = rest[:8]
    return (
        *quantized(a, 1), *quantized(b, 2 if trans_b else 1),
        indices, bin_ids, weights, bins, top_k, trans_b, rows, format, "float32", *rest[8:9],
    )  # fmt: skip


def _scaled_cases() -> list[BadCase]:
    """The scaled GEMMs on the bad data of their 16-bit forms (their bias cases too), in each
    format in turn."""
    cases = []
    plain = [*_gmm_cases(), *_fused_cases()]
    for op, base in _SCALED_OF.items():
        for i, case in enumerate(c for c in plain if c.op == base):
            format = formats.FORMAT_NAMES[i % len(formats.FORMAT_NAMES)]

            def build(
                device: torch.device, case: BadCase = case, op: str = op, f: str = format
            ) -> Args:
                return _scaled_args(op, case.build(device), f)

            cases.append(BadCase(f"{op}/{case.name.split('/', 1)[1]}", op, build))
    return cases


def _moe_permute_cases() -> list[BadCase]:
    return [BadCase(name, op, build) for name, op, build in moe_permute_cases.cases()]


CASES: tuple[BadCase, ...] = (
    *_routing_cases(),
    *_permutation_cases(),
    *_gmm_cases(),
    *_fused_cases(),
    *_scaled_cases(),
    *_moe_permute_cases(),
)
_BY_NAME = {c.name: c for c in CASES}


def case_names(op: str | None = None) -> list[str]:
    return [c.name for c in CASES if op is None or c.op == op]


def _valid_args(op: str, device: torch.device) -> Args:
    """A valid call of ``op`` of the same kind, run after each bad one."""
    if op in moe_permute_cases.OPS:
        return moe_permute_cases.valid_args(op, device)
    if op in SCALED_OPS:
        return _scaled_args(op, _valid_args(_SCALED_OF[op], device), formats.FORMAT_NAMES[0])
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
