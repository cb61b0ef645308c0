"""Input and output validation derived from the contracts.

:func:`validate` interprets a contract and raises a precise ``TypeError``/``ValueError`` naming
the op, the argument, what was expected and what came. The entry functions evaluate the same
contract's cheap rules as one generated boolean expression on every call
(:func:`megablocks_core.entries.fast_check_source`) and call :func:`validate` only when it is
false, to say what is wrong. :func:`check_data` (the rules that read tensor data) and
:func:`check_outputs` serve checked mode.
"""

from __future__ import annotations

import ast
import functools
import numbers
import operator
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .schema import (
    RULE_HELPERS,
    BoolArg,
    ChoiceArg,
    DataDim,
    FloatArg,
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


class BackendError(RuntimeError):
    """A backend's kernel broke the op's contract (checked mode compares every result's shapes and
    dtypes with the contract), or raised an exception that cannot be re-raised as its own type."""


#: Python ints beyond int64 cannot reach a kernel (torch cannot hold them).
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
#: Bytes no device can hold: the 48-bit virtual address space of today's CPUs and GPUs.
ADDRESS_SPACE = 2**48


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


def _is_real(value: Any) -> bool:
    """A Python or numpy real number (not a bool, not a tensor)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


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
        if spec.mutable and not value.is_contiguous():
            _fail(
                op,
                f"argument '{name}' must be a {expected}; got a non-contiguous tensor "
                f"(strides {tuple(value.stride())} for shape {tuple(value.shape)})",
                ValueError,
            )
    elif isinstance(spec, IntArg):
        if value is None and spec.optional:
            return
        if not _is_int(value):
            _fail(
                op, f"argument '{name}' must be an {spec.describe()}; got {_what(value)}", TypeError
            )
        if not INT64_MIN <= value <= INT64_MAX:
            _fail(
                op,
                f"argument '{name}' must be an {spec.describe()} that fits int64; got {value}",
                ValueError,
            )
        if (spec.min is not None and value < spec.min) or (
            spec.max is not None and value > spec.max
        ):
            _fail(op, f"argument '{name}' must be an {spec.describe()}; got {value}", ValueError)
    elif isinstance(spec, BoolArg) and not isinstance(value, bool):
        _fail(op, f"argument '{name}' must be a bool; got {_what(value)}", TypeError)
    elif isinstance(spec, ChoiceArg) and value is not None:
        if not isinstance(value, str):
            _fail(op, f"argument '{name}' must be {spec.describe()}; got {_what(value)}", TypeError)
        if value not in spec.choices:
            _fail(op, f"argument '{name}' must be {spec.describe()}; got {value!r}", ValueError)
    elif isinstance(spec, FloatArg) and value is not None and not _is_real(value):
        _fail(op, f"argument '{name}' must be a {spec.describe()}; got {_what(value)}", TypeError)
    elif isinstance(spec, SequenceArg) and (
        not isinstance(value, Sequence) or not all(_is_int(v) and v >= 0 for v in value)
    ):
        _fail(
            op,
            f"argument '{name}' must be a sequence of non-negative ints; got {_what(value)}",
            TypeError,
        )


def _check_devices(op: OpContract, bound: dict[str, Any]) -> None:
    tensors = [
        (a, bound[a.name]) for a in op.tensor_args if isinstance(bound[a.name], torch.Tensor)
    ]
    if not tensors:
        return
    primary_spec, primary = tensors[0]
    for spec, t in tensors[1:]:
        allowed = (primary.device,) + ((torch.device("cpu"),) if spec.any_device else ())
        if t.device not in allowed:
            where = " or the CPU" if spec.any_device and primary.device.type != "cpu" else ""
            _fail(
                op,
                f"argument '{spec.name}' must be on {primary.device}{where} like "
                f"'{primary_spec.name}'; got a tensor on {t.device}",
                ValueError,
            )


def _has_no_data(bound: dict[str, Any]) -> bool:
    """True if a tensor argument is a meta tensor: shapes only, no data for a data rule to read."""
    return any(isinstance(v, torch.Tensor) and v.is_meta for v in bound.values())


def _rule_applies(rule: Rule, bound: dict[str, Any], checked_mode: bool) -> bool:
    if rule.checked is False:
        return True
    if isinstance(rule.checked, str):
        on_cpu = bound[rule.checked].device.type == "cpu"
        return on_cpu or (checked_mode and not _has_no_data(bound))
    return checked_mode and not _has_no_data(bound)


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


def validate(
    op: OpContract, args: tuple[Any, ...], checked_mode: bool = False, data_rules: bool = True
) -> tuple[Any, ...]:
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
    _check_output_sizes(op, bound)
    return tuple(_plain(spec, bound[spec.name]) for spec in op.args)


@functools.cache
def memory_limit(device: torch.device) -> int:
    """Bytes one output on ``device`` may take at most: the device's memory (the host's physical
    memory for the CPU), never more than the 48-bit address space."""
    try:
        if device.type == "cpu":
            return min(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), ADDRESS_SPACE)
        if device.type == "cuda":
            return min(torch.cuda.get_device_properties(device).total_memory, ADDRESS_SPACE)
    except (ValueError, OSError, RuntimeError, AttributeError):  # no sysconf, or no such device
        pass
    return ADDRESS_SPACE


def _bytes(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    size = n / 1024
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        if size < 1024:
            return f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} PiB"


def _names(expr: str) -> set[str]:
    return {
        node.id for node in ast.walk(ast.parse(expr, mode="eval")) if isinstance(node, ast.Name)
    }


def _unknown_size(dim: DataDim) -> None:
    return None


def output_meta(
    op: OpContract,
    bound: dict[str, Any],
    data_dim: Callable[[DataDim], Any] = _unknown_size,
) -> list[tuple[tuple[Any, ...], torch.dtype]]:
    """Each output's (shape, dtype) from the contract; ``data_dim`` sizes each dim that depends
    on data (None unless given)."""
    scope = {**RULE_HELPERS, **bound}
    result = []
    for out in op.outputs:
        if isinstance(out.shape, str):
            shape = tuple(eval(out.shape, scope))
        else:
            shape = tuple(
                data_dim(d) if isinstance(d, DataDim) else eval(d, scope) for d in out.shape
            )
        result.append((shape, eval(out.dtype, scope)))
    return result


def _check_output_sizes(op: OpContract, bound: dict[str, Any]) -> None:
    """Reject a call whose output could never be allocated (e.g. ``histogram(x, 2**40)``) with an
    error naming the argument that sizes it, before any allocator fails without naming the op."""
    primary = bound[op.primary.name]
    if not isinstance(primary, torch.Tensor) or primary.is_meta:
        return  # meta tensors allocate nothing
    try:
        shapes = output_meta(op, bound)
    except Exception:  # a shape the rules let through but cannot be evaluated: the kernel will say
        return
    limit = memory_limit(primary.device)
    for out, (shape, dtype) in zip(op.outputs, shapes, strict=True):
        if not all(isinstance(d, int) for d in shape if d is not None):
            return  # symbolic sizes (tracing): nothing to allocate here
        elements = 1
        for d in shape:
            elements *= d if d is not None else 1
        size = elements * (dtype.itemsize if hasattr(dtype, "itemsize") else 8)
        if elements <= INT64_MAX and size <= limit:
            continue
        exprs = (
            [out.shape]
            if isinstance(out.shape, str)
            else [d for d in out.shape if isinstance(d, str)]
        )
        used = set().union(*(_names(e) for e in exprs))
        sizing = [a.name for a in op.args if a.name in used and isinstance(a, IntArg | SequenceArg)]
        culprit = (
            ", ".join(f"argument '{n}' = {bound[n]!r}" for n in sizing)
            if sizing
            else "the input shapes"
        )
        shown = tuple("?" if d is None else d for d in shape)
        _fail(
            op,
            f"{culprit} would make output '{out.name}' of shape {shown} {dtype} "
            f"({_bytes(size)}), more than the {_bytes(limit)} of memory of device {primary.device}",
            ValueError,
        )


def check_outputs(op: OpContract, args: tuple[Any, ...], result: Any, backend: str) -> None:
    """Checked mode: the kernel's outputs have the contract's count, shapes, dtypes and device
    (sizes that depend on data are not read)."""
    bound = op.bind(args)
    device = bound[op.primary.name].device
    where = f"megablocks_core.ops.{op.name}: the {backend!r} kernel"
    if not op.outputs:  # it writes its mutable arguments in place and returns nothing
        if result is not None:
            written = ", ".join(f"'{a.name}'" for a in op.mutated)
            raise BackendError(
                f"{where} returned {_what(result)}; the contract says it returns None "
                f"(it writes {written} in place)"
            )
        return
    outs = result if isinstance(result, tuple) else (result,)
    if len(outs) != len(op.outputs):
        raise BackendError(
            f"{where} returned {len(outs)} output(s); the contract says {len(op.outputs)}"
        )
    for out, value, (shape, dtype) in zip(op.outputs, outs, output_meta(op, bound), strict=True):
        if not isinstance(value, torch.Tensor):
            raise BackendError(
                f"{where} returned {_what(value)} as output '{out.name}'; "
                "the contract says a tensor"
            )
        got_shape = tuple(value.shape)
        shape_ok = len(got_shape) == len(shape) and all(
            want is None or want == got for want, got in zip(shape, got_shape, strict=True)
        )
        if not shape_ok or value.dtype != dtype or value.device != device:
            shown = tuple("any" if d is None else d for d in shape)
            raise BackendError(
                f"{where} returned output '{out.name}' of shape {got_shape} {value.dtype} "
                f"on {value.device}; the contract says {shown} {dtype} on {device}"
            )


def _plain(spec: Any, value: Any) -> Any:
    if isinstance(spec, IntArg) and value is not None and not isinstance(value, int | torch.SymInt):
        return operator.index(value)
    if isinstance(spec, FloatArg) and value is not None and type(value) is not float:
        return float(value)  # kernels see Python floats only (an int or numpy float converted)
    return value


def check_data(op: OpContract, args: tuple[Any, ...]) -> None:
    """Run the rules that read tensor data (checked mode only; may sync the device)."""
    bound = op.bind(args)
    if _has_no_data(bound):
        return  # meta tensors: shapes only (the shape rules have run)
    for rule in op.rules:
        if rule.checked:
            _check_rule(op, rule, bound)
