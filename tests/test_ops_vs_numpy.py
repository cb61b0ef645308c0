"""Every public op of ``megablocks_core.ops`` against an independent numpy reference.

Expected values are computed with numpy and plain Python loops only (no torch
ops and never the code under test); torch is used solely to build the inputs
and to read the results back. Routing inputs are built the way a MoE layer
builds them: random ``top_experts`` -> stable argsort -> bincount -> cumsum.

Gradients of the differentiable inputs are checked against analytic gradients
written in numpy.
"""

from __future__ import annotations

import numpy as np
import oracle
import pytest
import torch

from megablocks_core import ops
from megablocks_core.plugin import activation_backward_definition

pytestmark = pytest.mark.usefixtures("reference_backend")

# --------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------

NP_INT = {torch.int16: np.int16, torch.int32: np.int32, torch.int64: np.int64}
NBITS = {torch.int16: 16, torch.int32: 32, torch.int64: 64}

# (rtol, atol) used when comparing against a float64 numpy reference.
TOL = {
    torch.float64: (1e-12, 1e-12),
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (1e-2, 1e-2),
}


def ft(a: np.ndarray, dtype: torch.dtype, noncontig: bool = False) -> torch.Tensor:
    """A float tensor of ``dtype`` holding exactly ``a`` (already representable)."""
    src = np.ascontiguousarray(a, dtype=np.float64)
    t = torch.from_numpy(src.astype(np.float32) if dtype != torch.float64 else src).to(dtype)
    return make_noncontig(t) if noncontig else t


def it(a, dtype: torch.dtype, noncontig: bool = False) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(np.asarray(a), dtype=NP_INT[dtype]).copy())
    return make_noncontig(t) if noncontig else t


def make_noncontig(t: torch.Tensor) -> torch.Tensor:
    """Same values, strided storage: every other element of a 2x larger buffer (last dim)."""
    if t.dim() == 0:
        return t
    shape = list(t.shape)
    big_shape = [*shape[:-1], 2 * shape[-1]]
    big = torch.full(big_shape, 7, dtype=t.dtype)
    big[..., ::2] = t
    view = big[..., ::2]
    if t.numel() > 1 and shape[-1] > 1:
        assert not view.is_contiguous()
    return view


def to64(t: torch.Tensor) -> np.ndarray:
    t = t.detach()
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.to(torch.float32)
    return t.contiguous().numpy().astype(np.float64)


def check(got: torch.Tensor, exp: np.ndarray, dtype: torch.dtype, exact: bool = False) -> None:
    assert isinstance(got, torch.Tensor)
    assert got.dtype == dtype, (got.dtype, dtype)
    assert tuple(got.shape) == tuple(exp.shape), (tuple(got.shape), exp.shape)
    g = to64(got)
    if exact:
        np.testing.assert_array_equal(g, exp)
    else:
        rtol, atol = TOL[dtype]
        np.testing.assert_allclose(g, exp, rtol=rtol, atol=atol)


def check_int(got: torch.Tensor, exp: np.ndarray, dtype: torch.dtype) -> None:
    assert isinstance(got, torch.Tensor)
    assert got.dtype == dtype, (got.dtype, dtype)
    assert tuple(got.shape) == tuple(np.shape(exp)), (tuple(got.shape), np.shape(exp))
    np.testing.assert_array_equal(
        got.contiguous().numpy().astype(np.int64), np.asarray(exp, dtype=np.int64)
    )


# --------------------------------------------------------------------------------------
# permutation-op cases
# --------------------------------------------------------------------------------------

# name: (T, K, E, H, index dtype, data dtype, noncontig, empty experts, block, seed)
PERM_CASES = {
    "basic": (16, 2, 4, 8, torch.int32, torch.float32, False, False, 4, 0),
    "top1_i64": (10, 1, 3, 5, torch.int64, torch.float32, False, False, 4, 1),
    "top3_empty_f64": (9, 3, 8, 6, torch.int64, torch.float64, False, True, 4, 2),
    "top4_bf16": (20, 4, 8, 16, torch.int32, torch.bfloat16, False, False, 4, 3),
    "top5_f64": (6, 5, 6, 7, torch.int64, torch.float64, False, False, 4, 4),
    "top6_i16": (7, 6, 14, 3, torch.int16, torch.float32, False, True, 4, 5),
    "top7_block128": (5, 7, 9, 4, torch.int32, torch.float32, False, False, 128, 6),
    "top8": (12, 8, 16, 4, torch.int32, torch.float32, False, False, 4, 7),
    "one_expert": (7, 1, 1, 3, torch.int32, torch.float32, False, False, 4, 8),
    "one_expert_top2": (5, 2, 1, 3, torch.int16, torch.float64, False, False, 4, 9),
    "hidden1": (11, 2, 4, 1, torch.int16, torch.float32, False, False, 4, 10),
    "zero_tokens": (0, 2, 4, 8, torch.int32, torch.float32, False, False, 4, 11),
    "zero_tokens_top1_i64": (0, 1, 3, 5, torch.int64, torch.bfloat16, False, False, 4, 12),
    "noncontig": (13, 2, 5, 6, torch.int64, torch.float32, True, True, 4, 13),
    "noncontig_bf16_i16": (9, 3, 4, 5, torch.int16, torch.bfloat16, True, False, 4, 14),
    "many_experts": (64, 8, 256, 8, torch.int32, torch.float32, False, False, 4, 15),
}
PERM_IDS = list(PERM_CASES)


def setup_case(name):
    T, K, E, H, idt, fdt, nc, empty, block, seed = PERM_CASES[name]
    rng = np.random.default_rng(1000 + seed)
    r = oracle.make_routing(rng, T, K, E, block=block, empty=empty)
    if name == "many_experts":
        assert (r["tpe"] == 0).any()
    t = dict(
        indices=it(r["indices"], idt, nc),
        bin_ids=it(r["bin_ids"], idt, nc),
        bins=it(r["bins"], idt, nc),
        padded_bins=it(r["padded_bins"], idt, nc),
    )
    return rng, r, t, H, fdt, nc


def rand(rng, shape, dtype):
    return oracle.representable(rng.standard_normal(shape), dtype)


