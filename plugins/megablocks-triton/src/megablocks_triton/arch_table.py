"""The per-arch table: :data:`ARCHS`, everything this backend knows about each GPU arch family
(tiles, adjustments, dense rate, measured points), and its lookups (:func:`gmm_tile_family`,
:func:`arch_tuning`, :func:`by_arch`). The launch policy (:mod:`megablocks_triton.config`, which
re-exports these names), the cost hints (:mod:`megablocks_triton.tuning`), the grouped GEMMs and
the compile gate read an arch's facts here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from megablocks_core.plugin import DeviceInfo, GmmPoint, base_arch

from .launch_types import GmmConfig


def _empty() -> Mapping[Any, Any]:
    return MappingProxyType({})


@dataclass(frozen=True)
class ReduceEpilogue:
    """The accumulating weight gradient's TMA-reduction epilogue on one family, for 16-bit
    operands adding into a gradient of one dtype class: block caps and pipeline depth."""

    num_stages: int
    max_block_k: int
    max_block_n: int | None = None


@dataclass(frozen=True)
class ArchTuning:
    """Everything this backend knows about one GPU arch family (a row of :data:`ARCHS`).

    A new arch's tuning is one new row: the default policy (:class:`LaunchConfigs`), the cost
    hints (:mod:`megablocks_triton.tuning`), the TMA and Gluon paths (:mod:`.gmm`) and the
    compile gate's accepted spills (:mod:`.aot`) read nothing else about the arch.
    """

    kind: str
    """The device kind (:attr:`DeviceInfo.kind`) the family belongs to."""
    archs: tuple[str, ...]
    """The device archs (:attr:`DeviceInfo.arch`, without feature suffixes) of the family; empty
    for a kind's fallback row ("cuda", "amd", "cpu"), which serves every other arch of the kind."""
    gmm_tiles: Mapping[tuple[str, str], GmmConfig]
    """(op, dtype class) -> starting tiles; op is "gmm" or "wgrad"."""
    dense_bf16_tflops: float | None = None
    """Dense bf16 matmul TFLOP/s, measured at the benchmark shapes (docs/performance.md): what
    the measured points are fractions of. Approximate is enough (the hints compare ratios)."""
    measured: Mapping[str, Sequence[GmmPoint]] = field(default_factory=_empty)
    """op -> this backend's measured grouped-GEMM points on the family (cost hints)."""
    tma: bool = False
    """TMA tensor descriptors (sm90+)."""
    gluon_wgrad: bool = False
    """The warp-specialized Gluon weight gradient (:mod:`.hopper_wgrad`) runs here."""
    gluon_scaled_wgrad: bool = False
    """The FP8 rowwise weight gradient's Gluon kernel (:mod:`.hopper_scaled_wgrad`) runs here."""
    gluon_scaled_max_k: int | None = None
    """FP8 rowwise scaled GEMMs of plain rows reducing over fewer than this many k: the Gluon
    kernel (:mod:`.hopper_scaled`); None: never."""
    gmm_small_n_stages: int | None = None
    """16-bit ``gmm`` with N <= 1024: this many stages."""
    gmm_flatten_max_k: int | None = None
    """16-bit ``gmm`` with K up to this: ``flatten`` the tile and K loops."""
    gmm_few_rows_max_warps: int | None = None
    """``gmm`` tiles fitted to 16 rows or fewer: at most this many warps."""
    warp_specialized_max_tokens_per_expert: int | None = None
    """16-bit ``gmm_wgrad`` of up to this many tokens per expert: the Gluon kernel."""
    accumulate_fp32_max_block_n: int | None = None
    """``gmm_wgrad_accumulate`` into a float32 gradient: BLOCK_N at most this."""
    reduce_epilogue: Mapping[str, ReduceEpilogue] = field(default_factory=_empty)
    """``gmm_wgrad_accumulate`` of 16-bit operands, by the gradient's dtype class: TMA loads
    and the TMA-reduction epilogue with these blocks and stages."""
    spills_accepted: Mapping[tuple[str, str], str] = field(default_factory=_empty)
    """(kernel class, dtype class) -> why the default policy's kernel spills and stays;
    ``megablocks backends compile`` reports these spills without failing on them."""


def _tiles(entries: dict[tuple[str, str], GmmConfig]) -> Mapping[tuple[str, str], GmmConfig]:
    return MappingProxyType(entries)


