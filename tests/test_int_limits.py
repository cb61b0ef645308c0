"""Integer outputs that must not wrap, bf16 kept off the Triton interpreter, and the Triton
kernels' size limits declared as shape predicates (a call past one goes to the next backend).

Expected values come from plain Python or torch arithmetic, never from the code under test.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from triton_interpreter import interpreting

import megablocks_core
from megablocks_core import ops
from megablocks_core.contracts import BY_NAME
from megablocks_core.dispatch import describe_call, explain, explain_call
from megablocks_core.entries import call
from megablocks_core.testing.scenarios import SAMPLES, Scenario, routing
from megablocks_core.validation import ContractError

INT_DTYPES = (torch.int16, torch.int32, torch.int64)
INT32_MAX = 2**31 - 1
BF16 = torch.bfloat16


def raises(error: type[Exception], *fragments: str) -> Any:
    pattern = "".join(f"(?=.*{re.escape(f)})" for f in fragments)
    return pytest.raises(error, match=re.compile(pattern, re.S))


def _triton_runs_here() -> bool:
    try:
        import triton  # type: ignore[import-untyped]  # noqa: F401
    except ImportError:
        return False
    return interpreting()


needs_interpreter = pytest.mark.skipif(
    not _triton_runs_here(), reason="the triton backend on CPU tensors needs TRITON_INTERPRET=1"
)


@pytest.fixture
def fresh(clean_env: None) -> Iterator[None]:
    yield
    megablocks_core.reload({})


@pytest.fixture(params=["reference", pytest.param("triton", marks=needs_interpreter)])
def backend(request: pytest.FixtureRequest, fresh: None) -> Iterator[str]:
    with megablocks_core.use_backend(request.param):
        yield request.param


@pytest.fixture(params=[False, True], ids=["unchecked", "checked"])
def mode(request: pytest.FixtureRequest, backend: str) -> bool:
    megablocks_core.reload({"MEGABLOCKS_CHECK": "1"} if request.param else {})
    return bool(request.param)


def _ceil_multiple(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _padded_ends(ids: list[int], experts: int, block: int) -> list[int]:
    ends, total = [], 0
    for e in range(experts):
        total += _ceil_multiple(ids.count(e), block)
        ends.append(total)
    return ends


# ---------------------------------------------------------------------------------------------
# route: padded_bins is int32 whatever the block size


def test_route_rejects_block_sizes_that_could_wrap_padded_bins(mode: bool) -> None:
    ids = torch.tensor([0, 1, 2, 3] * 4, dtype=torch.int32)
    with raises(ContractError, "ops.route", "padded_bins is int32", "block_size=1073741824"):
        ops.route(ids, 4, 2**30)  # 4 experts * 2**30 rows: 2**32
    # 4 experts with a row each (13 + 1 + 1 + 1) can reach 4 * block_size: 2**31 does not fit.
    with raises(ContractError, "ops.route", "padded_bins is int32"):
        ops.route(ids, 4, 2**29)
    with raises(ContractError, "ops.route", "argument 'block_size'", "2147483648"):
        ops.route(torch.zeros(0, dtype=torch.int32), 4, 2**31)  # no rows, still past int32


@pytest.mark.parametrize(
    "ids, experts, block",
    [
        ([0], 1, INT32_MAX),  # one row padded to the largest int32
        ([0] * 13 + [1, 2, 3], 4, INT32_MAX // 4),  # every expert padded: 4 * block < 2**31
        ([5, 5, 1], 6, INT32_MAX // 3),  # three rows: at most three of the six experts pad
        (list(range(8)) * 3, 8, (INT32_MAX - 16) // 8),  # three rows each
    ],
)
def test_route_at_the_largest_block_sizes_is_exact(
    mode: bool, ids: list[int], experts: int, block: int
) -> None:
    _, _, counts, bins, padded = ops.route(torch.tensor(ids, dtype=torch.int32), experts, block)
    assert counts.tolist() == [ids.count(e) for e in range(experts)]
    assert padded.tolist() == _padded_ends(ids, experts, block)
    assert min(padded.tolist()) >= 0 and bins.tolist()[-1] == len(ids)


def test_route_rejects_one_block_past_the_bound(backend: str) -> None:
    ids = torch.tensor([0] * 13 + [1, 2, 3], dtype=torch.int32)
    ops.route(ids, 4, INT32_MAX // 4)
    with raises(ContractError, "ops.route", "padded_bins is int32"):
        ops.route(ids, 4, INT32_MAX // 4 + 1)


def test_route_bounds_the_rows_without_data(fresh: None) -> None:
    # 2**31 rows: bins (int32) could not hold their count; meta tensors carry no data.
    ids = torch.empty(2**31, dtype=torch.int64, device="meta")
    with raises(ContractError, "ops.route", "padded_bins is int32"):
        ops.route(ids, 1, 1)


# ---------------------------------------------------------------------------------------------
# round_up: no intermediate wrap-around, and a value or result past x's dtype is an error


@pytest.mark.parametrize("dtype", INT_DTYPES)
def test_round_up_rejects_a_value_beyond_the_dtype(fresh: None, dtype: torch.dtype) -> None:
    top = torch.iinfo(dtype).max
    x = torch.tensor([0, 1, -5], dtype=dtype)
    with raises(ContractError, "ops.round_up", "value", str(top + 1)):
        ops.round_up(x, top + 1)  # int16/int32: was a bare ZeroDivisionError (the value cast to 0)
    assert ops.round_up(x, top).tolist() == [0, top, 0]


@pytest.mark.parametrize("multiple", [2, 3, 7, 1000])
@pytest.mark.parametrize("dtype", INT_DTYPES)
def test_round_up_near_the_dtype_limits_is_exact(
    fresh: None, dtype: torch.dtype, multiple: int
) -> None:
    info = torch.iinfo(dtype)
    largest = info.max // multiple * multiple  # the largest multiple the dtype holds
    values = [largest, largest - 1, largest - multiple + 1, info.min, info.min + 1, -1, 0, 1]
    out = ops.round_up(torch.tensor(values, dtype=dtype), multiple)
    assert out.tolist() == [_ceil_multiple(v, multiple) for v in values]


@pytest.mark.parametrize("dtype", INT_DTYPES)
def test_round_up_results_past_the_dtype_are_caught_in_checked_mode(
    fresh: None, dtype: torch.dtype
) -> None:
    top = torch.iinfo(dtype).max
    megablocks_core.reload({"MEGABLOCKS_CHECK": "1"})
    for _ in range(2):  # a repeated call shape runs the data rule again
        with raises(ContractError, "ops.round_up", "the rounded counts fit x's dtype"):
            ops.round_up(torch.tensor([0, top], dtype=dtype), 2)
    assert ops.round_up(torch.tensor([0, top - 1], dtype=dtype), 2).tolist() == [0, top - 1]


# ---------------------------------------------------------------------------------------------
# Other integer outputs bounded by their contracts (meta tensors: shapes only, no memory)


def test_sort_of_more_keys_than_int32_indices_address_is_rejected(fresh: None) -> None:
    with raises(ContractError, "ops.sort", "int32 indices cannot address more than 2**31 keys"):
        ops.sort(torch.empty(2**31 + 1, dtype=torch.int32, device="meta"), None)


def test_router_topk_ids_are_int32(fresh: None) -> None:
    with raises(ContractError, "ops.router_topk", "expert ids are int32"):
        ops.router_topk(torch.empty(0, 2**31 + 1, device="meta"), 1, False)


# ---------------------------------------------------------------------------------------------
# bf16 under the Triton interpreter (which converts bf16 subnormals to float32 wrongly)

#: (op, the dtypes of a call) that the triton backend must leave to the reference backend
#: under the interpreter: every kernel that converts bf16 data.
BF16_OFF_INTERPRETER = [
    ("glu", {"x": BF16}),
    ("glu_backward", {"grad": BF16, "x": BF16}),
    ("activation_backward", {"grad": BF16, "x": BF16}),
    ("activation_backward", {"grad": torch.float32, "x": torch.float32, "scale": BF16}),
    ("router_topk", {"scores": BF16}),
    ("replicate_backward", {"grad": BF16}),
    *(
        (op, {"x": BF16})
        for op in BY_NAME
        if BY_NAME[op].family == "permutation" and "x" in BY_NAME[op].arg_names
    ),
    ("moe_permute_probs", {"probs": BF16}),
    ("scatter", {"x": torch.float32, "weights": BF16}),
    ("gather", {"x": torch.float32, "weights": BF16}),
    ("padded_scatter", {"x": torch.float16, "weights": BF16}),
    ("gmm", {"a": BF16, "b": BF16}),
    ("gmm_scatter", {"x": torch.float32, "b": torch.float32, "weights": BF16}),
]


def _winner(op: str, dtypes: dict[str, torch.dtype]) -> str:
    trace = explain(op, "cpu", dtypes)
    assert trace.winner is not None, trace.error
    return trace.winner.backend


@needs_interpreter
@pytest.mark.parametrize(
    "op, dtypes", BF16_OFF_INTERPRETER, ids=[f"{o}-{'-'.join(d)}" for o, d in BF16_OFF_INTERPRETER]
)
def test_bf16_is_not_served_by_triton_under_the_interpreter(
    fresh: None, op: str, dtypes: dict[str, torch.dtype]
) -> None:
    assert _winner(op, dtypes) == "reference"
    # The same call in float16 is the triton backend's: the exclusion is bf16's alone.
    assert _winner(op, {a: torch.float16 for a in dtypes}) == "triton"


@needs_interpreter
def test_replicate_copies_bf16_unconverted_and_keeps_it(fresh: None) -> None:
    assert _winner("replicate", {"x": BF16}) == "triton"
    x = torch.tensor([[1e-39, -5e-40, 3.0]], dtype=BF16)
    out = ops.replicate(x, torch.tensor([1, 1, 3], dtype=torch.int32), 4)
    # Columns: bin 0, bin 2 twice (bin 1 is empty), then one past bins[-1] (0). Bit for bit.
    want = torch.cat([x[:, [0, 2, 2]], torch.zeros(1, 1, dtype=BF16)], dim=1)
    assert out.view(torch.int16).tolist() == want.view(torch.int16).tolist()


def _subnormals(n: int, seed: int) -> torch.Tensor:
    """bf16 subnormals (below 2**-126), both signs."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=gen) * 2e-39).to(BF16)


