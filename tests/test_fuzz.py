"""Property-based fuzzing of every public op (hypothesis), against the oracle in oracle.py.

1. Random valid inputs — zero tokens, empty experts, top_k 1..8, one to 256 experts, int16/32/64
   indices, fp32/fp64/bf16 data, non-contiguous tensors — on every installed backend that serves
   the CPU (triton through Triton's interpreter), forced in turn with ``use_backend``: forward
   and, for differentiable ops, backward against the oracle's gradient.
2. Random invalid inputs at the always-on level (dtypes, ranks, lengths, devices, int
   arguments): ``ContractError``/``ContractTypeError`` whose message starts with
   ``megablocks_core.ops.<op>:`` and nothing else.
3. Checked mode (``MEGABLOCKS_CHECK=1``): inputs that are well-formed but wrong in their data
   (not a permutation, bins not cumulative, ids out of range, …) raise ``ContractError``.

Sizes are small (tokens <= 64, hidden <= 32) because the interpreter is slow. With the ``CI``
environment variable set, examples are derandomized, so a CI run is reproducible.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import oracle
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import megablocks_core
from megablocks_core import ContractError, ContractTypeError, ops
from megablocks_core.activations import CLAMPED
from megablocks_core.contracts import BY_NAME
from megablocks_core.plugin import call_op
from megablocks_core.schema import BoolArg, ChoiceArg, FloatArg, IntArg, TensorArg

settings.register_profile(
    "megablocks-fuzz",
    deadline=None,
    max_examples=30,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.register_profile(
    "megablocks-fuzz-ci", settings.get_profile("megablocks-fuzz"), derandomize=True
)
FUZZ = settings.get_profile("megablocks-fuzz-ci" if os.environ.get("CI") else "megablocks-fuzz")

MAX_TOKENS = 64
MAX_HIDDEN = 32
EXPERT_COUNTS = (1, 2, 3, 4, 5, 8, 16, 64, 256)
INDEX_DTYPES = (torch.int16, torch.int32, torch.int64)
FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16)

#: |got - want| <= RTOL * bound, where bound is the oracle run on absolute values (the sum of
#: |terms|): covers fp32 accumulation over <= 128 terms and one rounding to the output dtype.
RTOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 1e-2}


@dataclass(frozen=True)
class Budget:
    """How much of the input space one backend is fuzzed with, per test."""

    examples: int
    max_rows: int  # tokens * top_k
    max_layout_rows: int  # rows of the padded and binned layouts, padding included
    max_layout_experts: int  # experts of padded_* and binned_* calls


NATIVE = Budget(
    examples=FUZZ.max_examples, max_rows=128, max_layout_rows=192, max_layout_experts=256
)
#: Triton's interpreter runs every program in Python: about a millisecond per row, and
#: padded_gather and binned_gather about 50 ms per expert. Fewer examples than the reference:
#: the kit, the bad-data cases and tests/test_triton_*.py cover the kernels' edges besides.
INTERPRETED = Budget(examples=8, max_rows=64, max_layout_rows=96, max_layout_experts=16)

# --------------------------------------------------------------------------------------------
# backends


def cpu_backends() -> list[str]:
    """Installed, usable backends with at least one kernel for CPU tensors."""
    reg = megablocks_core.registry()
    return sorted(
        name
        for name, record in reg.plugins.items()
        if record.status == "ok" and any({"cpu", "any"} & set(k.devices) for k in record.kernels)
    )


BACKENDS = cpu_backends()


def budget(backend: str) -> Budget:
    """On the CPU every kernel that is not a portable one runs under Triton's interpreter."""
    record = megablocks_core.registry().plugins[backend]
    return NATIVE if all(k.portable for k in record.kernels if "cpu" in k.devices) else INTERPRETED


def fuzz(backend: str) -> settings:
    return settings(FUZZ, max_examples=budget(backend).examples)


def provides(backend: str, op: str) -> bool:
    record = megablocks_core.registry().plugins[backend]
    return any(k.op == op and {"cpu", "any"} & set(k.devices) for k in record.kernels)


def serves(backend: str, ops_needed: tuple[str, ...], dtypes: dict[str, torch.dtype]) -> bool:
    """Whether the forced backend has a kernel for each op on CPU tensors of these dtypes."""
    with megablocks_core.use_backend(backend):
        return all(
            megablocks_core.explain(op, "cpu", dtypes).winner is not None for op in ops_needed
        )


def served_dtypes(
    backend: str,
    ops_needed: tuple[str, ...],
    candidates: tuple[torch.dtype, ...],
    args: tuple[str, ...],
) -> list[torch.dtype]:
    """The candidate dtypes (given to ``args``) the backend serves for every op in ``ops_needed``.

    A backend that lacks an op altogether skips the test; one that declares narrower dtypes (triton
    leaves fp64 to the reference backend) is fuzzed on the dtypes it declares."""
    missing = [op for op in ops_needed if not provides(backend, op)]
    if missing:
        pytest.skip(f"backend {backend!r} does not provide {missing}")
    dtypes = [d for d in candidates if serves(backend, ops_needed, dict.fromkeys(args, d))]
    if not dtypes:
        pytest.skip(f"backend {backend!r} serves {ops_needed} for none of {candidates} on the CPU")
    return dtypes


# --------------------------------------------------------------------------------------------
# inputs


def layout(t: torch.Tensor, how: str) -> torch.Tensor:
    """Same values in another memory layout: "contiguous", "strided" (every other element of a
    larger buffer along the last dim) or "transposed" (column-major, 2-D and 3-D)."""
    if how == "strided" and t.dim() > 0:
        big = torch.zeros((*t.shape[:-1], 2 * t.shape[-1]), dtype=t.dtype)
        big[..., ::2] = t
        return big[..., ::2]
    if how == "transposed" and t.dim() >= 2:
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    return t


LAYOUTS = st.sampled_from(["contiguous", "strided", "transposed"])


def floats(
    rng: np.random.Generator, shape: tuple[int, ...], dtype: torch.dtype, low: float | None = None
) -> np.ndarray:
    """Random values that ``dtype`` stores exactly (standard normal, or uniform in [low, 1))."""
    values = rng.standard_normal(shape) if low is None else rng.uniform(low, 1.0, shape)
    return oracle.representable(values, dtype)


def tensor(values: np.ndarray, dtype: torch.dtype, how: str = "contiguous") -> torch.Tensor:
    src = np.ascontiguousarray(values)
    if dtype.is_floating_point:
        t = torch.from_numpy(src.astype(np.float64)).to(dtype)
    else:
        t = torch.from_numpy(src.astype(np.int64)).to(dtype)
    return layout(t, how)


def to64(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float64 if t.dtype.is_floating_point else torch.int64).numpy()


def assert_ints(got: torch.Tensor, want: np.ndarray, dtype: torch.dtype) -> None:
    assert got.dtype == dtype, (got.dtype, dtype)
    assert tuple(got.shape) == want.shape, (tuple(got.shape), want.shape)
    np.testing.assert_array_equal(to64(got), want)


def assert_copy(got: torch.Tensor, want: np.ndarray, dtype: torch.dtype) -> None:
    """got holds exactly the oracle's values (a copy moves values without arithmetic)."""
    assert got.dtype == dtype, (got.dtype, dtype)
    assert tuple(got.shape) == want.shape, (tuple(got.shape), want.shape)
    np.testing.assert_array_equal(to64(got), want)