def leaf(a, dtype, nc):
    return ft(a, dtype, nc).detach().requires_grad_(True)


# --------------------------------------------------------------------------------------
# gather / scatter
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", PERM_IDS)
def test_gather(name):
    rng, r, t, H, fdt, nc = setup_case(name)
    T, K = r["T"], r["K"]
    xv = rand(rng, (T, H), fdt)
    x = leaf(xv, fdt, nc)
    out = ops.gather(x, t["indices"], t["bin_ids"], t["bins"], K)
    check(
        out, oracle.gather(xv, r["indices"], r["bin_ids"], None, r["bins"], r["K"]), fdt, exact=True
    )

    g = rand(rng, (T * K, H), fdt)
    out.backward(ft(g, fdt, nc))
    assert x.grad is not None
    check(x.grad, oracle.scatter(g, r["indices"], r["bin_ids"], None, r["bins"], r["K"]), fdt)


@pytest.mark.parametrize("with_weights", [True, False], ids=["weights", "noweights"])
@pytest.mark.parametrize("name", PERM_IDS)
def test_scatter(name, with_weights):
    rng, r, t, H, fdt, nc = setup_case(name)
    T, K = r["T"], r["K"]
    n = T * K
    xv = rand(rng, (n, H), fdt)
    x = leaf(xv, fdt, nc)
    wv = oracle.representable(rng.uniform(0.1, 1.0, n), fdt) if with_weights else None
    w = leaf(wv, fdt, nc) if with_weights else None
    out = ops.scatter(x, t["indices"], t["bin_ids"], w, t["bins"], K)
    check(out, oracle.scatter(xv, r["indices"], r["bin_ids"], wv, r["bins"], r["K"]), fdt)

    g = rand(rng, (T, H), fdt)
    out.backward(ft(g, fdt, nc))
    assert x.grad is not None
    check(x.grad, oracle.gather(g, r["indices"], r["bin_ids"], wv, r["bins"], r["K"]), fdt)
    if with_weights:
        assert w.grad is not None
        check(
            w.grad, oracle.scatter_wgrad(xv, g, r["indices"], r["bin_ids"], r["bins"], r["K"]), fdt
        )


@pytest.mark.parametrize("name", ["basic", "top4_bf16", "top6_i16"])
def test_scatter_weights_only_grad(name):
    """Only the weights require grad (x is a plain input)."""
    rng, r, t, H, fdt, nc = setup_case(name)
    T, K = r["T"], r["K"]
    n = T * K
    xv = rand(rng, (n, H), fdt)
    wv = oracle.representable(rng.uniform(0.1, 1.0, n), fdt)
    w = leaf(wv, fdt, nc)
    out = ops.scatter(ft(xv, fdt), t["indices"], t["bin_ids"], w, t["bins"], K)
    check(out, oracle.scatter(xv, r["indices"], r["bin_ids"], wv, r["bins"], r["K"]), fdt)
    g = rand(rng, (T, H), fdt)
    out.backward(ft(g, fdt))
    check(w.grad, oracle.scatter_wgrad(xv, g, r["indices"], r["bin_ids"], r["bins"], r["K"]), fdt)


# --------------------------------------------------------------------------------------
# padded gather / scatter
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", PERM_IDS)
def test_padded_gather(name):
    rng, r, t, H, fdt, nc = setup_case(name)
    T, K = r["T"], r["K"]
    xv = rand(rng, (T, H), fdt)
    x = leaf(xv, fdt, nc)
    out = ops.padded_gather(x, t["indices"], t["bin_ids"], t["bins"], t["padded_bins"], K)
    exp = oracle.padded_gather(xv, r["indices"], r["bin_ids"], None, r["bins"], r["padded_bins"], K)
    check(out, exp, fdt, exact=True)

    g = rand(rng, exp.shape, fdt)
    out.backward(ft(g, fdt, nc))
    assert x.grad is not None
    exp_grad = oracle.padded_scatter(
        g, r["indices"], r["bin_ids"], None, r["bins"], r["padded_bins"], K
    )
    check(x.grad, exp_grad, fdt)


@pytest.mark.parametrize("with_weights", [True, False], ids=["weights", "noweights"])
@pytest.mark.parametrize("name", PERM_IDS)
def test_padded_scatter(name, with_weights):
    rng, r, t, H, fdt, nc = setup_case(name)
    T, K = r["T"], r["K"]
    n = T * K
    rows = int(r["padded_bins"][-1]) if r["E"] else 0
    xv = rand(rng, (rows, H), fdt)
    x = leaf(xv, fdt, nc)
    wv = oracle.representable(rng.uniform(0.1, 1.0, n), fdt) if with_weights else None
    w = leaf(wv, fdt, nc) if with_weights else None
    out = ops.padded_scatter(x, t["indices"], t["bin_ids"], w, t["bins"], t["padded_bins"], K)
    exp = oracle.padded_scatter(xv, r["indices"], r["bin_ids"], wv, r["bins"], r["padded_bins"], K)
    check(out, exp, fdt)

    g = rand(rng, (T, H), fdt)
    out.backward(ft(g, fdt, nc))
    assert x.grad is not None
    # padding rows must receive exactly zero gradient
    exp_grad = oracle.padded_gather(
        g, r["indices"], r["bin_ids"], wv, r["bins"], r["padded_bins"], K
    )
    check(x.grad, exp_grad, fdt)
    pad = np.ones(rows, dtype=bool)
    pad[oracle.padded_positions(r["bin_ids"], r["bins"], r["padded_bins"])] = False
    assert (to64(x.grad)[pad] == 0).all()
    if with_weights:
        assert w.grad is not None
        exp_wgrad = oracle.padded_scatter_wgrad(
            xv, g, r["indices"], r["bin_ids"], r["bins"], r["padded_bins"], K
        )
        check(w.grad, exp_wgrad, fdt)


# --------------------------------------------------------------------------------------
# binned gather / scatter
# --------------------------------------------------------------------------------------