def test_glu_of_bf16_subnormals_is_exact(fresh: None) -> None:
    rows, n = 4, 8
    gate = (torch.randn(rows, n, generator=torch.Generator().manual_seed(0)) + 2).to(BF16)
    up = _subnormals(rows * n, 1).view(rows, n)
    out = ops.glu(torch.cat([gate, up], dim=1), "relu")
    # A product of two bf16 values is exact in float32: one rounding to bf16.
    want = (gate.float().relu() * up.float()).to(BF16)
    assert torch.equal(out.float(), want.float())


def test_weighted_scatter_of_bf16_subnormals_is_exact(fresh: None) -> None:
    tokens, hidden = 5, 6
    x = _subnormals(tokens * hidden, 2).view(tokens, hidden)
    weights = torch.tensor([0.5, 1.0, 2.0, -1.0, 0.25], dtype=BF16)
    order = torch.arange(tokens, dtype=torch.int32)
    bins = torch.tensor([tokens], dtype=torch.int32)
    out = ops.scatter(x, order, torch.zeros(tokens, dtype=torch.int32), weights, bins, 1)
    want = (x.float() * weights.float()[:, None]).to(BF16)  # powers of two: exact
    assert torch.equal(out.float(), want.float())


def test_router_topk_ranks_bf16_subnormals(fresh: None) -> None:
    scores = _subnormals(4 * 6, 3).view(4, 6)
    weights, experts = ops.router_topk(scores, 3, False)
    for row, ids, got in zip(scores.float().tolist(), experts.tolist(), weights, strict=True):
        want = sorted(range(len(row)), key=lambda e: (-row[e], e))[:3]
        assert ids == want
        assert got.float().tolist() == [row[e] for e in want]


