"""The documented safe results of bad data: :func:`check_result` raises
:class:`~megablocks_core.testing.kit.Mismatch` unless an output is one (:mod:`.bad_data` runs the
cases)."""

from __future__ import annotations

import itertools
from typing import Any

import torch

from ..contracts import BY_NAME
from ..entries import ENTRIES
from ..policy import use_backend
from . import moe_permute_cases
from .bad_cases import FUSED_OPS, GMM_OPS, PADDED_OPS, PLAIN_OPS, SCALED_OPS, Args
from .kit import REFERENCE, TOLERANCES, Mismatch, check_meta, compare

#: Candidate combinations enumerated per output row before the value check gives up on a row.
MAX_COMBINATIONS = 4096


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
    # A fused op (and a scaled GEMM, on bad data as its 16-bit form) is defined by its composition: the reference runs exactly that, and for these
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
    elif op in FUSED_OPS or op in SCALED_OPS:
        _check_fused(op, args, out)
    else:
        _check_routing(op, bound, out)
