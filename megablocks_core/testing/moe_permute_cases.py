"""Bad data for the moe_permute ops (Megatron-Core / Transformer Engine permutation): the calls
and their documented safe results, written as per-slot loops independent of every backend.

:mod:`.bad_cases` adds these cases to its own and :mod:`.bad_results` routes their results here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

Args = tuple[Any, ...]

OPS = (
    "moe_permute_map",
    "moe_permute",
    "moe_permute_probs",
    "moe_unpermute",
    "moe_unpermute_wgrad",
    "moe_sort_chunks",
)

#: A row map of 4 tokens x 3 slots into 6 rows with entries out of range (negative, past the
#: rows, huge) and one row named twice (rows 1).
BAD_ROW_MAP = [[0, 99, -7], [1, 2**30, 3], [-1, 1, 5], [4, -(2**31), 6]]


def _x(device: torch.device, rows: int, hidden: int = 5, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, hidden, generator=torch.Generator().manual_seed(seed)).to(device)


def _int32(device: torch.device, values: Any) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


def _probs(device: torch.device, shape: tuple[int, int]) -> torch.Tensor:
    return (torch.rand(*shape, generator=torch.Generator().manual_seed(9)) + 0.5).to(device)


def cases() -> list[tuple[str, str, Callable[[torch.device], Args]]]:
    """(name, op, build) of every case."""

    def ids(device: torch.device, values: Any, dtype: torch.dtype = torch.int32) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    bad_map = lambda d: _int32(d, BAD_ROW_MAP)  # noqa: E731
    return [
        (
            "moe_permute_map/expert ids out of range",
            "moe_permute_map",
            lambda d: (ids(d, [[0, 5], [-1, 2], [2, 2], [7, -3]]), 3, 8, 1),
        ),
        (
            "moe_permute_map/huge int64 expert ids",
            "moe_permute_map",
            lambda d: (ids(d, [[2**33 + 1, 0], [1, -(2**40)]], torch.int64), 3, 4, 4),
        ),
        (
            "moe_permute_map/num_out_tokens too small (padded)",
            "moe_permute_map",
            lambda d: (ids(d, [[0, 1], [1, 2], [0, 2]]) == 1, 2, 3, 4),
        ),
        (
            "moe_permute_map/num_out_tokens 0",
            "moe_permute_map",
            lambda d: (ids(d, [[0, 1], [1, 2]]), 3, 0, 1),
        ),
        (
            "moe_permute/row map out of range",
            "moe_permute",
            lambda d: (_x(d, 4), bad_map(d), _probs(d, (4, 3)), 6),
        ),
        (
            "moe_permute/row map out of range (unweighted)",
            "moe_permute",
            lambda d: (_x(d, 4), bad_map(d), None, 6),
        ),
        (
            "moe_permute_probs/row map out of range",
            "moe_permute_probs",
            lambda d: (_probs(d, (4, 3)), bad_map(d), 6),
        ),
        (
            "moe_unpermute/row map out of range",
            "moe_unpermute",
            lambda d: (_x(d, 6, seed=1), bad_map(d), _probs(d, (4, 3))),
        ),
        (
            "moe_unpermute/x shorter than the row map says",
            "moe_unpermute",
            lambda d: (_x(d, 2, seed=1), bad_map(d), None),
        ),
        (
            "moe_unpermute_wgrad/row map out of range",
            "moe_unpermute_wgrad",
            lambda d: (_x(d, 6, seed=1), _x(d, 4, seed=2), bad_map(d)),
        ),
        (
            "moe_sort_chunks/negative and oversized chunks",
            "moe_sort_chunks",
            lambda d: (_x(d, 7), ids(d, [-3, 4, 9]), ids(d, [2, 0, 1])),
        ),
        (
            "moe_sort_chunks/index out of range and repeated",
            "moe_sort_chunks",
            lambda d: (_x(d, 7), ids(d, [2, 3, 2]), ids(d, [5, 1, 1])),
        ),
        (
            "moe_sort_chunks/huge int64 sizes and index",
            "moe_sort_chunks",
            lambda d: (
                _x(d, 5),
                ids(d, [2**40, 2], torch.int64),
                ids(d, [-(2**35), 0], torch.int64),
            ),
        ),
    ]


def valid_args(op: str, device: torch.device) -> Args:
    """A valid call of ``op``, run after each bad one."""
    mask = torch.tensor([[1, 0, 1], [0, 1, 1], [1, 1, 0], [0, 0, 1]], device=device) == 1
    row_map = _int32(device, [[0, -1, 4], [-1, 2, 5], [1, 3, -1], [-1, -1, 6]])
    return {
        "moe_permute_map": (mask, 3, 9, 2),
        "moe_permute": (_x(device, 4), row_map, _probs(device, (4, 3)), 8),
        "moe_permute_probs": (_probs(device, (4, 3)), row_map, 8),
        "moe_unpermute": (_x(device, 8, seed=1), row_map, _probs(device, (4, 3))),
        "moe_unpermute_wgrad": (_x(device, 8, seed=1), _x(device, 4, seed=2), row_map),
        "moe_sort_chunks": (
            _x(device, 7),
            torch.tensor([3, 0, 4], device=device),
            torch.tensor([2, 0, 1], device=device),
        ),
    }[op]


# ---------------------------------------------------------------------------
# The safe results, slot by slot


def _map(routing: torch.Tensor, experts: int, rows: int, align: int) -> tuple[list, list]:
    tokens, slots = routing.shape
    members: list[list[tuple[int, int]]] = [[] for _ in range(experts)]
    for t in range(tokens):
        for j in range(slots):
            e = (j if bool(routing[t, j]) else -1) if routing.dtype == torch.bool else routing[t, j]
            if 0 <= int(e) < experts:
                members[int(e)].append((t, j))
    row_map = [[-1] * slots for _ in range(tokens)]
    counts, start = [], 0
    for group in members:
        for r, (t, j) in enumerate(group):
            if start + r < rows:
                row_map[t][j] = start + r
        end = start + -(-len(group) // align) * align
        counts.append(min(end, rows) - min(start, rows))
        start = end
    return row_map, counts


def _writers(row_map: torch.Tensor, rows: int) -> list[list[tuple[int, int]]]:
    found: list[list[tuple[int, int]]] = [[] for _ in range(rows)]
    for t, line in enumerate(row_map.tolist()):
        for j, dest in enumerate(line):
            if 0 <= dest < rows:
                found[dest].append((t, j))
    return found


def _member_rows(got: torch.Tensor, candidates: list[torch.Tensor], what: str) -> None:
    """Each element of ``got`` equals that element of one candidate (0 when there is none)."""
    if not candidates:
        if got.any():
            raise AssertionError(f"{what}: a row no slot names is not 0")
        return
    stack = torch.stack(candidates)
    close = (stack - got).abs() <= 1e-5 * (stack.abs() + 1)
    if not bool(close.any(0).all()):
        raise AssertionError(f"{what}: an element is none of the slots' values")


def check(op: str, args: dict[str, Any], out: Any) -> None:
    """Raise AssertionError unless ``out`` is ``op``'s documented safe result on ``args``."""
    if op == "moe_permute_map":
        want_map, want_counts = _map(
            args["routing_map"].cpu(),
            args["num_experts"],
            args["num_out_tokens"],
            args["align_size"],
        )
        row_map, counts = out
        if row_map.cpu().tolist() != want_map or counts.cpu().tolist() != want_counts:
            raise AssertionError(
                f"row map {row_map.tolist()} / counts {counts.tolist()}, want {want_map} / "
                f"{want_counts}"
            )
        return
    if op == "moe_sort_chunks":
        x = args["x"].cpu()
        sizes = [max(int(s), 0) for s in args["split_sizes"].cpu().tolist()]
        starts, at = [], 0
        for s in sizes:
            starts.append(min(at, x.shape[0]))
            at = min(at + s, x.shape[0])
        sizes = [min(s, x.shape[0] - start) for s, start in zip(sizes, starts, strict=True)]
        want = torch.zeros_like(x)
        row = 0
        for c in args["sorted_index"].cpu().tolist():
            if 0 <= c < len(sizes):
                for i in range(sizes[c]):
                    if row < x.shape[0]:
                        want[row] = x[starts[c] + i]
                    row += 1
        torch.testing.assert_close(out.cpu(), want)
        return
    row_map = args["row_map"].cpu()
    if op in ("moe_permute", "moe_permute_probs"):
        rows = args["num_out_tokens"]
        probs = args["probs"]
        probs = None if probs is None else probs.cpu().float()
        for dest, writers in enumerate(_writers(row_map, rows)):
            if op == "moe_permute":
                x = args["x"].cpu().float()
                candidates = [x[t] * (1.0 if probs is None else probs[t, j]) for t, j in writers]
            else:
                candidates = [probs[t, j].reshape(1) for t, j in writers]  # type: ignore[index]
            _member_rows(out[dest].cpu().float().reshape(-1), candidates, f"row {dest}")
        return
    x = args["x"].cpu().double()
    tokens, slots = row_map.shape
    if op == "moe_unpermute":
        probs = args["probs"]
        want = torch.zeros(tokens, x.shape[1], dtype=torch.float64)
        for t in range(tokens):
            for j in range(slots):
                dest = int(row_map[t, j])
                if 0 <= dest < x.shape[0]:
                    want[t] += x[dest] * (1.0 if probs is None else float(probs[t, j]))
    else:  # moe_unpermute_wgrad
        grad = args["grad"].cpu().double()
        want = torch.zeros(tokens, slots, dtype=torch.float64)
        for t in range(tokens):
            for j in range(slots):
                dest = int(row_map[t, j])
                if 0 <= dest < x.shape[0]:
                    want[t, j] = x[dest] @ grad[t]
    torch.testing.assert_close(out.cpu().double(), want, rtol=1e-5, atol=1e-5)
