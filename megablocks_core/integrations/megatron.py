"""Megatron-Core's fused permutation on megablocks-core, without Transformer Engine.

Megatron-Core's ``moe_utils.permute``/``unpermute``/``sort_chunks_by_idxs`` with ``fused=True``
(``moe_permute_fusion``) call ``fused_permute``, ``fused_permute_with_probs``,
``fused_unpermute`` and ``fused_sort_chunks_by_index(_with_probs)``, names that
``megatron.core.transformer.moe.moe_utils`` imports from Transformer Engine, and refuse to run
when it is absent (``HAVE_TE`` false). :func:`install` sets those names to
:mod:`megablocks_core.integrations.transformer_engine`'s functions, so a Megatron user on an AMD
GPU or another vendor's device gets fused, sync-free permutation served by megablocks-core's
backends::

    from megablocks_core.integrations import megatron
    megatron.install()  # before building the model; then moe_permute_fusion=True works

FP8 rows: the permutations also take quantized tokens with their scales,
:class:`~megablocks_core.integrations.transformer_engine.QuantizedRows` (data in an FP8 dtype,
float32 scales of ``fp8_rowwise`` or ``fp8_blockwise``), and return them permuted the same way,
padding rows included (the rules: that module's docstring). Megatron-Core's ``permute`` and
``sort_chunks_by_idxs`` with ``fused=True`` hand ``tokens`` to these functions untouched, so
QuantizedRows pass through them; ``unpermute`` stays in the experts' output dtype (bf16).

Megatron-Core is imported only when :func:`install` runs.
"""

from __future__ import annotations

import importlib
from typing import Any

from torch import Tensor

from . import transformer_engine as te
from .transformer_engine import QuantizedRows

#: moe_utils' names of the fused permutation functions, and ours.
_PERMUTATION_NAMES = (
    "fused_permute",
    "fused_permute_with_probs",
    "fused_unpermute",
    "fused_sort_chunks_by_index",
    "fused_sort_chunks_by_index_with_probs",
)
#: Other names moe_utils imports from Transformer Engine: set to None where missing, so that
#: their own ``is None`` checks still refuse them with Megatron's message.
_OTHER_TE_NAMES = (
    "fused_compute_score_for_moe_aux_loss",
    "fused_moe_aux_loss",
    "fused_topk_with_score_function",
    "te_general_gemm",
)

_saved: dict[str, Any] = {}
_MISSING = object()


def fused_permute(
    tokens: Tensor | QuantizedRows, routing_map: Tensor, num_out_tokens: int | Tensor | None = None
) -> tuple[Tensor | QuantizedRows, Tensor]:
    return te.moe_permute(tokens, routing_map, -1 if num_out_tokens is None else num_out_tokens)


def fused_permute_with_probs(
    tokens: Tensor | QuantizedRows,
    probs: Tensor,
    routing_map: Tensor,
    num_out_tokens: int | Tensor | None = None,
) -> tuple[Tensor | QuantizedRows, Tensor, Tensor]:
    rows = -1 if num_out_tokens is None else num_out_tokens
    return te.moe_permute_with_probs(tokens, probs, routing_map, rows)


def fused_unpermute(
    permuted: Tensor,
    row_id_map: Tensor,
    merging_probs: Tensor | None = None,
    restore_shape: Any = None,
) -> Tensor:
    return te.moe_unpermute(permuted, row_id_map, merging_probs, restore_shape)


fused_sort_chunks_by_index = te.moe_sort_chunks_by_index
fused_sort_chunks_by_index_with_probs = te.moe_sort_chunks_by_index_with_probs


def _moe_utils() -> Any:
    return importlib.import_module("megatron.core.transformer.moe.moe_utils")


def install(replace_transformer_engine: bool = False) -> bool:
    """Make ``moe_utils``' fused permutation path run on megablocks-core. Does nothing (returns
    False) where Transformer Engine is installed, unless ``replace_transformer_engine``; returns
    True when the names are set. Idempotent; :func:`uninstall` undoes it."""
    moe_utils = _moe_utils()
    if getattr(moe_utils, "HAVE_TE", False) and not replace_transformer_engine and not _saved:
        return False
    if not _saved:
        for name in ("HAVE_TE", *_PERMUTATION_NAMES, *_OTHER_TE_NAMES):
            _saved[name] = getattr(moe_utils, name, _MISSING)
    for name in _PERMUTATION_NAMES:
        setattr(moe_utils, name, globals()[name])
    for name in _OTHER_TE_NAMES:
        if _saved[name] is _MISSING:
            setattr(moe_utils, name, None)
    # moe_utils tests HAVE_TE before each fused name; the names it lacks are None (refused).
    moe_utils.HAVE_TE = True
    return True


def uninstall() -> None:
    """Restore ``moe_utils`` as it was before :func:`install`."""
    if not _saved:
        return
    moe_utils = _moe_utils()
    for name, value in _saved.items():
        if value is _MISSING:
            if hasattr(moe_utils, name):
                delattr(moe_utils, name)
        else:
            setattr(moe_utils, name, value)
    _saved.clear()


def installed() -> bool:
    return bool(_saved)
