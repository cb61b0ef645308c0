"""Grouped GEMM (MegaBlocks ``gmm`` semantics) as persistent Triton kernels.

The grouped GEMMs, called by the core with already-validated inputs:

* :func:`gmm` — ``out[rows of e] = a_e @ b[e]`` (or ``@ b[e].T`` with ``trans_b``).
* :func:`gmm_weight_grad` — ``out[e] = a_e.T @ grad_e`` (variable-K grouped GEMM);
  :func:`gmm_weight_grad_accumulate` — ``out[e] += a_e.T @ grad_e`` in place, the same kernel
  with the existing gradient added in its epilogue (gradient-accumulation fusion).

Design
------
Both kernels are *persistent*: the grid is (about) one program per SM/CU and each program walks
the flat list of output tiles of all experts with a stride of the grid size. The group offsets are
never copied to the host: every program loads ``batch_sizes`` (E values, a few hundred bytes, L2
resident) once, builds the per-expert tile-count prefix in registers with ``tl.cumsum`` and maps
each tile id to ``(expert, m-tile, n-tile)`` with a vector compare + reduction. That keeps the
whole op at a single kernel launch with no host sync (CUDA-graph friendly) and lets many small
experts (E=128..256, a few hundred rows each) share all SMs instead of one launch/loop per expert.

``gmm``: the tile space of expert e is ``cdiv(size_e, BLOCK_M) x cdiv(N, BLOCK_N)``; the last
M-tile of a group straddles the group end. Rows past the group end are *clamped* to the group's
last row for loading (so no row mask on the loads and no read outside the group) and masked on the
store; the contiguous dims (K, N) are masked, which keeps 16-byte vector/cp.async loads. ``gmm_weight_grad``: every expert owns the same ``cdiv(K, BLOCK_M) x cdiv(N, BLOCK_N)``
tiles; the reduction runs over the expert's rows, masked (``other=0``) on both operands so rows
beyond the group end are neither read nor accumulated, and an empty group stores exact zeros.

The default path uses only plain ``tl.load``/``tl.dot`` with masks (portable: NVIDIA, AMD, the
interpreter). An optional path (``GmmConfig.use_tma``) loads tiles through TMA tensor
descriptors on Hopper/Blackwell; it is the default there for the forward ops' 16-bit inputs and,
on Hopper, for the accumulating weight gradient into a 16-bit gradient, whose epilogue then reads
and writes the gradient's tile through a descriptor too (measured on the H200,
docs/performance.md). A short forward K loop is flattened into the persistent tile loop
(``GmmConfig.flatten``) so the next tile's loads overlap the previous tile's epilogue. fp32 inputs use ``input_precision="ieee"`` (no TF32) so results track a float64 reference.
On Hopper the weight gradients have a second kernel, warp-specialized and written in Gluon
(:mod:`megablocks_triton.hopper_wgrad`: a loader warp that runs ahead across tiles), with the
same tiles and results bit for bit. It is a declared variant of its own (``triton/gluon-hopper``:
:func:`gmm_weight_grad_warp_specialized`, :func:`gmm_weight_grad_accumulate_warp_specialized`,
its predicates :func:`warp_specialized_capability` and :func:`warp_specialized_problem`), taking
the calls the launch policy measured it faster for (``GmmConfig.warp_specialized``); the plain
kernels never run it.

The forward ops (``gmm``, ``gather_gmm``, ``gmm_scatter``) prepare their launch once per call
shape (tile config, grid, scalars, constexprs, the TMA block shapes) and keep it with the
compiled kernel pinned (:mod:`megablocks_triton.launch`), so an eager call costs an output
allocation and a native launch; the TMA descriptors of a pinned launch are encoded once per
address (the expert weights' stay the same from call to call).

Tile configs come from the launch policy (:meth:`megablocks_triton.config.LaunchConfigs.gmm`, which
a vendor plugin may override) through :func:`choose_config`; they can be overridden per call
(``config=``) or by environment variable for tuning, see :func:`choose_config`.

This module is the forward ops' host side (per-shape plans, the op functions); the tile configs
and operand helpers are :mod:`megablocks_triton.gmm_configs`, the weight gradients (with the
Gluon variant's predicates) :mod:`megablocks_triton.gmm_wgrad`, whose names the plugin's
declarations and the tests read re-exported here; the ``@triton.jit`` kernels are
:mod:`megablocks_triton.kernels.gmm`, and ``_gmm_kernel`` is imported here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from megablocks_core.plugin import GATED_ACTIVATIONS, clamp_constants, contract

from .activation import _unit as activation_unit
from .config import GmmConfig, LaunchConfigs, TokenGmmConfig, launch_configs
from .gmm_configs import (
    MAX_EXPERTS,
    _check_experts,
    _device_sizes,
    _num_sms,
    _tma_layout_ok,
    _unit_last_stride,
    choose_config,
    device_info,
)
from .gmm_wgrad import WARP_SPECIALIZED_DTYPES as WARP_SPECIALIZED_DTYPES
from .gmm_wgrad import WARP_SPECIALIZED_VARIANT as WARP_SPECIALIZED_VARIANT
from .gmm_wgrad import _hopper_wgrad as _hopper_wgrad
from .gmm_wgrad import _warp_specialized as _warp_specialized
from .gmm_wgrad import (
    gmm_weight_grad,
    gmm_weight_grad_accumulate,
    gmm_weight_grad_accumulate_warp_specialized,
    gmm_weight_grad_warp_specialized,
    warp_specialized_capability,
    warp_specialized_problem,
)
from .gmm_wgrad import gmm_weight_grad_accumulate_supports as gmm_weight_grad_accumulate_supports
from .gmm_wgrad import gmm_weight_grad_supports as gmm_weight_grad_supports
from .kernels.gmm import _gmm_kernel
from .kernels.token_gmm import _token_gmm_scatter_kernel
from .launch import BoundLaunch, bind, bind_descriptors, cdiv, next_power_of_2, remember

__all__ = [
    "MAX_EXPERTS",
    "GmmConfig",
    "choose_config",
    "device_info",
    "gather_gmm",
    "gmm",
    "gmm_scatter",
    "gmm_weight_grad",
    "gmm_weight_grad_accumulate",
    "gmm_weight_grad_accumulate_warp_specialized",
    "gmm_weight_grad_warp_specialized",
    "warp_specialized_capability",
    "warp_specialized_problem",
]


# --------------------------------------------------------------------------------------------
# The forward (gmm, gather_gmm, gmm_scatter): one launch of _gmm_kernel, prepared per call shape
# --------------------------------------------------------------------------------------------

#: ``plan(a, b, sizes, indices, bias)``: the (m, n) output (bias None or (E, n)).
Forward = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor
]


class _ForwardPlan:
    """One call shape's ``_gmm_kernel`` launch, prepared once (tile config, grid, scalars and
    constexprs; the compiled kernel is pinned by :mod:`.launch`): ``plan(a, b, sizes, indices,
    bias)`` allocates the (m, n) output and launches. With a TMA config it takes the descriptor
    variant when the operands it reads through descriptors are 16-byte aligned, else the plain
    one (both as the call would have chosen without a plan). A plan made for a bias
    (``HAS_BIAS``) adds it in the epilogue; one made without passes ``sizes`` in its slot."""

    __slots__ = ("config", "plain", "shape", "tma", "tma_reads_a")

    def __init__(
        self,
        config: GmmConfig,
        shape: tuple[int, int],
        plain: BoundLaunch,
        tma: BoundLaunch | None,
        tma_reads_a: bool,
    ) -> None:
        self.config = config
        self.shape = shape
        self.plain = plain
        self.tma = tma
        self.tma_reads_a = tma_reads_a

    def __call__(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        sizes: torch.Tensor,
        indices: torch.Tensor,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        out = a.new_empty(self.shape)
        tma = self.tma
        biased = sizes if bias is None else bias
        if tma is not None and not (b.data_ptr() | (a.data_ptr() if self.tma_reads_a else 0)) & 15:
            tma(a, b, out, sizes, indices, biased)
        else:
            self.plain(a, b, out, sizes, indices, biased)
        return out


@functools.cache
def _served_bias() -> Callable[..., torch.Tensor]:
    """The core's own addition of a bias to rows grouped by cumulative ends (gather_gmm's
    ``serve(arguments by name, out)``): for products no bias epilogue made (an empty K's, which
    no launch makes; the scaled GEMMs' Gluon kernel's). Looked up once."""
    serve: Callable[..., torch.Tensor] = getattr(  # noqa: B009 (Arg has no serve)
        contract("gather_gmm").arg("bias"), "serve"
    )
    return serve


def add_grouped_bias(
    out: torch.Tensor, bias: torch.Tensor, sizes: torch.Tensor, from_ends: bool
) -> torch.Tensor:
    """out with bias[e] added to each row of group e by the core's own addition, for the
    products no bias epilogue made; ``sizes`` are the groups' sizes, or their ends
    (``from_ends``)."""
    ends = sizes if from_ends else sizes.cumsum(0)
    return _served_bias()({"bias": bias, "bins": ends}, out)


def _bias_only(
    shape: tuple[int, int], from_ends: bool
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """The plan of an empty K with a bias: each grouped row is its expert's bias, the others 0."""

    def run(
        a: torch.Tensor,
        b: torch.Tensor,
        sizes: torch.Tensor,
        indices: torch.Tensor,
        bias: torch.Tensor,
    ) -> torch.Tensor:
        return add_grouped_bias(a.new_zeros(shape), bias, sizes, from_ends)

    return run