def capacity(r, mode):
    mx = int(r["tpe"].max()) if r["E"] else 0
    if mode == "drop":
        return max(1, mx // 2)
    return mx + 1  # "fit": every row kept, extra zero rows


@pytest.mark.parametrize("mode", ["drop", "fit"])
@pytest.mark.parametrize("name", PERM_IDS)
def test_binned_gather(name, mode):
    rng, r, t, H, fdt, nc = setup_case(name)
    T, K = r["T"], r["K"]
    cap = capacity(r, mode)
    xv = rand(rng, (T, H), fdt)
    x = leaf(xv, fdt, nc)
    out = ops.binned_gather(x, t["indices"], t["bins"], cap, K)
    exp = oracle.binned_gather(xv, r["indices"], None, r["bins"], cap, r["K"])
    check(out, exp, fdt, exact=True)

    g = rand(rng, exp.shape, fdt)
    out.backward(ft(g, fdt, nc))
    assert x.grad is not None
    check(x.grad, oracle.binned_scatter(g, r["indices"], None, r["bins"], r["K"]), fdt)


@pytest.mark.parametrize("name", ["basic", "top6_i16", "zero_tokens", "top4_bf16"])
def test_binned_zero_capacity(name):
    """bin_size = 0: every row is dropped; binned_scatter of an (E, 0, H) input is all zero."""
    rng, r, t, H, fdt, nc = setup_case(name)
    T, K, E = r["T"], r["K"], r["E"]
    xv = rand(rng, (T, H), fdt)
    x = leaf(xv, fdt, nc)
    out = ops.binned_gather(x, t["indices"], t["bins"], 0, K)
    check(out, np.zeros((E, 0, H)), fdt, exact=True)
    out.backward(ft(np.zeros((E, 0, H)), fdt))
    check(x.grad, np.zeros((T, H)), fdt, exact=True)

    xb = leaf(np.zeros((E, 0, H)), fdt, False)
    wv = oracle.representable(rng.uniform(0.1, 1.0, T * K), fdt)
    w = leaf(wv, fdt, nc)
    out = ops.binned_scatter(xb, t["indices"], w, t["bins"], K)
    check(out, np.zeros((T, H)), fdt, exact=True)
    out.backward(ft(rand(rng, (T, H), fdt), fdt))
    check(w.grad, np.zeros(T * K), fdt, exact=True)


@pytest.mark.parametrize("with_weights", [True, False], ids=["weights", "noweights"])
@pytest.mark.parametrize("mode", ["drop", "fit"])
@pytest.mark.parametrize("name", PERM_IDS)
def test_binned_scatter(name, mode, with_weights):
    rng, r, t, H, fdt, nc = setup_case(name)
    T, K, E = r["T"], r["K"], r["E"]
    n = T * K
    cap = capacity(r, mode)
    xv = rand(rng, (E, cap, H), fdt)
    x = leaf(xv, fdt, nc)
    wv = oracle.representable(rng.uniform(0.1, 1.0, n), fdt) if with_weights else None
    w = leaf(wv, fdt, nc) if with_weights else None
    out = ops.binned_scatter(x, t["indices"], w, t["bins"], K)
    check(out, oracle.binned_scatter(xv, r["indices"], wv, r["bins"], r["K"]), fdt)

    g = rand(rng, (T, H), fdt)
    out.backward(ft(g, fdt, nc))
    assert x.grad is not None
    check(x.grad, oracle.binned_gather(g, r["indices"], wv, r["bins"], cap, r["K"]), fdt)
    if with_weights:
        assert w.grad is not None
        exp_wg = oracle.binned_scatter_wgrad(xv, g, r["indices"], r["bins"], r["K"])
        check(w.grad, exp_wg, fdt)


# --------------------------------------------------------------------------------------
# routing ops: sort / histogram / cumsum / topology / replicate / round_up
# --------------------------------------------------------------------------------------


SORT_CASES = [
    # (dtype, n, end_bit, seed)
    (torch.int32, 37, None, 0),
    (torch.int64, 100, None, 1),
    (torch.int16, 50, None, 2),
    (torch.int32, 64, 3, 3),
    (torch.int64, 1000, 8, 4),
    (torch.int16, 200, 5, 5),
    (torch.int16, 30, 16, 6),
    (torch.int32, 40, 32, 7),
    (torch.int64, 40, 64, 8),
    (torch.int32, 25, 1, 9),
    (torch.int32, 10, 0, 10),
    (torch.int32, 0, None, 11),
    (torch.int64, 0, 4, 12),
    (torch.int16, 1, 4, 13),
]


@pytest.mark.parametrize("dtype,n,end_bit,seed", SORT_CASES)
def test_sort(dtype, n, end_bit, seed):
    rng = np.random.default_rng(seed)
    bits = NBITS[dtype]
    # end_bit None: many ties; otherwise keys in [0, 2**end_bit), nonnegative
    hi = 8 if end_bit is None else min(2**end_bit, 2 ** (bits - 1))
    xv = rng.integers(0, hi, size=n).astype(np.int64)
    x = it(xv, dtype)
    values, idx = ops.sort(x, end_bit) if end_bit is not None else ops.sort(x)
    perm = np.argsort(xv, kind="stable")
    check_int(values, xv[perm], dtype)
    check_int(idx, perm, dtype)
    assert torch.equal(x, it(xv, dtype))  # input untouched


@pytest.mark.parametrize("dtype", [torch.int16, torch.int32, torch.int64])
def test_sort_negative_values_full_width(dtype):
    rng = np.random.default_rng(21)
    xv = rng.integers(-50, 50, size=60).astype(np.int64)
    xv[:3] = [np.iinfo(NP_INT[dtype]).min, np.iinfo(NP_INT[dtype]).max, 0]
    values, idx = ops.sort(it(xv, dtype), None)
    perm = np.argsort(xv, kind="stable")
    check_int(values, xv[perm], dtype)
    check_int(idx, perm, dtype)


def test_sort_noncontiguous():
    rng = np.random.default_rng(22)
    xv = rng.integers(0, 5, size=33).astype(np.int64)
    x = it(xv, torch.int32, noncontig=True)
    values, idx = ops.sort(x, 3)
    perm = np.argsort(xv, kind="stable")
    check_int(values, xv[perm], torch.int32)
    check_int(idx, perm, torch.int32)


HIST_CASES = [
    # (dtype, shape, num_bins, lo, hi, noncontig, seed)
    (torch.int32, (50,), 8, 0, 8, False, 0),
    (torch.int64, (77,), 5, -3, 9, False, 1),  # out-of-range values dropped
    (torch.int16, (40,), 1, 0, 1, False, 2),
    (torch.int32, (512,), 256, 0, 256, False, 3),
    (torch.int32, (0,), 4, 0, 4, False, 4),
    (torch.int32, (3, 20), 6, -1, 7, False, 5),
    (torch.int64, (2, 0), 3, 0, 3, False, 6),
    (torch.int16, (4, 9), 3, 0, 5, True, 7),
    (torch.int32, (30,), 10, 0, 3, True, 8),  # many empty bins
    (torch.int32, (12,), 0, 0, 3, False, 9),  # num_bins = 0: empty counts
    (torch.int64, (2, 5), 0, 0, 3, False, 10),
]


@pytest.mark.parametrize("dtype,shape,num_bins,lo,hi,nc,seed", HIST_CASES)
def test_histogram(dtype, shape, num_bins, lo, hi, nc, seed):
    rng = np.random.default_rng(seed)
    xv = rng.integers(lo, hi, size=shape).astype(np.int64)
    out = ops.histogram(it(xv, dtype, nc), num_bins)
    if len(shape) == 1:
        exp = oracle.histogram(xv, num_bins)
    else:
        exp = np.stack([oracle.histogram(row, num_bins) for row in xv]).reshape(shape[0], num_bins)
    check_int(out, exp, torch.int32)


CUMSUM_CASES = [
    # (dtype, shape, dim, noncontig, seed)
    (torch.int32, (17,), 0, False, 0),
    (torch.int64, (17,), 0, False, 1),
    (torch.int16, (17,), 0, False, 2),
    (torch.int32, (1,), 0, False, 3),
    (torch.int64, (1,), 0, False, 4),
    (torch.int32, (0,), 0, False, 5),
    (torch.int32, (256,), 0, False, 6),
    (torch.int32, (3, 5), 0, False, 7),
    (torch.int32, (3, 5), 1, False, 8),
    (torch.int64, (4, 6), 1, False, 9),
    (torch.int16, (4, 6), 0, False, 10),
    (torch.int32, (1, 1), 0, False, 11),
    (torch.int32, (1, 1), 1, False, 12),
    (torch.int32, (1, 7), 1, False, 13),
    (torch.int64, (7, 1), 0, False, 14),
    (torch.int32, (4, 6), 1, True, 15),
    (torch.int64, (4, 6), 0, True, 16),
    (torch.int32, (9,), 0, True, 17),
    (torch.int32, (4, 6), -1, False, 18),
    (torch.int64, (4, 6), -2, False, 19),
    (torch.int32, (8,), -1, False, 20),
]


@pytest.mark.parametrize("exclusive", [False, True], ids=["inclusive", "exclusive"])
@pytest.mark.parametrize("dtype,shape,dim,nc,seed", CUMSUM_CASES)
def test_cumsum(dtype, shape, dim, nc, seed, exclusive):
    rng = np.random.default_rng(seed)
    xv = rng.integers(0, 20, size=shape).astype(np.int64)
    x = it(xv, dtype, nc)
    fn = ops.exclusive_cumsum if exclusive else ops.inclusive_cumsum
    out = fn(x, dim)
    check_int(
        out, (oracle.exclusive_cumsum if exclusive else oracle.inclusive_cumsum)(xv, dim), dtype
    )


def test_cumsum_of_routing_counts():
    """The way a MoE layer uses it: bins from tokens_per_expert, with empty experts."""
    r = oracle.make_routing(np.random.default_rng(3), 20, 2, 8, empty=True)
    tpe = it(r["tpe"], torch.int32)
    check_int(ops.inclusive_cumsum(tpe, 0), r["bins"], torch.int32)
    check_int(ops.exclusive_cumsum(tpe, 0), r["bins"] - r["tpe"], torch.int32)


TOPO_CASES = [
    # (T, K, E, block_size, cols, dtype, empty, seed)
    (16, 2, 4, 4, 3, torch.int32, False, 0),
    (10, 1, 3, 4, 1, torch.int32, False, 1),
    (9, 3, 8, 4, 2, torch.int64, True, 2),
    (7, 2, 1, 4, 5, torch.int32, False, 3),
    (0, 2, 4, 4, 3, torch.int32, False, 4),
    (12, 4, 6, 128, 2, torch.int32, False, 5),
    (64, 8, 256, 4, 2, torch.int32, False, 6),
    (11, 2, 5, 2, 4, torch.int16, True, 7),
]


@pytest.mark.parametrize("T,K,E,bs,cols,dtype,empty,seed", TOPO_CASES)
def test_topology(T, K, E, bs, cols, dtype, empty, seed):
    r = oracle.make_routing(np.random.default_rng(seed), T, K, E, block=bs, empty=empty)
    pb = r["padded_bins"]
    rows = int(pb[-1]) // bs
    out = ops.topology(it(pb, dtype), bs, rows, cols)
    check_int(out, oracle.topology(pb, bs, rows, cols), torch.int16)


REPL_CASES = [
    # (B, T, K, E, extra cols, float dtype, index dtype, empty, noncontig, seed)
    (3, 16, 2, 4, 0, torch.float32, torch.int32, False, False, 0),
    (1, 9, 3, 8, 0, torch.float64, torch.int64, True, False, 1),
    (2, 20, 4, 8, 0, torch.bfloat16, torch.int32, False, False, 2),
    (4, 7, 1, 1, 0, torch.float32, torch.int32, False, False, 3),
    (2, 0, 2, 4, 0, torch.float32, torch.int32, False, False, 4),
    (2, 11, 2, 5, 0, torch.float32, torch.int16, True, False, 5),
    (3, 13, 2, 6, 0, torch.float32, torch.int64, False, True, 6),
    (2, 64, 8, 256, 0, torch.float32, torch.int32, False, False, 7),
]


@pytest.mark.parametrize("B,T,K,E,extra,fdt,idt,empty,nc,seed", REPL_CASES)
def test_replicate(B, T, K, E, extra, fdt, idt, empty, nc, seed):
    rng = np.random.default_rng(seed)
    r = oracle.make_routing(rng, T, K, E, empty=empty)
    bins = r["bins"]
    num_outputs = int(bins[-1]) + extra
    xv = rand(rng, (B, E), fdt)
    x = leaf(xv, fdt, nc)
    out = ops.replicate(x, it(bins, idt, nc), num_outputs)
    check(out, oracle.replicate(xv, bins, num_outputs), fdt, exact=True)

    g = rand(rng, (B, num_outputs), fdt)
    out.backward(ft(g, fdt, nc))
    assert x.grad is not None
    exp = oracle.replicate_backward(g, bins)
    check(x.grad, exp, fdt)
    # empty experts get exactly zero gradient
    assert (to64(x.grad)[:, r["tpe"] == 0] == 0).all()


def test_replicate_trailing_columns_are_zero():
    """kernels.md: columns j >= bins[-1] are 0 (num_outputs larger than bins[-1])."""
    rng = np.random.default_rng(41)
    r = oracle.make_routing(rng, 11, 2, 5, empty=True)
    bins = r["bins"]
    num_outputs = int(bins[-1]) + 3
    xv = rand(rng, (2, 5), torch.float32)
    out = ops.replicate(ft(xv, torch.float32), it(bins, torch.int32), num_outputs)
    exp = oracle.replicate(xv, bins, num_outputs)
    assert (exp[:, int(bins[-1]) :] == 0).all()
    check(out, exp, torch.float32, exact=True)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.int16])
