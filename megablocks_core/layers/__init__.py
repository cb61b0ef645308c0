"""Applications of the ops: a dropless MoE layer, its options and its expert parallelism.

Nothing in the core's mechanism imports this package; it is written against
:mod:`megablocks_core.ops` like any user code.

- :mod:`megablocks_core.layers.config` — :class:`MoEConfig`, every option of the layer in one
  checked record (MegaBlocks' ``Arguments``);
- :mod:`megablocks_core.layers.moe` — :class:`DroplessMoE` (MegaBlocks' ``dMoE``);
- :mod:`megablocks_core.layers.parallel` — expert parallelism over ``torch.distributed`` (the
  layer's exchange; the benchmarks' baseline exchange is imported from that module).

``megablocks demo``'s model lives in :mod:`megablocks_core.demo`, the named model shapes in
:mod:`megablocks_core.shapes`.
"""

from __future__ import annotations

from .config import MoEConfig
from .moe import DroplessMoE, dMoE, gelu_tanh, load_balancing_loss

__all__ = [
    "DroplessMoE",
    "MoEConfig",
    "dMoE",
    "gelu_tanh",
    "load_balancing_loss",
]
