"""Checked mode at every dtype limit, sizes that cannot be allocated, and errors that name the op.

Expected values come from numpy or plain Python, never from the code under test.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import megablocks_core
from megablocks_core import ops
from megablocks_core.validation import memory_limit

INT_LIMITS = {torch.int16: 16, torch.int32: 32, torch.int64: 64}


def raises(error: type[Exception], *fragments: str):
    pattern = "".join(f"(?=.*{re.escape(f)})" for f in fragments)
    return pytest.raises(error, match=re.compile(pattern, re.S))


@pytest.fixture
def checked(only_reference):
    megablocks_core.reload({"MEGABLOCKS_CHECK": "1", "MEGABLOCKS_PLUGINS": "reference"})
    yield


def numpy_sort(keys: torch.Tensor) -> tuple[list[int], list[int]]:
    array = keys.numpy()
    order = np.argsort(array, kind="stable")
    return array[order].tolist(), order.tolist()


@pytest.mark.parametrize("dtype", list(INT_LIMITS))
def test_sort_accepts_keys_at_the_dtype_maximum_for_every_end_bit_that_covers_them(checked, dtype):
    bits = INT_LIMITS[dtype]
    top = torch.iinfo(dtype).max
    keys = torch.tensor([top, 0, 5, top, 1], dtype=dtype)
    for end_bit in (bits - 1, bits, None):  # 2**(bits-1) - 1 is the dtype's largest key
        values, indices = ops.sort(keys, end_bit)
        want_values, want_order = numpy_sort(keys)
        assert values.tolist() == want_values and indices.tolist() == want_order, end_bit


@pytest.mark.parametrize("dtype", list(INT_LIMITS))
def test_sort_still_rejects_keys_outside_end_bit_at_the_limits(checked, dtype):
    bits = INT_LIMITS[dtype]
    with raises(ValueError, "ops.sort", "keys lie in [0, 2**end_bit)"):
        ops.sort(torch.tensor([-1, 0], dtype=dtype), bits)  # negative keys: never in range
    with raises(ValueError, "ops.sort", "keys lie in [0, 2**end_bit)"):
        ops.sort(torch.tensor([1 << (bits - 2), 0], dtype=dtype), bits - 2)  # exactly 2**end_bit
    with raises(ValueError, "ops.sort", "keys lie in [0, 2**end_bit)"):
        ops.sort(torch.tensor([torch.iinfo(dtype).max], dtype=dtype), 0)  # end_bit 0: no key at all
    values, _ = ops.sort(torch.tensor([(1 << (bits - 2)) - 1, 0], dtype=dtype), bits - 2)
    assert values.tolist() == [0, (1 << (bits - 2)) - 1]


@pytest.mark.parametrize("dtype", list(INT_LIMITS))
def test_route_accepts_expert_counts_beyond_the_id_dtype(checked, dtype):
    top = torch.iinfo(dtype).max
    experts = top + 1 if dtype == torch.int16 else 1000  # int16: 32768 experts, ids up to 32767
    ids = torch.tensor([min(top, experts - 1), 0, 3], dtype=dtype)
    indices, bin_ids, counts, bins, padded = ops.route(ids, experts, 4)
    _, want_order = numpy_sort(ids)
    assert indices.tolist() == want_order
    assert counts.shape == (experts,) and int(counts.sum()) == 3
    with raises(ValueError, "ops.route", "expert ids lie in [0, num_experts)"):
        ops.route(torch.tensor([-1], dtype=dtype), experts, 4)
    if dtype == torch.int16:  # 40000 experts: more than int16 can name, still a valid count
        assert ops.route(ids, 40000, 4)[2].shape == (40000,)


def test_int16_indices_address_exactly_32768_rows(checked):
    rows, top_k = 32768, 2  # positions 0..32767: the most int16 can hold
    tokens = rows // top_k
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, 3, generator=gen)
    indices = torch.randperm(rows, generator=gen).to(torch.int16)
    bin_ids = torch.zeros(rows, dtype=torch.int16)
    bins = torch.tensor([rows], dtype=torch.int32)  # bins must hold 32768: int32
    out = ops.gather(x, indices, bin_ids, bins, top_k)
    flat = indices.long().numpy()
    np.testing.assert_array_equal(out.numpy(), x.numpy()[flat // top_k])
    back = ops.scatter(out, indices, bin_ids, None, bins, top_k)
    np.testing.assert_allclose(back.numpy(), top_k * x.numpy(), rtol=1e-6)
    with raises(ValueError, "ops.gather", "int16 indices cannot address more than 32768 rows"):
        ops.gather(
            torch.randn(tokens + 1, 3),
            torch.arange(rows + 2).to(torch.int16),
            torch.zeros(rows + 2, dtype=torch.int16),
            torch.tensor([rows + 2]),
            top_k,
        )


@pytest.mark.parametrize("dtype", [torch.int16, torch.int32, torch.int64])
def test_cumsum_overflow_is_caught_at_every_width(checked, dtype):
    top = torch.iinfo(dtype).max
    with raises(ValueError, "ops.inclusive_cumsum", "running sums fit"):
        ops.inclusive_cumsum(torch.tensor([top, 1], dtype=dtype), 0)
    with raises(ValueError, "ops.exclusive_cumsum", "running sums fit"):
        ops.exclusive_cumsum(torch.tensor([top, top, 0], dtype=dtype), 0)
    assert ops.inclusive_cumsum(torch.tensor([top - 1, 1], dtype=dtype), 0).tolist() == [
        top - 1,
        top,
    ]
    low = torch.iinfo(dtype).min
    assert ops.inclusive_cumsum(torch.tensor([low, top], dtype=dtype), 0).tolist() == [low, -1]


def test_topology_block_size_beyond_the_dtype(checked):
    padded = torch.tensor([0, 0], dtype=torch.int16)
    assert ops.topology(padded, 40000, 0, 1).shape == (0,)


@pytest.mark.parametrize(
    "sizes", [[2**63 - 1, 2**63 - 1, 6], [2**62, 2**62, 2**62, 2**62 + 4], [-2, 3, 3], [5, -1, 0]]
)
def test_gmm_batch_sizes_that_sum_to_the_rows_only_modulo_2_64_are_rejected(checked, sizes):
    a, b = torch.randn(4, 2), torch.randn(len(sizes), 2, 3)
    assert (sum(sizes) - 4) % 2**64 == 0  # an int64 sum gives 4, the row count
    with raises(
        ValueError, "ops.gmm", "group sizes are not negative and none exceeds the rows of a"
    ):
        ops.gmm(a, b, torch.tensor(sizes, dtype=torch.int64))


def test_gmm_wrapping_sizes_rejected_without_checked_mode_on_the_cpu(only_reference):
    with raises(
        ValueError, "ops.gmm", "group sizes are not negative and none exceeds the rows of a"
    ):
        ops.gmm(torch.randn(4, 2), torch.randn(3, 2, 3), torch.tensor([2**63 - 1, 2**63 - 1, 6]))
    big = 300  # more groups than the list fast path: the torch reductions
    sizes = torch.zeros(big, dtype=torch.int64)
    sizes[0], sizes[1] = 2**63 - 1, 2**63 - 1
    sizes[2] = 6
    with raises(ValueError, "ops.gmm", "none exceeds the rows of a"):
        ops.gmm(torch.randn(4, 2), torch.randn(big, 2, 3), sizes)
    sizes = torch.zeros(big, dtype=torch.int64)
    sizes[7] = 4
    out = ops.gmm(a := torch.randn(4, 2), b := torch.randn(big, 2, 3), sizes)
    np.testing.assert_allclose(out.numpy(), a.numpy() @ b[7].numpy(), rtol=1e-5)


def test_sum_with_dim_none_is_a_clean_type_error(only_reference):
    with raises(TypeError, "ops.sum", "argument 'dim' must be an int", "None"):
        ops.sum(torch.randn(3, 2), None)
    assert ops.sum(torch.ones(3, 2)).tolist() == [3.0, 3.0]  # the default dim is 0


@pytest.mark.parametrize(
    "call, argument",
    [
        (
            lambda: ops.binned_gather(
                torch.randn(2, 4),
                torch.arange(4, dtype=torch.int32),
                torch.tensor([2, 4], dtype=torch.int32),
                2**45,
                2,
            ),
            "'bin_size' = 35184372088832",
        ),
        (
            lambda: ops.histogram(torch.tensor([1], dtype=torch.int32), 2**40),
            "'num_bins' = 1099511627776",
        ),
        (
            lambda: ops.replicate(torch.randn(1, 1), torch.tensor([1], dtype=torch.int32), 2**50),
            "'num_outputs'",
        ),
        (
            lambda: ops.topology(torch.tensor([4], dtype=torch.int32), 4, 2**62, 1),
            "'output_block_rows'",
        ),
        (lambda: ops.repeat(torch.ones(2), (2**40, 2**40)), "'tiling'"),
    ],
)
def test_outputs_that_cannot_be_allocated_are_rejected_naming_the_argument(
    only_reference, call, argument
):
    with raises(ValueError, "megablocks_core.ops.", argument, "of memory of device cpu"):
        call()


def test_ints_beyond_int64_are_rejected(only_reference):
    with raises(ValueError, "ops.histogram", "'num_bins'", "fits int64"):
        ops.histogram(torch.tensor([1], dtype=torch.int32), 2**70)


def test_memory_limit_is_the_host_memory_on_the_cpu():
    limit = memory_limit(torch.device("cpu"))
    assert 2**20 < limit <= 2**48
    assert limit == min(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), 2**48)


def test_checked_mode_skips_data_rules_on_meta_tensors(checked):
    values, indices = ops.sort(torch.empty(4, dtype=torch.int32, device="meta"), 4)
    assert values.device.type == "meta" and values.shape == (4,)
    out = ops.gather(
        torch.empty(3, 2, device="meta"),
        torch.empty(6, dtype=torch.int32, device="meta"),
        torch.empty(6, dtype=torch.int32, device="meta"),
        torch.empty(2, dtype=torch.int32, device="meta"),
        2,
    )
    assert out.shape == (6, 2) and out.is_meta
    with raises(
        ValueError, "ops.gather", "indices has top_k entries per row of x"
    ):  # shape rules still run
        ops.gather(
            torch.empty(3, 2, device="meta"),
            torch.empty(5, dtype=torch.int32, device="meta"),
            torch.empty(5, dtype=torch.int32, device="meta"),
            torch.empty(2, dtype=torch.int32, device="meta"),
            2,
        )


# ---------------------------------------------------------------------------
# The environment holds from the first call: a fresh process per case.


def _fresh(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MEGABLOCKS_")}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env={**clean, "MEGABLOCKS_PLUGINS": "reference", **env},
        timeout=300,
    )


FIRST_CALL = """
import torch
import megablocks_core
from megablocks_core import ops
x = torch.randn(3, 2, dtype=torch.float64)
indices = torch.tensor([0, 0, 2, 3, 4, 5], dtype=torch.int32)  # not a permutation
bin_ids = torch.zeros(6, dtype=torch.int32)
bins = torch.tensor([6], dtype=torch.int32)
for call in (1, 2):
    try:
        ops.gather(x, indices, bin_ids, bins, 2)
        print(call, "served by", megablocks_core.dispatch.served()["gather"])
    except Exception as exc:
        print(call, type(exc).__name__, str(exc).splitlines()[0])
"""


def test_backend_override_holds_from_the_first_call():
    result = _fresh(FIRST_CALL, MEGABLOCKS_BACKEND="nosuchbackend")
    lines = result.stdout.splitlines()
    assert len(lines) == 2, result.stderr
    for line in lines:  # both calls fail alike: the forced backend is not installed
        assert "NoKernelError" in line and "'nosuchbackend' was forced for 'gather'" in line, lines


def test_checked_mode_holds_from_the_first_call():
    result = _fresh(FIRST_CALL, MEGABLOCKS_CHECK="1")
    lines = result.stdout.splitlines()
    assert len(lines) == 2, result.stderr
    for line in lines:
        assert "ContractError" in line and "indices is a permutation" in line, lines


def test_a_bad_backend_variable_is_reported_on_the_first_call_not_at_import():
    result = _fresh(FIRST_CALL, MEGABLOCKS_BACKEND="gatherz=reference")
    lines = result.stdout.splitlines()
    assert len(lines) == 2 and all("names unknown op(s) ['gatherz']" in line for line in lines), (
        lines,
        result.stderr,
    )
