"""The Triton fast launch path (``megablocks_triton.launch``) against Triton's own launch.

Mostly GPU only: on the CPU interpreter every launch goes through ``kernel[grid]`` unchanged (the
rest of the suite covers that path). The descriptor launch's argument handling is also checked on
the CPU, against Triton 3.6's own descriptor wrapper driving a stand-in native launch.
"""

from __future__ import annotations

import pytest
import torch

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (compiled Triton)")


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


@gpu
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


@gpu
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


@gpu
def test_runtime_arguments_by_keyword_are_refused(kernel):
    from megablocks_triton.launch import Launcher

    x = torch.randn(8, device="cuda")
    with pytest.raises(TypeError, match="positionally"):
        Launcher(kernel)((1,), x, x, x, n=8, a=1.0, BLOCK=8, SQUARE=False)


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


# --------------------------------------------------------------------------- BoundLaunch


@gpu
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


@gpu
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


@gpu
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


@gpu
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


# --------------------------------------------------------------------------------------------
# DescriptorLaunch (TMA descriptors): CPU checks of the argument handling


def test_launcher_key_records_what_triton_specialises_a_descriptor_on():
    """A host-side descriptor is specialised on its dtype and block shape: those change the key,
    its base address, shape and strides (runtime arguments) do not."""
    from megablocks_triton.launch import _key
    from triton.tools.tensor_descriptor import TensorDescriptor

    a = torch.zeros(64, 32, dtype=torch.float16)
    other = torch.zeros(128, 64, dtype=torch.float16)[:, :32]  # another address, shape, strides
    key = _key((TensorDescriptor.from_tensor(a, [16, 32]),))
    assert key == _key((TensorDescriptor.from_tensor(other, [16, 32]),))
    assert key != _key((TensorDescriptor.from_tensor(a, [32, 32]),))
    assert key != _key((TensorDescriptor.from_tensor(a.float(), [16, 32]),))


def test_launcher_key_records_what_gluon_specialises_a_descriptor_on():
    """A Gluon kernel's descriptor (another class than Triton's) is keyed too, on its layout as
    well: without it every launch of a Hopper Gluon kernel took Triton's generic path."""
    gluon = pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    from megablocks_triton.launch import _key
    from triton.experimental.gluon import language as gl

    def desc(t: torch.Tensor, block: list[int], swizzle: int = 64) -> object:
        layout = gl.NVMMASharedLayout(swizzle, 16, rank=2)
        return gluon.TensorDescriptor.from_tensor(t, block, layout)

    a = torch.zeros(64, 32, dtype=torch.float16)
    other = torch.zeros(128, 64, dtype=torch.float16)[:, :32]
    key = _key((desc(a, [16, 32]),))
    assert key == _key((desc(other, [16, 32]),))
    assert key != _key((desc(a, [32, 32]),))
    assert key != _key((desc(a, [16, 32], swizzle=32),))


def _stand_in_triton(monkeypatch, metas):
    """A compiled kernel whose launcher is Triton 3.6's descriptor wrapper around a recording
    native launch, with the driver's descriptor encoder replaced by a recording stand-in; the
    current device and stream are fixed."""
    import triton
    from megablocks_triton import launch as L
    from triton.backends.nvidia import driver as nvidia

    encoded: list[int] = []

    def fill_tma_descriptor(address, swizzle, elem_size, dtype, block, shape, strides, padding):
        encoded.append(address)
        return ("map", address, swizzle, elem_size, dtype, tuple(block), tuple(shape), padding)

    class Utils:
        pass

    class Driver:
        utils = Utils()

    Driver.utils.fill_tma_descriptor = staticmethod(fill_tma_descriptor)
    monkeypatch.setattr(triton.runtime.driver, "_active", Driver())
    monkeypatch.setattr(L, "_current_device", lambda: 0)
    monkeypatch.setattr(L, "_raw_stream", lambda device: 77)
    launched: list[tuple] = []
    signature = {
        "a": "tensordesc<fp16[16, 32]>",
        "b": "tensordesc<fp16[1, 32, 16]>",
        "c": "*fp16",
        "n": "i32",
        "BLOCK": "constexpr",
    }

    class CudaLauncher:  # the name launch._direct_launch looks for
        global_scratch_size = 0
        profile_scratch_size = 0
        launch_cooperative_grid = False
        launch_pdl = False

        def __init__(self):
            self.launch = nvidia.wrap_handle_tensordesc(
                lambda *args: launched.append(args), signature, metas
            )

        def __call__(self, gx, gy, gz, stream, function, *args):  # as Triton's, no scratch
            self.launch(gx, gy, gz, stream, function, False, False, None, None, *args)

    class Compiled:
        function = "function"
        packed_metadata = "packed metadata"
        run = CudaLauncher()

    return Compiled(), launched, encoded


