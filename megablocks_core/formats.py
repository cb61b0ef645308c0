"""Low-precision operand formats of the scaled grouped GEMMs, as data.

A *format* says how a GEMM's two operands are stored in 8 bits: which blocks of each operand
share one float32 scale (its :class:`Scaling`), whether the scales are powers of two, and which
8-bit float *encoding* holds the data. Everything else derives from this module: the contracts'
rules on scale shapes (:mod:`megablocks_core.contracts.scaled`), the fake outputs under
``torch.compile``, the kit's samples, the reference kernels and the compile gate's FP8 jobs.
A kernel declares the formats it takes (``Kernel.formats``); a call in another format goes to
another kernel, never silently to a wider one.

Quantization, exactly (:func:`quantize`, the definition every backend matches bit for bit):

1. x is taken in float32 (float64 input is rounded to float32 first);
2. each block's ``amax`` is the largest ``|x|`` in it (0 for an empty block);
3. ``scale = max(amax / encoding.max, 2**-126)`` in float32 (the floor keeps ``1 / scale``
   finite for an all-zero or tiny block), rounded up to a power of two where the format says;
4. ``data = encode(clamp(x * (1 / scale), -max, max))``: the float32 reciprocal, one float32
   product, then round to nearest, ties to even, into the encoding (saturating: the clamp); a
   value that rounds to zero is +0 in an encoding without negative zero (FNUZ);
5. a block holding a NaN or an infinity gets scale NaN and every element NaN: non-finite input
   never turns into finite numbers.

Dequantized, ``x ≈ data * scale`` (each scale repeated over its block).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import torch

from .descriptors import DeviceInfo

SCALE_DTYPE = torch.float32
#: The smallest scale (the smallest normal float32): 1 / scale stays finite.
MIN_SCALE = 2.0**-126
#: The side of a square scale block, and the length of a row block, in the block formats.
BLOCK = 128


@dataclass(frozen=True)
class Encoding:
    """One 8-bit float encoding of the data (sign, 4 exponent bits, 3 mantissa bits)."""

    name: str
    dtype: torch.dtype
    max: float
    """The largest finite value: values are clamped to it (saturation)."""
    exponent_bias: int
    negative_zero: bool
    """False for FNUZ encodings, whose bit pattern 0x80 is their only NaN."""
    doc: str

    @property
    def min_normal(self) -> float:
        return 2.0 ** (1 - self.exponent_bias)

    @property
    def min_subnormal(self) -> float:
        return 2.0 ** (1 - self.exponent_bias - 3)


E4M3FN = Encoding(
    "e4m3fn",
    torch.float8_e4m3fn,
    448.0,
    7,
    True,
    "OCP FP8 E4M3 (torch.float8_e4m3fn): NVIDIA sm_89+, AMD gfx950 (CDNA4), and the CPU",
)
E4M3FNUZ = Encoding(
    "e4m3fnuz",
    torch.float8_e4m3fnuz,
    240.0,
    8,
    False,
    "FNUZ FP8 E4M3 (torch.float8_e4m3fnuz, exponent bias 8, no -0, no inf): AMD gfx942 (CDNA3)",
)
ENCODINGS: Mapping[str, Encoding] = MappingProxyType({e.name: e for e in (E4M3FN, E4M3FNUZ)})
BY_DTYPE: Mapping[torch.dtype, Encoding] = MappingProxyType(
    {e.dtype: e for e in ENCODINGS.values()}
)
FP8_DTYPES = frozenset(BY_DTYPE)

#: Archs whose matrix units take FNUZ, not OCP, FP8 (CDNA3).
FNUZ_ARCHS = frozenset({"gfx940", "gfx941", "gfx942"})


def native_encoding(device: DeviceInfo) -> Encoding:
    """The encoding a device's matrix units take: FNUZ on CDNA3, OCP everywhere else."""
    return E4M3FNUZ if (device.arch or "").split(":")[0] in FNUZ_ARCHS else E4M3FN