def test_the_compiled_path_keeps_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    plugin = pytest.importorskip("megablocks_triton.plugin")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    tables = (plugin._routing_dtypes(), plugin._activation_dtypes(), plugin._permutation_dtypes())
    for table in (*tables, plugin._gmm_dtypes()):
        for op, dtypes in table.items():
            floats = [d for d in dtypes.values() if d & {torch.float16, torch.float32}]
            assert all(BF16 in d for d in floats), op
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert BF16 not in plugin._activation_dtypes()["glu"]["x"]


# ---------------------------------------------------------------------------------------------
# The Triton kernels' size limits: declared, so that ranking falls back instead of raising

MANY_EXPERTS = 4097  # one past the grouped GEMM's in-register expert prefix


def _many_experts_args(op: str) -> tuple[Any, ...]:
    """A call of ``op`` with MANY_EXPERTS experts and six rows, routed to experts 0 and 4096."""
    gen = torch.Generator().manual_seed(7)
    tokens, top_k, k, n = 3, 2, 4, 3
    rows = tokens * top_k
    keys = torch.tensor([4096, 0, 4096, 4096, 0, 4096])
    bin_ids, order = torch.sort(keys, stable=True)
    counts = torch.bincount(keys, minlength=MANY_EXPERTS)
    bins = counts.cumsum(0).int()
    indices, bin_ids = order.int(), bin_ids.int()
    a = torch.randn(rows, k, generator=gen)
    b = torch.randn(MANY_EXPERTS, k, n, generator=gen)
    grad = torch.randn(rows, n, generator=gen)
    if op == "gmm":
        return (a, b, counts, False, None)
    if op == "gmm_weight_grad":
        return (a, grad, counts)
    if op == "gmm_weight_grad_accumulate":
        return (a, grad, counts, torch.randn(MANY_EXPERTS, k, n, generator=gen))
    x = torch.randn(tokens, k, generator=gen)
    if op == "gather_gmm":
        return (x, b, indices, bin_ids, bins, top_k, False, None, None)
    weights = torch.rand(rows, generator=gen)
    return (a, b, indices, bin_ids, weights, bins, top_k, False, None, None, None)


