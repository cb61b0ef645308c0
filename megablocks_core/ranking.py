"""How the core chooses one kernel for a call: the whole rule lives here.

1. Candidates are the kernels for the op from loaded plugins.
2. A candidate is rejected when its plugin is unavailable here, it does not
   serve the device kind, its capability predicate objects, or it restricts
   the dtype of an argument the call uses.
3. Among the rest: a backend forced for this op (``gather=triton``) or for all
   ops (``MEGABLOCKS_BACKEND=triton``) must win or the call fails; otherwise the
   first backend of a preference list that can serve wins; otherwise the
   kernels of the highest :class:`~megablocks_core.descriptors.Tier` compete
   (``PORTABLE`` < ``GENERIC_ACCELERATOR`` < ``VENDOR`` < ``SPECIALISED``) and,
   within that tier, in this order: a kernel that ``yields_to`` another backend
   of the tier ranks after it, then kernels naming the device kind before
   portable ones, then backend name, then variant (so the choice is
   deterministic).
4. Per call shape: a kernel whose shape predicate (``supports``: alignment,
   layout) rejects the call's shapes, or that does not take the call's format (``formats``),
   drops out, and steps 3-4 run again on the
   rest; when two or more eligible kernels of the highest tier declare a
   ``cost`` hint, the one with the lowest estimate for the call's shapes wins
   (kernels without an estimate rank after those with one; equal estimates keep
   step 3's order). Cost hints never cross tiers. That is how ``gmm`` picks
   between, say, a persistent Triton kernel and ``torch._grouped_mm`` per shape
   (:mod:`megablocks_core.costs`): both declare the generic-accelerator tier.

The dispatcher caches steps 1-3 per (op, device, dtype signature, policy) and
step 4 per call shape, so this module runs once per new signature, not per call.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from .descriptors import CallInfo, DeviceInfo, Kernel
from .policy import DEFAULT_POLICY, Policy
from .registry import PluginRecord, Registry


class NoKernelError(RuntimeError):
    """No kernel can serve a call (or the forced backend cannot)."""


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
    cost_tier: tuple[Kernel, ...] = ()
    """Eligible kernels of the winner's tier that declare cost hints, when there are two or
    more and no forced/preferred backend decided: the choice then depends on the call's shapes."""
    per_call: bool = False
    """Some eligible kernel has a shape predicate (``Kernel.supports``) or takes only some
    formats (``Kernel.formats``): each new call shape is checked against them (:func:`for_call`)."""

    @property
    def fallback(self) -> bool:
        """True when a portable kernel serves an accelerator because nothing specific can."""
        return self.winner is not None and _is_fallback(self.winner, self.device)


def _is_fallback(kernel: Kernel, device: DeviceInfo) -> bool:
    # On the CPU (and for shape-only meta tensors) the portable kernels are the native ones.
    return kernel.portable and device.kind not in ("cpu", "meta")


def _rejection(
    record: PluginRecord, k: Kernel, device: DeviceInfo, dtypes: Mapping[str, torch.dtype]
) -> str | None:
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


#: The backend that serves every op on any device (megablocks-reference): what an error suggests
#: when nothing can serve a call and it is not there.
FALLBACK = "reference"


def _fallback_hint(known: Mapping[str, str | None]) -> str:
    """Where the fallback backend is missing or did not load, how to get it (a CPU-only install
    of the core alone serves nothing)."""
    if FALLBACK not in known:
        return (
            f"; the {FALLBACK} backend serves every op on any device: install it (pip install "
            f"megablocks-core[{FALLBACK}]; from a checkout, pip install -e plugins/megablocks-"
            f"{FALLBACK})"
        )
    problem = known[FALLBACK]
    if problem is not None:
        return f"; the {FALLBACK} backend, which serves every op on any device, is {problem}"
    return ""


def _ranked(kernels: list[Kernel], peers: list[Kernel]) -> list[Kernel]:
    """``kernels`` in step 3's order; ``yields_to`` counts only backends among ``peers`` (the
    eligible kernels) of the same tier."""
    present = {(k.tier, k.backend) for k in peers}

    def order(k: Kernel) -> tuple[int, int, int, str, str]:
        yields = any((k.tier, name) in present for name in k.yields_to if name != k.backend)
        return (-k.tier, int(yields), int(k.portable), k.backend, k.variant)

    return sorted(kernels, key=order)


