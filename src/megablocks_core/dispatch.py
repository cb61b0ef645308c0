"""The call path of every dispatched op.

For each contract the core builds one entry function with the op's kernel-order
signature (its source is kept in ``ENTRIES[name].__source__``). On every eager
call it:

1. builds a key of every tensor's (dtype, shape, device), the int/bool
   arguments and the active policy;
2. on a cache miss, validates the call fully against the contract
   (:func:`megablocks_core.validation.validate` raises precise errors) and
   looks up the kernel, ranked once per (device, dtypes, policy) by
   :mod:`megablocks_core.ranking`; a hit means the call was already validated;
3. checks what a key cannot vouch for (exact int types, host-side data such as
   CPU ``batch_sizes``);
4. runs the data rules only in checked mode (``MEGABLOCKS_CHECK=1``), and there
   also compares the kernel's outputs with the contract's shapes and dtypes;
5. goes through autograd only if a differentiable input needs a gradient;
6. calls the kernel; an exception it raises is re-raised naming the op and the
   backend (the original is its ``__cause__``), on the exception path only.

The overrides in the environment (``MEGABLOCKS_BACKEND``, ``MEGABLOCKS_CHECK``)
are read when this module is imported, so they hold from the first call; the
plugins themselves load on first use (or at import with
``MEGABLOCKS_STRICT_PLUGINS=1``, see :mod:`megablocks_core`).

Under ``torch.compile`` the entry calls the op's ``torch.library`` custom op
instead, so tracing sees one node with a fake implementation.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from . import autograd, validation
from .contract import OpContract
from .contracts import ALL, BY_NAME
from .descriptors import CallInfo, DeviceInfo, Kernel, TensorMeta
from .devices import describe
from .ranking import DEFAULT_POLICY, NoKernelError, Policy, Trace, choose, for_call, rank
from .registry import Registry, load
from .validation import BackendError, ContractError, ContractTypeError

log = logging.getLogger("megablocks_core")


class _State:
    """Process-wide settings, read from the environment by :func:`reload`."""

    registry: Registry | None = None
    env_spec: str = ""
    env_policy: Policy = DEFAULT_POLICY
    set_policy: Policy | None = None
    policy: Policy = DEFAULT_POLICY
    """The policy outside any :func:`use_backend` block: set_policy, else env_policy."""
    checked: bool = False
    warned: set[tuple[str, str]]

    def __init__(self) -> None:
        self.warned = set()


_state = _State()
_context_policy: contextvars.ContextVar[Policy | None] = contextvars.ContextVar(
    "megablocks_backend", default=None)
_caches: dict[str, dict[Any, Selected]] = {}  # op → validated call key → choice
_ranked: dict[str, dict[Any, Selected]] = {}  # op → (device, dtypes, policy) → choice
_served: dict[str, set[str]] = {}  # op → labels of the kernels chosen so far


def current_policy() -> Policy:
    """The ranking overrides in force here: context > :func:`set_backend` > environment."""
    return _context_policy.get() or _state.policy


def _update_default_policy() -> None:
    _state.policy = _state.set_policy if _state.set_policy is not None else _state.env_policy


def _env_policy(env: Mapping[str, str]) -> tuple[str, Policy]:
    spec = env.get("MEGABLOCKS_BACKEND", "").strip()
    if spec == _state.env_spec:  # the same object: cache keys made before a reload stay valid
        return spec, _state.env_policy
    policy = Policy.parse(spec) if spec else DEFAULT_POLICY
    unknown_ops = sorted({op for op, _ in policy.per_op} - set(BY_NAME))
    if unknown_ops:  # a typo must not silently leave an op on the default ranking
        raise ValueError(f"MEGABLOCKS_BACKEND={spec!r} names unknown op(s) {unknown_ops}; "
                         f"ops are {sorted(BY_NAME)}")
    return spec, policy


def _read_overrides(env: Mapping[str, str]) -> None:
    """Take the environment's overrides (cheap: no plugin is loaded)."""
    _state.env_spec, _state.env_policy = _env_policy(env)
    _state.checked = env.get("MEGABLOCKS_CHECK", "") not in ("", "0")
    _update_default_policy()


