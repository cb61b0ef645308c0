"""Bad data reaches the kernels outside checked mode: every backend stays memory-safe and returns
the documented safe result (megablocks_core.testing.bad_data).

The reference backend runs every case in-process. The Triton kernels (under TRITON_INTERPRET=1,
where an out-of-bounds access is a real segfault or heap corruption) run in a child process that
reports case by case: a crash fails the case it happened in, by name, and the rest go on in a
fresh child.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megablocks_core.dispatch import registry
from megablocks_core.testing import Mismatch, bad_data

pytestmark = pytest.mark.usefixtures("unchecked")


@pytest.fixture
def unchecked(monkeypatch):
    """The data rules are off (the default), so bad data reaches the kernels."""
    monkeypatch.delenv("MEGABLOCKS_CHECK", raising=False)
    from megablocks_core.policy import overrides

    checked = overrides.checked
    overrides.checked = False
    yield
    overrides.checked = checked


def _triton_ok() -> bool:
    record = registry().plugins.get("triton")
    return record is not None and record.status == "ok"


needs_triton = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "0") in ("", "0") or not _triton_ok(),
    reason="the triton kernels run on the CPU only under TRITON_INTERPRET=1",
)

#: The weighted twins of the padded/binned gathers take the same paths as the unweighted ones
#: plus one multiply; under the interpreter they cost seconds each, so triton runs them once.
#: The scaled GEMMs' cases repeat their 16-bit twins' mutations on 8-bit operands (the same
#: safe results, the same kernel structure): triton runs every third of them.
_SCALED = [n for n in bad_data.case_names() if n.startswith("scaled_")]
TRITON_CASES = [
    name
    for name in bad_data.case_names()
    if not (name.startswith(("padded_gather/", "binned_gather/")) and name.endswith("(weighted)"))
    and not (name in _SCALED and _SCALED.index(name) % 3)
]

#: The cases again under the launch policy of large calls (tests/launch_paths.py): their small
#: shapes otherwise take only the default's small-call paths.
LARGE_CALL_CASES = [
    name
    for name in TRITON_CASES
    if name.partition("/")[0] in ("sort", "route", "histogram", "gather", "scatter")
]

_CHILD = """
import json, sys
from megablocks_core.testing import Mismatch, bad_data
if sys.argv[2] == "large-call":
    sys.path.insert(0, sys.argv[3])
    import megablocks_triton
    from launch_paths import LargeCallPaths
    megablocks_triton.set_launch_configs(LargeCallPaths())
for name in json.loads(sys.argv[1]):
    print("START " + json.dumps(name), flush=True)
    failure = bad_data.run_case("triton", name)
    print("DONE " + json.dumps([name, None if failure is None else failure.message]), flush=True)
