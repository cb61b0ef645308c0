"""The scenarios the conformance kit runs: :data:`QUICK`, :data:`FULL`, :data:`DEVICE_SIZED`,
and :func:`scenarios`, which picks among them for a device (re-exported by :mod:`.scenarios`).
"""

from __future__ import annotations

import torch

from .scenario_tensors import Scenario

_I16, _I32, _I64 = torch.int16, torch.int32, torch.int64
_F32, _F16, _BF16, _F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64

#: ``--quick``: one representative of each edge case (the first one also feeds opcheck and compile).
QUICK: tuple[Scenario, ...] = (
    Scenario(tokens=16, experts=4, top_k=2, hidden=8),
    Scenario(tokens=0, experts=4, top_k=2, hidden=8),
    Scenario(
        tokens=12,
        experts=8,
        top_k=2,
        hidden=5,
        dtype=_BF16,
        index_dtype=_I64,
        empty_experts=True,
        non_contiguous=True,
        trans_b=True,
        sizes_on_device=True,
        accumulate_dtype=_F32,
        seed=1,
    ),
    Scenario(
        tokens=9,
        experts=1,
        top_k=1,
        hidden=1,
        dtype=_F16,
        index_dtype=_I16,
        weighted=False,
        trans_b=True,
        block_size=128,
        seed=2,
    ),
    Scenario(tokens=40, experts=256, top_k=8, hidden=3, seed=3),
    # Pairs routed to no expert, past bins[-1] (expert parallelism's), and a sorted-row count.
    Scenario(tokens=21, experts=4, top_k=2, hidden=8, unrouted=17, first_rows=True, seed=4),
)

#: The full suite: the quick set, every float × index dtype pair, top_k 1…8, larger shapes.
FULL: tuple[Scenario, ...] = (
    *QUICK,
    *(
        Scenario(
            tokens=24,
            experts=6,
            top_k=2,
            hidden=16,
            dtype=f,
            index_dtype=i,
            accumulate_dtype=_F32 if i == _I64 else None,  # 16-bit data into a float32 main_grad
            seed=10 + n,
        )
        for n, (f, i) in enumerate(
            (f, i) for f in (_F32, _F16, _BF16, _F64) for i in (_I16, _I32, _I64)
        )
    ),
    *(
        Scenario(
            tokens=13,
            experts=8,
            top_k=k,
            hidden=7,
            seed=30 + k,
            trans_b=k % 2 == 0,
            weighted=k != 3,
        )
        for k in range(1, 9)
    ),
    Scenario(tokens=0, experts=1, top_k=1, hidden=1, dtype=_BF16, index_dtype=_I64),
    Scenario(tokens=1, experts=16, top_k=4, hidden=1, dtype=_F16, empty_experts=True, seed=40),
    Scenario(tokens=64, experts=256, top_k=8, hidden=32, dtype=_BF16, empty_experts=True, seed=41),
    Scenario(tokens=300, experts=8, top_k=2, hidden=128, dtype=_BF16, non_contiguous=True, seed=42),
    Scenario(
        tokens=257,
        experts=32,
        top_k=4,
        hidden=96,
        dtype=_F16,
        index_dtype=_I64,
        trans_b=True,
        seed=43,
    ),
    Scenario(tokens=512, experts=64, top_k=2, hidden=64, seed=44),
    Scenario(
        tokens=100,
        experts=8,
        top_k=2,
        hidden=33,
        dtype=_F32,
        index_dtype=_I16,
        non_contiguous=True,
        empty_experts=True,
        seed=45,
    ),
    # MegaBlocks' block size: most experts are a single padded block of 128 rows, mostly padding.
    Scenario(tokens=9, experts=32, top_k=8, hidden=33, dtype=_F16, block_size=128, seed=46),
    # Pairs routed to no expert (expert parallelism's pairs of other ranks' experts): sorted rows
    # past bins[-1], batch_sizes summing short.
    Scenario(tokens=21, experts=4, top_k=2, hidden=8, unrouted=17, seed=47),
    Scenario(
        tokens=10,
        experts=6,
        top_k=3,
        hidden=5,
        dtype=_BF16,
        index_dtype=_I16,
        empty_experts=True,
        non_contiguous=True,
        trans_b=True,
        sizes_on_device=True,
        accumulate_dtype=_F32,
        unrouted=11,
        seed=48,
    ),
    Scenario(tokens=6, experts=3, top_k=2, hidden=4, dtype=_F64, unrouted=12, seed=49),
    # ... and only the first sorted rows given or computed (a row count, as the receiving rank's).
    Scenario(
        tokens=10,
        experts=6,
        top_k=3,
        hidden=5,
        dtype=_BF16,
        index_dtype=_I16,
        non_contiguous=True,
        trans_b=True,
        sizes_on_device=True,
        unrouted=11,
        first_rows=True,
        seed=61,
    ),
    Scenario(
        tokens=6, experts=3, top_k=2, hidden=4, dtype=_F64, unrouted=12, first_rows=True, seed=62
    ),
)

