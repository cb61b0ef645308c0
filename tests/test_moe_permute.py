"""The Megatron-Core / Transformer Engine permutation ops (moe_permute_map, moe_permute,
moe_permute_probs, moe_unpermute, moe_sort_chunks) against Megatron-Core's own unfused path and
an independent per-slot loop, forward and backward; padding, the index form, dropping;
cross-backend pairing of permute and unpermute; the Triton kernels and the kit; bad inputs.

Megatron-Core (``megatron-core==0.16.1``, installed with ``--no-deps``) is the oracle written by
someone else; the tests that need it skip where it is not installed.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from moe_routing import (
    SETTINGS,
    TRITON_DEVICE,
    expert,
    loop_permute,
    loop_unpermute,
    moe_utils,
    needs_megatron,
    needs_triton,
    needs_triton_device,
    on_the_reference,  # noqa: F401 (an autouse fixture)
    routing_cases,
    top_k_mask,
)

import megablocks_core
import megablocks_core.ops as ops
from megablocks_core.integrations import transformer_engine as te
from megablocks_core.validation import ContractError, ContractTypeError

# ---------------------------------------------------------------------------
# Against Megatron-Core's unfused permute / unpermute / sort_chunks_by_idxs


@needs_megatron
@SETTINGS
@given(case=routing_cases)
def test_permute_and_unpermute_match_megatron_unfused(case):
    tokens, experts = case["tokens"], case["experts"]
    top_k = min(case["top_k"], experts)
    mask = top_k_mask(tokens, experts, top_k, min(case["empty"], experts - top_k), case["seed"])
    gen = torch.Generator().manual_seed(case["seed"] + 1)
    x = torch.randn(tokens, 6, generator=gen, dtype=torch.float64)
    probs = torch.rand(tokens, experts, generator=gen, dtype=torch.float64)
    upstream = torch.randn(tokens, 6, generator=gen, dtype=torch.float64)
    # Dropless Megatron passes tokens * top_k: a static bound, here with some slack.
    rows = tokens * top_k + case["slack"]
    with_probs = case["with_probs"]

    def run(ours: bool) -> tuple[torch.Tensor, ...]:
        xs = x.clone().requires_grad_(True)
        ps = probs.clone().requires_grad_(True)
        if ours:
            row_map, counts = ops.moe_permute_map(mask, experts, rows)
            permuted = ops.moe_permute(xs, row_map, rows)
            permuted_probs = ops.moe_permute_probs(ps, row_map, rows)
            out = ops.moe_unpermute(expert(permuted), row_map, ps if with_probs else None)
            assert int(counts.sum()) == tokens * top_k
        else:
            permuted, permuted_probs, sorted_indices = moe_utils.permute(
                xs, mask, probs=ps, num_out_tokens=rows
            )
            out = moe_utils.unpermute(
                expert(permuted),
                sorted_indices,
                xs.shape,
                probs=ps if with_probs else None,
                routing_map=mask if with_probs else None,
            )
        loss = (out * upstream).sum() + (permuted_probs * torch.arange(len(permuted_probs))).sum()
        loss.backward()
        return permuted, permuted_probs, out, xs.grad, ps.grad

    ours, theirs = run(True), run(False)
    real = tokens * top_k
    assert ours[0].shape == (rows, 6)
    torch.testing.assert_close(ours[0][:real], theirs[0])
    assert not ours[0][real:].any(), "rows past the real count are 0"
    torch.testing.assert_close(ours[1][:real], theirs[1])
    assert not ours[1][real:].any()
    for got, want in zip(ours[2:], theirs[2:], strict=True):
        torch.testing.assert_close(got, want)


@needs_megatron
@SETTINGS
@given(
    chunks=st.lists(st.integers(0, 4), min_size=1, max_size=8),
    seed=st.integers(0, 2**16),
    with_probs=st.booleans(),
    on_device=st.booleans(),
)
def test_sort_chunks_matches_megatron_unfused(chunks, seed, with_probs, on_device):
    gen = torch.Generator().manual_seed(seed)
    sizes = torch.tensor(chunks)
    order = torch.randperm(len(chunks), generator=gen)
    rows = sum(chunks)
    x = torch.randn(rows, 5, generator=gen, dtype=torch.float64)
    probs = torch.rand(rows, generator=gen, dtype=torch.float64)
    upstream = torch.randn(rows, 5, generator=gen, dtype=torch.float64)

    def run(ours: bool) -> tuple[torch.Tensor | None, ...]:
        xs = x.clone().requires_grad_(True)
        ps = probs.clone().requires_grad_(True)
        if ours:
            out, sorted_probs = te.moe_sort_chunks_by_index_with_probs(xs, ps, sizes, order)
            if not with_probs:
                out, sorted_probs = te.moe_sort_chunks_by_index(xs, sizes, order), None
        else:
            out, sorted_probs = moe_utils.sort_chunks_by_idxs(
                xs, sizes, order, probs=ps if with_probs else None
            )
        loss = (out * upstream).sum()
        if sorted_probs is not None:
            loss = loss + (sorted_probs * torch.arange(rows)).sum()
        if rows:
            loss.backward()
        return out, sorted_probs, xs.grad, ps.grad

    for got, want in zip(run(True), run(False), strict=True):
        if want is None:
            assert got is None or not got.any()
        else:
            torch.testing.assert_close(got, want)


@needs_megatron
@pytest.mark.parametrize("align", [1, 16, 32, 128])
def test_padded_form_equals_megatrons_padded_routing_map(align):
    """Megatron pads for FP8 by routing extra tokens (probability 0) to each expert; our padded
    form adds zero rows instead. The experts see row counts that are multiples of align either
    way, and the unpermuted outputs and gradients agree."""
    tokens, experts, top_k = 40, 4, 2
    mask = top_k_mask(tokens, experts, top_k, 1, seed=align)
    gen = torch.Generator().manual_seed(align + 1)
    x = torch.randn(tokens, 6, generator=gen, dtype=torch.float64)
    probs = torch.rand(tokens, experts, generator=gen, dtype=torch.float64) * mask
    rows = tokens * top_k + experts * (align - 1)  # a static bound for any routing

    def run(ours: bool) -> tuple[torch.Tensor, ...]:
        xs, ps = x.clone().requires_grad_(True), probs.clone().requires_grad_(True)
        if ours:
            row_map, counts = ops.moe_permute_map(mask, experts, rows, align)
            out = ops.moe_unpermute(expert(ops.moe_permute(xs, row_map, rows)), row_map, ps)
            assert not (counts % align).any()
        else:
            padded = moe_utils.pad_routing_map(mask.clone(), align)
            permuted, _, order = moe_utils.permute(xs, padded, probs=ps)
            out = moe_utils.unpermute(
                expert(permuted), order, xs.shape, probs=ps, routing_map=padded
            )
        out.square().sum().backward()
        return out, xs.grad, ps.grad

    ours, theirs = run(True), run(False)
    torch.testing.assert_close(ours[0], theirs[0])
    torch.testing.assert_close(ours[1], theirs[1])
    # Megatron's padding tokens also give their (zero) probabilities a gradient; ours has none.
    torch.testing.assert_close(ours[2] * mask, theirs[2] * mask)


# ---------------------------------------------------------------------------
# Against the independent loop: padding, the index form, dropping


@SETTINGS
@given(
    case=routing_cases,
    align=st.sampled_from([1, 16, 32, 128]),
    index_form=st.booleans(),
    short=st.booleans(),
)
def test_padded_index_and_dropping_forms_match_a_loop(case, align, index_form, short):
    tokens, experts = case["tokens"], case["experts"]
    top_k = min(case["top_k"], experts)
    mask = top_k_mask(tokens, experts, top_k, min(case["empty"], experts - top_k), case["seed"])
    gen = torch.Generator().manual_seed(case["seed"] + 2)
    if index_form:  # (tokens, top_k) ids, an unrouted (-1) one now and then
        routing = torch.multinomial(torch.ones(max(tokens, 1), experts), top_k, generator=gen)
        routing = routing[:tokens].to(torch.int32)
        if tokens > 1:
            routing[1, 0] = -1
    else:
        routing = mask
    needed = int(
        sum(
            -(-int(c) // align) * align
            for c in torch.bincount(
                (routing[routing >= 0].long() if index_form else mask.nonzero()[:, 1]).reshape(-1),
                minlength=experts,
            )
        )
    )
    rows = max(needed // 2, 0) if short else needed + case["slack"]
    x = torch.randn(tokens, 4, generator=gen)
    probs = torch.rand(*routing.shape, generator=gen) if case["with_probs"] else None
    want_map, want_counts, want_rows, want_probs = loop_permute(
        x, routing, experts, rows, align, probs
    )
    row_map, counts = ops.moe_permute_map(routing, experts, rows, align)
    assert torch.equal(row_map, want_map)
    assert torch.equal(counts, want_counts)
    assert torch.equal(ops.moe_permute(x, row_map, rows), want_rows)
    if probs is not None:
        assert torch.equal(ops.moe_permute_probs(probs, row_map, rows), want_probs)
    y = torch.randn(rows, 4, generator=gen)
    torch.testing.assert_close(
        ops.moe_unpermute(y, row_map, probs), loop_unpermute(y, row_map, probs).float()
    )


def test_a_wrong_row_order_fails_the_oracle():
    """The oracle is not vacuous: two rows of one expert swapped no longer match."""
    mask = top_k_mask(6, 3, 2, 0, seed=1)
    x = torch.randn(6, 4)
    want_map, _, want_rows, _ = loop_permute(x, mask, 3, 12, 1, None)
    row_map, _ = ops.moe_permute_map(mask, 3, 12)
    first, second = (row_map == 0).nonzero()[0], (row_map == 1).nonzero()[0]
    swapped = row_map.clone()
    swapped[tuple(first)], swapped[tuple(second)] = 1, 0
    assert not torch.equal(swapped, want_map)
    assert not torch.equal(ops.moe_permute(x, swapped, 12), want_rows)


def test_gradcheck_through_permute_map_permute_and_unpermute():
    mask = top_k_mask(5, 4, 2, 1, seed=3)
    row_map, _ = ops.moe_permute_map(mask, 4, 13, 4)
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    probs = torch.rand(5, 4, dtype=torch.float64, requires_grad=True)
    y = torch.randn(13, 3, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda a: ops.moe_permute(a, row_map, 13), (x,))
    torch.autograd.gradcheck(lambda p: ops.moe_permute_probs(p, row_map, 13), (probs,))
    torch.autograd.gradcheck(lambda a, p: ops.moe_unpermute(a, row_map, p), (y, probs))
    torch.autograd.gradgradcheck(lambda a, p: ops.moe_unpermute(a, row_map, p), (y, probs))
    sizes, order = torch.tensor([2, 0, 3]), torch.tensor([2, 0, 1])
    torch.autograd.gradcheck(lambda a: ops.moe_sort_chunks(a, sizes, order), (x,))


# ---------------------------------------------------------------------------
# Cross-backend pairing, torch.compile


@needs_triton
@pytest.mark.parametrize(
    "permute_on, unpermute_on", [("triton", "reference"), ("reference", "triton")]
)
def test_permute_on_one_backend_unpermute_on_another(permute_on, unpermute_on):
    mask = top_k_mask(9, 5, 2, 1, seed=13)
    gen = torch.Generator().manual_seed(14)
    x, probs = torch.randn(9, 4, generator=gen), torch.rand(9, 5, generator=gen)
    with megablocks_core.use_backend(moe_permute_map=permute_on, moe_permute=permute_on):
        row_map, _ = ops.moe_permute_map(mask, 5, 40, 4)  # 40: room for every padded row
        permuted = ops.moe_permute(x, row_map, 40)
    with megablocks_core.use_backend(moe_unpermute=unpermute_on):
        back = ops.moe_unpermute(permuted, row_map, probs)
    torch.testing.assert_close(back, x * (probs * mask).sum(1, keepdim=True))


@needs_triton
def test_the_pairing_forced_through_the_environment():
    code = """
