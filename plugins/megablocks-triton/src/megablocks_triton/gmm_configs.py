"""Grouped-GEMM tile configs and host helpers, shared by the forward ops (:mod:`.gmm`) and the
weight gradients (:mod:`.gmm_wgrad`): the device description, :func:`choose_config` (the
environment overrides, else the launch policy's tiles) and the checks and conversions of the
operands every grouped-GEMM launch makes.
"""

from __future__ import annotations

import os
from dataclasses import replace

import torch

from megablocks_core.plugin import DeviceInfo, describe_device, device_limits

from .config import GmmConfig, arch_tuning, launch_configs
from .launch import next_power_of_2, recorded_device

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