#: Family -> what the default policy knows of it: NVIDIA "hopper" and "blackwell", "cuda" (any
#: other NVIDIA), "amd" (any AMD GPU: portable defaults; the ROCm plugin tunes CDNA) and "cpu"
#: (TRITON_INTERPRET runs). Tiles are starting points (Triton persistent-matmul defaults per
#: arch); the H200 numbers are expected to be tuned.
ARCHS: Mapping[str, ArchTuning] = MappingProxyType(
    {
        "hopper": ArchTuning(
            kind="cuda",
            archs=("sm_90",),
            gmm_tiles=_tiles(
                {
                    # wgmma likes 128xN with 8 warps (2 warpgroups); 128x256x64 bf16 x 3 stages =
                    # 144 KiB smem. TMA loads: 0.95/0.87/0.89 of dense vs 0.81/0.80/0.76 with
                    # plain loads (docs/performance.md).
                    ("gmm", "16bit"): GmmConfig(
                        128, 256, 64, group_m=8, num_warps=8, num_stages=3, use_tma=True
                    ),
                    ("gmm", "fp32"): GmmConfig(128, 128, 32, group_m=8, num_warps=8, num_stages=3),
                    # FP8 (the scaled GEMMs): 128-deep K steps, one scale block of the blockwise
                    # formats. The float32 sum promoted every K step holds a second accumulator:
                    # 128x256 tiles spilled on sm_90a (`megablocks backends compile`), 128x128
                    # do not; 4 stages = 128 KiB smem. Not flattened: the flattened loops measured
                    # faster in one sweep (docs/performance.md) but have not passed the kit's
                    # full set on the H200.
                    ("gmm", "fp8"): GmmConfig(
                        128, 128, 128, group_m=8, num_warps=8, num_stages=4, use_tma=True
                    ),
                    # Weight gradients (reduced over each expert's ~1K tokens at qwen3/dsv3) with
                    # 4 stages: H200, the layer's two weights, 0.79/0.86 -> 0.67/0.75 ms (qwen3),
                    # 8.76/8.77 -> 8.49/8.24 ms (dsv3); accumulating into .grad 0.85/0.93 ->
                    # 0.78/0.94 ms (qwen3).
                    ("wgrad", "16bit"): GmmConfig(
                        128, 256, 64, group_m=8, num_warps=8, num_stages=4
                    ),
                    ("wgrad", "fp32"): GmmConfig(
                        128, 128, 32, group_m=8, num_warps=8, num_stages=3
                    ),
                }
            ),
            dense_bf16_tflops=690.0,  # H200
            measured=MappingProxyType(
                {
                    # Forward, TMA loads (the sm90 default), `megablocks bench --ops gmm` (mean
                    # of two runs): mixtral / qwen3 / dsv3 shapes.
                    "gmm": (
                        (4096, 4096, 14336, 0.96),
                        (1024, 2048, 768, 0.86),
                        (512, 7168, 2048, 0.86),
                    ),
                    # Weight gradient, the default policy (the Gluon kernel up to 1024 rows per
                    # expert), softmax top-k routing, do_bench medians of three beside a dense
                    # matmul and megablocks-cuda's grouped_mm in the same run
                    # (docs/bench/h200-2026-12-01h-wgrad-points.jsonl): both orientations of the
                    # qwen3 / dsv3 / mixtral layers' weight gradients (k = a's columns).
                    "gmm_weight_grad": (
                        (1024, 2048, 768, 0.80),
                        (1024, 768, 2048, 0.78),
                        (512, 7168, 2048, 0.77),
                        (512, 2048, 7168, 0.73),
                        (4096, 4096, 14336, 0.87),
                        (4096, 14336, 4096, 0.90),
                    ),
                }
            ),
            tma=True,
            gluon_wgrad=True,
            # H100, 2026-12-07 (docs/performance.md): 817-1003 TFLOP/s, 4.4-5.5x the Triton kernel.
            gluon_scaled_wgrad=True,
            # H100, 2026-12-07 (docs/performance.md), the kernel with its paired products:
            # 1.25-1.36x the Triton kernel at DeepSeek-V3's k = 4096 and 7168 (512 rows per
            # expert), 0.99-1.26x at Mixtral's k = 4096 to 28672. (Before the pairing, on the
            # H200 on 2026-12-04, it was 0.84-1.01x from k = 4096, and the bound was 3072.) The
            # bound is past the deepest k measured.
            gluon_scaled_max_k=32768,
            # One more K step in flight with few output columns (e.g. many small experts): 0.91
            # vs 0.87 of dense at the qwen3 shape on the H200.
            gmm_small_n_stages=4,
            # A short K loop (12 steps at K = 768): the epilogue and the next tile's pipeline
            # fill weigh unless they overlap. H200, qwen3's K = 768 GEMMs, two runs: x's
            # gradient (trans_b) 0.90 -> 0.99-1.02 of dense, the forward 0.91 -> 0.99 and
            # 0.91 -> 0.89; gated experts' x gradient (K = 1536) 0.68 -> 0.71-0.77; at K = 2048
            # flattening was 2-9 % slower (docs/performance.md).
            gmm_flatten_max_k=1536,
            # H200, the qwen3 and dsv3 layers' six weight gradients (512 and 1024 tokens per
            # expert) with softmax top-k routing: 8-13 % faster than the Triton kernel (medians
            # of three; docs/performance.md). Longer reductions (mixtral: 4096 tokens per
            # expert) were not measured with it and keep the Triton kernel.
            warp_specialized_max_tokens_per_expert=1024,
            # 32-token steps, 6 stages deep into a 16-bit gradient, 8 deep with 128-wide tiles
            # into a float32 one (see LaunchConfigs.gmm_wgrad_accumulate).
            reduce_epilogue=MappingProxyType(
                {
                    "16bit": ReduceEpilogue(num_stages=6, max_block_k=32),
                    "fp32": ReduceEpilogue(num_stages=8, max_block_k=32, max_block_n=128),
                }
            ),
            spills_accepted=MappingProxyType(
                {
                    ("gmm", "fp32"): "sm_90 tiles stay as tuned on the H200; the ieee fp32 "
                    "path's transposed and gathered variants spill a few bytes",
                }
            ),
        ),
        # Data-center Blackwell (B200/GB200, B300). Speed not measured on Blackwell.
        "blackwell": ArchTuning(
            kind="cuda",
            archs=("sm_100", "sm_103"),
            gmm_tiles=_tiles(
                {
                    ("gmm", "16bit"): GmmConfig(
                        128, 256, 64, group_m=8, num_warps=8, num_stages=4, use_tma=True
                    ),
                    # 16-deep K steps: with 32 the transposed and gathered fp32 variants spilled
                    # on sm_100 (`megablocks backends compile`).
                    ("gmm", "fp32"): GmmConfig(128, 128, 16, group_m=8, num_warps=8, num_stages=3),
                    ("gmm", "fp8"): GmmConfig(
                        128, 128, 128, group_m=8, num_warps=8, num_stages=4, use_tma=True
                    ),
                    ("wgrad", "16bit"): GmmConfig(
                        128, 256, 64, group_m=8, num_warps=8, num_stages=4
                    ),
                    ("wgrad", "fp32"): GmmConfig(
                        128, 128, 32, group_m=8, num_warps=8, num_stages=3
                    ),
                }
            ),
            tma=True,
            # Tiles fitted to a few rows per expert (decode): 8 warps spilled on sm_100
            # (`megablocks backends compile`), 4 do not.
            gmm_few_rows_max_warps=4,
            # The accumulating epilogue holds the float32 gradient's tile beside the
            # accumulator: 128-wide tiles keep both in registers (256-wide spilled on sm_100,
            # `megablocks backends compile`).
            accumulate_fp32_max_block_n=128,
            spills_accepted=MappingProxyType(
                {
                    ("scatter", "fp32"): "a few bytes at ~40 registers: ptxas for sm_100 keeps "
                    "a value on the stack, not register pressure",
                    ("gmm", "fp8"): "16 bytes at 128 registers in the blockwise gathered decode "
                    "tile (4 warps) with a bias (int32 offsets did not help); not measured on "
                    "Blackwell",
                }
            ),
        ),
        # Ampere/Ada and unknown NVIDIA: mma.sync, ~100-160 KiB smem.
        "cuda": ArchTuning(
            kind="cuda",
            archs=(),
            gmm_tiles=_tiles(
                {
                    ("gmm", "16bit"): GmmConfig(128, 128, 32, group_m=8, num_warps=4, num_stages=4),
                    ("gmm", "fp32"): GmmConfig(64, 64, 32, group_m=8, num_warps=4, num_stages=3),
                    # FP8 on Ada (sm_89): mma.sync e4m3 with ~100 KiB of shared memory.
                    ("gmm", "fp8"): GmmConfig(128, 128, 64, group_m=8, num_warps=4, num_stages=3),
                    # Weight gradients: 8 warps (64 fp32 accumulators per thread, not 128) and a
                    # 2-stage fp32 pipeline, the spill-free choices of `megablocks backends
                    # compile` on sm_80 (with 4 warps, or 3 fp32 stages, ptxas spilled; the
                    # registers per thread are the same on every arch of this family). Speed not
                    # measured on these GPUs.
                    ("wgrad", "16bit"): GmmConfig(
                        128, 128, 32, group_m=8, num_warps=8, num_stages=4
                    ),
                    ("wgrad", "fp32"): GmmConfig(64, 64, 32, group_m=8, num_warps=4, num_stages=2),
                }
            ),
        ),
        # AMD: 64 KiB LDS on most parts, the stream pipeliner wants num_stages=2.
        "amd": ArchTuning(
            kind="rocm",
            archs=(),
            gmm_tiles=_tiles(
                {
                    ("gmm", "16bit"): GmmConfig(128, 128, 64, group_m=4, num_warps=8, num_stages=2),
                    ("gmm", "fp32"): GmmConfig(64, 64, 32, group_m=4, num_warps=4, num_stages=2),
                    ("gmm", "fp8"): GmmConfig(128, 128, 128, group_m=4, num_warps=8, num_stages=2),
                    ("wgrad", "16bit"): GmmConfig(
                        128, 128, 64, group_m=4, num_warps=8, num_stages=2
                    ),
                    ("wgrad", "fp32"): GmmConfig(64, 64, 32, group_m=4, num_warps=4, num_stages=2),
                }
            ),
        ),
        # Interpreter: numpy-backed, small tiles keep the tiny test shapes multi-tile.
        "cpu": ArchTuning(
            kind="cpu",
            archs=(),
            gmm_tiles=_tiles(
                {
                    (op, dclass): GmmConfig(16, 16, 16, group_m=2, num_warps=1, num_stages=1)
                    for op in ("gmm", "wgrad")
                    for dclass in ("16bit", "fp32")
                }
                # FP8: 32-deep K steps (an FP8 MMA's smallest on Hopper, as the GPUs run them)
                | {("gmm", "fp8"): GmmConfig(32, 32, 32, group_m=2, num_warps=1, num_stages=1)}
            ),
        ),
    }
)

