"""Sample inputs for every dispatched op, from one routing-scenario generator.

A :class:`Scenario` names a routing situation (tokens, experts, top_k, hidden
size, dtypes, layout); :func:`routing` turns it into the tensors a dropless MoE
layer would hold at that point, built with plain torch so that no backend under
test takes part. :data:`SAMPLES` is the only per-op knowledge of the kit: how
to pick an op's kernel-order arguments out of those tensors. Everything else
(what to check, which errors to expect, output shapes) comes from the contracts.

The scenarios and their tensors are in :mod:`.scenario_tensors`, the lists of scenarios the kit
runs in :mod:`.scenario_sets`; their public names stay importable from here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .. import formats
from ..activations import CLAMPED, GATED, GLU_NAMES, ROW_NAMES
from ..contracts import BY_NAME
from .scenario_sets import DEVICE_SIZED as DEVICE_SIZED
from .scenario_sets import FULL as FULL
from .scenario_sets import QUICK as QUICK
from .scenario_sets import scenarios as scenarios
from .scenario_tensors import Routing, Scenario
from .scenario_tensors import routing as routing

#: Column blocks per expert in topology samples.
BLOCK_COLUMNS = 2


def _in_turn(first: tuple[str | None, ...], names: tuple[str, ...]) -> tuple[str | None, ...]:
    """``first``, then the rest of ``names``: the order in which seeds take them."""
    return (*first, *(n for n in names if n not in first))


#: glu's names in turn by seed: the quick scenarios (seeds 0-4) take the bilinear unit, both
#: layouts of the clamped SwiGLU and the commonest gates.
_GLU_ORDER = _in_turn((None, "silu_oai_interleaved", "silu", "silu_oai", "gelu_erf"), GLU_NAMES)
#: gmm_scatter's names in turn by seed, activation_backward's ``_BACKWARD_SHIFT`` ahead: the
#: quick scenarios give each op plain and gated ones, the clamped SwiGLU among them.
_ROW_ORDER = _in_turn(
    (None, "gelu", "swiglu_oai_interleaved", "gelu_erf", "silu", "relu", "geglu", "swiglu_oai",
     "geglu_erf"),
    ROW_NAMES,
)  # fmt: skip


def _activation(r: Routing) -> str | None:
    return _GLU_ORDER[r.scenario.seed % len(_GLU_ORDER)]


def _row_activation(r: Routing, shift: int = 0) -> str | None:
    """gmm_scatter's and activation_backward's activation, gated ones included, in turn by seed
    (``shift`` apart, so that the few quick scenarios give each op plain and gated ones)."""
    return _ROW_ORDER[(r.scenario.seed + shift) % len(_ROW_ORDER)]


def _clamp(r: Routing, name: str | None) -> tuple[float | None, float | None]:
    """The clamped SwiGLU's (alpha, limit) for an activation that takes them: constants other
    than GPT-OSS's, with a limit that the samples' values cross (every fourth seed: None, the
    defaults); (None, None) for every other activation."""
    if name not in CLAMPED or r.scenario.seed % 4 == 3:
        return None, None
    return 1.25, 1.5


def _row_input(r: Routing, plain: torch.Tensor, shift: int = 0) -> torch.Tensor:
    """An activating op's rows: ``plain`` (rows, ffn), or gate_up (rows, 2 * ffn) when the
    scenario's activation is gated."""
    return r.gate_up if _row_activation(r, shift) in GATED else plain