def _forward_plan(
    configs: LaunchConfigs,
    a: torch.Tensor,
    b: torch.Tensor,
    trans_b: bool,
    m: int,
    gather_top_k: int | None,
    from_ends: bool,
    config: GmmConfig | None,
    zero_tail: bool = True,
    bias_stride: int | None = None,
) -> Forward:
    """The launch of an (m, n) grouped GEMM of a (its token rows, read through the indices, with
    ``gather_top_k``) by b; group sizes are counts, or cumulative ends (``from_ends``). Rows no
    group covers are zeros, or (not ``zero_tail``) left unwritten. ``bias_stride``: the plan
    adds a per-expert bias (E, n) whose rows are that many elements apart (None: no bias)."""
    k = a.shape[1]
    num_experts = b.shape[0]
    n = b.shape[1] if trans_b else b.shape[2]
    shape = (m, n)
    if m == 0 or n == 0:
        return lambda a, b, sizes, indices, bias: a.new_empty(shape)
    if k == 0:
        if bias_stride is not None:
            return _bias_only(shape, from_ends)  # type: ignore[return-value]
        return lambda a, b, sizes, indices, bias: a.new_zeros(shape)
    block_e = _check_experts(num_experts)
    info = device_info(a.device)
    cfg = config or choose_config("gmm", m, n, k, num_experts, a.dtype, info)
    gather = gather_top_k is not None
    # b[e] viewed as (K, N): for trans_b the (N, K) storage is read with swapped strides.
    stride_bk, stride_bn = (b.stride(2), b.stride(1)) if trans_b else (b.stride(1), b.stride(2))
    n_tiles = cdiv(n, cfg.block_n)
    # Host-side upper bound on the tile count (no sync): each non-empty group adds <= 1 partial
    # tile, and so may the rows no group covers (bad device-side batch_sizes).
    max_tiles = (m // cfg.block_m + min(num_experts, m) + 1) * n_tiles
    grid = (max(1, min(_num_sms(info) * cfg.programs_per_sm, max_tiles)),)
    scalars = (
        m, n, k, num_experts, gather_top_k if gather else 1,
        a.shape[0] * gather_top_k if gather_top_k is not None else m,  # ids a row may name
        a.stride(0), a.stride(1),
        b.stride(0), stride_bk, stride_bn,
        n, 1,  # the contiguous (m, n) output's strides
        bias_stride or 0,
    )  # fmt: skip
    kw = {
        "BLOCK_M": cfg.block_m,
        "BLOCK_N": cfg.block_n,
        "BLOCK_K": cfg.block_k,
        "BLOCK_E": block_e,
        "GROUP_M": cfg.group_m,
        "EVEN_K": k % cfg.block_k == 0,
        "IEEE_FP32": a.dtype == torch.float32,
        "TRANS_B": trans_b,
        "GATHER": gather,
        "FROM_ENDS": from_ends,
        "FLATTEN": cfg.flatten,
        "ZERO_TAIL": zero_tail,
        "HAS_BIAS": bias_stride is not None,
        "num_warps": cfg.num_warps,
        "num_stages": cfg.num_stages,
        **configs.launch_options("gmm"),
    }
    plain = bind(_gmm_kernel, grid, *scalars, USE_TMA=False, **kw)
    tma: BoundLaunch | None = None
    # Gathered rows cannot come through a TMA descriptor (no row gather before Blackwell): then
    # only b does.
    if cfg.use_tma and _tma_layout_ok(info, b) and (gather or _tma_layout_ok(info, a)):
        b_block = [1, cfg.block_n, cfg.block_k] if trans_b else [1, cfg.block_k, cfg.block_n]
        blocks = {1: b_block} if gather else {0: [cfg.block_m, cfg.block_k], 1: b_block}
        tma = bind_descriptors(_gmm_kernel, grid, *scalars, descriptors=blocks, USE_TMA=True, **kw)
    return _ForwardPlan(cfg, shape, plain, tma, tma_reads_a=not gather)


#: Per call shape, launch policy and config override: the prepared forward launches.
_FORWARD_PLANS: dict[Any, Forward] = {}
_GMM_SCATTER_PLANS: dict[Any, Callable[..., torch.Tensor]] = {}


@functools.cache
def _activate() -> Callable[..., torch.Tensor]:
    """gmm_scatter's activation of x's rows, as the core applies it for a kernel that does not
    take one (the dispatched activation ops: a transient copy), ``apply(x, name, alpha, limit)``.
    Looked up once."""
    apply: Callable[..., torch.Tensor] = getattr(  # noqa: B009 (Arg has no apply)
        contract("gmm_scatter").arg("activation"), "apply"
    )
    return apply


def _planned(
    a: torch.Tensor,
    b: torch.Tensor,
    sizes: torch.Tensor,
    indices: torch.Tensor,
    trans_b: bool,
    m: int,
    gather_top_k: int | None,
    from_ends: bool,
    config: GmmConfig | None,
    bias_stride: int | None,
) -> Forward:
    """The prepared launch for this call shape (made on first use). The key holds everything
    the launch's scalars, constexprs and compiled kernel depend on: shapes, strides and dtypes
    of every operand (the sizes' and indices' dtypes too; a bias has a's), the device and the
    policy."""
    configs = launch_configs()
    key = (
        a.shape, a.stride(), a.dtype, a.device, b.shape, b.stride(), b.dtype,
        sizes.dtype, indices.dtype, m, trans_b, gather_top_k, from_ends, config, configs,
        bias_stride,
    )  # fmt: skip
    plan = _FORWARD_PLANS.get(key)
    if plan is None:
        made = _forward_plan(
            configs, a, b, trans_b, m, gather_top_k, from_ends, config, bias_stride=bias_stride
        )
        plan = remember(_FORWARD_PLANS, key, made)
    return plan


def _bias_layout(bias: torch.Tensor | None) -> tuple[torch.Tensor | None, int | None]:
    """The bias as the kernel reads it (unit column stride) and its row stride (None: none)."""
    if bias is None:
        return None, None
    bias = _unit_last_stride(bias)
    return bias, bias.stride(0)


def gmm(
    a: torch.Tensor,
    b: torch.Tensor,
    batch_sizes: torch.Tensor,
    trans_b: bool = False,
    bias: torch.Tensor | None = None,
    *,
    config: GmmConfig | None = None,
) -> torch.Tensor:
    """Grouped GEMM: rows ``[off_e, off_e + batch_sizes[e])`` of the result are ``a_e @ b[e]``
    (``a_e @ b[e].T`` when ``trans_b``), plus ``bias[e]`` when given (added to the fp32
    accumulator in the epilogue, one rounding). a (M, K); b (E, K, N), or (E, N, K) with
    trans_b; sum(batch_sizes) == M. Returns (M, N) in a's dtype, fp32 accumulation. No host sync.

    Device-side batch_sizes that break the contract (unchecked unless MEGABLOCKS_CHECK=1) are
    made safe in the kernel: negative sizes count as 0, groups are cut at row M, and rows no
    group covers come out 0."""
    a = _unit_last_stride(a)
    b = _unit_last_stride(b)
    bias, bias_stride = _bias_layout(bias)
    sizes = _device_sizes(batch_sizes, a.device)
    plan = _planned(a, b, sizes, sizes, trans_b, a.shape[0], None, False, config, bias_stride)
    return plan(a, b, sizes, sizes, bias)


def gather_gmm(
    x: torch.Tensor,
    b: torch.Tensor,
    indices: torch.Tensor,
    bin_ids: torch.Tensor,
    bins: torch.Tensor,
    top_k: int,
    trans_b: bool = False,
    rows: int | None = None,
    bias: torch.Tensor | None = None,
    *,
    config: GmmConfig | None = None,
) -> torch.Tensor:
    """``gmm(gather(x, indices, ...), b, counts, bias)`` reading each row of A from x in place:
    sorted row i is ``x[indices[i] // top_k] @ b[e]`` (plus ``bias[e]``, in the epilogue),
    groups from bins (cumulative), for the first ``rows`` sorted rows (all when None). No
    gathered copy of x is written; ids outside [0, tokens * top_k) give zero products."""
    x = _unit_last_stride(x)
    b = _unit_last_stride(b)
    bias, bias_stride = _bias_layout(bias)
    if not bins.is_contiguous():
        bins = bins.contiguous()
    m = indices.shape[0] if rows is None else rows
    plan = _planned(x, b, bins, indices, trans_b, m, int(top_k), True, config, bias_stride)
    return plan(x, b, bins, indices, bias)


def gmm_scatter(
    x: torch.Tensor,
    b: torch.Tensor,
    indices: torch.Tensor,
    bin_ids: torch.Tensor,
    weights: torch.Tensor | None,
    bins: torch.Tensor,
    top_k: int,
    trans_b: bool = False,
    activation: str | None = None,
    rows: int | None = None,
    bias: torch.Tensor | None = None,
    alpha: float | None = None,
    limit: float | None = None,
) -> torch.Tensor:
    """``scatter(gmm(act(x), b, counts, bias), indices, bin_ids, weights, bins, top_k)``.

    Tiled (most calls): the activation (the contract's own, a transient copy), then the GEMM with
    its plain (TMA) stores and the bias in its epilogue, then the token-major scatter kernel that
    sums each token's rows once (reading its top_k rows, weighting and summing in fp32): no
    atomics, deterministic. A few tokens (:meth:`~megablocks_triton.config.LaunchConfigs.
    token_gmm_scatter`): all of it in one launch (:mod:`megablocks_triton.kernels.token_gmm`),
    with the same roundings. x may hold only the first ``rows`` sorted rows (the GEMM covers
    those, the scatter reads no other)."""
    x = _unit_last_stride(x)
    b = _unit_last_stride(b)
    bias, bias_stride = _bias_layout(bias)
    if not bins.is_contiguous():
        bins = bins.contiguous()
    configs = launch_configs()
    key = (
        x.shape, x.stride(), x.dtype, x.device, b.shape, b.stride(), b.dtype,
        indices.shape, indices.dtype, bins.shape, bins.dtype,
        None if weights is None else weights.dtype, top_k, trans_b, configs, bias_stride,
        activation, alpha, limit,
    )  # fmt: skip
    plan = _GMM_SCATTER_PLANS.get(key)
    if plan is None:
        made = _gmm_scatter_plan(
            configs, x, b, indices, bins, weights is not None, int(top_k), trans_b, bias_stride,
            activation, alpha, limit,
        )  # fmt: skip
        plan = remember(_GMM_SCATTER_PLANS, key, made)
    return plan(x, b, indices, weights, bins, bias)


def _gmm_scatter_plan(
    configs: LaunchConfigs,
    x: torch.Tensor,
    b: torch.Tensor,
    indices: torch.Tensor,
    bins: torch.Tensor,
    has_weights: bool,
    top_k: int,
    trans_b: bool,
    bias_stride: int | None,
    activation: str | None,
    alpha: float | None,
    limit: float | None,
) -> Callable[..., torch.Tensor]:
    """gmm_scatter's prepared launches for one call shape: the few-token kernel where the launch
    policy takes it, else the activation, the grouped GEMM into expert-sorted rows and the plain
    scatter of those rows (its plan taken once, for the rows' shape and dtype). Sorted rows past
    bins' groups (expert parallelism's pairs of other ranks' experts) are neither written by the
    GEMM nor read by the scatter: their products are 0 by the contract."""
    from .permutation import _scatter_plan

    depth = x.shape[1] // 2 if activation in GATED_ACTIVATIONS else x.shape[1]
    width = b.shape[1] if trans_b else b.shape[2]
    num_tokens = indices.shape[0] // top_k
    depth_contiguous = (b.stride(2) if trans_b else b.stride(1)) == 1
    shape = configs.token_gmm_scatter(
        num_tokens, top_k, depth, width, x.element_size(), depth_contiguous
    )
    if shape is not None:
        return _token_gmm_scatter_plan(
            configs, shape, x, b, indices, bins, has_weights, top_k, trans_b, bias_stride,
            activation, alpha, limit, depth, width,
        )  # fmt: skip
    # The activation's output: a new (rows, depth) tensor (allocated once here, for its layout).
    activated = x if activation is None else x.new_empty((x.shape[0], depth))
    gemm = _forward_plan(
        configs, activated, b, trans_b, x.shape[0], None, True, None, False,
        bias_stride=bias_stride,
    )  # fmt: skip
    sorted_rows = torch.empty((x.shape[0], width), dtype=x.dtype, device="meta")
    reduce = _scatter_plan(
        configs, sorted_rows, indices.numel(), bins.numel(), top_k, has_weights, grouped_rows=True
    )
    activate = _activate()

    def run(
        x: torch.Tensor,
        b: torch.Tensor,
        indices: torch.Tensor,
        weights: torch.Tensor | None,
        bins: torch.Tensor,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        if activation is not None:
            x = activate(x, activation, alpha, limit)
        return reduce(gemm(x, b, bins, bins, bias), indices, weights, bins)

    return run


def _token_gmm_scatter_plan(
    configs: LaunchConfigs,
    shape: TokenGmmConfig,
    x: torch.Tensor,
    b: torch.Tensor,
    indices: torch.Tensor,
    bins: torch.Tensor,
    has_weights: bool,
    top_k: int,
    trans_b: bool,
    bias_stride: int | None,
    activation: str | None,
    alpha: float | None,
    limit: float | None,
    depth: int,
    width: int,
) -> Callable[..., torch.Tensor]:
    """The few-token gmm_scatter: one launch per call, its scalars fixed here."""
    n = indices.shape[0]
    num_tokens = n // top_k
    gated = activation in GATED_ACTIVATIONS
    unit = GATED_ACTIVATIONS[activation] if activation is not None and gated else activation
    code, interleaved = activation_unit(unit)
    stride_bn, stride_bk = (b.stride(1), b.stride(2)) if trans_b else (b.stride(2), b.stride(1))
    launch = bind(
        _token_gmm_scatter_kernel,
        (num_tokens, cdiv(width, shape.block_n)),
        n, x.shape[0], bins.shape[0], depth, width,
        x.stride(0), b.stride(0), stride_bk, stride_bn, bias_stride or 0,
        *clamp_constants(activation, alpha, limit),
        TOP_K=top_k, K_PAD=next_power_of_2(top_k), SEARCH=next_power_of_2(n),
        BLOCK_E=next_power_of_2(bins.shape[0]), BLOCK_N=shape.block_n, BLOCK_K=shape.block_k,
        ACTIVATION=code, GATED=gated, INTERLEAVED=interleaved, HAS_WEIGHTS=has_weights,
        HAS_BIAS=bias_stride is not None, num_warps=shape.num_warps,
        **configs.launch_options("gmm"),
    )  # fmt: skip

    def run(
        x: torch.Tensor,
        b: torch.Tensor,
        indices: torch.Tensor,
        weights: torch.Tensor | None,
        bins: torch.Tensor,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        out = x.new_empty((num_tokens, width))
        # Absent weights and bias: the kernel reads neither (HAS_WEIGHTS, HAS_BIAS are false).
        launch(
            x, b, indices, weights if weights is not None else x, bins,
            bias if bias is not None else x, out,
        )  # fmt: skip
        return out

    return run
