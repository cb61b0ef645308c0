"""What a backward does after a forward that accepted unchecked bad data, and whose name its
errors carry.

The fused ops read bins that are not a cumulative sum as the contract says (a negative group
counts as 0, groups are cut at the last sorted row). Their backward must read them the same way
on every backend and wherever the bins live, and never raise about an op or an argument the
caller did not use.
"""

from __future__ import annotations

import os

import pytest
import torch
from triton_interpreter import interpreting

import megablocks_core
from megablocks_core import ContractError, autograd, ops

F64 = torch.float64
TOKENS, TOP_K, EXPERTS, HIDDEN, FFN = 4, 2, 3, 4, 5
ROWS = TOKENS * TOP_K

#: Bins the unchecked forward accepts (no MEGABLOCKS_CHECK): not cumulative, past the rows,
#: negative, short of the rows.
BAD_BINS = {
    "not cumulative": [5, 3, 8],
    "past the rows": [3, 6, 12],
    "negative start": [-3, 6, 8],
    "short of the rows": [2, 4, 6],
    "int32 extremes": [2**31 - 1, -(2**31), 2**31 - 1],
}


def _groups(bins: list[int], rows: int) -> list[tuple[int, int]]:
    """Each expert's [start, end) rows as the contract reads bins (a plain loop)."""
    groups, start, previous = [], 0, 0
    for b in bins:
        size = max(b - previous, 0)
        previous = b
        end = min(start + size, rows)
        groups.append((start, end))
        start = end
    return groups


def _routing():
    top = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1], dtype=torch.int32)
    with megablocks_core.use_backend("reference"):
        bin_ids, indices = ops.sort(top, 2)
    return indices, bin_ids


def _inputs(dtype: torch.dtype, device: torch.device | str = "cpu"):
    gen = torch.Generator().manual_seed(0)
    shapes = ((TOKENS, HIDDEN), (EXPERTS, HIDDEN, FFN), (EXPERTS, FFN, HIDDEN), (ROWS,))
    values = [torch.randn(s, generator=gen, dtype=F64) for s in shapes]
    values[-1] = values[-1].abs()
    return [v.to(device, dtype).requires_grad_() for v in values]


def _step(backend: str, bins: torch.Tensor, dtype: torch.dtype, device: torch.device | str):
    indices, bin_ids = (t.to(device) for t in _routing())
    x, w1, w2, weights = leaves = _inputs(dtype, device)
    with megablocks_core.use_backend(backend):
        h = ops.gather_gmm(x, w1, indices, bin_ids, bins, TOP_K, False)
        y = ops.gmm_scatter(h, w2, indices, bin_ids, weights, bins, TOP_K, False)
        y.pow(2).sum().backward()
    return [t.grad.to("cpu", F64) for t in leaves]


@pytest.mark.parametrize("case", list(BAD_BINS))
def test_backward_after_bad_bins_reads_them_as_the_forward(case):
    bins = torch.tensor(BAD_BINS[case], dtype=torch.int32)
    x, w1, w2, weights = _step("reference", bins, F64, "cpu")
    # The first GEMM's weight gradient from the groups as the contract reads the bins: the
    # expert-sorted rows of x, times the gradient of h there (recomputed by a plain loop).
    indices, bin_ids = _routing()
    xs, w1s, w2s, ws = (t.detach() for t in _inputs(F64))
    rows = xs[indices.long() // TOP_K]
    groups = _groups(BAD_BINS[case], ROWS)
    h = torch.zeros(ROWS, FFN, dtype=F64)
    for e, (s, t) in enumerate(groups):
        h[s:t] = rows[s:t] @ w1s[e]
    y_rows = torch.zeros(ROWS, HIDDEN, dtype=F64)
    for e, (s, t) in enumerate(groups):
        y_rows[s:t] = h[s:t] @ w2s[e]
    scale = ws[indices.long()].unsqueeze(1)
    y = torch.zeros(TOKENS, HIDDEN, dtype=F64).index_add_(
        0, indices.long() // TOP_K, y_rows * scale
    )
    grad_rows = (2 * y)[indices.long() // TOP_K] * scale
    grad_h = torch.zeros_like(h)
    want_w1 = torch.zeros_like(w1s)
    for e, (s, t) in enumerate(groups):
        grad_h[s:t] = grad_rows[s:t] @ w2s[e].T
        want_w1[e] = rows[s:t].T @ grad_h[s:t]
    torch.testing.assert_close(w1, want_w1)


DEVICE = torch.device(
    os.environ.get("MEGABLOCKS_TRITON_TEST_DEVICE", "cpu" if interpreting() else "cuda")
)
_RUNNABLE = interpreting() if DEVICE.type == "cpu" else torch.cuda.is_available()


@pytest.mark.skipif(not _RUNNABLE, reason=f"Triton kernels on {DEVICE} cannot run here")
@pytest.mark.parametrize("case", list(BAD_BINS))
def test_backward_after_bad_bins_is_the_same_on_every_backend_and_device(case):
    pytest.importorskip("megablocks_triton")
    # The bins (and the counts the backward derives from them) live where the tokens do: on
    # the CPU under the interpreter, on the GPU otherwise. Either way the same as the reference.
    want = _step("reference", torch.tensor(BAD_BINS[case], dtype=torch.int32), F64, "cpu")
    bins = torch.tensor(BAD_BINS[case], dtype=torch.int32, device=DEVICE)
    got = _step("triton", bins, torch.float32, DEVICE)
    for g, w, name in zip(got, want, ("x", "w1", "w2", "weights"), strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4, msg=f"{name} on {DEVICE}")


def test_an_error_inside_a_backward_names_the_op_that_was_called(monkeypatch):
    def inner_failure(call, bound, grad, needs):
        raise ContractError("megablocks_core.ops.gmm_weight_grad: batch_sizes: a made-up failure")

    rule = autograd.RULES["gmm"]
    monkeypatch.setitem(
        autograd.RULES, "gmm", autograd.BackwardRule(inner_failure, rule.saves, rule.saves_if)
    )
    a = torch.randn(4, 3, requires_grad=True)
    b = torch.randn(2, 3, 2)
    with megablocks_core.use_backend("reference"):
        out = ops.gmm(a, b, torch.tensor([2, 2]))
        with pytest.raises(ContractError, match=r"^megablocks_core\.ops\.gmm: its backward") as err:
            out.sum().backward()
    assert "gmm_weight_grad" in str(err.value)  # the inner cause is kept in the message
    assert isinstance(err.value.__cause__, ContractError)


@pytest.mark.parametrize("enabled", ["no", 0, 1, None, 0.5])
def test_fuse_grad_accumulation_takes_only_a_bool(enabled):
    weight = torch.nn.Parameter(torch.randn(2, 3, 4))
    with pytest.raises(TypeError, match="enabled must be True or False"):
        megablocks_core.fuse_grad_accumulation(weight, enabled=enabled)
    assert not megablocks_core.is_grad_accumulation_fused(weight)