GROUPED_GEMMS = (
    "gmm",
    "gmm_weight_grad",
    "gmm_weight_grad_accumulate",
    "gather_gmm",
    "gmm_scatter",
)


@needs_interpreter
@pytest.mark.parametrize("op", GROUPED_GEMMS)
def test_more_experts_than_triton_holds_fall_back_to_the_reference(fresh: None, op: str) -> None:
    args = _many_experts_args(op)
    contract = BY_NAME[op]
    bound = contract.bind(args)
    dtypes = {name: v.dtype for name, v in bound.items() if isinstance(v, torch.Tensor)}
    trace = explain(op, "cpu", dtypes)
    assert trace.winner is not None and trace.winner.backend == "triton"  # for most shapes
    kernel, why = explain_call(trace, describe_call(contract, args))
    assert kernel is not None and kernel.backend == "reference", why
    assert "triton declined: 4097 experts: more than 4096" in why
    got_args = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
    got = call(op, *got_args)  # raised ValueError before the limit was declared
    with megablocks_core.use_backend("reference"):
        want_args = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
        want = call(op, *want_args)
    if got is None:  # accumulated in place
        got, want = got_args[-1], want_args[-1]
    assert torch.equal(got, want)


@needs_interpreter
def test_the_expert_limit_itself_is_served_by_triton(fresh: None) -> None:
    call_info = describe_call(
        BY_NAME["gmm"],
        (
            torch.randn(6, 4),
            torch.randn(4096, 4, 3),
            torch.zeros(4096, dtype=torch.int64),
            False,
            None,
        ),
    )
    kernel, why = explain_call(explain("gmm", "cpu", {"a": torch.float32}), call_info)
    assert kernel is not None and kernel.backend == "triton", why


