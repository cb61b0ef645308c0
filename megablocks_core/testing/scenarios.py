"""Sample inputs for every dispatched op, from one routing-scenario generator.

A :class:`Scenario` names a routing situation (tokens, experts, top_k, hidden
size, dtypes, layout); :func:`routing` turns it into the tensors a dropless MoE
layer would hold at that point, built with plain torch so that no backend under
test takes part. :data:`SAMPLES` is the only per-op knowledge of the kit: how
to pick an op's kernel-order arguments out of those tensors. Everything else
(what to check, which errors to expect, output shapes) comes from the contracts.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..activations import GATED, ROW_NAMES
from ..activations import NAMES as ACTIVATION_NAMES
from ..contracts import BY_NAME

#: Default padding granularity of padded_bins (small, so that padding rows really occur).
BLOCK_SIZE = 4
#: Column blocks per expert in topology samples.
BLOCK_COLUMNS = 2
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


def _activation(r: Routing) -> str | None:
    return (None, *ACTIVATION_NAMES)[r.scenario.seed % (len(ACTIVATION_NAMES) + 1)]


def _row_activation(r: Routing, shift: int = 0) -> str | None:
    """gmm_scatter's and activation_backward's activation, gated ones included, in turn by seed
    (``shift`` apart, so that the few quick scenarios give each op plain and gated ones)."""
    return (None, *ROW_NAMES)[(r.scenario.seed + shift) % (len(ROW_NAMES) + 1)]


def _row_input(r: Routing, plain: torch.Tensor, shift: int = 0) -> torch.Tensor:
    """An activating op's rows: ``plain`` (rows, ffn), or gate_up (rows, 2 * ffn) when the
    scenario's activation is gated."""
    return r.gate_up if _row_activation(r, shift) in GATED else plain


def _bias(r: Routing, width: int) -> torch.Tensor | None:
    """The grouped GEMMs' per-expert bias (experts, width), for odd seeds (None for even ones),
    from its own generator (the other tensors stay what they were before bias existed)."""
    s = r.scenario
    if s.seed % 2 == 0:
        return None
    gen = torch.Generator().manual_seed(s.seed + 2)
    bias = torch.randn(s.experts, width, generator=gen)
    return bias.to(device=r.x.device, dtype=s.dtype)


#: activation_backward's activations run this far ahead of gmm_scatter's (half of the names).
_BACKWARD_SHIFT = 4


def _moe_routing_map(r: Routing) -> torch.Tensor:
    """The moe_permute ops' routing map: the scenario's top-k experts as a (tokens, experts) bool
    mask (even seeds) or as (tokens, top_k) ids (odd seeds; unrouted pairs keep the sentinel id
    ``experts``, which names no expert)."""
    s = r.scenario
    ids = r.top_experts.view(s.tokens, s.top_k)
    if s.seed % 2:
        return ids
    routed = ids.long() < s.experts
    mask = torch.zeros(s.tokens, s.experts + 1, dtype=torch.bool, device=ids.device)
    mask.scatter_(1, torch.where(routed, ids.long(), s.experts), True)
    return mask[:, : s.experts].contiguous()


def _moe_counts(routing_map: torch.Tensor, experts: int) -> torch.Tensor:
    if routing_map.dtype == torch.bool:
        return routing_map.long().sum(0)
    ids = routing_map.long().reshape(-1)
    return torch.bincount(ids[ids < experts], minlength=experts)


