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

This module is the host side (configs, plans, the op functions); the ``@triton.jit`` kernels
are :mod:`megablocks_triton.kernels.gmm`, and ``_gmm_kernel`` and ``_gmm_wgrad_kernel`` are
imported here.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import triton  # type: ignore[import-untyped]
from triton.tools.tensor_descriptor import TensorDescriptor  # type: ignore[import-untyped]

from megablocks_core.plugin import (
    CallInfo,
    DeviceInfo,
    contract,
    describe_device,
    device_limits,
)

from .config import GmmConfig, LaunchConfigs, arch_tuning, launch_configs
from .kernels.gmm import (
    _gmm_kernel,
    _gmm_wgrad_kernel,
)
from .launch import (
    BoundLaunch,
    bind,
    bind_descriptors,
    cdiv,
    launch,
    next_power_of_2,
    recorded_device,
    remember,
)

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

#: The in-register expert prefix holds next_pow2(E) values per program; beyond this the register
#: cost gets silly (and no real MoE has that many experts per rank).
MAX_EXPERTS = 4096


# --------------------------------------------------------------------------------------------
# Configs
# --------------------------------------------------------------------------------------------


def device_info(device: torch.device) -> DeviceInfo:
    """The core's (cached) description of ``device``; an index-less CUDA device is the current one.
    While launches are recorded (ahead-of-time compilation), ``meta`` stands for the recorded
    device."""
    if device.type == "meta" and (recorded := recorded_device()) is not None:
        return recorded
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return describe_device(device)


def _num_sms(info: DeviceInfo) -> int:
    # The interpreter: a few "SMs" so that the persistent loop is exercised.
    return 4 if info.kind == "cpu" else info.multiprocessors or 1


_ENV_VAR = {
    "gmm": "MEGABLOCKS_TRITON_GMM_CONFIG",
    "wgrad": "MEGABLOCKS_TRITON_GMM_WGRAD_CONFIG",
    "wgrad_accumulate": "MEGABLOCKS_TRITON_GMM_WGRAD_CONFIG",
}


def _parse_env_config(text: str) -> GmmConfig:
    """Parse "BM,BN,BK[,GROUP_M[,WARPS[,STAGES[,PROGRAMS_PER_SM]]]]" into a GmmConfig."""
    fields = [int(v) for v in text.replace(" ", "").split(",") if v]
    if not 3 <= len(fields) <= 7:
        raise ValueError(f"bad grouped-GEMM config override {text!r}")
    block_m, block_n, block_k, *rest = fields
    cfg = GmmConfig(block_m, block_n, block_k)
    defaults = (cfg.group_m, cfg.num_warps, cfg.num_stages, cfg.programs_per_sm)
    group_m, num_warps, num_stages, programs_per_sm = (*rest, *defaults[len(rest) :])
    return GmmConfig(
        block_m,
        block_n,
        block_k,
        group_m=group_m,
        num_warps=num_warps,
        num_stages=num_stages,
        programs_per_sm=programs_per_sm,
    )


def shared_memory_estimate(cfg: GmmConfig, info: DeviceInfo, dtype: torch.dtype) -> int:
    """Bytes of shared memory (LDS) the K loop's operand buffers of ``cfg`` take at least: one
    (BLOCK_M x BLOCK_K) and one (BLOCK_K x BLOCK_N) tile per buffered stage. Triton's NVIDIA
    pipeliner buffers ``num_stages`` of them, AMD's stream pipeliner ``num_stages - 1``."""
    stages = cfg.num_stages if info.kind != "rocm" else max(cfg.num_stages - 1, 1)
    per_stage = (cfg.block_m + cfg.block_n) * cfg.block_k * dtype.itemsize
    return per_stage * stages


