"""The entry functions of the dispatched ops, generated from the contracts.

For each contract the core builds one function with the op's kernel-order signature (its source
is kept in ``ENTRIES[name].__source__`` and registered with :mod:`linecache`, so tracebacks show
its lines). On every eager call it:

1. builds a key of every tensor's (dtype, shape, device), the int/bool arguments and the active
   policy (:func:`call_key_source`);
2. on a cache miss, validates the call fully and chooses its kernel
   (:func:`megablocks_core.dispatch.resolve`); a hit means the call was already validated;
3. checks what a key cannot vouch for (exact int types, host-side data such as CPU
   ``batch_sizes``: :func:`fast_check_source`);
4. runs the data rules only in checked mode (``MEGABLOCKS_CHECK=1``), and there also compares the
   kernel's outputs with the contract's shapes and dtypes;
5. goes through autograd (:func:`megablocks_core.autograd.apply`) only if a differentiable input
   needs a gradient;
6. calls the kernel; an exception it raises is re-raised naming the op and the backend (the
   original is its ``__cause__``), on the exception path only.

Under ``torch.compile`` the entry calls the op's ``torch.library`` custom op instead, so tracing
sees one node with a fake implementation; this module registers those custom ops
(:func:`megablocks_core.library.register`) once the entries exist.
"""

from __future__ import annotations

import linecache
from collections.abc import Callable
from typing import Any

import torch

from . import autograd, library, validation
from .calls import ENTRIES, call
from .contracts import ALL
from .dispatch import SHAPE_CACHE_LIMIT, Selected, new_cache, resolve
from .policy import Policy, context_policy, current_policy, overrides
from .ranking import NoKernelError
from .schema import (
    RULE_HELPERS,
    BoolArg,
    ChoiceArg,
    FloatArg,
    IntArg,
    OpContract,
    SequenceArg,
    TensorArg,
    is_option,
)
from .validation import BackendError, ContractError, ContractTypeError


def call_key_source(op: OpContract) -> str:
    """Tuple items that pin down everything the static rules look at.

    Every tensor's dtype, shape and device, and every int/bool argument's value.
    The selection cache holds calls whose key :func:`~megablocks_core.validation.validate` has
    accepted, so a repeated call shape is valid without evaluating a single rule.
    """
    items = []
    for spec in op.args:
        n = spec.name
        if isinstance(spec, TensorArg) and spec.optional:
            items.append(f"{n} if {n} is None else ({n}.dtype, {n}.shape, {n}.device)")
        elif isinstance(spec, TensorArg):
            items += [f"{n}.dtype", f"{n}.shape", f"{n}.device"]
        elif isinstance(spec, SequenceArg):  # a list too (unhashable as it is)
            items.append(f"tuple({n})")
        else:
            items.append(n)
    return ", ".join(items)


def fast_check_source(op: OpContract) -> str:
    """A boolean expression checked on every call, cache hit or not; only when it is false does
    the entry call :func:`~megablocks_core.validation.validate` to say what is wrong.

    Exact types of int/bool/float arguments (the key cannot tell ``2`` from ``numpy.int64(2)``,
    and kernels should only see Python ints and floats), the contiguity of mutable arguments (not in the
    key either), and the rules that read host data (CPU ``batch_sizes``), which no key can vouch
    for.
    """
    parts = []
    for spec in op.args:
        if isinstance(spec, TensorArg) and spec.mutable:
            parts.append(f"{spec.name}.is_contiguous()")
        elif isinstance(spec, IntArg):
            test = f"type({spec.name}) is int"
            parts.append(f"({spec.name} is None or {test})" if spec.optional else test)
        elif isinstance(spec, BoolArg):
            parts.append(f"type({spec.name}) is bool")
        elif isinstance(spec, ChoiceArg):  # an exact str: kernels compare it by value
            n = spec.name
            parts.append(f"({n} is None or (type({n}) is str and {n} in {spec.choices!r}))")
        elif isinstance(spec, FloatArg):  # an int or numpy float is converted by validation
            parts.append(f"({spec.name} is None or type({spec.name}) is float)")
        elif isinstance(spec, SequenceArg):  # its key holds the values, not their types
            n = spec.name
            parts.append(f"(type({n}) in (list, tuple) and all(type(v) is int for v in {n}))")
    for rule in op.rules:
        if isinstance(rule.checked, str):
            parts.append(f"({rule.checked}.device.type != 'cpu' or ({rule.expr}))")
    return " and ".join(parts) or "True"


