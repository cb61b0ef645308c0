"""Plugin discovery: entry points in ``megablocks.backends``, each loaded in isolation.

A plugin that fails to import, has invalid hooks, returns bad descriptors or
declares an incompatible ``megablocks-core`` requirement is recorded (name,
distribution, version, error) and skipped; the others keep working. A kernel the plugin
could not build (a :class:`~megablocks_core.descriptors.KernelProblem` in its place) fails
only that op: the plugin's other kernels load and the record keeps the problem.
``MEGABLOCKS_STRICT_PLUGINS=1`` turns such failures into :class:`PluginLoadError`.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, Literal

import pluggy
import torch
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

from . import __version__
from .contracts import BY_NAME
from .descriptors import (
    ANY_DEVICE,
    DEVICE_KINDS,
    CallInfo,
    DeviceInfo,
    Kernel,
    KernelProblem,
    ShapeCheck,
    Tier,
)
from .formats import FORMAT_NAMES
from .hookspecs import ENTRY_POINT_GROUP, KERNEL_HOOKS, PROJECT_NAME, BackendHooks
from .schema import ChoiceArg, FloatArg, IntArg, TensorArg, is_option

log = logging.getLogger("megablocks_core")

Status = Literal["ok", "broken", "incompatible", "unavailable", "disabled"]
CORE_DISTRIBUTION = "megablocks-core"


class PluginLoadError(RuntimeError):
    """A plugin failed to load while ``MEGABLOCKS_STRICT_PLUGINS=1``."""


@dataclass(frozen=True)
class PluginRecord:
    """What the core knows about one installed plugin."""

    name: str
    distribution: str | None
    version: str | None
    status: Status
    reason: str | None = None
    kernels: tuple[Kernel, ...] = ()
    problems: tuple[KernelProblem, ...] = ()
    """The kernels the plugin could not build: those ops (variants) are not served by it."""

    def problems_for(self, op: str) -> tuple[KernelProblem, ...]:
        return tuple(p for p in self.problems if p.op == op)

    @property
    def ops(self) -> tuple[str, ...]:
        return tuple(sorted({k.op for k in self.kernels}))

    @property
    def device_kinds(self) -> tuple[str, ...]:
        return tuple(sorted({d for k in self.kernels for d in k.devices}))

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "distribution": self.distribution,
            "version": self.version,
            "status": self.status,
            "reason": self.reason,
            "device_kinds": list(self.device_kinds),
            "ops": list(self.ops),
            "kernels": [
                {
                    "op": k.op,
                    "variant": k.variant,
                    "devices": list(k.devices),
                    "tier": k.tier.label,
                }
                for k in self.kernels
            ],
            "problems": [
                {"op": p.op, "variant": p.variant, "reason": p.reason} for p in self.problems
            ],
        }


@dataclass
class Registry:
    """The loaded plugins and, per op, the kernels that may take part in ranking."""

    plugins: dict[str, PluginRecord] = field(default_factory=dict)

    def kernels_for(self, op: str) -> list[tuple[PluginRecord, Kernel]]:
        return [(p, k) for p in self.plugins.values() for k in p.kernels if k.op == op]

    @property
    def backend_names(self) -> list[str]:
        return sorted(self.plugins)


def _env_list(name: str, env: Mapping[str, str]) -> set[str] | None:
    value = env.get(name, "").strip()
    return {v.strip() for v in value.split(",") if v.strip()} if value else None


def _incompatibility(dist: metadata.Distribution | None) -> str | None:
    """Check the plugin's declared megablocks-core requirement before importing it."""
    if dist is None:
        return None
    for line in dist.requires or ():
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        if canonicalize_name(req.name) != CORE_DISTRIBUTION:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        if not req.specifier.contains(__version__, prereleases=True):
            return f"requires {CORE_DISTRIBUTION}{req.specifier}, but {__version__} is installed"
    return None


def core_device_kinds() -> frozenset[str]:
    """The device kinds the core itself names (:data:`DEVICE_KINDS` and ``"any"``). A kernel may
    also declare any device type torch accepts now (:func:`_is_device_kind`), including one a
    vendor's extension registered (e.g. ``npu`` after
    ``torch.utils.rename_privateuse1_backend("npu")``, done when the plugin module is imported)."""
    return frozenset({*DEVICE_KINDS, ANY_DEVICE})


def _is_device_kind(kind: str) -> bool:
    if kind in core_device_kinds():
        return True
    try:
        return torch.device(kind).type == kind
    except (RuntimeError, ValueError):
        return False


