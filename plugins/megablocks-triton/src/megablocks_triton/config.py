"""Launch parameters, chosen in one place so another vendor can override them.

Every kernel launch in this package asks :func:`launch_configs` for its block
sizes and warp counts (the grouped GEMMs for their tiles: :meth:`LaunchConfigs.gmm`,
:meth:`LaunchConfigs.gmm_wgrad`), and for extra backend-specific launch keywords
(:meth:`LaunchConfigs.launch_options`, e.g. ``waves_per_eu`` on AMD). The
defaults are tuned by reasoning for an NVIDIA H200 (132 SMs, 32-wide warps) and
pass no extra keywords; a ROCm plugin (64-wide wavefronts, different register
file) can subclass :class:`LaunchConfigs` and install it process-wide with
:func:`set_launch_configs`, or for a block of code with
:class:`use_launch_configs`, without touching the kernels.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextvars import ContextVar, Token
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

import torch

from megablocks_core.plugin import DeviceInfo, GmmPoint, base_arch

from .launch import cdiv, next_power_of_2

#: The kernel classes :meth:`LaunchConfigs.launch_options` is asked about: ``"routing"``
#: (sort/route/histogram/cumsum/topology/replicate), ``"permutation"`` (gather/scatter and their
#: wgrad), ``"gmm"`` and ``"gmm_wgrad"`` (the grouped-GEMM dot kernels).
KERNEL_KINDS = ("routing", "permutation", "gmm", "gmm_wgrad")

_NO_OPTIONS: Mapping[str, Any] = MappingProxyType({})


@dataclass(frozen=True)
class RoutingConfig:
    """Counting-sort / route launch shape."""

    tile: int
    """Keys per program; tiles are the unit of the per-tile histograms."""
    chunk: int
    """Keys ranked together with one (chunk x chunk) compare inside a tile."""
    tile_rows: int
    """Rows of the (tiles x bins) count table read per step by the scan."""
    num_warps: int
    prescan: bool = False
    """Scan the count table in a launch of its own (many bins) instead of in every program."""
    single: bool = False
    """One program sorts every key (n <= tile): it counts them itself, so one launch and no
    count table (few keys, e.g. decode)."""
    recount: bool = False
    """One program per tile, each counting every key itself (a few in-register histograms)
    instead of reading a count table that a first launch wrote: one launch, no table. For a
    few thousand keys (each program reads them all)."""


@dataclass(frozen=True)
class PermutationConfig:
    """Token-major gather/scatter launch shape."""

    block_h: int
    """Hidden elements per inner-loop step (power of two)."""
    split_h: int
    """Programs sharing one token's hidden dim (more parallelism for few tokens)."""
    zero_rows: int
    """Programs per expert that zero-fill padding rows (padded/binned gather)."""
    num_warps: int


@dataclass(frozen=True)
class GmmConfig:
    """Grouped-GEMM tile shape and launch parameters.

    For ``gmm``: BLOCK_M tiles the rows of ``a``/output, BLOCK_N the output columns and BLOCK_K the
    reduction (``a``'s columns). For ``gmm_weight_grad``: BLOCK_M tiles ``a``'s columns (output
    rows), BLOCK_N ``grad``'s columns and BLOCK_K the tokens of the group (the reduction).
    GROUP_M: M-tiles swizzled together inside one expert so neighbouring programs share B tiles.
    programs_per_sm: persistent grid = programs_per_sm * num_sms (2 can hide the per-tile
    prologue/epilogue when occupancy allows).
    use_tma: load A/B tiles through TMA tensor descriptors (NVIDIA sm90+, or the interpreter):
    the forward ops; of the weight gradients only the accumulating one, whose epilogue then also
    reads and writes the gradient it adds to through a descriptor (16-bit gradients; any
    gradient with ``reduce_epilogue``, which only writes it). Silently
    falls back to the portable path when the device or the operands' alignment (16-byte
    base/strides, unit inner stride) do not allow it.
    flatten: forward only; the persistent tile loop and the K loop are pipelined as one loop
    (``tl.range(flatten=True)``), so a tile's first loads are in flight during the previous
    tile's epilogue: pays when the K loop is short.
    reduce_epilogue: the accumulating weight gradient with ``use_tma`` on NVIDIA hardware (not
    the interpreter): the tile is rounded to the gradient's dtype and added to it by a TMA
    reduction, asynchronous, instead of being read, added in float32 and written back.
    warp_specialized: a weight gradient on Hopper (sm_90): the policy's choice of the
    warp-specialized Gluon kernel of :mod:`megablocks_triton.hopper_wgrad` (its own 128x256x64
    tiles, 3 stages; a loader warp running ahead across tiles) for these shapes. It is read by the
    shape predicate of the declared variant ``triton/gluon-hopper``
    (:func:`megablocks_triton.gmm.warp_specialized_problem`), so the ranking, ``explain`` and the
    kit see it; the plain kernels run the Triton kernel with this config's tiles. The default policy
    sets it for a new gradient (``gmm_wgrad``) of up to 1024 tokens per expert, and for the
    accumulating one into a 16-bit gradient of more than 768 and up to 1024.
    """

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    programs_per_sm: int = 1
    use_tma: bool = False
    flatten: bool = False
    reduce_epilogue: bool = False
    warp_specialized: bool = False


