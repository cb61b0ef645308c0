"""What every backward rule is written with: the rule's record, its call and gradient types, and
what a rule says the forward must keep."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from ..schema import OpContract

Call = Callable[..., torch.Tensor]
Grads = dict[str, "torch.Tensor | None"]


class GatheredRows(NamedTuple):
    """A weight gradient's row operand left ungathered: gather's arguments for it (the sorted
    rows ``x[indices[i] // top_k]``, weighted by ``weights[indices[i]]``, the first ``rows``).
    The backward rules pass one instead of the gathered tensor only to a call that reads its
    rows through the indices itself (:func:`reads_gathered_rows`: an FP8 weight gradient's
    ``gather_quantize_transposed``)."""

    x: torch.Tensor
    indices: torch.Tensor
    bin_ids: torch.Tensor
    weights: torch.Tensor | None
    bins: torch.Tensor
    top_k: int
    rows: int | None

    @property
    def sorted_rows(self) -> int:
        """How many sorted rows it holds."""
        return self.indices.shape[0] if self.rows is None else self.rows


def reads_gathered_rows(call: Call) -> bool:
    """Whether ``call`` takes a :class:`GatheredRows` operand in its weight gradients."""
    return bool(getattr(call, "reads_gathered_rows", False))


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