@dataclass(frozen=True)
class Format:
    """How both operands of a scaled grouped GEMM are cut into blocks that share a scale.

    The row operand (``(rows, k)``: tokens, sorted rows, gradients) has one scale per
    ``row_block`` elements along k (0: the whole row). The expert matrices (``(experts, k, n)``,
    or ``(experts, n, k)`` stored transposed) have, with ``matrix_block`` 0, one scale per output
    column (per vector along the reduced dim k), else one per ``matrix_block`` x
    ``matrix_block`` tile of the two matrix dims (the same tiles whichever dim is reduced, so one
    quantization serves a matrix and its transpose)."""

    name: str
    row_block: int
    matrix_block: int
    power_of_two: bool
    doc: str
    grouped_columns: bool = False
    """Whether the format defines the weight gradient's operands: a row operand's columns, each
    scaled over each expert's rows (the weight gradient sums over rows), stored transposed
    (:func:`grouped_column_scale_shape`)."""

    def block(self, ndim: int, reduce_dim: int) -> tuple[int, ...]:
        """Per dimension of the stored operand, the length of a scale block (0: the whole
        dimension); ``reduce_dim`` is the dimension the GEMM sums over."""
        if ndim == 2:
            return (1, self.row_block)
        if self.matrix_block:
            return (1, self.matrix_block, self.matrix_block)
        return tuple(0 if d == reduce_dim else 1 for d in range(3))


FORMATS: Mapping[str, Format] = MappingProxyType(
    {
        f.name: f
        for f in (
            Format(
                "fp8_rowwise",
                row_block=0,
                matrix_block=0,
                power_of_two=False,
                doc="one scale per row of the row operand and per output column of each expert "
                "matrix (torch._scaled_grouped_mm's rowwise scaling)",
                grouped_columns=True,
            ),
            Format(
                "fp8_blockwise",
                row_block=BLOCK,
                matrix_block=BLOCK,
                power_of_two=True,
                doc="one power-of-two scale per 1x128 block of the row operand and per 128x128 "
                "tile of each expert matrix (DeepSeek-V3's and Transformer Engine's block scaling)",
            ),
        )
    }
)
FORMAT_NAMES: tuple[str, ...] = tuple(FORMATS)