def rank(
    registry: Registry,
    op: str,
    device: DeviceInfo,
    dtypes: Mapping[str, torch.dtype] | None = None,
    policy: Policy = DEFAULT_POLICY,
) -> Trace:
    """Rank every candidate for ``op`` on ``device``; never raises (see :func:`choose`).

    Steps 1-3 of the rule; when shapes can still change the choice (step 4: shape predicates or
    cost hints), the trace says so (``per_call``) and :func:`for_call` finishes the job per call.
    """
    dtypes = dtypes or {}
    judged = []
    for record, k in registry.kernels_for(op):
        reason = _rejection(record, k, device, dtypes)
        judged.append(Candidate(k, reason is None, reason or "can serve"))
    by_kernel = {id(c.kernel): c for c in judged}
    accepted = [c.kernel for c in judged if c.accepted]
    judged = [by_kernel[id(k)] for k in _ranked([c.kernel for c in judged], accepted)]
    eligible = [c.kernel for c in judged if c.accepted]
    reasons = {id(c.kernel): c.reason for c in judged}
    known = {
        name: None if p.status == "ok" else f"{p.status}: {p.reason}"
        for name, p in registry.plugins.items()
    }
    winner, why, error, tier = _select(
        op, device, dtypes, policy, known, [c.kernel for c in judged], eligible, reasons, None
    )
    marked = tuple(
        Candidate(c.kernel, c.accepted, "chosen: " + why if c.kernel is winner else c.reason)
        for c in judged
    )
    return Trace(
        op,
        device,
        dtypes,
        policy,
        marked,
        winner,
        why,
        error,
        cost_tier=tier,
        per_call=any(k.supports is not None or k.formats for k in eligible),
    )


def _select(
    op: str,
    device: DeviceInfo,
    dtypes: Mapping[str, torch.dtype],
    policy: Policy,
    known: Mapping[str, str | None],
    candidates: list[Kernel],
    eligible: list[Kernel],
    reasons: Mapping[int, str],
    call: CallInfo | None,
) -> tuple[Kernel | None, str, str | None, tuple[Kernel, ...]]:
    """Steps 3-4 over ``eligible`` (ranked order): (winner, why, error, cost tier).

    ``known``: every installed backend → None when it loaded, else why not (its status and error).
    """
    what = "this call" if call is not None else _dtype_text(dtypes)
    eligible = _ranked(eligible, eligible)
    forced = policy.forced_for(op)
    if forced is not None:  # a backend name, or "backend/variant" for one of its kernels
        if forced.partition("/")[0] not in known:
            return (
                None,
                "",
                (
                    f"backend {forced!r} was forced for {op!r} on {device} by {policy.source} "
                    f"but is not installed (installed: {', '.join(sorted(known)) or 'none'})"
                ),
                (),
            )
        for k in eligible:
            if forced in (k.backend, k.label):
                return k, f"forced by {policy.source}", None, ()
        problem = known[forced.partition("/")[0]]
        if problem is not None and problem.startswith(("broken", "incompatible", "disabled")):
            return (
                None,
                "",
                (
                    f"backend {forced!r} was forced for {op!r} by {policy.source} but did not "
                    f"load: {problem}"
                ),
                (),
            )
        why_not = "; ".join(reasons[id(k)] for k in candidates if forced in (k.backend, k.label))
        return (
            None,
            "",
            (
                f"backend {forced!r} was forced for {op!r} by {policy.source} but cannot serve "
                f"{device} with {what}: {why_not or 'provides no such op'}"
            ),
            (),
        )
    for name in policy.prefer:
        for k in eligible:
            if name in (k.backend, k.label):
                return k, f"preferred by {policy.source}", None, ()
    if not eligible:
        why_not = (
            "; ".join(f"{k.label}: {reasons[id(k)]}" for k in candidates)
            or "no backend provides it"
        )
        return (
            None,
            "",
            f"no implementation of {op!r} can serve {device} with {what}: {why_not}"
            + _fallback_hint(known),
            (),
        )
    top = eligible[0]
    tier = tuple(k for k in eligible if k.tier == top.tier and k.cost is not None)
    if len(tier) < 2:
        return (
            top,
            "highest tier" + (" (portable fallback)" if _is_fallback(top, device) else ""),
            None,
            (),
        )
    if call is None:  # no shapes yet: the tier order's pick, refined per call
        labels = ", ".join(k.label for k in tier)
        return top, f"highest tier; per call shape, lowest cost hint of {labels}", None, tier
    scored = [
        (value, i, k)
        for i, (k, value) in enumerate(_estimates(tier, device, call))
        if value is not None
    ]
    if not scored:
        return top, "highest tier (no cost hint had an estimate for this shape)", None, tier
    value, _, best = min(scored, key=lambda t: (t[0], t[1]))
    others = ", ".join(f"{k.label} {v:.1f}" for v, _, k in scored if k is not best)
    return (
        best,
        f"lowest cost hint for this shape: {value:.1f} µs" + (f" (vs {others})" if others else ""),
        None,
        tier,
    )


