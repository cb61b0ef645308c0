"""Loading the C++/CUDA extension: the ahead-of-time build if present, else a JIT build.

Nothing here runs at import: :func:`load` is called by the first call of one of its kernels or
by their capability check on a CUDA device (the first ranking of one of their ops). The result,
a module or the reason there is none, is cached for the process.
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
from pathlib import Path
from types import ModuleType

import torch

CSRC = Path(__file__).parent / "csrc"
SOURCES = ("routing.cu", "permutation.cu", "bindings.cpp")
AOT_MODULE = "megablocks_cuda._C"


class ExtensionUnavailable(RuntimeError):
    """The extension is neither built ahead of time nor buildable here (the message says why)."""


_lock = threading.Lock()
_module: ModuleType | None = None
_problem: str | None = None


def _jit_name() -> str:
    # One cache entry per torch/CUDA pair: a build for another torch must not be picked up.
    tag = f"{torch.__version__}_{torch.version.cuda}".replace(".", "_").replace("+", "_")
    return f"megablocks_cuda_ext_{tag}"


def _jit_build() -> ModuleType:
    from torch.utils import cpp_extension

    if cpp_extension.CUDA_HOME is None:
        raise ExtensionUnavailable(
            "no ahead-of-time build and no CUDA toolkit to compile it "
            "(set CUDA_HOME, or reinstall megablocks-cuda where nvcc exists)"
        )
    name = _jit_name()
    build_dir = Path(cpp_extension.get_default_build_root()) / name
    build_dir.mkdir(parents=True, exist_ok=True)
    if not any(build_dir.glob(f"{name}*.so")):
        print(
            f"megablocks-cuda: compiling the CUDA extension into {build_dir} "
            "(first use only; takes about a minute)",
            file=sys.stderr,
            flush=True,
        )
    flags = ["-O3", "-std=c++17"]
    return cpp_extension.load(
        name=name,
        sources=[str(CSRC / s) for s in SOURCES],
        build_directory=str(build_dir),
        extra_cflags=flags,
        extra_cuda_cflags=[*flags, "--expt-relaxed-constexpr"],
        verbose=False,
    )


def _load() -> ModuleType:
    if torch.version.cuda is None or torch.version.hip:
        raise ExtensionUnavailable("torch is not a CUDA build")
    try:
        return importlib.import_module(AOT_MODULE)
    except ImportError as exc:
        # No ahead-of-time build (or one made for another torch): compile the shipped sources.
        aot = (
            ""
            if isinstance(exc, ModuleNotFoundError)
            else f" (ahead-of-time build unusable: {exc})"
        )
    if os.environ.get("MEGABLOCKS_CUDA_NO_JIT", "") not in ("", "0"):
        raise ExtensionUnavailable(f"no ahead-of-time build and MEGABLOCKS_CUDA_NO_JIT is set{aot}")
    try:
        return _jit_build()
    except ExtensionUnavailable:
        raise
    except Exception as exc:  # compiler missing or failing, ninja missing, version mismatch …
        lines = [line for line in str(exc).strip().splitlines() if line.strip()]
        raise ExtensionUnavailable(
            f"building the CUDA extension failed{aot}: "
            f"{type(exc).__name__}: {lines[-1] if lines else ''}"
        ) from exc


def load() -> ModuleType:
    """The extension module; raises :class:`ExtensionUnavailable` (cached) when there is none."""
    global _module, _problem
    if _module is not None:
        return _module
    with _lock:
        if _module is None and _problem is None:
            try:
                _module = _load()
            except ExtensionUnavailable as exc:
                _problem = str(exc)
    if _module is None:
        raise ExtensionUnavailable(_problem)
    return _module


def problem() -> str | None:
    """Why the extension cannot be used here, or None once it is loaded (loads it if needed)."""
    try:
        load()
    except ExtensionUnavailable as exc:
        return str(exc)
    return None


def loaded() -> ModuleType | None:
    """The extension if it has already been loaded, without trying to load or build it."""
    return _module