def dtype_class(dtype: torch.dtype) -> str:
    """``"fp32"`` or ``"16bit"``: the grouped-GEMM tile tables are keyed by it."""
    return "fp32" if dtype == torch.float32 else "16bit"


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


def _pow2_at_least(x: int, floor: int) -> int:
    return max(floor, next_power_of_2(x))


def fit_gmm_tiles(
    cfg: GmmConfig, rows: int, cols: int, depth: int, rows_per_expert: float | None = None
) -> GmmConfig:
    """``cfg`` with blocks that never exceed the problem (rounded up to a power of two, >= 16
    for ``tl.dot``): ``rows`` x ``cols`` output per expert, ``depth`` the reduction per expert.

    ``rows_per_expert`` (the forward pass; None: no shrinking): experts averaging fewer rows than
    half a BLOCK_M tile waste most of their last M-tile, so BLOCK_M halves while that holds, not
    below 64 (the MMA atoms are 64 rows on Hopper; 4 16x16 MFMA blocks on AMD).
    """
    block_m = cfg.block_m
    if rows_per_expert is not None:
        while block_m > 64 and rows_per_expert < block_m / 2:
            block_m //= 2
    return replace(
        cfg,
        block_m=min(block_m, _pow2_at_least(rows, 16)),
        block_n=min(cfg.block_n, _pow2_at_least(cols, 16)),
        block_k=min(cfg.block_k, _pow2_at_least(depth, 16)),
    )


