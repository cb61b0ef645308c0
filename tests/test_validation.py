"""Bad input raises TypeError/ValueError naming the op, the argument, what was expected and what came."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import megablocks_core
from megablocks_core import ops

pytestmark = pytest.mark.usefixtures("reference_backend")


def routing(tokens: int = 6, top_k: int = 2, experts: int = 4, hidden: int = 3):
    torch.manual_seed(0)
    top = torch.randint(0, experts, (tokens * top_k,), dtype=torch.int32)
    bin_ids, indices = ops.sort(top, 2)
    counts = ops.histogram(top, experts)
    bins = ops.inclusive_cumsum(counts, 0)
    padded_bins = ops.inclusive_cumsum(ops.round_up(counts, 4), 0)
    x = torch.randn(tokens, hidden)
    return x, indices, bin_ids, bins, padded_bins, counts


def raises(error: type[Exception], *fragments: str):
    """pytest.raises that also requires every fragment in the message."""
    pattern = "".join(f"(?=.*{re.escape(f)})" for f in fragments)
    return pytest.raises(error, match=re.compile(pattern, re.S))


def test_float_keys_are_a_type_error():
    with raises(TypeError, "ops.sort", "'x'", "int16/int32/int64", "float32"):
        ops.sort(torch.rand(5), 3)
    with raises(TypeError, "ops.histogram", "'x'", "float32"):
        ops.histogram(torch.rand(5), 3)


def test_wrong_rank():
    with raises(ValueError, "ops.sort", "'x'", "1-D", "got a 2-D tensor"):
        ops.sort(torch.zeros(2, 2, dtype=torch.int32))
    x, indices, bin_ids, bins, _, _ = routing()
    with raises(ValueError, "ops.gather", "'x'", "2-D", "got a 1-D tensor"):
        ops.gather(x[:, 0], indices, bin_ids, bins, 2)


def test_top_k_inconsistent_with_indices():
    x, indices, bin_ids, bins, _, _ = routing(tokens=6, top_k=2)
    with raises(ValueError, "ops.gather", "x.shape[0] * top_k == indices.shape[0]", "top_k=3"):
        ops.gather(x, indices, bin_ids, bins, 3)
    rows = torch.randn(indices.shape[0], x.shape[1])
    with raises(ValueError, "ops.scatter", "indices.shape[0] % top_k == 0", "top_k=5"):
        ops.scatter(rows, indices, bin_ids, None, bins, 5)


def test_wrong_lengths():
    x, indices, bin_ids, bins, padded_bins, _ = routing()
    with raises(
        ValueError, "ops.gather", "indices.shape[0] == bin_ids.shape[0]", "bin_ids.shape[0]=11"
    ):
        ops.gather(x, indices, bin_ids[:-1], bins, 2)
    rows = torch.randn(indices.shape[0], x.shape[1])
    with raises(ValueError, "ops.scatter", "weights.shape[0] == indices.shape[0]"):
        ops.scatter(rows, indices, bin_ids, torch.rand(3), bins, 2)
    with raises(ValueError, "ops.padded_gather", "padded_bins.shape[0] == bins.shape[0]"):
        ops.padded_gather(x, indices, bin_ids, bins, padded_bins[:-1], 2)


def test_bad_ints():
    x, indices, bin_ids, bins, _, _ = routing()
    with raises(ValueError, "ops.gather", "'top_k'", "int >= 1", "got 0"):
        ops.gather(x, indices, bin_ids, bins, 0)
    with raises(TypeError, "ops.gather", "'top_k'", "float"):
        ops.gather(x, indices, bin_ids, bins, 2.0)
    with raises(TypeError, "ops.histogram", "'num_bins'", "bool"):
        ops.histogram(indices, True)
    with raises(ValueError, "ops.histogram", "'num_bins'", "got -1"):
        ops.histogram(indices, -1)
    with raises(ValueError, "ops.sort", "end_bit", "torch.iinfo(x.dtype).bits"):
        ops.sort(torch.zeros(3, dtype=torch.int16), 20)
    with raises(ValueError, "ops.inclusive_cumsum", "-x.dim() <= dim < x.dim()", "dim=1"):
        ops.inclusive_cumsum(torch.zeros(3, dtype=torch.int32), 1)


def test_numpy_integers_are_accepted():
    np = pytest.importorskip("numpy")
    counts = ops.histogram(torch.tensor([0, 1, 1], dtype=torch.int32), np.int64(3))
    assert counts.tolist() == [1, 2, 0]


def test_not_a_tensor():
    with raises(TypeError, "ops.sort", "'x'", "list"):
        ops.sort([1, 2, 3])
    x, indices, bin_ids, bins, _, _ = routing()
    with raises(TypeError, "ops.gather", "'bins'", "NoneType"):
        ops.gather(x, indices, bin_ids, None, 2)


def test_tensors_on_different_devices():
    x, indices, bin_ids, bins, _, _ = routing()
    with raises(ValueError, "ops.gather", "'indices'", "must be on cpu", "meta"):
        ops.gather(x, indices.to("meta"), bin_ids, bins, 2)


def test_int16_indices_that_would_overflow_are_rejected():
    with raises(ValueError, "ops.sort", "int16", "32768", "x.shape[0]=40000"):
        ops.sort(torch.zeros(40000, dtype=torch.int16))
    x = torch.randn(20000, 2)
    indices = torch.zeros(40000, dtype=torch.int16)
    with raises(ValueError, "ops.gather", "int16 indices"):
        ops.gather(x, indices, indices, torch.tensor([40000], dtype=torch.int32), 2)


def test_dtype_mismatch_in_gmm():
    a, b = torch.randn(4, 3), torch.randn(2, 3, 5, dtype=torch.float64)
    with raises(TypeError, "ops.gmm", "b.dtype == a.dtype"):
        ops.gmm(a, b, torch.tensor([2, 2]))


def test_gmm_shape_errors():
    a, b = torch.randn(5, 3), torch.randn(2, 3, 4)
    with raises(
        ValueError, "ops.gmm", "one group size per expert", "batch_sizes.shape[0]=3", "b.shape[0]=2"
    ):
        ops.gmm(a, b, torch.tensor([2, 2, 1]))
    with raises(ValueError, "ops.gmm", "inner dimensions agree", "a.shape[1]=3"):
        ops.gmm(a, b, torch.tensor([2, 3]), trans_b=True)
    with raises(ValueError, "ops.gmm", "fit in the rows of a", "a.shape[0]=5"):
        ops.gmm(a, b, torch.tensor([3, 3]))
    # Groups ending before the last row are valid: the rows past them belong to no group (0).
    out = ops.gmm(a, b, torch.tensor([2, 2]))
    assert torch.equal(out[4], torch.zeros(4))
    torch.testing.assert_close(out[:2], a[:2] @ b[0])
    with raises(ValueError, "ops.gmm", "not negative"):
        ops.gmm(a, b, torch.tensor([7, -2]))
    with raises(TypeError, "ops.gmm", "'batch_sizes'", "int32/int64", "float32"):
        ops.gmm(a, b, torch.tensor([2.0, 3.0]))
    with raises(TypeError, "ops.gmm", "'trans_b'", "bool"):
        ops.gmm(a, b, torch.tensor([2, 3]), 1)


def test_activation_backward_errors():
    from megablocks_core.plugin import call_op

    grad, x = torch.randn(4, 3), torch.randn(4, 3)
    with raises(ValueError, "activation_backward", "grad has act(x)'s shape", "x.shape[1]=2"):
        call_op("activation_backward", grad, x[:, :2], None, "gelu")
    # A gated activation: x is [gate | up], twice grad's width.
    with raises(ValueError, "activation_backward", "grad has act(x)'s shape", "x.shape[1]=4"):
        call_op("activation_backward", grad, torch.randn(4, 4), None, "swiglu")
    with raises(ValueError, "activation_backward", "gate and up halves", "x.shape[1]=5"):
        call_op("activation_backward", grad, torch.randn(4, 5), None, "geglu")
    with raises(ValueError, "activation_backward", "one scale per row", "scale.shape[0]=5"):
        call_op("activation_backward", grad, x, torch.rand(5), "gelu")
    with raises(TypeError, "activation_backward", "x.dtype == grad.dtype"):
        call_op("activation_backward", grad.half(), x, None, "silu")
    with raises(ValueError, "activation_backward", "'activation'", "'tanh'"):
        call_op("activation_backward", grad, x, None, "tanh")


def test_gmm_scatter_gated_activation_errors():
    """A gated activation halves x's width before the GEMM: b's inner dimension is half of x's."""
    x, indices, bin_ids, bins, _, _ = routing()
    rows = indices.shape[0]
    weights = torch.rand(rows)
    h, w2 = torch.randn(rows, 8), torch.randn(4, 4, 3)
    assert ops.gmm_scatter(h, w2, indices, bin_ids, weights, bins, 2, False, "swiglu").shape == (
        rows // 2,
        3,
    )
    with raises(ValueError, "ops.gmm_scatter", "inner dimensions agree", "x.shape[1]=8"):
        ops.gmm_scatter(h, w2, indices, bin_ids, weights, bins, 2, False, "gelu")
    with raises(ValueError, "ops.gmm_scatter", "gate and up halves", "x.shape[1]=9"):
        ops.gmm_scatter(
            torch.randn(rows, 9), w2, indices, bin_ids, weights, bins, 2, False, "reglu"
        )


