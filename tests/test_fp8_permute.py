"""FP8 rows through the Transformer Engine / Megatron-Core permutations
(megablocks_core.integrations.transformer_engine.QuantizedRows): the data's bytes and the scales
moved bit for bit, in the bf16 path's row order, against a plain loop over the routing map,
quantize-after-permute, and Megatron-Core's own unfused permute on the bytes; padding rows data
0 with scale 2**-126; the reference and Triton (under the interpreter)."""

from __future__ import annotations

import pytest
import torch
from moe_routing import (
    TRITON_DEVICE,
    moe_utils,
    needs_megatron,
    needs_triton,
    needs_triton_device,
    on_the_reference,  # noqa: F401 (an autouse fixture)
    top_k_mask,
)

import megablocks_core
import megablocks_core.ops as ops
from megablocks_core.formats import FORMATS, MIN_SCALE, dequantize
from megablocks_core.integrations import megatron as mcore_adapter
from megablocks_core.integrations import transformer_engine as te
from megablocks_core.integrations.transformer_engine import QuantizedRows

FORMAT_NAMES = ("fp8_rowwise", "fp8_blockwise")
ENCODING_NAMES = ("e4m3fn", "e4m3fnuz")
PERMUTE_OPS = ("moe_permute_map", "moe_permute", "moe_permute_probs", "moe_sort_chunks")
BACKENDS = ["reference", pytest.param("triton", marks=needs_triton)]


@pytest.fixture(params=BACKENDS)
def backend(request):
    with megablocks_core.use_backend(**dict.fromkeys(PERMUTE_OPS, request.param)):
        yield request.param


def _quantized(x: torch.Tensor, fmt: str, encoding: str) -> QuantizedRows:
    return QuantizedRows(*ops.quantize(x, 1, fmt, encoding))


