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