"""


def _run_isolated(names: list[str], policy: str = "default") -> dict[str, str | None]:
    """Run cases in child processes under the launch ``policy`` ("default" or "large-call"); a
    case that kills its child gets that as its failure."""
    results: dict[str, str | None] = {}
    remaining = list(names)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env.pop("MEGABLOCKS_CHECK", None)
    while remaining:
        proc = subprocess.run(
            [
                sys.executable,
                "-c",
                _CHILD,
                json.dumps(remaining),
                policy,
                os.path.dirname(__file__),
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        started = None
        for line in proc.stdout.splitlines():
            if line.startswith("START "):
                started = json.loads(line[6:])
            elif line.startswith("DONE "):
                name, message = json.loads(line[5:])
                results[name] = message
                started = None
        if proc.returncode != 0:
            culprit = (
                started if started is not None else next(n for n in remaining if n not in results)
            )
            results[culprit] = (
                f"the process died (exit {proc.returncode}) in this case: "
                f"{proc.stderr.strip().splitlines()[-1:] or ''}"
            )
        remaining = [n for n in remaining if n not in results]
    return results


@pytest.fixture(scope="module")
def triton_results():
    return _run_isolated(TRITON_CASES)


@pytest.fixture(scope="module")
def triton_large_call_results():
    return _run_isolated(LARGE_CALL_CASES, "large-call")


@pytest.mark.parametrize("name", bad_data.case_names())
def test_reference(name):
    failure = bad_data.run_case("reference", name)
    assert failure is None, str(failure)


@needs_triton
@pytest.mark.parametrize("name", TRITON_CASES)
def test_triton(name, triton_results):
    assert triton_results[name] is None, f"triton: {name}: {triton_results[name]}"


@needs_triton
@pytest.mark.parametrize("name", LARGE_CALL_CASES)
def test_triton_large_call_paths(name, triton_large_call_results):
    failure = triton_large_call_results[name]
    assert failure is None, f"triton (large-call paths): {name}: {failure}"


def test_cases_cover_every_data_dependent_op():
    covered = {case.op for case in bad_data.CASES}
    wanted = {
        "route",
        "sort",
        "histogram",
        "topology",
        "replicate",
        "replicate_backward",
        "gmm",
        "gmm_weight_grad",
        "gmm_weight_grad_accumulate",
        *bad_data.PLAIN_OPS,
        *bad_data.PADDED_OPS,
        *bad_data.BINNED_OPS,
    }
    assert wanted <= covered


def test_the_checks_catch_wrong_results():
    """The property checks are not vacuous: a result that is not the safe one fails them."""
    case = next(c for c in bad_data.CASES if c.name == "gather/index out of range")
    args = case.build(torch.device("cpu"))
    x, indices, top_k = args[0], args[1], args[5]
    garbage = x[(indices.clamp(0, x.shape[0] * top_k - 1) // top_k).long()].clone()
    garbage[3] = 1e25  # the row whose index is out of range must be 0
    with pytest.raises(Mismatch):
        bad_data.check_result("gather", args, garbage)
    route = next(c for c in bad_data.CASES if c.name == "route/expert id too large")
    top, experts, block = route.build(torch.device("cpu"))
    order = torch.sort(torch.where(top < experts, top, experts), stable=True).indices.int()
    counts = torch.bincount(top[top < experts].long(), minlength=experts).int()
    good = (
        order,
        top[order.long()],
        counts,
        counts.cumsum(0).int(),
        ((counts + block - 1) // block * block).cumsum(0).int(),
    )
    bad_data.check_result("route", route.build(torch.device("cpu")), good)
    broken = (torch.full_like(order, 1798629576), *good[1:])
    with pytest.raises(Mismatch):
        bad_data.check_result("route", route.build(torch.device("cpu")), broken)


# ---------------------------------------------------------------------------
# Random bad data


def _layout_args(
    op: str,
    indices: list[int],
    bins: list[int],
    padded: list[int],
    top_k: int,
    weighted: bool,
    rows: int | None = None,
) -> tuple:
    """Arguments of ``op`` with this layout (``rows``: gather's sorted-row count)."""
    gen = torch.Generator().manual_seed(len(indices) + top_k)
    n = len(indices)
    tokens, hidden = n // top_k, 6
    idx = torch.tensor(indices, dtype=torch.int32)
    b = torch.tensor(bins, dtype=torch.int32)
    w = torch.rand(n, generator=gen) + 0.5 if weighted else None
    if op == "gather":
        x = torch.randn(tokens, hidden, generator=gen)
        return x, idx, torch.zeros_like(idx), w, b, top_k, rows
    if op == "scatter":
        return torch.randn(n, hidden, generator=gen), idx, torch.zeros_like(idx), w, b, top_k
    if op == "scatter_wgrad":
        return (
            torch.randn(n, hidden, generator=gen),
            torch.randn(tokens, hidden, generator=gen),
            idx,
            torch.zeros_like(idx),
            b,
            top_k,
        )
    if op == "padded_gather":
        p = torch.tensor(padded, dtype=torch.int32)
        return (
            torch.randn(tokens, hidden, generator=gen),
            idx,
            torch.zeros_like(idx),
            w,
            b,
            p,
            top_k,
        )
    if op == "binned_gather":
        return torch.randn(tokens, hidden, generator=gen), idx, w, b, 2, top_k
    raise AssertionError(op)


@st.composite
def bad_layouts(draw, ops: tuple[str, ...]):
    op = draw(st.sampled_from(ops))
    top_k = draw(st.integers(1, 3))
    tokens = draw(st.integers(1, 4))
    n = tokens * top_k
    indices = draw(st.lists(st.integers(-3, 2 * n), min_size=n, max_size=n))
    experts = draw(st.integers(1, 3))
    bins = draw(st.lists(st.integers(-2, n + 3), min_size=experts, max_size=experts))
    padded = draw(st.lists(st.integers(-2, 2 * n + 4), min_size=experts - 1, max_size=experts - 1))
    padded.append(draw(st.integers(0, 2 * n + 4)))  # the output's row count
    rows = draw(st.one_of(st.none(), st.integers(0, n)))  # gather's first sorted rows only
    return op, _layout_args(op, indices, bins, padded, top_k, draw(st.booleans()), rows)


ALL_LAYOUT_OPS = ("gather", "scatter", "scatter_wgrad", "padded_gather", "binned_gather")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bad_layouts(ALL_LAYOUT_OPS))
def test_reference_random_bad_layouts(case):
    op, args = case
    problem = bad_data.check_call("reference", op, args)
    assert problem is None, f"{op}: {problem}"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(-(2**40), 2**40), min_size=0, max_size=12), st.integers(1, 4))
