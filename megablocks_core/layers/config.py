"""The options of :class:`megablocks_core.layers.DroplessMoE`, in one record: :class:`MoEConfig`.

MegaBlocks keeps every layer option in one dataclass, ``megablocks.layers.arguments.Arguments``,
and its layers take that record; this module is the same idea for this layer. Each field keeps
the name the layer's constructor gave it (the MegaBlocks name it stands for is in its
documentation: ``num_experts`` is ``moe_num_experts``, ``top_k`` is ``moe_top_k``, ...), has its
default and is documented where it is declared. The record checks itself when it is made
(``__post_init__``), so a :class:`MoEConfig` that exists is one the layer can be built from, and
:func:`dataclasses.replace` checks the new one again. The checks are the only validation of the
layer's options: ``DroplessMoE(hidden_size=..., ...)`` builds a record from its keywords.

Errors name the layer (``megablocks_core.layers.dMoE: <field> must be ...``): TypeError for a
wrong type (a bool included where an int or a number is asked for), ValueError for a wrong value.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..activations import ACTIVATIONS, GATED
from ..fp8 import Recipe, recipe_of
from ..schema import FLOAT_DTYPES

if TYPE_CHECKING:
    import torch.distributed as dist

#: How the layer's errors name it.
_LAYER = "megablocks_core.layers.dMoE"

#: The parameter dtypes the ops take, for the messages.
_DTYPE_NAMES = ", ".join(sorted(map(str, FLOAT_DTYPES)))


def _got(value: object) -> str:
    return f"{value!r} ({type(value).__name__})"


def _check_int(
    name: str, value: object, low: int, high: int | None = None, bounds: str = ""
) -> None:
    """``value`` is an int in [low, high] (no upper bound for None); a bool is refused (True would
    pass as 1). ``bounds`` replaces the range in the message."""
    bounds = bounds or (f">= {low}" if high is None else f"in [{low}, {high}]")
    message = f"{_LAYER}: {name} must be an int {bounds}; got {_got(value)}"
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(message)
    if value < low or (high is not None and value > high):
        raise ValueError(message)


def _check_number(name: str, value: object, requirement: str, ok: Callable[[float], bool]) -> None:
    """``value`` is an int or float (not a bool) for which ``ok`` holds."""
    message = f"{_LAYER}: {name} must be {requirement}; got {_got(value)}"
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(message)
    if not ok(value):
        raise ValueError(message)


def _finite_non_negative(value: float) -> bool:
    # An int is always finite (math.isfinite would overflow on a huge one).
    return value >= 0 and (isinstance(value, int) or math.isfinite(value))


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):  # 0/1 or a tensor would be read as a truth value
        raise TypeError(f"{_LAYER}: {name} must be a bool (True or False); got {_got(value)}")


def _check_init(std: object, seed: object) -> None:
    """The initialisation's arguments (the record's ``init_std`` and ``seed``, and those of
    ``DroplessMoE.reset_parameters``)."""
    _check_number("init_std", std, "a finite number >= 0", _finite_non_negative)
    # torch.Generator.manual_seed's range.
    _check_int("seed", seed, -(1 << 63), (1 << 64) - 1, "in [-2**63, 2**64)")


def _gated_hint(name: str) -> str:
    """What to ask the layer for instead of a gated unit's name (only what it takes)."""
    if name not in GATED:
        return ""
    gate = GATED[name]
    if gate is None:  # the bilinear unit: gate * up
        return " (gated experts: glu=True with the identity as a callable activation)"
    if gate in ACTIVATIONS:
        return f" (gated experts: glu=True with activation={gate!r})"
    # GPT-OSS's unit and the interleaved layouts are ops' names (ops.glu, ops.gmm_scatter).
    return (
        " (a gated unit the layer does not offer: its gated experts, glu=True, hold gate and "
        "up side by side and take one of the activations above)"
    )


def _check_activation(activation: object) -> None:
    requirement = f"one of {sorted(ACTIVATIONS)} or a callable"
    if isinstance(activation, str):
        if activation not in ACTIVATIONS:
            raise ValueError(
                f"{_LAYER}: activation must be {requirement}; got {activation!r}"
                f"{_gated_hint(activation)}"
            )
    elif not callable(activation):
        raise TypeError(f"{_LAYER}: activation must be {requirement}; got {_got(activation)}")