def _arity_problem(fn: Any, contract: Any) -> tuple[str | None, int]:
    """(why ``fn`` cannot take the contract's arguments positionally, or None; how many of
    them it takes). A function may leave the contract's trailing options to the core
    (:func:`~megablocks_core.schema.is_option`: ``torch._grouped_mm`` cannot take ``bias``, for
    one) by not taking them; an unreadable signature (some builtins) is taken to take them
    all."""
    names = contract.arg_names
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return None, len(names)
    try:
        signature.bind(*names)
        return None, len(names)
    except TypeError as exc:
        problem = (
            f"fn {getattr(fn, '__qualname__', fn)!s}{signature} cannot take the {len(names)} "
            f"arguments ({', '.join(names)}) the contract passes positionally: {exc}"
        )
    taken = len(names)
    while taken and is_option(contract.args[taken - 1]):
        taken -= 1
        try:
            signature.bind(*names[:taken])
            return None, taken
        except TypeError:
            continue
    return problem, len(names)


def _without_options(fn: Any, contract: Any, taken: int) -> Callable[..., Any]:
    """``fn``, which takes the first ``taken`` arguments, as a kernel of the whole contract: each
    option it leaves to the core is served around it. A choice is applied to its argument first
    (``ChoiceArg.apply``); a row count pads its argument with zero rows or cuts the output
    (:class:`RowsOption`); a tensor option is applied to the output (``TensorArg.serve``)."""
    names = contract.arg_names
    options = [(i, a) for i, a in enumerate(contract.args) if i >= taken and is_option(a)]
    # Each padded row count's total, an expression over the arguments, as a function made once.
    totals = {
        at: eval(f"lambda {', '.join(names)}: {arg.option.total}")
        for at, arg in options
        if isinstance(arg, IntArg) and arg.option is not None and arg.option.pads is not None
    }

    # Each choice's parameters (FloatArg options), by position: the core applies them with it.
    parameter_positions = {
        arg.name: tuple(names.index(p) for p in contract.parameters_of(arg.name))
        for _, arg in options
        if isinstance(arg, ChoiceArg)
    }

    def served(*args: Any) -> Any:
        given = list(args[:taken])
        keep_rows = None
        serve_after = []
        for at, arg in options:
            value = args[at]
            if value is None:
                continue
            if isinstance(arg, TensorArg):
                assert arg.serve is not None  # is_option's test
                serve_after.append(arg.serve)
            elif isinstance(arg, ChoiceArg):
                assert arg.applies_to is not None and arg.apply is not None  # is_option's test
                target = names.index(arg.applies_to)
                parameters = (args[at] for at in parameter_positions[arg.name])
                given[target] = arg.apply(given[target], value, *parameters)
            elif isinstance(arg, FloatArg):
                continue  # applied with its choice above (a kernel taking the choice declines it)
            elif at in totals:
                target = names.index(arg.option.pads)
                given[target] = arg.option.pad(given[target], totals[at](*args))
            else:
                keep_rows = value
        out = fn(*given)
        out = out if keep_rows is None else out[:keep_rows]
        for serve in serve_after:
            out = serve(dict(zip(names, args, strict=True)), out)
        return out

    # The call that uses none of the options goes straight to fn. A closure costs ~0.1 us per
    # call more than the code generated for this before (CPython 3.11): the price of no exec.
    positions = tuple(at for at, _ in options)
    if len(positions) == 1:
        (only,) = positions

        def direct(*args: Any) -> Any:
            if args[only] is None:
                return fn(*args[:taken])
            return served(*args)

    else:

        def direct(*args: Any) -> Any:
            for at in positions:
                if args[at] is not None:
                    return served(*args)
            return fn(*args[:taken])

    direct.__wrapped__ = fn  # type: ignore[attr-defined]
    direct.__qualname__ = getattr(fn, "__qualname__", "kernel")
    return direct


def _declining_parameters(
    supports: ShapeCheck | None, contract: Any, taken: int
) -> ShapeCheck | None:
    """``supports``, declining the calls that set a choice's parameter (:class:`FloatArg`) that
    a kernel taking the first ``taken`` arguments lacks while it takes the choice itself: it
    would compute the choice's defaults instead (a parameter of a choice left to the core is
    applied with it)."""
    names = contract.arg_names
    lacking = tuple(
        a.name
        for a in contract.args[taken:]
        if isinstance(a, FloatArg) and names.index(a.of) < taken
    )
    if not lacking:
        return supports

    def declines(device: DeviceInfo, call: CallInfo) -> str | None:
        given = [name for name in lacking if call.get(name) is not None]
        if given:
            listed = ", ".join(repr(n) for n in given)
            return (
                f"its function takes no {listed} (it computes the default only), and the call "
                "sets it"
            )
        return None if supports is None else supports(device, call)

    return declines