def test_reference_route_random_expert_ids(ids, experts):
    top = torch.tensor(ids, dtype=torch.int64)
    problem = bad_data.check_call("reference", "route", (top, experts, 2))
    assert problem is None, problem


@needs_triton
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bad_layouts(("gather", "scatter", "scatter_wgrad")))
def test_triton_random_bad_indices(case):
    # In-process: the fixed kernels are memory-safe (the named cases above run isolated first).
    op, args = case
    problem = bad_data.check_call("triton", op, args)
    assert problem is None, f"{op}: {problem}"


@needs_triton
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(-(2**40), 2**40), min_size=1, max_size=12), st.integers(1, 4))
def test_triton_route_random_expert_ids(ids, experts):
    problem = bad_data.check_call(
        "triton", "route", (torch.tensor(ids, dtype=torch.int64), experts, 2)
    )
    assert problem is None, problem


@needs_triton
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(-(2**35), 2**35), min_size=1, max_size=4), st.booleans())
def test_triton_gmm_random_device_sizes(sizes, trans_b):
    """Device-side batch_sizes are not checked: the kernels cut and clamp them (called directly,
    since on the CPU batch_sizes counts as host data and the core checks it)."""
    from megablocks_reference import kernels as reference
    from megablocks_triton import gmm as triton_gmm

    gen = torch.Generator().manual_seed(len(sizes))
    a = torch.randn(20, 8, generator=gen)
    b = (
        torch.randn(len(sizes), 6, 8, generator=gen)
        if trans_b
        else torch.randn(len(sizes), 8, 6, generator=gen)
    )
    grad = torch.randn(20, 6, generator=gen)
    batch = torch.tensor(sizes, dtype=torch.int64)
    for impl in (triton_gmm, reference):
        bad_data.check_result("gmm", (a, b, batch, trans_b), impl.gmm(a, b, batch, trans_b))
        bad_data.check_result(
            "gmm_weight_grad", (a, grad, batch), impl.gmm_weight_grad(a, grad, batch)
        )
    # The accumulating kernel (the reference composes it through the dispatched, checked op).
    before = torch.randn(len(sizes), 8, 6, generator=gen)
    out = before.clone()
    returned = triton_gmm.gmm_weight_grad_accumulate(a, grad, batch, out)
    bad_data.check_result(
        "gmm_weight_grad_accumulate", (a, grad, batch, before), returned, written=(out,)
    )


def test_accumulate_check_catches_an_overwrite():
    """The accumulate check is not vacuous: overwriting out (or adding twice) fails it."""
    [case] = [c for c in bad_data.CASES if c.name == "gmm_weight_grad_accumulate/negative size"]
    a, grad, batch, before = case.build(torch.device("cpu"))
    groups = [(0, 0), (0, 10), (10, 2)]  # [-4, 10, 6]: clamped to 0, 10, then cut at row 12
    product = torch.stack([a[s : s + n].T @ grad[s : s + n] for s, n in groups])
    args = (a, grad, batch, before)
    bad_data.check_result("gmm_weight_grad_accumulate", args, None, written=(before + product,))
    for wrong in (product, before + 2 * product, before):
        with pytest.raises(Mismatch):
            bad_data.check_result("gmm_weight_grad_accumulate", args, None, written=(wrong,))
    with pytest.raises(Mismatch, match="the contract says None"):
        bad_data.check_result(
            "gmm_weight_grad_accumulate", args, before + product, written=(before + product,)
        )


@pytest.mark.parametrize("sizes", [[6, 6, 9], [3, 2, 4], [-4, 10, 6], [2**40, 1, 1], [0, 0, 0]])
def test_cuda_grouped_mm_makes_device_sizes_safe(monkeypatch, sizes):
    """The cuda plugin's torch._grouped_mm provider with unchecked (device-side) sizes, run on the
    CPU by treating CPU sizes as unchecked: clamped, cut at the last row, uncovered rows 0."""
    from megablocks_cuda import gmm as cuda_gmm

    if cuda_gmm.grouped_mm_function() is None:
        pytest.skip("this torch has no grouped mm")
    monkeypatch.setattr(cuda_gmm, "_unchecked", lambda batch_sizes: True)
    gen = torch.Generator().manual_seed(9)
    a, b, grad = (
        torch.randn(12, 8, generator=gen),
        torch.randn(3, 8, 8, generator=gen),
        torch.randn(12, 8, generator=gen),
    )
    batch = torch.tensor(sizes)
    bad_data.check_result("gmm", (a, b, batch, False), cuda_gmm.grouped_mm_gmm(a, b, batch, False))
    bad_data.check_result(
        "gmm_weight_grad", (a, grad, batch), cuda_gmm.grouped_mm_gmm_weight_grad(a, grad, batch)
    )
