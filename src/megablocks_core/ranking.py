"""How the core chooses one kernel for a call: the whole rule lives here.

1. Candidates are the kernels for the op from loaded plugins.
2. A candidate is rejected when its plugin is unavailable here, it does not
   serve the device kind, its capability predicate objects, or it restricts
   the dtype of an argument the call uses.
3. Among the rest: a backend forced for this op (``gather=triton``) or for all
   ops (``MEGABLOCKS_BACKEND=triton``) must win or the call fails; otherwise the
   first backend of a preference list that can serve wins; otherwise the
   highest priority, then kernels naming the device kind before portable ones,
   then backend name (so the choice is deterministic).
4. Per call shape: when two or more eligible kernels of that highest priority
   declare a ``cost`` hint, the one with the lowest estimate for the call's
   shapes wins (kernels without an estimate rank after those with one). That
   is how ``gmm`` picks between, say, a persistent Triton kernel and
   ``torch._grouped_mm`` per shape (:mod:`megablocks_core.costs`).

The dispatcher caches steps 1-3 per (op, device, dtype signature, policy) and
step 4 per call shape, so this module runs once per new signature, not per call.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import torch

from .descriptors import CallInfo, DeviceInfo, Kernel
from .registry import PluginRecord, Registry


class NoKernelError(RuntimeError):
    """No kernel can serve a call (or the forced backend cannot)."""


@dataclass(frozen=True, eq=False)  # identity hash: it is part of every dispatch cache key
class Policy:
    """User overrides of the ranking (from ``MEGABLOCKS_BACKEND`` or :func:`use_backend`).

    ``force``: one backend for every op. ``prefer``: tried in order, then normal
    ranking. ``per_op``: op name → forced backend.
    """

    force: str | None = None
    prefer: tuple[str, ...] = ()
    per_op: tuple[tuple[str, str], ...] = ()
    source: str = "default"

    @classmethod
    def parse(cls, spec: str, source: str = "MEGABLOCKS_BACKEND") -> Policy:
        """``"triton"`` forces; ``"triton,reference"`` prefers; ``"gather=triton,gmm=cuda"`` forces per op;
        ``"gmm=cuda/grouped_mm"`` forces one variant of a backend."""
        names: list[str] = []
        per_op: list[tuple[str, str]] = []
        for item in (s.strip() for s in spec.split(",")):
            if not item:
                continue
            if "=" in item:
                op, _, backend = item.partition("=")
                per_op.append((op.strip(), backend.strip()))
            else:
                names.append(item)
        if len(names) == 1:
            return cls(force=names[0], per_op=tuple(per_op), source=source)
        return cls(prefer=tuple(names), per_op=tuple(per_op), source=source)

    @property
    def is_default(self) -> bool:
        return not (self.force or self.prefer or self.per_op)

    def forced_for(self, op: str) -> str | None:
        return dict(self.per_op).get(op, self.force)

    def describe(self) -> str:
        parts = [f"force {self.force}"] if self.force else []
        parts += [f"prefer {', '.join(self.prefer)}"] if self.prefer else []
        parts += [f"{op}={b}" for op, b in self.per_op]
        return f"{'; '.join(parts)} ({self.source})" if parts else "default ranking"


DEFAULT_POLICY = Policy()


@dataclass(frozen=True)
class Candidate:
    kernel: Kernel
    accepted: bool
    reason: str


@dataclass(frozen=True)
class Trace:
    """Every candidate for one op on one device, why it was accepted or rejected, and the winner."""

    op: str
    device: DeviceInfo
    dtypes: Mapping[str, torch.dtype]
    policy: Policy
    candidates: tuple[Candidate, ...]
    winner: Kernel | None
    why: str
    error: str | None = None
    notes: tuple[str, ...] = field(default=())
    cost_tier: tuple[Kernel, ...] = ()
    """Eligible kernels of the winner's priority that declare cost hints, when there are two or
    more and no forced/preferred backend decided: the choice then depends on the call's shapes."""

    @property
    def fallback(self) -> bool:
        """True when a portable kernel serves an accelerator because nothing specific can."""
        return self.winner is not None and _is_fallback(self.winner, self.device)


def _is_fallback(kernel: Kernel, device: DeviceInfo) -> bool:
    # On the CPU (and for shape-only meta tensors) the portable kernels are the native ones.
    return kernel.portable and device.kind not in ("cpu", "meta")


def _rejection(record: PluginRecord, k: Kernel, device: DeviceInfo,
               dtypes: Mapping[str, torch.dtype]) -> str | None:
    if record.status != "ok":
        return f"backend {record.status}: {record.reason}"
    if not k.serves_kind(device.kind):
        return f"serves {', '.join(k.devices)}, not {device.kind}"
    for arg, allowed in k.dtypes.items():
        got = dtypes.get(arg)
        if got is not None and got not in allowed:
            names = ", ".join(sorted(str(d).removeprefix("torch.") for d in allowed))
            return f"{arg} must be {names}, got {str(got).removeprefix('torch.')}"
    if k.capability is not None:
        try:
            reason = k.capability(device)
        except Exception as exc:  # a buggy predicate rejects its kernel, nothing more
            return f"capability check raised {type(exc).__name__}: {exc}"
        if reason:
            return str(reason)
    return None