@pytest.mark.parametrize("lowered", [True, False])  # descriptors encoded for TMA, or not
def test_descriptor_launch_passes_what_tritons_wrapper_passes(monkeypatch, lowered):
    import triton
    from megablocks_triton.launch import DescriptorLaunch
    from triton.tools.tensor_descriptor import TensorDescriptor

    if not triton.__version__.startswith("3.6."):  # the wrapper this mirrors is 3.6's
        pytest.skip(f"triton {triton.__version__}: DescriptorLaunch does not pin natively")
    meta = {"swizzle": 3, "elem_size": 2, "elem_type": 6, "fp4_padded": False}
    metas = [{**meta, "block_size": [16, 32]}, {**meta, "block_size": [1, 32, 16]}]
    compiled, launched, encoded = _stand_in_triton(monkeypatch, metas if lowered else None)
    blocks = {0: [16, 32], 1: [1, 32, 16]}
    bound = DescriptorLaunch(None, (3,), (5,), {}, blocks)  # type: ignore[arg-type]
    a = torch.zeros(64, 32, dtype=torch.float16)
    b = torch.zeros(4, 32, 48, dtype=torch.float16)
    c = torch.zeros(64, 48, dtype=torch.float16)
    bound._pin_descriptors((compiled, (128,)), (a, b, c))
    assert bound.pinned == "native"
    a2, c2 = torch.zeros_like(a), torch.zeros_like(c)
    calls = [  # the tensors, and the addresses this call must encode (each address only once)
        ((a, b, c), [a.data_ptr(), b.data_ptr()]),
        ((a2, b, c2), [a2.data_ptr()]),  # a new a; b as before
        ((a, b, c), []),  # both seen before
    ]
    for tensors, new_addresses in calls:
        encoded.clear()
        bound(*tensors)
        assert encoded == (new_addresses if lowered else [])
        ours = launched.pop()
        descriptors = [TensorDescriptor.from_tensor(tensors[i], blocks[i]) for i in (0, 1)]
        compiled.run(3, 1, 1, 77, "function", "packed metadata", None, None, None,
                     *descriptors, tensors[2], 5, 128)  # fmt: skip
        theirs = tuple(x.data_ptr() if isinstance(x, torch.Tensor) else x for x in launched.pop())
        assert ours == theirs


# --------------------------------------------------------------------------------------------
# The grouped GEMMs' prepared launches on the GPU


def _gmm_reference(a: torch.Tensor, b: torch.Tensor, counts: torch.Tensor, trans_b: bool):
    """float32 per-expert products of consecutive row groups (a torch loop)."""
    out = torch.zeros(a.shape[0], b.shape[1] if trans_b else b.shape[2], device=a.device)
    start = 0
    for e, count in enumerate(counts.tolist()):
        w = b[e].float().T if trans_b else b[e].float()
        out[start : start + count] = a[start : start + count].float() @ w
        start += count
    return out


def _assert_close_bf16(got: torch.Tensor, want: torch.Tensor) -> None:
    scale = max(1.0, float(want.abs().max())) if want.numel() else 1.0
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2 * scale)


