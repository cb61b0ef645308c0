"""Selection: which kernel serves a call, remembered per call shape.

:func:`resolve` runs when an entry function (:mod:`megablocks_core.entries`) sees a call key for
the first time. It validates the call fully against the contract
(:func:`megablocks_core.validation.validate` raises precise errors), looks up the kernel, ranked
once per (device, dtypes, policy) by :mod:`megablocks_core.ranking`, refines it per call shape
where shape predicates or cost hints decide, and caches the choice under the call key: a cache hit
means the call was already validated and its kernel chosen.

The plugins load on first use (or at import with ``MEGABLOCKS_STRICT_PLUGINS=1``, see
:mod:`megablocks_core`); :func:`reload` rediscovers them, re-reads the environment's overrides
(:mod:`megablocks_core.policy`) and forgets every cached choice. :func:`explain` and
:func:`explain_call` show the same decisions without making a call.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from . import policy as _policy
from . import validation
from .contracts import ALL, BY_NAME
from .descriptors import CallInfo, DeviceInfo, Kernel, TensorMeta
from .devices import describe
from .policy import Policy, current_policy, overrides
from .ranking import NoKernelError, Trace, choose, for_call, rank
from .registry import Registry, load
from .schema import OpContract, TensorArg

log = logging.getLogger("megablocks_core")

_registry: Registry | None = None
_warned: set[tuple[str, str]] = set()  # (op, device kind) whose portable fallback was reported
_caches: dict[str, dict[Any, Selected]] = {}  # op → validated call key → choice
_ranked: dict[str, dict[Any, Selected]] = {}  # op → (device, dtypes, policy) → choice
_served: dict[str, set[str]] = {}  # op → labels of the kernels chosen so far
# (op, id of a kernel's fn) → (that fn, its contiguous-arguments wrapper)
_runners: dict[tuple[str, int], tuple[Callable[..., Any], Callable[..., Any]]] = {}


def reload(env: Mapping[str, str] | None = None) -> Registry:
    """Re-read the environment, rediscover plugins and forget every cached choice."""
    global _registry
    env = os.environ if env is None else env
    _policy.environment_policy(env)  # a bad MEGABLOCKS_BACKEND raises before anything changes
    loaded = load(env)  # may raise (strict mode): then nothing below changes
    _policy.read_environment(env)
    policy = overrides.env_policy
    names = [
        *policy.prefer,
        *([policy.force] if policy.force else []),
        *(b for _, b in policy.per_op),
    ]
    for name in dict.fromkeys(n.partition("/")[0] for n in names):
        record = loaded.plugins.get(name)
        if record is None:
            log.warning("megablocks: MEGABLOCKS_BACKEND names %r, which is not installed", name)
        elif record.status != "ok":
            log.warning(
                "megablocks: MEGABLOCKS_BACKEND names %r, which is %s: %s",
                name,
                record.status,
                record.reason,
            )
    _registry = loaded
    _warned.clear()
    for cache in (*_caches.values(), *_ranked.values()):
        cache.clear()
    for labels in _served.values():
        labels.clear()
    _runners.clear()
    return _registry


def registry() -> Registry:
    """The loaded plugins (discovered on first use)."""
    return _registry if _registry is not None else reload()


@dataclass(frozen=True, eq=False)
class Selected:
    """A cached choice: the kernel and how to call it."""

    kernel: Kernel
    run: Callable[..., Any]
    trace: Trace


def _runner(kernel: Kernel, contract: OpContract) -> Callable[..., Any]:
    """How the entry calls ``kernel``: its function, or for a kernel that takes contiguous
    tensors, a closure that makes each tensor argument contiguous first (``.contiguous()``
    returns a contiguous tensor itself). Mutable arguments are passed as they are: the contract
    requires them contiguous, and a copy would take the kernel's writes away."""
    if not kernel.contiguous:
        return kernel.fn
    made = _runners.get((contract.name, id(kernel.fn)))
    if made is not None and made[0] is kernel.fn:
        return made[1]
    fn = kernel.fn
    # The positions of the tensor arguments to make contiguous (None passes as None).
    positions = tuple(
        i for i, a in enumerate(contract.args) if isinstance(a, TensorArg) and not a.mutable
    )

    def run_contiguous(*args: Any) -> Any:
        given = list(args)
        for i in positions:
            value = given[i]
            if value is not None:
                given[i] = value.contiguous()
        return fn(*given)

    _runners[(contract.name, id(fn))] = (fn, run_contiguous)
    return run_contiguous


