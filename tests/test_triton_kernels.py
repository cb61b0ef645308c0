"""Triton routing and permutation kernels (megablocks_triton) against the numpy oracle (oracle.py).

Runs the kernels under the Triton interpreter on the CPU (TRITON_INTERPRET=1, the default without
a GPU: see conftest.py), so every shape is tiny; the cases aim at the edges instead: zero tokens,
empty experts, one expert, E=256, top_k 1..8, hidden 1 and hidden spanning several blocks,
int16/32/64 indices, bf16/fp16/fp32 data.
"""

from __future__ import annotations

import inspect
import os

import numpy as np
import oracle
import pytest
import torch
from triton_interpreter import interpreting

triton = pytest.importorskip("triton")

import megablocks_triton  # noqa: E402
from launch_paths import LargeCallPaths  # noqa: E402
from megablocks_triton import config  # noqa: E402
from megablocks_triton import permutation as P  # noqa: E402
from megablocks_triton import routing as R  # noqa: E402

#: Where the kernels run: the CPU under the interpreter, else the GPU. On a GPU machine
#: ``TRITON_INTERPRET=0 pytest tests/test_triton_kernels.py`` (the default there) checks the
#: compiled kernels with the same cases; MEGABLOCKS_TRITON_TEST_DEVICE overrides the choice.
DEVICE = torch.device(
    os.environ.get("MEGABLOCKS_TRITON_TEST_DEVICE", "cpu" if interpreting() else "cuda")
)
_RUNNABLE = interpreting() if DEVICE.type == "cpu" else torch.cuda.is_available()
pytestmark = pytest.mark.skipif(
    not _RUNNABLE,
    reason=f"kernels on {DEVICE}: CPU tensors need TRITON_INTERPRET=1, GPU tensors a GPU",
)


class _OnDevice:
    """megablocks_triton with tensor arguments moved to DEVICE and results back to the CPU; an
    argument the kernel writes in place (activation_backward's grad) is copied back too."""

    def __init__(self, module: object) -> None:
        self._module = module

    def __getattr__(self, name: str) -> object:
        fn = getattr(self._module, name)
        if not inspect.isfunction(fn) or name in ("launch_configs", "set_launch_configs"):
            return fn

        def call(*args: object) -> object:
            moved = [a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args]
            out = fn(*moved)
            for a, m in zip(args, moved, strict=True):
                if isinstance(a, torch.Tensor) and m is not a:
                    a.copy_(m)
            if isinstance(out, tuple):
                return tuple(o.cpu() for o in out)
            return out.cpu()

        return call


mt = _OnDevice(megablocks_triton)


@pytest.fixture(params=["default", "large-call"])
def launch_paths(request: pytest.FixtureRequest) -> object:
    """Each test using it runs under the default launch policy and under :class:`LargeCallPaths`
    (for these tiny shapes: the paths the default takes only for large calls)."""
    if request.param == "default":
        yield
        return
    with config.use_launch_configs(LargeCallPaths()):
        yield


INTS = (torch.int16, torch.int32, torch.int64)
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-2, 2e-2), torch.float16: (2e-3, 2e-3)}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _close(got: torch.Tensor, ref: np.ndarray, dtype: torch.dtype) -> None:
    assert got.dtype == dtype
    atol, rtol = TOL[dtype]
    np.testing.assert_allclose(got.float().numpy(), ref, atol=atol, rtol=rtol)


# =========================================================================== routing