def test_composite_op_errors():
    with raises(TypeError, "ops.round_up", "'x'", "float32"):
        ops.round_up(torch.rand(3), 4)
    with raises(ValueError, "ops.round_up", "'value'", "got 0"):
        ops.round_up(torch.ones(3, dtype=torch.int32), 0)
    with raises(ValueError, "ops.repeat", "len(tiling) >= x.dim()"):
        ops.repeat(torch.ones(2, 2), (2,))
    with raises(ValueError, "ops.sum", "x.dim() > 0"):
        ops.sum(torch.tensor(3.0))


def test_errors_are_contract_error_subclasses():
    with pytest.raises(megablocks_core.ContractError) as info:
        ops.histogram(torch.zeros(2, 2, 2, dtype=torch.int32), 3)
    assert isinstance(info.value, ValueError)
    with pytest.raises(megablocks_core.ContractTypeError) as info:
        ops.histogram(torch.zeros(2), 3)
    assert isinstance(info.value, TypeError)


@pytest.fixture
def checked_mode():
    megablocks_core.reload({"MEGABLOCKS_CHECK": "1"})
    yield
    megablocks_core.reload({})


def test_data_rules_run_only_in_checked_mode(checked_mode):
    x, indices, bin_ids, bins, padded_bins, counts = routing()
    bad = indices.clone()
    bad[0] = bad[1]  # no longer a permutation
    with raises(ValueError, "ops.gather", "is_permutation(indices)"):
        ops.gather(x, bad, bin_ids, bins, 2)
    with raises(ValueError, "ops.sort", "keys lie in [0, 2**end_bit)"):
        ops.sort(torch.tensor([0, 9], dtype=torch.int32), 2)
    with raises(ValueError, "ops.padded_gather", "bins ends at the number of rows"):
        ops.padded_gather(x, indices, bin_ids, bins - 1, padded_bins, 2)
    with raises(ValueError, "ops.gather", "bins end at or before the last sorted row"):
        ops.gather(x, indices, bin_ids, bins + 1, 2)
    with raises(ValueError, "ops.gather_gmm", "bin_ids agrees with bins"):
        ops.gather_gmm(x, torch.randn(4, 3, 2), indices, bin_ids, bins - 1, 2)
    with raises(ValueError, "ops.padded_gather", "each padded bin holds"):
        ops.padded_gather(x, indices, bin_ids, bins, bins // 2, 2)
    with raises(ValueError, "ops.inclusive_cumsum", "running sums fit"):
        ops.inclusive_cumsum(torch.full((3,), 30000, dtype=torch.int16), 0)


def test_rows_routed_to_no_expert_pass_checked_mode(checked_mode):
    """Sorted rows past bins[-1] whose bin_ids name the sentinel bin (the number of experts), as
    expert parallelism routes the pairs of other ranks' experts, are valid for the fused ops and
    for the gather and scatter their backward and reference composition call."""
    x, _, _, _, _, _ = routing()
    top = torch.tensor([0, 4, 1, 4, 4, 2, 0, 3, 4, 1, 4, 4], dtype=torch.int32)  # 4: no expert
    bin_ids, indices = ops.sort(top, 3)
    bins = ops.inclusive_cumsum(ops.histogram(top, 4), 0)
    assert int(bins[-1]) == 6
    w1, w2 = torch.randn(4, 3, 5), torch.randn(4, 5, 3)
    weights = torch.rand(12, requires_grad=True)
    leaf = x.clone().requires_grad_()
    h = ops.gather_gmm(leaf, w1, indices, bin_ids, bins, 2)
    assert torch.equal(h[6:], torch.zeros(6, 5))
    out = ops.gmm_scatter(h, w2, indices, bin_ids, weights, bins, 2)
    out.sum().backward()
    unrouted = indices[6:].long()
    assert torch.equal(weights.grad[unrouted], torch.zeros(6))
    assert ops.gather(x, indices, bin_ids, bins, 2).shape == (12, 3)
    assert ops.scatter(h, indices, bin_ids, None, bins, 2).shape == (6, 5)


def test_data_rules_are_skipped_by_default():
    # Out-of-range keys with end_bit are the caller's promise; without checked mode nobody reads them.
    values, _ = ops.sort(torch.tensor([5, 1], dtype=torch.int32), 1)
    assert values.tolist() == [1, 5]


def test_a_traceback_through_an_entry_function_shows_its_generated_lines():
    import traceback

    from megablocks_core.entries import ENTRIES

    with pytest.raises(TypeError) as info:
        ops.histogram("not a tensor", 4)
    frames = traceback.extract_tb(info.value.__traceback__)
    entry = [f for f in frames if f.filename == "<megablocks_core.entries histogram>"]
    assert len(entry) == 1, [f.filename for f in frames]
    assert entry[0].line == "chosen = _resolve(_contract, key, (x, num_bins,))"
    assert entry[0].line in ENTRIES["histogram"].__source__
    assert "chosen = _resolve(_contract, key" in "".join(traceback.format_exception(info.value))


def test_composite_ops_remember_valid_call_shapes_and_reject_bad_calls_every_time(monkeypatch):
    """round_up/repeat/sum validate a call shape once (their rules read no data); a call that
    breaks the contract is never remembered, so it raises every time."""
    from megablocks_core import validation
    from megablocks_core.contracts import BY_NAME
    from megablocks_core.entries import validator

    validated = []
    real = validation.validate

    def counting(op, args, *rest, **kw):
        validated.append(op.name)
        return real(op, args, *rest, **kw)

    monkeypatch.setattr(validation, "validate", counting)
    fresh = {name: validator(BY_NAME[name]) for name in ops._VALIDATORS}
    monkeypatch.setattr(ops, "_VALIDATORS", fresh)  # no call shape seen yet
    x = torch.tensor([0, 1, 5, 8], dtype=torch.int32)
    for _ in range(3):
        assert ops.round_up(x, 4).tolist() == [0, 4, 8, 8]
    assert validated == ["round_up"]
    assert ops.round_up(x, 8).tolist() == [0, 8, 8, 8]  # another value: validated once more
    assert ops.round_up(x[:2], 4).tolist() == [0, 4]  # another shape
    assert validated == ["round_up"] * 3
    for _ in range(2):
        with pytest.raises(ValueError, match="'value' must be an int >= 1"):
            ops.round_up(x, 0)
        with pytest.raises(TypeError, match="'value' must be an int >= 1; got bool"):
            ops.round_up(x, True)  # == 1 and hashes like 1: the key tells the types apart
        with pytest.raises(TypeError, match="argument 'x' must be a tensor of int"):
            ops.round_up(x.float(), 4)
        with pytest.raises(ValueError, match="one factor per dimension"):
            ops.repeat(x.view(2, 2), (2,))
    assert ops.repeat(x.view(2, 2), [1, 2]).shape == (2, 4)
    assert ops.repeat(x.view(2, 2), [1, 2]).shape == (2, 4)
    assert validated.count("repeat") == 3  # two refused calls, one valid shape
    ops.repeat(x.view(2, 2), (np.int64(1), 2))  # equal to the key of (1, 2), not its types
    assert validated.count("repeat") == 4
    with pytest.raises(TypeError, match="sequence of non-negative ints"):
        ops.repeat(x.view(2, 2), {1: 0, 2: 0})  # iterates like (1, 2); not a sequence


def test_a_validator_remembers_accepted_call_shapes_only_for_what_their_keys_vouch_for(
    monkeypatch,
):
    """entries.validator (for code that calls a contract without its entry): a call shape it
    accepted once is not validated again, but CPU batch sizes, exact argument types and, in
    checked mode, the data rules are checked on every call, and rejected calls are never
    remembered."""
    from megablocks_core import validation
    from megablocks_core.contracts import BY_NAME
    from megablocks_core.entries import validator
    from megablocks_core.policy import overrides

    full = []
    real = validation.validate
    monkeypatch.setattr(validation, "validate", lambda *a: full.append(a[0].name) or real(*a))
    check = validator(BY_NAME["gmm"])
    a, b = torch.randn(6, 4), torch.randn(2, 4, 3)
    args = (a, b, torch.tensor([2, 4]), False, None)
    assert check(args) == args and check(args) == args
    assert full == ["gmm"]  # the second call: its key was seen
    with pytest.raises(megablocks_core.ContractError, match="batch_sizes"):
        check((a, b, torch.tensor([4, 4]), False, None))  # host data the key cannot see
    with pytest.raises(megablocks_core.ContractTypeError, match="trans_b"):
        check((a, b, torch.tensor([2, 4]), 0, None))  # 0 == False in a key
    with pytest.raises(megablocks_core.ContractError):
        check((a, torch.randn(2, 5, 3), torch.tensor([2, 4]), False, None))
    with pytest.raises(megablocks_core.ContractError):  # still refused: never remembered
        check((a, torch.randn(2, 5, 3), torch.tensor([2, 4]), False, None))
    with pytest.raises(TypeError, match="expected 5 arguments"):
        check((a, b))
    sort = validator(BY_NAME["sort"])
    keys = torch.tensor([5, 1], dtype=torch.int32)
    sort((keys, 1))  # out-of-range keys with end_bit: only a data rule reads them
    monkeypatch.setattr(overrides, "checked", True)
    with pytest.raises(megablocks_core.ContractError):
        sort((keys, 1))