import torch, megablocks_core.ops as ops
from megablocks_core.dispatch import explain
mask = torch.rand(7, 4, generator=torch.Generator().manual_seed(0)) > 0.5
x = torch.randn(7, 3)
row_map, _ = ops.moe_permute_map(mask, 4, 28, 4)
back = ops.moe_unpermute(ops.moe_permute(x, row_map, 28), row_map, None)
torch.testing.assert_close(back, x * mask.sum(1, keepdim=True))
print(*(explain(op, "cpu").winner.backend
        for op in ("moe_permute_map", "moe_permute", "moe_unpermute")))
"""
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "MEGABLOCKS_BACKEND": "moe_permute_map=triton,moe_permute=triton,moe_unpermute=reference",
    }
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["triton", "triton", "reference"]


def test_compile_fullgraph_static_shapes():
    mask = top_k_mask(8, 4, 2, 0, seed=15)
    gen = torch.Generator().manual_seed(16)
    x, probs = torch.randn(8, 3, generator=gen), torch.rand(8, 4, generator=gen)

    def layer(x: torch.Tensor, mask: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        row_map, _ = ops.moe_permute_map(mask, 4, 16, 1)
        return ops.moe_unpermute(expert(ops.moe_permute(x, row_map, 16)), row_map, probs)

    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x, mask, probs), layer(x, mask, probs))


# ---------------------------------------------------------------------------
# Bad inputs: a clear error or the documented safe result


def test_bad_routing_maps_and_probs_are_clear_errors():
    mask = top_k_mask(4, 3, 1, 0, seed=17)
    x = torch.randn(4, 2)
    with pytest.raises(ContractTypeError, match="routing_map"):
        ops.moe_permute_map(mask.float(), 3, 4)
    with pytest.raises(ContractError, match="routing_map"):
        ops.moe_permute_map(mask.reshape(-1), 3, 4)
    with pytest.raises(ContractError, match="one column per expert"):
        ops.moe_permute_map(mask, 5, 4)
    with pytest.raises(ContractError, match="num_out_tokens"):
        ops.moe_permute_map(mask, 3, -1)
    row_map, _ = ops.moe_permute_map(mask, 3, 4)
    with pytest.raises(ContractError, match="one row map row per token"):
        ops.moe_permute(x[:3], row_map, 4)
    with pytest.raises(ContractError, match="one probability per slot"):
        ops.moe_unpermute(x, row_map, torch.rand(4, 2))
    with pytest.raises(ContractTypeError, match="row_map"):
        ops.moe_unpermute(x, row_map.long(), None)
    with pytest.raises(TypeError, match=r"mask routing_map must be torch\.bool"):
        te.moe_permute(x, mask.int(), 4)


def test_num_out_tokens_too_small_drops_the_rows_past_it():
    mask = top_k_mask(6, 3, 2, 0, seed=18)
    x = torch.randn(6, 2)
    row_map, counts = ops.moe_permute_map(mask, 3, 5)
    assert int(row_map.max()) == 4 and int(counts.sum()) == 5
    assert int((row_map >= 0).sum()) == 5
    out = ops.moe_permute(x, row_map, 5)
    back = ops.moe_unpermute(out, row_map, None)
    kept = (row_map >= 0).sum(1, keepdim=True)
    torch.testing.assert_close(back, x * kept)


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=needs_triton)])
def test_row_map_entries_out_of_range_touch_nothing(backend, monkeypatch):
    from megablocks_core.policy import overrides

    monkeypatch.setattr(overrides, "checked", False)
    x = torch.randn(3, 2)
    row_map = torch.tensor([[0, 99], [-7, 2], [2**30, 1]], dtype=torch.int32)
    with megablocks_core.use_backend(backend):
        out = ops.moe_permute(x, row_map, 3)
        back = ops.moe_unpermute(out, row_map, None)
        probs = ops.moe_permute_probs(torch.ones(3, 2), row_map, 3)
    torch.testing.assert_close(out, torch.stack([x[0], x[2], x[1]]))
    torch.testing.assert_close(back, x)
    assert probs.tolist() == [1.0, 1.0, 1.0]


# ---------------------------------------------------------------------------
# The Triton kernels (under the interpreter) and the conformance kit


def _triton_against_the_loop(
    routing: torch.Tensor, experts: int, rows: int, align: int, hidden: int, seed: int
) -> None:
    """Triton's map, permute, permuted probs, unpermute and its backward on TRITON_DEVICE
    against the per-slot loop (and the reference's backward)."""
    tokens = routing.shape[0]
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    probs = torch.rand(*routing.shape, generator=gen)
    want_map, want_counts, want_rows, want_probs = loop_permute(
        x, routing, experts, rows, align, probs
    )
    y = torch.randn(rows, hidden, generator=gen)
    dev = TRITON_DEVICE
    y_dev = y.to(dev, copy=True).requires_grad_(True)
    with megablocks_core.use_backend("triton"):
        row_map, counts = ops.moe_permute_map(routing.to(dev), experts, rows, align)
        permuted = ops.moe_permute(x.to(dev), row_map, rows)
        permuted_probs = ops.moe_permute_probs(probs.to(dev), row_map, rows)
        back = ops.moe_unpermute(y_dev, row_map, probs.to(dev))
        back.sum().backward()
    row_map, counts = row_map.cpu(), counts.cpu()
    assert torch.equal(row_map, want_map) and torch.equal(counts, want_counts)
    assert torch.equal(permuted.cpu(), want_rows)
    assert torch.equal(permuted_probs.cpu(), want_probs)
    torch.testing.assert_close(back.cpu(), loop_unpermute(y, row_map, probs).float())
    with megablocks_core.use_backend("reference"):
        y_ref = y.clone().requires_grad_(True)
        ops.moe_unpermute(y_ref, row_map, probs).sum().backward()
    # No gradient at all (nothing routed) counts as a zero gradient.
    got = torch.zeros_like(y) if y_dev.grad is None else y_dev.grad.cpu()
    want = torch.zeros_like(y) if y_ref.grad is None else y_ref.grad
    torch.testing.assert_close(got, want)


@needs_triton_device
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=routing_cases, align=st.sampled_from([1, 16, 32]), index_form=st.booleans())
def test_triton_matches_the_loop(case, align, index_form):
    tokens, experts = case["tokens"] % 7, case["experts"]
    top_k = min(case["top_k"], experts)
    mask = top_k_mask(tokens, experts, top_k, min(case["empty"], experts - top_k), case["seed"])
    routing = mask.nonzero()[:, 1].view(tokens, top_k).to(torch.int64) if index_form else mask
    if index_form and tokens:
        routing[0, 0] = experts + 4  # names no expert
    rows = max(tokens * top_k + experts * (align - 1) - case["slack"], 0)  # slack: dropping
    _triton_against_the_loop(routing, experts, rows, align, 3, case["seed"])