def _refuse_over_limits(
    variable: str, text: str, cfg: GmmConfig, info: DeviceInfo, dtype: torch.dtype
) -> None:
    """Raise where a forced config cannot fit ``info``'s arch (the core's limits table): launched,
    it would fail or corrupt shared memory instead of being slow."""
    lim = device_limits(info)
    if lim is None:
        return
    shared = shared_memory_estimate(cfg, info, dtype)
    if shared > lim.shared_memory_per_block:
        raise ValueError(
            f"{variable}={text!r} asks for at least {shared // 1024} KiB of shared memory (LDS) per "
            f"block for {str(dtype).removeprefix('torch.')} operands, over the "
            f"{lim.shared_memory_per_block // 1024} KiB limit of {lim.arch}; use smaller tiles or "
            "fewer stages"
        )
    threads = cfg.num_warps * lim.warp_size
    if threads > 1024:
        raise ValueError(
            f"{variable}={text!r} asks for {cfg.num_warps} warps ({threads} threads), over the "
            f"1024 threads per block of {lim.arch}"
        )


def _tma_override(cfg: GmmConfig) -> GmmConfig:
    # MEGABLOCKS_TRITON_GMM_TMA=0/1 flips the TMA path independently of the tile shape (tuning).
    env = os.environ.get("MEGABLOCKS_TRITON_GMM_TMA")
    return cfg if env is None or env == "" else replace(cfg, use_tma=env not in ("0", "false"))


def choose_config(
    op: str,
    m: int,
    n: int,
    k: int,
    num_experts: int,
    dtype: torch.dtype,
    info: DeviceInfo,
    out_dtype: torch.dtype | None = None,
) -> GmmConfig:
    """Pick tile sizes for one call. Pure function of the shapes, dtypes, device and launch policy.

    op: "gmm" (m = rows of a, n = output columns, k = reduction), "wgrad" (m = a.shape[1],
    n = grad.shape[1], k = total tokens) or "wgrad_accumulate" (the same, adding into an
    ``out_dtype`` gradient). Steps:

    1. Env override ``MEGABLOCKS_TRITON_GMM_CONFIG`` / ``MEGABLOCKS_TRITON_GMM_WGRAD_CONFIG``
       ("BM,BN,BK[,GROUP_M[,WARPS[,STAGES[,PROGRAMS_PER_SM]]]]") wins, for tuning sweeps (the
       weight-gradient one for both weight-gradient ops).
    2. Else the launch policy in force decides (:meth:`LaunchConfigs.gmm
       <megablocks_triton.config.LaunchConfigs.gmm>` / ``gmm_wgrad`` / ``gmm_wgrad_accumulate``;
       a vendor plugin may install its own).
    3. ``MEGABLOCKS_TRITON_GMM_TMA=0/1`` sets ``use_tma`` (tuning).

    The forward ops ask once per call shape and launch policy and keep the answer with their
    prepared launch: the environment overrides apply to the forward call shapes first seen after
    they are set (a sweep sets them before its process starts, or passes ``config=``).
    """
    env = os.environ.get(_ENV_VAR[op])
    if env:
        forced = _tma_override(_parse_env_config(env))
        if recorded_device() is None:  # the compile gate compiles it to report what it uses
            _refuse_over_limits(_ENV_VAR[op], env, forced, info, dtype)
        return forced
    policy = launch_configs()
    if op == "gmm":
        return _tma_override(policy.gmm(info, m, n, k, num_experts, dtype))
    if op == "wgrad_accumulate":
        out = dtype if out_dtype is None else out_dtype
        return _tma_override(policy.gmm_wgrad_accumulate(info, m, n, k, num_experts, dtype, out))
    return _tma_override(policy.gmm_wgrad(info, m, n, k, num_experts, dtype))


# --------------------------------------------------------------------------------------------
# Host wrappers
# --------------------------------------------------------------------------------------------


def _device_sizes(batch_sizes: torch.Tensor, device: torch.device) -> torch.Tensor:
    """batch_sizes on the kernel's device, any int dtype (the kernel casts to int32 in registers,
    so a device int64 tensor costs no conversion kernel). A CPU tensor is copied H2D — the caller
    already has the counts on the host, so that is not a new sync."""
    if batch_sizes.device != device:
        if (
            batch_sizes.device.type == "cpu"
            and device.type != "cpu"
            and not batch_sizes.is_pinned()
        ):
            # From pageable memory the copy would wait for the stream to drain; through pinned
            # memory (torch's caching host allocator, which keeps the block until the copy has
            # run) it is queued like a kernel.
            batch_sizes = batch_sizes.pin_memory()
        batch_sizes = batch_sizes.to(device, non_blocking=True)
    return batch_sizes if batch_sizes.is_contiguous() else batch_sizes.contiguous()


