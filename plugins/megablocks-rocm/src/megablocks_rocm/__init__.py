"""AMD ROCm backend for megablocks-core.

The Triton kernels of ``megablocks-triton`` (taken through its API for other plugins,
:mod:`megablocks_triton.api`), declared for device kind ``"rocm"`` and launched with launch
configurations chosen per AMD architecture (:mod:`megablocks_rocm.arch`,
:mod:`megablocks_rocm.launch`). Importing this package needs neither triton nor a GPU.
"""

from __future__ import annotations

__version__ = "0.1.0"
