"""megablocks-cuda on a CUDA GPU: every routing op and both grouped-GEMM providers vs references.

Skipped without an NVIDIA GPU. The first test builds (or loads) the extension, so a broken build
shows up here as a failure with the compiler's message.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from megablocks_reference import kernels as reference

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or bool(torch.version.hip), reason="needs an NVIDIA CUDA GPU"
)

DEV = "cuda"
INTS = (torch.int16, torch.int32, torch.int64)


@pytest.fixture(scope="module")
def ext():
    from megablocks_cuda import extension

    assert extension.problem() is None, extension.problem()
    return extension.load()


def _keys(n: int, experts: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, experts, (n,), generator=g).to(dtype).to(DEV)


def _same(got, want) -> None:
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape and g.device == w.device
        assert torch.equal(g, w)


@pytest.mark.parametrize("dtype", INTS)
@pytest.mark.parametrize(
    "n,experts", [(0, 8), (1, 1), (1000, 1), (5000, 8), (32768, 256), (200_003, 64)]
)
def test_sort_histogram_cumsum(ext, dtype, n, experts):
    from megablocks_cuda import routing

    if dtype == torch.int16 and n > 32768:
        pytest.skip("the contract rejects int16 keys this long")
    x = _keys(n, experts, dtype, seed=n)
    end_bit = max((experts - 1).bit_length(), 1)
    for bits in (end_bit, None, torch.iinfo(dtype).bits):
        _same(routing.sort(x, bits), reference.sort(x, bits))
    counts = routing.histogram(x, experts)
    _same(counts, reference.histogram(x, experts))
    _same(routing.histogram(x, 3), reference.histogram(x, 3))  # keys beyond the bins are dropped
    for op in ("inclusive_cumsum", "exclusive_cumsum"):
        c = counts.to(dtype)
        _same(getattr(routing, op)(c, 0), getattr(reference, op)(c, 0))
        wide = x[: (n // 4) * 4].view(4, -1) if n >= 4 else x.view(1, -1)
        for dim in (0, 1, -1):
            _same(getattr(routing, op)(wide.contiguous(), dim), getattr(reference, op)(wide, dim))


def test_sort_end_bit_zero_and_batched_histogram(ext):
    from megablocks_cuda import routing

    x = torch.zeros(100, dtype=torch.int32, device=DEV)
    _same(routing.sort(x, 0), reference.sort(x, 0))
    rows = torch.randint(-3, 40, (5, 777), device=DEV)
    _same(routing.histogram(rows, 32), reference.histogram(rows, 32))
    _same(routing.histogram(rows, 5000), reference.histogram(rows, 5000))  # global-atomic path
    _same(routing.histogram(rows, 0), reference.histogram(rows, 0))


def _route_oracle(ids: torch.Tensor, experts: int, block: int) -> tuple[torch.Tensor, ...]:
    """route by torch on the CPU: ids out of range sort last in input order, uncounted."""
    wide = ids.cpu().long()
    valid = (wide >= 0) & (wide < experts)
    order = torch.sort(torch.where(valid, wide, experts), stable=True).indices
    counts = torch.bincount(wide[valid], minlength=experts)
    rounded = (counts + block - 1) // block * block
    return (
        order.to(ids.dtype),
        ids.cpu()[order],
        counts.int(),
        counts.cumsum(0).int(),
        rounded.cumsum(0).int(),
    )


#: Around the one-block kernels' block shapes (128, 512, 1024, 2048 and 4096 keys) and, for
#: route's counting sort up to 128 ids, its warps' edges (32 ids each).
ONE_BLOCK_SIZES = (
    *(0, 1, 7, 32, 33, 100, 127, 128, 129, 511, 512, 513),
    *(1023, 1024, 1025, 2047, 2048, 2049, 3000, 4095, 4096),
)


@pytest.mark.parametrize("dtype", INTS)
@pytest.mark.parametrize("n", ONE_BLOCK_SIZES)
def test_one_block_sort_and_route(ext, dtype, n):
    from megablocks_cuda import routing

    assert routing.one_block_limits() == (4096, 1024, 16)
    for experts in (1, 3, 8, 128, 1000, 1024):
        x = _keys(n, experts, dtype, seed=n + experts)
        end_bit = max((experts - 1).bit_length(), 1)
        for bits in (0, end_bit, 16) if experts == 1 else (end_bit, 16):
            got = routing.sort_one_block(x, bits)
            _same(tuple(t.cpu() for t in got), reference.sort(x.cpu(), bits))
        for block in (1, 64, 128):
            got = routing.route_one_block(x, experts, block)
            _same(tuple(t.cpu() for t in got), _route_oracle(x, experts, block))


def test_one_block_ops_take_strided_keys(ext):
    """The one-block kernels make their input contiguous themselves (the core passes it as is)."""
    from megablocks_cuda import routing

    x = _keys(2000, 64, torch.int32, seed=5)
    strided = torch.stack([x, -x], 1).flatten()[::2]
    assert not strided.is_contiguous() and torch.equal(strided, x)
    _same(routing.sort_one_block(strided, 6), routing.sort_one_block(x, 6))
    _same(routing.route_one_block(strided, 64, 128), routing.route_one_block(x, 64, 128))
    _same(
        tuple(t.cpu() for t in routing.route_one_block(strided, 64, 128)), _route_oracle(x, 64, 128)
    )


@pytest.mark.parametrize("dtype", INTS)
def test_one_block_route_and_sort_on_bad_ids(ext, dtype):
    """Ids out of range: route sorts them last, uncounted; sort still returns a permutation."""
    from megablocks_cuda import routing

    g = torch.Generator().manual_seed(3)
    low = -5 if dtype != torch.int64 else -(2**40)
    for n in (5, 100, 1000, 4096):
        ids = torch.randint(low, 20, (n,), generator=g).to(dtype)
        ids[:2] = torch.iinfo(dtype).max
        x = ids.to(DEV)
        for block in (1, 128, 2**40):  # a block size past int32: the sums wrap as int32's do
            got = routing.route_one_block(x, 16, block)
            _same(tuple(t.cpu() for t in got), _route_oracle(ids, 16, block))
        values, order = routing.sort_one_block(x, 4)
        assert torch.equal(order.cpu().long().sort().values, torch.arange(n))
        assert torch.equal(values.cpu(), ids[order.cpu().long()])


@pytest.mark.parametrize("dtype", INTS)
@pytest.mark.parametrize("experts,block,cols", [(1, 128, 4), (8, 128, 3), (256, 64, 2)])
def test_topology(ext, dtype, experts, block, cols):
    from megablocks_cuda import routing

    counts = _keys(experts * 50, experts, torch.int64).bincount(minlength=experts)
    counts[0] = 0  # an expert without rows owns no block-rows
    padded = (((counts + block - 1) // block) * block).cumsum(0).to(dtype)
    rows = int(padded[-1]) // block
    _same(
        routing.topology(padded, block, rows, cols), reference.topology(padded, block, rows, cols)
    )
    _same(routing.topology(padded, block, 0, cols), reference.topology(padded, block, 0, cols))


@pytest.mark.parametrize(
    "xdtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64, *INTS]
)
@pytest.mark.parametrize("experts", [1, 8, 256])
def test_replicate(ext, xdtype, experts):
    from megablocks_cuda import routing

    counts = _keys(experts * 7, experts, torch.int64).bincount(minlength=experts)
    bins = counts.cumsum(0).to(torch.int32)
    total = int(bins[-1])
    x = (torch.randn(2, experts, device=DEV) * 10).to(xdtype)
    for outputs in (total, total + 5, 0):
        _same(routing.replicate(x, bins, outputs), reference.replicate(x, bins, outputs))
    if xdtype.is_floating_point:
        grad = torch.randn(3, total + 2, device=DEV).to(xdtype)
        got, want = routing.replicate_backward(grad, bins), reference.replicate_backward(grad, bins)
        tol = {"rtol": 1e-2, "atol": 1e-2} if xdtype in (torch.bfloat16, torch.float16) else {}
        torch.testing.assert_close(got, want, **tol)
        empty = routing.replicate_backward(grad[:, :0], bins)
        _same(empty, reference.replicate_backward(grad[:, :0], bins))


FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# Rounding of the result (accumulated in float32, float64 for float64 data) against float64.
SCATTER_TOL = {
    torch.float16: 2e-3,
    torch.bfloat16: 1.6e-2,
    torch.float32: 1e-5,
    torch.float64: 1e-12,
}


def _scatter_oracle(x, indices, weights, top_k):
    """float64 definition: every row whose flat id is in range adds w[id] * row to token id // k."""
    n, hidden = x.shape
    ids = indices.cpu().long()
    keep = (ids >= 0) & (ids < n)
    rows = x.cpu().double()[keep]
    if weights is not None:
        rows = rows * weights.cpu().double()[ids[keep]][:, None]
    out = torch.zeros(n // top_k, hidden, dtype=torch.float64)
    return out.index_add_(0, ids[keep] // top_k, rows)


def _scatter_inputs(tokens, top_k, hidden, dtype, index_dtype, seed):
    g = torch.Generator().manual_seed(seed)
    n = tokens * top_k
    x = torch.randn(n, hidden, generator=g).to(dtype).to(DEV)
    indices = torch.randperm(n, generator=g).to(index_dtype).to(DEV)
    weights = torch.rand(n, generator=g).to(DEV)
    return x, indices, weights


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("index_dtype", INTS)
@pytest.mark.parametrize(
    "tokens,top_k,hidden",
    [
        (0, 8, 64),
        (1, 1, 1),
        (1, 8, 2048),
        (7, 2, 7),
        (33, 8, 130),
        (128, 8, 2048),
        (512, 8, 2048),
        (4096, 1, 64),
        (1, 4096, 8),
        (300, 6, 1000),
    ],
)
def test_scan_scatter(ext, dtype, index_dtype, tokens, top_k, hidden):
    from megablocks_cuda import permutation

    assert permutation.scan_scatter_max_rows() == 4096
    x, indices, weights = _scatter_inputs(
        tokens, top_k, hidden, dtype, index_dtype, tokens + hidden
    )
    for w in (None, weights, weights.to(torch.bfloat16), weights.to(dtype)):
        want = _scatter_oracle(x, indices, w, top_k)
        for per_block in (0, 1, 3, 8):  # 0: the launch shape's own choice
            got = ext.scan_scatter(x, indices, w, top_k, per_block)
            assert got.dtype == dtype and got.shape == (tokens, hidden)
            torch.testing.assert_close(
                got.cpu().double(), want, rtol=SCATTER_TOL[dtype], atol=SCATTER_TOL[dtype]
            )


def test_scan_scatter_layouts(ext):
    """Strided and misaligned inputs (the one-element path) give what contiguous ones give."""
    from megablocks_cuda import permutation

    x, indices, weights = _scatter_inputs(100, 4, 257, torch.bfloat16, torch.int32, 1)
    want = _scatter_oracle(x, indices, weights, 4)
    wide = torch.zeros(400, 2 * 257, dtype=torch.bfloat16, device=DEV)
    wide[:, ::2] = x
    offset = torch.zeros(400 * 257 + 1, dtype=torch.bfloat16, device=DEV)
    offset[1:] = x.flatten()
    strided_ids = torch.stack([indices, -indices]).t().flatten()[::2]
    for rows in (wide[:, ::2], offset[1:].view(400, 257), x):
        for ids in (strided_ids, indices):
            got = permutation.scan_scatter(rows, ids, None, weights[::1], None, 4)
            torch.testing.assert_close(got.cpu().double(), want, rtol=1.6e-2, atol=1.6e-2)


@pytest.mark.parametrize("index_dtype", INTS)
def test_scan_scatter_on_bad_ids(ext, index_dtype):
    """Ids out of range are ignored, a copy no row names adds 0, a doubly named copy adds one of
    its rows (the contract leaves which one open); nothing outside the tensors is touched."""
    tokens, top_k, hidden = 200, 8, 64
    x, indices, weights = _scatter_inputs(tokens, top_k, hidden, torch.float32, index_dtype, 7)
    bad = indices.clone()
    low = torch.iinfo(index_dtype).min
    bad[:3] = torch.tensor([-1, tokens * top_k, low], dtype=index_dtype)
    bad[3] = torch.iinfo(index_dtype).max
    got = ext.scan_scatter(x, bad, weights, top_k).cpu().double()
    torch.testing.assert_close(got, _scatter_oracle(x, bad, weights, top_k), rtol=1e-5, atol=1e-5)
    doubled = indices.clone()
    doubled[10] = doubled[11]  # the copy row 10 named is named by no row, row 11's copy by two
    got = ext.scan_scatter(x, doubled, weights, top_k).cpu().double()
    row_11_wins, row_10_wins = doubled.clone(), doubled.clone()
    row_11_wins[10] = -1
    row_10_wins[11] = -1
    assert any(
        torch.allclose(got, _scatter_oracle(x, ids, weights, top_k), rtol=1e-5, atol=1e-5)
        for ids in (row_11_wins, row_10_wins)
    )


REFUSED_CALLS = {
    "scan_scatter past its rows": (
        "ext.scan_scatter(torch.zeros(4097, 8, device='cuda'), "
        "torch.arange(4097, device='cuda', dtype=torch.int32), None, 1)",
        "at most 4096 rows, not 4097",
    ),
    "scan_scatter of a partial token": (
        "ext.scan_scatter(torch.zeros(10, 8, device='cuda'), "
        "torch.arange(10, device='cuda', dtype=torch.int32), None, 3)",
        "whole tokens",
    ),
    "scan_scatter of integer rows": (
        "ext.scan_scatter(torch.zeros(4, 8, device='cuda', dtype=torch.int32), "
        "torch.arange(4, device='cuda', dtype=torch.int32), None, 1)",
        "unsupported dtype",
    ),
    "sort of float keys": (
        "ext.sort(torch.zeros(8, device='cuda'), 4)",
        "expected int16, int32 or int64",
    ),
    "route_one_block of no experts": (
        "ext.route_one_block(torch.zeros(8, device='cuda', dtype=torch.int32), 0, 4)",
        "num_experts must lie in",
    ),
}


@pytest.mark.parametrize("what", list(REFUSED_CALLS))
def test_the_extension_refuses_bad_arguments_with_an_error(ext, what):
    """A direct call of the extension with arguments it cannot take raises RuntimeError with its
    reason (a failing TORCH_CHECK crashed the process on one torch build: csrc/check.h). In a
    child process, so that a crash fails this test only."""
    call, reason = REFUSED_CALLS[what]
    code = (
        "import torch\n"
        "from megablocks_cuda import extension\n"
        "ext = extension.load()\n"
        "try:\n"
        f"    {call}\n"
        "    print('accepted')\n"
        "except RuntimeError as error:\n"
        "    print('RuntimeError:', error)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.startswith("RuntimeError:") and reason in done.stdout, done.stdout


def _loop_gmm(a, b, sizes, trans_b):
    out, start = [], 0
    for e, s in enumerate(sizes.tolist()):
        w = b[e].double().t() if trans_b else b[e].double()
        out.append(a[start : start + s].double() @ w)
        start += s
    return torch.cat(out)


def _loop_wgrad(a, grad, sizes):
    out, start = [], 0
    for s in sizes.tolist():
        out.append(a[start : start + s].double().t() @ grad[start : start + s].double())
        start += s
    return torch.stack(out)


def _providers():
    from megablocks_cuda import gmm, plugin

    found = [("grouped_mm", gmm.grouped_mm_gmm, gmm.grouped_mm_gmm_weight_grad)]
    if gmm.grouped_gemm_backend() is not None:
        found.append(("grouped_gemm", gmm.grouped_gemm_gmm, gmm.grouped_gemm_gmm_weight_grad))
    info = __import__("megablocks_core.devices", fromlist=["describe"]).describe("cuda:0")
    if plugin.grouped_mm_capability(info) is not None:
        found = found[1:]
    return found


@pytest.mark.parametrize(
    "m,k,n,experts", [(512, 256, 384, 8), (300, 72, 40, 5), (256, 100, 36, 4), (0, 64, 64, 3)]
)
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("device_sizes", [False, True])
def test_gmm_providers(m, k, n, experts, trans_b, device_sizes):
    g = torch.Generator().manual_seed(m + k + n)
    sizes = torch.zeros(experts, dtype=torch.int64)
    if m:
        sizes[1:] = torch.multinomial(
            torch.ones(experts - 1), m, replacement=True, generator=g
        ).bincount(minlength=experts - 1)
    assert int(sizes.sum()) == m and sizes[0] == 0  # expert 0 is empty
    a = torch.randn(m, k, generator=g).to(DEV, torch.bfloat16)
    b = torch.randn(experts, *((n, k) if trans_b else (k, n)), generator=g).to(DEV, torch.bfloat16)
    grad = torch.randn(m, n, generator=g).to(DEV, torch.bfloat16)
    bs = sizes.to(DEV, torch.int32) if device_sizes else sizes
    for name, fwd, wgrad in _providers():
        out = fwd(a, b, bs, trans_b)
        assert out.dtype == torch.bfloat16 and out.shape == (m, n), name
        if m:
            torch.testing.assert_close(
                out.double(), _loop_gmm(a, b, sizes, trans_b), rtol=2e-2, atol=5e-2 * k**0.5
            )
        wg = wgrad(a, grad, bs)
        assert wg.shape == (experts, k, n), name
        assert torch.equal(wg[0], torch.zeros_like(wg[0])), f"{name}: empty expert not exactly 0"
        if m:
            want = _loop_wgrad(a, grad, sizes)
            torch.testing.assert_close(wg.double(), want, rtol=2e-2, atol=5e-2 * m**0.5)


def test_grouped_mm_has_no_host_sync():
    from megablocks_cuda import gmm

    a = torch.randn(256, 64, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(4, 64, 32, device=DEV, dtype=torch.bfloat16)
    sizes = torch.tensor([0, 100, 56, 100], device=DEV, dtype=torch.int32)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        gmm.grouped_mm_gmm(a, b, sizes, False)
        gmm.grouped_mm_gmm_weight_grad(
            a, torch.randn(256, 32, device=DEV, dtype=torch.bfloat16), sizes
        )
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_routing_ops_have_no_host_sync(ext):
    from megablocks_cuda import routing

    x = _keys(4096, 64, torch.int32)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        routing.sort(x, 6)
        routing.sort_one_block(x, 6)
        routing.route_one_block(x, 64, 128)
        counts = routing.histogram(x, 64)
        bins = routing.inclusive_cumsum(counts, 0)
        routing.exclusive_cumsum(counts, 0)
        routing.replicate(torch.randn(1, 64, device=DEV), bins, 4096)
        routing.replicate_backward(torch.randn(1, 4096, device=DEV), bins)
        routing.topology(bins * 0 + 128, 128, 1, 2)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_conformance_kit(ext):
    from megablocks_core import testing

    results = testing.check(["cuda"], device="cuda:0", quick=True)
    failures = [r for r in results if r.status == "fail"]
    assert not failures, [r.message for r in failures]
    assert any(r.backend == "cuda" and r.status == "pass" for r in results)


_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.skipif(not _SM90, reason="torch._scaled_grouped_mm's provider serves compute 9.x")
@pytest.mark.parametrize("sizes", [[700, 0, 513, 811], [2048, 0, 0, 0], [0, 0, 0, 0]])
def test_scaled_grouped_mm_against_a_float64_loop(sizes):
    """The provider's scaled_gmm against the dequantized operands multiplied in float64: uneven
    and empty groups, rows past the groups (zero), device-side sizes; and ranking sends it this
    call (4 experts, k, n >= 2048, 512 rows per expert)."""
    from megablocks_cuda import gmm

    import megablocks_core.ops as ops
    from megablocks_core import formats
    from megablocks_core.contracts import BY_NAME
    from megablocks_core.dispatch import describe_call, explain, explain_call

    experts, k, n, rows = 4, 2048, 2048, 2048 + 64  # 64 rows past the groups
    g = torch.Generator(device=DEV).manual_seed(sum(sizes))
    a = torch.randn(rows, k, device=DEV, generator=g)
    w = torch.randn(experts, n, k, device=DEV, generator=g) / k**0.5
    rowwise = formats.FORMATS["fp8_rowwise"]
    qa, sa = formats.quantize(a, rowwise.block(2, 1), formats.E4M3FN, False)
    qb, sb = formats.quantize(w, rowwise.block(3, 2), formats.E4M3FN, False)
    batch_sizes = torch.tensor(sizes, dtype=torch.int32, device=DEV)
    out = gmm.scaled_grouped_mm_gmm(qa, sa, qb, sb, batch_sizes, True, "fp8_rowwise", None)
    da = formats.dequantize(qa, sa, rowwise.block(2, 1)).double()
    db = formats.dequantize(qb, sb, rowwise.block(3, 2)).double()
    want = torch.zeros(rows, n, dtype=torch.float64, device=DEV)
    start = 0
    for e, size in enumerate(sizes):
        want[start : start + size] = da[start : start + size] @ db[e].T
        start += size
    assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
    scale = max(want.abs().max().item(), 1e-30)
    assert (out.double() - want).abs().max().item() <= 2**-7 * scale  # bf16 output
    assert not out[start:].any()  # rows past the groups
    args = (qa, sa, qb, sb, batch_sizes, True, "fp8_rowwise", "bfloat16")
    trace = explain("scaled_gmm", qa.device, {"a": qa.dtype, "b": qb.dtype})
    kernel, why = explain_call(trace, describe_call(BY_NAME["scaled_gmm"], args))
    assert kernel is not None and kernel.variant == "scaled_grouped_mm", why
    assert torch.equal(ops.scaled_gmm(*args), out)
