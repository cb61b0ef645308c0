"""The Triton backend's ``@triton.jit`` kernels and their device helpers, one module per family.

Kernels only: the launch shapes, per-call-shape plans and op functions that use them live in
the host modules of the same name one level up (:mod:`megablocks_triton.routing`,
:mod:`megablocks_triton.permutation`, :mod:`megablocks_triton.gmm`), which re-export them.
"""
