"""The core's autograd, written once for every backend: backward rules and the glue that runs them.

Each rule receives ``call(op, *args)``, which runs another op through the
registry (kernel-order arguments), and the forward's arguments by name (those
not kept are None; ``"<name>.shape"`` gives each tensor argument's shape). So a
backend that supplies only forward kernels is autograd-correct. The same rules serve eager autograd
(:func:`apply`, called by the entry functions of :mod:`megablocks_core.entries`) and
``torch.compile`` (:mod:`megablocks_core.library`); :func:`pack_for_backward` and
:func:`unpack_for_backward` decide what both keep for the backward.

Gradient-accumulation fusion (opt-in per parameter, :func:`fuse_grad_accumulation`) is
described in :mod:`megablocks_core.autograd.fusion`.

The package, by job: ``base.py`` (the rule record, :func:`kept`), ``fusion.py``
(gradient-accumulation fusion), the rules by op family (``permutation.py``, ``gmm.py``,
``moe_permute.py``), ``rules.py`` (:data:`RULES`, the table of them) and ``function.py`` (the
glue: packing, :func:`run_rule`, the autograd node, :func:`apply`).
"""

from .base import BackwardRule, Call, Grads, kept
from .function import apply, pack_for_backward, run_rule, unpack_for_backward
from .fusion import FUSION_ATTRIBUTE, fuse_grad_accumulation, is_grad_accumulation_fused
from .rules import ROUTING_SAVES, RULES

__all__ = [
    "FUSION_ATTRIBUTE",
    "ROUTING_SAVES",
    "RULES",
    "BackwardRule",
    "Call",
    "Grads",
    "apply",
    "fuse_grad_accumulation",
    "is_grad_accumulation_fused",
    "kept",
    "pack_for_backward",
    "run_rule",
    "unpack_for_backward",
]