@gpu
@pytest.mark.parametrize("trans_b", [False, True])
def test_prepared_grouped_gemms_on_the_gpu(trans_b, monkeypatch):
    """gmm, gather_gmm and gmm_scatter (bf16: TMA on Hopper and later) over calls that pin their
    launches and then take the native path, with new tensors every call (descriptors per
    address), an unaligned operand (the plain kernel), counts and indices of two dtypes, no
    tokens, one expert, empty experts, and returns to earlier shapes: each against a float32
    torch loop."""
    import triton
    from megablocks_reference import kernels as reference
    from megablocks_triton import gmm as G

    monkeypatch.setattr(G, "_FORWARD_PLANS", {})
    monkeypatch.setattr(G, "_GMM_SCATTER_PLANS", {})
    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = [
        (64, 4, 16, 512, 256),
        (1, 8, 128, 256, 128),
        (0, 2, 8, 256, 128),
        (33, 1, 1, 256, 64),
    ]
    for tokens, top_k, experts, hidden, ffn in shapes * 2 + shapes[:1] * 3:
        for index_dtype in (torch.int32, torch.int64):
            top = torch.randint(0, experts, (tokens * top_k,), device="cuda", generator=gen)
            top[::3] = experts // 2  # some experts get many rows, others none
            indices, bin_ids, counts, bins, _ = reference.route(top.to(index_dtype), experts, 16)
            w1_shape = (experts, ffn, hidden) if trans_b else (experts, hidden, ffn)
            w2_shape = (experts, hidden, ffn) if trans_b else (experts, ffn, hidden)
            w1 = (torch.randn(w1_shape, device="cuda", generator=gen) / hidden**0.5).bfloat16()
            w2 = (torch.randn(w2_shape, device="cuda", generator=gen) / ffn**0.5).bfloat16()
            x = torch.randn(tokens, hidden, device="cuda", generator=gen).bfloat16()
            weights = torch.rand(tokens * top_k, device="cuda", generator=gen)
            gathered = x[indices.long() // top_k] if tokens else x.new_zeros(0, hidden)
            rows = G.gather_gmm(x, w1, indices, bin_ids, bins, top_k, trans_b)
            _assert_close_bf16(rows, _gmm_reference(gathered, w1, counts, trans_b))
            h = torch.randn(tokens * top_k, ffn, device="cuda", generator=gen).bfloat16()
            got = G.gmm(h, w2, counts.to(index_dtype), trans_b)
            products = _gmm_reference(h, w2, counts, trans_b)
            _assert_close_bf16(got, products)
            if tokens:  # an operand one element off 16 bytes: the plain kernel
                shifted = torch.empty(h.numel() + 1, device="cuda", dtype=h.dtype)[1:]
                shifted = shifted.view_as(h).copy_(h)
                _assert_close_bf16(G.gmm(shifted, w2, counts, trans_b), products)
            out = G.gmm_scatter(h, w2, indices, bin_ids, weights, bins, top_k, trans_b)
            want = torch.zeros(tokens, hidden, device="cuda")
            flat = indices.long()
            want.index_add_(0, flat // top_k, products * weights[flat, None])
            _assert_close_bf16(out, want)
    # gmm's and gather_gmm's launches (gmm_scatter keeps its own inside its plan).
    tma = [p.tma for p in G._FORWARD_PLANS.values() if getattr(p, "tma", None) is not None]
    if torch.cuda.get_device_capability()[0] >= 9:  # bf16 forward configs use TMA there
        assert tma
        if triton.__version__.startswith("3.6."):
            assert all(t.pinned == "native" for t in tma)


@gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_prepared_gmm_is_kept_per_device():
    """One call shape on two GPUs: each device gets its own prepared launch and results."""
    from megablocks_triton import gmm as G

    counts = torch.tensor([5, 0, 11])
    for _ in range(2):
        for device in ("cuda:0", "cuda:1"):
            a = torch.randn(16, 64, device=device).bfloat16()
            b = (torch.randn(3, 64, 32, device=device) / 8).bfloat16()
            dev_counts = counts.to(device)
            _assert_close_bf16(G.gmm(a, b, dev_counts), _gmm_reference(a, b, dev_counts, False))
