"""Launch compiled Triton kernels without Triton's generic per-call Python path.

``kernel[grid](*args, **kw)`` binds the arguments, computes Triton's specialisation of
each one (dtype and 16-byte alignment of pointers; 32/64-bit range, divisibility by 16
and equality to 1 of ints) in a chain of native calls, builds a cache key string and
looks the compiled kernel up: tens of µs of host time per launch on a GPU host, more
than these kernels take on the GPU at small sizes.

Two levels, both keeping Triton's semantics (a call always runs the kernel Triton would
compile for it):

* :class:`Launcher` keeps, per kernel, a dict from a cheap key of its own to the
  compiled kernel and the parameters that never change between calls with that key
  (the constexprs). The key records at least everything Triton specialises on, so two
  calls with one key always get the same compiled kernel: the first call of a key goes
  through ``kernel[grid]`` (compiling if needed) and later ones call the compiled
  kernel's launcher directly with the current stream.
* :class:`BoundLaunch` (:func:`bind`) is one call site's launch with the grid, the scalar
  arguments and the constexprs fixed: the op functions keep one per call shape, so a call
  computes no key at all. It passes the tensors' addresses as integers (the launcher then
  skips a driver query per pointer) and, with Triton's CUDA launcher, calls the native
  launch function directly. :class:`DescriptorLaunch` (:func:`bind_descriptors`) does the
  same for a kernel that takes some tensors as TMA tensor descriptors.

:class:`record_launches` notes the launches instead of running them (``meta`` tensors standing
for a simulated device's): the ahead-of-time compile gate compiles what the launch path chose
(:mod:`megablocks_triton.aot`).

Where the fast paths cannot be used — the CPU interpreter (``TRITON_INTERPRET=1``),
launch hooks installed (profilers such as proton) — every call goes through
``kernel[grid]`` unchanged. On ROCm, where Triton also specialises pointers on whether their
storage fits 2 GiB, the key records that too and :class:`BoundLaunch` pins nothing.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import triton  # type: ignore[import-untyped]
from triton.runtime.jit import JITFunction  # type: ignore[import-untyped]
from triton.tools.tensor_descriptor import TensorDescriptor  # type: ignore[import-untyped]

from megablocks_core.plugin import DeviceInfo

_INT32 = (-(2**31), 2**31 - 1)
_Tensor = torch.Tensor
#: ROCm: Triton also specialises pointers on whether the tensor's storage fits 2 GiB (buffer
#: loads with 32-bit offsets), which the key must then record too.
_HIP = torch.version.hip is not None
_TWO_GIB = 2**31 - 1
#: Triton versions whose CUDA launcher's native ``launch`` takes the argument order used by
#: :meth:`BoundLaunch._pin` (checked against their source; others go through ``compiled.run``).
_DIRECT_LAUNCH_VERSIONS = ("3.6.",)


class _Uncacheable(Exception):
    """An argument whose specialisation this module does not model (e.g. a TMA descriptor)."""


def _key(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """What a compiled kernel can depend on in each argument: a superset of Triton's
    specialisation (one loop, no call per argument: this runs on every launch)."""
    key: list[Any] = []
    for arg in args:
        kind = type(arg)
        if kind is int:
            key.append((arg == 1, not arg & 15, _INT32[0] <= arg <= _INT32[1], arg >= 2**63))
        elif kind is _Tensor or isinstance(arg, _Tensor):
            if _HIP:
                small = arg.untyped_storage().size() <= _TWO_GIB
                key.append((arg.dtype, not arg.data_ptr() & 15, small))
            else:
                key.append((arg.dtype, not arg.data_ptr() & 15))
        elif arg is None or kind is bool:
            key.append(arg)
        elif kind is float:
            key.append(float)
        elif kind is TensorDescriptor and not _HIP:
            # Triton specialises a host-side descriptor on its dtype and block shape (its base
            # address, shape and strides are runtime arguments).
            key.append((arg.base.dtype, tuple(arg.block_shape), arg.padding))
        elif kind is _GLUON_DESCRIPTOR and not _HIP:
            # A Gluon kernel's descriptor: on its shared-memory layout too.
            key.append((arg.base.dtype, tuple(arg.block_shape), arg.padding, arg.layout))
        else:
            raise _Uncacheable
    return tuple(key)


def _gluon_descriptor_class() -> type | None:
    try:
        from triton.experimental.gluon.nvidia.hopper import (  # type: ignore[import-untyped]
            TensorDescriptor as GluonTensorDescriptor,
        )
    except Exception:  # a Triton without Gluon: no such descriptors to key
        return None
    return GluonTensorDescriptor


#: The host-side descriptor of Gluon kernels (the Hopper kernels take it): another class than
#: Triton's, specialised on its shared-memory layout as well.
_GLUON_DESCRIPTOR = _gluon_descriptor_class()

_raw_stream: Callable[[int], int] = getattr(
    torch._C, "_cuda_getCurrentRawStream", lambda i: torch.cuda.current_stream(i).cuda_stream
)
#: The current CUDA device without ``torch.cuda.current_device``'s lazy-init check (only called
#: on a launch, after CUDA is initialised).
_current_device: Callable[[], int] = getattr(
    torch._C, "_cuda_getDevice", lambda: torch.cuda.current_device()
)


_knobs = triton.knobs


@dataclass(frozen=True)
class RecordedLaunch:
    """A launch that :class:`record_launches` noted instead of running: the kernel, its grid, the
    positional arguments (tensors may be ``meta`` tensors) and the keywords (constexprs, launch
    options), as :class:`Launcher` received them."""

    kernel: Any
    grid: tuple[int, ...]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


class record_launches:  # lower-case: used like a function, ``with record_launches(device):``
    """Within the block, every launch through this module is noted (:class:`RecordedLaunch`) and
    not run, and ``meta`` tensors stand for tensors on ``device`` (a device description, possibly
    of a GPU this host does not have): the op functions run their real launch path, so the
    launches noted are what would run there. For ahead-of-time compilation (:mod:`.aot`); not
    thread-safe, not nestable."""

    def __init__(self, device: DeviceInfo) -> None:
        self.device = device
        self.launches: list[RecordedLaunch] = []

    def __enter__(self) -> record_launches:
        global _RECORDER
        if _RECORDER is not None:
            raise RuntimeError("launches are already being recorded")
        _RECORDER = self
        return self

    def __exit__(self, *exc: object) -> None:
        global _RECORDER
        _RECORDER = None


_RECORDER: record_launches | None = None


def recorded_device() -> DeviceInfo | None:
    """The device that ``meta`` tensors stand for while launches are recorded, else None."""
    return None if _RECORDER is None else _RECORDER.device


_data_ptr = torch.Tensor.data_ptr


def _hooks_installed() -> bool:
    runtime = _knobs.runtime
    return bool(runtime.launch_enter_hook.calls or runtime.launch_exit_hook.calls)


class Launcher:
    """``Launcher(kernel)(grid, *args, **kw)`` launches like ``kernel[grid](*args, **kw)``.

    ``kw`` holds the kernel's constexpr parameters and Triton launch options
    (``num_warps``, ``num_stages``, backend options); runtime arguments are passed
    positionally in the kernel's parameter order.
    """

    __slots__ = ("_cache", "_defaults", "_fast", "_kernel", "_names", "_runtime_names")

    def __init__(self, kernel: Any) -> None:
        self._kernel = kernel
        self._fast = isinstance(kernel, JITFunction)  # False under the interpreter
        params = inspect.signature(kernel.fn).parameters if self._fast else {}
        self._names: tuple[str, ...] = tuple(params)
        self._defaults = {
            n: p.default for n, p in params.items() if p.default is not inspect.Parameter.empty
        }
        self._runtime_names = (
            frozenset(kp.name for kp in kernel.params if not kp.is_constexpr)
            if self._fast
            else frozenset()
        )
        # key → (compiled kernel, the parameters after the positional ones, in order)
        self._cache: dict[Any, tuple[Any, tuple[Any, ...]]] = {}

    def __call__(
        self, grid: Sequence[int], *args: Any, **kw: Any
    ) -> tuple[Any, tuple[Any, ...]] | None:
        """Launch; returns the (compiled kernel, constexpr tail) used, or None where the launch
        went through ``kernel[grid]`` without the cache (or was only recorded)."""
        if _RECORDER is not None:  # ahead-of-time compilation: note the launch, run nothing
            _RECORDER.launches.append(RecordedLaunch(self._kernel, tuple(grid), args, dict(kw)))
            return None
        kernel = self._kernel
        if not self._fast or _hooks_installed():
            kernel[tuple(grid)](*args, **kw)
            return None
        device = _current_device()
        try:
            key = (device, _key(args), tuple(kw.items()))
        except _Uncacheable:
            kernel[tuple(grid)](*args, **kw)
            return None
        hit = self._cache.get(key)
        if hit is None:
            runtime_kw = self._runtime_names.intersection(kw)
            if runtime_kw:  # their values would be frozen into the cached tail
                raise TypeError(
                    f"{kernel.fn.__name__}: pass runtime arguments {sorted(runtime_kw)} "
                    "positionally"
                )
            compiled = kernel[tuple(grid)](*args, **kw)
            if hasattr(compiled, "result"):  # asynchronous compilation mode
                compiled = compiled.result()
            tail = tuple(kw[n] if n in kw else self._defaults[n] for n in self._names[len(args) :])
            hit = self._cache[key] = (compiled, tail)
            return hit
        compiled, tail = hit
        g0 = grid[0]
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        stream = _raw_stream(device)
        compiled.run(
            g0,
            g1,
            g2,
            stream,
            compiled.function,
            compiled.packed_metadata,
            None,
            None,
            None,
            *args,
            *tail,
        )
        return hit


def _direct_launch(run: Any) -> Callable[..., Any] | None:
    """The native launch function behind Triton's CUDA launcher ``run``, where calling it
    directly is known to be equivalent (no scratch memory to allocate per launch)."""
    if (
        type(run).__name__ != "CudaLauncher"
        or not triton.__version__.startswith(_DIRECT_LAUNCH_VERSIONS)
        or getattr(run, "global_scratch_size", 1) != 0
        or getattr(run, "profile_scratch_size", 1) != 0
    ):
        return None
    return getattr(run, "launch", None)


def _native_pinned(compiled: Any, run: Any) -> tuple[Any, ...]:
    """The fixed leading arguments of Triton 3.6's native launch after (grid, stream): function,
    cooperative, pdl, global scratch, profile scratch, metadata, launch metadata, enter hook,
    exit hook."""
    return (
        compiled.function,
        run.launch_cooperative_grid,
        run.launch_pdl,
        None,
        None,
        compiled.packed_metadata,
        None,
        None,
        None,
    )


class BoundLaunch:
    """A launch of one kernel with its grid, scalar arguments and constexprs fixed:
    ``bound(*tensors)`` runs ``kernel[grid](*tensors, *scalars, **kw)``.

    The kernel's leading parameters are the tensors (pointers), then the scalars. Whoever keeps
    a BoundLaunch for reuse must key it on everything that decides the scalars and every
    tensor's dtype (e.g. the input shapes and dtypes): the compiled kernel is pinned on the
    first call with 16-byte-aligned tensors and reused for every later one on the same device.
    Calls with an unaligned tensor, on another device or with launch hooks installed go through
    :class:`Launcher` (keyed on every argument) instead.
    """

    __slots__ = (
        "_args",
        "_device",
        "_grid",
        "_kw",
        "_launcher",
        "_native",
        "_pinned",
        "_run",
        "_scalars",
    )

    def __init__(
        self, launcher: Launcher, grid: Sequence[int], scalars: Sequence[Any], kw: Mapping[str, Any]
    ) -> None:
        self._launcher = launcher
        self._grid = tuple(grid) + (1,) * (3 - len(grid))
        self._kw = dict(kw)
        self._scalars = tuple(scalars)
        self._args = self._scalars  # what follows the tensors: + the constexprs once pinned
        self._device = -1
        # Once pinned: the compiled kernel's launch function, and what it takes between the
        # stream and the kernel's arguments.
        self._run: Callable[..., Any] | None = None
        self._pinned: tuple[Any, ...] = ()
        self._native = False

    @property
    def pinned(self) -> str | None:
        """How aligned calls launch: "native" (Triton's C launch function), "launcher" (the
        compiled kernel's launcher object) or None (not pinned: every call goes through
        :class:`Launcher`)."""
        if self._run is None:
            return None
        return "native" if self._native else "launcher"

    def __call__(self, *tensors: torch.Tensor) -> None:
        run = self._run
        runtime = _knobs.runtime  # launch hooks (profilers) need Triton's own launch path
        if run is not None and not (
            runtime.launch_enter_hook.calls or runtime.launch_exit_hook.calls
        ):
            device = _current_device()
            if device == self._device:
                ptrs = [*map(_data_ptr, tensors)]
                unaligned = 0
                for p in ptrs:
                    unaligned |= p
                if not unaligned & 15:
                    g0, g1, g2 = self._grid
                    run(g0, g1, g2, _raw_stream(device), *self._pinned, *ptrs, *self._args)
                    return
        self._slow(tensors)

    def _slow(self, tensors: tuple[torch.Tensor, ...]) -> None:
        hit = self._launcher(self._grid, *tensors, *self._scalars, **self._kw)
        if hit is None or self._run is not None or _HIP:
            return
        if any(t.data_ptr() & 15 for t in tensors):
            return  # pin only the aligned specialisation (what fresh allocations get)
        compiled, tail = hit
        run = compiled.run
        direct = _direct_launch(run)
        if direct is not None:
            self._run, self._native = direct, True
            self._pinned = _native_pinned(compiled, run)
        else:  # run(grid, stream, function, metadata, launch metadata, enter/exit hooks, ...)
            self._run, self._native = run, False
            self._pinned = (compiled.function, compiled.packed_metadata, None, None, None)
        self._args = self._scalars + tail
        self._device = _current_device()


#: Encoded descriptors a :class:`DescriptorLaunch` keeps per tensor position (by address);
#: past this the position's cache starts over.
DESCRIPTOR_CACHE_LIMIT = 64


class _Address(int):
    """A device address where Triton's descriptor code asks a tensor for ``data_ptr()``."""

    def data_ptr(self) -> int:
        return int(self)


