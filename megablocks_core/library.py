"""``torch.library`` custom ops for ``torch.compile``, derived from the contracts.

Each dispatched op becomes ``torch.ops.megablocks.<name>`` with a schema, a fake
implementation (output shapes and dtypes from the contract; data-dependent
sizes become unbacked symbols) and the core's backward rule. Eager calls never
go through these wrappers (they cost several µs per call); the entry functions
in :mod:`megablocks_core.entries` switch to them only while compiling, and
register them (:func:`register`) when they are built.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from . import autograd, validation
from .contracts import ALL
from .schema import (
    BoolArg,
    ChoiceArg,
    FloatArg,
    IntArg,
    OpContract,
    TensorArg,
    is_option,
)

NAMESPACE = "megablocks"
_library = torch.library.Library(NAMESPACE, "DEF")


def schema(contract: OpContract) -> str:
    """The op's torch schema, e.g. ``gather(Tensor x, Tensor indices, …, SymInt top_k) -> Tensor``.

    A mutable argument is declared written (``Tensor(a!) out``, one alias set per such argument),
    and an op without outputs returns ``()``."""
    parts = []
    aliases = iter("abcdefghijklmnopqrstuvwxyz")
    for a in contract.args:
        if isinstance(a, TensorArg) and a.mutable:
            parts.append(f"Tensor({next(aliases)}!) {a.name}")
        elif isinstance(a, TensorArg) and a.serve is not None:  # a trailing option
            parts.append(f"Tensor? {a.name}=None")
        elif isinstance(a, TensorArg):
            parts.append(f"Tensor{'?' if a.optional else ''} {a.name}")
        elif isinstance(a, IntArg) and a.option is not None:  # a trailing option
            parts.append(f"SymInt? {a.name}=None")
        elif isinstance(a, IntArg):
            parts.append(f"SymInt{'?' if a.optional else ''} {a.name}")
        elif isinstance(a, BoolArg):
            parts.append(f"bool {a.name}")
        elif isinstance(a, ChoiceArg):
            parts.append(f"str? {a.name}=None")
        elif isinstance(a, FloatArg):  # a trailing option
            parts.append(f"float? {a.name}=None")
        else:  # pragma: no cover - composite-only argument kinds
            raise TypeError(f"{contract.name}: no schema for {a!r}")
    outs = (
        "Tensor"
        if len(contract.outputs) == 1
        else f"({', '.join('Tensor' for _ in contract.outputs)})"  # "()" for none
    )
    return f"{contract.name}({', '.join(parts)}) -> {outs}"


def _complete(contract: OpContract, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """All of the op's arguments: torch passes a trailing argument left at its schema default
    (``str? activation=None``, ``SymInt? rows=None``) on to the implementations only when it
    was given."""
    missing = contract.args[len(args) :]
    assert all(isinstance(a, ChoiceArg) or is_option(a) for a in missing), contract.name
    return (*args, *(None for _ in missing))


def _fake(contract: OpContract) -> Callable[..., Any]:
    def fake(*args: Any) -> Any:
        args = _complete(contract, args)
        validation.validate(contract, args, checked_mode=False, data_rules=False)
        bound = contract.bind(args)
        device = bound[contract.primary.name].device
        ctx = torch.library.get_ctx()
        metas = validation.output_meta(contract, bound, lambda _: ctx.new_dynamic_size())
        outs = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in metas]
        if not outs:
            return None  # an op that only writes its mutable arguments
        return outs[0] if len(outs) == 1 else tuple(outs)

    return fake


def _real(contract: OpContract, entry: Callable[..., Any]) -> Callable[..., Any]:
    def real(*args: Any) -> Any:
        with torch.no_grad():  # the custom op's own autograd formula records the graph
            return entry(*_complete(contract, args))

    return real


def _custom_call(op: str, *args: Any) -> Any:
    return getattr(torch.ops.megablocks, op)(*args)


def _register_autograd(contract: OpContract) -> None:
    diff_positions = [i for i, a in enumerate(contract.args) if a.name in contract.differentiable]

    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        given = len(inputs)
        inputs = _complete(contract, inputs)
        needs = {
            a.name: bool(i in diff_positions and isinstance(v, torch.Tensor) and v.requires_grad)
            for i, (a, v) in enumerate(zip(contract.args, inputs, strict=True))
        }
        tensors, consts = autograd.pack_for_backward(contract, inputs, needs)
        ctx.save_for_backward(*tensors)
        ctx.meta = (consts, needs, given)

    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        consts, needs, given = ctx.meta
        bound = autograd.unpack_for_backward(contract, ctx.saved_tensors, consts)
        grads = autograd.run_rule(contract, _custom_call, bound, grad, needs)
        return tuple(grads.get(a.name) if needs[a.name] else None for a in contract.args[:given])

    torch.library.register_autograd(
        f"{NAMESPACE}::{contract.name}", backward, setup_context=setup_context
    )


def register(entries: Mapping[str, Callable[..., Any]]) -> None:
    """Define ``torch.ops.megablocks.<op>`` for every dispatched op, running ``entries[op]`` (once
    per process: the entry functions call it when they are built)."""
    for contract in ALL:
        if contract.dispatched:
            _library.define(schema(contract))
            _library.impl(
                contract.name, _real(contract, entries[contract.name]), "CompositeExplicitAutograd"
            )
            torch.library.register_fake(
                f"{NAMESPACE}::{contract.name}", _fake(contract), lib=_library
            )
            if contract.differentiable:
                _register_autograd(contract)
