"""The glue: what a forward keeps, and the autograd node of an eager call."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import torch

from ..policy import Policy, policy_scope
from ..schema import OpContract, TensorArg
from ..validation import ContractError, ContractTypeError
from .base import Call, Grads, _kept_if_set, kept
from .fusion import _fusion_targets
from .rules import RULES

#: How an op's forward packs its arguments for one combination of inputs needing a gradient:
#: those needs by name; per tensor argument (position, "<name>.shape", kept for backward, the
#: position of an option that also keeps it when given or -1); per other argument (position,
#: name).
_Packing = tuple[
    Mapping[str, bool], tuple[tuple[int, str, bool, int], ...], tuple[tuple[int, str], ...]
]
#: (op, each argument's needs-gradient flag) → its packing, worked out once (a training step
#: calls each op with the same flags every time).
_PACKINGS: dict[tuple[str, tuple[bool, ...]], _Packing] = {}


def _packing(contract: OpContract, flags: tuple[bool, ...]) -> _Packing:
    found = _PACKINGS.get((contract.name, flags))
    if found is None:
        rule = RULES[contract.name]
        needs = MappingProxyType(
            {a.name: bool(f) for a, f in zip(contract.args, flags, strict=True)}
        )
        tensor_slots = tuple(
            (
                i,
                f"{a.name}.shape",
                kept(rule, a.name, needs),
                _kept_if_set(rule, contract, a.name, needs),
            )
            for i, a in enumerate(contract.args)
            if isinstance(a, TensorArg)
        )
        other_slots = tuple(
            (i, a.name) for i, a in enumerate(contract.args) if not isinstance(a, TensorArg)
        )
        found = _PACKINGS[(contract.name, flags)] = (needs, tensor_slots, other_slots)
    return found


def _pack(
    packing: _Packing, args: tuple[Any, ...]
) -> tuple[list[torch.Tensor | None], dict[str, Any]]:
    _, tensor_slots, other_slots = packing
    tensors: list[torch.Tensor | None] = []
    consts: dict[str, Any] = {}
    for i, shape_name, keep, option in tensor_slots:
        value = args[i]
        if value is None:  # an optional tensor not given
            tensors.append(None)
        else:
            keep = keep or (option >= 0 and args[option] is not None)
            tensors.append(value if keep else None)
            consts[shape_name] = tuple(value.shape)
    for i, name in other_slots:
        consts[name] = args[i]
    return tensors, consts


def pack_for_backward(
    contract: OpContract, args: tuple[Any, ...], needs: Mapping[str, bool]
) -> tuple[list[torch.Tensor | None], dict[str, Any]]:
    """Split the forward's arguments into tensors to save and constants to keep."""
    flags = tuple(bool(needs.get(a.name, False)) for a in contract.args)
    return _pack(_packing(contract, flags), args)


def unpack_for_backward(
    contract: OpContract, saved: tuple[torch.Tensor | None, ...], consts: Mapping[str, Any]
) -> dict[str, Any]:
    """The forward's arguments by name, for a backward rule (see :func:`pack_for_backward`)."""
    bound = dict(consts)
    bound.update(zip((a.name for a in contract.tensor_args), saved, strict=True))
    return bound


#: Leading arguments of :class:`_OpFunction` that are not the op's.
_NODE_ARGS = 4


def run_rule(
    contract: OpContract,
    call: Call,
    bound: Mapping[str, Any],
    grad: torch.Tensor,
    needs: Mapping[str, bool],
) -> Grads:
    """The op's backward rule; a contract error raised by an op it calls is re-raised naming the
    op whose backward this is (the caller never called the inner op)."""
    try:
        return RULES[contract.name].fn(call, bound, grad, needs)
    except (ContractError, ContractTypeError) as exc:
        if str(exc).startswith(f"megablocks_core.ops.{contract.name}:"):
            raise
        raise type(exc)(
            f"megablocks_core.ops.{contract.name}: its backward could not run: {exc}"
        ) from exc


class _OpFunction(torch.autograd.Function):
    """One autograd node for any differentiable op; the backward comes from :data:`RULES`."""

    @staticmethod
    def forward(
        ctx: Any,
        contract: OpContract,
        run: Callable[..., Any],
        policy: Policy,
        call: Call,
        *args: Any,
    ) -> Any:
        packing = _packing(contract, ctx.needs_input_grad[_NODE_ARGS:])
        needs = packing[0]
        tensors, consts = _pack(packing, args)
        rule = RULES[contract.name]
        if rule.fusable:  # eager only: torch.compile's autograd (library.py) never fuses
            consts.update(_fusion_targets(rule, contract, args, needs))
        ctx.save_for_backward(*tensors)
        ctx.meta = (contract, policy, call, consts, needs)
        return run(*args)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        contract, policy, call, consts, needs = ctx.meta
        bound = unpack_for_backward(contract, ctx.saved_tensors, consts)
        with policy_scope(policy):  # backward runs on the backends the forward was ranked with
            grads = run_rule(contract, call, bound, grad, needs)
        return (
            *(None,) * _NODE_ARGS,
            *(grads.get(a.name) if needs[a.name] else None for a in contract.args),
        )


def apply(
    contract: OpContract, run: Callable[..., Any], policy: Policy, call: Call, args: tuple[Any, ...]
) -> Any:
    """``run(*args)`` recorded as one autograd node; its backward runs the op's rule, calling other
    ops through ``call`` under ``policy`` (the policy the forward was ranked with)."""
    return _OpFunction.apply(contract, run, policy, call, *args)
