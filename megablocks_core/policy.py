"""The user's overrides of the ranking, and checked mode.

Three places can override which backend serves an op, in this order of precedence:

1. a :func:`use_backend` block (context-local: threads and asyncio tasks are isolated);
2. :func:`set_backend` (process-wide);
3. the environment: ``MEGABLOCKS_BACKEND`` (read when the core is imported and by
   :func:`megablocks_core.reload`).

Each is a :class:`Policy`; :func:`current_policy` is the one in force. ``MEGABLOCKS_CHECK=1``
(checked mode: the contract rules that read tensor data run too) is read with the environment's
policy. A policy is part of every selection-cache key (:mod:`megablocks_core.dispatch`), so a
change of policy never reuses a choice made under another.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace

from .contracts import BY_NAME


@dataclass(frozen=True)
class Policy:
    """User overrides of the ranking (from ``MEGABLOCKS_BACKEND`` or :func:`use_backend`).

    ``force``: one backend for every op. ``prefer``: tried in order, then normal
    ranking. ``per_op``: op name → forced backend. Equal by value (``source``, which only
    names where it came from, aside), so the ``use_backend`` block a loop enters again and again
    finds the choices made the first time in the dispatch caches, whose keys hold the policy.
    """

    force: str | None = None
    prefer: tuple[str, ...] = ()
    per_op: tuple[tuple[str, str], ...] = ()
    source: str = field(default="default", compare=False)

    def __post_init__(self) -> None:
        # Hashed on every dispatched call (it is part of the call key): computed once.
        object.__setattr__(self, "_hash", hash((self.force, self.prefer, self.per_op)))

    def __hash__(self) -> int:
        return self._hash  # type: ignore[attr-defined]

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


class Overrides:
    """The process-wide overrides, read from the environment by :func:`read_environment`."""

    env_spec: str = ""
    env_policy: Policy = DEFAULT_POLICY
    set_policy: Policy | None = None
    policy: Policy = DEFAULT_POLICY
    """The policy outside any :func:`use_backend` block: set_policy, else env_policy."""
    checked: bool = False
    """Checked mode (``MEGABLOCKS_CHECK=1``)."""

    def update_policy(self) -> None:
        self.policy = self.set_policy if self.set_policy is not None else self.env_policy


#: The one instance; the generated entry functions read ``policy`` and ``checked`` on every call.
overrides = Overrides()
_context_policy: contextvars.ContextVar[Policy | None] = contextvars.ContextVar(
    "megablocks_backend", default=None
)
#: The policy of the innermost :func:`use_backend` block, or None (read on every call).
context_policy = _context_policy.get


def current_policy() -> Policy:
    """The ranking overrides in force here: context > :func:`set_backend` > environment."""
    return _context_policy.get() or overrides.policy


#: MEGABLOCKS_CHECK's values, case aside: checked mode on, or off (unset is off).
CHECK_ON = ("1", "true", "yes", "on")
CHECK_OFF = ("", "0", "false", "no", "off")


def environment_checked(env: Mapping[str, str]) -> bool:
    """Checked mode as ``MEGABLOCKS_CHECK`` of ``env`` sets it; ValueError for another value
    (``false`` must not turn it on)."""
    value = env.get("MEGABLOCKS_CHECK", "").strip().lower()
    if value not in CHECK_ON + CHECK_OFF:
        raise ValueError(
            f"MEGABLOCKS_CHECK={env['MEGABLOCKS_CHECK']!r}: use 1 (or true, yes, on) for checked "
            "mode, 0 (or false, no, off, unset) for none"
        )
    return value in CHECK_ON


def environment_policy(env: Mapping[str, str]) -> tuple[str, Policy]:
    """``MEGABLOCKS_BACKEND`` of ``env`` and its policy; raises ValueError for an unknown op name
    (and for a MEGABLOCKS_CHECK that is neither on nor off, read with it)."""
    environment_checked(env)
    spec = env.get("MEGABLOCKS_BACKEND", "").strip()
    if spec == overrides.env_spec:  # the same object: cache keys made before a reload stay valid
        return spec, overrides.env_policy
    policy = Policy.parse(spec) if spec else DEFAULT_POLICY
    unknown_ops = sorted({op for op, _ in policy.per_op} - set(BY_NAME))
    if unknown_ops:  # a typo must not silently leave an op on the default ranking
        raise ValueError(
            f"MEGABLOCKS_BACKEND={spec!r} names unknown op(s) {unknown_ops}; "
            f"ops are {sorted(BY_NAME)}"
        )
    return spec, policy


def read_environment(env: Mapping[str, str]) -> None:
    """Take the environment's overrides (cheap: no plugin is loaded)."""
    overrides.env_spec, overrides.env_policy = environment_policy(env)
    overrides.checked = environment_checked(env)
    overrides.update_policy()


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
    overrides.set_policy = _policy_from(names, per_op, "set_backend()")
    overrides.update_policy()


def with_op_forced(policy: Policy, op: str, backend: str) -> Policy:
    """``policy`` with ``op`` forced to ``backend`` and every other op as it was
    (:func:`megablocks_core.plugin.call_op`'s ``backend``)."""
    per_op = (*((o, b) for o, b in policy.per_op if o != op), (op, backend))
    return replace(policy, per_op=per_op, source="call_op(backend=...)")


@contextlib.contextmanager
def policy_scope(policy: Policy) -> Iterator[None]:
    """Run a block under ``policy`` (a backward pass under its forward's policy)."""
    token = _context_policy.set(policy)
    try:
        yield
    finally:
        _context_policy.reset(token)


# The environment's overrides hold from the first call. A bad MEGABLOCKS_BACKEND or MEGABLOCKS_CHECK
# is reported by the registry's first load (the first call, :func:`megablocks_core.dispatch.reload`), not here.
with contextlib.suppress(ValueError):
    read_environment(os.environ)
