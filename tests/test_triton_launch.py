"""The Triton fast launch path (``megablocks_triton.launch``) against Triton's own launch.

GPU only: on the CPU interpreter every launch goes through ``kernel[grid]`` unchanged (the
rest of the suite covers that path).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU (compiled Triton)"
)


@pytest.fixture(scope="module")
def kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def axpy(x_ptr, y_ptr, out_ptr, n, a, BLOCK: tl.constexpr, SQUARE: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        v = tl.load(x_ptr + i, mask=m) * a + tl.load(y_ptr + i, mask=m)
        if SQUARE:
            v = v * v
        tl.store(out_ptr + i, v, mask=m)

    return axpy


@pytest.mark.parametrize("n", [1, 16, 17, 1000])
@pytest.mark.parametrize("offset", [0, 1])  # 1: pointers not 16-byte aligned
@pytest.mark.parametrize("square", [False, True])
def test_fast_launch_matches_triton(kernel, n, offset, square):
    from megablocks_triton.launch import Launcher

    fast = Launcher(kernel)
    for dtype in (torch.float32, torch.float16):
        x = torch.randn(n + offset, device="cuda", dtype=dtype)[offset:]
        y = torch.randn(n + offset, device="cuda", dtype=dtype)[offset:]
        for a in (1.0, 2.5):
            want = torch.empty_like(x)
            kernel[(triton_cdiv(n, 128),)](x, y, want, n, a, BLOCK=128, SQUARE=square)
            for _ in range(3):  # first call compiles and caches, the next ones take the fast path
                got = torch.full_like(x, float("nan"))
                fast((triton_cdiv(n, 128),), x, y, got, n, a, BLOCK=128, SQUARE=square)
                torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert len(fast._cache) == 2  # one entry per dtype; a and the repeats share them


def test_fast_launch_keys_on_specialisation(kernel):
    """Calls Triton would compile differently (alignment, n == 1, n % 16) never share an entry."""
    from megablocks_triton.launch import Launcher

    fast = Launcher(kernel)
    base = torch.randn(64, device="cuda")
    out = torch.empty_like(base)
    for offset, n in [(0, 32), (1, 32), (0, 1), (0, 17), (0, 48)]:
        fast((1,), base[offset:], base[offset:], out[offset:], n, 1.0, BLOCK=64, SQUARE=False)
    # aligned/32, misaligned/32, aligned/1, aligned/17; 48 shares 32's specialisation
    assert len(fast._cache) == 4


def test_runtime_arguments_by_keyword_are_refused(kernel):
    from megablocks_triton.launch import Launcher

    x = torch.randn(8, device="cuda")
    with pytest.raises(TypeError, match="positionally"):
        Launcher(kernel)((1,), x, x, x, n=8, a=1.0, BLOCK=8, SQUARE=False)


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


# --------------------------------------------------------------------------- BoundLaunch


@pytest.mark.parametrize("square", [False, True])
def test_bound_launch_matches_triton(kernel, square):
    """Aligned calls take the pinned path, unaligned ones Triton's keyed one; all agree."""
    from megablocks_triton.launch import bind

    n = 1000
    grid = (triton_cdiv(n, 128),)
    bound = bind(kernel, grid, n, 2.5, BLOCK=128, SQUARE=square)
    base = torch.randn(3, n + 16, device="cuda")  # rows 16-byte aligned; offset 1 is not
    for offset in (0, 0, 1, 0, 1):  # pinned on the first aligned call, unaligned in between
        x, y = base[0, offset : offset + n], base[1, offset : offset + n]
        want = torch.empty_like(x)
        kernel[grid](x, y, want, n, 2.5, BLOCK=128, SQUARE=square)
        got = base[2, offset : offset + n].fill_(float("nan"))
        bound(x, y, got)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert bound.pinned is not None


def test_bound_launch_uses_the_native_launch_on_triton_3_6(kernel):
    import triton
    from megablocks_triton.launch import bind

    bound = bind(kernel, (1,), 8, 1.0, BLOCK=8, SQUARE=False)
    x = torch.ones(8, device="cuda")
    out = torch.empty_like(x)
    bound(x, x, out)
    bound(x, x, out)
    torch.testing.assert_close(out, torch.full_like(x, 2.0))
    assert bound.pinned == ("native" if triton.__version__.startswith("3.6.") else "launcher")


def test_bound_launch_goes_through_triton_when_hooks_are_installed(kernel):
    import triton
    from megablocks_triton.launch import bind

    bound = bind(kernel, (1,), 8, 1.0, BLOCK=8, SQUARE=False)
    x = torch.ones(8, device="cuda")
    out = torch.empty_like(x)
    bound(x, x, out)  # pinned
    seen = []

    def hook(metadata):
        seen.append(metadata)

    triton.knobs.runtime.launch_enter_hook.add(hook)
    try:
        out.zero_()
        bound(x, x, out)
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(hook)
    torch.testing.assert_close(out, torch.full_like(x, 2.0))
    assert len(seen) == 1


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64, torch.int16])
def test_prepared_launches_are_kept_per_dtype(index_dtype):
    """Calls of one shape but other dtypes (indices, weights, keys) never share a compiled
    kernel: the per-shape launches are keyed on every input's dtype."""
    from megablocks_reference import kernels as reference
    from megablocks_triton import permutation, routing

    tokens, hidden, experts, top_k = 64, 96, 8, 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    top = torch.randint(0, experts, (tokens * top_k,), device="cuda", generator=gen)
    x = torch.randn(tokens, hidden, device="cuda", generator=gen).bfloat16()
    for dtype in (torch.int32, index_dtype, torch.int64, torch.int32):
        keys = top.to(dtype)
        bin_ids, indices = routing.sort(keys, 3)
        want_ids, want_idx = reference.sort(keys, 3)
        assert torch.equal(bin_ids, want_ids) and torch.equal(indices, want_idx)
        routed = routing.route(keys, experts, 16)
        for got, want in zip(routed, reference.route(keys, experts, 16), strict=True):
            assert got.dtype == want.dtype and torch.equal(got, want)
        bins = routed[3]
        assert torch.equal(routing.histogram(keys, experts), reference.histogram(keys, experts))
        probs = torch.rand(tokens * top_k, device="cuda", generator=gen)
        # No weights, then weights of two dtypes, then none again: four launches of one shape.
        for weights in (None, probs, probs.bfloat16(), None):
            rows = permutation.gather(x, indices, bin_ids, weights, bins, top_k)
            want_rows = reference.gather(x, indices, bin_ids, weights, bins, top_k)
            torch.testing.assert_close(rows, want_rows, rtol=1e-2, atol=1e-2)
            out = permutation.scatter(rows, indices, bin_ids, weights, bins, top_k)
            want = reference.scatter(rows, indices, bin_ids, weights, bins, top_k)
            torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2)