def _dtype_text(dtypes: Mapping[str, torch.dtype]) -> str:
    return (
        ", ".join(f"{a}={str(d).removeprefix('torch.')}" for a, d in dtypes.items()) or "any dtypes"
    )


def _estimates(
    kernels: tuple[Kernel, ...], device: DeviceInfo, call: CallInfo
) -> list[tuple[Kernel, float | None]]:
    out: list[tuple[Kernel, float | None]] = []
    for k in kernels:
        try:
            value = k.cost(device, call) if k.cost is not None else None
        except Exception:  # a buggy hint must not break the call: the tier order decides
            value = None
        out.append((k, None if value is None or value != value else float(value)))
    return out


def estimates(trace: Trace, call: CallInfo) -> list[tuple[Kernel, float | None]]:
    """Each cost-tier kernel's estimate (µs) for one call; a raising hint counts as no estimate."""
    return _estimates(trace.cost_tier, trace.device, call)


def _shape_rejection(k: Kernel, device: DeviceInfo, call: CallInfo) -> str | None:
    if k.formats and call.get("format") not in k.formats:
        return f"takes format {', '.join(k.formats)}, not {call.get('format')}"
    if k.supports is None:
        return None
    try:
        return k.supports(device, call) or None
    except Exception as exc:  # a buggy predicate rejects its kernel, nothing more
        return f"shape check raised {type(exc).__name__}: {exc}"


def for_call(trace: Trace, call: CallInfo) -> tuple[Kernel | None, str, str | None]:
    """The kernel one call gets (step 4): the trace's eligible kernels minus those whose shape
    predicate rejects the call, then policy, tier and cost hints. (winner, why, error)."""
    if not (trace.per_call or trace.cost_tier) or trace.winner is None:
        return trace.winner, trace.why, trace.error
    candidates = [c.kernel for c in trace.candidates]
    reasons = {id(c.kernel): c.reason.removeprefix("chosen: ") for c in trace.candidates}
    eligible, declined = [], []
    for c in trace.candidates:
        if c.accepted:
            reason = _shape_rejection(c.kernel, trace.device, call)
            if reason is None:
                eligible.append(c.kernel)
            else:
                reasons[id(c.kernel)] = reason
                declined.append(f"{c.kernel.label} declined: {reason}")
    known: dict[str, str | None] = {k.backend: None for k in candidates}
    winner, why, error, _ = _select(
        trace.op,
        trace.device,
        trace.dtypes,
        trace.policy,
        known,
        candidates,
        eligible,
        reasons,
        call,
    )
    return winner, "; ".join([why, *declined]) if winner is not None else why, error


def choose(
    registry: Registry,
    op: str,
    device: DeviceInfo,
    dtypes: Mapping[str, torch.dtype] | None = None,
    policy: Policy = DEFAULT_POLICY,
) -> Trace:
    """Like :func:`rank`, but raise :class:`NoKernelError` when nothing can serve."""
    trace = rank(registry, op, device, dtypes, policy)
    if trace.winner is None:
        raise NoKernelError(f"megablocks_core: {trace.error}")
    return trace
