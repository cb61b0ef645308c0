"""What every command of the ``megablocks`` command line shares: the user-error type, the plugin
registry as the commands load it, progress lines, plain-text tables and ``--device``."""

from __future__ import annotations

import os
import sys

import torch

from . import dispatch
from .descriptors import DeviceInfo
from .devices import describe
from .policy import environment_policy
from .registry import Registry

#: The name of a device ``explain`` describes that this host does not have.
ABSENT = "not present on this host"


class CLIError(Exception):
    """A user error: printed on stderr, exit status 2."""


def _registry() -> Registry:
    """The plugin registry, once MEGABLOCKS_BACKEND is known to name only real ops (loading the
    registry reports a bad one as a ValueError, which outside this check would read as a bug)."""
    try:
        environment_policy(os.environ)
    except ValueError as exc:
        raise CLIError(str(exc)) from exc
    return dispatch.registry()


def progress(line: str) -> None:
    """A line on stderr for a person watching a long command (``check``, ``compile``): only when
    stderr is a terminal, so that a log or a pipe gets the report alone."""
    if sys.stderr.isatty():
        print(line, file=sys.stderr, flush=True)


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    lines += [
        "  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
    ]
    return "\n".join(lines)


def _device(text: str, runs: bool = False) -> DeviceInfo:
    """Describe a ``--device`` value, after the plugins have loaded: a vendor's torch extension
    (imported by its plugin) may register the device type (e.g. ``npu``). ``runs``: the command
    will run ops there, so the device must exist and hold data (``explain`` describes any
    device, ``meta`` and a GPU this host lacks included)."""
    _registry()
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError) as exc:
        raise CLIError(f"device {text!r}: {str(exc).splitlines()[0]}") from exc
    if not runs and device.type == "cuda" and not torch.cuda.is_available():
        # explain describes a GPU this host lacks as such (its arch unknown) instead of failing.
        kind = "rocm" if torch.version.hip else "cuda"
        return DeviceInfo(kind=kind, type="cuda", index=device.index, name=ABSENT)
    try:
        info = describe(device)
    except (RuntimeError, ValueError) as exc:
        raise CLIError(f"device {text!r}: {str(exc).splitlines()[0]}") from exc
    if runs and info.type == "meta":
        raise CLIError(f"device {text!r}: meta tensors hold no data, so no op can run there")
    if runs and info.type not in ("cpu", "cuda"):  # cuda: describe() has checked it
        module = getattr(torch, info.type, None)
        available = getattr(module, "is_available", None)
        if callable(available) and not available():
            raise CLIError(f"device {text!r}: torch sees no {info.type} device")
    return info
