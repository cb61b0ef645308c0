"""The low-precision ops' host side: ``quantize`` and the scaled grouped GEMMs, and the weight
gradient's pair (``quantize_transposed``, ``scaled_gmm_weight_grad``: one launch each; on Hopper
the GEMM takes the Gluon kernel of :mod:`.hopper_scaled_wgrad` where its layouts serve).

``quantize`` is one launch of :func:`~megablocks_triton.kernels.scaled._quantize_kernel` over x
seen as (E, R, C) (a row operand is E = 1), in any strides: an expert matrix's transposed view
is read tile by tile and written contiguous (the transpose-quantize that gives the scaled GEMMs
their reduced dimension contiguous). The scaled GEMMs are one launch of
:func:`~megablocks_triton.kernels.scaled._scaled_gmm_kernel` each, prepared once per call shape
like the 16-bit forward ops (:mod:`megablocks_triton.gmm`); ``scaled_gmm_scatter`` is that GEMM
into expert-sorted rows of the output dtype, then the 16-bit path's token-major scatter. On
Hopper the rowwise GEMMs of plain and gathered rows take the warp-specialized Gluon kernel of
:mod:`.hopper_scaled` instead, where :func:`_warp_specialized` says (the arch table's
``gluon_scaled_max_k``, enough rows per expert): the same results bit for bit, faster there.
Gathered rows are copied into sorted order first, for the plain rows' kernel, where that kernel
is the Gluon one (:data:`GATHER_FIRST`).

FP8 matrix instructions exist on NVIDIA sm_89+ (OCP e4m3fn) and AMD gfx942 (FNUZ e4m3fnuz) /
gfx950 (OCP): :func:`fp8_capability` refuses other devices, :func:`scaled_gmm_supports` a data
encoding the device's matrix units do not take.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any, NamedTuple

import torch

from megablocks_core.plugin import (
    FP8_ENCODINGS,
    SCALED_FORMATS,
    DeviceInfo,
    base_arch,
    native_encoding,
    out_dtype_of,
)

from .config import LaunchConfigs, arch_tuning, launch_configs
from .gmm import _bias_layout, add_grouped_bias
from .gmm_configs import (
    _check_experts,
    _device_sizes,
    _num_sms,
    _tma_layout_ok,
    choose_config,
    device_info,
)
from .gmm_wgrad import tested_gluon_module
from .kernels.scaled import (
    _both_ways_kernel,
    _column_codes_kernel,
    _quantize_kernel,
    _quantize_transposed_kernel,
    _rows_and_column_peaks_kernel,
    _scaled_gmm_kernel,
    _scaled_wgrad_kernel,
)
from .launch import (
    BoundLaunch,
    bind,
    bind_descriptors,
    cdiv,
    next_power_of_2,
    recorded_device,
    remember,
)

#: AMD archs with FP8 matrix instructions: CDNA3 (FNUZ) and CDNA4 (OCP).
AMD_FP8_ARCHS = frozenset({"gfx940", "gfx941", "gfx942", "gfx950"})
#: A K step of a blockwise format never straddles two scale blocks: BLOCK_K divides this.
SCALE_BLOCK = 128
#: The float32 sum of the FP8 products is promoted at least every this many k (Hopper's FP8
#: MMA accumulates in reduced precision between promotions); None: never (measurements only).
PROMOTE_EVERY: int | None = SCALE_BLOCK
#: The smallest K step: an FP8 MMA on Hopper takes K >= 32.
MIN_BLOCK_K = 32
#: Measurements only (tile sweeps): this config instead of the launch policy's.
CONFIG_OVERRIDE: Any = None
#: Measurements only: False keeps every scaled GEMM on the Triton kernel, where the Gluon kernel
#: of :mod:`.hopper_scaled` would take some (:func:`_warp_specialized`).
WARP_SPECIALIZED = True
#: The Gluon kernel's tiles are 128 rows: with fewer rows per expert on average (DeepSeek-V3's
#: 64 on the H200: 0.79-0.92x) the Triton kernel's are the better fit.
WARP_SPECIALIZED_MIN_ROWS_PER_EXPERT = 128
#: Its partitions keep every expert's row count in registers: up to this many experts (as
#: ``block_e``, the next power of two) nothing spills on sm_90a; plain rowwise rows 256, the
#: gathering loader and the blockwise scales 128 (``megablocks backends compile``, ptxas -v).
WARP_SPECIALIZED_MAX_BLOCK_E = 256
WARP_SPECIALIZED_MAX_BLOCK_E_GATHERED_OR_BLOCKWISE = 128
#: True gathers a scaled_gather_gmm's rows and their scales into sorted order first and runs
#: the plain rows' kernel on the copy, wherever plain rows of that shape take the Gluon kernel
#: (:class:`_GatherFirstPlan`): its operands then come by TMA, where the gathering loader copies
#: them with its threads, for a write and a read of one byte per sorted row element. Measured
#: (docs/performance.md, benchmarks/scaled_gmm_providers.py --gather): rowwise on the H200,
#: 1.28-1.66x the gathering kernels at 16384 tokens (Qwen3's two GEMMs, DeepSeek-V3's down
#: projection), at 2048 1.37x at Qwen3's down projection and 0.93x at its up; blockwise on the
#: H100, 1.31-1.53x at Qwen3's, OLMoE's and GPT-OSS's GEMMs. False keeps the gathering
#: kernels (the same output bit for bit).
GATHER_FIRST = True


@contextlib.contextmanager
def gather_first(on: bool) -> Iterator[None]:
    """For measurements: :data:`GATHER_FIRST` set to ``on`` inside, restored after; the plans
    are dropped on entry and exit, so the ones inside are this setting's only."""
    global GATHER_FIRST
    before = GATHER_FIRST
    GATHER_FIRST = on
    _SCALED_PLANS.clear()
    try:
        yield
    finally:
        GATHER_FIRST = before
        _SCALED_PLANS.clear()


def fp8_capability(device: DeviceInfo) -> str | None:
    """None where the device's matrix units take FP8, else why not."""
    if device.kind == "cpu":
        return None
    if device.kind == "cuda":
        if device.capability is not None and device.capability >= (8, 9):
            return None
        return f"FP8 matrix instructions need NVIDIA sm_89 or newer; {device} has none"
    if device.kind == "rocm" and base_arch(device) in AMD_FP8_ARCHS:
        return None
    return f"no FP8 matrix instructions on {device} (AMD: gfx942 or gfx950)"


def _hardware_conversion(device: DeviceInfo, encoding: str) -> bool:
    """Whether the device converts float32 into this encoding itself (else the kernel's integer
    encoder does, bit for bit the same): the native encoding of a GPU with FP8 units."""
    if device.kind == "cpu" or fp8_capability(device) is not None:
        return False
    return native_encoding(device).name == encoding


