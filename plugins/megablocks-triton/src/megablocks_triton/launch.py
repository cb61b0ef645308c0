"""Launch compiled Triton kernels without Triton's generic per-call Python path.

``kernel[grid](*args, **kw)`` binds the arguments, computes Triton's specialisation of
each one (dtype and 16-byte alignment of pointers; 32/64-bit range, divisibility by 16
and equality to 1 of ints) in a chain of native calls, builds a cache key string and
looks the compiled kernel up: tens of µs of host time per launch on a GPU host, more
than these kernels take on the GPU at small sizes.

:class:`Launcher` keeps, per kernel, a dict from a cheap key of its own to the
compiled kernel and the parameters that never change between calls with that key
(the constexprs). The key records at least everything Triton specialises on, so two
calls with one key always get the same compiled kernel: the first call of a key goes
through ``kernel[grid]`` (compiling if needed) and later ones call the compiled
kernel's launcher directly with the current stream.

Where the fast path cannot be used — the CPU interpreter (``TRITON_INTERPRET=1``),
launch hooks installed (profilers such as proton) — every call goes through
``kernel[grid]`` unchanged.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
import triton  # type: ignore[import-untyped]
from triton.runtime.jit import JITFunction  # type: ignore[import-untyped]

_INT32 = (-(2**31), 2**31 - 1)
_Tensor = torch.Tensor


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
            key.append((arg.dtype, not arg.data_ptr() & 15))
        elif arg is None or kind is bool:
            key.append(arg)
        elif kind is float:
            key.append(float)
        else:
            raise _Uncacheable
    return tuple(key)


_raw_stream: Callable[[int], int] = getattr(
    torch._C, "_cuda_getCurrentRawStream", lambda i: torch.cuda.current_stream(i).cuda_stream
)


def _hooks_installed() -> bool:
    runtime = triton.knobs.runtime
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

    def __call__(self, grid: Sequence[int], *args: Any, **kw: Any) -> None:
        kernel = self._kernel
        if not self._fast or _hooks_installed():
            kernel[tuple(grid)](*args, **kw)
            return
        device = torch.cuda.current_device()
        try:
            key = (device, _key(args), tuple(kw.items()))
        except _Uncacheable:
            kernel[tuple(grid)](*args, **kw)
            return
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
            self._cache[key] = (compiled, tail)
            return
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


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for launch grids (``triton.cdiv`` costs µs per call: a jit wrapper)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1), without ``triton``'s jit wrapper."""
    return 1 << (int(n) - 1).bit_length() if n > 1 else 1


_LAUNCHERS: dict[Any, Launcher] = {}


def launch(kernel: Any, grid: Sequence[int], *args: Any, **kw: Any) -> None:
    """``kernel[grid](*args, **kw)`` through the kernel's :class:`Launcher` (made on first use)."""
    runner = _LAUNCHERS.get(kernel)
    if runner is None:
        runner = _LAUNCHERS[kernel] = Launcher(kernel)
    runner(grid, *args, **kw)