@needs_triton_device
@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "align", "index_form", "drop"),
    [
        (300, 24, 3, 16, False, 0),  # more tokens than one scan block, padding
        (300, 24, 3, 1, True, 0),
        (257, 40, 6, 1, True, 40),  # dropping past num_out_tokens
        (129, 8, 2, 128, False, 0),  # padding rows to zero
        (64, 1, 1, 1, True, 0),  # one expert
    ],
)
def test_triton_matches_the_loop_on_multi_block_shapes(
    tokens, experts, top_k, align, index_form, drop
):
    mask = top_k_mask(tokens, experts, top_k, 0, 11)
    routing = mask.nonzero()[:, 1].view(tokens, top_k).to(torch.int64) if index_form else mask
    if index_form:
        routing[1, 0] = -1  # names no expert
    rows = tokens * top_k + experts * (align - 1) - drop
    _triton_against_the_loop(routing, experts, rows, align, 8, 12)


@needs_triton_device
def test_triton_rows_wider_than_one_program():
    """Rows of more than 8K elements: permute and unpermute split each token's row over
    programs (LaunchConfigs.row_copy / row_sum), against the loop."""
    mask = top_k_mask(5, 4, 2, 0, 3)
    _triton_against_the_loop(mask, 4, 10, 1, 8192 + 40, 4)