def _check_experts(num_experts: int) -> int:
    if num_experts > MAX_EXPERTS:
        raise ValueError(f"triton gmm supports at most {MAX_EXPERTS} experts, got {num_experts}")
    return max(16, next_power_of_2(num_experts))


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    # Vectorised loads want a unit stride in the innermost dim; other strides are passed through.
    return t if t.stride(-1) == 1 else t.contiguous()


def _tma_layout_ok(info: DeviceInfo, t: torch.Tensor) -> bool:
    """What TMA needs of a tensor besides a 16-byte aligned base (checked per call): sm90+ (or
    the interpreter, which emulates descriptors), a unit inner stride and 16-byte aligned outer
    strides."""
    if not (arch_tuning(info).tma or info.kind == "cpu"):
        return False
    size = t.element_size()
    return t.stride(-1) == 1 and not any((st * size) % 16 for st in t.stride()[:-1])


# --------------------------------------------------------------------------------------------
# The forward (gmm, gather_gmm, gmm_scatter): one launch of _gmm_kernel, prepared per call shape
# --------------------------------------------------------------------------------------------

Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class _ForwardPlan:
    """One call shape's ``_gmm_kernel`` launch, prepared once (tile config, grid, scalars and
    constexprs; the compiled kernel is pinned by :mod:`.launch`): ``plan(a, b, sizes, indices)``
    allocates the (m, n) output and launches. With a TMA config it takes the descriptor
    variant when the operands it reads through descriptors are 16-byte aligned, else the plain
    one (both as the call would have chosen without a plan)."""

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
        self, a: torch.Tensor, b: torch.Tensor, sizes: torch.Tensor, indices: torch.Tensor
    ) -> torch.Tensor:
        out = a.new_empty(self.shape)
        tma = self.tma
        if tma is not None and not (b.data_ptr() | (a.data_ptr() if self.tma_reads_a else 0)) & 15:
            tma(a, b, out, sizes, indices)
        else:
            self.plain(a, b, out, sizes, indices)
        return out


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
) -> Forward:
    """The launch of an (m, n) grouped GEMM of a (its token rows, read through the indices, with
    ``gather_top_k``) by b; group sizes are counts, or cumulative ends (``from_ends``). Rows no
    group covers are zeros, or (not ``zero_tail``) left unwritten."""
    k = a.shape[1]
    num_experts = b.shape[0]
    n = b.shape[1] if trans_b else b.shape[2]
    shape = (m, n)
    if m == 0 or n == 0:
        return lambda a, b, sizes, indices: a.new_empty(shape)
    if k == 0:
        return lambda a, b, sizes, indices: a.new_zeros(shape)
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
def _activate() -> Callable[[torch.Tensor, str], torch.Tensor]:
    """gmm_scatter's activation of x's rows, as the core applies it for a kernel that does not
    take one (the dispatched activation ops: a transient copy). Looked up once."""
    apply: Callable[[torch.Tensor, str], torch.Tensor] = getattr(  # noqa: B009 (Arg has no apply)
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
) -> Forward:
    """The prepared launch for this call shape (made on first use). The key holds everything
    the launch's scalars, constexprs and compiled kernel depend on: shapes, strides and dtypes
    of every operand (the sizes' and indices' dtypes too), the device and the policy."""
    configs = launch_configs()
    key = (
        a.shape, a.stride(), a.dtype, a.device, b.shape, b.stride(), b.dtype,
        sizes.dtype, indices.dtype, m, trans_b, gather_top_k, from_ends, config, configs,
    )  # fmt: skip
    plan = _FORWARD_PLANS.get(key)
    if plan is None:
        plan = remember(
            _FORWARD_PLANS,
            key,
            _forward_plan(configs, a, b, trans_b, m, gather_top_k, from_ends, config),
        )
    return plan


