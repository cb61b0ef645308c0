"""Build the CUDA extension ahead of time when this host can, else install pure Python.

The extension (``megablocks_cuda._C``) is built only when torch is importable at build time (so
with ``--no-build-isolation``), torch has CUDA (``torch.version.cuda``) and a CUDA toolkit is
found (``CUDA_HOME``/nvcc). ``TORCH_CUDA_ARCH_LIST`` picks the architectures, as for any torch
extension. Otherwise the package installs without it and compiles the same sources on first use.
Set ``MEGABLOCKS_CUDA_NO_BUILD=1`` to skip the ahead-of-time build.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from setuptools import setup

SOURCES = [
    "src/megablocks_cuda/csrc/routing.cu",
    "src/megablocks_cuda/csrc/permutation.cu",
    "src/megablocks_cuda/csrc/bindings.cpp",
]


def _extension() -> dict[str, Any]:
    if os.environ.get("MEGABLOCKS_CUDA_NO_BUILD", "") not in ("", "0"):
        return {}
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except ImportError:  # build isolation, or no torch yet: the JIT path covers it later
        return {}
    if torch.version.cuda is None or CUDA_HOME is None:
        print(
            "megablocks-cuda: no CUDA torch or no CUDA toolkit; installing without the "
            "ahead-of-time extension (it compiles on first use)",
            file=sys.stderr,
        )
        return {}
    flags = ["-O3", "-std=c++17"]
    ext = CUDAExtension(
        "megablocks_cuda._C",
        SOURCES,
        extra_compile_args={"cxx": flags, "nvcc": [*flags, "--expt-relaxed-constexpr"]},
    )
    return {"ext_modules": [ext], "cmdclass": {"build_ext": BuildExtension}}


setup(**_extension())
