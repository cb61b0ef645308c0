"""What the reference backend provides: every op, on any device, at the lowest priority.

It ranks below every kernel that names a device kind, so it serves only where
nothing faster can (and the core reports that fallback).
"""

from __future__ import annotations

from megablocks_core.plugin import Kernel, family_ops, hookimpl

from . import kernels

PRIORITY = 0


def _kernels(family: str) -> list[Kernel]:
    # Every op of the family: kernels.py has one function per op, named after it.
    return [
        Kernel(op=op, fn=getattr(kernels, op), devices=("any",), priority=PRIORITY)
        for op in family_ops(family)
    ]


@hookimpl
def megablocks_routing_kernels() -> list[Kernel]:
    return _kernels("routing")


@hookimpl
def megablocks_permutation_kernels() -> list[Kernel]:
    return _kernels("permutation")


@hookimpl
def megablocks_grouped_gemm_kernels() -> list[Kernel]:
    return _kernels("grouped_gemm")


@hookimpl
def megablocks_activation_kernels() -> list[Kernel]:
    return _kernels("activation")
