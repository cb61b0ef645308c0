"""Shared by the moe_permute tests: Megatron-Core's moe_utils (the oracle written by someone
else; None where megatron-core is not installed), random top-k routing, and an independent
per-slot loop of the row map format (megablocks_core.contracts.ROW_MAP_FORMAT)."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

import megablocks_core
from megablocks_core.dispatch import registry

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # Megatron warns that Transformer Engine and Apex are absent
    try:
        from megatron.core.transformer.moe import moe_utils
    except ImportError:  # pragma: no cover - CI installs it (Makefile)
        moe_utils = None

needs_megatron = pytest.mark.skipif(moe_utils is None, reason="megatron-core is not installed")


def _triton_ok() -> bool:
    record = registry().plugins.get("triton")
    return (
        os.environ.get("TRITON_INTERPRET") == "1" and record is not None and record.status == "ok"
    )


needs_triton = pytest.mark.skipif(
    not _triton_ok(), reason="the triton kernels run on the CPU only under TRITON_INTERPRET=1"
)

#: Where the tests of the compiled kernels run: the CPU under the interpreter, else the GPU test
#: device (``MEGABLOCKS_TRITON_TEST_DEVICE``).
TRITON_DEVICE = torch.device(
    os.environ.get(
        "MEGABLOCKS_TRITON_TEST_DEVICE",
        "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda",
    )
)


def _triton_device_ok() -> bool:
    record = registry().plugins.get("triton")
    if record is None or record.status != "ok":
        return False
    if TRITON_DEVICE.type == "cpu":
        return os.environ.get("TRITON_INTERPRET") == "1"
    return torch.cuda.is_available()


needs_triton_device = pytest.mark.skipif(
    not _triton_device_ok(), reason=f"the triton kernels cannot run on {TRITON_DEVICE} here"
)


@pytest.fixture(autouse=True, scope="module")
def on_the_reference():
    """Every op on the reference unless a test forces another backend (the triton tests do):
    under TRITON_INTERPRET=1 the triton backend would otherwise win the CPU calls it serves.
    Autouse in each module that imports it."""
    with megablocks_core.use_backend("reference"):
        yield


SETTINGS = settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# ---------------------------------------------------------------------------
# Routing and the independent oracle


def top_k_mask(tokens: int, experts: int, top_k: int, empty: int, seed: int) -> torch.Tensor:
    """A (tokens, experts) bool mask of top_k distinct experts per token; the last ``empty``
    experts get no token."""
    gen = torch.Generator().manual_seed(seed)
    used = max(experts - empty, top_k)
    scores = torch.rand(tokens, used, generator=gen)
    chosen = scores.topk(top_k, dim=1).indices
    mask = torch.zeros(tokens, experts, dtype=torch.bool)
    return mask.scatter_(1, chosen, True)


def loop_permute(
    x: torch.Tensor,
    routing: torch.Tensor,
    experts: int,
    rows: int,
    align: int,
    probs: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(row_map, counts, permuted rows, permuted probs) one slot at a time, in plain Python."""
    tokens, slots = routing.shape
    by_expert: list[list[tuple[int, int]]] = [[] for _ in range(experts)]
    for t in range(tokens):
        for j in range(slots):
            if routing.dtype == torch.bool:
                e = j if bool(routing[t, j]) else -1
            else:
                e = int(routing[t, j])
            if 0 <= e < experts:
                by_expert[e].append((t, j))
    row_map = torch.full((tokens, slots), -1, dtype=torch.int32)
    counts = torch.zeros(experts, dtype=torch.int32)
    out = torch.zeros(rows, x.shape[1], dtype=x.dtype)
    out_probs = None if probs is None else torch.zeros(rows, dtype=probs.dtype)
    start = 0
    for e, members in enumerate(by_expert):
        for r, (t, j) in enumerate(members):
            row = start + r
            if row < rows:
                row_map[t, j] = row
                out[row] = x[t]
                if out_probs is not None and probs is not None:
                    out_probs[row] = probs[t, j]
        end = start + -(-len(members) // align) * align
        counts[e] = min(end, rows) - min(start, rows)
        start = end
    return row_map, counts, out, out_probs


def loop_unpermute(
    y: torch.Tensor, row_map: torch.Tensor, probs: torch.Tensor | None
) -> torch.Tensor:
    out = torch.zeros(row_map.shape[0], y.shape[1], dtype=torch.float64)
    for t in range(row_map.shape[0]):
        for j in range(row_map.shape[1]):
            row = int(row_map[t, j])
            if row >= 0:
                weight = 1.0 if probs is None else float(probs[t, j])
                out[t] += weight * y[row].double()
    return out


def expert(rows: torch.Tensor) -> torch.Tensor:
    """A nonlinear per-row stand-in for the experts (so that gradients depend on the rows)."""
    return rows * 2 + rows**2


routing_cases = st.fixed_dictionaries(
    {
        "tokens": st.integers(0, 12),
        "experts": st.integers(1, 9),
        "top_k": st.integers(1, 8),
        "empty": st.integers(0, 3),
        "slack": st.sampled_from([0, 0, 3]),
        "with_probs": st.booleans(),
        "seed": st.integers(0, 2**16),
    }
)
