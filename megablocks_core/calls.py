"""A dispatched op run by name, for the core's modules that the entry functions import.

:mod:`megablocks_core.entries` builds one entry function per op and puts it in :data:`ENTRIES`;
a module below it (the contracts: ``gmm_scatter``'s activation as the core applies it around a
kernel without it runs the dispatched ``glu``) runs an op through :func:`call` without
importing the entries back, so the core's imports form no circle.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: Op name → entry function taking the kernel-order arguments (filled by the entries).
ENTRIES: dict[str, Callable[..., Any]] = {}


def call(op: str, *args: Any) -> Any:
    """Run a dispatched op (including kernel-only ops such as ``scatter_wgrad``) by name."""
    return ENTRIES[op](*args)
