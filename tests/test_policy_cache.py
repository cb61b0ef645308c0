"""Policies compare by value, so the dispatch caches they key stay small and warm however often
a ``use_backend`` block is entered."""

from __future__ import annotations

import time

import torch

import megablocks_core
from megablocks_core import dispatch, ops
from megablocks_core.policy import Policy


def test_policies_are_equal_by_value_whatever_their_source():
    a = Policy.parse("triton,reference", source="MEGABLOCKS_BACKEND")
    b = Policy.parse("triton,reference", source="use_backend()")
    assert a == b and hash(a) == hash(b)
    assert Policy.parse("reference,triton") != a  # the order of preference matters
    assert Policy.parse("gather=reference") != Policy.parse("scatter=reference")
    assert Policy(force="reference") == Policy.parse("reference")


def test_a_use_backend_block_in_a_loop_reuses_one_cache_entry():
    top = torch.tensor([1, 0, 1, 0], dtype=torch.int32)
    bin_ids, indices = ops.sort(top, 1)
    bins = ops.inclusive_cumsum(ops.histogram(top, 2), 0)
    x = torch.randn(2, 3)

    def one_block() -> None:
        with megablocks_core.use_backend("reference"):
            ops.gather(x, indices, bin_ids, bins, 2)

    one_block()
    calls, ranked = len(dispatch._caches["gather"]), len(dispatch._ranked["gather"])
    start = time.perf_counter()
    for _ in range(2000):
        one_block()
    assert len(dispatch._caches["gather"]) == calls  # every block hit the entry of the first
    assert len(dispatch._ranked["gather"]) == ranked
    # Not a timing test: a generous bound that only a miss (validation and ranking on every
    # call, several times slower) could break on any machine.
    assert (time.perf_counter() - start) / 2000 < 2e-3


def test_the_ranking_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(dispatch, "SHAPE_CACHE_LIMIT", 4)
    dispatch._ranked["gather"].clear()  # earlier tests' choices: more than the limit set here
    top = torch.tensor([1, 0, 1, 0], dtype=torch.int32)
    bin_ids, indices = ops.sort(top, 1)
    bins = ops.inclusive_cumsum(ops.histogram(top, 2), 0)
    seen = 0
    for dtype in (torch.float16, torch.float32, torch.float64, torch.bfloat16):
        for preferred in ("reference", "reference,triton"):  # 8 signatures in all
            x = torch.randn(2, 3).to(dtype)
            with megablocks_core.use_backend(*preferred.split(",")):
                out = ops.gather(x, indices, bin_ids, bins, 2)
            assert torch.equal(out, x[indices.long() // 2])
            seen += 1
            assert len(dispatch._ranked["gather"]) <= 4
    assert seen == 8
