"""The Transformer Engine drop-in (megablocks_core.integrations.transformer_engine) and the
Megatron-Core adapter (megablocks_core.integrations.megatron): Megatron's fused=True path through
our ops equals its own unfused path, a permute → experts → unpermute round trip on the reference
and on Triton (under the interpreter), forward and backward."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from moe_routing import (
    moe_utils,
    needs_megatron,
    needs_triton,
    on_the_reference,  # noqa: F401 (an autouse fixture)
    top_k_mask,
)

import megablocks_core
import megablocks_core.ops as ops
from megablocks_core.integrations import megatron as mcore_adapter
from megablocks_core.integrations import transformer_engine as te

# ---------------------------------------------------------------------------
# The Megatron-Core adapter and a permute → experts → unpermute round trip


@pytest.fixture
def megatron_installed():
    assert mcore_adapter.install()
    yield
    mcore_adapter.uninstall()


def _round_trip(
    fused: bool, mask: torch.Tensor, x: torch.Tensor, probs: torch.Tensor, w: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """Megatron's permute → one expert GEMM per expert (ops.gmm) → unpermute, and gradients."""
    xs, ps, ws = (t.clone().requires_grad_(True) for t in (x, probs, w))
    tokens, experts = mask.shape
    rows = int(mask.sum())
    permuted, _, sorted_indices = moe_utils.permute(xs, mask, num_out_tokens=rows, fused=fused)
    counts = mask.sum(0).long()
    hidden = ops.gmm(permuted, ws, counts)
    out = moe_utils.unpermute(
        hidden, sorted_indices, xs.shape, probs=ps, routing_map=mask, fused=fused
    )
    out.square().sum().backward()
    return out, xs.grad, ps.grad, ws.grad


@needs_megatron
@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=needs_triton)])
def test_megatron_round_trip_fused_through_ours_equals_megatron_unfused(
    backend, megatron_installed
):
    mask = top_k_mask(10, 4, 2, 1, seed=7)
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(10, 8, generator=gen)
    probs = torch.rand(10, 4, generator=gen) * mask
    w = torch.randn(4, 8, 8, generator=gen) / 3
    want = _round_trip(False, mask, x, probs, w)
    forced = {op: backend for op in ("moe_permute_map", "moe_permute", "moe_unpermute")}
    with megablocks_core.use_backend(**forced):
        got = _round_trip(True, mask, x, probs, w)
    for g, wnt in zip(got, want, strict=True):
        torch.testing.assert_close(g, wnt, rtol=1e-5, atol=1e-5)


@needs_megatron
def test_megatron_fused_paths_and_config_accept_the_adapter(megatron_installed):
    from megatron.core.transformer.transformer_config import TransformerConfig

    TransformerConfig(
        num_layers=1,
        hidden_size=8,
        num_attention_heads=1,
        num_moe_experts=4,
        moe_router_topk=2,
        moe_permute_fusion=True,
    )  # its check that the fused functions exist passes
    mask = top_k_mask(7, 5, 3, 1, seed=9)
    gen = torch.Generator().manual_seed(10)
    x, probs = torch.randn(7, 3, generator=gen), torch.rand(7, 5, generator=gen)
    fused = moe_utils.permute(x, mask, probs=probs, num_out_tokens=21, fused=True)
    plain = moe_utils.permute(x, mask, probs=probs, fused=False)
    torch.testing.assert_close(fused[0], plain[0])
    torch.testing.assert_close(fused[1], plain[1])
    # Megatron's dropping and FP8-padding paths pass the routed count as a tensor
    counted = moe_utils.permute(x, mask, num_out_tokens=mask.sum(), fused=True)
    torch.testing.assert_close(counted[0], plain[0])
    sizes, order = torch.tensor([3, 1, 3]), torch.tensor([1, 2, 0])
    got = moe_utils.sort_chunks_by_idxs(x, sizes, order, probs=probs[:, 0], fused=True)
    want = moe_utils.sort_chunks_by_idxs(x, sizes, order, probs=probs[:, 0], fused=False)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
    with pytest.raises(ValueError, match="fused_moe_aux_loss is not available"):
        moe_utils.switch_load_balancing_loss_func(probs, mask.sum(0), 7, 3, 5, 0.1, fused=True)


@needs_megatron
def test_uninstall_restores_megatron():
    assert mcore_adapter.install()
    mcore_adapter.uninstall()
    assert not moe_utils.HAVE_TE and not hasattr(moe_utils, "fused_permute")


def test_importing_the_core_imports_no_megatron():
    code = "import sys, megablocks_core, megablocks_core.ops; print('megatron' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.strip() == "False", result.stderr


# ---------------------------------------------------------------------------
# The Transformer Engine drop-in


