"""Input validation derived from the contracts.

Two speeds, one source. :func:`validate` interprets a contract and raises a
precise ``TypeError``/``ValueError`` naming the op, the argument, what was
expected and what came. :func:`fast_check_source` turns the same contract's
cheap rules into one boolean Python expression that the dispatcher evaluates on
every call; only when it is false does the dispatcher call :func:`validate` to
say what is wrong.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch

from .contract import (
    RULE_HELPERS,
    BoolArg,
    IntArg,
    OpContract,
    Rule,
    SequenceArg,
    TensorArg,
)


class ContractError(ValueError):
    """Raised for a value that breaks an op's contract (shapes, ranges, devices)."""


class ContractTypeError(TypeError):
    """Raised for an argument of the wrong type or dtype."""


def _what(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dim()}-D tensor of {value.dtype} on {value.device}"
    return f"{type(value).__name__} {value!r}"[:120]


def _is_int(value: Any) -> bool:
    if isinstance(value, bool | torch.Tensor):
        return False
    if isinstance(value, int | torch.SymInt):
        return True
    try:
        operator.index(value)  # numpy integers
    except TypeError:
        return False
    return True


def _fail(op: OpContract, message: str, error: type[Exception]) -> None:
    kind = ContractTypeError if issubclass(error, TypeError) else ContractError
    raise kind(f"megablocks_core.ops.{op.name}: {message}")


def _check_arg(op: OpContract, spec: Any, value: Any) -> None:
    name = spec.name
    if isinstance(spec, TensorArg):
        if value is None and spec.optional:
            return
        expected = spec.describe()
        if not isinstance(value, torch.Tensor):
            _fail(op, f"argument '{name}' must be a {expected}; got {_what(value)}", TypeError)
        if spec.dtypes and value.dtype not in spec.dtypes:
            _fail(op, f"argument '{name}' must be a {expected}; got {_what(value)}", TypeError)
        if spec.ndim and value.dim() not in spec.ndim:
            _fail(op, f"argument '{name}' must be a {expected}; got {_what(value)}", ValueError)
    elif isinstance(spec, IntArg):
        if value is None and spec.optional:
            return
        if not _is_int(value):
            _fail(op, f"argument '{name}' must be an {spec.describe()}; got {_what(value)}", TypeError)
        if (spec.min is not None and value < spec.min) or (spec.max is not None and value > spec.max):
            _fail(op, f"argument '{name}' must be an {spec.describe()}; got {value}", ValueError)
    elif isinstance(spec, BoolArg) and not isinstance(value, bool):
        _fail(op, f"argument '{name}' must be a bool; got {_what(value)}", TypeError)
    elif isinstance(spec, SequenceArg) and (
            not isinstance(value, Sequence) or not all(_is_int(v) and v >= 0 for v in value)):
        _fail(op, f"argument '{name}' must be a sequence of non-negative ints; got {_what(value)}",
                  TypeError)


def _check_devices(op: OpContract, bound: dict[str, Any]) -> None:
    tensors = [(a, bound[a.name]) for a in op.tensor_args if isinstance(bound[a.name], torch.Tensor)]
    if not tensors:
        return
    primary_spec, primary = tensors[0]
    for spec, t in tensors[1:]:
        allowed = (primary.device,) + ((torch.device("cpu"),) if spec.any_device else ())
        if t.device not in allowed:
            where = " or the CPU" if spec.any_device and primary.device.type != "cpu" else ""
            _fail(op, f"argument '{spec.name}' must be on {primary.device}{where} like "
                      f"'{primary_spec.name}'; got a tensor on {t.device}", ValueError)


def _rule_applies(rule: Rule, bound: dict[str, Any], checked_mode: bool) -> bool:
    if rule.checked is False:
        return True
    if isinstance(rule.checked, str):
        on_cpu = bound[rule.checked].device.type == "cpu"
        return on_cpu or checked_mode
    return checked_mode


def _check_rule(op: OpContract, rule: Rule, bound: dict[str, Any]) -> None:
    scope = {**RULE_HELPERS, **bound}
    if eval(rule.code, scope):
        return
    got = []
    for operand in rule.operands:
        if operand in bound and isinstance(bound[operand], torch.Tensor):
            continue  # the tensor itself says nothing; its attributes are listed
        try:
            got.append(f"{operand}={eval(operand, scope)!r}")
        except Exception:  # an operand that only makes sense in context
            continue
    detail = f" (got {', '.join(got)})" if got else ""
    _fail(op, f"{rule.why}: expected {rule.expr}{detail}", rule.error)


def validate(op: OpContract, args: tuple[Any, ...], checked_mode: bool = False,
             data_rules: bool = True) -> tuple[Any, ...]:
    """Raise a precise error if ``args`` (kernel order) break ``op``'s contract.

    Returns the arguments with integer-like values (numpy integers) turned into
    ``int``, so kernels only ever see Python ints. ``data_rules=False`` skips
    every rule that reads tensor data (used while tracing, where tensors have no data).
    """
    if len(args) != len(op.args):
        _fail(op, f"expected {len(op.args)} arguments {op.arg_names}; got {len(args)}", TypeError)
    bound = op.bind(args)
    for spec in op.args:
        _check_arg(op, spec, bound[spec.name])
    _check_devices(op, bound)
    for rule in op.rules:
        if rule.checked is False or (data_rules and _rule_applies(rule, bound, checked_mode)):
            _check_rule(op, rule, bound)
    return tuple(_plain(spec, bound[spec.name]) for spec in op.args)


def _plain(spec: Any, value: Any) -> Any:
    if isinstance(spec, IntArg) and value is not None and not isinstance(value, int | torch.SymInt):
        return operator.index(value)
    return value


def check_data(op: OpContract, args: tuple[Any, ...]) -> None:
    """Run the rules that read tensor data (checked mode only; may sync the device)."""
    bound = op.bind(args)
    for rule in op.rules:
        if rule.checked:
            _check_rule(op, rule, bound)


# ---------------------------------------------------------------------------
# The fast path: a cache key per call, and what the key cannot vouch for.


def call_key_source(op: OpContract) -> str:
    """Tuple items that pin down everything the static rules look at.

    Every tensor's dtype, shape and device, and every int/bool argument's value.
    The dispatcher caches calls whose key :func:`validate` has accepted, so a
    repeated call shape is valid without evaluating a single rule.
    """
    items = []
    for spec in op.args:
        n = spec.name
        if isinstance(spec, TensorArg) and spec.optional:
            items.append(f"{n} if {n} is None else ({n}.dtype, {n}.shape, {n}.device)")
        elif isinstance(spec, TensorArg):
            items += [f"{n}.dtype", f"{n}.shape", f"{n}.device"]
        else:
            items.append(n)
    return ", ".join(items)


def fast_check_source(op: OpContract) -> str:
    """A boolean expression checked on every call, cache hit or not.

    Exact types of int/bool arguments (the key cannot tell ``2`` from ``numpy.int64(2)``,
    and kernels should only see Python ints), and the rules that read host data
    (CPU ``batch_sizes``), which no key can vouch for.
    """
    parts = []
    for spec in op.args:
        if isinstance(spec, IntArg):
            test = f"type({spec.name}) is int"
            parts.append(f"({spec.name} is None or {test})" if spec.optional else test)
        elif isinstance(spec, BoolArg):
            parts.append(f"type({spec.name}) is bool")
    for rule in op.rules:
        if isinstance(rule.checked, str):
            parts.append(f"({rule.checked}.device.type != 'cpu' or ({rule.expr}))")
    return " and ".join(parts) or "True"
