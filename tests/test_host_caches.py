"""What the host remembers between calls instead of rebuilding it: the fused ops' group sizes in
backward (megablocks_core.autograd.gmm._counts_from_bins) and the Gluon weight gradient's shared
layouts (megablocks_triton.hopper_wgrad.shared_layout). Each must give what rebuilding gives, and
must not be reused where it would be stale."""

from __future__ import annotations

import gc

import pytest
import torch

from megablocks_core.autograd import gmm as rules


def _fresh(bins: torch.Tensor, rows: int) -> torch.Tensor:
    """The group sizes as the fused ops read bins, by a plain loop (an independent reference)."""
    sizes, end = [], 0
    previous = 0
    for value in bins.tolist():
        size = max(value - previous, 0)
        previous = value
        start = min(end, rows)
        end += size
        sizes.append(min(end, rows) - start)
    return torch.tensor(sizes, dtype=torch.int32)


@pytest.fixture(autouse=True)
def _forget() -> None:
    rules._LAST_COUNTS = None


def test_counts_are_remembered_for_the_same_bins_and_rows() -> None:
    bins = torch.tensor([3, 3, 7, 5, 12], dtype=torch.int32)  # an empty and a negative group
    first = rules._counts_from_bins(bins, 10)
    assert torch.equal(first, _fresh(bins, 10))
    assert rules._counts_from_bins(bins, 10) is first
    other_rows = rules._counts_from_bins(bins, 6)
    assert torch.equal(other_rows, _fresh(bins, 6))


def test_counts_are_recomputed_after_bins_change_in_place() -> None:
    bins = torch.tensor([2, 4, 6], dtype=torch.int32)
    before = rules._counts_from_bins(bins, 6)
    bins.copy_(torch.tensor([1, 1, 6], dtype=torch.int32))
    after = rules._counts_from_bins(bins, 6)
    assert after is not before
    assert torch.equal(after, _fresh(bins, 6))


def test_counts_of_another_bins_tensor_are_its_own() -> None:
    """A bins tensor with the id of a freed one (Python reuses ids) is not taken for it."""
    for values in ([2, 4, 6], [1, 5, 6], [6, 6, 6]):
        bins = torch.tensor(values, dtype=torch.int32)
        assert torch.equal(rules._counts_from_bins(bins, 6), _fresh(bins, 6))
        del bins
        gc.collect()


def test_counts_are_not_remembered_while_tracing(monkeypatch: pytest.MonkeyPatch) -> None:
    bins = torch.tensor([2, 4, 6], dtype=torch.int32)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    first = rules._counts_from_bins(bins, 6)
    assert rules._LAST_COUNTS is None
    assert rules._counts_from_bins(bins, 6) is not first


def test_the_gluon_layouts_are_built_once_and_equal_gluons_own() -> None:
    hopper_wgrad = pytest.importorskip("megablocks_triton.hopper_wgrad")
    from triton.experimental.gluon import language as gl

    hopper_wgrad.shared_layout.cache_clear()
    for block, dtype, kind in (
        ((64, 128), torch.bfloat16, gl.bfloat16),
        ((1, 128, 256), torch.float16, gl.float16),
    ):
        layout = hopper_wgrad.shared_layout(block, dtype)
        assert layout == gl.NVMMASharedLayout.get_default_for(list(block), kind)
        assert hopper_wgrad.shared_layout(block, dtype) is layout
    assert hopper_wgrad.shared_layout.cache_info().misses == 2