def _fresh_plans(monkeypatch: pytest.MonkeyPatch) -> None:
    """Empty plan caches for the Triton permutation ops (restored after the test): a test that
    changes their launch constants must not reuse, or leave behind, launches prepared under
    other ones."""
    from megablocks_triton import moe_permute as kernels

    for name in ("_MAP_PLANS", "_PERMUTE_PLANS", "_PROBS_PLANS", "_UNPERMUTE_PLANS"):
        monkeypatch.setattr(kernels, name, {})


@needs_triton_device
def test_triton_prepares_each_call_shape_once(monkeypatch):
    """The map build, permute, probs and unpermute keep one prepared launch per call shape,
    reused by later calls (their results right and their outputs fresh each time); another
    num_out_tokens, routing dtype or probs dtype prepares another."""
    from megablocks_triton import moe_permute as kernels

    _fresh_plans(monkeypatch)
    experts, rows = 24, 120
    mask = top_k_mask(40, experts, 3, 0, seed=2)
    gen = torch.Generator().manual_seed(3)
    x, probs = torch.randn(40, 8, generator=gen), torch.rand(40, experts, generator=gen)
    want_map, want_counts, want_rows, want_probs = loop_permute(x, mask, experts, rows, 1, probs)
    want_weighted = torch.zeros(rows, 8)
    for t, j in (want_map >= 0).nonzero().tolist():
        want_weighted[int(want_map[t, j])] = x[t] * probs[t, j]
    y = torch.randn(rows, 8, generator=gen)
    dev = TRITON_DEVICE
    outputs = []
    for _ in range(3):
        row_map, counts = kernels.moe_permute_map(mask.to(dev), experts, rows, 1)
        assert torch.equal(row_map.cpu(), want_map) and torch.equal(counts.cpu(), want_counts)
        permuted = kernels.moe_permute(x.to(dev), row_map, None, rows)
        assert torch.equal(permuted.cpu(), want_rows)
        outputs.append(permuted)
        weighted = kernels.moe_permute(x.to(dev), row_map, probs.to(dev), rows)
        assert torch.equal(weighted.cpu(), want_weighted)
        moved = kernels.moe_permute_probs(probs.to(dev), row_map, rows)
        assert torch.equal(moved.cpu(), want_probs)
        for weights in (probs, None):
            combined = kernels.moe_unpermute(
                y.to(dev), row_map, None if weights is None else weights.to(dev)
            )
            want = loop_unpermute(y, want_map, weights)
            torch.testing.assert_close(combined.cpu(), want.to(combined.dtype))
    assert len({out.data_ptr() for out in outputs}) > 1  # fresh outputs, not a kept buffer
    counted = (kernels._MAP_PLANS, kernels._PERMUTE_PLANS, kernels._PROBS_PLANS)
    assert [len(p) for p in (*counted, kernels._UNPERMUTE_PLANS)] == [1, 2, 1, 2]
    # Another bound on the rows and the index form of the same routing: plans of their own.
    index = mask.nonzero()[:, 1].view(40, 3)
    kernels.moe_permute_map(mask.to(dev), experts, 100, 1)
    index_map, _ = kernels.moe_permute_map(index.to(dev), experts, rows, 1)
    assert torch.equal(index_map.cpu(), loop_permute(x, index, experts, rows, 1, None)[0])
    assert len(kernels._MAP_PLANS) == 3
    half = kernels.moe_permute_probs(probs.half().to(dev), row_map, rows)
    assert half.dtype == torch.float16 and len(kernels._PROBS_PLANS) == 2