def gmm(
    a: torch.Tensor,
    b: torch.Tensor,
    batch_sizes: torch.Tensor,
    trans_b: bool = False,
    *,
    config: GmmConfig | None = None,
) -> torch.Tensor:
    """Grouped GEMM: rows ``[off_e, off_e + batch_sizes[e])`` of the result are ``a_e @ b[e]``
    (``a_e @ b[e].T`` when ``trans_b``). a (M, K); b (E, K, N), or (E, N, K) with trans_b;
    sum(batch_sizes) == M. Returns (M, N) in a's dtype, fp32 accumulation. No host sync.

    Device-side batch_sizes that break the contract (unchecked unless MEGABLOCKS_CHECK=1) are
    made safe in the kernel: negative sizes count as 0, groups are cut at row M, and rows no
    group covers come out 0."""
    a = _unit_last_stride(a)
    b = _unit_last_stride(b)
    sizes = _device_sizes(batch_sizes, a.device)
    plan = _planned(a, b, sizes, sizes, trans_b, a.shape[0], None, False, config)
    return plan(a, b, sizes, sizes)


def gather_gmm(
    x: torch.Tensor,
    b: torch.Tensor,
    indices: torch.Tensor,
    bin_ids: torch.Tensor,
    bins: torch.Tensor,
    top_k: int,
    trans_b: bool = False,
    rows: int | None = None,
    *,
    config: GmmConfig | None = None,
) -> torch.Tensor:
    """``gmm(gather(x, indices, ...), b, counts)`` reading each row of A from x in place: sorted
    row i is ``x[indices[i] // top_k] @ b[e]``, groups from bins (cumulative), for the first
    ``rows`` sorted rows (all when None). No gathered copy of x is written; ids outside
    [0, tokens * top_k) give zero rows."""
    x = _unit_last_stride(x)
    b = _unit_last_stride(b)
    if not bins.is_contiguous():
        bins = bins.contiguous()
    m = indices.shape[0] if rows is None else rows
    plan = _planned(x, b, bins, indices, trans_b, m, int(top_k), True, config)
    return plan(x, b, bins, indices)


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
) -> torch.Tensor:
    """``scatter(gmm(act(x), b, counts), indices, bin_ids, weights, bins, top_k)``: the GEMM
    keeps its plain (TMA) stores and the token-major scatter kernel sums each token's rows once
    (reading its top_k rows, weighting and summing in fp32): no atomics, deterministic. x may
    hold only the first ``rows`` sorted rows (the GEMM covers those, the scatter reads no
    other). The activation is the contract's own (applied to x first, a transient copy)."""
    if activation is not None:
        x = _activate()(x, activation)
    x = _unit_last_stride(x)
    b = _unit_last_stride(b)
    if not bins.is_contiguous():
        bins = bins.contiguous()
    configs = launch_configs()
    key = (
        x.shape, x.stride(), x.dtype, x.device, b.shape, b.stride(), b.dtype,
        indices.shape, indices.dtype, bins.shape, bins.dtype,
        None if weights is None else weights.dtype, top_k, trans_b, configs,
    )  # fmt: skip
    plan = _GMM_SCATTER_PLANS.get(key)
    if plan is None:
        plan = remember(
            _GMM_SCATTER_PLANS,
            key,
            _gmm_scatter_plan(
                configs, x, b, indices, bins, weights is not None, int(top_k), trans_b
            ),
        )
    return plan(x, b, indices, weights, bins)


def _gmm_scatter_plan(
    configs: LaunchConfigs,
    x: torch.Tensor,
    b: torch.Tensor,
    indices: torch.Tensor,
    bins: torch.Tensor,
    has_weights: bool,
    top_k: int,
    trans_b: bool,
) -> Callable[..., torch.Tensor]:
    """gmm_scatter's two prepared steps: the grouped GEMM into expert-sorted rows, then the plain
    scatter of those rows (its plan taken once, for the rows' shape and dtype). Sorted rows past
    bins' groups (expert parallelism's pairs of other ranks' experts) are neither written by the
    GEMM nor read by the scatter: their products are 0 by the contract."""
    from .permutation import _scatter_plan

    gemm = _forward_plan(configs, x, b, trans_b, x.shape[0], None, True, None, zero_tail=False)
    n = b.shape[1] if trans_b else b.shape[2]
    rows = torch.empty((x.shape[0], n), dtype=x.dtype, device="meta")
    reduce = _scatter_plan(
        configs, rows, indices.numel(), bins.numel(), top_k, has_weights, grouped_rows=True
    )

    def run(
        x: torch.Tensor,
        b: torch.Tensor,
        indices: torch.Tensor,
        weights: torch.Tensor | None,
        bins: torch.Tensor,
    ) -> torch.Tensor:
        return reduce(gemm(x, b, bins, bins), indices, weights, bins)

    return run