def _kernel_failed(contract: OpContract, selected: Selected, exc: Exception) -> BaseException:
    """The exception to raise for one a kernel raised: its type (or :class:`BackendError` where that
    type cannot be built from a message), naming op and backend, the original as ``__cause__``."""
    message = (
        f"megablocks_core.ops.{contract.name}: the {selected.kernel.label!r} kernel raised "
        f"{type(exc).__name__}: {exc}"
    )
    if isinstance(
        exc, ContractError | ContractTypeError | NoKernelError
    ) and f"ops.{contract.name}:" in str(exc):
        return (
            exc  # the core's own error for this op (e.g. raised by the validation of a nested call)
        )
    if isinstance(exc, RecursionError):  # said once, not once per level of the recursion
        if str(exc).startswith("megablocks_core.ops."):
            return exc
        message += (
            " (a kernel that calls its own op is chosen again: hand the call to another backend "
            f"with megablocks_core.plugin.call_op({contract.name!r}, ..., backend='reference'), "
            "or decline it up front with the kernel's supports or dtypes)"
        )
    try:
        wrapped = type(exc)(message)
        if not isinstance(wrapped, Exception) or wrapped.args != (message,):
            raise TypeError  # an exception type that does not take a message
    except Exception:
        wrapped = BackendError(message)
    wrapped.__cause__ = exc
    return wrapped


def _apply_autograd(
    contract: OpContract, selected: Selected, policy: Policy, args: tuple[Any, ...]
) -> Any:
    return autograd.apply(contract, selected.run, policy, call, args)


def _run_checked(
    contract: OpContract,
    selected: Selected,
    policy: Policy,
    args: tuple[Any, ...],
    wants_grad: bool,
) -> Any:
    """Checked mode: the data rules, the call, then the outputs against the contract."""
    validation.check_data(contract, args)
    try:
        result = (
            _apply_autograd(contract, selected, policy, args) if wants_grad else selected.run(*args)
        )
    except Exception as exc:
        raise _kernel_failed(contract, selected, exc)  # noqa: B904 (the cause is set there)
    validation.check_outputs(contract, args, result, selected.kernel.label)
    return result


def _signature_source(contract: OpContract) -> str:
    """The entry's parameters: the trailing options (a caller may leave them out:
    :func:`~megablocks_core.schema.is_option`) default to None."""
    names = list(contract.arg_names)
    at = len(names)
    while at and is_option(contract.args[at - 1]):
        at -= 1
    return ", ".join(names[:at] + [f"{n}=None" for n in names[at:]])


def _entry_source(contract: OpContract) -> str:
    params = ", ".join(contract.arg_names)
    optional = {a.name for a in contract.tensor_args if a.optional}
    grad_test = " or ".join(
        f"({n} is not None and {n}.requires_grad)" if n in optional else f"{n}.requires_grad"
        for n in contract.differentiable
    )
    wants_grad = f"(({grad_test}) and _grad_enabled())" if contract.differentiable else "False"
    autograd_branch = (
        f"        if {wants_grad}:\n"
        f"            return _apply_autograd(_contract, chosen, key[-1], ({params},))\n"
        if contract.differentiable
        else ""
    )
    # The try around the kernel call costs nothing until a kernel raises (Python >= 3.11).
    return (
        f"def {contract.name}({_signature_source(contract)}):\n"
        f"    if _is_compiling():\n"
        f"        return _compiled({params})\n"
        f"    try:\n"
        f"        key = ({call_key_source(contract)}, _context_policy() or _overrides.policy)\n"
        f"        chosen = _cache.get(key)\n"
        f"    except (AttributeError, TypeError):  # not a tensor, or unhashable: validation says which\n"
        f"        key = chosen = None\n"
        f"    if chosen is None:\n"
        f"        chosen = _resolve(_contract, key, ({params},))\n"
        f"    if not ({fast_check_source(contract)}):\n"
        f"        {params}, = _validate(_contract, ({params},))\n"
        f"    if _overrides.checked:\n"
        f"        return _run_checked(_contract, chosen, key[-1] if key else _current_policy(), "
        f"({params},), {wants_grad})\n"
        f"    try:\n"
        f"{autograd_branch}"
        f"        return chosen.run({params})\n"
        f"    except Exception as exc:\n"
        f"        raise _kernel_failed(_contract, chosen, exc)\n"
    )