@pytest.mark.parametrize(
    ("n", "num_experts", "block_size", "dtype", "used"),
    [
        (0, 8, 4, torch.int32, 8),
        (1, 1, 1, torch.int32, 1),
        (300, 1, 8, torch.int64, 1),  # one expert
        (500, 7, 4, torch.int16, 3),  # most experts empty
        (200, 64, 16, torch.int16, 40),  # few keys: one program (the default's small-call path)
        (3000, 256, 128, torch.int32, 256),  # E=256, several tiles
        (2000, 64, 16, torch.int64, 20),
        (
            9000,
            64,
            128,
            torch.int32,
            64,
        ),  # > 4096 keys, >= 64 experts: the prescanned 3-launch path
        (20000, 256, 128, torch.int64, 200),
    ],
)
def test_route(
    n: int, num_experts: int, block_size: int, dtype: torch.dtype, used: int, launch_paths: object
) -> None:
    g = _gen(n + num_experts)
    pool = torch.randperm(num_experts, generator=g)[:used]
    keys = pool[torch.randint(0, used, (n,), generator=g)].to(dtype)
    indices, bin_ids, tpe, bins, padded = mt.route(keys, num_experts, block_size)
    order, sorted_keys, counts, ends, padded_ends = oracle.route(
        keys.numpy(), num_experts, block_size
    )
    assert indices.dtype == dtype and bin_ids.dtype == dtype
    assert tpe.dtype == bins.dtype == padded.dtype == torch.int32
    np.testing.assert_array_equal(indices.numpy(), order)
    np.testing.assert_array_equal(bin_ids.numpy(), sorted_keys)
    np.testing.assert_array_equal(tpe.numpy(), counts)
    np.testing.assert_array_equal(bins.numpy(), ends)
    np.testing.assert_array_equal(padded.numpy(), padded_ends)


def test_route_matches_separate_ops() -> None:
    keys = torch.randint(0, 12, (700,), generator=_gen(3), dtype=torch.int32)
    indices, bin_ids, tpe, bins, _ = mt.route(keys, 12, 8)
    sorted_keys, order = mt.sort(keys, 4)
    assert torch.equal(indices, order) and torch.equal(bin_ids, sorted_keys)
    assert torch.equal(tpe, mt.histogram(keys, 12))
    assert torch.equal(bins, mt.inclusive_cumsum(tpe, 0))


@pytest.mark.parametrize("n", [200, 600])  # one program by default, or several tiles
@pytest.mark.parametrize("dtype", INTS)
@pytest.mark.parametrize("end_bit", [0, 1, 4, 8, 10, 13, 16, None])
def test_sort(n: int, end_bit: int | None, dtype: torch.dtype, launch_paths: object) -> None:
    g = _gen(end_bit or 0)
    if end_bit is None:  # full width: negative keys too
        info = torch.iinfo(dtype)
        x = torch.randint(
            max(info.min, -(2**20)), min(info.max, 2**20), (n,), generator=g, dtype=dtype
        )
    else:
        x = torch.randint(
            0, min(2**end_bit, torch.iinfo(dtype).max), (n,), generator=g, dtype=dtype
        )
    values, indices = mt.sort(x, end_bit)
    ref_values, ref_indices = oracle.sort(x.numpy(), end_bit)
    assert values.dtype == indices.dtype == dtype
    np.testing.assert_array_equal(indices.numpy(), ref_indices)
    np.testing.assert_array_equal(values.numpy(), ref_values)