def _encoding_constexprs(
    format: str, encoding: str | None, device: DeviceInfo
) -> tuple[Any, dict[str, Any]]:
    """(the encoding, the constexprs a quantizing kernel takes for it and the format's scales):
    ``encoding`` None is the one the device's matrix units take."""
    import triton.language as tl  # type: ignore[import-untyped]

    enc = FP8_ENCODINGS[encoding] if encoding is not None else native_encoding(device)
    return enc, dict(
        MAX=enc.max, BIAS=enc.exponent_bias, NEG_ZERO=enc.negative_zero,
        NAN_BITS=0x7F if enc.negative_zero else 0x80,
        POW2=SCALED_FORMATS[format].power_of_two, HARDWARE=_hardware_conversion(device, enc.name),
        FP8=tl.float8e4b8 if enc.name == "e4m3fnuz" else tl.float8e4nv,
    )  # fmt: skip


# --------------------------------------------------------------------------------------------
# quantize
# --------------------------------------------------------------------------------------------


#: Whole rows up to this many elements, padded to a power of two with at most a seventh more,
#: are quantized in one read: a tile of whole rows held in registers ("row_tile" with one tile
#: across the row). The rest take the two passes of "row" (the peak, then the codes), which read
#: x twice. On the H200 (docs/performance.md): DeepSeek-V3's rows of 7168 1.36-1.48x the ideal
#: bytes against 1.62-1.86x; rows of 2048 alike either way; rows of 768 (padded to 1024) 1.80x
#: against 1.45x in one of two tensors, hence the padding bound. Whole columns (a strip of
#: whole columns in registers) were 1.6-5x slower in one read: they keep two passes.
ONE_PASS_MAX = 8192
#: (elements, warps) of one program's tile in the one-read row pass: as many whole rows as fit
#: in that many elements, one at least (a row of 7168 takes a tile of 8192). 4096 elements in 8
#: or 16 warps, 8192 or 16384 in 8 or 16, 2048 in 4: slower or equal.
ONE_PASS_ROWS = (4096, 4)


def _one_read_row(c: int) -> int | None:
    """The padded row length of a one-read row pass over rows of ``c`` elements, or None."""
    whole = next_power_of_2(c)
    return whole if whole <= ONE_PASS_MAX and 7 * (whole - c) <= c else None


def _quantize_launch(
    mode: str, block: tuple[int, int], c: int, row_major: bool
) -> tuple[str, int, int, int]:
    """(MODE, BLOCK_R, BLOCK_C, num_warps) of the quantize kernel: "tile" takes the format's
    square block, "row_tile" 32 of its 1 x 128 blocks; whole rows one read each where they fit
    (:func:`_one_read_row`); else the two passes over a tile of 4K-8K elements, chosen on the
    H200 (docs/performance.md)."""
    if mode == "tile":
        # 16 warps for a row-major tensor (a transposed one is read through its stored layout):
        # 4 took every register of sm_90a (megablocks backends compile) and 2.5x the ideal bytes
        # against 1.4x. A view contiguous in neither dim keeps 4 (16 were slower across strides).
        return mode, block[0], block[1], 16 if row_major else 4
    if mode == "row_tile":
        return mode, 32, block[1], 4
    if mode == "column":  # 1.7-1.9x the ideal bytes (64 x 64: 1.8-1.9x)
        return mode, 64, 128, 4
    whole = _one_read_row(c)
    if whole is not None:
        elements, warps = ONE_PASS_ROWS
        return "row_tile", max(elements // whole, 1), whole, warps
    # Whole rows: 512 columns a step, 256 where that divides the row and 512 does not (768:
    # 1.50x against 1.87x); 8 warps (1.30-1.75x against 1.44-1.92x with 4).
    block_c = 256 if c % 512 and not c % 256 else 512
    return mode, 4096 // block_c, block_c, 8


def quantize(
    x: torch.Tensor, reduce_dim: int, format: str, encoding: str | None
) -> tuple[torch.Tensor, torch.Tensor]:
    # (The recorded device: meta tensors stand for another device per compile-gate target.)
    key = (x.shape, x.stride(), x.dtype, x.device, reduce_dim, format, encoding, recorded_device())
    plan = _QUANTIZE_PLANS.get(key)
    if plan is None:
        plan = remember(_QUANTIZE_PLANS, key, _quantize_plan(x, reduce_dim, format, encoding))
    return plan(x)


#: Per call shape: the prepared quantization (its launch bound once: at decode sizes the
#: launch's own argument checks cost more than the kernel).
_QUANTIZE_PLANS: dict[Any, Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]] = {}