@needs_triton_device
@pytest.mark.parametrize("index_form", [False, True])
def test_triton_map_with_a_count_table_scanned_in_several_steps(index_form, monkeypatch):
    """The scan down the tiles' count table in steps of two tiles, across many small tiles: the
    running sums carried from step to step (real shapes take one or a few steps)."""
    from megablocks_triton import moe_permute as kernels

    _fresh_plans(monkeypatch)
    monkeypatch.setattr(kernels, "SCAN_COLS", 4)
    monkeypatch.setattr(kernels, "SCAN_STEP", 8)  # 2 tiles a step
    monkeypatch.setattr(kernels, "MASK_MAP_TILE", 256)  # 8 tokens of 32 experts a tile
    tokens, experts, top_k = 300, 32, 3
    mask = top_k_mask(tokens, experts, top_k, 0, 5)
    routing = mask.nonzero()[:, 1].view(tokens, top_k).to(torch.int64) if index_form else mask
    _triton_against_the_loop(routing, experts, tokens * top_k + experts * 15, 16, 8, 6)


@needs_triton_device
@pytest.mark.parametrize("experts", [40, 130])  # 130: more slots than the pre-pass's chunk
def test_triton_compacted_slots_match_the_per_slot_loop_and_a_plain_loop(experts, monkeypatch):
    """Mask-form row maps with many slots go through the compaction pre-pass: its lists, and
    permute, unpermute and wgrad bit-identical to the per-slot path and equal to a plain loop;
    tokens with no slot and with every slot, entries out of range and past num_out_tokens."""
    from megablocks_triton import moe_permute as kernels

    tokens, hidden = 33, 3  # 33: more tokens than one pre-pass block
    mask = top_k_mask(tokens, experts, 3, 0, seed=experts)
    mask[0], mask[1] = False, True
    rows = int(mask.sum())
    row_map, _ = ops.moe_permute_map(mask, experts, rows)
    row_map[2, 0], row_map[3, -1], row_map[3, 1] = rows + 7, -5, 2**30  # bad entries
    num_out = rows - 2  # permute drops the last two rows
    gen = torch.Generator().manual_seed(experts)
    x, y = torch.randn(tokens, hidden, generator=gen), torch.randn(rows, hidden, generator=gen)
    probs = torch.rand(tokens, experts, generator=gen)
    dev = TRITON_DEVICE
    cols, count, compact = kernels._compact_slots(row_map.to(dev), rows)
    valid = (row_map >= 0) & (row_map < rows)
    assert compact and torch.equal(count.cpu(), valid.sum(1).to(torch.int32))
    for t in range(tokens):
        assert cols[t, : int(count[t])].cpu().tolist() == valid[t].nonzero()[:, 0].tolist()

    def run(n: int) -> list[torch.Tensor]:  # the first n tokens
        m, p, g = row_map[:n].to(dev), probs[:n].to(dev), x[:n].to(dev)
        return [
            kernels.moe_permute(g, m, p, num_out).cpu(),
            kernels.moe_unpermute(y.to(dev), m, p).cpu(),
            kernels.moe_unpermute(y.to(dev), m, None).cpu(),
            kernels.moe_unpermute_wgrad(y.to(dev), g, m).cpu(),
        ]

    _fresh_plans(monkeypatch)
    compacted, few = run(tokens), run(4)  # the per-slot path is slow under the interpreter
    monkeypatch.setattr(kernels, "COMPACT_ABOVE_SLOTS", experts)
    _fresh_plans(monkeypatch)
    for got, want in zip(few, run(4), strict=True):
        assert torch.equal(got, want)
    want = [
        torch.zeros(num_out, hidden),
        torch.zeros(tokens, hidden, dtype=torch.float64),
        torch.zeros(tokens, hidden, dtype=torch.float64),
        torch.zeros(tokens, experts, dtype=torch.float64),
    ]
    for t, j in (row_map >= 0).nonzero().tolist():
        r = int(row_map[t, j])
        if r < num_out:
            want[0][r] = x[t] * probs[t, j]
        if r < rows:
            want[1][t] += float(probs[t, j]) * y[r].double()
            want[2][t] += y[r].double()
            want[3][t, j] = (y[r].double() * x[t].double()).sum()
    for got, expected in zip(compacted, want, strict=True):
        torch.testing.assert_close(got, expected.float())