def _compiled_op(name: str) -> Callable[..., Any]:
    def call_custom_op(*args: Any) -> Any:
        return getattr(torch.ops.megablocks, name)(*args)

    return call_custom_op


def _generated(name: str, source: str, scope: dict[str, Any]) -> Callable[..., Any]:
    """The function ``name`` defined by ``source``, run in ``scope``; its source kept in
    ``__source__`` and in linecache (tracebacks and debuggers read source lines through it; mtime
    None: linecache.checkcache never drops an entry that has no file behind it)."""
    filename = f"<megablocks_core.entries {name}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    exec(compile(source, filename, "exec"), scope)
    function: Callable[..., Any] = scope[name]
    function.__source__ = source  # type: ignore[attr-defined]
    return function


# Why the entries are generated (exec) at run time and not plain closures: a closure has to walk
# the contract's argument specs on every call to build the key and run the checks; one that does
# only the hot path of a cache hit (key, cache lookup, int/bool type checks, checked-mode flag,
# gradient test, kernel call) measured 2.3 µs a call of gather against the generated entry's
# 1.4 µs (CPU, a null kernel, best of 7 x 20000 calls), +0.9 µs where the dispatch overhead is
# about 1.2 µs in all (benchmarks/dispatch_overhead.py). Each generated source is kept in
# __source__ and linecache, so tracebacks and tests read it.
def _build_entry(contract: OpContract) -> Callable[..., Any]:
    scope: dict[str, Any] = {
        **RULE_HELPERS,
        "_contract": contract,
        "_cache": new_cache(contract.name),
        "_overrides": overrides,
        "_context_policy": context_policy,
        "_resolve": resolve,
        "_validate": validation.validate,
        "_run_checked": _run_checked,
        "_kernel_failed": _kernel_failed,
        "_current_policy": current_policy,
        "_is_compiling": torch.compiler.is_compiling,
        "_grad_enabled": torch.is_grad_enabled,
        "_apply_autograd": _apply_autograd,
        "_compiled": _compiled_op(contract.name),
    }
    entry = _generated(contract.name, _entry_source(contract), scope)
    entry.__qualname__ = entry.__name__ = contract.name
    entry.__doc__ = contract.summary
    return entry


def _validator_source(contract: OpContract) -> str:
    params = ", ".join(contract.arg_names)
    return (
        f"def validate_{contract.name}(args):\n"
        f"    if _overrides.checked or len(args) != {len(contract.args)}:\n"
        f"        return _validation.validate(_contract, args, _overrides.checked)\n"
        f"    {params}, = args\n"
        f"    try:\n"
        f"        key = ({call_key_source(contract)},)\n"
        f"        seen = key in _seen\n"
        f"    except (AttributeError, TypeError):  # not a tensor, or unhashable\n"
        f"        key, seen = None, False\n"
        f"    if seen and ({fast_check_source(contract)}):\n"
        f"        return args\n"
        f"    args = _validation.validate(_contract, args, False)\n"
        f"    if key is not None:\n"
        f"        if len(_seen) >= _limit:\n"
        f"            _seen.clear()\n"
        f"        _seen.add(key)\n"
        f"    return args\n"
    )


def validator(contract: OpContract) -> Callable[[tuple[Any, ...]], tuple[Any, ...]]:
    """A function that validates ``contract``'s kernel-order arguments as its entry does, for
    code that checks a contract without its entry (the FP8 functions, the composite ops): a call key already
    accepted is valid after the fast checks (:func:`fast_check_source`), any other call is
    validated fully (:func:`megablocks_core.validation.validate`; in checked mode always,
    data rules included). Returns the arguments as validation returns them."""
    scope: dict[str, Any] = {
        **RULE_HELPERS,
        "_contract": contract,
        "_seen": set(),
        "_limit": SHAPE_CACHE_LIMIT,
        "_overrides": overrides,
        "_validation": validation,  # looked up per call: tests count its validate calls
    }
    return _generated(f"validate_{contract.name}", _validator_source(contract), scope)


# ENTRIES (megablocks_core.calls): op name → entry function taking the kernel-order arguments.
ENTRIES.update({c.name: _build_entry(c) for c in ALL if c.dispatched})


# torch.ops.megablocks.<op>, which the entries call while compiling.
library.register(ENTRIES)
