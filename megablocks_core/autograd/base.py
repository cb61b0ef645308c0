"""What every backward rule is written with: the rule's record, its call and gradient types, and
what a rule says the forward must keep."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..schema import OpContract

Call = Callable[..., torch.Tensor]
Grads = dict[str, "torch.Tensor | None"]


@dataclass(frozen=True)
class BackwardRule:
    fn: Callable[[Call, Mapping[str, Any], torch.Tensor, Mapping[str, bool]], Grads]
    saves: tuple[str, ...]
    """Tensor arguments the backward reads (others are not kept alive)."""
    saves_if: Mapping[str, str | tuple[str, ...]] = field(default_factory=dict)
    """Argument → the input(s) whose gradient needs it (``x`` only if ``weights`` needs grad)."""
    saves_if_set: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    """Argument → (an option, an input): also kept when that option is given (not None) and
    that input needs a gradient (gmm_scatter's x when an activation is to be differentiated)."""
    fusable: tuple[str, ...] = ()
    """Weight arguments whose gradient the rule can add into the parameter's existing gradient
    (gradient-accumulation fusion); the rule finds an opted-in one as ``"<name>.fused"``."""


def _cast(t: torch.Tensor | None, like: torch.Tensor | None) -> torch.Tensor | None:
    return t if t is None or like is None else t.to(like.dtype)


def kept(rule: BackwardRule, name: str, needs: Mapping[str, bool]) -> bool:
    """Whether the forward must keep argument ``name`` for this backward."""
    if name in rule.saves:
        return True
    dependants = rule.saves_if.get(name, ())
    if isinstance(dependants, str):
        dependants = (dependants,)
    return any(needs.get(d, False) for d in dependants)


def _kept_if_set(
    rule: BackwardRule, contract: OpContract, name: str, needs: Mapping[str, bool]
) -> int:
    """Position of the option that, when given, also keeps argument ``name``; -1 if none does
    for these needs."""
    option, dependant = rule.saves_if_set.get(name, ("", ""))
    if not option or not needs.get(dependant, False):
        return -1
    return contract.arg_names.index(option)