def _check_dtype(dtype: object) -> None:
    if dtype is None:
        return
    message = f"{_LAYER}: dtype must be a floating torch.dtype ({_DTYPE_NAMES}) or None"
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{message}; got {_got(dtype)}")
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"{message}; got {dtype}")


def _check_device(device: object) -> None:
    if device is None:
        return
    requirement = "a torch.device, a device string such as 'cuda:0', a CUDA device index or None"
    if isinstance(device, bool) or not isinstance(device, str | int | torch.device):
        raise TypeError(f"{_LAYER}: device must be {requirement}; got {_got(device)}")
    try:
        torch.device(device)
    except RuntimeError as error:
        raise ValueError(
            f"{_LAYER}: device must be {requirement}; got {_got(device)}: {error}"
        ) from error


def _check_expert_parallelism(
    group: object, num_experts: int, chunks: object, dispatch: object
) -> None:
    from .parallel import DISPATCHES

    if chunks is not None:
        _check_int("expert_parallel_chunks", chunks, 1, bounds=">= 1 or None")
    requirement = f"one of {DISPATCHES}"
    if not isinstance(dispatch, str):
        raise TypeError(
            f"{_LAYER}: expert_parallel_dispatch must be {requirement}; got {_got(dispatch)}"
        )
    if dispatch not in DISPATCHES:
        raise ValueError(
            f"{_LAYER}: expert_parallel_dispatch must be {requirement}; got {dispatch!r}"
        )
    if dispatch == "allgather" and chunks not in (None, 1):
        raise ValueError(
            f"{_LAYER}: expert_parallel_dispatch='allgather' runs in one piece; "
            f"expert_parallel_chunks must be None or 1; got {_got(chunks)}"
        )
    if group is None:
        return
    import torch.distributed as dist  # only expert parallelism needs it

    if not (dist.is_available() and isinstance(group, dist.ProcessGroup)):
        raise TypeError(
            f"{_LAYER}: expert_parallel_group must be a torch.distributed.ProcessGroup or None; "
            f"got {_got(group)}"
        )
    world = dist.get_world_size(group)
    if num_experts % world:
        raise ValueError(
            f"{_LAYER}: num_experts={num_experts} is not divisible by the expert_parallel_group's "
            f"size {world}"
        )