def _raw_rows(tokens: int, hidden: int, fmt: str, encoding: str, seed: int) -> QuantizedRows:
    """Every byte pattern is fair game (NaNs, -0, float32 signalling-NaN words): random bytes,
    and a first row holding the word 0x7F800001 (a float32 signalling NaN)."""
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (tokens, hidden), generator=gen, dtype=torch.uint8)
    if tokens and hidden >= 4:
        raw[0, :4] = torch.tensor([0x01, 0x00, 0x80, 0x7F], dtype=torch.uint8)
    blocks = 1 if fmt == "fp8_rowwise" else -(-hidden // 128)
    scale = torch.rand(tokens, blocks, generator=gen) + 0.5
    if tokens:
        scale[-1, 0] = float("nan")
    return QuantizedRows(raw.view(getattr(torch, f"float8_{encoding}")), scale)


def _slot_order(routing_map: torch.Tensor, num_experts: int) -> list[list[int]]:
    """Per expert, its tokens in permuted order (the bf16 path's: tokens ascending; a token's
    slots in ascending k), a plain loop over the routing map."""
    order: list[list[int]] = [[] for _ in range(num_experts)]
    for t in range(routing_map.shape[0]):
        for j in range(routing_map.shape[1]):
            if routing_map.dtype == torch.bool:
                if routing_map[t, j]:
                    order[j].append(t)
            elif 0 <= int(routing_map[t, j]) < num_experts:
                order[int(routing_map[t, j])].append(t)
    return order


def _expected(
    rows: QuantizedRows, order: list[list[int]], align: int, num_out: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The permuted bytes and scales, row by row: each expert's tokens, then data 0 / scale
    MIN_SCALE up to a multiple of align; rows past the routed ones likewise; cut at num_out."""
    raw = rows.data.view(torch.uint8)
    data: list[torch.Tensor] = []
    scale: list[torch.Tensor] = []
    zero = raw.new_zeros(raw.shape[1])
    pad_scale = torch.full((rows.scale.shape[1],), MIN_SCALE)
    for tokens in order:
        for t in tokens:
            data.append(raw[t])
            scale.append(rows.scale[t])
        for _ in range(-len(tokens) % align):
            data.append(zero)
            scale.append(pad_scale)
    while len(data) < num_out:
        data.append(zero)
        scale.append(pad_scale)
    hidden, blocks = raw.shape[1], rows.scale.shape[1]
    return (
        torch.stack(data[:num_out]) if num_out else raw.new_zeros(0, hidden),
        torch.stack(scale[:num_out]) if num_out else rows.scale.new_zeros(0, blocks),
    )


def _assert_bits(got: QuantizedRows, data: torch.Tensor, scale: torch.Tensor, dtype) -> None:
    assert isinstance(got, QuantizedRows)
    assert got.data.dtype == dtype and got.data.is_contiguous()
    assert got.scale.dtype == torch.float32
    assert torch.equal(got.data.view(torch.uint8), data)
    assert torch.equal(got.scale.view(torch.int32), scale.view(torch.int32))


def _ids(mask: torch.Tensor) -> torch.Tensor:
    return mask.nonzero()[:, 1].view(mask.shape[0], -1).to(torch.int32)


# ---------------------------------------------------------------------------
# Bit-exact moves against a plain loop, both formats and encodings, every form


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
@pytest.mark.parametrize("encoding", ENCODING_NAMES)
def test_permute_moves_bytes_and_scales_as_the_loop_says(backend, fmt, encoding):
    tokens, experts, top_k = 7, 4, 2
    hidden = 130 if fmt == "fp8_blockwise" else 6  # 2 blocks; a hidden size not whole words
    rows = _raw_rows(tokens, hidden, fmt, encoding, seed=1)
    mask = top_k_mask(tokens, experts, top_k, 1, seed=2)
    order = _slot_order(mask, experts)
    routed = tokens * top_k
    dtype = rows.data.dtype

    got, row_map = te.moe_permute(rows, mask, routed)
    _assert_bits(got, *_expected(rows, order, 1, routed), dtype)
    # a larger bound: the rows past the routed ones are padding
    _assert_bits(te.moe_permute(rows, mask, routed + 3)[0], *_expected(rows, order, 1, 17), dtype)
    # the index form, and the row map the bf16 path gets
    got_i, map_i = te.moe_permute(rows, _ids(mask), routed, map_type="index")
    _assert_bits(got_i, *_expected(rows, order, 1, routed), dtype)
    assert torch.equal(row_map, te.moe_permute(torch.randn(tokens, hidden), mask, routed)[1])

    probs = torch.rand(tokens, experts)
    got_p, permuted_probs, map_p = te.moe_permute_with_probs(rows, probs, mask, routed)
    _assert_bits(got_p, *_expected(rows, order, 1, routed), dtype)
    assert torch.equal(map_p, row_map)
    assert torch.equal(permuted_probs, ops.moe_permute_probs(probs, row_map, routed))


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
@pytest.mark.parametrize("encoding", ENCODING_NAMES)
@pytest.mark.parametrize("align", [16, 32, 128])
def test_padded_permute_pads_with_zero_data_and_the_zero_row_scale(fmt, encoding, align):
    tokens, experts = 6, 3
    rows = _raw_rows(tokens, 8, fmt, encoding, seed=3)
    mask = top_k_mask(tokens, experts, 2, 0, seed=4)
    probs = torch.rand(tokens, experts)
    got, permuted_probs, row_map, offsets, counts = te.moe_permute_and_pad_with_probs(
        rows, probs, mask, mask.sum(0), align
    )
    assert offsets is None and counts.tolist() == [align] * experts
    _assert_bits(
        got, *_expected(rows, _slot_order(mask, experts), align, align * experts), rows.data.dtype
    )
    plain = te.moe_permute_and_pad_with_probs(
        torch.randn(tokens, 8), probs, mask, mask.sum(0), align
    )
    assert torch.equal(row_map, plain[2]) and torch.equal(permuted_probs, plain[1])


@needs_triton
def test_padded_permute_on_triton_equals_the_loop():
    rows = _raw_rows(5, 6, "fp8_rowwise", "e4m3fn", seed=5)
    mask = top_k_mask(5, 3, 2, 0, seed=6)
    with megablocks_core.use_backend(**dict.fromkeys(PERMUTE_OPS, "triton")):
        got = te.moe_permute_and_pad_with_probs(rows, torch.rand(5, 3), mask, mask.sum(0), 16)[0]
    _assert_bits(got, *_expected(rows, _slot_order(mask, 3), 16, 48), rows.data.dtype)


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
@pytest.mark.parametrize("encoding", ENCODING_NAMES)
def test_permuting_quantized_rows_equals_quantizing_permuted_rows(fmt, encoding):
    """Padding included (a zero row quantizes to data 0, scale 2**-126); dequantized, the
    permuted FP8 rows are the bf16 path's permute of the dequantized rows."""
    tokens, experts = 9, 4
    x = torch.randn(tokens, 256, dtype=torch.bfloat16) * 3
    q = _quantized(x, fmt, encoding)
    mask = top_k_mask(tokens, experts, 2, 0, seed=7)
    probs = torch.rand(tokens, experts)
    got = te.moe_permute_and_pad_with_probs(q, probs, mask, mask.sum(0), 16)[0]
    permuted_x = te.moe_permute_and_pad_with_probs(x, probs, mask, mask.sum(0), 16)[0]
    want = _quantized(permuted_x, fmt, encoding)
    assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
    assert torch.equal(got.scale, want.scale)
    block = FORMATS[fmt].block(2, 1)
    dequantized = te.moe_permute_and_pad_with_probs(
        dequantize(*q, block), probs, mask, mask.sum(0), 16
    )[0]
    assert torch.equal(dequantize(*got, block), dequantized)


@needs_triton_device
@pytest.mark.parametrize("encoding", ENCODING_NAMES)
def test_triton_on_its_test_device_moves_fp8_bytes_exactly(encoding):
    """On a GPU (MEGABLOCKS_TRITON_TEST_DEVICE) too: every byte pattern, NaN words included."""
    rows = _raw_rows(37, 260, "fp8_blockwise", encoding, seed=19)
    mask = top_k_mask(37, 5, 2, 1, seed=20)
    on = QuantizedRows(rows.data.to(TRITON_DEVICE), rows.scale.to(TRITON_DEVICE))
    probs = torch.rand(37, 5, device=TRITON_DEVICE)
    with megablocks_core.use_backend(**dict.fromkeys(PERMUTE_OPS, "triton")):
        got = te.moe_permute_and_pad_with_probs(on, probs, mask.to(TRITON_DEVICE), mask.sum(0), 16)
        got_i = te.moe_permute(on, _ids(mask).to(TRITON_DEVICE), 74, map_type="index")[0]
    padded = QuantizedRows(got[0].data.cpu(), got[0].scale.cpu())
    padded_rows = int(((mask.sum(0) + 15) // 16 * 16).sum())
    assert padded_rows > 16 * 5  # an expert with more than 16 rows
    _assert_bits(padded, *_expected(rows, _slot_order(mask, 5), 16, padded_rows), rows.data.dtype)
    dense = QuantizedRows(got_i.data.cpu(), got_i.scale.cpu())
    _assert_bits(dense, *_expected(rows, _slot_order(mask, 5), 1, 74), rows.data.dtype)


# ---------------------------------------------------------------------------
# Edge cases


def test_zero_tokens_one_expert_and_a_non_contiguous_input(backend):
    # zero tokens: empty data, empty scales (and a bound past them: padding rows)
    empty = _raw_rows(0, 8, "fp8_rowwise", "e4m3fn", seed=8)
    got, row_map = te.moe_permute(empty, torch.zeros(0, 3, dtype=torch.bool), 0)
    assert got.data.shape == (0, 8) and got.scale.shape == (0, 1) and row_map.shape == (0, 3)
    padded = te.moe_permute(empty, torch.zeros(0, 3, dtype=torch.bool), 2)[0]
    _assert_bits(padded, *_expected(empty, [[]], 1, 2), empty.data.dtype)
    # one expert: every token, in order
    rows = _raw_rows(5, 8, "fp8_rowwise", "e4m3fnuz", seed=9)
    one = torch.ones(5, 1, dtype=torch.bool)
    _assert_bits(
        te.moe_permute(rows, one, 5)[0], *_expected(rows, [list(range(5))], 1, 5), rows.data.dtype
    )
    # non-contiguous data and scales (every other column, a transposed scale)
    wide = _raw_rows(5, 16, "fp8_rowwise", "e4m3fn", seed=10)
    strided = QuantizedRows(wide.data[:, ::2], wide.scale.t().contiguous().t())
    assert not strided.data.is_contiguous()
    mask = top_k_mask(5, 3, 2, 0, seed=11)
    dense = QuantizedRows(strided.data.contiguous(), strided.scale.contiguous())
    _assert_bits(
        te.moe_permute(strided, mask, 10)[0],
        *_expected(dense, _slot_order(mask, 3), 1, 10),
        dense.data.dtype,
    )
    # a row slice whose rows start mid-word
    sliced = QuantizedRows(wide.data[:, 1:9], wide.scale)
    want = _expected(
        QuantizedRows(sliced.data.contiguous(), wide.scale), _slot_order(mask, 3), 1, 10
    )
    _assert_bits(te.moe_permute(sliced, mask, 10)[0], *want, wide.data.dtype)


def test_sort_chunks_moves_fp8_rows_and_scales(backend):
    rows = _raw_rows(7, 6, "fp8_rowwise", "e4m3fn", seed=12)
    sizes, order = torch.tensor([3, 1, 2]), torch.tensor([1, 2, 0])
    source = [3, 4, 5, 0, 1, 2]  # chunk 1, chunk 2, chunk 0; the 7th row is past the chunks
    raw = rows.data.view(torch.uint8)
    want_data = torch.cat([raw[source], torch.zeros_like(raw[:1])])
    want_scale = torch.cat([rows.scale[source], torch.full_like(rows.scale[:1], MIN_SCALE)])
    _assert_bits(
        te.moe_sort_chunks_by_index(rows, sizes, order), want_data, want_scale, rows.data.dtype
    )
    probs = torch.rand(7)
    got, sorted_probs = te.moe_sort_chunks_by_index_with_probs(rows, probs, sizes, order)
    _assert_bits(got, want_data, want_scale, rows.data.dtype)
    assert torch.equal(
        sorted_probs,
        te.moe_sort_chunks_by_index_with_probs(torch.randn(7, 6), probs, sizes, order)[1],
    )


# ---------------------------------------------------------------------------
# Errors: naming what is wrong


def test_fp8_rows_are_refused_without_scales_with_gradients_or_at_unpermute():
    rows = _raw_rows(4, 8, "fp8_rowwise", "e4m3fn", seed=13)
    mask = top_k_mask(4, 2, 1, 0, seed=14)
    with pytest.raises(TypeError, match="need their scales"):
        te.moe_permute(rows.data, mask)
    with pytest.raises(RuntimeError, match="forward-only"):
        te.moe_permute(QuantizedRows(rows.data, rows.scale.requires_grad_()), mask)
    with pytest.raises(RuntimeError, match="forward-only"):
        te.moe_permute(QuantizedRows(rows.data.clone().requires_grad_(), rows.scale.detach()), mask)
    with pytest.raises(ValueError, match=r"scale must be \(4, 1\)"):
        te.moe_permute(QuantizedRows(rows.data, torch.ones(4, 2)), mask)
    with pytest.raises(TypeError, match="scale must be a 2-D float32"):
        te.moe_permute(QuantizedRows(rows.data, torch.ones(4)), mask)
    with pytest.raises(TypeError, match="data must be one of"):
        te.moe_permute(QuantizedRows(torch.randn(4, 8), torch.ones(4, 1)), mask)
    permuted, row_map = te.moe_permute(QuantizedRows(rows.data, rows.scale.detach()), mask)
    with pytest.raises(TypeError, match="moe_unpermute: inp must be"):
        te.moe_unpermute(permuted, row_map)
    with pytest.raises(TypeError, match="moe_unpermute: inp must be"):
        te.moe_unpermute(permuted.data, row_map)


@pytest.mark.parametrize("align", [1, 8, 24, 48 + 1])
def test_fp8_padding_takes_multiples_of_16_only(align):
    rows = _raw_rows(4, 8, "fp8_blockwise", "e4m3fn", seed=15)
    mask = top_k_mask(4, 2, 1, 0, seed=16)
    with pytest.raises(ValueError, match="align_size must be a multiple of 16 for FP8"):
        te.moe_permute_and_pad_with_probs(rows, torch.rand(4, 2), mask, mask.sum(0), align)
    # the bf16 path takes any positive align_size
    te.moe_permute_and_pad_with_probs(torch.randn(4, 8), torch.rand(4, 2), mask, mask.sum(0), align)


# ---------------------------------------------------------------------------
# Megatron-Core: its fused=True path through ours on FP8 rows equals its unfused path on bytes


@needs_megatron
@pytest.mark.parametrize("encoding", ENCODING_NAMES)
def test_megatron_fused_fp8_permute_equals_its_unfused_permute_of_the_bytes(encoding):
    assert mcore_adapter.install()
    try:
        tokens, experts = 8, 4
        rows = _raw_rows(tokens, 130, "fp8_blockwise", encoding, seed=17)
        mask = top_k_mask(tokens, experts, 2, 1, seed=18)
        probs = torch.rand(tokens, experts)
        got, got_probs, _ = moe_utils.permute(
            rows, mask, probs=probs, num_out_tokens=16, fused=True
        )
        bytes_, want_probs, _ = moe_utils.permute(
            rows.data.view(torch.uint8), mask, probs=probs, num_out_tokens=16, fused=False
        )
        scales = moe_utils.permute(rows.scale, mask, num_out_tokens=16, fused=False)[0]
        _assert_bits(got, bytes_, scales, rows.data.dtype)
        torch.testing.assert_close(got_probs, want_probs, rtol=0, atol=0)
        sizes, order = torch.tensor([3, 5]), torch.tensor([1, 0])
        sorted_rows, _ = moe_utils.sort_chunks_by_idxs(rows, sizes, order, fused=True)
        want = moe_utils.sort_chunks_by_idxs(rows.data.view(torch.uint8), sizes, order)[0]
        want_scale = moe_utils.sort_chunks_by_idxs(rows.scale, sizes, order)[0]
        _assert_bits(sorted_rows, want, want_scale, rows.data.dtype)
    finally:
        mcore_adapter.uninstall()
