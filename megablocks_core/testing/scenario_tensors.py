"""The conformance kit's routing scenarios and their tensors.

A :class:`Scenario` names a routing situation (tokens, experts, top_k, hidden
size, dtypes, layout); :func:`routing` turns it into the tensors a dropless MoE
layer would hold at that point, built with plain torch so that no backend under
test takes part. Each op's sample is picked out of those tensors by :mod:`.scenarios`;
the scenarios the kit runs are listed in :mod:`.scenario_sets`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

#: Default padding granularity of padded_bins (small, so that padding rows really occur).
BLOCK_SIZE = 4
#: Rows of the per-bin tables that replicate expands.
REPLICATE_BATCH = 2


@dataclass(frozen=True)
class Scenario:
    """One routing situation; every op's sample is derived from it."""

    tokens: int
    experts: int
    top_k: int
    hidden: int
    dtype: torch.dtype = torch.float32
    """Dtype of every floating-point tensor (activations, weights, gradients)."""
    index_dtype: torch.dtype = torch.int32
    """Dtype of the keys, indices, bin_ids, bins and padded_bins."""
    empty_experts: bool = False
    """Route tokens to even-numbered experts only, so the odd ones get no rows."""
    non_contiguous: bool = False
    """Pass every tensor as a strided (non-contiguous) view."""
    weighted: bool = True
    """Pass weights where an op accepts them (None otherwise)."""
    trans_b: bool = False
    ffn: int | None = None
    """gmm's output width (the expert weights' other dimension); default ``hidden + 2``."""
    block_size: int = BLOCK_SIZE
    """Padding granularity of padded_bins, route and topology (MegaBlocks uses 128)."""
    sizes_on_device: bool = False
    """gmm's batch_sizes on the device (the sync-free form) instead of MegaBlocks' CPU tensor."""
    accumulate_dtype: torch.dtype | None = None
    """Dtype of the gradient gmm_weight_grad_accumulate adds to (e.g. float32, a main_grad for
    16-bit data); None: the scenario's dtype."""
    unrouted: int = 0
    """(token, k) pairs routed to no expert: their key is the sentinel ``experts`` (one past the
    last), so they sort last, bins ends before the last sorted row and batch_sizes sums short, as
    expert parallelism routes the pairs whose expert lives on another rank. Only the ops whose
    contracts take such rows get this scenario's samples (see :func:`applies`)."""
    first_rows: bool = False
    """With ``unrouted`` pairs: the ops that take a sorted-row count (``gather``, ``gather_gmm``,
    ``gmm_scatter``: ``rows``) get one, the routed rows plus half the unrouted ones, as expert
    parallelism's receiving rank passes its own pairs' count."""
    seed: int = 0

    @property
    def ffn_size(self) -> int:
        return self.hidden + 2 if self.ffn is None else self.ffn

    @property
    def name(self) -> str:
        flags = [
            f
            for f, on in (
                ("empty experts", self.empty_experts),
                ("non-contiguous", self.non_contiguous),
                ("unweighted", not self.weighted),
                ("trans_b", self.trans_b),
                (f"ffn={self.ffn}", self.ffn is not None),
                (f"block={self.block_size}", self.block_size != BLOCK_SIZE),
                ("sizes on device", self.sizes_on_device),
                (
                    f"accumulate in {_short(self.accumulate_dtype or self.dtype)}",
                    self.accumulate_dtype not in (None, self.dtype),
                ),
                (f"unrouted={self.unrouted}", self.unrouted > 0),
                ("first rows", self.first_rows),
            )
            if on
        ]
        dtypes = f"{_short(self.dtype)}/{_short(self.index_dtype)}"
        return (
            f"tokens={self.tokens} experts={self.experts} top_k={self.top_k} hidden={self.hidden} "
            + " ".join([dtypes, *flags])
        )


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Routing:
    """The tensors of one scenario on one device (see :func:`routing`)."""

    scenario: Scenario
    top_experts: torch.Tensor
    end_bit: int
    indices: torch.Tensor
    bin_ids: torch.Tensor
    counts: torch.Tensor
    """Tokens per expert in the index dtype (cumsum input)."""
    bins: torch.Tensor
    padded_bins: torch.Tensor
    padded_rows_total: int
    bin_size: int
    x: torch.Tensor
    """Token rows, (tokens, hidden)."""
    rows: torch.Tensor
    """Expert-sorted rows, (tokens * top_k, hidden)."""
    weights: torch.Tensor | None
    grad: torch.Tensor
    """A gradient with respect to token rows, (tokens, hidden)."""
    padded_x: torch.Tensor
    binned_x: torch.Tensor
    per_bin: torch.Tensor
    per_row: torch.Tensor
    expert_weights: torch.Tensor
    """gmm's b: (experts, hidden, ffn), or (experts, ffn, hidden) with trans_b."""
    gmm_grad: torch.Tensor
    batch_sizes: torch.Tensor
    """Tokens per expert as int64, on the CPU (MegaBlocks' convention for gmm) unless the scenario
    puts them on the device."""
    weight_grad_buffer: torch.Tensor
    """The existing gradient gmm_weight_grad_accumulate adds ``rows.T @ gmm_grad`` to:
    (experts, hidden, ffn) in the scenario's ``accumulate_dtype``."""
    scores: torch.Tensor
    """Router scores, (tokens, experts), in quarter steps (equal scores in most rows), with a
    NaN in row 1 and row 2 all -inf where the shape allows (router_topk's tie and NaN rules)."""
    gate_up: torch.Tensor
    """A gated expert's first GEMM output, (tokens * top_k, 2 * ffn): glu's input."""

    @property
    def num_rows(self) -> int:
        return self.indices.shape[0]

    @property
    def row_count(self) -> int | None:
        """The ops' sorted-row count (``rows``): None unless the scenario asks for one."""
        s = self.scenario
        if not s.first_rows:
            return None
        return s.tokens * s.top_k - s.unrouted + s.unrouted // 2

    def first(self, rows: torch.Tensor) -> torch.Tensor:
        """Sorted ``rows`` cut to the row count, if any."""
        return rows if self.row_count is None else rows[: self.row_count]