def reload(env: Mapping[str, str] | None = None) -> Registry:
    """Re-read the environment, rediscover plugins and forget every cached choice."""
    env = os.environ if env is None else env
    _env_policy(env)  # a bad MEGABLOCKS_BACKEND raises before anything changes
    loaded = load(env)  # may raise (strict mode): then nothing below changes
    _read_overrides(env)
    policy = _state.env_policy
    names = [*policy.prefer, *([policy.force] if policy.force else []), *(b for _, b in policy.per_op)]
    for name in dict.fromkeys(n.partition("/")[0] for n in names):
        record = loaded.plugins.get(name)
        if record is None:
            log.warning("megablocks: MEGABLOCKS_BACKEND names %r, which is not installed", name)
        elif record.status != "ok":
            log.warning("megablocks: MEGABLOCKS_BACKEND names %r, which is %s: %s", name,
                        record.status, record.reason)
    _state.registry = loaded
    _update_default_policy()
    _state.warned.clear()
    for cache in (*_caches.values(), *_ranked.values(), *_served.values()):
        cache.clear()
    return _state.registry


def registry() -> Registry:
    """The loaded plugins (discovered on first use)."""
    return _state.registry if _state.registry is not None else reload()


def _policy_from(names: tuple[str, ...], per_op: Mapping[str, str], source: str) -> Policy | None:
    unknown = set(per_op) - set(BY_NAME)
    if unknown:
        raise ValueError(f"use_backend: unknown op(s) {sorted(unknown)}; ops are {sorted(BY_NAME)}")
    if not names and not per_op:
        return None
    spec = ",".join([*names, *(f"{op}={b}" for op, b in per_op.items())])
    return Policy.parse(spec, source=source)


@contextlib.contextmanager
def use_backend(*names: str, **per_op: str) -> Iterator[Policy | None]:
    """Override the ranking inside a ``with`` block (context-local: threads and tasks are isolated).

    ``use_backend("triton")`` forces one backend for every op;
    ``use_backend("triton", "reference")`` prefers them in order, then ranks as usual;
    ``use_backend(gather="triton")`` forces a backend for one op.
    """
    token = _context_policy.set(_policy_from(names, per_op, "use_backend()") or DEFAULT_POLICY)
    try:
        yield _context_policy.get()
    finally:
        _context_policy.reset(token)


def set_backend(*names: str, **per_op: str) -> None:
    """Process-wide form of :func:`use_backend`; ``set_backend()`` with no argument clears it."""
    _state.set_policy = _policy_from(names, per_op, "set_backend()")
    _update_default_policy()


@contextlib.contextmanager
def _policy_scope(policy: Policy) -> Iterator[None]:
    token = _context_policy.set(policy)
    try:
        yield
    finally:
        _context_policy.reset(token)


# ---------------------------------------------------------------------------
# Selection


@dataclass(frozen=True, eq=False)
class Selected:
    """A cached choice: the kernel and how to call it."""

    kernel: Kernel
    run: Callable[..., Any]
    trace: Trace


def _runner(kernel: Kernel) -> Callable[..., Any]:
    if not kernel.contiguous:
        return kernel.fn
    fn = kernel.fn

    def run_contiguous(*args: Any) -> Any:
        return fn(*(a.contiguous() if isinstance(a, torch.Tensor) else a for a in args))

    return run_contiguous


def describe_call(contract: OpContract, args: tuple[Any, ...]) -> dict[str, Any]:
    """A call as cost hints see it: tensors as :class:`TensorMeta`, other arguments as values."""
    return {name: TensorMeta(tuple(v.shape), v.dtype, v.device.type) if isinstance(v, torch.Tensor) else v
            for name, v in contract.bind(args).items()}


def _call_dtypes(contract: OpContract, args: tuple[Any, ...]) -> dict[str, torch.dtype]:
    bound = contract.bind(args)
    return {a.name: bound[a.name].dtype for a in contract.tensor_args if bound[a.name] is not None}


#: Distinct call shapes remembered per op; past this the cache starts over (bounded memory
#: for workloads whose shapes never repeat).
SHAPE_CACHE_LIMIT = 1024