#: A device kind -> the :data:`ARCHS` row serving its archs that no row lists.
_FALLBACK = {"cuda": "cuda", "rocm": "amd"}


def gmm_tile_family(device: DeviceInfo) -> str:
    """The family (:data:`ARCHS` key) that serves ``device``: the row of its kind listing its
    arch, else its kind's fallback row ("cpu" for the interpreter, which runs on the host)."""
    arch = base_arch(device)
    for name, row in ARCHS.items():
        if row.kind == device.kind and arch in row.archs:
            return name
    return _FALLBACK.get(device.kind, "cpu")


def arch_tuning(device: DeviceInfo) -> ArchTuning:
    """The :data:`ARCHS` row that serves ``device``."""
    return ARCHS[gmm_tile_family(device)]


def by_arch(fact: Callable[[ArchTuning], Any]) -> Mapping[str, Any]:
    """A live view of one fact of :data:`ARCHS` keyed by device arch (``"sm_90"``), e.g. the
    dense rates for the core's cost hints: read at every lookup, so a row added later counts."""
    return _ByArch(fact)


class _ByArch(Mapping[str, Any]):
    __slots__ = ("_fact",)

    def __init__(self, fact: Callable[[ArchTuning], Any]) -> None:
        self._fact = fact

    def _table(self) -> dict[str, Any]:
        return {
            arch: value
            for row in ARCHS.values()
            if (value := self._fact(row)) is not None
            for arch in row.archs
        }

    def __getitem__(self, arch: str) -> Any:
        return self._table()[arch]

    def __iter__(self) -> Iterator[str]:
        return iter(self._table())

    def __len__(self) -> int:
        return len(self._table())
