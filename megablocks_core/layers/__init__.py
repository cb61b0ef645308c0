"""Applications of the ops: a dropless MoE layer, its expert parallelism and a training demo.

Nothing in the core's mechanism imports this package; it is written against
:mod:`megablocks_core.ops` like any user code.

- :mod:`megablocks_core.layers.moe` — :class:`DroplessMoE` (MegaBlocks' ``dMoE``);
- :mod:`megablocks_core.layers.parallel` — expert parallelism over ``torch.distributed``;
- :mod:`megablocks_core.layers.demo` — ``megablocks demo``: a tiny model trained on synthetic data;
- :mod:`megablocks_core.layers.shapes` — MoE layer shapes of well-known models.
"""

from __future__ import annotations

from .moe import DroplessMoE, dMoE, gelu_tanh, load_balancing_loss
from .parallel import all_to_all, expert_parallel_apply

__all__ = [
    "DroplessMoE",
    "all_to_all",
    "dMoE",
    "expert_parallel_apply",
    "gelu_tanh",
    "load_balancing_loss",
]