class _DescriptorArgs:
    """What Triton's ``make_tensordesc_arg`` reads of a host-side descriptor."""

    __slots__ = ("base", "padding", "shape", "strides")

    def __init__(self, address: int, shape: list[int], strides: list[int]) -> None:
        self.base = _Address(address)
        self.shape = shape
        self.strides = strides
        self.padding = "zero"  # TensorDescriptor.from_tensor's


def _descriptor_expander(
    make: Callable[[Any, Any], Sequence[Any]], meta: Any, tensor: torch.Tensor
) -> Callable[[int], Sequence[Any]]:
    """address → the native launch arguments that stand for a descriptor over ``tensor``'s shape
    and strides at that address: what Triton's own launch wrapper passes (``make(desc, meta)``),
    cached per address (the encoding depends on nothing else that can change for one
    :class:`DescriptorLaunch`)."""
    shape, strides = list(tensor.shape), list(tensor.stride())
    cache: dict[int, tuple[Any, ...]] = {}

    def expand(address: int) -> tuple[Any, ...]:
        found = cache.get(address)
        if found is None:
            made = list(make(_DescriptorArgs(address, shape, strides), meta))
            if isinstance(made[0], _Address):  # not lowered to TMA: the base is a plain pointer
                made[0] = int(made[0])
            if len(cache) >= DESCRIPTOR_CACHE_LIMIT:
                cache.clear()
            found = cache[address] = tuple(made)
        return found

    return expand