def gmm_weight_grad(
    a: torch.Tensor,
    grad: torch.Tensor,
    batch_sizes: torch.Tensor,
    *,
    config: GmmConfig | None = None,
    warp_specialized: bool = False,
) -> torch.Tensor:
    """Variable-K grouped GEMM: ``out[e] = a_e.T @ grad_e`` with a (M, K), grad (M, N), giving
    (E, K, N) in a's dtype. Empty groups give exact zeros; rows of a/grad beyond
    sum(batch_sizes) are never read (a worst-case-allocated buffer may be passed whole).
    ``warp_specialized``: the Gluon kernel where it can take the tensors (the variant
    :func:`gmm_weight_grad_warp_specialized`), else this Triton kernel."""
    a = _unit_last_stride(a)
    grad = _unit_last_stride(grad)
    out = torch.empty(
        (batch_sizes.shape[0], a.shape[1], grad.shape[1]), dtype=a.dtype, device=a.device
    )
    if out.numel() == 0:
        return out
    if a.shape[0] == 0:
        return out.zero_()
    _launch_wgrad(
        a, grad, batch_sizes, out, accumulate=False, config=config,
        warp_specialized=warp_specialized,
    )  # fmt: skip
    return out


def gmm_weight_grad_accumulate(
    a: torch.Tensor,
    grad: torch.Tensor,
    batch_sizes: torch.Tensor,
    out: torch.Tensor,
    *,
    config: GmmConfig | None = None,
    warp_specialized: bool = False,
) -> None:
    """``out[e] += a_e.T @ grad_e`` in place (gradient-accumulation fusion): the weight gradient
    is added to the existing ``out`` (E, K, N) in the GEMM's epilogue, in float32, and rounded
    once to out's dtype (a's dtype, or float32 for 16-bit a); with the TMA reduction (the Hopper
    policy's ``reduce_epilogue``) the product is rounded to out's dtype and the memory system
    adds it, as the composition ``out += gmm_weight_grad(...)`` rounds. No (E, K, N) temporary
    is written.
    An empty expert's ``out[e]`` is left untouched; rows of a/grad beyond sum(batch_sizes) are
    never read. ``out`` must be contiguous (the core checks it). ``warp_specialized``: as for
    :func:`gmm_weight_grad`."""
    if out.numel() == 0 or a.shape[0] == 0:
        return  # nothing to add
    _launch_wgrad(
        _unit_last_stride(a), _unit_last_stride(grad), batch_sizes, out, accumulate=True,
        config=config, warp_specialized=warp_specialized,
    )  # fmt: skip


def gmm_weight_grad_warp_specialized(
    a: torch.Tensor, grad: torch.Tensor, batch_sizes: torch.Tensor
) -> torch.Tensor:
    """The kernel of variant ``gluon-hopper`` of ``gmm_weight_grad``: the Gluon kernel of
    :mod:`.hopper_wgrad` (tensors whose base or strides do not suit TMA, which the shape
    predicate cannot see, take the Triton kernel with the policy's tiles)."""
    return gmm_weight_grad(a, grad, batch_sizes, warp_specialized=True)


def gmm_weight_grad_accumulate_warp_specialized(
    a: torch.Tensor, grad: torch.Tensor, batch_sizes: torch.Tensor, out: torch.Tensor
) -> None:
    """The kernel of variant ``gluon-hopper`` of ``gmm_weight_grad_accumulate`` (as
    :func:`gmm_weight_grad_warp_specialized`: the Gluon kernel's TMA reduction into ``out``)."""
    gmm_weight_grad_accumulate(a, grad, batch_sizes, out, warp_specialized=True)


#: The Triton releases (major, minor) the Gluon kernel of :mod:`.hopper_wgrad` was written and
#: tested with: Gluon is experimental and its API moves between releases.
GLUON_TESTED = ((3, 6),)


