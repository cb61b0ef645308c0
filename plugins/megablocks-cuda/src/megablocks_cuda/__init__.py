"""megablocks-cuda: a CUDA backend for megablocks-core.

Routing ops from a small CUB-based C++ extension (built ahead of time by ``pip install`` when a
CUDA toolkit is present, otherwise compiled on first use) and grouped-GEMM providers built on
``torch._grouped_mm`` and, when installed, the ``grouped_gemm`` package. The hooks are in
:mod:`megablocks_cuda.plugin`.
"""

__version__ = "0.1.0"