def _quantize_plan(
    x: torch.Tensor, reduce_dim: int, format: str, encoding: str | None
) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """The quantization of tensors shaped and strided as ``x`` (read for its metadata only)."""
    fmt = SCALED_FORMATS[format]
    enc, encode = _encoding_constexprs(format, encoding, device_info(x.device))
    block = fmt.block(x.dim(), reduce_dim)
    shape = tuple(x.shape)
    scale_shape = tuple(1 if b == 0 else cdiv(s, b) for s, b in zip(shape, block, strict=True))
    three = x.dim() == 3

    def outputs(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        data = torch.empty(shape, dtype=enc.dtype, device=x.device)
        return data, torch.empty(scale_shape, dtype=torch.float32, device=x.device)

    if x.numel() == 0:

        def empty(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            data, scale = outputs(x)
            if scale.numel():  # empty blocks (k = 0): amax 0, the smallest scale
                scale.fill_(2.0**-126)
            return data, scale

        return empty
    view = x if three else x.unsqueeze(0)
    experts, r, c = view.shape
    _, br, bc = block if three else (1, *block)
    if br == 0:
        mode = "column"
    elif bc == 0:
        mode = "row"
    elif br == 1:
        mode = "row_tile"
    else:
        mode = "tile"
    scale3 = torch.empty(scale_shape, device="meta")
    scale3 = scale3 if three else scale3.unsqueeze(0)
    transposed = mode in ("row", "tile") and view.stride(-1) != 1 and view.stride(-2) == 1
    if transposed:
        # A transposed view (a weight's transpose, the layout the GEMMs read): its transpose,
        # the stored layout, read along its contiguous dim (rows become columns, tiles stay
        # tiles), and the codes written transposed back into x's shape.
        view, scale3 = view.transpose(1, 2), scale3.transpose(1, 2)
        experts, r, c = view.shape
        mode, br, bc = ("column" if mode == "row" else mode), bc, br
    mode, block_r, block_c, num_warps = _quantize_launch(mode, (br, bc), c, view.stride(-1) == 1)
    r_tiles = 1 if mode == "column" else cdiv(r, block_r)
    c_tiles = 1 if mode == "row" else cdiv(c, block_c)
    bound = bind(
        _quantize_kernel,
        (experts * r_tiles * c_tiles,),
        r, c, r_tiles, c_tiles,
        *view.stride(), *scale3.stride(),
        BLOCK_R=block_r, BLOCK_C=block_c, MODE=mode, TRANSPOSED=transposed,
        num_warps=num_warps, **encode,
    )  # fmt: skip

    def run(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        data, scale = outputs(x)
        view = x if three else x.unsqueeze(0)
        scale3 = scale if three else scale.unsqueeze(0)
        if transposed:
            view, scale3 = view.transpose(1, 2), scale3.transpose(1, 2)
        bound(view, data.view(torch.uint8), scale3)
        return data, scale

    return run


#: num_warps of quantize_both_ways' blockwise kernel (one 128 x 128 tile a program): on an H100
#: 8 and 16 took 1.02-1.07x the ideal bytes (read 2, write 1 + 1), 4 took 1.7x
#: (docs/performance.md).
BOTH_WAYS_WARPS = 8

#: Rowwise quantize_both_ways: rows a program of its first read quantizes (whole rows, one read
#: each, as quantize's one-read rows) before raising its column peaks once; the second read's
#: (BLOCK_P, BLOCK_Q) tile and num_warps. Rows longer than BOTH_WAYS_MAX_ROW take the two
#: quantize calls: on an H100 rows of 2048 and 4096 took 0.88-0.93x their time, rows of 7168
#: 1.26x (the peaks of 8192 columns beside a row in registers; docs/performance.md).
BOTH_WAYS_ROWS_PER_PROGRAM = 64
BOTH_WAYS_MAX_ROW = 4096
BOTH_WAYS_COLUMN_TILE = (128, 64)
BOTH_WAYS_COLUMN_WARPS = 4

#: quantize_both_ways' outputs: (data, scale, data_t, scale_t).
BothWays = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def quantize_both_ways(x: torch.Tensor, format: str, encoding: str | None) -> BothWays:
    """The blockwise format: one read of each tile writes both copies. Rowwise: one read of
    whole rows writes the rows' copy and raises every column's peak, a second the columns' copy;
    rows longer than BOTH_WAYS_MAX_ROW, or too long for one read, take the two quantize calls."""
    swapped = x.stride(-1) != 1 and x.stride(-2) == 1
    row = x.shape[1 if swapped else 2]
    whole_rows = SCALED_FORMATS[format].block(3, 2)[2] == 0
    if whole_rows and (row > BOTH_WAYS_MAX_ROW or _one_read_row(row) is None):
        return (
            *quantize(x, 2, format, encoding),
            *quantize(x.transpose(1, 2), 2, format, encoding),
        )
    key = (x.shape, x.stride(), x.dtype, x.device, format, encoding, recorded_device())
    plan = _BOTH_WAYS_PLANS.get(key)
    if plan is None:
        plan = remember(_BOTH_WAYS_PLANS, key, _both_ways_plan(x, format, encoding))
    return plan(x)


_BOTH_WAYS_PLANS: dict[Any, Callable[[torch.Tensor], BothWays]] = {}


def _both_ways_plan(
    x: torch.Tensor, format: str, encoding: str | None
) -> Callable[[torch.Tensor], BothWays]:
    """quantize_both_ways of tensors shaped and strided as ``x``: square blocks in one read,
    whole rows in two (:func:`quantize_both_ways`). x is read through its stored layout: a
    transposed view is its transpose, with the two copies swapped."""
    fmt = SCALED_FORMATS[format]
    enc, encode = _encoding_constexprs(format, encoding, device_info(x.device))
    swapped = x.stride(-1) != 1 and x.stride(-2) == 1
    view = x.transpose(1, 2) if swapped else x
    experts, p, q = view.shape
    _, block_p, block_q = fmt.block(3, 2)
    rowwise = block_q == 0
    if rowwise:  # the second read's tiles
        block_p, block_q = BOTH_WAYS_COLUMN_TILE
    p_tiles, q_tiles = cdiv(p, block_p), cdiv(q, block_q)
    shapes = ((experts, p, q), (experts, q, p))
    scale_shapes = (
        ((experts, p, 1), (experts, q, 1))
        if rowwise
        else ((experts, p_tiles, q_tiles), (experts, q_tiles, p_tiles))
    )

    def outputs(x: torch.Tensor) -> BothWays:
        data, data_t = (torch.empty(s, dtype=enc.dtype, device=x.device) for s in shapes)
        scale, scale_t = (
            torch.empty(s, dtype=torch.float32, device=x.device) for s in scale_shapes
        )
        return data, scale, data_t, scale_t

    def ordered(copies: BothWays) -> BothWays:
        data, scale, data_t, scale_t = copies
        return (data_t, scale_t, data, scale) if swapped else copies

    if x.numel() == 0:

        def empty(x: torch.Tensor) -> BothWays:
            copies = outputs(x)
            for scale in copies[1::2]:
                scale.fill_(2.0**-126)  # empty blocks (p or q = 0): amax 0, the smallest scale
            return ordered(copies)

        return empty
    grid = (experts * p_tiles * q_tiles,)
    launch: Callable[..., None]
    if not rowwise:
        tiles = bind(
            _both_ways_kernel, grid, p, q, p_tiles, q_tiles, *view.stride(),
            BLOCK_P=block_p, BLOCK_Q=block_q, num_warps=BOTH_WAYS_WARPS, **encode,
        )  # fmt: skip

        def launch(view: torch.Tensor, data: Any, scale: Any, data_t: Any, scale_t: Any) -> None:
            tiles(view, data, data_t, scale, scale_t)

    else:
        q_pad = _one_read_row(q)
        assert q_pad is not None
        elements, warps = ONE_PASS_ROWS
        block_r = max(elements // q_pad, 1)
        steps = max(min(BOTH_WAYS_ROWS_PER_PROGRAM // block_r, cdiv(p, block_r)), 1)
        p_chunks = cdiv(p, steps * block_r)
        rows = bind(
            _rows_and_column_peaks_kernel, (experts * p_chunks,), p, q, p_chunks, *view.stride(),
            BLOCK_R=block_r, Q_PAD=q_pad, STEPS=steps, num_warps=warps, **encode,
        )  # fmt: skip
        columns = bind(
            _column_codes_kernel, grid, p, q, p_tiles, q_tiles, *view.stride(),
            BLOCK_P=block_p, BLOCK_Q=block_q, num_warps=BOTH_WAYS_COLUMN_WARPS, **encode,
        )  # fmt: skip

        def launch(view: torch.Tensor, data: Any, scale: Any, data_t: Any, scale_t: Any) -> None:
            col_peak = torch.zeros((experts, q), dtype=torch.float32, device=view.device)
            rows(view, data, scale, col_peak)
            columns(view, data_t, scale_t, col_peak)

    def run(x: torch.Tensor) -> BothWays:
        data, scale, data_t, scale_t = copies = outputs(x)
        view = x.transpose(1, 2) if swapped else x
        launch(view, data.view(torch.uint8), scale, data_t.view(torch.uint8), scale_t)
        return ordered(copies)

    return run


# --------------------------------------------------------------------------------------------
# The scaled grouped GEMMs
# --------------------------------------------------------------------------------------------


def _scale_strides(scale: torch.Tensor, trans_b: bool) -> tuple[int, int, int]:
    """(expert, along k, along n) strides of b's scales (b stored (E, k, n), or (E, n, k))."""
    if trans_b:
        return scale.stride(0), scale.stride(2), scale.stride(1)
    return scale.stride(0), scale.stride(1), scale.stride(2)


@functools.cache
def _hopper_scaled() -> Any:
    """:mod:`.hopper_scaled`, or None (:func:`~megablocks_triton.gmm_wgrad.tested_gluon_module`:
    the Triton kernel then serves every scaled GEMM)."""
    return tested_gluon_module("hopper_scaled")


def _warp_specialized(
    info: DeviceInfo,
    a: torch.Tensor,
    b: torch.Tensor,
    trans_b: bool,
    m: int,
    gathered: bool,
    blockwise: bool,
    out_dtype: torch.dtype,
    block_e: int,
) -> Any:
    """:mod:`.hopper_scaled` when its kernel takes this call shape, else None: a Hopper GPU (the
    arch table's ``gluon_scaled_max_k``), the sum promoted every 128 k, k below that bound, at
    least WARP_SPECIALIZED_MIN_ROWS_PER_EXPERT rows per expert on average, and layouts its
    descriptors take (:func:`hopper_scaled.serves`; the bases' alignment is checked per call),
    and no more experts than it keeps in registers (WARP_SPECIALIZED_MAX_BLOCK_E...). Rowwise:
    plain or gathered rows; blockwise: plain rows into a 16-bit output (gathered rows, or a
    float32 output, spill on sm_90a: the per-step scales beside the gathering loader or the
    float32 epilogue)."""
    max_k = arch_tuning(info).gluon_scaled_max_k
    if not WARP_SPECIALIZED or max_k is None or info.kind != "cuda":
        return None
    if blockwise and (gathered or out_dtype == torch.float32):
        return None
    if not trans_b or PROMOTE_EVERY != SCALE_BLOCK:
        return None
    if CONFIG_OVERRIDE is not None or a.shape[1] >= max_k:
        return None
    if m < WARP_SPECIALIZED_MIN_ROWS_PER_EXPERT * b.shape[0]:
        return None
    most = (
        WARP_SPECIALIZED_MAX_BLOCK_E_GATHERED_OR_BLOCKWISE
        if gathered or blockwise
        else WARP_SPECIALIZED_MAX_BLOCK_E
    )
    if block_e > most:
        return None
    module = _hopper_scaled()
    if module is None or not module.serves(a, b, out_dtype):
        return None
    return module


class _WarpSpecializedPlan:
    """One call shape's launch of the Gluon kernel (:mod:`.hopper_scaled`); operands whose bases
    its descriptors cannot take go to the Triton kernel's plan."""

    __slots__ = ("block_e", "blockwise", "fallback", "from_ends", "module", "num_sms", "top_k",
                 "zero_tail")  # fmt: skip

    def __init__(
        self,
        module: Any,
        from_ends: bool,
        zero_tail: bool,
        block_e: int,
        num_sms: int,
        top_k: int | None,
        blockwise: bool,
        fallback: _ScaledPlan,
    ) -> None:
        self.module = module
        self.top_k = top_k
        self.blockwise = blockwise
        self.from_ends = from_ends
        self.zero_tail = zero_tail
        self.block_e = block_e
        self.num_sms = num_sms
        self.fallback = fallback

    def __call__(self, *tensors: Any) -> torch.Tensor:
        a, b, sizes, ids, a_scale, b_scale, bias = tensors
        if (a.data_ptr() | b.data_ptr()) & 15:
            return self.fallback(*tensors)
        if recorded_device() is not None:  # the compile gate: the fallback's launch compiles too
            self.fallback.misaligned(*tensors)
        out = torch.empty(self.fallback.shape, dtype=self.fallback.out_dtype, device=a.device)
        self.module.launch(
            a, a_scale, b, b_scale, sizes, out, from_ends=self.from_ends,
            zero_tail=self.zero_tail, block_e=self.block_e, num_sms=self.num_sms,
            gather=None if self.top_k is None else (ids, self.top_k), blockwise=self.blockwise,
            bias=None if self.blockwise else bias,
        )  # fmt: skip
        if bias is None or not self.blockwise:
            return out
        # Blockwise, its epilogue has no registers for a bias (24 bytes spilled on sm_90a): the
        # core's addition, rounded once more.
        return add_grouped_bias(out, bias, sizes, self.from_ends)


class _ScaledPlan:
    """One call shape's scaled GEMM launch (as :class:`megablocks_triton.gmm._ForwardPlan`)."""

    __slots__ = ("out_dtype", "plain", "reads_a", "shape", "tma")

    def __init__(
        self,
        shape: tuple[int, int],
        out_dtype: torch.dtype,
        plain: BoundLaunch,
        tma: BoundLaunch | None,
        reads_a: bool,
    ) -> None:
        self.shape = shape
        self.out_dtype = out_dtype
        self.plain = plain
        self.tma = tma
        self.reads_a = reads_a

    def misaligned(self, *tensors: Any) -> torch.Tensor:
        """The launch of operands whose bases TMA cannot take: what a Gluon plan falls back to
        for them (plain rows: no descriptor; gathered rows: b's alone, x being the one
        misaligned). Recorded for the compile gate, whose meta tensors look aligned, so it
        compiles the 16-byte pointer specialisation, not the misaligned one."""
        a, b = tensors[0], tensors[1]
        out = torch.empty(self.shape, dtype=self.out_dtype, device=a.device)
        launch = self.tma if self.tma is not None and not self.reads_a else self.plain
        launch(a, b, out, *_kernel_tensors(tensors))
        return out

    def __call__(self, *tensors: Any) -> torch.Tensor:
        a, b = tensors[0], tensors[1]
        out = torch.empty(self.shape, dtype=self.out_dtype, device=a.device)
        aligned = not (b.data_ptr() | (a.data_ptr() if self.reads_a else 0)) & 15
        launch = self.tma if self.tma is not None and aligned else self.plain
        launch(a, b, out, *_kernel_tensors(tensors))
        return out


def _kernel_tensors(tensors: tuple[Any, ...]) -> tuple[torch.Tensor, ...]:
    """A plan's (a, b, sizes, ids, a_scale, b_scale, bias) as the kernel's tensors after c: the
    bias pointer is the sizes' where there is none (HAS_BIAS is off, it is never read)."""
    sizes, bias = tensors[2], tensors[6]
    return (*tensors[2:6], sizes if bias is None else bias)


def _scaled_plan(
    configs: LaunchConfigs,
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    trans_b: bool,
    m: int,
    gather_top_k: int | None,
    from_ends: bool,
    blockwise: bool,
    out_dtype: torch.dtype,
    zero_tail: bool,
    bias_stride: int | None = None,
) -> Callable[..., torch.Tensor]:
    k = a.shape[1]
    num_experts = b.shape[0]
    n = b.shape[1] if trans_b else b.shape[2]
    shape = (m, n)
    if m == 0 or n == 0:
        return lambda *t: torch.empty(shape, dtype=out_dtype, device=a.device)
    if k == 0:
        return functools.partial(_empty_k, shape, out_dtype, from_ends)
    block_e = _check_experts(num_experts)
    info = device_info(a.device)
    cfg = CONFIG_OVERRIDE or choose_config("gmm", m, n, k, num_experts, a.dtype, info)
    cfg = replace(cfg, block_k=max(cfg.block_k, MIN_BLOCK_K))
    if blockwise:
        # A K step never straddles two scale blocks; the per-step scaling does not flatten well
        # (qwen3 up/down on the H200: 585/446 TFLOP/s plain vs 498/425 flattened).
        cfg = replace(cfg, block_k=min(cfg.block_k, SCALE_BLOCK), flatten=False)
    stride_bk, stride_bn = (b.stride(2), b.stride(1)) if trans_b else (b.stride(1), b.stride(2))
    n_tiles = cdiv(n, cfg.block_n)
    max_tiles = (m // cfg.block_m + min(num_experts, m) + 1) * n_tiles
    grid = (max(1, min(_num_sms(info) * cfg.programs_per_sm, max_tiles)),)
    scalars = (
        m, n, k, num_experts, gather_top_k if gather_top_k is not None else 1,
        a.shape[0] * gather_top_k if gather_top_k is not None else m,
        a.stride(0), a.stride(1),
        b.stride(0), stride_bk, stride_bn,
        n, 1,
        a_scale.stride(0), a_scale.stride(1),
        *_scale_strides(b_scale, trans_b), bias_stride or 0,
    )  # fmt: skip
    kw = {
        "BLOCK_M": cfg.block_m,
        "BLOCK_N": cfg.block_n,
        "BLOCK_K": cfg.block_k,
        "BLOCK_E": block_e,
        "GROUP_M": cfg.group_m,
        "EVEN_K": k % cfg.block_k == 0,
        "BLOCKWISE": blockwise,
        "SCALE_BLOCK": SCALE_BLOCK if blockwise else 1,
        "PROMOTE": cfg.block_k if PROMOTE_EVERY is None else min(PROMOTE_EVERY, cfg.block_k),
        "NO_PROMOTION": PROMOTE_EVERY is None,
        "TRANS_B": trans_b,
        "GATHER": gather_top_k is not None,
        "FROM_ENDS": from_ends,
        "ZERO_TAIL": zero_tail,
        "INTERPRETED": info.kind == "cpu",
        "FLATTEN": cfg.flatten,
        "HAS_BIAS": bias_stride is not None,
        "num_warps": cfg.num_warps,
        "num_stages": cfg.num_stages,
        **configs.launch_options("gmm"),
    }
    plain = bind(_scaled_gmm_kernel, grid, *scalars, B_TMA=False, **kw)
    tma: BoundLaunch | None = None
    gather = gather_top_k is not None
    # Gathered rows cannot come through a descriptor (no row gather before Blackwell): then only
    # b does.
    if cfg.use_tma and _tma_layout_ok(info, b):
        b_block = [1, cfg.block_n, cfg.block_k] if trans_b else [1, cfg.block_k, cfg.block_n]
        blocks = {1: b_block}
        a_tma = not gather and _tma_layout_ok(info, a)
        if a_tma:
            blocks[0] = [cfg.block_m, cfg.block_k]
        tma = bind_descriptors(
            _scaled_gmm_kernel, grid, *scalars, descriptors=blocks, B_TMA=True, A_TMA=a_tma, **kw
        )
    triton_plan = _ScaledPlan(shape, out_dtype, plain, tma, reads_a=not gather)
    if gather_top_k is not None and GATHER_FIRST:
        first = _gather_first_plan(
            configs, info, a, a_scale, b, b_scale, trans_b, m, gather_top_k, blockwise,
            out_dtype, zero_tail, block_e, bias_stride,
        )  # fmt: skip
        if first is not None:
            return first
    hopper = _warp_specialized(info, a, b, trans_b, m, gather, blockwise, out_dtype, block_e)
    if hopper is None:
        return triton_plan
    return _WarpSpecializedPlan(
        hopper, from_ends, zero_tail, block_e, _num_sms(info), gather_top_k, blockwise,
        triton_plan,
    )  # fmt: skip


def _empty_k(
    shape: tuple[int, int], out_dtype: torch.dtype, from_ends: bool, *tensors: Any
) -> torch.Tensor:
    """The plan of an empty K: zero products, each grouped row its expert's bias if given."""
    out = torch.zeros(shape, dtype=out_dtype, device=tensors[0].device)
    bias = tensors[6]
    return out if bias is None else add_grouped_bias(out, bias, tensors[2], from_ends)


class _GatherFirstPlan:
    """Gathered rows copied into sorted order first, then the plain rows' plan on the copy. The
    copy is :mod:`.permutation`'s gather, which moves bytes as they are: the FP8 rows as float32
    words (four values each), their scales as rows of their own. An id out of range gives a zero
    row and zero scales, so its output row is 0 (non-finite weight scales aside, as in the
    reference's product of a zero row). The plain kernel's sums are the gathering one's, in the
    same order: the same output bit for bit."""

    __slots__ = ("gather_rows", "gather_scales", "plain")

    def __init__(
        self,
        gather_rows: Callable[..., torch.Tensor],
        gather_scales: Callable[..., torch.Tensor],
        plain: Callable[..., torch.Tensor],
    ) -> None:
        self.gather_rows = gather_rows
        self.gather_scales = gather_scales
        self.plain = plain

    def __call__(self, *tensors: Any) -> torch.Tensor:
        x, b, bins, indices, x_scale, b_scale, bias = tensors
        words = self.gather_rows(_as_words(x), indices, None, bins)
        scales = self.gather_scales(x_scale.contiguous(), indices, None, bins)
        return self.plain(words.view(x.dtype), b, bins, bins, scales, b_scale, bias)


def _as_words(x: torch.Tensor) -> torch.Tensor:
    """Contiguous FP8 rows (k a multiple of 16) as float32 words of their bytes."""
    x = x.contiguous()
    if x.storage_offset() % 4:  # a start inside a word: a copy that starts on one
        x = x.clone()
    return x.view(torch.float32)


def _gather_first_plan(
    configs: LaunchConfigs,
    info: DeviceInfo,
    x: torch.Tensor,
    x_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    trans_b: bool,
    m: int,
    top_k: int,
    blockwise: bool,
    out_dtype: torch.dtype,
    zero_tail: bool,
    block_e: int,
    bias_stride: int | None,
) -> _GatherFirstPlan | None:
    """The :class:`_GatherFirstPlan` of a gathered call shape where plain rows of its shape take
    the Gluon kernel (:func:`_gathers_first`), else None."""
    from .permutation import _gather_plan

    tokens, k = x.shape
    layout = torch.empty((m, k), dtype=x.dtype, device="meta")  # the copy's
    if not _gathers_first(info, layout, b, trans_b, m, blockwise, out_dtype, block_e):
        return None
    # The plans read shapes, strides and the device (made once per call shape).
    rows, row_scales = x.new_empty((m, k)), x_scale.new_empty((m, x_scale.shape[1]))
    plain = _scaled_plan(configs, rows, row_scales, b, b_scale, trans_b, m, None, True, blockwise,
                         out_dtype, zero_tail, bias_stride)  # fmt: skip
    n, experts = tokens * top_k, b.shape[0]
    words = x.new_empty((tokens, k // 4), dtype=torch.float32)
    return _GatherFirstPlan(
        _gather_plan(configs, words, n, experts, top_k, False, m),
        _gather_plan(configs, x_scale.new_empty(x_scale.shape), n, experts, top_k, False, m),
        plain,
    )


def _gathers_first(
    info: DeviceInfo,
    rows: torch.Tensor,
    b: torch.Tensor,
    trans_b: bool,
    m: int,
    blockwise: bool,
    out_dtype: torch.dtype,
    block_e: int,
) -> bool:
    """Whether plain rows like ``rows`` take the Gluon kernel (the copy pays only there)."""
    return (
        _warp_specialized(info, rows, b, trans_b, m, False, blockwise, out_dtype, block_e)
        is not None
    )


#: Per call shape and launch policy: the prepared scaled launches.
_SCALED_PLANS: dict[Any, Callable[..., torch.Tensor]] = {}


def _planned(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    trans_b: bool,
    m: int,
    gather_top_k: int | None,
    from_ends: bool,
    format: str,
    out_dtype: torch.dtype,
    zero_tail: bool = True,
    sizes_dtype: torch.dtype | None = None,
    indices_dtype: torch.dtype | None = None,
    bias: torch.Tensor | None = None,
) -> Callable[..., torch.Tensor]:
    configs = launch_configs()
    bias_stride = None if bias is None else bias.stride(0)
    key = (
        a.shape, a.stride(), a.dtype, a.device, a_scale.shape, a_scale.stride(),
        b.shape, b.stride(), b.dtype, b_scale.shape, b_scale.stride(), sizes_dtype,
        indices_dtype, m, trans_b, gather_top_k, from_ends, format, out_dtype, zero_tail, configs,
        bias_stride, None if bias is None else bias.dtype,
        CONFIG_OVERRIDE, WARP_SPECIALIZED, PROMOTE_EVERY, GATHER_FIRST,  # measurement switches
    )  # fmt: skip
    plan = _SCALED_PLANS.get(key)
    if plan is None:
        blockwise = SCALED_FORMATS[format].matrix_block != 0
        plan = remember(
            _SCALED_PLANS,
            key,
            _scaled_plan(
                configs,
                a,
                a_scale,
                b,
                b_scale,
                trans_b,
                m,
                gather_top_k,
                from_ends,
                blockwise,
                out_dtype,
                zero_tail,
                bias_stride,
            ),
        )
    return plan


def _k_major(
    b: torch.Tensor, b_scale: torch.Tensor, trans_b: bool
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """b stored (experts, n, k), its reduced dim contiguous, on a GPU: FP8 matrix instructions
    read B K-major (the FP8 recipes quantize their weights that way; other callers pay a copy,
    never a different code path). The interpreter takes either layout."""
    if trans_b or b.device.type == "cpu":
        return b, b_scale, trans_b
    return b.transpose(1, 2).contiguous(), b_scale.transpose(1, 2).contiguous(), True


def scaled_gmm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    batch_sizes: torch.Tensor,
    trans_b: bool,
    format: str,
    out_dtype: str | None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    sizes = _device_sizes(batch_sizes, a.device)
    b, b_scale, trans_b = _k_major(b, b_scale, trans_b)
    bias, _ = _bias_layout(bias)
    plan = _planned(
        a, a_scale, b, b_scale, trans_b, a.shape[0], None, False, format,
        out_dtype_of(out_dtype), sizes_dtype=sizes.dtype, bias=bias,
    )  # fmt: skip
    return plan(a, b, sizes, sizes, a_scale, b_scale, bias)


def scaled_gather_gmm(
    x: torch.Tensor,
    x_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    indices: torch.Tensor,
    bin_ids: torch.Tensor,
    bins: torch.Tensor,
    top_k: int,
    trans_b: bool,
    rows: int | None,
    format: str,
    out_dtype: str | None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    b, b_scale, trans_b = _k_major(b, b_scale, trans_b)
    bias, _ = _bias_layout(bias)
    m = indices.shape[0] if rows is None else rows
    plan = _planned(
        x, x_scale, b, b_scale, trans_b, m, int(top_k), True, format, out_dtype_of(out_dtype),
        sizes_dtype=bins.dtype, indices_dtype=indices.dtype, bias=bias,
    )  # fmt: skip
    return plan(x, b, bins, indices, x_scale, b_scale, bias)


def scaled_gmm_scatter(
    x: torch.Tensor,
    x_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    indices: torch.Tensor,
    bin_ids: torch.Tensor,
    weights: torch.Tensor | None,
    bins: torch.Tensor,
    top_k: int,
    trans_b: bool,
    rows: int | None,
    format: str,
    out_dtype: str | None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    from .permutation import _scatter_plan

    b, b_scale, trans_b = _k_major(b, b_scale, trans_b)
    bias, _ = _bias_layout(bias)
    dtype = out_dtype_of(out_dtype)
    # The bias goes into each product row before the weighted sum, as the contract says.
    gemm = _planned(
        x, x_scale, b, b_scale, trans_b, x.shape[0], None, True, format, dtype,
        zero_tail=False, sizes_dtype=bins.dtype, bias=bias,
    )  # fmt: skip
    products = gemm(x, b, bins, bins, x_scale, b_scale, bias)
    configs = launch_configs()
    # Everything the pinned scatter launch depends on: shapes and dtypes of every operand (a
    # launch compiled for float32 weights must never read bfloat16 ones), device and policy.
    key = (
        products.shape, dtype, products.device, indices.shape, indices.dtype, bins.shape,
        bins.dtype, None if weights is None else weights.dtype, int(top_k), configs,
    )  # fmt: skip
    reduce = _SCATTER_PLANS.get(key)
    if reduce is None:
        meta = torch.empty(products.shape, dtype=dtype, device="meta")
        reduce = remember(
            _SCATTER_PLANS,
            key,
            _scatter_plan(
                configs,
                meta,
                indices.numel(),
                bins.numel(),
                int(top_k),
                weights is not None,
                grouped_rows=True,
            ),
        )
    return reduce(products, indices, weights, bins)


_SCATTER_PLANS: dict[Any, Callable[..., torch.Tensor]] = {}


# --------------------------------------------------------------------------------------------
# the weight gradient: quantize_transposed and scaled_gmm_weight_grad
# --------------------------------------------------------------------------------------------

#: quantize_transposed's (BLOCK_R, BLOCK_C) tile, num_warps and its loops' stages: the fastest
#: of a sweep on an H100 (docs/performance.md). Groups held whole in registers, read once, were
#: 1.2-20x slower (they spill).
TRANSPOSED_TILE = (64, 32)
TRANSPOSED_WARPS = 2
TRANSPOSED_STAGES = 3
#: The Triton weight gradient's tile (M, N, K: 128 rows a product, the promotion's depth),
#: warps and stages.
WGRAD_TILE = (128, 128, 128)
WGRAD_WARPS = 8
WGRAD_STAGES = 3
#: Whether scaled_gmm_weight_grad takes :mod:`.hopper_scaled_wgrad` where it serves (a switch
#: for measurements: the Triton kernel otherwise).
WGRAD_WARP_SPECIALIZED = True

_TRANSPOSED_PLANS: dict[Any, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {}
_WGRAD_PLANS: dict[Any, Callable[..., torch.Tensor]] = {}


def quantize_transposed(
    x: torch.Tensor, batch_sizes: torch.Tensor, format: str, encoding: str | None
) -> tuple[torch.Tensor, torch.Tensor]:
    sizes = _device_sizes(batch_sizes, x.device)
    key = (
        x.shape, x.stride(), x.dtype, x.device, sizes.shape, sizes.dtype, format, encoding,
        recorded_device(),
    )  # fmt: skip
    plan = _TRANSPOSED_PLANS.get(key)
    if plan is None:
        plan = _transposed_plan(x, x.shape[0], sizes.shape[0], format, encoding)
        remember(_TRANSPOSED_PLANS, key, plan)
    return plan(x, sizes, x, x)


def gather_quantize_transposed(
    x: torch.Tensor,
    indices: torch.Tensor,
    weights: torch.Tensor | None,
    top_k: int,
    batch_sizes: torch.Tensor,
    rows: int | None,
    format: str,
    encoding: str | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    sizes = _device_sizes(batch_sizes, x.device)
    # The kernel reads the ids and weights at unit stride.
    indices = indices.contiguous()
    weights = None if weights is None else weights.contiguous()
    key = (
        "gathered", x.shape, x.stride(), x.dtype, x.device, indices.shape, indices.dtype,
        None if weights is None else weights.dtype, top_k, rows, sizes.shape, sizes.dtype,
        format, encoding, recorded_device(),
    )  # fmt: skip
    plan = _TRANSPOSED_PLANS.get(key)
    if plan is None:
        gathered = indices.shape[0] if rows is None else rows
        through = _Gathered(indices.shape[0], top_k, weights is not None)
        plan = _transposed_plan(x, gathered, sizes.shape[0], format, encoding, through)
        remember(_TRANSPOSED_PLANS, key, plan)
    return plan(x, sizes, indices, x if weights is None else weights)


class _Gathered(NamedTuple):
    """How quantize_transposed's rows are read from token rows: gather's flat ids (ids of
    [0, ids) name rows), its top_k, whether the rows are weighted."""

    ids: int
    top_k: int
    weighted: bool


def _transposed_plan(
    x: torch.Tensor,
    rows: int,
    experts: int,
    format: str,
    encoding: str | None,
    gathered: _Gathered | None = None,
) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """quantize_transposed's launch for ``rows`` rows of x's width: x's own rows, or the rows
    that ``gathered`` reads through the ids. The plan takes (x, sizes, ids, weights), the ids
    and weights tensors ignored (any tensor) for x's own rows."""
    enc, encode = _encoding_constexprs(format, encoding, device_info(x.device))
    columns = x.shape[1]

    def outputs(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        data = torch.empty(columns, rows, dtype=enc.dtype, device=x.device)
        return data, torch.empty(experts, columns, dtype=torch.float32, device=x.device)

    if columns == 0 or experts == 0:  # no groups: every row is past them, its data 0

        def degenerate(
            x: torch.Tensor, sizes: torch.Tensor, *_: Any
        ) -> tuple[torch.Tensor, torch.Tensor]:
            data, scale = outputs(x)
            return data.zero_(), scale

        return degenerate
    block_r, block_c = TRANSPOSED_TILE
    c_tiles = cdiv(columns, block_c)
    through = {} if gathered is None else {
        "TOP_K": gathered.top_k, "GATHERED": True, "WEIGHTED": gathered.weighted,
    }  # fmt: skip
    bound = bind(
        _quantize_transposed_kernel,
        ((experts + 1) * c_tiles,),  # and the rows past every group
        rows, columns, experts, c_tiles, *x.stride(), 0 if gathered is None else gathered.ids,
        BLOCK_R=block_r, BLOCK_C=block_c, BLOCK_E=_check_experts(experts),
        STAGES=TRANSPOSED_STAGES, num_warps=TRANSPOSED_WARPS, **encode, **through,
    )  # fmt: skip

    def run(
        x: torch.Tensor, sizes: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        data, scale = outputs(x)
        bound(x, data.view(torch.uint8), scale, sizes, ids, weights)
        return data, scale

    return run


def _hopper_scaled_wgrad() -> Any:
    """:mod:`.hopper_scaled_wgrad`, or None (as :func:`_hopper_scaled`)."""
    return tested_gluon_module("hopper_scaled_wgrad")


def scaled_gmm_weight_grad(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    grad: torch.Tensor,
    grad_scale: torch.Tensor,
    batch_sizes: torch.Tensor,
    format: str,
    out_dtype: str | None,
) -> torch.Tensor:
    sizes = _device_sizes(batch_sizes, a.device)
    dtype = out_dtype_of(out_dtype)
    key = (
        a.shape, a.stride(), a.dtype, a.device, grad.shape, grad.stride(), sizes.shape,
        sizes.dtype, dtype, WGRAD_WARP_SPECIALIZED, recorded_device(),
    )  # fmt: skip
    plan = _WGRAD_PLANS.get(key)
    if plan is None:
        plan = remember(_WGRAD_PLANS, key, _wgrad_plan(a, grad, sizes.shape[0], dtype))
    return plan(a, a_scale, grad, grad_scale, sizes)


def _wgrad_plan(
    a: torch.Tensor, grad: torch.Tensor, experts: int, out_dtype: torch.dtype
) -> Callable[..., torch.Tensor]:
    (m, rows), n = a.shape, grad.shape[0]
    shape = (experts, m, n)
    if experts == 0 or m == 0 or n == 0 or rows == 0:
        return lambda *t: torch.zeros(shape, dtype=out_dtype, device=a.device)
    info = device_info(a.device)
    block_e = _check_experts(experts)
    block_m, block_n, block_k = WGRAD_TILE
    tiles = experts * cdiv(m, block_m) * cdiv(n, block_n)
    bound = bind(
        _scaled_wgrad_kernel,
        (max(1, min(_num_sms(info), tiles)),),
        m, n, rows, experts, *a.stride(), *grad.stride(),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_E=block_e, PROMOTE=block_k,
        INTERPRETED=info.kind == "cpu", num_warps=WGRAD_WARPS, num_stages=WGRAD_STAGES,
    )  # fmt: skip
    hopper = _hopper_scaled_wgrad() if _warp_specialized_wgrad(info, a, grad, out_dtype) else None

    def run(
        a: torch.Tensor,
        a_scale: torch.Tensor,
        grad: torch.Tensor,
        grad_scale: torch.Tensor,
        sizes: torch.Tensor,
    ) -> torch.Tensor:
        out = torch.empty(shape, dtype=out_dtype, device=a.device)
        if hopper is not None and hopper.serves(a, grad, out):  # the bases' alignment, per call
            hopper.launch(
                a, a_scale, grad, grad_scale, sizes, out, block_e=block_e, num_sms=_num_sms(info)
            )
        else:
            bound(a, grad, out, sizes, a_scale, grad_scale)
        return out

    return run


def _warp_specialized_wgrad(
    info: DeviceInfo, a: torch.Tensor, grad: torch.Tensor, out_dtype: torch.dtype
) -> bool:
    """Whether the Gluon weight gradient may take this call shape: an arch whose table row runs
    it (``gluon_scaled_wgrad``: Hopper) and OCP data (:func:`hopper_scaled_wgrad.serves` checks
    the layouts)."""
    return (
        WGRAD_WARP_SPECIALIZED
        and info.kind == "cuda"
        and arch_tuning(info).gluon_scaled_wgrad
        and a.dtype == torch.float8_e4m3fn
        and _hopper_scaled_wgrad() is not None
    )


def scaled_gmm_supports(device: DeviceInfo, call: Any) -> str | None:
    """The data's encoding must be the one the device's matrix units take (the interpreter
    takes both, but rounds bfloat16 products wrongly on their way into the scatter kernel)."""
    if device.kind == "cpu":
        if "weights" in call and call.get("out_dtype") in (None, "bfloat16"):
            return "Triton's interpreter truncates the bfloat16 products the scatter sums"
        return None
    native = native_encoding(device)
    for name in ("a", "x"):
        meta = call.get(name)
        if meta is not None and meta.dtype != native.dtype:
            dtype = str(meta.dtype).removeprefix("torch.")
            return f"{device} multiplies {native.name} FP8, not {dtype}"
    return None


scaled_gather_gmm_supports = scaled_gmm_supports
scaled_gmm_scatter_supports = scaled_gmm_supports
scaled_gmm_weight_grad_supports = scaled_gmm_supports


def compile_calls(shape: Any, device: DeviceInfo) -> Any:
    """(op, call) of the low-precision ops at a layer ``shape`` on ``device`` (meta tensors, for
    the compile gate): every format, the transpose-quantize of both weights, both GEMM layouts,
    the layer's two GEMMs with and without a bias, and (rowwise) the weight gradients' operands
    and GEMMs; none on a device without FP8 matrix instructions."""
    if fp8_capability(device) is not None:
        return
    t, h, f, e, k = shape.tokens, shape.hidden, shape.ffn, shape.experts, shape.top_k
    rows = t * k
    enc = native_encoding(device)
    i32, bf16 = torch.int32, torch.bfloat16
    ids, counts = _meta(rows, dtype=i32), _meta(e, dtype=i32)
    weights = _meta(rows, dtype=torch.float32)
    x, hidden = _meta(t, h, dtype=bf16), _meta(rows, f, dtype=bf16)
    w1, w2 = _meta(e, h, f, dtype=bf16), _meta(e, f, h, dtype=bf16)
    for format in SCALED_FORMATS:
        yield "quantize", functools.partial(quantize, x, 1, format, None)
        yield "quantize", functools.partial(quantize, w1.transpose(1, 2), 2, format, None)
        yield "quantize", functools.partial(quantize, w2, 2, format, None)  # (experts, n, k) as is
        for w in (w1, w2):  # rowwise: whole rows in one read where they fit, else two passes
            yield "quantize_both_ways", functools.partial(quantize_both_ways, w, format, None)
        x8, sx = _quantized_meta(x, format, 1, enc.dtype)
        h8, sh = _quantized_meta(hidden, format, 1, enc.dtype)
        w1t, s1 = _quantized_meta(w1.transpose(1, 2), format, 2, enc.dtype)
        w2t, s2 = _quantized_meta(w2.transpose(1, 2), format, 2, enc.dtype)
        for biased in (False, True):
            bias1 = _meta(e, f, dtype=bf16) if biased else None
            bias2 = _meta(e, h, dtype=bf16) if biased else None
            yield "scaled_gather_gmm", functools.partial(
                scaled_gather_gmm, x8, sx, w1t, s1, ids, ids, counts, k, True, None, format,
                None, bias1,
            )  # fmt: skip
            yield "scaled_gmm_scatter", functools.partial(
                scaled_gmm_scatter, h8, sh, w2t, s2, ids, ids, weights, counts, k, True, None,
                format, None, bias2,
            )  # fmt: skip
        yield (
            "scaled_gmm",
            functools.partial(scaled_gmm, h8, sh, w2t, s2, counts, True, format, None),
        )
        if SCALED_FORMATS[format].grouped_columns:  # the weight gradients' operands and GEMMs
            up, down = _meta(rows, 2 * f, dtype=bf16), _meta(rows, h, dtype=bf16)
            for operand in (hidden, up, down):
                yield (
                    "quantize_transposed",
                    functools.partial(quantize_transposed, operand, counts, format, None),
                )
            for scale in (None, weights):  # gather_gmm's rows; gmm_scatter's output gradient
                yield (
                    "gather_quantize_transposed",
                    functools.partial(
                        gather_quantize_transposed, x, ids, scale, k, counts, None, format, None
                    ),
                )
            for m, n in ((h, 2 * f), (f, h)):
                a8, a_scale = _meta(m, rows, dtype=enc.dtype), _meta(e, m, dtype=torch.float32)
                g8, g_scale = _meta(n, rows, dtype=enc.dtype), _meta(e, n, dtype=torch.float32)
                yield (
                    "scaled_gmm_weight_grad",
                    functools.partial(
                        scaled_gmm_weight_grad, a8, a_scale, g8, g_scale, counts, format, None
                    ),
                )


def _meta(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def _quantized_meta(
    x: torch.Tensor, format: str, reduce_dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    block = SCALED_FORMATS[format].block(x.dim(), reduce_dim)
    shape = tuple(1 if b == 0 else cdiv(s, b) for s, b in zip(x.shape, block, strict=True))
    return _meta(*x.shape, dtype=dtype), _meta(*shape, dtype=torch.float32)