def _native_descriptor_launch(
    run: Any, count: int
) -> tuple[Callable[..., Any], Any, list[Any]] | None:
    """For Triton 3.6's CUDA launcher of a kernel with ``count`` descriptor arguments: the native
    launch function behind its descriptor-expanding wrapper, the function that expands one
    descriptor (``make_tensordesc_arg``) and each descriptor's metadata; None where the wrapper is
    not the one this was checked against."""
    wrapper = _direct_launch(run)
    code = getattr(wrapper, "__code__", None)
    closure = getattr(wrapper, "__closure__", None)
    if code is None or closure is None:
        return None
    cells = dict(zip(code.co_freevars, closure, strict=True))
    make = getattr(wrapper, "__globals__", {}).get("make_tensordesc_arg")
    if make is None or not {"launcher", "tensordesc_meta"} <= cells.keys():
        return None
    metas = list(cells["tensordesc_meta"].cell_contents or [None] * count)
    if len(metas) != count:
        return None
    return cells["launcher"].cell_contents, make, metas


class DescriptorLaunch(BoundLaunch):
    """A :class:`BoundLaunch` that passes some of its tensors as TMA tensor descriptors,
    ``TensorDescriptor.from_tensor(tensor, block_shape)``: ``blocks`` maps their positions among
    the tensor arguments to block shapes.

    Whoever keeps one must key it also on those tensors' shapes and strides (a descriptor holds
    them; they are fixed on the first pinned call). Once pinned (Triton 3.6's CUDA launcher), a
    call hands the native launch function what Triton's descriptor wrapper would (the encoded
    descriptor, kept per address, then shape and strides) without building descriptor objects.
    Otherwise every call builds the descriptors and goes through :class:`Launcher`.
    """

    __slots__ = ("_blocks", "_expanders")

    def __init__(
        self,
        launcher: Launcher,
        grid: Sequence[int],
        scalars: Sequence[Any],
        kw: Mapping[str, Any],
        blocks: Mapping[int, Sequence[int]],
    ) -> None:
        super().__init__(launcher, grid, scalars, kw)
        self._blocks = {i: list(block) for i, block in blocks.items()}
        # Once pinned, per tensor: None (passed as its address) or its descriptor's expander.
        self._expanders: tuple[Callable[[int], Sequence[Any]] | None, ...] = ()

    def __call__(self, *tensors: torch.Tensor) -> None:
        run = self._run
        runtime = _knobs.runtime
        if run is not None and not (
            runtime.launch_enter_hook.calls or runtime.launch_exit_hook.calls
        ):
            device = _current_device()
            if device == self._device:
                args: list[Any] = []
                unaligned = 0
                for tensor, expand in zip(tensors, self._expanders, strict=True):
                    address = _data_ptr(tensor)
                    unaligned |= address
                    if expand is None:
                        args.append(address)
                    else:
                        args += expand(address)
                if not unaligned & 15:
                    g0, g1, g2 = self._grid
                    run(g0, g1, g2, _raw_stream(device), *self._pinned, *args, *self._args)
                    return
        self._slow(tensors)

    def _slow(self, tensors: tuple[torch.Tensor, ...]) -> None:
        blocks = self._blocks
        args = [
            TensorDescriptor.from_tensor(t, blocks[i]) if i in blocks else t
            for i, t in enumerate(tensors)
        ]
        hit = self._launcher(self._grid, *args, *self._scalars, **self._kw)
        if hit is None or self._run is not None or _HIP:
            return
        if any(t.data_ptr() & 15 for t in tensors):
            return
        self._pin_descriptors(hit, tensors)

    def _pin_descriptors(
        self, hit: tuple[Any, tuple[Any, ...]], tensors: Sequence[torch.Tensor]
    ) -> None:
        compiled, tail = hit
        run = compiled.run
        native = _native_descriptor_launch(run, len(self._blocks))
        if native is None:
            return
        launch_fn, make, metas = native
        positions = sorted(self._blocks)  # the descriptors' order among the arguments
        meta_of = dict(zip(positions, metas, strict=True))
        self._expanders = tuple(
            _descriptor_expander(make, meta_of[i], t) if i in meta_of else None
            for i, t in enumerate(tensors)
        )
        self._run, self._native = launch_fn, True
        self._pinned = _native_pinned(compiled, run)
        self._args = self._scalars + tail
        self._device = _current_device()