class _GarbageEmpty:
    """torch for megablocks_triton.moe_permute, except that its empty tensors are full of
    garbage (NaN, or 0x5A5A...): an output row or row map entry a kernel forgets to write
    shows instead of passing as the zeros fresh memory often holds."""

    def __getattr__(self, name: str) -> object:
        return getattr(torch, name)

    @staticmethod
    def empty(*size: object, **kw: object) -> torch.Tensor:
        out = torch.empty(*size, **kw)
        return out.fill_(float("nan") if out.is_floating_point() else 0x5A5A)


@needs_triton_device
@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "align", "index_form", "slack", "many_experts"),
    [
        (40, 24, 3, 16, False, 50, False),  # padding rows and rows past the real count
        (40, 24, 3, 16, True, 50, False),
        (100, 40, 3, 1, False, -30, False),  # several map tiles, dropping
        (100, 40, 3, 1, True, -30, False),
        (40, 24, 3, 16, False, 50, True),  # the per-expert scans (many experts)
        (40, 24, 3, 16, True, 50, True),
    ],
)
def test_triton_writes_every_row_and_map_entry(
    tokens, experts, top_k, align, index_form, slack, many_experts, monkeypatch
):
    """The map's entries and the permuted rows (zero only where no slot names a row) are
    written over uninitialized memory, on every map path: one tile, several tiles, and the
    per-expert scans past MAX_MAP_EXPERTS; rows wider than the zeroing pass's block."""
    from megablocks_triton import moe_permute as kernels

    _fresh_plans(monkeypatch)
    monkeypatch.setattr(kernels, "torch", _GarbageEmpty())
    if many_experts:
        monkeypatch.setattr(kernels, "MAX_MAP_EXPERTS", experts - 1)
    mask = top_k_mask(tokens, experts, top_k, 0, seed=tokens + experts)
    routing = mask.nonzero()[:, 1].view(tokens, top_k).to(torch.int64) if index_form else mask
    if index_form:
        routing[1, 0], routing[2, 2] = -3, experts  # name no expert
    rows = tokens * top_k + experts * (align - 1) + slack
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(tokens, 130, generator=gen)
    probs = torch.rand(*routing.shape, generator=gen)
    want_map, want_counts, want_rows, want_probs = loop_permute(
        x, routing, experts, rows, align, probs
    )
    dev = TRITON_DEVICE
    row_map, counts = kernels.moe_permute_map(routing.to(dev), experts, rows, align)
    assert torch.equal(row_map.cpu(), want_map) and torch.equal(counts.cpu(), want_counts)
    assert torch.equal(kernels.moe_permute(x.to(dev), row_map, None, rows).cpu(), want_rows)
    want_weighted = torch.zeros(rows, x.shape[1])
    for t, j in (want_map >= 0).nonzero().tolist():
        want_weighted[int(want_map[t, j])] = x[t] * probs[t, j]
    weighted = kernels.moe_permute(x.to(dev), row_map, probs.to(dev), rows).cpu()
    assert torch.equal(weighted, want_weighted)
    assert torch.equal(kernels.moe_permute_probs(probs.to(dev), row_map, rows).cpu(), want_probs)