def test_replicate_int_values(dtype):
    rng = np.random.default_rng(42)
    r = oracle.make_routing(rng, 9, 3, 8, empty=True)
    bins = r["bins"]
    xv = rng.integers(-100, 100, size=(3, 8)).astype(np.int64)
    out = ops.replicate(it(xv, dtype), it(bins, torch.int32), int(bins[-1]))
    check_int(out, oracle.replicate(xv, bins, int(bins[-1])).astype(np.int64), dtype)


@pytest.mark.parametrize("value", [1, 4, 128])
@pytest.mark.parametrize("dtype", [torch.int16, torch.int32, torch.int64])
def test_round_up(dtype, value):
    rng = np.random.default_rng(value)
    xv = np.concatenate([[0, 1, value, value - 1, value + 1, 2 * value], rng.integers(0, 1000, 20)])
    xv = xv.astype(np.int64)
    out = ops.round_up(it(xv, dtype), value)
    exp = np.array([((int(v) + value - 1) // value) * value for v in xv], dtype=np.int64)
    check_int(out, exp, dtype)
    assert (exp % value == 0).all() and (exp >= xv).all()


def test_round_up_routing_counts():
    r = oracle.make_routing(np.random.default_rng(5), 30, 2, 8, block=4, empty=True)
    out = ops.round_up(it(r["tpe"], torch.int32), 4)
    check_int(out, np.diff(np.concatenate([[0], r["padded_bins"]])), torch.int32)


# --------------------------------------------------------------------------------------
# repeat / sum
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape,tiling,dtype",
    [
        ((3, 4), (2, 3), torch.float32),
        ((3, 4), (1, 2), torch.int32),
        ((5,), (3,), torch.float64),
        ((2, 3), (2, 1, 2), torch.float32),  # more tiling entries than dims
        ((0, 3), (2, 2), torch.float32),
        ((4, 1), (1, 8), torch.bfloat16),
    ],
)
def test_repeat(shape, tiling, dtype):
    rng = np.random.default_rng(len(shape) + sum(tiling))
    if dtype.is_floating_point:
        xv = rand(rng, shape, dtype)
        x = ft(xv, dtype)
    else:
        xv = rng.integers(-9, 9, size=shape).astype(np.int64)
        x = it(xv, dtype)
    out = ops.repeat(x, tiling)
    exp = np.tile(xv, tiling)
    if dtype.is_floating_point:
        check(out, exp, dtype, exact=True)
    else:
        check_int(out, exp, dtype)


@pytest.mark.parametrize("shape,tiling", [((2, 3), (1, 1)), ((6,), (1,)), ((2, 3), [1, 1])])
def test_repeat_identity_returns_input(shape, tiling):
    xv = np.arange(6.0).reshape(shape)
    x = ft(xv, torch.float32)
    out = ops.repeat(x, tiling)
    assert out is x
    check(out, xv, torch.float32, exact=True)


@pytest.mark.parametrize(
    "shape,dim,dtype",
    [
        ((4, 5), 0, torch.float32),
        ((4, 5), 1, torch.float64),
        ((3, 6, 2), 1, torch.float32),
        ((1, 5), 0, torch.float32),  # size-1 dim squeezed
        ((3, 1, 4), 1, torch.float64),  # size-1 dim squeezed
        ((4, 1), 1, torch.bfloat16),
        ((6, 3), 0, torch.bfloat16),
        ((5, 3), 0, torch.int64),
        ((7,), 0, torch.float32),
        ((3, 1, 4), -2, torch.float32),  # negative dim, squeezed
        ((3, 5, 4), -1, torch.float64),
    ],
)
def test_sum(shape, dim, dtype):
    rng = np.random.default_rng(sum(shape) + dim)
    if dtype.is_floating_point:
        xv = rand(rng, shape, dtype)
        x = ft(xv, dtype)
    else:
        xv = rng.integers(-9, 9, size=shape).astype(np.int64)
        x = it(xv, dtype)
    out = ops.sum(x, dim)
    exp = np.sum(xv, axis=dim)
    if dtype.is_floating_point:
        check(out, exp, dtype, exact=shape[dim] == 1)
    else:
        check_int(out, exp, dtype)


def test_sum_default_dim():
    rng = np.random.default_rng(99)
    xv = rand(rng, (3, 4), torch.float32)
    check(ops.sum(ft(xv, torch.float32)), xv.sum(axis=0), torch.float32)


# --------------------------------------------------------------------------------------
# grouped GEMM
# --------------------------------------------------------------------------------------


GMM_CASES = {
    # name: (T, topk, E, K, N, trans_b, data dtype, batch_sizes dtype, empty, noncontig, seed)
    "basic": (12, 2, 4, 8, 6, False, torch.float32, torch.int64, False, False, 0),
    "trans_b": (12, 2, 4, 8, 6, True, torch.float32, torch.int64, False, False, 1),
    "int32_sizes": (10, 1, 3, 5, 7, False, torch.float32, torch.int32, False, False, 2),
    "int32_sizes_trans_b": (10, 3, 3, 5, 7, True, torch.float32, torch.int32, False, False, 3),
    "empty_experts": (9, 3, 8, 6, 4, False, torch.float32, torch.int64, True, False, 4),
    "empty_experts_trans_b": (9, 3, 8, 6, 4, True, torch.float64, torch.int64, True, False, 5),
    "f64": (7, 2, 5, 4, 3, False, torch.float64, torch.int64, False, False, 6),
    "bf16": (16, 2, 6, 32, 16, False, torch.bfloat16, torch.int64, True, False, 7),
    "bf16_trans_b": (16, 2, 4, 32, 16, True, torch.bfloat16, torch.int32, False, False, 8),
    "one_expert": (6, 1, 1, 4, 5, False, torch.float32, torch.int64, False, False, 9),
    "zero_tokens": (0, 2, 3, 4, 5, False, torch.float32, torch.int64, False, False, 10),
    "zero_tokens_trans_b": (0, 2, 3, 4, 5, True, torch.float32, torch.int32, False, False, 11),
    "k1_n1": (8, 2, 3, 1, 1, False, torch.float32, torch.int64, False, False, 12),
    "noncontig": (11, 2, 4, 6, 5, False, torch.float32, torch.int64, True, True, 13),
    "noncontig_trans_b": (11, 2, 4, 6, 5, True, torch.float32, torch.int32, False, True, 14),
    "many_experts": (32, 8, 256, 4, 4, False, torch.float32, torch.int64, False, False, 15),
}


def gmm_noncontig_b(bv, dtype):
    """b with the same values as bv but stored transposed in its last two dims."""
    t = ft(np.ascontiguousarray(np.swapaxes(bv, 1, 2)), dtype).transpose(1, 2)
    if bv.shape[1] > 1 and bv.shape[2] > 1:
        assert not t.is_contiguous()
    return t.detach().requires_grad_(True)


@pytest.mark.parametrize("name", list(GMM_CASES))
def test_gmm(name):
    T, topk, E, K, N, trans_b, fdt, sdt, empty, nc, seed = GMM_CASES[name]
    rng = np.random.default_rng(500 + seed)
    r = oracle.make_routing(rng, T, topk, E, empty=empty)
    sizes = [int(c) for c in r["tpe"]]
    M = sum(sizes)
    av = rand(rng, (M, K), fdt)
    bv = rand(rng, (E, N, K) if trans_b else (E, K, N), fdt)
    a = leaf(av, fdt, nc)
    b = gmm_noncontig_b(bv, fdt) if nc else leaf(bv, fdt, False)
    bs = it(sizes, sdt, nc)
    assert bs.device.type == "cpu"
    out = ops.gmm(a, b, bs, trans_b)
    check(out, oracle.gmm(av, bv, sizes, trans_b), fdt)

    g = rand(rng, (M, N), fdt)
    out.backward(ft(g, fdt, nc))
    ga, gb = oracle.gmm_backward(av, bv, g, sizes, trans_b)
    assert a.grad is not None and b.grad is not None
    check(a.grad, ga, fdt)
    check(b.grad, gb, fdt)
    for e, c in enumerate(sizes):
        if c == 0:  # empty expert: exactly zero weight gradient
            assert (to64(b.grad[e]) == 0).all(), e
    if empty or name in ("zero_tokens", "zero_tokens_trans_b", "many_experts"):
        assert any(c == 0 for c in sizes)


@pytest.mark.parametrize(
    "sizes,extra,trans_b,fdt,on_device",
    [
        ([4, 0, 7], 5, False, torch.float32, False),
        ([4, 0, 7], 5, True, torch.float64, True),
        ([0, 0], 6, False, torch.float32, False),
        ([3, 9, 2, 0], 1, True, torch.bfloat16, False),
    ],
)
def test_gmm_rows_past_the_last_group(sizes, extra, trans_b, fdt, on_device):
    """batch_sizes summing short of the rows: the rows past the last group belong to no group
    (output 0, a's gradient 0) and add nothing to b's gradient."""
    rng = np.random.default_rng(sum(sizes) + extra)
    M, E, K, N = sum(sizes) + extra, len(sizes), 6, 5
    av = rand(rng, (M, K), fdt)
    bv = rand(rng, (E, N, K) if trans_b else (E, K, N), fdt)
    a, b = leaf(av, fdt, False), leaf(bv, fdt, False)
    bs = it(sizes, torch.int64)
    out = ops.gmm(a, b, bs.to(a.device) if on_device else bs, trans_b)
    check_sum(out, oracle.gmm(av, bv, sizes, trans_b), fdt)
    assert (to64(out[sum(sizes) :]) == 0).all()
    g = rand(rng, (M, N), fdt)
    out.backward(ft(g, fdt))
    ga, gb = oracle.gmm_backward(av, bv, g, sizes, trans_b)
    check_sum(a.grad, ga, fdt)
    check_sum(b.grad, gb, fdt)
    assert (to64(a.grad[sum(sizes) :]) == 0).all()


def test_gmm_default_trans_b_and_same_device_sizes():
    """trans_b defaults to False; batch_sizes may live on a's device."""
    rng = np.random.default_rng(77)
    r = oracle.make_routing(rng, 10, 2, 3)
    sizes = [int(c) for c in r["tpe"]]
    M = sum(sizes)
    av = rand(rng, (M, 4), torch.float32)
    bv = rand(rng, (3, 4, 5), torch.float32)
    a = ft(av, torch.float32)
    bs = it(sizes, torch.int64).to(a.device)
    out = ops.gmm(a, ft(bv, torch.float32), bs)
    check(out, oracle.gmm(av, bv, sizes, False), torch.float32)


# name: (T, top_k, E, H, F, trans_b, data dtype, index dtype, weighted, empty, noncontig, seed)
FUSED_CASES = {
    "basic": (12, 2, 4, 8, 6, False, torch.float32, torch.int32, True, False, False, 0),
    "trans_b": (12, 2, 4, 8, 6, True, torch.float32, torch.int64, True, False, False, 1),
    "top1_unweighted": (10, 1, 3, 5, 7, False, torch.float32, torch.int32, False, False, False, 2),
    "top8_empty": (9, 8, 16, 6, 4, False, torch.float64, torch.int64, True, True, False, 3),
    "bf16": (16, 2, 6, 32, 16, False, torch.bfloat16, torch.int32, True, True, False, 4),
    "fp16_trans_b": (16, 3, 4, 16, 32, True, torch.float16, torch.int16, True, False, False, 5),
    "one_expert": (6, 1, 1, 4, 5, False, torch.float32, torch.int32, True, False, False, 6),
    "zero_tokens": (0, 2, 3, 4, 5, False, torch.float32, torch.int32, True, False, False, 7),
    "noncontig": (11, 2, 4, 6, 5, True, torch.float32, torch.int64, True, True, True, 8),
    "many_experts": (32, 8, 256, 4, 4, False, torch.float32, torch.int32, True, False, False, 9),
}


def check_sum(got: torch.Tensor, exp: np.ndarray, dtype: torch.dtype) -> None:
    """As check, for sums of rounded 16-bit products: errors scale with the largest term, so
    a sum that cancels is compared with an absolute tolerance of 1 % of the largest value."""
    if dtype not in (torch.float16, torch.bfloat16):
        return check(got, exp, dtype)
    assert got.dtype == dtype and tuple(got.shape) == tuple(exp.shape)
    scale = max(1.0, float(np.abs(exp).max())) if exp.size else 1.0
    np.testing.assert_allclose(to64(got), exp, rtol=1e-2, atol=1e-2 * scale)


#: Cases with (token, k) pairs routed to no expert (sorted rows past bins[-1]), as expert
#: parallelism's receiving rank has them: FUSED_CASES entry and the number of such pairs.
UNROUTED_FUSED_CASES = {
    "unrouted_basic": ("basic", 9),
    "unrouted_trans_b": ("trans_b", 13),
    "unrouted_top8_empty": ("top8_empty", 40),
    "unrouted_bf16": ("bf16", 17),
    "unrouted_noncontig": ("noncontig", 5),
    "unrouted_all": ("top1_unweighted", 10),
}


@pytest.mark.parametrize("name", list(FUSED_CASES))
def test_gather_gmm_and_gmm_scatter(name):
    """The fused ops against row-by-row numpy loops, forward and every gradient."""
    _fused_vs_loops(*FUSED_CASES[name])


@pytest.mark.parametrize("name", list(UNROUTED_FUSED_CASES))
def test_fused_ops_skip_rows_past_the_last_group(name):
    """Sorted rows past bins[-1] belong to no expert: gather_gmm gives 0 rows for them,
    gmm_scatter adds nothing for them, and every gradient is the numpy loop's that skips them."""
    case, unrouted = UNROUTED_FUSED_CASES[name]
    _fused_vs_loops(*FUSED_CASES[case], unrouted=unrouted)


@pytest.mark.parametrize("act", ["gelu", "silu", "relu", "geglu", "swiglu", "reglu", "bilinear"])
@pytest.mark.parametrize("name", ["basic", "trans_b", "top8_empty", "bf16", "fp16_trans_b"])
def test_gmm_scatter_with_an_activation(name, act):
    """gmm_scatter(x, ..., activation=act) against the loops over act(x) (numpy's own formulas;
    a gated one: act(gate) * up of x's halves), every gradient through the activation included."""
    _fused_vs_loops(*FUSED_CASES[name], act=act)


def _fused_vs_loops(
    T, K, E, H, F, trans_b, fdt, idt, weighted, empty, nc, seed, unrouted=0, act=None
):
    rng = np.random.default_rng(900 + seed + unrouted)
    r = oracle.make_routing(rng, T, K, E, empty=empty, unrouted=unrouted)
    routed = int(r["bins"][-1]) if E else 0
    assert routed == T * K - unrouted
    idx = [it(r[n], idt, nc) for n in ("indices", "bin_ids", "bins")]
    F1 = 2 * F if act in oracle.GATED else F  # a gated activation halves the first GEMM's width
    xv, w1v = rand(rng, (T, H), fdt), rand(rng, (E, F1, H) if trans_b else (E, H, F1), fdt)
    w2v = rand(rng, (E, H, F) if trans_b else (E, F, H), fdt)
    wv = oracle.representable(rng.uniform(0.1, 1.0, T * K), fdt) if weighted else None
    x, w1, w2 = leaf(xv, fdt, nc), leaf(w1v, fdt, False), leaf(w2v, fdt, False)
    w = leaf(wv, fdt, nc) if weighted else None

    h = ops.gather_gmm(x, w1, *idx, K, trans_b)
    hv = oracle.gather_gmm(xv, w1v, r["indices"], r["bins"], K, trans_b)
    check_sum(h, hv, fdt)
    assert (to64(h[routed:]) == 0).all()  # rows of no expert: exact zeros
    hin = leaf(to64(h), fdt, nc)  # the second GEMM on its own leaf: each op's gradients alone
    out = ops.gmm_scatter(hin, w2, idx[0], idx[1], w, idx[2], K, trans_b, act)
    want = oracle.gmm_scatter(to64(h), w2v, r["indices"], wv, r["bins"], K, trans_b, act)
    check_sum(out, want, fdt)

    g = rand(rng, (T, H), fdt)
    out.backward(ft(g, fdt, nc))
    gh, gw2, gw = oracle.gmm_scatter_backward(
        to64(h), w2v, wv, g, r["indices"], r["bins"], K, trans_b, act
    )
    check_sum(hin.grad, gh, fdt)
    check_sum(w2.grad, gw2, fdt)
    if weighted:
        check_sum(w.grad, gw, fdt)
        unrouted_ids = torch.from_numpy(r["indices"][routed:])
        assert (to64(w.grad[unrouted_ids]) == 0).all()  # skipped pairs: exactly 0
    assert (to64(hin.grad[routed:]) == 0).all()
    gout = rand(rng, tuple(h.shape), fdt)
    h.backward(ft(gout, fdt))
    gx, gw1 = oracle.gather_gmm_backward(xv, w1v, gout, r["indices"], r["bins"], K, trans_b)
    check_sum(x.grad, gx, fdt)
    check_sum(w1.grad, gw1, fdt)
    for e, c in enumerate(r["tpe"]):
        if c == 0:  # an empty expert's weight gradients are exactly zero
            assert (to64(w1.grad[e]) == 0).all() and (to64(w2.grad[e]) == 0).all(), e


@pytest.mark.parametrize(
    "T,K,E,block,empty,dtype",
    [
        (0, 2, 8, 4, False, torch.int32),
        (5, 1, 1, 4, False, torch.int64),
        (33, 8, 256, 128, False, torch.int32),
        (17, 3, 9, 4, True, torch.int16),
        (64, 2, 8, 128, False, torch.int64),
    ],
)
def test_route(T, K, E, block, empty, dtype):
    r = oracle.make_routing(np.random.default_rng(T + E), T, K, E, block=block, empty=empty)
    indices, bin_ids, counts, bins, padded_bins = ops.route(it(r["top"], dtype), E, block)
    check_int(indices, r["indices"], dtype)
    check_int(bin_ids, r["bin_ids"], dtype)
    for got, want in ((counts, r["tpe"]), (bins, r["bins"]), (padded_bins, r["padded_bins"])):
        check_int(got, want, torch.int32)


def _router_scores(rng, T, E, specials):
    """Quarter steps (many equal scores, exact in every float dtype); with ``specials`` a NaN,
    an all -inf row, +inf, and -0.0 beside 0.0."""
    s = np.round(rng.standard_normal((T, E)) * 4) / 4
    if specials and T >= 4 and E >= 3:
        s[0, E - 1] = np.nan
        s[1, :] = -np.inf
        s[2, 1] = np.inf
        s[3, 0], s[3, 1] = -0.0, 0.0
    return s


@pytest.mark.parametrize(
    "T,E,K,dtype,softmax,noncontig,specials",
    [
        (0, 8, 2, torch.float32, True, False, False),
        (5, 1, 1, torch.float32, False, False, False),
        (6, 3, 3, torch.float64, True, False, True),
        (33, 128, 8, torch.float32, True, False, True),
        (17, 9, 4, torch.bfloat16, False, True, True),
        (40, 64, 6, torch.float16, True, False, False),
        (9, 256, 1, torch.float64, False, True, True),
        (4, 5000, 8, torch.float32, True, False, True),
    ],
)
def test_router_topk(T, E, K, dtype, softmax, noncontig, specials):
    s = _router_scores(np.random.default_rng(T + E + K), T, E, specials)
    weights, experts = ops.router_topk(ft(s, dtype, noncontig), K, softmax)
    want_w, want_e = oracle.router_topk(s, K, softmax)
    check_int(experts, want_e, torch.int32)
    if dtype in TOL:
        check(weights, want_w, dtype)
    else:  # float16: ~1e-3 relative
        assert weights.dtype == dtype
        np.testing.assert_allclose(to64(weights), want_w, rtol=2e-3, atol=2e-3)
    if specials and T >= 4 and E >= 3:
        assert experts[0, 0] == E - 1  # NaN ranks first
        assert experts[2, 0] == 1  # +inf next to it in its own row
        assert bool(torch.isnan(weights[1]).all()) == softmax  # -inf only: softmax is NaN


def test_router_topk_rejects_top_k_past_the_experts():
    with pytest.raises(ValueError, match="top_k is at most the number of experts"):
        ops.router_topk(torch.zeros(3, 4), 5)


# --------------------------------------------------------------------------------------
# glu (gated experts' unit)
# --------------------------------------------------------------------------------------

GLU_CASES = {
    "basic": (33, 24, torch.float32, False),
    "fp64": (7, 5, torch.float64, False),
    "non_contiguous": (12, 16, torch.float32, True),
    "bf16": (16, 8, torch.bfloat16, False),
    "zero_rows": (0, 4, torch.float32, False),
    "zero_width": (5, 0, torch.float32, False),
}


@pytest.mark.parametrize(
    "act", [None, "gelu", "silu", "relu", "geglu", "swiglu", "reglu", "bilinear"]
)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_activation_backward_definition(dtype, act):
    """The definition of activation_backward (what the reference backend runs) against numpy's
    slopes; scaled and unscaled rows; a gated activation's x twice grad's width."""
    rng = np.random.default_rng(90)
    width = 14 if act in oracle.GATED else 7
    xv = oracle.representable(3 * rng.standard_normal((11, width)), dtype)
    g = rand(rng, (11, 7), dtype)
    scale = oracle.representable(rng.random(11), dtype)
    for s in (scale, None):
        grad = ft(g.copy(), dtype)  # act(x) is written over it (float64 would share g's memory)
        grad_x, dots = activation_backward_definition(
            grad, ft(xv, dtype), None if s is None else ft(s, dtype), act
        )
        want = oracle.activation_backward(g, xv, s, act, dtype)
        check(grad_x, want[0], dtype)
        check(grad, want[1], dtype)
        # The dots of the act written (checked above) and grad, rounded to the data's dtype.
        check(dots, (grad.double() * ft(g, dtype).double()).sum(1).numpy(), dtype)


@pytest.mark.parametrize("act", [None, "gelu", "silu", "relu"])
@pytest.mark.parametrize("name", list(GLU_CASES))
def test_glu(name, act):
    """ops.glu and its gradient (glu_backward) against numpy's act(gate) * up and the
    hand-differentiated slopes; values spread to reach every activation's tails."""
    rows, n, dtype, nc = GLU_CASES[name]
    rng = np.random.default_rng(70 + rows + n)
    xv = oracle.representable(3 * rng.standard_normal((rows, 2 * n)), dtype)
    x = leaf(xv, dtype, nc)
    out = ops.glu(x, act)
    check(out, oracle.glu(xv, act), dtype)
    g = rand(rng, (rows, n), dtype)
    out.backward(ft(g, dtype, nc))
    check(x.grad, oracle.glu_backward(g, xv, act), dtype)