@dataclass(frozen=True)
class MoEConfig:
    """Every option of a :class:`~megablocks_core.layers.DroplessMoE`, checked when made.

    ``MoEConfig(hidden_size, ffn_hidden_size, num_experts, top_k=1, *, ...)``: the four sizes may
    be given by position (the layer constructor's order), every other field by keyword. Frozen:
    derive a variant with ``dataclasses.replace(config, seed=1)`` (checked again).

    Example: Mixtral 8x7B's MoE layer in bfloat16::

        MoEConfig(4096, 14336, 8, 2, glu=True, activation="silu", dtype=torch.bfloat16)
    """

    hidden_size: int
    """Model width, the last dimension of the layer's input (MegaBlocks' ``hidden_size``). An
    int >= 1, e.g. 4096."""

    ffn_hidden_size: int
    """Width of each expert's MLP (MegaBlocks' ``ffn_hidden_size``). An int >= 1, e.g. 14336."""

    num_experts: int
    """Number of experts E (MegaBlocks' ``moe_num_experts``). An int >= 1, e.g. 8."""

    top_k: int = 1
    """Experts per token, an int in [1, num_experts] (MegaBlocks' ``moe_top_k``), e.g. 2."""

    _: KW_ONLY

    glu: bool = False
    """Gated experts, ``act(x @ gate) * (x @ up) @ w2`` (MegaBlocks' ``mlp_type="glu"``, whose
    ``w1`` and ``v1`` are the gate and up here); with ``activation="silu"`` this is SwiGLU (Llama,
    Mixtral, Qwen3-MoE, DeepSeek-V3). The two projections are one parameter, ``w1`` of
    ``(E, hidden, 2 * ffn)`` with the gate in ``w1[..., :ffn]`` and up in ``w1[..., ffn:]``, so
    that one grouped GEMM computes both and ``ops.glu`` combines them in one pass.
    ``load_state_dict`` also takes the two apart, as ``w1`` and ``v1`` of ``(E, hidden, ffn)``
    each (joined on load)."""

    activation: str | Callable[[Tensor], Tensor] = "gelu"
    """Expert activation (MegaBlocks' ``activation_fn``): ``"gelu"`` (tanh approximation; the
    default, as MegaBlocks; also named ``"gelu_tanh"``), ``"gelu_erf"`` (the exact GELU, torch's
    and transformers' ``"gelu"``), ``"silu"``, ``"relu"``, or any callable. With a named
    activation the experts keep only the first GEMM's output for backward (gated experts: both
    projections and their product) and recompute the activation there."""

    normalize_expert_weights: float | None = None
    """If set, each token's top-k weights are divided by their p-norm with this p, a number > 0
    (``math.inf`` allowed; MegaBlocks' ``moe_normalize_expert_weights``): 1 makes them sum to 1.
    None (default): the softmax weights as they are."""

    load_balancing_loss_coefficient: float = 0.01
    """Weight of the load-balancing loss that ``forward`` returns, a finite number >= 0
    (MegaBlocks' ``moe_loss_weight``); 0 disables the loss."""

    block_size: int = 128
    """Padding granularity passed to ``ops.route``, an int >= 1 (only its ``padded_bins`` use
    it, which this grouped layer ignores)."""

    init_std: float = 0.02
    """Parameters are drawn from N(0, init_std²), a finite number >= 0: MegaBlocks' default
    ``init_method`` (std 0.02) for the router and both expert matrices."""

    seed: int = 0
    """Initialisation seed, an int in [-2**63, 2**64) (the same values across runs and devices):
    the router's CPU generator's, and each expert's through
    :func:`megablocks_core.layers.moe.expert_seed` (see ``DroplessMoE.reset_parameters``)."""

    dtype: torch.dtype | None = None
    """The parameters' dtype: bfloat16, float16, float32 or float64; None: torch's default
    (MegaBlocks' ``fp16``/``bf16`` flags)."""

    device: torch.device | str | int | None = None
    """The parameters' device: a ``torch.device``, a device string such as ``"cuda:0"``, a CUDA
    device index, or None for torch's default (MegaBlocks' ``device``). ``"meta"`` allocates
    nothing (fill such a layer with ``to_empty`` and loaded values)."""

    expert_parallel_group: dist.ProcessGroup | None = None
    """A ``torch.distributed`` process group of W ranks over which the experts are sharded
    (``num_experts % W == 0``; MegaBlocks' ``expert_parallel_group`` with
    ``moe_expert_model_parallelism``): rank r of the group holds experts
    ``[r * E/W, (r + 1) * E/W)`` only (``w1`` and ``w2`` have E/W rows), the router is
    replicated. None (default): one process holds every expert. With the same seed, every rank's
    parameters are the matching slices of the single-process layer's."""

    fuse_permutation: bool = True
    """True (default): ``gather_gmm`` and ``gmm_scatter`` (no (tokens * top_k, hidden) tensor
    written or kept). False: ``gather``, ``gmm`` and ``scatter`` as separate ops, MegaBlocks'
    dataflow, which keeps the gathered tokens and the expert outputs for backward; for
    comparison (expert parallelism has its own exchange)."""

    expert_parallel_chunks: int | None = None
    """Token chunks whose exchanges overlap the experts of the others, an int >= 1 (1: no
    overlap; the same on every rank of the group). None (default):
    ``megablocks_core.layers.parallel.DEFAULT_CHUNKS`` (1); ``"allgather"`` dispatch takes only
    None or 1. See :func:`megablocks_core.layers.parallel.expert_parallel_moe`."""

    grad_accumulation_fusion: bool = False
    """Opt the expert weights (``w1``, ``w2``) in to gradient-accumulation fusion
    (:func:`megablocks_core.fuse_grad_accumulation`): when a backward finds an expert weight's
    gradient already there (every micro-batch after the first of a step that accumulates
    gradients), its weight-gradient GEMM adds into it, or into the weight's ``main_grad`` when it
    has one (Megatron-LM's convention, e.g. float32 for 16-bit weights, which then get no
    ``.grad``), instead of autograd adding a fresh (E, ·, ·) gradient in a separate pass. Off by
    default because autograd's accumulation is bypassed for those weights: their
    ``register_hook`` hooks get None, and DDP/FSDP reducers are not supported. Both dataflows
    (``fuse_permutation``) honour it; it has no effect with an ``expert_parallel_group`` (whose
    backward takes the expert gradients through ``torch.autograd.grad``) or under
    ``torch.compile``. Settable later on the layer: ``layer.grad_accumulation_fusion = True``."""

    fp8: Recipe | str | None = None
    """Run the expert GEMMs in FP8 (:mod:`megablocks_core.fp8`): a
    :class:`megablocks_core.fp8.Recipe` or a format name (``"fp8_rowwise"``,
    ``"fp8_blockwise"``: that format, the recipe's defaults otherwise); None (default): in the
    weights' dtype. The weights stay in their dtype (the master copy) and are quantized per call
    (``Recipe.cache_weights`` keeps the quantized copy while a weight is unchanged, except under
    ``torch.compile``, where every call quantizes them); the tokens
    are quantized once each, the activated rows once per (token, expert) pair, and the
    backward's data gradients run in FP8 too unless ``Recipe(backward="input")``. Weight
    gradients stay in the weights' dtype unless ``Recipe(weight_grad="fp8")`` (rowwise)."""

    expert_parallel_dispatch: str = "alltoall"
    """How tokens reach the experts' ranks, one of ``("alltoall", "allgather")``. ``"alltoall"``
    (default): each token goes once to each rank holding one of its top-k experts, with one host
    sync per call for the split sizes. ``"allgather"``: every rank gathers every rank's tokens,
    runs its experts on them and a reduce-scatter sums the outputs back: no host sync
    (CUDA-graph friendly), about as many bytes as ``"alltoall"`` on 2 ranks but W - 1 rows per
    token on W ranks; every rank of the group must pass the same number of tokens (checked only
    with ``MEGABLOCKS_CHECK=1``). See :mod:`megablocks_core.layers.parallel`."""

    def __post_init__(self) -> None:
        _check_config(self)