@functools.cache
def _hopper_wgrad() -> Any:
    """:mod:`.hopper_wgrad`, or None with a Triton it was not tested with or whose Gluon does not
    import (the Triton kernel then serves every weight gradient)."""
    release = tuple(int(part) for part in triton.__version__.split(".")[:2] if part.isdigit())
    if release not in GLUON_TESTED:
        return None
    try:
        from . import hopper_wgrad
    except Exception:
        return None
    return hopper_wgrad


def _tma_ready(info: DeviceInfo, tensors: tuple[torch.Tensor, ...]) -> bool:
    """Every tensor can be read or written through a TMA descriptor on ``info``: its layout
    (:func:`_tma_layout_ok`) and a 16-byte aligned base."""
    return all(_tma_layout_ok(info, t) and not t.data_ptr() & 15 for t in tensors)


def warp_specialized_capability(device: DeviceInfo) -> str | None:
    """The Gluon weight gradient's device predicate: an NVIDIA Hopper GPU, and a Triton release
    its Gluon code was tested with (:data:`GLUON_TESTED`)."""
    if not arch_tuning(device).gluon_wgrad:
        return f"the Gluon weight gradient is for NVIDIA Hopper (sm_90), not {device.arch}"
    if _hopper_wgrad() is None:
        tested = ", ".join(".".join(map(str, release)) for release in GLUON_TESTED)
        return f"its Gluon code is tested with Triton {tested} only, not {triton.__version__}"
    return None


#: The Gluon weight gradient's dtypes: 16-bit operands, and a 16-bit gradient it writes.
WARP_SPECIALIZED_DTYPES = frozenset({torch.bfloat16, torch.float16})


def warp_specialized_problem(op: str, device: DeviceInfo, call: CallInfo) -> str | None:
    """None when the Gluon variant takes this ``gmm_weight_grad`` /
    ``gmm_weight_grad_accumulate`` call, else why not: its device (:func:`
    warp_specialized_capability`), its dtypes (one 16-bit dtype for ``a`` and ``grad``, a 16-bit
    gradient), rows TMA can address (K and N of 16 bytes' multiples) and the launch policy's
    choice for the shapes (``GmmConfig.warp_specialized``: where it was measured faster).
    The plain Triton kernel declines exactly these calls, so that the ranking sees one kernel
    of this backend per call, with the backend's cost hint."""
    problem = warp_specialized_capability(device)
    if problem:
        return problem
    a, grad, batch_sizes = call["a"], call["grad"], call["batch_sizes"]
    out_dtype = call["out"].dtype if op == "gmm_weight_grad_accumulate" else a.dtype
    if not (
        a.dtype in WARP_SPECIALIZED_DTYPES
        and grad.dtype == a.dtype
        and out_dtype in WARP_SPECIALIZED_DTYPES
    ):
        return "the Gluon weight gradient takes 16-bit a and grad of one dtype, a 16-bit gradient"
    k, n = a.shape[1], grad.shape[1]
    if (k * a.dtype.itemsize) % 16 or (n * a.dtype.itemsize) % 16:
        return f"K = {k}, N = {n}: the Gluon weight gradient's TMA rows need 16-byte multiples"
    kind = "wgrad_accumulate" if op == "gmm_weight_grad_accumulate" else "wgrad"
    if os.environ.get(_ENV_VAR[kind]):
        return f"{_ENV_VAR[kind]} sets the Triton kernel's tiles (tuning)"
    policy = launch_configs()
    rows, experts = a.shape[0], batch_sizes.shape[0]
    if kind == "wgrad":
        cfg = policy.gmm_wgrad(device, k, n, rows, experts, a.dtype)
    else:
        cfg = policy.gmm_wgrad_accumulate(device, k, n, rows, experts, a.dtype, out_dtype)
    if not cfg.warp_specialized:
        return (
            f"{rows} rows over {experts} experts: the launch policy keeps the Triton kernel "
            "(the Gluon one is measured faster only where it takes it)"
        )
    return None


#: The Gluon weight gradient's variant label: ``triton/gluon-hopper`` in ``megablocks backends
#: explain``, forceable as ``MEGABLOCKS_BACKEND=gmm_weight_grad=triton/gluon-hopper``.
WARP_SPECIALIZED_VARIANT = "gluon-hopper"