def _moe_out_tokens(r: Routing) -> int:
    """Rows of the permuted output: every padded row and a few to spare, or (every third seed)
    half of them, so that rows are dropped."""
    s = r.scenario
    counts = _moe_counts(_moe_routing_map(r).cpu(), s.experts)
    needed = int(((counts + s.block_size - 1) // s.block_size * s.block_size).sum())
    return needed // 2 if s.seed % 3 == 2 else needed + 3


def _moe_row_map(r: Routing) -> torch.Tensor:
    """The row map of :func:`_moe_routing_map` (the contract's format), built here with plain
    torch, one expert at a time, so that no backend under test takes part."""
    s = r.scenario
    routing = _moe_routing_map(r).cpu()
    rows, align = _moe_out_tokens(r), s.block_size
    if routing.dtype == torch.bool:
        expert_of = torch.where(routing, torch.arange(s.experts), -1)
    else:
        expert_of = routing.long()
    flat = expert_of.reshape(-1)
    row_map = torch.full_like(flat, -1)
    start = 0
    for e in range(s.experts):
        slots = (flat == e).nonzero().reshape(-1)  # ascending: token order, then k
        dest = start + torch.arange(slots.numel())
        row_map[slots] = torch.where(dest < rows, dest, -1)
        start += -(-slots.numel() // align) * align
    return row_map.view(routing.shape).to(device=r.x.device, dtype=torch.int32)


def _moe_probs(r: Routing) -> torch.Tensor:
    gen = torch.Generator().manual_seed(r.scenario.seed + 3)
    shape = _moe_routing_map(r).shape
    return torch.rand(*shape, generator=gen).to(device=r.x.device, dtype=r.scenario.dtype)


def _moe_permuted(r: Routing) -> torch.Tensor:
    gen = torch.Generator().manual_seed(r.scenario.seed + 4)
    rows = torch.randn(_moe_out_tokens(r), r.scenario.hidden, generator=gen)
    return rows.to(device=r.x.device, dtype=r.scenario.dtype)


def _moe_chunks(r: Routing) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """moe_sort_chunks' arguments: the sorted rows in the experts' chunks, placed in a shuffled
    order; the sizes on the CPU in odd seeds (both places are accepted)."""
    gen = torch.Generator().manual_seed(r.scenario.seed + 5)
    order = torch.randperm(r.scenario.experts, generator=gen)
    sizes = r.counts if r.scenario.seed % 2 == 0 else r.counts.cpu()
    return r.rows, sizes, order.to(device=sizes.device, dtype=r.scenario.index_dtype)


#: Op → its kernel-order arguments in a scenario. The only per-op table of the kit;
#: a test checks that it covers every dispatched contract.
SAMPLES: dict[str, Callable[[Routing], tuple[Any, ...]]] = {
    "sort": lambda r: (r.top_experts, r.end_bit),
    "histogram": lambda r: (r.top_experts, r.scenario.experts),
    "inclusive_cumsum": lambda r: (r.counts, 0),
    "exclusive_cumsum": lambda r: (r.counts, 0),
    "topology": lambda r: (
        r.padded_bins,
        r.scenario.block_size,
        r.padded_rows_total // r.scenario.block_size,
        BLOCK_COLUMNS,
    ),
    "replicate": lambda r: (r.per_bin, r.bins, r.num_rows),
    "replicate_backward": lambda r: (r.per_row, r.bins),
    "route": lambda r: (r.top_experts, r.scenario.experts, r.scenario.block_size),
    # Softmax weights in every other scenario (by seed), the scores themselves in the rest.
    "router_topk": lambda r: (r.scores, r.scenario.top_k, r.scenario.seed % 2 == 0),
    "gather": lambda r: (
        r.x,
        r.indices,
        r.bin_ids,
        r.weights,
        r.bins,
        r.scenario.top_k,
        r.row_count,
    ),
    "scatter": lambda r: (r.rows, r.indices, r.bin_ids, r.weights, r.bins, r.scenario.top_k),
    "scatter_wgrad": lambda r: (r.rows, r.grad, r.indices, r.bin_ids, r.bins, r.scenario.top_k),
    "padded_gather": lambda r: (
        r.x,
        r.indices,
        r.bin_ids,
        r.weights,
        r.bins,
        r.padded_bins,
        r.scenario.top_k,
    ),
    "padded_scatter": lambda r: (
        r.padded_x,
        r.indices,
        r.bin_ids,
        r.weights,
        r.bins,
        r.padded_bins,
        r.scenario.top_k,
    ),
    "padded_scatter_wgrad": lambda r: (
        r.padded_x,
        r.grad,
        r.indices,
        r.bin_ids,
        r.bins,
        r.padded_bins,
        r.scenario.top_k,
    ),
    "binned_gather": lambda r: (r.x, r.indices, r.weights, r.bins, r.bin_size, r.scenario.top_k),
    "binned_scatter": lambda r: (r.binned_x, r.indices, r.weights, r.bins, r.scenario.top_k),
    "binned_scatter_wgrad": lambda r: (r.binned_x, r.grad, r.indices, r.bins, r.scenario.top_k),
    "moe_permute_map": lambda r: (
        _moe_routing_map(r),
        r.scenario.experts,
        _moe_out_tokens(r),
        r.scenario.block_size,
    ),
    "moe_permute": lambda r: (
        r.x,
        _moe_row_map(r),
        _moe_probs(r) if r.scenario.weighted else None,
        _moe_out_tokens(r),
    ),
    "moe_permute_probs": lambda r: (_moe_probs(r), _moe_row_map(r), _moe_out_tokens(r)),
    "moe_unpermute": lambda r: (
        _moe_permuted(r),
        _moe_row_map(r),
        _moe_probs(r) if r.scenario.weighted else None,
    ),
    "moe_unpermute_wgrad": lambda r: (_moe_permuted(r), r.grad, _moe_row_map(r)),
    "moe_sort_chunks": _moe_chunks,
    "gmm": lambda r: (
        r.rows,
        r.expert_weights,
        r.batch_sizes,
        r.scenario.trans_b,
        _bias(r, r.scenario.ffn_size),
    ),
    "gmm_weight_grad": lambda r: (r.rows, r.gmm_grad, r.batch_sizes),
    "gmm_weight_grad_accumulate": lambda r: (
        r.rows,
        r.gmm_grad,
        r.batch_sizes,
        r.weight_grad_buffer,
    ),
    "gather_gmm": lambda r: (
        r.x,
        r.expert_weights,
        r.indices,
        r.bin_ids,
        r.bins,
        r.scenario.top_k,
        r.scenario.trans_b,
        r.row_count,
        _bias(r, r.scenario.ffn_size),
    ),
    # The second expert GEMM: sorted (rows, ffn) back to (tokens, hidden), its activation (or
    # none; a gated one of (rows, 2 * ffn)) taken in turn by seed.
    "gmm_scatter": lambda r: (
        r.first(_row_input(r, r.gmm_grad)),
        r.expert_weights.transpose(1, 2).contiguous(),
        r.indices,
        r.bin_ids,
        r.weights,
        r.bins,
        r.scenario.top_k,
        r.scenario.trans_b,
        _row_activation(r),
        r.row_count,
        _bias(r, r.scenario.hidden),
    ),
    # The gated unit, its activation (or none) taken in turn by seed as gmm_scatter's.
    "glu": lambda r: (r.gate_up, _activation(r)),
    "glu_backward": lambda r: (r.gmm_grad, r.gate_up, _activation(r)),
    # An expert MLP's activation in backward: the gate half of gate_up as the pre-activation rows
    # (a strided view) or all of it for a gated activation, the rows' top-k weights as scale.
    "activation_backward": lambda r: (
        r.gmm_grad,
        _row_input(r, r.gate_up[:, : r.scenario.ffn_size], _BACKWARD_SHIFT),
        r.weights,
        _row_activation(r, _BACKWARD_SHIFT),
    ),
}


#: Ops whose contracts need every sorted row routed to an expert (bins ending at the last row,
#: expert ids in range): they get no samples of scenarios with ``unrouted`` pairs.
ROUTED_ONLY_OPS = frozenset(
    {
        "route",
        "padded_gather",
        "padded_scatter",
        "padded_scatter_wgrad",
        "binned_gather",
        "binned_scatter",
        "binned_scatter_wgrad",
    }
)


def applies(scenario: Scenario, op: str) -> bool:
    """Whether ``op`` gets a sample of ``scenario`` (every op but those of
    :data:`ROUTED_ONLY_OPS` when some pairs are routed to no expert)."""
    return not (scenario.unrouted and op in ROUTED_ONLY_OPS)


def strided(t: torch.Tensor) -> torch.Tensor:
    """The same values as a non-contiguous view (every other element of a wider tensor)."""
    if t.dim() == 0:
        return t
    wide = t.new_zeros(*t.shape[:-1], 2 * t.shape[-1])
    wide[..., ::2] = t
    return wide[..., ::2]


def sample(op: str, r: Routing) -> tuple[Any, ...]:
    """``op``'s kernel-order arguments in routing ``r`` (strided views if the scenario says so,
    but for arguments the op writes in place: those must be contiguous)."""
    args = SAMPLES[op](r)
    if not r.scenario.non_contiguous:
        return args
    specs = BY_NAME[op].args
    return tuple(
        strided(a) if isinstance(a, torch.Tensor) and not getattr(spec, "mutable", False) else a
        for spec, a in zip(specs, args, strict=True)
    )


_I16, _I32, _I64 = torch.int16, torch.int32, torch.int64
_F32, _F16, _BF16, _F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64

#: ``--quick``: one representative of each edge case (the first one also feeds opcheck and compile).
QUICK: tuple[Scenario, ...] = (
    Scenario(tokens=16, experts=4, top_k=2, hidden=8),
    Scenario(tokens=0, experts=4, top_k=2, hidden=8),
    Scenario(
        tokens=12,
        experts=8,
        top_k=2,
        hidden=5,
        dtype=_BF16,
        index_dtype=_I64,
        empty_experts=True,
        non_contiguous=True,
        trans_b=True,
        sizes_on_device=True,
        accumulate_dtype=_F32,
        seed=1,
    ),
    Scenario(
        tokens=9,
        experts=1,
        top_k=1,
        hidden=1,
        dtype=_F16,
        index_dtype=_I16,
        weighted=False,
        trans_b=True,
        block_size=128,
        seed=2,
    ),
    Scenario(tokens=40, experts=256, top_k=8, hidden=3, seed=3),
    # Pairs routed to no expert, past bins[-1] (expert parallelism's), and a sorted-row count.
    Scenario(tokens=21, experts=4, top_k=2, hidden=8, unrouted=17, first_rows=True, seed=4),
)

#: The full suite: the quick set, every float × index dtype pair, top_k 1…8, larger shapes.
FULL: tuple[Scenario, ...] = (
    *QUICK,
    *(
        Scenario(
            tokens=24,
            experts=6,
            top_k=2,
            hidden=16,
            dtype=f,
            index_dtype=i,
            accumulate_dtype=_F32 if i == _I64 else None,  # 16-bit data into a float32 main_grad
            seed=10 + n,
        )
        for n, (f, i) in enumerate(
            (f, i) for f in (_F32, _F16, _BF16, _F64) for i in (_I16, _I32, _I64)
        )
    ),
    *(
        Scenario(
            tokens=13,
            experts=8,
            top_k=k,
            hidden=7,
            seed=30 + k,
            trans_b=k % 2 == 0,
            weighted=k != 3,
        )
        for k in range(1, 9)
    ),
    Scenario(tokens=0, experts=1, top_k=1, hidden=1, dtype=_BF16, index_dtype=_I64),
    Scenario(tokens=1, experts=16, top_k=4, hidden=1, dtype=_F16, empty_experts=True, seed=40),
    Scenario(tokens=64, experts=256, top_k=8, hidden=32, dtype=_BF16, empty_experts=True, seed=41),
    Scenario(tokens=300, experts=8, top_k=2, hidden=128, dtype=_BF16, non_contiguous=True, seed=42),
    Scenario(
        tokens=257,
        experts=32,
        top_k=4,
        hidden=96,
        dtype=_F16,
        index_dtype=_I64,
        trans_b=True,
        seed=43,
    ),
    Scenario(tokens=512, experts=64, top_k=2, hidden=64, seed=44),
    Scenario(
        tokens=100,
        experts=8,
        top_k=2,
        hidden=33,
        dtype=_F32,
        index_dtype=_I16,
        non_contiguous=True,
        empty_experts=True,
        seed=45,
    ),
    # MegaBlocks' block size: most experts are a single padded block of 128 rows, mostly padding.
    Scenario(tokens=9, experts=32, top_k=8, hidden=33, dtype=_F16, block_size=128, seed=46),
    # Pairs routed to no expert (expert parallelism's pairs of other ranks' experts): sorted rows
    # past bins[-1], batch_sizes summing short.
    Scenario(tokens=21, experts=4, top_k=2, hidden=8, unrouted=17, seed=47),
    Scenario(
        tokens=10,
        experts=6,
        top_k=3,
        hidden=5,
        dtype=_BF16,
        index_dtype=_I16,
        empty_experts=True,
        non_contiguous=True,
        trans_b=True,
        sizes_on_device=True,
        accumulate_dtype=_F32,
        unrouted=11,
        seed=48,
    ),
    Scenario(tokens=6, experts=3, top_k=2, hidden=4, dtype=_F64, unrouted=12, seed=49),
    # ... and only the first sorted rows given or computed (a row count, as the receiving rank's).
    Scenario(
        tokens=10,
        experts=6,
        top_k=3,
        hidden=5,
        dtype=_BF16,
        index_dtype=_I16,
        non_contiguous=True,
        trans_b=True,
        sizes_on_device=True,
        unrouted=11,
        first_rows=True,
        seed=61,
    ),
    Scenario(
        tokens=6, experts=3, top_k=2, hidden=4, dtype=_F64, unrouted=12, first_rows=True, seed=62
    ),
)

#: Added to the full set on an accelerator: the shapes of real MoE layers (thousands of tokens,
#: hidden sizes in the thousands, MegaBlocks' block size 128), where tiling, masking of odd tails
#: and multi-block launches are exercised. Too slow for a CPU (and Triton's interpreter).
DEVICE_SIZED: tuple[Scenario, ...] = (
    Scenario(
        tokens=4096,
        experts=8,
        top_k=2,
        hidden=1024,
        ffn=768,
        dtype=_BF16,
        block_size=128,
        accumulate_dtype=_F32,
        seed=50,
    ),
    Scenario(
        tokens=4096,
        experts=8,
        top_k=2,
        hidden=1024,
        ffn=768,
        dtype=_F16,
        block_size=128,
        trans_b=True,
        sizes_on_device=True,
        seed=51,
    ),
    Scenario(
        tokens=2048, experts=64, top_k=8, hidden=512, ffn=384, dtype=_F32, block_size=128, seed=52
    ),
    Scenario(
        tokens=2048,
        experts=64,
        top_k=8,
        hidden=512,
        ffn=384,
        dtype=_BF16,
        index_dtype=_I64,
        block_size=128,
        trans_b=True,
        sizes_on_device=True,
        seed=53,
    ),
    Scenario(
        tokens=1024,
        experts=256,
        top_k=8,
        hidden=2048,
        ffn=256,
        dtype=_BF16,
        block_size=128,
        empty_experts=True,
        accumulate_dtype=_F32,
        seed=54,
    ),
    Scenario(
        tokens=296,
        experts=16,
        top_k=2,
        hidden=72,
        ffn=136,
        dtype=_F32,
        block_size=128,
        trans_b=True,
        seed=55,
    ),
    # Odd sizes everywhere: masks and tails.
    Scenario(
        tokens=777,
        experts=16,
        top_k=1,
        hidden=129,
        ffn=136,
        dtype=_F16,
        block_size=128,
        non_contiguous=True,
        seed=56,
    ),
    Scenario(
        tokens=777,
        experts=16,
        top_k=1,
        hidden=129,
        ffn=136,
        dtype=_F32,
        block_size=128,
        sizes_on_device=True,
        weighted=False,
        seed=57,
    ),
    Scenario(tokens=0, experts=8, top_k=2, hidden=256, dtype=_BF16, block_size=128, seed=58),
    # Expert parallelism's receiving rank: half the pairs belong to other ranks' experts.
    Scenario(
        tokens=2048,
        experts=16,
        top_k=4,
        hidden=512,
        ffn=384,
        dtype=_BF16,
        block_size=128,
        sizes_on_device=True,
        accumulate_dtype=_F32,
        unrouted=4096,
        seed=59,
    ),
    Scenario(
        tokens=2048,
        experts=16,
        top_k=4,
        hidden=512,
        ffn=384,
        dtype=_BF16,
        block_size=128,
        sizes_on_device=True,
        unrouted=4096,
        first_rows=True,
        seed=63,
    ),
)


def scenarios(quick: bool = False, device: torch.device | str = "cpu") -> tuple[Scenario, ...]:
    """The scenarios to check on ``device``: :data:`QUICK`, or :data:`FULL` plus, on an accelerator,
    :data:`DEVICE_SIZED`."""
    if quick:
        return QUICK
    return FULL if torch.device(device).type in ("cpu", "meta") else FULL + DEVICE_SIZED