#: Added to the full set on an accelerator: the shapes of real MoE layers (thousands of tokens,
#: hidden sizes in the thousands, MegaBlocks' block size 128), where tiling, masking of odd tails
#: and multi-block launches are exercised. Too slow for a CPU (and Triton's interpreter).
DEVICE_SIZED: tuple[Scenario, ...] = (
    Scenario(
        tokens=4096,
        experts=8,
        top_k=2,
        hidden=1024,
        ffn=768,
        dtype=_BF16,
        block_size=128,
        accumulate_dtype=_F32,
        seed=50,
    ),
    Scenario(
        tokens=4096,
        experts=8,
        top_k=2,
        hidden=1024,
        ffn=768,
        dtype=_F16,
        block_size=128,
        trans_b=True,
        sizes_on_device=True,
        seed=51,
    ),
    Scenario(
        tokens=2048, experts=64, top_k=8, hidden=512, ffn=384, dtype=_F32, block_size=128, seed=52
    ),
    Scenario(
        tokens=2048,
        experts=64,
        top_k=8,
        hidden=512,
        ffn=384,
        dtype=_BF16,
        index_dtype=_I64,
        block_size=128,
        trans_b=True,
        sizes_on_device=True,
        seed=53,
    ),
    Scenario(
        tokens=1024,
        experts=256,
        top_k=8,
        hidden=2048,
        ffn=256,
        dtype=_BF16,
        block_size=128,
        empty_experts=True,
        accumulate_dtype=_F32,
        seed=54,
    ),
    Scenario(
        tokens=296,
        experts=16,
        top_k=2,
        hidden=72,
        ffn=136,
        dtype=_F32,
        block_size=128,
        trans_b=True,
        seed=55,
    ),
    # Odd sizes everywhere: masks and tails.
    Scenario(
        tokens=777,
        experts=16,
        top_k=1,
        hidden=129,
        ffn=136,
        dtype=_F16,
        block_size=128,
        non_contiguous=True,
        seed=56,
    ),
    Scenario(
        tokens=777,
        experts=16,
        top_k=1,
        hidden=129,
        ffn=136,
        dtype=_F32,
        block_size=128,
        sizes_on_device=True,
        weighted=False,
        seed=57,
    ),
    Scenario(tokens=0, experts=8, top_k=2, hidden=256, dtype=_BF16, block_size=128, seed=58),
    # Expert parallelism's receiving rank: half the pairs belong to other ranks' experts.
    Scenario(
        tokens=2048,
        experts=16,
        top_k=4,
        hidden=512,
        ffn=384,
        dtype=_BF16,
        block_size=128,
        sizes_on_device=True,
        accumulate_dtype=_F32,
        unrouted=4096,
        seed=59,
    ),
    Scenario(
        tokens=2048,
        experts=16,
        top_k=4,
        hidden=512,
        ffn=384,
        dtype=_BF16,
        block_size=128,
        sizes_on_device=True,
        unrouted=4096,
        first_rows=True,
        seed=63,
    ),
)


def scenarios(quick: bool = False, device: torch.device | str = "cpu") -> tuple[Scenario, ...]:
    """The scenarios to check on ``device``: :data:`QUICK`, or :data:`FULL` plus, on an accelerator,
    :data:`DEVICE_SIZED`."""
    if quick:
        return QUICK
    return FULL if torch.device(device).type in ("cpu", "meta") else FULL + DEVICE_SIZED