def _resolve(contract: OpContract, key: Any, args: tuple[Any, ...]) -> Selected:
    """Validate a call seen for the first time and find its kernel (ranked once per signature)."""
    validation.validate(contract, args, _state.checked)
    policy = key[-1] if key is not None else current_policy()
    device = describe(contract.bind(args)[contract.primary.name].device)
    dtypes = _call_dtypes(contract, args)
    ranked = _ranked[contract.name]
    signature = (device, tuple(dtypes.items()), policy)
    selected = ranked.get(signature)
    if selected is None:
        trace = choose(registry(), contract.name, device, dtypes, policy)
        assert trace.winner is not None
        # A fallback the user asked for (a forced or preferred backend) is no news.
        if trace.fallback and policy.is_default and (contract.name, device.kind) not in _state.warned:
            _state.warned.add((contract.name, device.kind))
            log.warning("megablocks: no %s implementation of %r can serve this call; using the "
                        "portable %r kernel (see `megablocks backends explain %s`)", device.kind,
                        contract.name, trace.winner.label, contract.name)
        selected = ranked[signature] = Selected(trace.winner, _runner(trace.winner), trace)
    if selected.trace.per_call or selected.trace.cost_tier:  # the shapes decide (ranking step 4)
        kernel, _, error = for_call(selected.trace, describe_call(contract, args))
        if kernel is None:
            raise NoKernelError(f"megablocks_core: {error}")
        selected = Selected(kernel, _runner(kernel), selected.trace)
    _served.setdefault(contract.name, set()).add(selected.kernel.label)
    if key is not None:
        cache = _caches[contract.name]
        if len(cache) >= SHAPE_CACHE_LIMIT:
            cache.clear()
        cache[key] = selected
    return selected


def explain(op: str, device: DeviceInfo | torch.device | str = "cpu",
            dtypes: Mapping[str, torch.dtype] | None = None, policy: Policy | None = None) -> Trace:
    """Every candidate for ``op`` on ``device``, accepted or rejected with the reason, and the winner.

    When the trace has a ``cost_tier``, the winner shown is the priority order's; the kernel a
    call really gets depends on its shapes: see :func:`explain_call`.
    """
    if op not in BY_NAME or not BY_NAME[op].dispatched:
        raise ValueError(f"unknown op {op!r}; dispatched ops are "
                         f"{sorted(c.name for c in ALL if c.dispatched)}")
    info = device if isinstance(device, DeviceInfo) else describe(device)
    return rank(registry(), op, info, dtypes, policy or current_policy())


def explain_call(trace: Trace, call: CallInfo) -> tuple[Kernel | None, str]:
    """The kernel a call with these arguments (see :func:`describe_call`) would get, and why (or
    why none can serve it)."""
    kernel, why, error = for_call(trace, call)
    return kernel, why if kernel is not None else (error or "")


# ---------------------------------------------------------------------------
# Autograd


def pack_for_backward(contract: OpContract, args: tuple[Any, ...],
                      needs: Mapping[str, bool]) -> tuple[list[torch.Tensor | None], dict[str, Any]]:
    """Split the forward's arguments into tensors to save and constants to keep."""
    rule = autograd.RULES[contract.name]
    tensors: list[torch.Tensor | None] = []
    consts: dict[str, Any] = {}
    for spec, value in zip(contract.args, args, strict=True):
        if isinstance(value, torch.Tensor):
            tensors.append(value if autograd.kept(rule, spec.name, needs) else None)
            consts[f"{spec.name}.shape"] = tuple(value.shape)
        elif spec in contract.tensor_args:
            tensors.append(None)
        else:
            consts[spec.name] = value
    return tensors, consts


def unpack_for_backward(contract: OpContract, saved: tuple[torch.Tensor | None, ...],
                        consts: Mapping[str, Any]) -> dict[str, Any]:
    bound = dict(consts)
    bound.update(zip((a.name for a in contract.tensor_args), saved, strict=True))
    return bound


def _eager_call(op: str, *args: Any) -> Any:
    return ENTRIES[op](*args)


class _OpFunction(torch.autograd.Function):
    """One autograd node for any differentiable op; the backward comes from :mod:`autograd`."""

    @staticmethod
    def forward(ctx: Any, contract: OpContract, selected: Selected, policy: Policy, *args: Any) -> Any:
        needs = {a.name: bool(n) for a, n in zip(contract.args, ctx.needs_input_grad[3:], strict=True)}
        tensors, consts = pack_for_backward(contract, args, needs)
        ctx.save_for_backward(*tensors)
        ctx.meta = (contract, policy, consts, needs)
        return selected.run(*args)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        contract, policy, consts, needs = ctx.meta
        bound = unpack_for_backward(contract, ctx.saved_tensors, consts)
        with _policy_scope(policy):  # backward runs on the backends the forward was ranked with
            grads = autograd.RULES[contract.name].fn(_eager_call, bound, grad, needs)
        return (None, None, None, *(grads.get(a.name) if needs[a.name] else None for a in contract.args))


def _apply_autograd(contract: OpContract, selected: Selected, policy: Policy, args: tuple[Any, ...]) -> Any:
    return _OpFunction.apply(contract, selected, policy, *args)


# ---------------------------------------------------------------------------
# Entry functions, generated from the contracts