def _leaves_to_gluon(op: str, device: DeviceInfo, call: CallInfo) -> str | None:
    if device.kind != "cuda" or warp_specialized_problem(op, device, call) is not None:
        return None
    return f"the Gluon weight gradient (variant {WARP_SPECIALIZED_VARIANT}) takes this call"


def gmm_weight_grad_supports(device: DeviceInfo, call: CallInfo) -> str | None:
    """The plain kernel's shape predicate: every call but those of the Gluon variant."""
    return _leaves_to_gluon("gmm_weight_grad", device, call)


def gmm_weight_grad_accumulate_supports(device: DeviceInfo, call: CallInfo) -> str | None:
    """The plain kernel's shape predicate: every call but those of the Gluon variant."""
    return _leaves_to_gluon("gmm_weight_grad_accumulate", device, call)


def _warp_specialized(
    info: DeviceInfo, a: torch.Tensor, grad: torch.Tensor, out: torch.Tensor
) -> Any:
    """:mod:`.hopper_wgrad` when it can take these tensors (an sm_90 GPU, its dtypes, TMA
    layouts and aligned bases), else None."""
    if not arch_tuning(info).gluon_wgrad:
        return None
    hopper = _hopper_wgrad()
    if hopper is None or not hopper.serves_dtypes(a.dtype, grad.dtype, out.dtype):
        return None
    return hopper if _tma_ready(info, (a, grad, out)) else None


def _launch_wgrad(
    a: torch.Tensor,
    grad: torch.Tensor,
    batch_sizes: torch.Tensor,
    out: torch.Tensor,
    *,
    accumulate: bool,
    config: GmmConfig | None,
    warp_specialized: bool = False,
) -> None:
    """One weight-gradient launch writing (or, ``accumulate``, adding to) ``out`` (E, K, N):
    the Gluon kernel when ``warp_specialized`` and it can take the tensors, else the Triton
    kernel with the policy's (or ``config``'s) tiles."""
    num_experts = batch_sizes.shape[0]
    ka, n = a.shape[1], grad.shape[1]
    block_e = _check_experts(num_experts)
    sizes = _device_sizes(batch_sizes, a.device)
    info = device_info(a.device)
    op = "wgrad_accumulate" if accumulate else "wgrad"
    cfg = config or choose_config(op, ka, n, a.shape[0], num_experts, a.dtype, info, out.dtype)
    hopper = _warp_specialized(info, a, grad, out) if warp_specialized else None
    if hopper is not None:
        hopper.launch(
            a, grad, sizes, out, accumulate=accumulate, block_e=block_e, num_sms=_num_sms(info)
        )
        return
    total_tiles = num_experts * triton.cdiv(ka, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    grid = max(1, min(_num_sms(info) * cfg.programs_per_sm, total_tiles))
    descriptors: tuple[Any, ...] = (a, grad, out)  # unused unless TMA
    # A config may ask for TMA (the policy's, or one passed in); the kernel's TMA epilogue only
    # fits shared memory for a 16-bit gradient tile, and the descriptors need aligned tensors.
    # The TMA reduction (cfg.reduce_epilogue) needs the hardware (the interpreter has none) and
    # stages no (BLOCK_M, BLOCK_N) tile to read, so a float32 gradient fits too.
    reduce = accumulate and cfg.reduce_epilogue and info.kind == "cuda"
    tma = (
        accumulate
        and cfg.use_tma
        and (out.element_size() == 2 or reduce)
        and _tma_ready(info, descriptors)
    )
    if tma:
        descriptors = (
            TensorDescriptor.from_tensor(a, [cfg.block_k, cfg.block_m]),
            TensorDescriptor.from_tensor(grad, [cfg.block_k, cfg.block_n]),
            TensorDescriptor.from_tensor(out, [1, cfg.block_m, cfg.block_n]),
        )
    launch(
        _gmm_wgrad_kernel, (grid,),
        a, grad, out, sizes, *descriptors,
        a.shape[0], ka, n, num_experts,
        a.stride(0), a.stride(1),
        grad.stride(0), grad.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        BLOCK_E=block_e, GROUP_M=cfg.group_m,
        IEEE_FP32=a.dtype == torch.float32, ACCUMULATE=accumulate, TMA=tma, REDUCE=tma and reduce,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **launch_configs().launch_options("gmm_wgrad"),
    )  # fmt: skip