def _bias(r: Routing, width: int, every_other_pair: bool = False) -> torch.Tensor | None:
    """The grouped GEMMs' per-expert bias (experts, width), for odd seeds (None for even ones),
    from its own generator (the other tensors stay what they were before bias existed).
    ``every_other_pair``: for seeds 2-3, 6-7, ... instead (the scaled GEMMs, whose format
    follows the seed's parity: each format gets seeds with and without a bias)."""
    s = r.scenario
    if (s.seed // 2 if every_other_pair else s.seed) % 2 == 0:
        return None
    gen = torch.Generator().manual_seed(s.seed + 2)
    bias = torch.randn(s.experts, width, generator=gen)
    return bias.to(device=r.x.device, dtype=s.dtype)


#: activation_backward's activations run this far ahead of gmm_scatter's in :data:`_ROW_ORDER`.
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


def _format(r: Routing) -> str:
    """The scaled ops' format, in turn by seed."""
    return formats.FORMAT_NAMES[r.scenario.seed % len(formats.FORMAT_NAMES)]


def _out_dtype(r: Routing) -> str | None:
    """The scaled GEMMs' output dtype, in turn by seed (None: bfloat16)."""
    return (None, "float32", "float16")[(r.scenario.seed // 2) % 3]


def _quantized(r: Routing, x: torch.Tensor, reduce_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x quantized in the scenario's format and the encoding x's device takes, by the core's own
    definition (no backend under test takes part)."""
    fmt = formats.FORMATS[_format(r)]
    encoding = formats.encoding_of(None, x.device)
    return formats.quantize(x, fmt.block(x.dim(), reduce_dim), encoding, fmt.power_of_two)


def _quantize_sample(r: Routing) -> tuple[Any, ...]:
    """A row operand (even seeds) or, as the FP8 recipes pass them, an expert matrix's
    transposed view (odd seeds: the transpose-quantize, its own strides)."""
    if r.scenario.seed % 2 == 0:
        return (r.x, 1, _format(r), None)
    return (r.expert_weights.transpose(1, 2), 2 if not r.scenario.trans_b else 1, _format(r), None)


#: The one format that defines a weight gradient's operands (Format.grouped_columns).
ROWWISE = "fp8_rowwise"


def _transposed(r: Routing, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x quantized as a weight gradient's operand (rowwise, the one format that defines it), by
    the core's definition."""
    sizes = r.batch_sizes.tolist()
    encoding = formats.encoding_of(None, x.device)
    return formats.quantize_transposed(x, sizes, encoding, formats.FORMATS[ROWWISE].power_of_two)


def _matrix_sum_dim(r: Routing) -> int:
    return 2 if r.scenario.trans_b else 1


#: Op → its kernel-order arguments in a scenario. The only per-op table of the kit;#: Op → its kernel-order arguments in a scenario. The only per-op table of the kit;
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
        *_clamp(r, _row_activation(r)),
    ),
    "quantize": _quantize_sample,
    # A weight as the layer stores it (even seeds) or a transposed view of one (odd seeds).
    "quantize_both_ways": lambda r: (
        r.expert_weights if r.scenario.seed % 2 == 0 else r.expert_weights.transpose(1, 2),
        _format(r),
        None,
    ),
    # The rows (even seeds) or the output gradient (odd seeds) of a weight gradient.
    "quantize_transposed": lambda r: (
        r.rows if r.scenario.seed % 2 == 0 else r.gmm_grad,
        r.batch_sizes,
        ROWWISE,
        None,
    ),
    # gather_gmm's rows (x), or gmm_scatter's weighted output-gradient rows (grad and the
    # weights of a weighted scenario), read through the indices.
    "gather_quantize_transposed": lambda r: (
        r.x if r.scenario.seed % 2 == 0 else r.grad,
        r.indices,
        r.weights,
        r.scenario.top_k,
        r.batch_sizes,
        r.row_count,
        ROWWISE,
        None,
    ),
    "scaled_gmm_weight_grad": lambda r: (
        *_transposed(r, r.rows),
        *_transposed(r, r.gmm_grad),
        r.batch_sizes,
        ROWWISE,
        _out_dtype(r),
    ),
    "scaled_gmm": lambda r: (
        *_quantized(r, r.rows, 1),
        *_quantized(r, r.expert_weights, _matrix_sum_dim(r)),
        r.batch_sizes,
        r.scenario.trans_b,
        _format(r),
        _out_dtype(r),
        _bias(r, r.scenario.ffn_size, every_other_pair=True),
    ),
    "scaled_gather_gmm": lambda r: (
        *_quantized(r, r.x, 1),
        *_quantized(r, r.expert_weights, _matrix_sum_dim(r)),
        r.indices,
        r.bin_ids,
        r.bins,
        r.scenario.top_k,
        r.scenario.trans_b,
        r.row_count,
        _format(r),
        _out_dtype(r),
        _bias(r, r.scenario.ffn_size, every_other_pair=True),
    ),
    "scaled_gmm_scatter": lambda r: (
        *_quantized(r, r.first(r.gmm_grad), 1),
        *_quantized(r, r.expert_weights.transpose(1, 2).contiguous(), _matrix_sum_dim(r)),
        r.indices,
        r.bin_ids,
        r.weights,
        r.bins,
        r.scenario.top_k,
        r.scenario.trans_b,
        r.row_count,
        _format(r),
        _out_dtype(r),
        _bias(r, r.scenario.hidden, every_other_pair=True),
    ),
    # The gated unit, its activation (or none) taken in turn by seed.
    "glu": lambda r: (r.gate_up, _activation(r), *_clamp(r, _activation(r))),
    "glu_backward": lambda r: (r.gmm_grad, r.gate_up, _activation(r), *_clamp(r, _activation(r))),
    # An expert MLP's activation in backward: the gate half of gate_up as the pre-activation rows
    # (a strided view) or all of it for a gated activation, the rows' top-k weights as scale.
    "activation_backward": lambda r: (
        r.gmm_grad,
        _row_input(r, r.gate_up[:, : r.scenario.ffn_size], _BACKWARD_SHIFT),
        r.weights,
        _row_activation(r, _BACKWARD_SHIFT),
        *_clamp(r, _row_activation(r, _BACKWARD_SHIFT)),
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