def assert_close(
    got: torch.Tensor,
    want: np.ndarray,
    bound: np.ndarray,
    dtype: torch.dtype,
    rtol_dtype: torch.dtype | None = None,
) -> None:
    """got equals the float64 oracle up to fp32 accumulation and one rounding to ``dtype``."""
    assert got.dtype == dtype, (got.dtype, dtype)
    assert tuple(got.shape) == want.shape, (tuple(got.shape), want.shape)
    rtol = max(RTOL[dtype], RTOL[rtol_dtype or dtype])
    err = np.abs(to64(got) - want)
    limit = rtol * np.abs(bound) + 1e-300
    worst = np.unravel_index(np.argmax(err - limit), err.shape) if err.size else None
    assert (err <= limit).all(), f"at {worst}: got {to64(got)[worst]}, want {want[worst]}"


class Routing:
    """Routing metadata for T tokens, top_k each, over E experts, built from random top-k ids."""

    def __init__(
        self, T: int, K: int, E: int, used: str, seed: int, block: int = 4, unrouted: int = 0
    ) -> None:
        rng = np.random.default_rng(seed)
        self.rng = rng
        if used == "one":  # every row to one expert: all others empty
            allowed = rng.integers(0, E, 1)
        elif used == "some":  # about half the experts empty
            allowed = rng.permutation(E)[: max(1, E // 2)]
        else:
            allowed = np.arange(E)
        self.T, self.K, self.E, self.block = T, K, E, block
        self.top = rng.choice(allowed, size=T * K).astype(np.int64)
        # Pairs routed to no expert (the sentinel id E, as expert parallelism routes the pairs of
        # other ranks' experts): they sort last and bins ends before them.
        if unrouted:
            self.top[rng.choice(T * K, size=unrouted, replace=False)] = E
        (self.indices, self.bin_ids, self.counts, self.bins, self.padded_bins) = oracle.route(
            self.top, E, block
        )

    def tensors(self, dtype: torch.dtype, how: str) -> dict[str, torch.Tensor]:
        return {
            name: tensor(getattr(self, name), dtype, how if how != "transposed" else "strided")
            for name in ("indices", "bin_ids", "bins", "padded_bins")
        }


@st.composite
def routings(
    draw: st.DrawFn,
    limits: Budget = NATIVE,
    block: int | None = None,
    layout: bool = False,
    unrouted: bool = False,
) -> Routing:
    """Random routing metadata; ``unrouted``: some (or all) pairs may be routed to no expert."""
    K = draw(st.integers(1, 8))
    T = draw(st.integers(0, min(MAX_TOKENS, limits.max_rows // K)))
    experts = [e for e in EXPERT_COUNTS if not layout or e <= limits.max_layout_experts]
    E = draw(st.sampled_from(experts))
    used = draw(st.sampled_from(["all", "some", "one"]))
    seed = draw(st.integers(0, 2**32 - 1))
    if unrouted:
        return Routing(T, K, E, used, seed, 4, draw(st.integers(0, T * K)))
    if block is not None:
        return Routing(T, K, E, used, seed, block)
    block = draw(st.sampled_from([1, 2, 4, 16]))
    routing = Routing(T, K, E, used, seed, block)
    while block > 1 and routing.padded_bins[-1] > limits.max_layout_rows:
        block //= 2
        routing = Routing(T, K, E, used, seed, block)
    return routing


def bin_sizes(r: Routing, limits: Budget) -> st.SearchStrategy[int]:
    """Capacities from 0 through dropping rows to room for all, within the budget's layout rows."""
    most = int(r.counts.max()) if r.E else 0
    return st.integers(0, max(1, min(most + 1, limits.max_layout_rows // r.E)))


def leaf(values: np.ndarray, dtype: torch.dtype, how: str) -> torch.Tensor:
    return tensor(values, dtype, how).requires_grad_(True)


# --------------------------------------------------------------------------------------------
# 1. valid inputs: every backend against the oracle

backend_param = pytest.mark.parametrize("backend", BACKENDS)
#: For the permutation ops and gmm, the interpreter takes seconds per test: those are marked slow.
heavy_backend_param = pytest.mark.parametrize(
    "backend",
    [pytest.param(b, marks=pytest.mark.slow) if budget(b) is INTERPRETED else b for b in BACKENDS],
)


@backend_param
def test_sort(backend: str) -> None:
    dtypes = served_dtypes(backend, ("sort",), INDEX_DTYPES, ("x",))

    @fuzz(backend)
    @given(dtype=st.sampled_from(dtypes), n=st.integers(0, 256), data=st.data(), how=LAYOUTS)
    def check(dtype: torch.dtype, n: int, data: st.DataObject, how: str) -> None:
        bits = torch.iinfo(dtype).bits
        end_bit = data.draw(st.one_of(st.none(), st.integers(0, bits)), label="end_bit")
        rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
        info = np.iinfo(np.int64 if bits == 64 else f"int{bits}")
        if end_bit is None:  # full width: negative keys and the extremes too
            keys = rng.integers(max(info.min, -(2**20)), min(info.max, 2**20), n)
            if n >= 2:
                keys[:2] = [info.min, info.max]
        else:  # keys in [0, 2**end_bit), many ties
            keys = rng.integers(0, min(2**end_bit, int(info.max) + 1), n, dtype=np.int64)
        x = tensor(keys, dtype, how)
        with megablocks_core.use_backend(backend):
            values, indices = ops.sort(x, end_bit)
        want_values, want_indices = oracle.sort(keys, end_bit)
        assert_ints(values, want_values, dtype)
        assert_ints(indices, want_indices, dtype)

    check()


@backend_param
def test_histogram(backend: str) -> None:
    dtypes = served_dtypes(backend, ("histogram",), INDEX_DTYPES, ("x",))

    @fuzz(backend)
    @given(
        dtype=st.sampled_from(dtypes),
        shape=st.sampled_from([(0,), (1,), (37,), (200,), (3, 40), (2, 0), (1, 1)]),
        num_bins=st.integers(0, 300),
        seed=st.integers(0, 2**32 - 1),
        how=LAYOUTS,
    )
    def check(
        dtype: torch.dtype, shape: tuple[int, ...], num_bins: int, seed: int, how: str
    ) -> None:
        keys = np.random.default_rng(seed).integers(-3, num_bins + 3, shape)  # some out of range
        with megablocks_core.use_backend(backend):
            counts = ops.histogram(tensor(keys, dtype, how), num_bins)
        assert_ints(counts, oracle.histogram(keys, num_bins), torch.int32)

    check()


@backend_param
@pytest.mark.parametrize("op", ["inclusive_cumsum", "exclusive_cumsum"])
def test_cumsum(backend: str, op: str) -> None:
    dtypes = served_dtypes(backend, (op,), INDEX_DTYPES, ("x",))

    @fuzz(backend)
    @given(
        dtype=st.sampled_from(dtypes),
        shape=st.sampled_from([(0,), (1,), (9,), (300,), (1, 1), (4, 7), (7, 1), (3, 0)]),
        data=st.data(),
        how=LAYOUTS,
    )
    def check(dtype: torch.dtype, shape: tuple[int, ...], data: st.DataObject, how: str) -> None:
        dim = data.draw(st.integers(-len(shape), len(shape) - 1), label="dim")
        rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
        x = rng.integers(0, 50, shape)  # the running sums fit int16
        with megablocks_core.use_backend(backend):
            out = getattr(ops, op)(tensor(x, dtype, how), dim)
        assert_ints(out, getattr(oracle, op)(x, dim), dtype)

    check()


@backend_param
def test_topology(backend: str) -> None:
    dtypes = served_dtypes(backend, ("topology",), INDEX_DTYPES, ("padded_bins",))
    limits = budget(backend)

    @fuzz(backend)
    @given(
        dtype=st.sampled_from(dtypes),
        block=st.sampled_from([1, 2, 4, 16]),
        data=st.data(),
        cols=st.integers(1, 4),
        how=LAYOUTS,
    )
    def check(dtype: torch.dtype, block: int, data: st.DataObject, cols: int, how: str) -> None:
        r = data.draw(routings(limits, block=block), label="routing")
        rows = int(r.padded_bins[-1]) // block
        with megablocks_core.use_backend(backend):
            out = ops.topology(tensor(r.padded_bins, dtype, how), block, rows, cols)
        assert_ints(out, oracle.topology(r.padded_bins, block, rows, cols), torch.int16)

    check()


@backend_param
def test_route(backend: str) -> None:
    dtypes = served_dtypes(backend, ("route",), INDEX_DTYPES, ("top_experts",))
    limits = budget(backend)

    @fuzz(backend)
    @given(dtype=st.sampled_from(dtypes), r=routings(limits), how=LAYOUTS)
    def check(dtype: torch.dtype, r: Routing, how: str) -> None:
        top = tensor(r.top, dtype, how)
        with megablocks_core.use_backend(backend):
            indices, bin_ids, counts, bins, padded_bins = ops.route(top, r.E, r.block)
        assert_ints(indices, r.indices, dtype)
        assert_ints(bin_ids, r.bin_ids, dtype)
        assert_ints(counts, r.counts, torch.int32)
        assert_ints(bins, r.bins, torch.int32)
        assert_ints(padded_bins, r.padded_bins, torch.int32)

    check()


@backend_param
def test_replicate(backend: str) -> None:
    floats_served = served_dtypes(
        backend, ("replicate", "replicate_backward"), FLOAT_DTYPES, ("x", "grad")
    )
    ints_served = [d for d in INDEX_DTYPES if serves(backend, ("replicate",), {"x": d})]
    limits = budget(backend)

    @fuzz(backend)
    @given(
        dtype=st.sampled_from(floats_served + ints_served),
        r=routings(limits),
        batch=st.integers(1, 3),
        extra=st.integers(0, 3),
        index_dtype=st.sampled_from(INDEX_DTYPES),
        how=LAYOUTS,
    )
    def check(
        dtype: torch.dtype, r: Routing, batch: int, extra: int, index_dtype: torch.dtype, how: str
    ) -> None:
        num_outputs = int(r.bins[-1]) + extra  # columns past bins[-1] are 0
        bins = tensor(r.bins, index_dtype, "strided" if how != "contiguous" else how)
        if dtype.is_floating_point:
            xv = floats(r.rng, (batch, r.E), dtype)
            x = leaf(xv, dtype, how)
        else:
            xv = r.rng.integers(-1000, 1000, (batch, r.E))
            x = tensor(xv, dtype, how)
        with megablocks_core.use_backend(backend):
            out = ops.replicate(x, bins, num_outputs)
            want = oracle.replicate(xv, r.bins, num_outputs)
            if not dtype.is_floating_point:
                assert_ints(out, want, dtype)
                return
            assert_copy(out, want, dtype)
            grad = floats(r.rng, (batch, num_outputs), dtype)
            out.backward(tensor(grad, dtype, how))
        assert_close(
            x.grad,
            oracle.replicate_backward(grad, r.bins),
            oracle.replicate_backward(np.abs(grad), r.bins),
            dtype,
        )
        assert (to64(x.grad)[:, r.counts == 0] == 0).all()  # an empty bin's gradient is exactly 0

    check()


PERMUTATION_CHAINS = {  # op → every op its forward and backward run
    "gather": ("gather", "scatter"),
    "scatter": ("scatter", "gather", "scatter_wgrad"),
    "padded_gather": ("padded_gather", "padded_scatter"),
    "padded_scatter": ("padded_scatter", "padded_gather", "padded_scatter_wgrad"),
    "binned_gather": ("binned_gather", "binned_scatter"),
    "binned_scatter": ("binned_scatter", "binned_gather", "binned_scatter_wgrad"),
}


def permutation_dtypes(backend: str, op: str) -> list[torch.dtype]:
    return served_dtypes(backend, PERMUTATION_CHAINS[op], FLOAT_DTYPES, ("x", "grad"))


@heavy_backend_param
@pytest.mark.parametrize("op", ["gather", "padded_gather", "binned_gather"])
def test_gathers(backend: str, op: str) -> None:
    dtypes = permutation_dtypes(backend, op)
    limits = budget(backend)

    @fuzz(backend)
    @given(
        dtype=st.sampled_from(dtypes),
        index_dtype=st.sampled_from(INDEX_DTYPES),
        r=routings(limits, layout=op != "gather"),
        hidden=st.integers(1, MAX_HIDDEN),
        how=LAYOUTS,
        data=st.data(),
    )
    def check(
        dtype: torch.dtype,
        index_dtype: torch.dtype,
        r: Routing,
        hidden: int,
        how: str,
        data: st.DataObject,
    ) -> None:
        t = r.tensors(index_dtype, how)
        xv = floats(r.rng, (r.T, hidden), dtype)
        x = leaf(xv, dtype, how)
        if op == "gather":
            call = (ops.gather, (x, t["indices"], t["bin_ids"], t["bins"], r.K))
            fwd = (oracle.gather, (r.indices, r.bin_ids, None, r.bins, r.K))
            bwd = (oracle.scatter, (r.indices, r.bin_ids, None, r.bins, r.K))
        elif op == "padded_gather":
            call = (
                ops.padded_gather,
                (x, t["indices"], t["bin_ids"], t["bins"], t["padded_bins"], r.K),
            )
            fwd = (oracle.padded_gather, (r.indices, r.bin_ids, None, r.bins, r.padded_bins, r.K))
            bwd = (oracle.padded_scatter, (r.indices, r.bin_ids, None, r.bins, r.padded_bins, r.K))
        else:
            bin_size = data.draw(bin_sizes(r, limits), label="bin_size")
            call = (ops.binned_gather, (x, t["indices"], t["bins"], bin_size, r.K))
            fwd = (oracle.binned_gather, (r.indices, None, r.bins, bin_size, r.K))
            bwd = (oracle.binned_scatter, (r.indices, None, r.bins, r.K))
        with megablocks_core.use_backend(backend):
            out = call[0](*call[1])
            want = fwd[0](xv, *fwd[1])
            assert_copy(out, want, dtype)  # an unweighted gather only moves rows
            grad = floats(r.rng, tuple(out.shape), dtype)
            out.backward(tensor(grad, dtype, how))
        assert_close(x.grad, bwd[0](grad, *bwd[1]), bwd[0](np.abs(grad), *bwd[1]), dtype)

    check()


def scatter_oracles(op: str, r: Routing, bin_size: int) -> tuple[Callable[..., np.ndarray], ...]:
    """The oracle's (forward(x, w), x-gradient(grad, w), w-gradient(x, grad)) of a scatter op."""
    if op == "scatter":
        routing = (r.indices, r.bin_ids)
        tail: tuple[Any, ...] = (r.bins, r.K)
    elif op == "padded_scatter":
        routing, tail = (r.indices, r.bin_ids), (r.bins, r.padded_bins, r.K)
    else:
        routing, tail = (r.indices,), (r.bins, r.K)
    gather = getattr(oracle, op.replace("scatter", "gather"))
    gather_tail = (r.bins, bin_size, r.K) if op == "binned_scatter" else tail

    def forward(x: np.ndarray, w: np.ndarray | None) -> np.ndarray:
        return getattr(oracle, op)(x, *routing, w, *tail)

    def x_grad(grad: np.ndarray, w: np.ndarray | None) -> np.ndarray:
        return gather(grad, *routing, w, *gather_tail)

    def w_grad(x: np.ndarray, grad: np.ndarray) -> np.ndarray:
        return getattr(oracle, f"{op}_wgrad")(x, grad, *routing, *tail)

    return forward, x_grad, w_grad


@heavy_backend_param
@pytest.mark.parametrize("op", ["scatter", "padded_scatter", "binned_scatter"])
def test_scatters(backend: str, op: str) -> None:
    dtypes = permutation_dtypes(backend, op)
    # The weights' dtypes the backend serves (triton leaves bf16 to the reference under the
    # interpreter, which converts bf16 subnormals wrongly).
    weights_dtypes = served_dtypes(backend, PERMUTATION_CHAINS[op], FLOAT_DTYPES, ("weights",))
    limits = budget(backend)

    @fuzz(backend)
    @given(
        dtype=st.sampled_from(dtypes),
        index_dtype=st.sampled_from(INDEX_DTYPES),
        r=routings(limits, layout=op != "scatter"),
        hidden=st.integers(1, MAX_HIDDEN),
        weights_dtype=st.one_of(st.none(), st.sampled_from(weights_dtypes)),
        grads=st.sampled_from(["x", "weights", "both"]),
        how=LAYOUTS,
        data=st.data(),
    )
    def check(
        dtype: torch.dtype,
        index_dtype: torch.dtype,
        r: Routing,
        hidden: int,
        weights_dtype: torch.dtype | None,
        grads: str,
        how: str,
        data: st.DataObject,
    ) -> None:
        t = r.tensors(index_dtype, how)
        n = r.T * r.K
        if op == "scatter":
            rows = (n,)
        elif op == "padded_scatter":
            rows = (int(r.padded_bins[-1]),)
        else:
            rows = (r.E, data.draw(bin_sizes(r, limits), label="bin_size"))
        xv = floats(r.rng, (*rows, hidden), dtype)
        x = tensor(xv, dtype, how).requires_grad_(grads != "weights" or weights_dtype is None)
        wv = None if weights_dtype is None else floats(r.rng, (n,), weights_dtype, low=0.1)
        w = None if wv is None else tensor(wv, weights_dtype, how).requires_grad_(grads != "x")
        if op == "scatter":
            call = (ops.scatter, (x, t["indices"], t["bin_ids"], w, t["bins"], r.K))
        elif op == "padded_scatter":
            call = (
                ops.padded_scatter,
                (x, t["indices"], t["bin_ids"], w, t["bins"], t["padded_bins"], r.K),
            )
        else:
            call = (ops.binned_scatter, (x, t["indices"], w, t["bins"], r.K))
        fwd, back, wgrad = scatter_oracles(op, r, rows[-1])
        absw = None if wv is None else np.abs(wv)
        with megablocks_core.use_backend(backend):
            out = call[0](*call[1])
            assert_close(out, fwd(xv, wv), fwd(np.abs(xv), absw), dtype, weights_dtype)
            grad = floats(r.rng, (r.T, hidden), dtype)
            out.backward(tensor(grad, dtype, how))
        if x.requires_grad:
            assert_close(x.grad, back(grad, wv), back(np.abs(grad), absw), dtype, weights_dtype)
        if w is not None and w.requires_grad:
            assert_close(
                w.grad, wgrad(xv, grad), wgrad(np.abs(xv), np.abs(grad)), weights_dtype, dtype
            )

    check()


@heavy_backend_param
def test_gmm(backend: str) -> None:
    dtypes = served_dtypes(backend, ("gmm", "gmm_weight_grad"), FLOAT_DTYPES, ("a", "b", "grad"))
    limits = budget(backend)

    @fuzz(backend)
    @given(
        dtype=st.sampled_from(dtypes),
        sizes_dtype=st.sampled_from([torch.int32, torch.int64]),
        r=routings(limits),
        k=st.integers(1, MAX_HIDDEN),
        n=st.integers(1, MAX_HIDDEN),
        trans_b=st.booleans(),
        how=LAYOUTS,
        grads=st.sampled_from(["a", "b", "both"]),
    )
    def check(
        dtype: torch.dtype,
        sizes_dtype: torch.dtype,
        r: Routing,
        k: int,
        n: int,
        trans_b: bool,
        how: str,
        grads: str,
    ) -> None:
        rows = int(r.counts.sum())
        av = floats(r.rng, (rows, k), dtype)
        bv = floats(r.rng, (r.E, n, k) if trans_b else (r.E, k, n), dtype)
        a = tensor(av, dtype, how).requires_grad_(grads != "b")
        b = tensor(bv, dtype, how).requires_grad_(grads != "a")
        sizes = tensor(r.counts, sizes_dtype)
        with megablocks_core.use_backend(backend):
            out = ops.gmm(a, b, sizes, trans_b)
            assert_close(
                out,
                oracle.gmm(av, bv, r.counts, trans_b),
                oracle.gmm(np.abs(av), np.abs(bv), r.counts, trans_b),
                dtype,
            )
            grad = floats(r.rng, (rows, n), dtype)
            out.backward(tensor(grad, dtype, how))
        want_a, want_b = oracle.gmm_backward(av, bv, grad, r.counts, trans_b)
        bound_a, bound_b = oracle.gmm_backward(
            np.abs(av), np.abs(bv), np.abs(grad), r.counts, trans_b
        )
        if a.requires_grad:
            assert_close(a.grad, want_a, bound_a, dtype)
        if b.requires_grad:
            assert_close(b.grad, want_b, bound_b, dtype)
            assert (to64(b.grad)[r.counts == 0] == 0).all()  # an empty expert: exactly zero

    check()


@backend_param
def test_glu(backend: str) -> None:
    """glu and its gradient against numpy's act(gate) * up and the hand-written slopes. The
    bound adds |gate * up|: a float32 evaluation of GELU through 1 + tanh cancels to an absolute
    error of a few units of |gate| where the result is near 0."""
    dtypes = served_dtypes(backend, ("glu", "glu_backward"), FLOAT_DTYPES, ("x", "grad"))

    @fuzz(backend)
    @given(
        dtype=st.sampled_from(dtypes),
        rows=st.integers(0, 64),
        n=st.integers(0, MAX_HIDDEN),
        activation=st.sampled_from([None, "gelu", "silu", "relu"]),
        seed=st.integers(0, 2**32 - 1),
        how=LAYOUTS,
    )
    def check(
        dtype: torch.dtype, rows: int, n: int, activation: str | None, seed: int, how: str
    ) -> None:
        rng = np.random.default_rng(seed)
        xv = oracle.representable(3 * rng.standard_normal((rows, 2 * n)), dtype)
        gate, up = np.abs(xv[:, :n]), np.abs(xv[:, n:])
        x = tensor(xv, dtype, how).requires_grad_()
        with megablocks_core.use_backend(backend):
            out = ops.glu(x, activation)
            want = oracle.glu(xv, activation)
            assert_close(out, want, np.abs(want) + gate * up, dtype)
            grad = floats(rng, (rows, n), dtype)
            out.backward(tensor(grad, dtype, how))
        want_grad = oracle.glu_backward(grad, xv, activation)
        size = np.abs(grad) * (1 + gate)
        bound = np.abs(want_grad) + np.concatenate((size * up, size * (1 + gate)), axis=1)
        assert_close(x.grad, want_grad, bound, dtype)

    check()


@backend_param
def test_activation_backward(backend: str) -> None:
    """activation_backward, every activation (gated ones on rows twice grad's width), scaled or
    not, against numpy's formulas; the dots against the float64 sum of the act written. Bounds
    as test_glu's (GELU through 1 + tanh cancels to a few units of |x| near 0)."""
    dtypes = served_dtypes(backend, ("activation_backward",), FLOAT_DTYPES, ("x", "grad"))

    @fuzz(backend)
    @given(
        dtype=st.sampled_from(dtypes),
        rows=st.integers(0, 64),
        n=st.integers(0, MAX_HIDDEN),
        activation=st.sampled_from([None, "gelu", "silu", "relu", *oracle.GATED]),
        scaled=st.booleans(),
        seed=st.integers(0, 2**32 - 1),
        how=LAYOUTS,
    )
    def check(
        dtype: torch.dtype,
        rows: int,
        n: int,
        activation: str | None,
        scaled: bool,
        seed: int,
        how: str,
    ) -> None:
        rng = np.random.default_rng(seed)
        gated = activation in oracle.GATED
        xv = oracle.representable(3 * rng.standard_normal((rows, 2 * n if gated else n)), dtype)
        grad = floats(rng, (rows, n), dtype)
        scale = floats(rng, (rows,), dtype, low=0.0) if scaled else None
        act = tensor(grad, dtype)  # contiguous (written in place): act(x) goes over it
        with megablocks_core.use_backend(backend):
            grad_x, dots = call_op(
                "activation_backward",
                act,
                tensor(xv, dtype, how),
                None if scale is None else tensor(scale, dtype),
                activation,
            )
        want_x, want_act, _ = oracle.activation_backward(grad, xv, scale, activation, dtype)
        scaled_grad = np.abs(grad) * (1.0 if scale is None else np.abs(scale)[:, None])
        if gated:
            gate, up = np.abs(xv[:, :n]), np.abs(xv[:, n:])
            act_bound = np.abs(want_act) + gate * up
            size = scaled_grad * (1 + gate)
            x_bound = np.abs(want_x) + np.concatenate((size * up, size * (1 + gate)), axis=1)
        else:
            act_bound = np.abs(want_act) + np.abs(xv)
            x_bound = np.abs(want_x) + scaled_grad * (1 + np.abs(xv))
        assert_close(act, want_act, act_bound, dtype)
        assert_close(grad_x, want_x, x_bound, dtype)
        got_act = to64(act)
        assert_close(
            dots, (got_act * grad).sum(axis=1), (np.abs(got_act * grad)).sum(axis=1), dtype
        )

    check()


@heavy_backend_param
def test_fused_gather_gmm_and_gmm_scatter(backend: str) -> None:
    """gather_gmm and gmm_scatter (and every gradient) against the float64 row loops, through
    whichever kernels the backend serves (its fused ones or the defining composition), pairs
    routed to no expert (sorted past bins[-1]) included."""
    fused = ("gather_gmm", "gmm_scatter")
    dtypes = served_dtypes(backend, fused, FLOAT_DTYPES, ("x", "b"))
    limits = budget(backend)

    @fuzz(backend)
    @given(
        dtype=st.sampled_from(dtypes),
        index_dtype=st.sampled_from(INDEX_DTYPES),
        r=routings(limits, unrouted=True),
        hidden=st.integers(1, MAX_HIDDEN),
        ffn=st.integers(1, MAX_HIDDEN),
        trans_b=st.booleans(),
        how=st.sampled_from(["contiguous", "strided"]),
        weighted=st.booleans(),
    )
    def check(
        dtype: torch.dtype,
        index_dtype: torch.dtype,
        r: Routing,
        hidden: int,
        ffn: int,
        trans_b: bool,
        how: str,
        weighted: bool,
    ) -> None:
        t = r.tensors(index_dtype, how)
        routing = (t["indices"], t["bin_ids"])
        n = r.T * r.K
        xv = floats(r.rng, (r.T, hidden), dtype)
        w1v = floats(r.rng, (r.E, ffn, hidden) if trans_b else (r.E, hidden, ffn), dtype)
        hv = floats(r.rng, (n, ffn), dtype)
        w2v = floats(r.rng, (r.E, hidden, ffn) if trans_b else (r.E, ffn, hidden), dtype)
        wv = floats(r.rng, (n,), dtype, low=0.1) if weighted else None
        x, w1 = (tensor(v, dtype, how).requires_grad_() for v in (xv, w1v))
        h, w2 = (tensor(v, dtype, how).requires_grad_() for v in (hv, w2v))
        w = None if wv is None else tensor(wv, dtype, how).requires_grad_()
        absw = None if wv is None else np.abs(wv)
        with megablocks_core.use_backend(backend):
            rows = ops.gather_gmm(x, w1, *routing, t["bins"], r.K, trans_b)
            out = ops.gmm_scatter(h, w2, *routing, w, t["bins"], r.K, trans_b)
            g_rows = floats(r.rng, (n, ffn), dtype)
            g_out = floats(r.rng, (r.T, hidden), dtype)
            torch.autograd.backward(
                [rows, out], [tensor(g_rows, dtype, how), tensor(g_out, dtype, how)]
            )
        ix, bins = r.indices, r.bins
        assert_close(
            rows,
            oracle.gather_gmm(xv, w1v, ix, bins, r.K, trans_b),
            oracle.gather_gmm(np.abs(xv), np.abs(w1v), ix, bins, r.K, trans_b),
            dtype,
        )
        # The composition rounds each product row before the weighted sum: bound accordingly.
        assert_close(
            out,
            oracle.gmm_scatter(hv, w2v, ix, wv, bins, r.K, trans_b),
            2 * oracle.gmm_scatter(np.abs(hv), np.abs(w2v), ix, absw, bins, r.K, trans_b),
            dtype,
        )
        want_x, want_w1 = oracle.gather_gmm_backward(xv, w1v, g_rows, ix, bins, r.K, trans_b)
        bound_x, bound_w1 = oracle.gather_gmm_backward(
            np.abs(xv), np.abs(w1v), np.abs(g_rows), ix, bins, r.K, trans_b
        )
        assert_close(x.grad, want_x, 2 * bound_x, dtype)
        assert_close(w1.grad, want_w1, bound_w1, dtype)
        want_h, want_w2, want_w = oracle.gmm_scatter_backward(
            hv, w2v, wv, g_out, ix, bins, r.K, trans_b
        )
        bound_h, bound_w2, bound_w = oracle.gmm_scatter_backward(
            np.abs(hv), np.abs(w2v), absw, np.abs(g_out), ix, bins, r.K, trans_b
        )
        assert_close(h.grad, want_h, 2 * bound_h, dtype)
        assert_close(w2.grad, want_w2, 2 * bound_w2, dtype)
        if w is not None:
            assert_close(w.grad, want_w, bound_w, dtype)
        empty = r.counts == 0
        assert (to64(w1.grad)[empty] == 0).all() and (to64(w2.grad)[empty] == 0).all()

    check()


# --------------------------------------------------------------------------------------------
# 2. invalid inputs: always-on checks raise the core's errors, naming the op

#: Inputs for the error tests: no kernel runs on a rejected call, so only the base call costs.
SMALL = Budget(FUZZ.max_examples, max_rows=32, max_layout_rows=96, max_layout_experts=256)


def valid_call(op: str, r: Routing, index_dtype: torch.dtype, dtype: torch.dtype) -> dict[str, Any]:
    """Valid kernel-order arguments of ``op`` by name (public arguments only)."""
    t = r.tensors(index_dtype, "contiguous")
    hidden = 3
    x_tokens = torch.ones(r.T, hidden, dtype=dtype)
    weights = torch.ones(r.T * r.K, dtype=dtype)
    most = int(r.counts.max()) if r.E else 0
    if op == "sort":
        return {"x": tensor(r.top, index_dtype), "end_bit": 9}
    if op == "histogram":
        return {"x": tensor(r.top, index_dtype), "num_bins": r.E}
    if op in ("inclusive_cumsum", "exclusive_cumsum"):
        return {"x": tensor(r.counts, index_dtype), "dim": 0}
    if op == "topology":
        return {
            "padded_bins": t["padded_bins"],
            "block_size": r.block,
            "output_block_rows": int(r.padded_bins[-1]) // r.block,
            "output_block_columns": 2,
        }
    if op == "replicate":
        return {
            "x": torch.ones(2, r.E, dtype=dtype),
            "bins": t["bins"],
            "num_outputs": int(r.bins[-1]),
        }
    if op == "route":
        return {
            "top_experts": tensor(r.top, index_dtype),
            "num_experts": r.E,
            "block_size": r.block,
        }
    if op == "router_topk":
        # The routing may draw more picks per token than experts; router_topk wants top_k <= E.
        return {
            "scores": torch.ones(r.T, r.E, dtype=dtype),
            "top_k": min(r.K, r.E),
            "softmax": True,
        }
    routing = {"indices": t["indices"], "bin_ids": t["bin_ids"], "bins": t["bins"], "top_k": r.K}
    if op == "gather":
        return {"x": x_tokens, **routing, "rows": r.T * r.K}  # every sorted row, counted
    if op == "scatter":
        return {"x": torch.ones(r.T * r.K, hidden, dtype=dtype), **routing, "weights": weights}
    if op == "padded_gather":
        return {"x": x_tokens, **routing, "padded_bins": t["padded_bins"]}
    if op == "padded_scatter":
        return {
            "x": torch.ones(int(r.padded_bins[-1]), hidden, dtype=dtype),
            **routing,
            "weights": weights,
            "padded_bins": t["padded_bins"],
        }
    if op == "binned_gather":
        return {
            "x": x_tokens,
            "indices": t["indices"],
            "bins": t["bins"],
            "bin_size": most,
            "top_k": r.K,
        }
    if op == "binned_scatter":
        return {
            "x": torch.ones(r.E, most, hidden, dtype=dtype),
            "indices": t["indices"],
            "weights": weights,
            "bins": t["bins"],
            "top_k": r.K,
        }
    if op == "gather_gmm":
        b = torch.ones(r.E, hidden, 5, dtype=dtype)
        return {"x": x_tokens, "b": b, **routing, "trans_b": False, "rows": None, "bias": None}
    if op == "gmm_scatter":
        rows = torch.ones(r.T * r.K, 4, dtype=dtype)
        b = torch.ones(r.E, 5, 4, dtype=dtype)
        return {
            "x": rows,
            "b": b,
            **routing,
            "weights": weights,
            "trans_b": True,
            "activation": "silu",
            "rows": r.T * r.K,
            "bias": None,
            "alpha": None,
            "limit": None,
        }
    if op == "glu":  # GPT-OSS's unit with constants of its own
        x = torch.ones(r.T * r.K, 6, dtype=dtype)
        return {"x": x, "activation": "silu_oai", "alpha": 1.5, "limit": 6.0}
    if op.startswith("moe_"):  # Megatron-Core's vocabulary: a top-k id map and its row map
        ids = tensor(r.top, torch.int32).reshape(r.T, r.K)
        n = r.T * r.K
        if op == "moe_permute_map":
            return {"routing_map": ids, "num_experts": r.E, "num_out_tokens": n, "align_size": 1}
        with megablocks_core.use_backend("reference"):
            row_map, counts = ops.moe_permute_map(ids, r.E, n, 1)
        probs = torch.ones(r.T, r.K, dtype=dtype)
        if op == "moe_permute":
            return {"x": x_tokens, "row_map": row_map, "num_out_tokens": n}
        if op == "moe_permute_probs":
            return {"probs": probs, "row_map": row_map, "num_out_tokens": n}
        if op == "moe_unpermute":
            return {"x": torch.ones(n, hidden, dtype=dtype), "row_map": row_map, "probs": probs}
        if op == "moe_sort_chunks":
            order = torch.arange(r.E, dtype=torch.int32).flip(0)
            return {
                "x": torch.ones(n, hidden, dtype=dtype),
                "split_sizes": counts,
                "sorted_index": order,
            }
    if op == "quantize":
        return {"x": x_tokens, "reduce_dim": 1, "format": "fp8_rowwise", "encoding": None}
    if op == "quantize_both_ways":
        return {
            "x": torch.ones(r.E, 4, 5, dtype=dtype),
            "format": "fp8_blockwise",
            "encoding": None,
        }
    if op == "quantize_transposed":
        rows = int(r.counts.sum())
        batch = tensor(r.counts, torch.int64)
        return {
            "x": torch.ones(rows, 4, dtype=dtype),
            "batch_sizes": batch,
            "format": "fp8_rowwise",
            "encoding": None,
        }
    if op == "scaled_gmm_weight_grad":
        rows = int(r.counts.sum())
        batch = tensor(r.counts, torch.int64)
        a, a_scale = ops.quantize_transposed(torch.ones(rows, 4), batch, "fp8_rowwise")
        g, g_scale = ops.quantize_transposed(torch.ones(rows, 5), batch, "fp8_rowwise")
        return {
            "a": a,
            "a_scale": a_scale,
            "grad": g,
            "grad_scale": g_scale,
            "batch_sizes": batch,
            "format": "fp8_rowwise",
            "out_dtype": None,
        }
    if op.startswith("scaled_"):  # the operands quantized as their format says
        fmt = "fp8_rowwise"
        rows = r.T * r.K if op != "scaled_gmm" else int(r.counts.sum())
        a, a_scale = ops.quantize(torch.ones(r.T if op == "scaled_gather_gmm" else rows, 4), 1, fmt)
        b, b_scale = ops.quantize(torch.ones(r.E, 5, 4), 2, fmt)  # (experts, n, k): trans_b
        common = {
            "b": b, "b_scale": b_scale, "trans_b": True, "format": fmt, "out_dtype": None,
            "bias": None,
        }  # fmt: skip
        if op == "scaled_gmm":
            batch = tensor(r.counts, torch.int64)
            return {"a": a, "a_scale": a_scale, **common, "batch_sizes": batch}
        x = {"x": a, "x_scale": a_scale, **common, **routing, "rows": None}
        return {**x, "weights": weights} if op == "scaled_gmm_scatter" else x
    if op == "gmm":
        return {
            "a": torch.ones(int(r.counts.sum()), 4, dtype=dtype),
            "b": torch.ones(r.E, 4, 5, dtype=dtype),
            "batch_sizes": tensor(r.counts, torch.int64),
            "trans_b": False,
            "bias": None,
        }
    raise AssertionError(op)


PUBLIC_DISPATCHED = (
    "sort",
    "histogram",
    "inclusive_cumsum",
    "exclusive_cumsum",
    "topology",
    "replicate",
    "route",
    "router_topk",
    "gather",
    "scatter",
    "padded_gather",
    "padded_scatter",
    "binned_gather",
    "binned_scatter",
    "gmm",
    "gather_gmm",
    "gmm_scatter",
    "glu",
    "quantize",
    "quantize_both_ways",
    "quantize_transposed",
    "scaled_gmm",
    "scaled_gather_gmm",
    "scaled_gmm_scatter",
    "scaled_gmm_weight_grad",
    "moe_permute_map",
    "moe_permute",
    "moe_permute_probs",
    "moe_unpermute",
    "moe_sort_chunks",
)
WRONG_DTYPES = (
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.float32,
    torch.complex64,
)
Mutation = Callable[[dict[str, Any]], None]


def extend(t: torch.Tensor) -> torch.Tensor:
    """One more element (1-D) or row (n-D)."""
    return torch.cat([t, t.new_zeros((1, *t.shape[1:]))])


def _dtype(args: dict[str, Any], spec: TensorArg) -> torch.dtype:
    """The dtype of ``args[spec.name]``; for an optional tensor left out (None), the call's first
    tensor's that ``spec`` accepts (what an option such as ``bias`` must match; not the 8-bit
    data of a scaled GEMM, which a bias never is)."""
    if args[spec.name] is not None:
        return cast(torch.dtype, args[spec.name].dtype)
    return next(
        v.dtype for v in args.values() if isinstance(v, torch.Tensor) and v.dtype in spec.dtypes
    )


def mutations(op: str, args: dict[str, Any]) -> Iterator[tuple[str, type[Exception], Mutation]]:
    """(what, expected error, how to break ``args``) for every always-on check that applies."""
    contract = BY_NAME[op]
    tensors = [a for a in contract.public_args if isinstance(a, TensorArg)]
    for spec in tensors:
        name = spec.name
        for dtype in WRONG_DTYPES:
            if spec.dtypes and dtype not in spec.dtypes:
                yield (
                    f"{name} as {dtype}",
                    ContractTypeError,
                    lambda a, n=name, d=dtype: a.__setitem__(n, torch.zeros(3, dtype=d)),
                )
        for rank in {0, 1, 2, 3, 4} - set(spec.ndim or {0, 1, 2, 3, 4}):
            yield (
                f"{name} of rank {rank}",
                ContractError,
                lambda a, s=spec, k=rank: a.__setitem__(
                    s.name, torch.zeros((2,) * k, dtype=_dtype(a, s))
                ),
            )
        yield (f"{name} as a list", ContractTypeError, lambda a, n=name: a.__setitem__(n, [0, 1]))
        # off the first tensor's device (an optional tensor left out, None, has no device)
        if spec is not tensors[0] and not spec.any_device and args[name] is not None:
            yield (
                f"{name} on meta",
                ContractError,
                lambda a, n=name: a.__setitem__(n, a[n].to("meta")),
            )
    for spec in contract.public_args:
        name = spec.name
        if isinstance(spec, IntArg):
            yield f"{name} as a float", ContractTypeError, lambda a, n=name: a.__setitem__(n, 2.0)
            yield f"{name} as a bool", ContractTypeError, lambda a, n=name: a.__setitem__(n, True)
            if spec.min is not None:
                yield (
                    f"{name} below its minimum",
                    ContractError,
                    lambda a, n=name, m=spec.min: a.__setitem__(n, m - 1),
                )
            if spec.max is not None:
                yield (
                    f"{name} above its maximum",
                    ContractError,
                    lambda a, n=name, m=spec.max: a.__setitem__(n, m + 1),
                )
        if isinstance(spec, BoolArg):
            yield f"{name} as an int", ContractTypeError, lambda a, n=name: a.__setitem__(n, 1)
        if isinstance(spec, ChoiceArg):
            unknown = spec.choices[0].upper()
            yield f"{name} as a bool", ContractTypeError, lambda a, n=name: a.__setitem__(n, True)
            yield (
                f"{name} an unknown name",
                ContractError,
                lambda a, n=name, bad=unknown: a.__setitem__(n, bad),
            )
        if isinstance(spec, FloatArg):
            yield f"{name} as a str", ContractTypeError, lambda a, n=name: a.__setitem__(n, "1.5")
            yield f"{name} as a bool", ContractTypeError, lambda a, n=name: a.__setitem__(n, True)
            yield f"{name} as nan", ContractError, lambda a, n=name: a.__setitem__(n, float("nan"))
            if args[spec.of] not in CLAMPED:
                yield (
                    f"{name} with {args[spec.of]!r}, which takes no constants",
                    ContractError,
                    lambda a, n=name: a.__setitem__(n, 1.0),
                )

    def put(name: str, value: Callable[[dict[str, Any]], Any]) -> Mutation:
        return lambda a: a.__setitem__(name, value(a))

    if "bin_ids" in args:
        yield (
            "bin_ids one longer than indices",
            ContractError,
            put("bin_ids", lambda a: extend(a["bin_ids"])),
        )
    if args.get("weights") is not None:
        yield "weights one too long", ContractError, put("weights", lambda a: extend(a["weights"]))
    if "padded_bins" in args and op != "topology":
        yield (
            "padded_bins one longer than bins",
            ContractError,
            put("padded_bins", lambda a: extend(a["padded_bins"])),
        )
    if op in (
        "gather",
        "scatter",
        "padded_gather",
        "binned_gather",
        "binned_scatter",
        "gather_gmm",
        "gmm_scatter",
    ):
        yield "x with one row too many", ContractError, put("x", lambda a: extend(a["x"]))
    if op in ("gather_gmm", "gmm_scatter"):
        yield "one expert matrix too many", ContractError, put("b", lambda a: extend(a["b"]))
    if op in ("gmm", "gather_gmm", "gmm_scatter"):
        first = "a" if op == "gmm" else "x"  # the operand multiplied with b
        yield (
            "inner dimensions differ",
            ContractError,
            put(first, lambda a: torch.ones(a[first].shape[0], 7, dtype=a[first].dtype)),
        )
        yield (
            "b of another dtype",
            ContractTypeError,
            put(
                "b",
                lambda a: a["b"].to(
                    torch.float16 if a[first].dtype != torch.float16 else torch.float32
                ),
            ),
        )
    if op == "replicate":
        yield (
            "bins one longer than x's columns",
            ContractError,
            put("bins", lambda a: extend(a["bins"])),
        )
    if op == "sort" and args["x"].dtype != torch.int64:
        yield (
            "end_bit wider than the keys",
            ContractError,
            put("end_bit", lambda a: torch.iinfo(a["x"].dtype).bits + 1),
        )
    if op in ("sort", "route"):
        key = "x" if op == "sort" else "top_experts"
        yield (
            "int16 keys past 32768",
            ContractError,
            put(key, lambda a: torch.zeros(32769, dtype=torch.int16)),
        )
    if op == "router_topk":
        yield (
            "top_k past the experts",
            ContractError,
            put("top_k", lambda a: a["scores"].shape[1] + 1),
        )
    if op in ("inclusive_cumsum", "exclusive_cumsum"):
        yield "dim past x's dimensions", ContractError, put("dim", lambda a: a["x"].dim())
        yield "dim below -x.dim()", ContractError, put("dim", lambda a: -a["x"].dim() - 1)
    if op == "topology":
        yield (
            "more than 32768 column indices",
            ContractError,
            put("output_block_columns", lambda a: 32768 // a["padded_bins"].shape[0] + 1),
        )
    if op in ("gather", "gather_gmm", "gmm_scatter"):
        yield (
            "rows past the sorted rows",
            ContractError,
            put("rows", lambda a: a["indices"].shape[0] + 1),
        )
    if op == "gmm_scatter":
        yield "x with a row more than rows", ContractError, put("x", lambda a: extend(a["x"]))
    if op == "gmm":

        def first_size(change: Callable[[torch.Tensor], torch.Tensor]) -> Mutation:
            return put(
                "batch_sizes",
                lambda a: torch.cat([change(a["batch_sizes"][:1]), a["batch_sizes"][1:]]),
            )

        yield (
            "batch_sizes one too long",
            ContractError,
            put("batch_sizes", lambda a: extend(a["batch_sizes"])),
        )
        yield "batch_sizes not summing to a's rows", ContractError, first_size(lambda s: s + 1)
        yield "a negative group size", ContractError, first_size(lambda s: s * 0 - 1)


def call_public(op: str, args: dict[str, Any]) -> Any:
    return getattr(ops, op)(*(args[a.name] for a in BY_NAME[op].public_args))


@settings(FUZZ, max_examples=150)
@given(
    op=st.sampled_from(PUBLIC_DISPATCHED),
    r=routings(SMALL),
    index_dtype=st.sampled_from(INDEX_DTYPES),
    dtype=st.sampled_from(FLOAT_DTYPES),
    data=st.data(),
)
def test_invalid_inputs_raise_contract_errors(
    op: str, r: Routing, index_dtype: torch.dtype, dtype: torch.dtype, data: st.DataObject
) -> None:
    args = valid_call(op, r, index_dtype, dtype)
    what, error, mutate = data.draw(st.sampled_from(list(mutations(op, args))), label="mutation")
    mutate(args)
    with pytest.raises((ContractError, ContractTypeError)) as caught:
        call_public(op, args)
    message = str(caught.value)
    assert message.startswith(f"megablocks_core.ops.{op}: "), message
    assert isinstance(caught.value, error), f"{what}: {type(caught.value).__name__}: {message}"


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_every_mutation_applies_to_the_valid_call(dtype: torch.dtype) -> None:
    """Each mutation offered for a valid call can be made (the test above draws one at random:
    one that cannot, such as moving an optional tensor left out to meta, fails it by chance)."""
    for r in (Routing(5, 2, 4, "all", seed=0), Routing(0, 1, 3, "all", seed=1)):
        for op in PUBLIC_DISPATCHED:
            args = valid_call(op, r, torch.int32, dtype)
            for what, _, mutate in mutations(op, args):
                try:
                    mutate(dict(args))
                except Exception as exc:
                    raise AssertionError(f"{op}: {what}: {type(exc).__name__}: {exc}") from exc


def test_invalid_input_mutations_cover_every_public_op() -> None:
    """Every public dispatched op has dtype, rank, type and length mutations above."""
    r = Routing(5, 2, 4, "all", seed=0)
    public = {c.name for c in BY_NAME.values() if c.public and c.dispatched}
    assert public == set(PUBLIC_DISPATCHED)
    for op in PUBLIC_DISPATCHED:
        args = valid_call(op, r, torch.int32, torch.float32)
        names = [what for what, _, _ in mutations(op, args)]
        assert any(" as torch." in w for w in names), (op, names)
        assert any("rank" in w for w in names), (op, names)
        call_public(op, valid_call(op, r, torch.int32, torch.float32))  # the base call is valid


# --------------------------------------------------------------------------------------------
# 3. checked mode: data-level violations


@pytest.fixture
def checked_mode() -> Iterator[None]:
    """MEGABLOCKS_CHECK=1 for the test, the caller's environment restored afterwards."""
    megablocks_core.reload({**os.environ, "MEGABLOCKS_CHECK": "1"})
    try:
        yield
    finally:
        megablocks_core.reload()


def data_mutations(op: str, args: dict[str, Any], r: Routing) -> Iterator[tuple[str, Mutation]]:
    """(what, how) for each data-level violation that applies to these arguments."""
    n = r.T * r.K

    def edit(name: str, change: Callable[[torch.Tensor], None]) -> Mutation:
        def mutate(a: dict[str, Any]) -> None:
            a[name] = a[name].clone()
            change(a[name])

        return mutate

    if "indices" in args and n >= 2:
        yield "indices repeat a row", edit("indices", lambda t: t.__setitem__(1, t[0]))
    if "indices" in args and n >= 1:
        yield "an index past the rows", edit("indices", lambda t: t.__setitem__(0, n))
    if "bins" in args and r.E >= 2 and op != "replicate":
        yield "bins not cumulative", edit("bins", lambda t: t.__setitem__(0, int(t[-1]) + 1))
    if "bins" in args and op != "replicate":
        yield "bins ending past the rows", edit("bins", lambda t: t.__setitem__(-1, int(t[-1]) + 1))
    if "bin_ids" in args and r.E >= 2 and n >= 1:
        yield (
            "bin_ids disagreeing with bins",
            edit("bin_ids", lambda t: t.__setitem__(0, (int(t[0]) + 1) % r.E)),
        )
    if "padded_bins" in args and op != "topology" and n >= 1:
        yield "padded bins too small", edit("padded_bins", lambda t: t.zero_())
    if "padded_bins" in args and op != "topology" and r.E >= 2 and int(r.padded_bins[-1]) >= 1:
        yield (
            "padded_bins not cumulative",
            edit("padded_bins", lambda t: t.__setitem__(0, int(t[-1]) + 1)),
        )
    if op == "sort" and n >= 1:
        yield "a key past 2**end_bit", edit("x", lambda t: t.__setitem__(0, 1 << args["end_bit"]))
    if op == "route" and n >= 1:
        yield "an expert id past num_experts", edit("top_experts", lambda t: t.__setitem__(0, r.E))
        yield "a negative expert id", edit("top_experts", lambda t: t.__setitem__(-1, -1))
    if op == "topology" and r.block >= 2 and int(r.padded_bins[-1]) >= 1:
        yield (
            "padded bins not whole blocks",
            edit("padded_bins", lambda t: t.__setitem__(-1, int(t[-1]) - 1)),
        )
    if op == "topology" and r.E >= 2 and int(r.padded_bins[-1]) >= 1:
        yield (
            "padded_bins not cumulative",
            edit("padded_bins", lambda t: t.__setitem__(0, int(t[-1]) + r.block)),
        )
    if op == "replicate" and int(r.bins[-1]) >= 1:
        yield "bins past num_outputs", lambda a: a.__setitem__("num_outputs", int(r.bins[-1]) - 1)
    if op == "replicate" and r.E >= 2 and int(r.bins[-1]) >= 1:
        yield "bins not cumulative", edit("bins", lambda t: t.__setitem__(0, int(t[-1]) + 1))
    # int64 overflow goes undetected: test_checked_mode_int64_cumsum_overflow below.
    cumsum = op in ("inclusive_cumsum", "exclusive_cumsum")
    if cumsum and r.E >= 2 and args["x"].dtype != torch.int64:

        def overflow(a: dict[str, Any]) -> None:
            a["x"] = torch.full((r.E,), torch.iinfo(a["x"].dtype).max, dtype=a["x"].dtype)

        yield "running sums overflowing x's dtype", overflow


# histogram has no data rule; gmm's batch_sizes on the CPU are checked always (see above).
CHECKED_OPS = tuple(op for op in PUBLIC_DISPATCHED if op not in ("histogram", "gmm"))


@settings(FUZZ, max_examples=100)
@given(
    op=st.sampled_from(CHECKED_OPS),
    r=routings(SMALL),
    index_dtype=st.sampled_from(INDEX_DTYPES),
    data=st.data(),
)
def test_checked_mode_rejects_bad_data(
    checked_mode: None, op: str, r: Routing, index_dtype: torch.dtype, data: st.DataObject
) -> None:
    args = valid_call(op, r, index_dtype, torch.float32)
    with megablocks_core.use_backend("reference"):
        call_public(op, args)  # the unbroken call passes the checks
    candidates = list(data_mutations(op, args, r))
    if not candidates:
        return  # nothing in these inputs to break (e.g. zero tokens for a permutation op)
    what, mutate = data.draw(st.sampled_from(candidates), label="violation")
    mutate(args)
    with pytest.raises(ContractError) as caught:
        call_public(op, args)
    message = str(caught.value)
    assert message.startswith(f"megablocks_core.ops.{op}: "), f"{what}: {message}"


@pytest.mark.parametrize("op", ["inclusive_cumsum", "exclusive_cumsum"])
def test_checked_mode_int64_cumsum_overflow(checked_mode: None, op: str) -> None:
    x = torch.full((3,), torch.iinfo(torch.int64).max, dtype=torch.int64)
    with pytest.raises(ContractError, match=rf"^megablocks_core\.ops\.{op}: "):
        getattr(ops, op)(x, 0)