def _check_kernel(item: Any, hook: str) -> Kernel:
    """Validate one descriptor (raises naming the kernel) and return it with ``devices`` a tuple."""
    family = KERNEL_HOOKS[hook]
    if not isinstance(item, Kernel):
        raise TypeError(f"{hook} returned {type(item).__name__}, expected megablocks_core.Kernel")
    contract = BY_NAME.get(item.op) if isinstance(item.op, str) else None
    if contract is None or not contract.dispatched:
        raise ValueError(f"{hook} returned a kernel for unknown op {item.op!r}")
    if contract.family != family:
        raise ValueError(f"{hook} returned a kernel for {item.op!r}, a {contract.family} op")
    what = f"kernel for {item.op!r}" + (f" (variant {item.variant!r})" if item.variant else "")
    if not isinstance(item.variant, str):
        raise TypeError(f"{what}: variant must be a str, got {type(item.variant).__name__}")
    if not callable(item.fn):
        raise TypeError(f"{what}: fn is not callable")
    problem, taken = _arity_problem(item.fn, contract)
    if problem:
        raise TypeError(f"{what}: {problem}")
    if taken < len(contract.args):
        item = dataclasses.replace(
            item,
            fn=_without_options(item.fn, contract, taken),
            supports=_declining_parameters(item.supports, contract, taken),
        )
    devices = item.devices
    if isinstance(devices, str) or not isinstance(devices, tuple | list | set | frozenset):
        raise TypeError(
            f"{what}: devices must be a tuple of device kinds such as ('cpu',), "
            f"got {type(devices).__name__} {devices!r}"
        )
    if not devices or not all(isinstance(d, str) and d == d.lower() for d in devices):
        raise ValueError(f"{what}: devices must be lowercase kinds, got {devices!r}")
    unknown_kinds = sorted(d for d in devices if not _is_device_kind(d))
    if unknown_kinds:
        raise ValueError(
            f"{what}: unknown device kind(s) {unknown_kinds}; a kind is one of "
            f"{', '.join(sorted(core_device_kinds()))} or a device type torch accepts "
            "(register a vendor's type before the hooks return)"
        )
    if not isinstance(item.tier, Tier):
        raise TypeError(f"{what}: tier must be a megablocks_core.plugin.Tier, got {item.tier!r}")
    if not isinstance(item.contiguous, bool):
        raise TypeError(f"{what}: contiguous must be a bool, got {item.contiguous!r}")
    for field_name in ("capability", "supports", "cost"):
        value = getattr(item, field_name)
        if value is not None and not callable(value):
            raise TypeError(
                f"{what}: {field_name} must be callable or None, got {type(value).__name__}"
            )
    takes_format = "format" in contract.arg_names
    if takes_format and not item.formats:
        raise ValueError(
            f"{what}: the op takes a format: declare the formats the kernel takes "
            f"(formats=, from {', '.join(FORMAT_NAMES)})"
        )
    if item.formats and not takes_format:
        raise ValueError(f"{what}: formats declared for an op without a format argument")
    unknown_formats = sorted(set(item.formats) - set(FORMAT_NAMES))
    if unknown_formats:
        raise ValueError(
            f"{what}: unknown format(s) {unknown_formats}; formats are {', '.join(FORMAT_NAMES)}"
        )
    if not isinstance(item.dtypes, Mapping):
        raise TypeError(f"{what}: dtypes must map argument names to sets of torch dtypes")
    unknown = set(item.dtypes) - set(contract.arg_names)
    if unknown:
        raise ValueError(f"{what}: dtypes names unknown arguments {sorted(unknown)}")
    if not all(
        isinstance(ds, set | frozenset | tuple | list)
        and all(isinstance(d, torch.dtype) for d in ds)
        for ds in item.dtypes.values()
    ):
        raise TypeError(f"{what}: dtypes must map argument names to sets of torch dtypes")
    return dataclasses.replace(item, devices=tuple(dict.fromkeys(devices)))


def _check_problem(item: KernelProblem, hook: str) -> KernelProblem:
    """Validate a :class:`KernelProblem` a kernel hook returned (raises naming the hook)."""
    if not all(isinstance(v, str) for v in (item.op, item.reason, item.variant)):
        raise TypeError(f"{hook} returned a KernelProblem whose op, reason and variant are not str")
    if not item.reason:
        raise ValueError(f"{hook} returned a KernelProblem for {item.op!r} without a reason")
    return item


