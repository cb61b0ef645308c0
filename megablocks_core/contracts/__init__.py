"""Every op's contract, written once.

Read an entry top to bottom to know an op: its arguments (dtype, rank), the
rules relating them, what it returns, which inputs get gradients, edge cases,
and where it knowingly differs from MegaBlocks. Validation, fake (meta)
implementations, docs/contracts.md and the conformance kit are all derived
from these entries; nothing else describes an op.

Argument order is the kernel order: a backend's kernel receives exactly these
arguments, positionally. Public ops (``megablocks_core.ops``) take the same
arguments minus those marked ``public=False`` (passed as None).

One module per op family (``routing``, ``permutation``, ``grouped_gemm`` with the fused ops,
``activation``, ``moe_permute``, ``scaled`` (quantization and the FP8 grouped GEMMs),
``composite``) and ``common`` for what several share; this
package gathers them in :data:`ALL` and :data:`BY_NAME`. The contracts are data: they import
the schema, the activations and the bias definitions, nothing of the dispatch machinery
(``tests/test_import_graph.py``). The API is unpublished (0.1); once published, a contract that
changes gets a new version rather than back-compat shims.
"""

from __future__ import annotations

from ..schema import OpContract
from .activation import ACTIVATION_BACKWARD, GLU, GLU_BACKWARD
from .common import ANY_DTYPE
from .composite import REPEAT, ROUND_UP, SUM
from .grouped_gemm import GATHER_GMM, GMM, GMM_SCATTER, GMM_WEIGHT_GRAD, GMM_WEIGHT_GRAD_ACCUMULATE
from .moe_permute import MOE_PERMUTATION_OPS, ROW_MAP_FORMAT
from .permutation import (
    BINNED_GATHER,
    BINNED_SCATTER,
    BINNED_SCATTER_WGRAD,
    GATHER,
    PADDED_GATHER,
    PADDED_SCATTER,
    PADDED_SCATTER_WGRAD,
    SCATTER,
    SCATTER_WGRAD,
)
from .routing import (
    EXCLUSIVE_CUMSUM,
    HISTOGRAM,
    INCLUSIVE_CUMSUM,
    REPLICATE,
    REPLICATE_BACKWARD,
    ROUTE,
    ROUTER_TOPK,
    SORT,
    TOPOLOGY,
)
from .scaled import (
    QUANTIZE,
    QUANTIZE_BOTH_WAYS,
    QUANTIZE_TRANSPOSED,
    SCALED_GATHER_GMM,
    SCALED_GMM,
    SCALED_GMM_SCATTER,
    SCALED_GMM_WEIGHT_GRAD,
    SCALED_OPS,
)

ALL: tuple[OpContract, ...] = (
    SORT,
    HISTOGRAM,
    INCLUSIVE_CUMSUM,
    EXCLUSIVE_CUMSUM,
    TOPOLOGY,
    REPLICATE,
    REPLICATE_BACKWARD,
    ROUTE,
    ROUTER_TOPK,
    GATHER,
    SCATTER,
    SCATTER_WGRAD,
    PADDED_GATHER,
    PADDED_SCATTER,
    PADDED_SCATTER_WGRAD,
    BINNED_GATHER,
    BINNED_SCATTER,
    BINNED_SCATTER_WGRAD,
    *MOE_PERMUTATION_OPS,
    GMM,
    GMM_WEIGHT_GRAD,
    GMM_WEIGHT_GRAD_ACCUMULATE,
    GATHER_GMM,
    GMM_SCATTER,
    *SCALED_OPS,
    GLU,
    GLU_BACKWARD,
    ACTIVATION_BACKWARD,
    ROUND_UP,
    REPEAT,
    SUM,
)
BY_NAME: dict[str, OpContract] = {c.name: c for c in ALL}


def family_ops(family: str) -> tuple[str, ...]:
    """Names of the dispatched ops of one family (what a backend's hook for it may return)."""
    return tuple(c.name for c in ALL if c.family == family and c.dispatched)


__all__ = [
    "ACTIVATION_BACKWARD",
    "ALL",
    "ANY_DTYPE",
    "BINNED_GATHER",
    "BINNED_SCATTER",
    "BINNED_SCATTER_WGRAD",
    "BY_NAME",
    "EXCLUSIVE_CUMSUM",
    "GATHER",
    "GATHER_GMM",
    "GLU",
    "GLU_BACKWARD",
    "GMM",
    "GMM_SCATTER",
    "GMM_WEIGHT_GRAD",
    "GMM_WEIGHT_GRAD_ACCUMULATE",
    "HISTOGRAM",
    "INCLUSIVE_CUMSUM",
    "MOE_PERMUTATION_OPS",
    "PADDED_GATHER",
    "PADDED_SCATTER",
    "PADDED_SCATTER_WGRAD",
    "QUANTIZE",
    "QUANTIZE_BOTH_WAYS",
    "QUANTIZE_TRANSPOSED",
    "REPEAT",
    "REPLICATE",
    "REPLICATE_BACKWARD",
    "ROUND_UP",
    "ROUTE",
    "ROUTER_TOPK",
    "ROW_MAP_FORMAT",
    "SCALED_GATHER_GMM",
    "SCALED_GMM",
    "SCALED_GMM_SCATTER",
    "SCALED_GMM_WEIGHT_GRAD",
    "SCATTER",
    "SCATTER_WGRAD",
    "SORT",
    "SUM",
    "TOPOLOGY",
    "OpContract",
    "family_ops",
]