@needs_triton
def test_the_kit_passes_triton_on_the_moe_permute_ops_paired_with_the_reference():
    from megablocks_core.testing import kit

    names = [c.name for c in megablocks_core.contracts.MOE_PERMUTATION_OPS]
    results = kit.check(["triton"], "cpu", quick=True, ops=names)
    assert {r.op: r.status for r in results} == dict.fromkeys(names, "pass"), [
        r.message for r in results if r.status != "pass"
    ]


def test_the_bad_data_checks_catch_wrong_results():
    from megablocks_core.testing import Mismatch, bad_data

    case = next(c for c in bad_data.CASES if c.name == "moe_permute_map/expert ids out of range")
    args = case.build(torch.device("cpu"))
    row_map, counts = ops.moe_permute_map(*args)
    bad_data.check_result("moe_permute_map", args, (row_map, counts))
    swapped = row_map.flip(0).contiguous()
    with pytest.raises(Mismatch):
        bad_data.check_result("moe_permute_map", args, (swapped, counts))
    case = next(c for c in bad_data.CASES if c.name == "moe_permute/row map out of range")
    args = case.build(torch.device("cpu"))
    out = ops.moe_permute(args[0], args[1], args[3])
    with pytest.raises(Mismatch):  # the unweighted rows where weighted ones are due
        bad_data.check_result("moe_permute", args, out)