def _collect(
    pm: pluggy.PluginManager, plugin: object, name: str
) -> tuple[str | None, tuple[Kernel, ...], tuple[KernelProblem, ...]]:
    """Call this plugin's hooks (once) and validate what they return."""
    for caller in pm.get_hookcallers(plugin) or ():
        if caller.spec is None:
            raise ValueError(f"implements unknown hook {caller.name!r}")

    def results(hook: str) -> Iterable[Any]:
        for impl in getattr(pm.hook, hook).get_hookimpls():
            if impl.plugin is plugin:
                yield impl.function()

    unavailable = next((r for r in results("megablocks_unavailable_reason") if r), None)
    kernels: list[Kernel] = []
    problems: list[KernelProblem] = []
    for hook in KERNEL_HOOKS:
        for returned in results(hook):
            for item in returned or ():
                if isinstance(item, KernelProblem):
                    problems.append(_check_problem(item, hook))
                else:
                    kernels.append(dataclasses.replace(_check_kernel(item, hook), backend=name))
    seen: set[tuple[str, str]] = set()
    for k in kernels:
        if (k.op, k.variant) in seen:
            raise ValueError(f"two kernels for {k.op!r} with the same variant {k.variant!r}")
        seen.add((k.op, k.variant))
    return (str(unavailable) if unavailable else None), tuple(kernels), tuple(problems)


def load(env: Mapping[str, str] | None = None) -> Registry:
    """Discover and load every plugin in the ``megablocks.backends`` entry-point group."""
    env = os.environ if env is None else env
    strict = env.get("MEGABLOCKS_STRICT_PLUGINS", "") not in ("", "0")
    allow = _env_list("MEGABLOCKS_PLUGINS", env)
    deny = _env_list("MEGABLOCKS_DISABLE_PLUGINS", env) or set()
    pm = pluggy.PluginManager(PROJECT_NAME)
    pm.add_hookspecs(BackendHooks)
    registry = Registry()

    for ep in sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        dist = ep.dist
        record: dict[str, Any] = dict(
            name=ep.name,
            distribution=dist.metadata["Name"] if dist else None,
            version=dist.version if dist else None,
        )
        if ep.name in registry.plugins:
            other = registry.plugins[ep.name].distribution
            clash = f"the name {ep.name!r} is already taken by distribution {other}"
            if strict:
                raise PluginLoadError(f"plugin from {record['distribution']}: {clash}")
            log.warning("megablocks plugin from %s skipped: %s", record["distribution"], clash)
            continue
        if (allow is not None and ep.name not in allow) or ep.name in deny:
            registry.plugins[ep.name] = PluginRecord(
                **record,
                status="disabled",
                reason="excluded by MEGABLOCKS_PLUGINS / MEGABLOCKS_DISABLE_PLUGINS",
            )
            continue
        problem = _incompatibility(dist)
        if problem:
            if strict:
                raise PluginLoadError(f"plugin {ep.name!r}: {problem}")
            registry.plugins[ep.name] = PluginRecord(
                **record, status="incompatible", reason=problem
            )
            log.warning("megablocks plugin %r not loaded: %s", ep.name, problem)
            continue
        plugin = None
        try:
            plugin = ep.load()
            pm.register(plugin, name=ep.name)
            unavailable, kernels, problems = _collect(pm, plugin, ep.name)
        except Exception as exc:  # isolation: one bad plugin must not take the others down
            if plugin is not None and pm.is_registered(plugin):
                pm.unregister(plugin)
            reason = f"{type(exc).__name__}: {exc}"
            if strict:  # raised, not skipped: no "skipped" warning first
                raise PluginLoadError(f"plugin {ep.name!r} failed to load: {reason}") from exc
            registry.plugins[ep.name] = PluginRecord(**record, status="broken", reason=reason)
            log.warning("megablocks plugin %r is broken and was skipped: %s", ep.name, reason)
            continue
        for failed in problems:
            if strict:
                raise PluginLoadError(
                    f"plugin {ep.name!r}: its {failed.what} did not load: {failed.reason}"
                )
            log.warning(
                "megablocks plugin %r: its %s did not load: %s", ep.name, failed.what, failed.reason
            )
        status: Status = "unavailable" if unavailable else "ok"
        registry.plugins[ep.name] = PluginRecord(
            **record, status=status, reason=unavailable, kernels=kernels, problems=problems
        )
    return registry