def _order(k: Kernel) -> tuple[int, int, str, str]:
    return (-k.priority, int(k.portable), k.backend, k.variant)


def rank(registry: Registry, op: str, device: DeviceInfo,
         dtypes: Mapping[str, torch.dtype] | None = None, policy: Policy = DEFAULT_POLICY) -> Trace:
    """Rank every candidate for ``op`` on ``device``; never raises (see :func:`choose`)."""
    dtypes = dtypes or {}
    judged = []
    for record, k in registry.kernels_for(op):
        reason = _rejection(record, k, device, dtypes)
        judged.append(Candidate(k, reason is None, reason or "can serve"))
    judged.sort(key=lambda c: _order(c.kernel))
    eligible = [c.kernel for c in judged if c.accepted]

    def result(winner: Kernel | None, why: str, error: str | None = None) -> Trace:
        marked = tuple(Candidate(c.kernel, c.accepted, "chosen: " + why if c.kernel is winner else c.reason)
                       for c in judged)
        return Trace(op, device, dtypes, policy, marked, winner, why, error)

    known = set(registry.plugins)
    forced = policy.forced_for(op)
    if forced is not None:  # a backend name, or "backend/variant" for one of its kernels
        if forced.partition("/")[0] not in known:
            return result(None, "", f"backend {forced!r} was forced for {op!r} on {device} by {policy.source} "
                                    f"but is not installed (installed: {', '.join(sorted(known)) or 'none'})")
        for k in eligible:
            if forced in (k.backend, k.label):
                return result(k, f"forced by {policy.source}")
        reasons = "; ".join(c.reason for c in judged if forced in (c.kernel.backend, c.kernel.label))
        return result(None, "", f"backend {forced!r} was forced for {op!r} by {policy.source} "
                                f"but cannot serve {device} with {_dtype_text(dtypes)}: "
                                f"{reasons or 'provides no such op'}")
    for name in policy.prefer:
        for k in eligible:
            if name in (k.backend, k.label):
                return result(k, f"preferred by {policy.source}")
    if eligible:
        k = eligible[0]
        tier = tuple(c for c in eligible if c.priority == k.priority and c.cost is not None)
        if len(tier) >= 2:
            how = f"highest priority; per call shape, lowest cost hint of {', '.join(c.label for c in tier)}"
            return replace(result(k, how), cost_tier=tier)
        how = "highest priority" + (" (portable fallback)" if _is_fallback(k, device) else "")
        return result(k, how)
    reasons = "; ".join(f"{c.kernel.label}: {c.reason}" for c in judged) or "no backend provides it"
    return result(None, "", f"no implementation of {op!r} can serve {device} with "
                            f"{_dtype_text(dtypes)}: {reasons}")


def _dtype_text(dtypes: Mapping[str, torch.dtype]) -> str:
    return ", ".join(f"{a}={str(d).removeprefix('torch.')}" for a, d in dtypes.items()) or "any dtypes"


def estimates(trace: Trace, call: CallInfo) -> list[tuple[Kernel, float | None]]:
    """Each cost-tier kernel's estimate (µs) for one call; a raising hint counts as no estimate."""
    out: list[tuple[Kernel, float | None]] = []
    for k in trace.cost_tier:
        try:
            value = k.cost(trace.device, call) if k.cost is not None else None
        except Exception:  # a buggy hint must not break the call: priority order decides
            value = None
        out.append((k, None if value is None or value != value else float(value)))
    return out


def by_cost(trace: Trace, call: CallInfo) -> tuple[Kernel, str]:
    """The kernel of ``trace`` for one call shape, and why (step 4 of the rule above)."""
    assert trace.winner is not None
    if not trace.cost_tier:
        return trace.winner, trace.why
    scored = [(value, i, k) for i, (k, value) in enumerate(estimates(trace, call)) if value is not None]
    if not scored:
        return trace.winner, "highest priority (no cost hint had an estimate for this shape)"
    value, _, best = min(scored, key=lambda t: (t[0], t[1]))
    others = ", ".join(f"{k.label} {v:.1f}" for v, _, k in sorted(scored, key=lambda t: t[1]) if k is not best)
    return best, f"lowest cost hint for this shape: {value:.1f} µs" + (f" (vs {others})" if others else "")


def choose(registry: Registry, op: str, device: DeviceInfo,
           dtypes: Mapping[str, torch.dtype] | None = None, policy: Policy = DEFAULT_POLICY) -> Trace:
    """Like :func:`rank`, but raise :class:`NoKernelError` when nothing can serve."""
    trace = rank(registry, op, device, dtypes, policy)
    if trace.winner is None:
        raise NoKernelError(f"megablocks_core: {trace.error}")
    return trace