def _check_config(config: MoEConfig) -> None:
    """Every field of ``config``, before anything is allocated: TypeError for a wrong type,
    ValueError for a wrong value, each naming the field."""
    for name, size in (
        ("hidden_size", config.hidden_size),
        ("ffn_hidden_size", config.ffn_hidden_size),
        ("num_experts", config.num_experts),
    ):
        _check_int(name, size, 1)
    num_experts = config.num_experts
    _check_int("top_k", config.top_k, 1, num_experts, f"in [1, num_experts={num_experts}]")
    for name, flag in (
        ("glu", config.glu),
        ("fuse_permutation", config.fuse_permutation),
        ("grad_accumulation_fusion", config.grad_accumulation_fusion),
    ):
        _check_bool(name, flag)
    _check_activation(config.activation)
    try:
        recipe_of(config.fp8)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{_LAYER}: fp8: {exc}") from None
    if config.normalize_expert_weights is not None:
        _check_number(
            "normalize_expert_weights",
            config.normalize_expert_weights,
            "the p of a p-norm, a number > 0 (math.inf allowed), or None",
            lambda p: p > 0,  # NaN fails it too
        )
    _check_number(
        "load_balancing_loss_coefficient",
        config.load_balancing_loss_coefficient,
        "a finite number >= 0",
        _finite_non_negative,
    )
    _check_int("block_size", config.block_size, 1)
    _check_init(config.init_std, config.seed)
    _check_dtype(config.dtype)
    _check_device(config.device)
    _check_expert_parallelism(
        config.expert_parallel_group,
        num_experts,
        config.expert_parallel_chunks,
        config.expert_parallel_dispatch,
    )


__all__ = ["MoEConfig"]