#: (op, the argument that sizes the limit, its axis; None for an int argument).
INT32_LIMITS = [
    *(
        (op, "indices", 0)
        for op in BY_NAME
        # the moe_permute ops compute int64 offsets: no int32 limit to decline at
        if BY_NAME[op].family == "permutation" and "indices" in BY_NAME[op].arg_names
    ),
    ("gmm", "a", 0),
    ("gmm_weight_grad", "a", 0),
    ("gmm_weight_grad_accumulate", "a", 0),
    ("gather_gmm", "indices", 0),
    ("gmm_scatter", "indices", 0),
    ("sort", "x", 0),
    ("route", "top_experts", 0),
    ("histogram", "x", 0),
    ("topology", "output_block_rows", None),
    ("replicate", "num_outputs", None),
    ("replicate_backward", "grad", 1),
]


def _scenario_call(op: str, arg: str, axis: int | None, size: int) -> dict[str, Any]:
    """A scenario's call of ``op`` as the ranking sees it, with one size replaced."""
    r = routing(Scenario(tokens=4, experts=4, top_k=2, hidden=8, dtype=torch.float32))
    described = describe_call(BY_NAME[op], SAMPLES[op](r))
    if axis is None:
        described[arg] = size
    else:
        meta = described[arg]
        shape = list(meta.shape)
        shape[axis] = size
        described[arg] = type(meta)(tuple(shape), meta.dtype, meta.device)
    return described


@needs_interpreter
@pytest.mark.parametrize(
    "op, arg, axis", INT32_LIMITS, ids=[f"{o}-{a}" for o, a, _ in INT32_LIMITS]
)
def test_sizes_past_the_kernels_int32_offsets_go_to_the_reference(
    fresh: None, op: str, arg: str, axis: int | None
) -> None:
    from megablocks_triton.plugin import INT32_ELEMENTS

    float_args = {a.name: torch.float32 for a in BY_NAME[op].tensor_args if a.dtypes & {BF16}}
    trace = explain(op, "cpu", float_args)
    at_limit, why = explain_call(trace, _scenario_call(op, arg, axis, INT32_ELEMENTS))
    assert at_limit is not None and at_limit.backend == "triton", why
    past, why = explain_call(trace, _scenario_call(op, arg, axis, INT32_ELEMENTS + 1))
    assert past is not None and past.backend == "reference", why
    assert f"triton declined: {INT32_ELEMENTS + 1} " in why and "int32 offsets" in why


@needs_interpreter
def test_a_routing_map_past_int32_entries_goes_to_the_reference(fresh: None) -> None:
    """moe_permute_map's index form ranks its flat slots in the counting sort's int32 tiles: a
    map of more entries goes to the reference (its limit is on the entries, not one axis)."""
    from megablocks_triton.plugin import INT32_ELEMENTS

    trace = explain("moe_permute_map", "cpu", {})
    slots = _scenario_call("moe_permute_map", "routing_map", 0, 1)["routing_map"].shape[1]
    fits = INT32_ELEMENTS // slots
    at_limit, why = explain_call(trace, _scenario_call("moe_permute_map", "routing_map", 0, fits))
    assert at_limit is not None and at_limit.backend == "triton", why
    past, why = explain_call(trace, _scenario_call("moe_permute_map", "routing_map", 0, fits + 1))
    assert past is not None and past.backend == "reference", why
    assert f"triton declined: {(fits + 1) * slots} routing map entries" in why


@needs_interpreter
@pytest.mark.parametrize("op", ["glu", "glu_backward"])
def test_glu_past_cudas_grid_is_declined_on_cuda_only(fresh: None, op: str) -> None:
    from dataclasses import replace

    from megablocks_triton.plugin import GLU_CUDA_COLUMNS

    trace = explain(op, "cpu", {"x": torch.float32})
    [triton_kernel] = [c.kernel for c in trace.candidates if c.kernel.backend == "triton"]
    assert triton_kernel.supports is not None
    cuda = replace(trace.device, kind="cuda", type="cuda")
    for columns, declined in ((GLU_CUDA_COLUMNS, False), (GLU_CUDA_COLUMNS + 1, True)):
        wide = _scenario_call(op, "x", 1, 2 * columns)
        reason = triton_kernel.supports(cuda, wide)
        assert bool(reason) is declined, reason
        # The interpreter has no grid limit.
        assert triton_kernel.supports(trace.device, wide) is None