def describe_call(contract: OpContract, args: tuple[Any, ...]) -> dict[str, Any]:
    """A call as cost hints see it: tensors as :class:`TensorMeta`, other arguments as values."""
    return {
        name: TensorMeta(tuple(v.shape), v.dtype, v.device.type)
        if isinstance(v, torch.Tensor)
        else v
        for name, v in contract.bind(args).items()
    }


def _call_dtypes(contract: OpContract, args: tuple[Any, ...]) -> dict[str, torch.dtype]:
    bound = contract.bind(args)
    return {a.name: bound[a.name].dtype for a in contract.tensor_args if bound[a.name] is not None}


#: Distinct call shapes remembered per op; past this the cache starts over (bounded memory
#: for workloads whose shapes never repeat).
SHAPE_CACHE_LIMIT = 1024


def new_cache(op: str) -> dict[Any, Selected]:
    """The call-key cache of ``op``'s entry function (emptied by :func:`reload`)."""
    cache: dict[Any, Selected] = {}
    _caches[op] = cache
    _ranked[op] = {}
    return cache


def resolve(contract: OpContract, key: Any, args: tuple[Any, ...]) -> Selected:
    """Validate a call seen for the first time and find its kernel (ranked once per signature)."""
    validation.validate(contract, args, overrides.checked)
    policy = key[-1] if key is not None else current_policy()
    device = describe(contract.bind(args)[contract.primary.name].device)
    dtypes = _call_dtypes(contract, args)
    ranked = _ranked[contract.name]
    signature = (device, tuple(dtypes.items()), policy)
    selected = ranked.get(signature)
    if selected is None:
        if len(ranked) >= SHAPE_CACHE_LIMIT:  # bounded like the call-key cache
            ranked.clear()
        trace = choose(registry(), contract.name, device, dtypes, policy)
        assert trace.winner is not None
        # A fallback the user asked for (a forced or preferred backend) is no news.
        if trace.fallback and policy.is_default and (contract.name, device.kind) not in _warned:
            _warned.add((contract.name, device.kind))
            log.warning(
                "megablocks: no %s implementation of %r can serve this call; using the "
                "portable %r kernel (see `megablocks backends explain %s`)",
                device.kind,
                contract.name,
                trace.winner.label,
                contract.name,
            )
        selected = ranked[signature] = Selected(
            trace.winner, _runner(trace.winner, contract), trace
        )
    if selected.trace.per_call or selected.trace.cost_tier:  # the shapes decide (ranking step 4)
        kernel, _, error = for_call(selected.trace, describe_call(contract, args))
        if kernel is None:
            raise NoKernelError(f"megablocks_core: {error}")
        selected = Selected(kernel, _runner(kernel, contract), selected.trace)
    _served.setdefault(contract.name, set()).add(selected.kernel.label)
    if key is not None:
        cache = _caches[contract.name]
        if len(cache) >= SHAPE_CACHE_LIMIT:
            cache.clear()
        cache[key] = selected
    return selected


def explain(
    op: str,
    device: DeviceInfo | torch.device | str = "cpu",
    dtypes: Mapping[str, torch.dtype] | None = None,
    policy: Policy | None = None,
) -> Trace:
    """Every candidate for ``op`` on ``device``, accepted or rejected with the reason, and the winner.

    When the trace has a ``cost_tier``, the winner shown is the tier order's; the kernel a
    call really gets depends on its shapes: see :func:`explain_call`.
    """
    if op not in BY_NAME or not BY_NAME[op].dispatched:
        raise ValueError(
            f"unknown op {op!r}; dispatched ops are {sorted(c.name for c in ALL if c.dispatched)}"
        )
    info = device if isinstance(device, DeviceInfo) else describe(device)
    return rank(registry(), op, info, dtypes, policy or current_policy())


def explain_call(trace: Trace, call: CallInfo) -> tuple[Kernel | None, str]:
    """The kernel a call with these arguments (see :func:`describe_call`) would get, and why (or
    why none can serve it)."""
    kernel, why, error = for_call(trace, call)
    return kernel, why if kernel is not None else (error or "")


def served() -> dict[str, list[str]]:
    """Op → labels of the kernels chosen so far in this process (from the selection cache)."""
    return {op: sorted(labels) for op, labels in _served.items() if labels}