# id(kernel) → its Launcher (ids, not the kernels' own hash, which Triton computes in Python;
# the Launcher keeps its kernel alive, so an id is never reused for another kernel).
_LAUNCHERS: dict[int, Launcher] = {}


def launcher(kernel: Any) -> Launcher:
    """The kernel's :class:`Launcher` (made on first use)."""
    found = _LAUNCHERS.get(id(kernel))
    if found is None:
        found = _LAUNCHERS[id(kernel)] = Launcher(kernel)
    return found


def launch(kernel: Any, grid: Sequence[int], *args: Any, **kw: Any) -> None:
    """``kernel[grid](*args, **kw)`` through the kernel's :class:`Launcher`."""
    launcher(kernel)(grid, *args, **kw)


def bind(kernel: Any, grid: Sequence[int], *scalars: Any, **kw: Any) -> BoundLaunch:
    """A :class:`BoundLaunch` of ``kernel``: call it with the tensor arguments."""
    return BoundLaunch(launcher(kernel), grid, scalars, kw)


def bind_descriptors(
    kernel: Any,
    grid: Sequence[int],
    *scalars: Any,
    descriptors: Mapping[int, Sequence[int]],
    **kw: Any,
) -> DescriptorLaunch:
    """A :class:`DescriptorLaunch` of ``kernel``: call it with the tensor arguments; those at the
    positions of ``descriptors`` go in as TMA descriptors with the given block shapes."""
    return DescriptorLaunch(launcher(kernel), grid, scalars, kw, descriptors)


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for launch grids (``triton.cdiv`` costs µs per call: a jit wrapper)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1), without ``triton``'s jit wrapper."""
    return 1 << (int(n) - 1).bit_length() if n > 1 else 1


#: Call shapes remembered per op function (each holds a few :class:`BoundLaunch`); past this
#: a cache starts over (bounded memory for workloads whose shapes never repeat).
PLAN_LIMIT = 512


def remember(cache: dict[Any, Any], key: Any, plan: Any) -> Any:
    """``cache[key] = plan`` (emptying a full cache first); returns ``plan``."""
    if len(cache) >= PLAN_LIMIT:
        cache.clear()
    cache[key] = plan
    return plan