def scale_shape(shape: Sequence[int], block: Sequence[int]) -> tuple[int, ...]:
    """The scale tensor's shape for data of ``shape`` cut into ``block`` s (0: whole dim)."""
    return tuple(1 if b == 0 else -(-s // b) for s, b in zip(shape, block, strict=True))


def operand_scale_shape(fmt: str, shape: Sequence[int], reduce_dim: int) -> tuple[int, ...]:
    """The scale shape of an operand of ``shape`` in format ``fmt`` summed over ``reduce_dim``."""
    return scale_shape(shape, FORMATS[fmt].block(len(shape), reduce_dim))


def has_grouped_columns(fmt: str) -> bool:
    """Whether format ``fmt`` defines the weight gradient's operands (Format.grouped_columns)."""
    return FORMATS[fmt].grouped_columns


def grouped_column_scale_shape(fmt: str, experts: int, columns: int) -> tuple[int, ...]:
    """The scale shape of a weight-gradient operand in format ``fmt``: one scale per column per
    expert, (experts, columns)."""
    if not has_grouped_columns(fmt):
        raise ValueError(f"format {fmt!r} defines no weight-gradient operands")
    return (experts, columns)


def out_dtype_of(name: str | None) -> torch.dtype:
    """A scaled op's output dtype, given by name (None: bfloat16)."""
    dtype: torch.dtype = getattr(torch, name or "bfloat16")
    return dtype


def encoding_of(name: str | None, device: torch.device) -> Encoding:
    """The encoding named, or (None) the one the device's matrix units take."""
    if name is not None:
        return ENCODINGS[name]
    if device.type in ("cpu", "meta"):
        return E4M3FN
    from .devices import describe  # a real device: its arch decides

    return native_encoding(describe(device))


def _blocked(x: torch.Tensor, block: Sequence[int]) -> torch.Tensor:
    """x viewed as (n0, b0, n1, b1, ...): each dim cut into its blocks, zero-padded at its end."""
    pad: list[int] = []
    split: list[int] = []
    for size, b in zip(x.shape, block, strict=True):
        length = size if b == 0 else b
        count = 1 if b == 0 else -(-size // b)
        pad = [0, count * length - size, *pad]
        split += [count, max(length, 0)]
    padded = torch.nn.functional.pad(x, pad) if any(pad) else x
    return padded.reshape(split)


def _unblocked(blocked: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """The inverse of :func:`_blocked`: the original shape, padding cut off."""
    dims = len(shape)
    merged = blocked.reshape([blocked.shape[2 * d] * blocked.shape[2 * d + 1] for d in range(dims)])
    return merged[tuple(slice(0, s) for s in shape)]


def round_up_to_power_of_two(scale: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= each positive finite scale (others unchanged)."""
    mantissa, exponent = torch.frexp(scale)  # scale = mantissa * 2**exponent, 0.5 <= mantissa < 1
    exponent = torch.where(mantissa == 0.5, exponent - 1, exponent)
    rounded = torch.ldexp(torch.ones_like(scale), exponent)
    return torch.where(torch.isfinite(scale) & (scale > 0), rounded, scale)


def quantize(
    x: torch.Tensor, block: Sequence[int], encoding: Encoding, power_of_two: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition of quantization (module docstring): (data in ``encoding.dtype``, float32
    scales of :func:`scale_shape`), both contiguous, on x's device."""
    values = x.to(torch.float32)
    blocked = _blocked(values, block)
    inner = tuple(range(1, blocked.dim(), 2))
    if blocked.numel() == 0:
        amax = blocked.new_zeros([blocked.shape[d] for d in range(0, blocked.dim(), 2)])
    else:
        amax = blocked.abs().amax(dim=inner)
    # Tensor by tensor: torch divides a CUDA tensor by a Python number as a multiply by its
    # reciprocal, 1 ulp off the quotient at times (and a tie in the encoding moves with it).
    scale = torch.clamp_min(amax / torch.full_like(amax, encoding.max), MIN_SCALE)
    if power_of_two:
        scale = round_up_to_power_of_two(scale)
    scale = torch.where(torch.isfinite(scale), scale, torch.full_like(scale, math.nan))
    expanded = scale.reshape([s for d in range(scale.dim()) for s in (scale.shape[d], 1)])
    scaled = (blocked * (torch.ones_like(expanded) / expanded)).clamp(-encoding.max, encoding.max)
    if not encoding.negative_zero:
        scaled = torch.where(scaled == 0, torch.zeros_like(scaled), scaled)  # -0 is FNUZ's NaN
    data = _unblocked(scaled, values.shape).to(encoding.dtype).contiguous()
    return data, scale.contiguous()


def dequantize(data: torch.Tensor, scale: torch.Tensor, block: Sequence[int]) -> torch.Tensor:
    """data * scale in float32, each scale repeated over its block."""
    blocked = _blocked(data.to(torch.float32), block)
    expanded = scale.reshape([s for d in range(scale.dim()) for s in (scale.shape[d], 1)])
    return _unblocked(blocked * expanded, data.shape)


def quantize_transposed(
    x: torch.Tensor, group_sizes: Sequence[int], encoding: Encoding, power_of_two: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition of a weight gradient's operand (``quantize_transposed``): x (rows, c) in
    groups of ``group_sizes`` rows from row 0 (each in [0, rows left]), each column of each
    group one block of :func:`quantize`. Returns data (c, rows) contiguous (the rows past the
    groups 0) and float32 scales (groups, c)."""
    rows, columns = x.shape
    data = torch.zeros(columns, rows, dtype=encoding.dtype, device=x.device)
    scale = torch.empty(len(group_sizes), columns, dtype=SCALE_DTYPE, device=x.device)
    start = 0
    for group, size in enumerate(group_sizes):
        block_data, block_scale = quantize(
            x[start : start + size].t(), (1, 0), encoding, power_of_two
        )
        data[:, start : start + size] = block_data
        scale[group] = block_scale[:, 0]
        start += size
    return data, scale
