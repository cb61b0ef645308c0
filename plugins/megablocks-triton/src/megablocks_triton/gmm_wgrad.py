"""The grouped GEMM's weight gradients (``gmm_weight_grad``, ``gmm_weight_grad_accumulate``):
one launch of the Triton kernel ``_gmm_wgrad_kernel`` with the policy's tiles, or on Hopper the
warp-specialized Gluon kernel of :mod:`.hopper_wgrad`, the declared variant ``triton/gluon-hopper``
with its predicates (:func:`warp_specialized_capability`, :func:`warp_specialized_problem`).
:mod:`.gmm` re-exports every name here; its docstring describes the design.
"""

from __future__ import annotations

import functools
import importlib
import os
from typing import Any

import torch
import triton  # type: ignore[import-untyped]
from triton.tools.tensor_descriptor import TensorDescriptor  # type: ignore[import-untyped]

from megablocks_core.plugin import CallInfo, DeviceInfo

from .config import GmmConfig, arch_tuning, launch_configs
from .gmm_configs import (
    _ENV_VAR,
    _check_experts,
    _device_sizes,
    _num_sms,
    _tma_layout_ok,
    _unit_last_stride,
    choose_config,
    device_info,
)
from .kernels.gmm import _gmm_wgrad_kernel
from .launch import launch


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


def tested_gluon_module(name: str) -> Any:
    """This package's Gluon module ``name``, or None with a Triton it was not tested with
    (:data:`GLUON_TESTED`) or whose Gluon does not import."""
    release = tuple(int(part) for part in triton.__version__.split(".")[:2] if part.isdigit())
    if release not in GLUON_TESTED:
        return None
    try:
        return importlib.import_module(f"{__package__}.{name}")
    except Exception:
        return None


@functools.cache
def _hopper_wgrad() -> Any:
    """:mod:`.hopper_wgrad`, or None (:func:`tested_gluon_module`: the Triton kernel then serves
    every weight gradient)."""
    return tested_gluon_module("hopper_wgrad")


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