def _stable_route(keys: np.ndarray, num_experts: int, block_size: int) -> tuple[np.ndarray, ...]:
    """route's outputs from a stable argsort in which ids outside [0, num_experts) sort after
    every valid id, in input order (the contract for bad ids), and a counting loop."""
    wide = keys.astype(np.int64)
    valid = (wide >= 0) & (wide < num_experts)
    order = np.argsort(np.where(valid, wide, num_experts), kind="stable")
    counts = np.zeros(num_experts, dtype=np.int64)
    for k in wide[valid]:
        counts[k] += 1
    padded = -(-counts // block_size) * block_size
    return order, keys[order], counts, np.cumsum(counts), np.cumsum(padded)


@pytest.mark.parametrize(
    ("n", "num_experts", "dtype", "stray_every"),
    [
        (1, 1, torch.int32, 0),
        (63, 1, torch.int64, 0),  # one expert, one partial tile
        (130, 7, torch.int16, 5),  # three tiles, the last partial; strays in each
        (1500, 64, torch.int32, 97),  # 24 tiles, keys in two counting steps of 1024
        (1024, 128, torch.int32, 0),  # the layer's shape at 128 tokens, top_k 8
    ],
)
def test_route_recounting_tiles(
    n: int, num_experts: int, dtype: torch.dtype, stray_every: int
) -> None:
    """route and sort on the one-launch path whose tile programs count every key themselves
    (tests/launch_paths.py RecountPaths), out-of-range ids included."""
    from launch_paths import RecountPaths

    keys = torch.randint(0, num_experts, (n,), generator=_gen(n), dtype=torch.int64)
    if stray_every:  # negative and too-large ids spread over the tiles
        keys[::stray_every] = -1
        keys[3::stray_every] = num_experts + 2
    keys = keys.to(dtype)
    with config.use_launch_configs(RecountPaths()):
        routed = mt.route(keys, num_experts, 8)
        if not stray_every:
            end_bit = max((num_experts - 1).bit_length(), 1)
            sorted_keys, order = mt.sort(keys, end_bit)
    want = _stable_route(keys.numpy(), num_experts, 8)
    for got, ref in zip(routed, want, strict=True):
        np.testing.assert_array_equal(got.numpy(), ref)
    if not stray_every:
        np.testing.assert_array_equal(order.numpy(), want[0])
        np.testing.assert_array_equal(sorted_keys.numpy(), want[1])


@pytest.mark.parametrize("n", [8, 1024, 3000])  # one program, recounting tiles, count table
def test_routing_outputs_do_not_share_storage(n: int) -> None:
    """The outputs of route and sort are separate tensors (a custom op's outputs may not alias:
    torch.compile and torch.library.opcheck rely on it)."""
    keys = torch.randint(0, 16, (n,), generator=_gen(n), dtype=torch.int32).to(DEVICE)
    for outputs in (R.route(keys, 16, 4), R.sort(keys, 4)):
        storages = {o.untyped_storage().data_ptr() for o in outputs}
        assert len(storages) == len(outputs)


@pytest.mark.parametrize("n", [0, 1])
def test_sort_tiny(n: int) -> None:
    x = torch.zeros(n, dtype=torch.int32)
    values, indices = mt.sort(x, 3)
    assert values.shape == indices.shape == (n,)
    np.testing.assert_array_equal(indices.numpy(), np.arange(n))


@pytest.mark.parametrize("dtype", INTS)
@pytest.mark.parametrize(
    ("shape", "num_bins"),
    [((0,), 5), ((1,), 1), ((777,), 9), ((3, 400), 256), ((2, 300), 5000), ((4,), 0)],
)
def test_histogram(
    shape: tuple[int, ...], num_bins: int, dtype: torch.dtype, launch_paths: object
) -> None:
    hi = max(num_bins, 1) + 3
    x = torch.randint(-3, hi, shape, generator=_gen(num_bins), dtype=torch.int64)
    if dtype == torch.int64 and x.numel():
        x.view(-1)[0] = 2**40 + 1  # would wrap into range if narrowed before the range test
    x = x.to(dtype) if dtype != torch.int64 else x
    out = mt.histogram(x, num_bins)
    assert out.dtype == torch.int32 and out.shape == (*shape[:-1], num_bins)
    np.testing.assert_array_equal(out.numpy(), oracle.histogram(x.numpy(), num_bins))


@pytest.mark.parametrize("dtype", INTS)
@pytest.mark.parametrize(
    ("shape", "dim"),
    [((1,), 0), ((9,), 0), ((3000,), -1), ((4, 7), 0), ((4, 7), 1), ((5, 3), -1), ((0,), 0)],
)
def test_cumsum(shape: tuple[int, ...], dim: int, dtype: torch.dtype) -> None:
    x = torch.randint(0, 20, shape, generator=_gen(len(shape)), dtype=dtype)
    inc = mt.inclusive_cumsum(x, dim)
    exc = mt.exclusive_cumsum(x, dim)
    for got, want in (
        (inc, oracle.inclusive_cumsum(x.numpy(), dim)),
        (exc, oracle.exclusive_cumsum(x.numpy(), dim)),
    ):
        assert got.dtype == dtype and got.shape == x.shape
        np.testing.assert_array_equal(got.numpy(), want)


@pytest.mark.parametrize("counts", [[3, 0, 5, 1], [0, 0, 4], [7], [1] * 40])
def test_topology(counts: list[int]) -> None:
    bs, cols = 2, 3
    padded = np.cumsum([-(-c // bs) * bs for c in counts])
    rows = int(padded[-1]) // bs
    out = mt.topology(torch.tensor(padded, dtype=torch.int32), bs, rows, cols)
    assert out.dtype == torch.int16
    np.testing.assert_array_equal(
        out.numpy(), oracle.topology(padded, bs, rows, cols).astype(np.int16)
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32, torch.int16])
def test_replicate(dtype: torch.dtype) -> None:
    counts = [2, 0, 3, 1, 0]
    bins = np.cumsum(counts)
    x = (torch.randn(3, len(counts), generator=_gen(0)) * 10).to(dtype)
    out = mt.replicate(x, torch.tensor(bins, dtype=torch.int64), int(bins[-1]))
    assert out.dtype == dtype
    np.testing.assert_array_equal(
        out.double().numpy(), oracle.replicate(x.double().numpy(), bins, int(bins[-1]))
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_replicate_backward(dtype: torch.dtype) -> None:
    counts = [300, 0, 5, 1]  # one bin longer than the kernel's block
    bins = np.cumsum(counts)
    grad = torch.randn(2, int(bins[-1]), generator=_gen(1)).to(dtype)
    out = mt.replicate_backward(grad, torch.tensor(bins, dtype=torch.int32))
    _close(out, oracle.replicate_backward(grad.double().numpy(), bins), dtype)
    assert out[:, 1].eq(0).all()  # an empty bin is exactly 0


@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "dtype", "softmax"),
    [
        (0, 8, 2, torch.float32, True),
        (7, 1, 1, torch.float16, False),  # one expert
        (37, 128, 8, torch.float32, True),  # qwen3's router, rows spanning several programs
        (19, 9, 9, torch.bfloat16, True),  # top_k = experts, not a power of two
        (5, 300, 6, torch.float32, False),
        (3, 5000, 8, torch.float32, True),  # one row per program (8192 lanes)
    ],
)
def test_router_topk(
    tokens: int, experts: int, top_k: int, dtype: torch.dtype, softmax: bool
) -> None:
    # Quarter steps: equal scores in every row; a NaN, an all -inf row, +inf, -0.0 beside 0.0.
    s = (torch.randn(tokens, experts, generator=_gen(tokens + experts)) * 4).round() / 4
    if tokens >= 4 and experts >= 3:
        s[0, experts - 1] = float("nan")
        s[1] = float("-inf")
        s[2, 1] = float("inf")
        s[3, :2] = torch.tensor([-0.0, 0.0])
    scores = s.to(dtype)
    weights, ids = mt.router_topk(scores, top_k, softmax)
    want_w, want_e = oracle.router_topk(scores.double().numpy(), top_k, softmax)
    assert ids.dtype == torch.int32 and ids.shape == (tokens, top_k)
    np.testing.assert_array_equal(ids.numpy(), want_e)
    _close(weights, want_w, dtype)


def test_router_topk_past_its_expert_limit_goes_to_the_next_backend() -> None:
    experts = R.MAX_TOPK_EXPERTS + 1
    scores = torch.randn(3, experts, generator=_gen(5)).to(DEVICE)
    assert "more than the 8192" in R.router_topk_supports(None, {"scores": scores})
    with pytest.raises(ValueError, match="more than the 8192"):
        R.router_topk(scores, 4, True)  # called directly: refused, not wrong
    from megablocks_core import ops

    weights, ids = ops.router_topk(scores, 4, True)  # through the core: another backend serves
    want_w, want_e = oracle.router_topk(scores.double().cpu().numpy(), 4, True)
    np.testing.assert_array_equal(ids.cpu().numpy(), want_e)
    _close(weights.cpu(), want_w, torch.float32)


def test_router_topk_non_contiguous_scores() -> None:
    wide = torch.randn(12, 64, generator=_gen(3)).to(DEVICE)
    scores = wide[:, ::2]  # row stride 64, column stride 2 (sliced on DEVICE: .to would compact it)
    assert scores.stride() == (64, 2)
    weights, ids = megablocks_triton.router_topk(scores, 4, True)
    want_w, want_e = oracle.router_topk(scores.double().cpu().numpy(), 4, True)
    np.testing.assert_array_equal(ids.cpu().numpy(), want_e)
    _close(weights.cpu(), want_w, torch.float32)


# =========================================================================== permutation


class Routed:
    """One routing of T tokens (top_k each) over E experts, as tensors and as numpy arrays."""

    def __init__(
        self,
        T: int,
        K: int,
        E: int,
        H: int,
        dtype: torch.dtype,
        idx_dtype: torch.dtype,
        w_dtype: torch.dtype | None,
        seed: int,
        block: int = 4,
    ) -> None:
        g = _gen(seed)
        self.T, self.K, self.E, self.H, self.dtype = T, K, E, H, dtype
        used = torch.randperm(E, generator=g)[: max(1, (E + 1) // 2)]  # leave experts empty
        top = used[torch.randint(0, used.numel(), (T * K,), generator=g)]
        order = np.argsort(top.numpy(), kind="stable")
        self.flat = order  # flat id of sorted row i
        self.expert = top.numpy()[order]
        counts = np.bincount(top.numpy(), minlength=E)
        pcounts = -(-counts // block) * block
        self.bins_np, self.padded_bins_np = np.cumsum(counts), np.cumsum(pcounts)
        self.x = torch.randn(T, H, generator=g).to(dtype)
        self.grad = torch.randn(T, H, generator=g).to(dtype)
        self.w = None if w_dtype is None else torch.rand(T * K, generator=g).to(w_dtype)
        self.indices = torch.tensor(order).to(idx_dtype)
        self.bin_ids = torch.tensor(self.expert).to(idx_dtype)
        self.bins = torch.tensor(self.bins_np).to(idx_dtype)
        self.padded_bins = torch.tensor(self.padded_bins_np).to(idx_dtype)

    def np64(self, t: torch.Tensor | None) -> np.ndarray | None:
        """A tensor's exact values in float64 (None stays None)."""
        return None if t is None else t.double().numpy()

    @property
    def sorted_args(self) -> tuple[np.ndarray, np.ndarray]:
        """(indices, bin_ids) as numpy arrays: the oracle's routing arguments."""
        return self.flat, self.expert


CASES = [
    # T, K, E, H, dtype, idx dtype, weights dtype
    (6, 1, 4, 8, torch.float32, torch.int32, None),
    (5, 2, 3, 33, torch.bfloat16, torch.int16, torch.float32),
    (4, 8, 5, 1, torch.float16, torch.int64, torch.bfloat16),  # hidden 1, top_k 8
    (7, 3, 1, 70, torch.float32, torch.int32, torch.float32),  # one expert
    (3, 8, 4, 1100, torch.bfloat16, torch.int32, torch.float16),  # several H blocks, split H
    (9, 5, 6, 17, torch.float16, torch.int16, None),
    (0, 2, 4, 16, torch.bfloat16, torch.int32, torch.float32),  # zero tokens
]


def _ids(case: tuple) -> str:
    T, K, E, H, dt, it, wt = case
    w = "none" if wt is None else str(wt).split(".")[1]
    return f"T{T}-K{K}-E{E}-H{H}-{str(dt).split('.')[1]}-{str(it).split('.')[1]}-w{w}"


@pytest.fixture(params=CASES, ids=_ids)
def routed(request: pytest.FixtureRequest) -> Routed:
    return Routed(*request.param, seed=request.param_index)


def test_gather(routed: Routed, launch_paths: object) -> None:
    r = routed
    out = mt.gather(r.x, r.indices, r.bin_ids, r.w, r.bins, r.K)
    assert out.shape == (r.T * r.K, r.H)
    _close(out, oracle.gather(r.np64(r.x), *r.sorted_args, r.np64(r.w), r.bins_np, r.K), r.dtype)
    unweighted = mt.gather(r.x, r.indices, r.bin_ids, None, r.bins, r.K)
    for i, f in enumerate(r.flat):  # a plain copy is exact
        assert torch.equal(unweighted[i], r.x[f // r.K])


def test_scatter(routed: Routed, launch_paths: object) -> None:
    r = routed
    rows = torch.randn(r.T * r.K, r.H, generator=_gen(5)).to(r.dtype)
    out = mt.scatter(rows, r.indices, r.bin_ids, r.w, r.bins, r.K)
    _close(out, oracle.scatter(r.np64(rows), *r.sorted_args, r.np64(r.w), r.bins_np, r.K), r.dtype)


def _close_wgrad(got: torch.Tensor, ref: np.ndarray, r: Routed) -> None:
    """A weight gradient is a dot product over hidden: its error grows with sqrt(hidden)."""
    atol, rtol = TOL[r.dtype]
    np.testing.assert_allclose(
        got.float().numpy(), ref, atol=atol * max(r.H, 1) ** 0.5 * 4, rtol=rtol
    )


def test_scatter_wgrad(routed: Routed) -> None:
    r = routed
    rows = torch.randn(r.T * r.K, r.H, generator=_gen(6)).to(r.dtype)
    out = mt.scatter_wgrad(rows, r.grad, r.indices, r.bin_ids, r.bins, r.K)
    assert out.shape == (r.T * r.K,)
    _close_wgrad(
        out, oracle.scatter_wgrad(r.np64(rows), r.np64(r.grad), *r.sorted_args, r.bins_np, r.K), r
    )


def test_padded(routed: Routed) -> None:
    r = routed
    out = mt.padded_gather(r.x, r.indices, r.bin_ids, r.w, r.bins, r.padded_bins, r.K)
    rows = int(r.padded_bins[-1])
    assert out.shape == (rows, r.H)
    # padding rows stay exactly zero (the oracle leaves them 0)
    ref = oracle.padded_gather(
        r.np64(r.x), *r.sorted_args, r.np64(r.w), r.bins_np, r.padded_bins_np, r.K
    )
    _close(out, ref, r.dtype)

    prow = torch.randn(rows, r.H, generator=_gen(7)).to(r.dtype)
    back = mt.padded_scatter(prow, r.indices, r.bin_ids, r.w, r.bins, r.padded_bins, r.K)
    _close(
        back,
        oracle.padded_scatter(
            r.np64(prow), *r.sorted_args, r.np64(r.w), r.bins_np, r.padded_bins_np, r.K
        ),
        r.dtype,
    )

    wg = mt.padded_scatter_wgrad(prow, r.grad, r.indices, r.bin_ids, r.bins, r.padded_bins, r.K)
    _close_wgrad(
        wg,
        oracle.padded_scatter_wgrad(
            r.np64(prow), r.np64(r.grad), *r.sorted_args, r.bins_np, r.padded_bins_np, r.K
        ),
        r,
    )


@pytest.mark.parametrize("cap", [0, 2, 64])  # no room, dropping most, room for all
def test_binned(routed: Routed, cap: int) -> None:
    r = routed
    out = mt.binned_gather(r.x, r.indices, r.w, r.bins, cap, r.K)
    assert out.shape == (r.E, cap, r.H)
    ref = oracle.binned_gather(r.np64(r.x), r.flat, r.np64(r.w), r.bins_np, cap, r.K)
    _close(out, ref, r.dtype)

    binned = torch.randn(r.E, cap, r.H, generator=_gen(8)).to(r.dtype)
    back = mt.binned_scatter(binned, r.indices, r.w, r.bins, r.K)
    _close(
        back, oracle.binned_scatter(r.np64(binned), r.flat, r.np64(r.w), r.bins_np, r.K), r.dtype
    )

    wg = mt.binned_scatter_wgrad(binned, r.grad, r.indices, r.bins, r.K)
    _close_wgrad(
        wg, oracle.binned_scatter_wgrad(r.np64(binned), r.np64(r.grad), r.flat, r.bins_np, r.K), r
    )
    kept = {int(r.flat[i]) for _, _, i in oracle.binned_slots(r.bins_np, cap)}
    dropped = [f for f in range(r.T * r.K) if f not in kept]
    assert wg[dropped].eq(0).all()  # dropped copies: exactly 0


def test_weights_any_float_dtype() -> None:
    r = Routed(4, 2, 3, 5, torch.float32, torch.int32, torch.float64, seed=11)
    out = mt.scatter(
        mt.gather(r.x, r.indices, r.bin_ids, None, r.bins, r.K),
        r.indices,
        r.bin_ids,
        r.w,
        r.bins,
        r.K,
    )
    w = r.np64(r.w)
    ref = np.stack(
        [sum(w[t * r.K + k] for k in range(r.K)) * r.x[t].double().numpy() for t in range(r.T)]
    )
    _close(out, ref, torch.float32)


# =========================================================================== activation


@pytest.mark.parametrize("activation", [None, "gelu", "silu", "relu"])
@pytest.mark.parametrize(
    ("rows", "n", "dtype"),
    [
        (0, 8, torch.float32),  # no rows
        (5, 0, torch.float32),  # no columns
        (5, 1, torch.float32),
        (37, 24, torch.float32),
        (3, 5, torch.float16),  # rows not 16-byte aligned
        (9, 600, torch.float32),  # two column blocks
        (70, 8, torch.bfloat16),  # several row blocks
    ],
)
def test_glu(rows: int, n: int, dtype: torch.dtype, activation: str | None) -> None:
    x = (torch.randn(rows, 2 * n, generator=_gen(rows + n)) * 3).to(dtype)
    grad = torch.randn(rows, n, generator=_gen(7)).to(dtype)
    x64, grad64 = x.double().numpy(), grad.double().numpy()
    _close(mt.glu(x, activation), oracle.glu(x64, activation), dtype)
    got = mt.glu_backward(grad, x, activation)
    assert got.shape == x.shape
    _close(got, oracle.glu_backward(grad64, x64, activation), dtype)


@pytest.mark.parametrize(
    "activation", [None, "gelu", "silu", "relu", "geglu", "swiglu", "reglu", "bilinear"]
)
@pytest.mark.parametrize(
    ("rows", "n", "dtype", "scale_dtype"),
    [
        (0, 8, torch.float32, torch.float32),  # no rows
        (5, 0, torch.float32, None),  # no columns: dots 0
        (5, 1, torch.float32, torch.float32),
        (37, 24, torch.float32, None),
        (3, 5, torch.float16, torch.float32),  # rows not 16-byte aligned
        (9, 1100, torch.float32, torch.float16),  # three column steps, the last partial
        (70, 8, torch.bfloat16, torch.bfloat16),  # several row blocks
    ],
)
def test_activation_backward(
    rows: int, n: int, dtype: torch.dtype, scale_dtype: torch.dtype | None, activation: str | None
) -> None:
    width = 2 * n if activation in oracle.GATED else n  # a gated x: [gate | up]
    x = (torch.randn(rows, width, generator=_gen(rows + n)) * 3).to(dtype)
    grad = torch.randn(rows, n, generator=_gen(8)).to(dtype)
    scale = None if scale_dtype is None else torch.rand(rows, generator=_gen(9)).to(scale_dtype)
    act = grad.clone()  # act(x) is written over the gradient
    grad_x, dots = mt.activation_backward(act, x, scale, activation)
    assert grad_x.dtype == dots.dtype == dtype
    assert grad_x.shape == x.shape and dots.shape == (rows,)
    scale64 = None if scale is None else scale.double().numpy()
    want = oracle.activation_backward(
        grad.double().numpy(), x.double().numpy(), scale64, activation, dtype
    )
    _close(grad_x, want[0], dtype)
    _close(act, want[1], dtype)
    # The dots are of the act written (checked above: within a rounding of the oracle's) and grad,
    # summed in float32 and rounded to the data's dtype: compare with their float64 sum.
    exact = (act.double() * grad.double()).sum(dim=1).numpy() if n else np.zeros(rows)
    _close(dots, exact, dtype)


# =========================================================================== grouped GEMM


@pytest.mark.parametrize(
    ("dtype", "out_dtype"),
    [
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32),  # a float32 main_grad
        (torch.float16, torch.float16),
        (torch.float32, torch.float32),
    ],
    ids=str,
)
@pytest.mark.parametrize(("k", "n"), [(72, 40), (37, 20)], ids=["aligned", "unaligned"])
def test_gmm_weight_grad_accumulate(
    dtype: torch.dtype, out_dtype: torch.dtype, k: int, n: int
) -> None:
    """out[e] += a_e.T @ grad_e under the default launch policy (on Hopper: TMA loads and the
    TMA-reduction epilogue where the strides are 16-byte aligned, the plain kernel where not)
    against the float64 oracle; empty experts' NaN and -0.0 are left untouched."""
    from megablocks_triton import gmm

    sizes = [40, 0, 33, 1, 70, 0]
    rows = sum(sizes)
    info = gmm.device_info(DEVICE)
    if info.capability == (9, 0) and dtype != torch.float32:  # Hopper: the reduction is chosen
        cfg = gmm.choose_config("wgrad_accumulate", k, n, rows, len(sizes), dtype, info, out_dtype)
        assert cfg.use_tma and cfg.reduce_epilogue
    a = torch.randn(rows, k, generator=_gen(11)).to(dtype)
    grad = torch.randn(rows, n, generator=_gen(12)).to(dtype)
    before = torch.randn(len(sizes), k, n, generator=_gen(13)).to(out_dtype)
    before[1] = float("nan")
    before[5] = -0.0
    out = before.clone().to(DEVICE)  # (.to alone would alias before on the CPU)
    gmm.gmm_weight_grad_accumulate(a.to(DEVICE), grad.to(DEVICE), torch.tensor(sizes), out)
    got = out.cpu()
    assert torch.isnan(got[1]).all()
    assert (got[5] == 0).all() and torch.signbit(got[5]).all()
    want = before.double().numpy() + oracle.gmm_weight_grad(
        a.double().numpy(), grad.double().numpy(), sizes
    )
    full = [e for e, size in enumerate(sizes) if size]
    # A 16-bit gradient may be rounded twice (the product, then the sum), as the composition is.
    _close(got[full], want[full], out_dtype)


# =========================================================================== plugin


def test_plugin_descriptors() -> None:
    pytest.importorskip("megablocks_core")
    from megablocks_triton import plugin

    from megablocks_core import contracts
    from megablocks_core.descriptors import Kernel, Tier

    assert plugin.megablocks_unavailable_reason() is None  # interpreter or GPU here
    by_name = {c.name: c for c in contracts.ALL}
    kernels = [*plugin.megablocks_routing_kernels(), *plugin.megablocks_permutation_kernels()]
    assert {k.op for k in kernels} == set(plugin.ROUTING) | set(plugin.PERMUTATION)
    for k in kernels:
        assert isinstance(k, Kernel)
        assert k.tier == plugin.TIER == Tier.GENERIC_ACCELERATOR and k.contiguous
        assert k.devices == (("cuda", "rocm", "cpu") if interpreting() else ("cuda", "rocm"))
        # Positional arguments in the contract's order, and dtype keys naming real arguments.
        names = tuple(inspect.signature(k.fn).parameters)
        assert names == by_name[k.op].arg_names, k.op
        assert set(k.dtypes) <= set(names), k.op


def test_launch_config_is_overridable() -> None:
    base = mt.launch_configs()

    class Small(type(base)):  # type: ignore[misc]
        def permutation(self, num_tokens: int, hidden: int, top_k: int, element_size: int):
            cfg = super().permutation(num_tokens, hidden, top_k, element_size)
            return type(cfg)(block_h=2, split_h=3, zero_rows=2, num_warps=cfg.num_warps)

    r = Routed(3, 2, 3, 7, torch.float32, torch.int32, torch.float32, seed=12)
    mt.set_launch_configs(Small())
    try:
        out = mt.padded_gather(r.x, r.indices, r.bin_ids, r.w, r.bins, r.padded_bins, r.K)
    finally:
        mt.set_launch_configs(base)
    ref = _OnDevice(P).padded_gather(r.x, r.indices, r.bin_ids, r.w, r.bins, r.padded_bins, r.K)
    assert torch.equal(out, ref)
    assert R.MAX_COUNTING_BINS >= 256


def test_numpy_integer_arguments() -> None:
    """The core passes int-like arguments through unchanged; numpy ints must work as Python ints."""
    keys = torch.tensor([2, 0, 2, 1], dtype=torch.int32)
    assert mt.histogram(keys, np.int64(3)).tolist() == [1, 1, 2]
    assert mt.sort(keys, np.int64(2))[1].tolist() == [1, 3, 0, 2]
    assert mt.route(keys, np.int32(3), np.int64(2))[4].tolist() == [2, 4, 6]
    r = Routed(3, 2, 3, 4, torch.float32, torch.int32, None, seed=13)
    out = mt.binned_gather(r.x, r.indices, None, r.bins, np.int64(2), np.int64(r.K))
    assert out.shape == (3, 2, 4)
    assert mt.topology(
        torch.tensor([2, 4], dtype=torch.int32), np.int64(2), np.int64(2), np.int64(1)
    ).tolist() == [0, 1]