def _kernel_failed(contract: OpContract, selected: Selected, exc: Exception) -> BaseException:
    """The exception to raise for one a kernel raised: its type (or :class:`BackendError` where that
    type cannot be built from a message), naming op and backend, the original as ``__cause__``."""
    message = (f"megablocks_core.ops.{contract.name}: the {selected.kernel.label!r} kernel raised "
               f"{type(exc).__name__}: {exc}")
    if isinstance(exc, ContractError | ContractTypeError | NoKernelError) and \
            f"ops.{contract.name}:" in str(exc):
        return exc  # the core's own error for this op (e.g. raised by the validation of a nested call)
    try:
        wrapped = type(exc)(message)
        if not isinstance(wrapped, Exception) or wrapped.args != (message,):
            raise TypeError  # an exception type that does not take a message
    except Exception:
        wrapped = BackendError(message)
    wrapped.__cause__ = exc
    return wrapped


def _run_checked(contract: OpContract, selected: Selected, policy: Policy, args: tuple[Any, ...],
                 wants_grad: bool) -> Any:
    """Checked mode: the data rules, the call, then the outputs against the contract."""
    validation.check_data(contract, args)
    try:
        result = (_apply_autograd(contract, selected, policy, args) if wants_grad
                  else selected.run(*args))
    except Exception as exc:
        raise _kernel_failed(contract, selected, exc)  # noqa: B904 (the cause is set there)
    validation.check_outputs(contract, args, result, selected.kernel.label)
    return result


def _entry_source(contract: OpContract) -> str:
    params = ", ".join(contract.arg_names)
    grad_test = " or ".join(
        f"({n} is not None and {n}.requires_grad)" if contract.arg(n).optional else f"{n}.requires_grad"
        for n in contract.differentiable)
    wants_grad = f"(({grad_test}) and _grad_enabled())" if contract.differentiable else "False"
    autograd_branch = (
        f"        if {wants_grad}:\n"
        f"            return _apply_autograd(_contract, chosen, key[-1], ({params},))\n"
        if contract.differentiable else "")
    # The try around the kernel call costs nothing until a kernel raises (Python >= 3.11).
    return (
        f"def {contract.name}({params}):\n"
        f"    if _is_compiling():\n"
        f"        return _compiled({params})\n"
        f"    try:\n"
        f"        key = ({validation.call_key_source(contract)}, _context_policy() or _state.policy)\n"
        f"        chosen = _cache.get(key)\n"
        f"    except (AttributeError, TypeError):  # not a tensor, or unhashable: validation says which\n"
        f"        key = chosen = None\n"
        f"    if chosen is None:\n"
        f"        chosen = _resolve(_contract, key, ({params},))\n"
        f"    if not ({validation.fast_check_source(contract)}):\n"
        f"        {params}, = _validate(_contract, ({params},))\n"
        f"    if _state.checked:\n"
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


def _build_entry(contract: OpContract) -> Callable[..., Any]:
    from .contract import RULE_HELPERS

    cache: dict[Any, Selected] = {}
    _caches[contract.name] = cache
    _ranked[contract.name] = {}
    scope: dict[str, Any] = {
        **RULE_HELPERS,
        "_contract": contract, "_cache": cache, "_state": _state, "_context_policy": _context_policy.get,
        "_resolve": _resolve, "_validate": validation.validate, "_run_checked": _run_checked,
        "_kernel_failed": _kernel_failed, "_current_policy": current_policy,
        "_is_compiling": torch.compiler.is_compiling, "_grad_enabled": torch.is_grad_enabled,
        "_apply_autograd": _apply_autograd, "_compiled": _compiled_op(contract.name),
    }
    source = _entry_source(contract)
    exec(compile(source, f"<megablocks_core.dispatch {contract.name}>", "exec"), scope)
    entry = scope[contract.name]
    entry.__source__ = source
    entry.__qualname__ = entry.__name__ = contract.name
    entry.__doc__ = contract.summary
    return entry


# A bad MEGABLOCKS_BACKEND is reported by the registry's first load (the first call), not at import.
with contextlib.suppress(ValueError):
    _read_overrides(os.environ)

#: Op name → entry function taking the kernel-order arguments.
ENTRIES: dict[str, Callable[..., Any]] = {c.name: _build_entry(c) for c in ALL if c.dispatched}


def call(op: str, *args: Any) -> Any:
    """Run a dispatched op (including kernel-only ops such as ``scatter_wgrad``) by name."""
    return ENTRIES[op](*args)


def served() -> dict[str, list[str]]:
    """Op → labels of the kernels chosen so far in this process (from the selection cache)."""
    return {op: sorted(labels) for op, labels in _served.items() if labels}