def permutation_wgrad_shape(
    num_tokens: int,
    hidden: int,
    top_k: int,
    *,
    tile_elements: int,
    min_block_h: int,
    min_programs: int,
    num_warps: tuple[int, int],
    more_warps_from: int,
) -> PermutationConfig:
    """scatter_wgrad's launch shape: each program keeps a (top_k, block_h) fp32 tile of partial
    dots in registers.

    ``tile_elements``: the tile's size target (block_h shrinks as top_k grows), with rows of at
    least ``min_block_h`` elements for wide loads. Few tokens (decode): the hidden dim is split
    until ``min_programs`` programs exist. ``num_warps``: (fewer, more), the latter for tiles of
    ``more_warps_from`` elements or more.
    """
    k_pad = next_power_of_2(top_k)
    block_h = min(next_power_of_2(hidden), max(tile_elements // k_pad, min_block_h), 4096)
    h_blocks = cdiv(hidden, block_h)
    split_h = 1
    while num_tokens * split_h < min_programs and split_h * 2 <= h_blocks:
        split_h *= 2
    warps = num_warps[1] if k_pad * block_h >= more_warps_from else num_warps[0]
    return PermutationConfig(block_h=block_h, split_h=split_h, zero_rows=16, num_warps=warps)


class LaunchConfigs:
    """Default launch parameters; subclass and override per vendor."""

    def routing(self, n: int, num_bins_pow2: int) -> RoutingConfig:
        if n <= 256:
            # Few keys: one program ranks them all in one launch. Its 64-key chunks run one after
            # the other (about 1 µs each on the H200), so past ~4 chunks the two-launch path below
            # is faster on the GPU (1024 keys: 21 µs against 10; 128 keys: 5 against 9).
            return RoutingConfig(
                tile=_pow2_at_least(n, 64),
                chunk=64,
                tile_rows=max(1, min(32, 8192 // num_bins_pow2)),
                num_warps=4,
                single=True,
            )
        if n <= 2048:
            # A few thousand keys: 256-key tiles (4 chunks of serial rank chain each), every
            # program counting all keys itself: one launch instead of a histogram launch and a
            # count table (the two-launch path took 9.7 µs of GPU time at 1024 keys on the H200).
            return RoutingConfig(
                tile=256,
                chunk=64,
                tile_rows=max(1, min(32, 8192 // num_bins_pow2)),
                num_warps=4,
                recount=True,
            )
        # Aim for ~128 tiles (16384*8 keys -> 1024-key tiles): enough programs
        # for the H200's 132 SMs and a short serial in-tile rank chain, few
        # enough that every program can re-read the whole (tiles x bins) count
        # table from L2 (128 KB at E=256) instead of a third launch/host sync.
        tile = min(max(next_power_of_2(n // 128), 256), 8192)
        # The in-tile rank is an O(chunk) compare per key; 64 keeps the
        # (chunk x chunk) mask at 4K elements (registers, no spills).
        chunk = 64
        tile_rows = max(1, min(32, 8192 // num_bins_pow2))
        # Many bins: a (tiles x bins) table re-read by every program would be MBs of L2
        # traffic, so scan it once in its own launch and use short 256-key tiles.
        prescan = num_bins_pow2 >= 64 and n > 4096
        if prescan:
            tile = 256
        return RoutingConfig(
            tile=tile, chunk=chunk, tile_rows=tile_rows, num_warps=4, prescan=prescan
        )

    def histogram_block(self, n: int) -> int:
        """Keys per program of ``histogram`` (rows of ``n`` keys). Up to 4096 keys one program
        counts a row and writes its bins (no memset launch)."""
        # H200, E = 128: one program as fast on the GPU as a memset and atomics up to 4096 keys
        # (5.2-5.3 µs in a CUDA graph), one launch less on the host; 7.9 against 5.0 at 8192.
        if n <= 4096:
            return max(next_power_of_2(n), 32)
        return min(max(next_power_of_2(n // 128), 256), 4096)

    def scan_block(self, length: int) -> int:
        return min(next_power_of_2(length), 2048)

    def elementwise_block(self, n: int) -> int:
        return min(next_power_of_2(n), 1024)

    def permutation(
        self, num_tokens: int, hidden: int, top_k: int, element_size: int
    ) -> PermutationConfig:
        """gather / scatter: one program per token, one copy at a time over a row block.

        A block covers the whole row when it fits (up to 16K elements: the fp32 top-k
        accumulator then needs 32-64 registers per thread), so every copy's destination is
        looked up once. With few tokens, rows are split so that >= ~1024 programs exist.
        """
        block_h = min(next_power_of_2(hidden), 16384)
        split_h = cdiv(hidden, block_h)
        while num_tokens * split_h < 1024 and block_h > 512:
            block_h //= 2
            split_h = cdiv(hidden, block_h)
        # ~16 bytes per thread per load: 8 warps for an 8K-element bf16 row.
        num_warps = max(4, min(16, block_h * element_size // 2048))
        return PermutationConfig(
            block_h=block_h, split_h=split_h, zero_rows=16, num_warps=num_warps
        )

    def gather_by_rows(self, num_tokens: int, hidden: int, top_k: int, element_size: int) -> bool:
        """Plain gather: one program per output row that reads its token's row (each row of x
        read top_k times, from L2 while x is small) in one launch, instead of token programs that
        read each row once but need an inverse-permutation launch first. For few rows."""
        # H200, H=2048 bf16: 5.0 µs against 7.9 at 128 tokens, 6.6 against 10.8 at 512 (2 MiB).
        return num_tokens * top_k <= 4096 and num_tokens * hidden * element_size <= 2**21

    def scatter_search(self, num_tokens: int, top_k: int) -> int:
        """Plain scatter with few rows: each token program finds its rows by scanning all of
        ``indices`` (this many ids per step) instead of an inverse-permutation launch first; 0
        for that launch (the scan is O(rows) per token)."""
        # H200, top_k 8, H = 2048: one step over all of them up to 1024 rows (4.3 µs at 1024 rows
        # against 5.3 in 256-id steps and 5.6 inverted first); at 2048 rows the inverse is faster
        # on the GPU (6.5 against 7.5 in 2048-id steps), at 4096 more so (7.7 against 11.5).
        rows = num_tokens * top_k
        return next_power_of_2(rows) if rows <= 1024 else 0

    def wgrad(
        self, num_tokens: int, hidden: int, top_k: int, element_size: int
    ) -> PermutationConfig:
        """scatter_wgrad: each program keeps a (top_k, block_h) fp32 tile of partial dots."""
        # A tile near 8K elements (32 per thread at 8 warps), rows >= 512 elements; few tokens:
        # >= ~4 programs per SM of the H200.
        return permutation_wgrad_shape(
            num_tokens,
            hidden,
            top_k,
            tile_elements=8192,
            min_block_h=512,
            min_programs=512,
            num_warps=(4, 8),
            more_warps_from=8192,
        )

    def gmm(
        self, device: DeviceInfo, tokens: int, n: int, k: int, num_experts: int, dtype: torch.dtype
    ) -> GmmConfig:
        """Tiles of the grouped GEMM ``gmm``: a (tokens, k) times b (E, k, n) on ``device``.

        The tiles of the device's :data:`ARCHS` row, fitted to the problem
        (:func:`fit_gmm_tiles`), then the row's adjustments: e.g. on Hopper, 16-bit, few output
        columns (N <= 1024, e.g. many small experts), 4 stages instead of 3 (one more K step in
        flight; 0.91 vs 0.87 of dense at the qwen3 shape on the H200).
        """
        family = gmm_tile_family(device)
        row = ARCHS[family]
        dclass = dtype_class(dtype)
        experts = max(num_experts, 1)
        cfg = fit_gmm_tiles(
            row.gmm_tiles[("gmm", dclass)],
            max(tokens // experts, 1),
            n,
            k,
            rows_per_expert=None if family == "cpu" else tokens / experts,
        )
        if row.gmm_small_n_stages is not None and dclass == "16bit" and n <= 1024:
            cfg = replace(cfg, num_stages=row.gmm_small_n_stages)
        if row.gmm_few_rows_max_warps is not None and cfg.block_m <= 16:
            cfg = replace(cfg, num_warps=min(cfg.num_warps, row.gmm_few_rows_max_warps))
        if row.gmm_flatten_max_k is not None and dclass == "16bit" and k <= row.gmm_flatten_max_k:
            cfg = replace(cfg, flatten=True)
        return cfg

    def gmm_wgrad(
        self,
        device: DeviceInfo,
        rows: int,
        cols: int,
        tokens: int,
        num_experts: int,
        dtype: torch.dtype,
    ) -> GmmConfig:
        """Tiles of ``gmm_weight_grad``: per expert a (rows x cols) output (a's and grad's
        columns) reduced over the expert's share of ``tokens``."""
        row, dclass = arch_tuning(device), dtype_class(dtype)
        cfg = row.gmm_tiles[("wgrad", dclass)]
        cfg = fit_gmm_tiles(cfg, rows, cols, max(tokens // max(num_experts, 1), 1))
        most = row.warp_specialized_max_tokens_per_expert
        if most is not None and dclass == "16bit" and tokens <= most * max(num_experts, 1):
            cfg = replace(cfg, warp_specialized=True)
        return cfg

    def gmm_wgrad_accumulate(
        self,
        device: DeviceInfo,
        rows: int,
        cols: int,
        tokens: int,
        num_experts: int,
        dtype: torch.dtype,
        out_dtype: torch.dtype,
    ) -> GmmConfig:
        """Tiles of ``gmm_weight_grad_accumulate`` (``gmm_wgrad``'s, adding into an ``out_dtype``
        gradient). Hopper, 16-bit operands: TMA loads, and the epilogue adds the tile to the
        gradient with a TMA reduction, so a program starts its next tile without waiting for the
        gradient's tile to arrive; 32-token steps, 6 stages deep into a 16-bit gradient, 8 deep
        with 128-wide tiles into a float32 one (the reduction stages the tile in shared memory):
        each expert has only ~512-1024 tokens, and the deeper pipeline hides more of each tile's
        start. H200, the qwen3 and dsv3 layers' six weight gradients, against the kernel that
        read, added and wrote the tile (same day, separate runs): 9-20 % faster into bf16,
        17-30 % into float32 (docs/performance.md).

        The warp-specialized kernel adds into a 16-bit gradient with its own TMA reduction
        where it was measured faster: more than 768 and up to 1024 tokens per expert (H200,
        softmax top-k routing, two sessions: 3-6 % faster than this kernel at the qwen3 shapes,
        1024 tokens per expert; at dsv3's 512 it was 1 % faster to 10 % slower, at mixtral's
        4096 5-13 % slower; docs/performance.md)."""
        cfg = self.gmm_wgrad(device, rows, cols, tokens, num_experts, dtype)
        warp_specialized = (
            cfg.warp_specialized
            and dtype_class(out_dtype) == "16bit"
            and tokens > 768 * max(num_experts, 1)
        )
        row = arch_tuning(device)
        if row.accumulate_fp32_max_block_n is not None and dtype_class(out_dtype) == "fp32":
            cfg = replace(cfg, block_n=min(cfg.block_n, row.accumulate_fp32_max_block_n))
        epilogue = row.reduce_epilogue.get(dtype_class(out_dtype))
        if epilogue is not None and dtype_class(dtype) == "16bit":
            block_n = cfg.block_n if epilogue.max_block_n is None else epilogue.max_block_n
            cfg = replace(
                cfg,
                block_n=min(cfg.block_n, block_n),
                block_k=min(cfg.block_k, epilogue.max_block_k),
                use_tma=True,
                reduce_epilogue=True,
                num_stages=epilogue.num_stages,
            )
        return replace(cfg, warp_specialized=warp_specialized)

    def launch_options(self, kernel: str) -> Mapping[str, Any]:
        """Extra keywords for every launch of a ``kernel`` class (see :data:`KERNEL_KINDS`).

        Triton validates them against the active backend's options (an unknown keyword raises
        at launch), so a policy must return only what its backend accepts: e.g.
        ``waves_per_eu`` / ``matrix_instr_nonkdim`` on HIP, never on CUDA. The default is
        portable: nothing.
        """
        return _NO_OPTIONS


_CONFIGS: LaunchConfigs = LaunchConfigs()
# A scoped policy (use_launch_configs) wins over the process-wide one; context-local so that a
# backend wrapping these kernels for one device never changes another thread's launches.
_SCOPED: ContextVar[LaunchConfigs | None] = ContextVar(
    "megablocks_triton_launch_configs", default=None
)


def launch_configs() -> LaunchConfigs:
    """The launch-parameter policy in use: the scoped one if any, else the process-wide one."""
    return _SCOPED.get() or _CONFIGS


class use_launch_configs:  # lower-case: used like a function, ``with use_launch_configs(c):``
    """Use ``configs`` for the launches inside a ``with`` block (context-local, nestable).

    A plain class rather than ``@contextmanager``: it wraps every kernel call of a plugin that
    supplies its own policy, so it should cost no more than a ContextVar set and reset.
    """

    __slots__ = ("_configs", "_token")

    def __init__(self, configs: LaunchConfigs) -> None:
        self._configs = configs
        self._token: Token[LaunchConfigs | None] | None = None

    def __enter__(self) -> LaunchConfigs:
        self._token = _SCOPED.set(self._configs)
        return self._configs

    def __exit__(self, *exc: object) -> None:
        if self._token is not None:
            _SCOPED.reset(self._token)
            self._token = None


def set_launch_configs(configs: LaunchConfigs) -> None:
    """Install another policy (e.g. a ROCm plugin's wavefront-64 tuning)."""
    global _CONFIGS
    _CONFIGS = configs
