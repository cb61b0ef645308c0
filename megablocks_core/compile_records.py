"""The records of the ahead-of-time compile gate that a backend reads and returns.

:class:`CompileShape` (the layer shapes the gate knows: :data:`SHAPES`) is what
:meth:`~megablocks_core.hookspecs.BackendHooks.megablocks_compile_jobs` is asked about, and
:class:`CompileJob` what it returns. They live apart from the gate (:mod:`megablocks_core.aot`),
which loads the plugins through :mod:`megablocks_core.hookspecs`, so that the hook's
specification can name them without importing the gate.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch


@dataclass(frozen=True)
class CompileShape:
    """A MoE layer's shape, for which a backend lists the kernels it would launch."""

    name: str
    tokens: int
    hidden: int
    ffn: int
    experts: int
    top_k: int
    dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float32)
    """The activation dtypes to compile for: 16-bit training and the fp32 tile tables."""


#: The shapes the gate knows. ``training``: a qwen3-sized layer (1024 rows per expert);
#: ``decode``: the same layer at 64 tokens (4 rows per expert).
SHAPES: Mapping[str, CompileShape] = MappingProxyType(
    {
        "training": CompileShape("training", 16384, 2048, 768, 128, 8),
        "decode": CompileShape("decode", 64, 2048, 768, 128, 8),
    }
)


@dataclass(frozen=True)
class CompileJob:
    """One kernel variant to compile ahead of time, as the backend would launch it.

    ``signature``, ``constexprs`` and ``attrs`` are what Triton's ``ASTSource`` takes (the
    parameter types such as ``"*bf16"`` / ``"i32"`` / ``"constexpr"``; constexpr values and
    specialisation attributes keyed by argument path); ``options`` the compile options
    (``num_warps``, ``num_stages``, and on AMD ``waves_per_eu``, ``matrix_instr_nonkdim``, …).
    """

    kernel: str
    """The kernel's name, e.g. ``"gmm._gmm_kernel"``."""
    op: str
    """The op whose launch it is (``"gmm"``, ``"sort"``, …)."""
    variant: str
    """What distinguishes this launch from others of the kernel (dtype, tiles, path)."""
    fn: Any
    """The ``@triton.jit`` (or ``@gluon.jit``) function."""
    signature: Mapping[str, str]
    constexprs: Mapping[Any, Any]
    attrs: Mapping[Any, Any] = field(default_factory=dict)
    options: Mapping[str, Any] = field(default_factory=dict)
    spill_reason: str | None = None
    """Why spilling is accepted for this variant (then a spill is reported, not a failure)."""