def routing(s: Scenario, device: torch.device | str = "cpu") -> Routing:
    """Build a scenario's tensors with plain torch (deterministic for a given seed)."""
    gen = torch.Generator().manual_seed(s.seed)
    rows = s.tokens * s.top_k
    used = (s.experts + 1) // 2 if s.empty_experts else s.experts
    keys = torch.randint(0, used, (rows,), generator=gen) * (2 if s.empty_experts else 1)
    if s.unrouted:
        keys[torch.randperm(rows, generator=gen)[: s.unrouted]] = s.experts  # the sentinel
    bin_ids, indices = torch.sort(keys, stable=True)
    counts = torch.bincount(keys, minlength=s.experts + 1)[: s.experts]  # the sentinel uncounted
    padded_counts = (counts + s.block_size - 1) // s.block_size * s.block_size
    padded_total = int(padded_counts.sum())
    bin_size = math.ceil(rows / s.experts)  # rows past an expert's fair share are dropped
    ffn = s.ffn_size

    def floats(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=s.dtype)

    def index(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=s.index_dtype)

    b_shape = (s.experts, ffn, s.hidden) if s.trans_b else (s.experts, s.hidden, ffn)
    weights = torch.rand(rows, generator=gen).to(device=device, dtype=s.dtype)
    return Routing(
        scenario=s,
        top_experts=index(keys),
        end_bit=max((s.experts if s.unrouted else s.experts - 1).bit_length(), 1),
        indices=index(indices),
        bin_ids=index(bin_ids),
        counts=index(counts),
        bins=index(counts.cumsum(0)),
        padded_bins=index(padded_counts.cumsum(0)),
        padded_rows_total=padded_total,
        bin_size=bin_size,
        x=floats(s.tokens, s.hidden),
        rows=floats(rows, s.hidden),
        weights=weights if s.weighted else None,
        grad=floats(s.tokens, s.hidden),
        padded_x=floats(padded_total, s.hidden),
        binned_x=floats(s.experts, bin_size, s.hidden),
        per_bin=floats(REPLICATE_BATCH, s.experts),
        per_row=floats(REPLICATE_BATCH, rows),
        expert_weights=floats(*b_shape),
        gmm_grad=floats(rows, ffn),
        batch_sizes=counts.to(device=device if s.sizes_on_device else "cpu", dtype=torch.int64),
        weight_grad_buffer=torch.randn(s.experts, s.hidden, ffn, generator=gen).to(
            device=device, dtype=s.accumulate_dtype or s.dtype
        ),
        scores=_router_scores(s, device),
        gate_up=_gate_up(s, rows, device),
    )


def _gate_up(s: Scenario, rows: int, device: torch.device | str) -> torch.Tensor:
    # Its own generator (as the scores'), values wide enough to reach every activation's tails.
    gen = torch.Generator().manual_seed(s.seed + 2)
    return (torch.randn(rows, 2 * s.ffn_size, generator=gen) * 3).to(device=device, dtype=s.dtype)


def _router_scores(s: Scenario, device: torch.device | str) -> torch.Tensor:
    # Its own generator: the other tensors stay what they were before router_topk existed.
    gen = torch.Generator().manual_seed(s.seed + 1)
    scores = (torch.randn(s.tokens, s.experts, generator=gen) * 4).round() / 4
    if s.tokens > 2 and s.experts > 1:
        scores[1, s.experts // 2] = float("nan")
        scores[2] = float("-inf")
    return scores.to(device=device, dtype=s.dtype)