def test_transformer_engine_drop_in_forms():
    mask = top_k_mask(6, 4, 2, 0, seed=11)
    gen = torch.Generator().manual_seed(12)
    x, probs = torch.randn(6, 3, generator=gen), torch.rand(6, 4, generator=gen)
    out, row_map = te.moe_permute(x, mask, num_out_tokens=12)
    assert out.shape == (12, 3) and row_map.dtype == torch.int32 and row_map.shape == (6, 4)
    assert torch.equal(te.moe_permute(x, mask)[0], out)  # -1: the routed count (12)
    out_p, permuted_probs, row_map_p = te.moe_permute_with_probs(x, probs, mask, 12)
    assert torch.equal(out_p, out) and torch.equal(row_map_p, row_map)
    back = te.moe_unpermute(out, row_map, merging_probs=probs, restore_shape=x.shape)
    torch.testing.assert_close(back, x * (probs * mask).sum(1, keepdim=True))
    # the index form, merging probs of (tokens, top_k)
    ids = mask.nonzero()[:, 1].view(6, 2).to(torch.int32)
    out_i, map_i = te.moe_permute(x, ids, num_out_tokens=12, map_type="index")
    assert torch.equal(out_i, out)
    top_probs = probs.gather(1, ids.long())
    back_i = te.moe_unpermute(out_i, map_i, top_probs, map_type="index")
    torch.testing.assert_close(back_i, back)
    # the padded form: each expert's rows a multiple of 16, padding rows 0
    tokens_per_expert = mask.sum(0)
    padded, padded_probs, map_pad, offsets, target = te.moe_permute_and_pad_with_probs(
        x, probs, mask, tokens_per_expert, 16
    )
    assert padded.shape == (64, 3) and offsets is None and target.tolist() == [16] * 4
    starts = torch.arange(4) * 16
    for e in range(4):
        count = int(tokens_per_expert[e])
        assert not padded[starts[e] + count : starts[e] + 16].any()
    torch.testing.assert_close(te.moe_unpermute(padded, map_pad, probs, pad_offsets=offsets), back)


# Transformer Engine's signatures take plain ints and 1-D probs: anything else is an error naming
# the argument, never a truncated count or probs reordered as if they were rows.


def test_transformer_engine_align_size_must_be_a_positive_int():
    mask = top_k_mask(6, 4, 2, 0, seed=13)
    x, probs = torch.randn(6, 3), torch.rand(6, 4)
    for align in (0, -16, 16.0, True):
        with pytest.raises((TypeError, ValueError), match="align_size"):
            te.moe_permute_and_pad_with_probs(x, probs, mask, mask.sum(0), align)


def test_transformer_engine_unpermute_refuses_probs_and_merging_probs_together():
    mask = top_k_mask(6, 4, 2, 0, seed=14)
    x, probs = torch.randn(6, 3), torch.rand(6, 4)
    out, row_map = te.moe_permute(x, mask)
    with pytest.raises(ValueError, match="merging_probs and probs"):
        te.moe_unpermute(out, row_map, merging_probs=probs, probs=probs)
    # probs alone is the older name of merging_probs
    torch.testing.assert_close(
        te.moe_unpermute(out, row_map, probs=probs), te.moe_unpermute(out, row_map, probs)
    )


@pytest.mark.parametrize(
    "count, error",
    [
        ("12", TypeError),
        (12.0, TypeError),
        (11.5, TypeError),
        (True, TypeError),
        (torch.tensor(11.5), TypeError),
        (torch.tensor(True), TypeError),
        (torch.tensor([6, 6]), ValueError),
        (torch.tensor([]).long(), ValueError),
    ],
)
def test_transformer_engine_num_out_tokens_is_one_integer_count(count, error):
    mask = top_k_mask(6, 4, 2, 0, seed=15)
    x, probs = torch.randn(6, 3), torch.rand(6, 4)
    with pytest.raises(error, match="num_out_tokens"):
        te.moe_permute(x, mask, count)
    with pytest.raises(error, match="num_out_tokens"):
        te.moe_permute_with_probs(x, probs, mask, count)


@pytest.mark.parametrize("count", [12, torch.tensor(12), torch.tensor([12], dtype=torch.int32)])
def test_transformer_engine_num_out_tokens_as_an_int_or_one_element_tensor(count):
    mask = top_k_mask(6, 4, 2, 0, seed=15)
    x = torch.randn(6, 3)
    assert torch.equal(te.moe_permute(x, mask, count)[0], te.moe_permute(x, mask)[0])


@pytest.mark.parametrize("shape", [(7, 2), (7, 1), (14,), ()])
def test_transformer_engine_sort_chunks_probs_are_one_per_row(shape):
    x = torch.randn(7, 3)
    sizes, order = torch.tensor([3, 1, 3]), torch.tensor([1, 2, 0])
    with pytest.raises(ValueError, match="probs"):
        te.moe_sort_chunks_by_index_with_probs(x, torch.rand(shape), sizes, order)
