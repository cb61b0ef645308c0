"""Fake backend distributions, discovered through real ``megablocks.backends`` entry points.

:class:`FakePlugins` writes ``NAME-VERSION.dist-info`` folders (METADATA and
entry_points.txt) plus the plugin module into a temporary directory, puts that
directory first on ``sys.path`` and reloads the registry. Nothing in the core is
patched: the core finds the fakes exactly as it finds installed plugins.

Every generated module starts with :data:`PRELUDE`, which gives it

- ``CALLS``: the op names its kernels were called for, in order;
- ``CAP_CALLS``: how many times its capability predicates ran;
- ``recording(op)``: a kernel fn that appends ``op`` to ``CALLS`` and delegates
  to the reference kernel (so results stay correct);
- ``counting(check)``: wraps a capability predicate to count its calls.
"""

from __future__ import annotations

import importlib
import sys
import textwrap
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType

import pytest
import torch

import megablocks_core

PRELUDE = """\
import functools

import torch
from megablocks_core import DeviceInfo, Kernel, Tier, hookimpl
from megablocks_reference import kernels as _reference
from megablocks_reference import scaled as _reference_scaled

CALLS = []
CAP_CALLS = [0]


def recording(op):
    reference = getattr(_reference, op, None) or getattr(_reference_scaled, op)

    @functools.wraps(reference)  # its signature too: the core passes what the reference takes
    def fn(*args):
        CALLS.append(op)
        return reference(*args)

    return fn


def counting(check):
    def predicate(device):
        CAP_CALLS[0] += 1
        return check(device)

    return predicate

"""

#: The environment variables the core reads; tests that build their own registry clear them.
ENV_VARS = (
    "MEGABLOCKS_BACKEND",
    "MEGABLOCKS_PLUGINS",
    "MEGABLOCKS_DISABLE_PLUGINS",
    "MEGABLOCKS_STRICT_PLUGINS",
    "MEGABLOCKS_CHECK",
)
#: Other installed backends (triton under TRITON_INTERPRET=1) would change what these tests expect.
ONLY_REFERENCE = {"MEGABLOCKS_PLUGINS": "reference"}

MODULE_PREFIX = "mbfake_"


class FakePlugins:
    """Creates fake plugin distributions under ``root`` and reloads the registry."""

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.root = root
        self.monkeypatch = monkeypatch
        self.modules: set[str] = set()
        self.sites: set[Path] = set()
        self.names: list[str] = []

    def site(self, sub: str = "site") -> Path:
        path = self.root / sub
        if path not in self.sites:
            path.mkdir(parents=True, exist_ok=True)
            self.monkeypatch.syspath_prepend(str(path))
            self.sites.add(path)
        return path

    def add(
        self,
        name: str,
        body: str = "",
        *,
        distribution: str | None = None,
        version: str = "1.0",
        requires: tuple[str, ...] = (),
        module: str | None = None,
        prelude: bool = True,
        sub: str = "site",
    ) -> str:
        """Write a distribution whose entry point ``name`` points at a new module; return the module name."""
        site = self.site(sub)
        module = module or f"{MODULE_PREFIX}{name}"
        distribution = distribution or f"megablocks-fake-{name}"
        info = site / f"{distribution.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        metadata = ["Metadata-Version: 2.1", f"Name: {distribution}", f"Version: {version}"]
        metadata += [f"Requires-Dist: {r}" for r in requires]
        (info / "METADATA").write_text("\n".join(metadata) + "\n")
        (info / "entry_points.txt").write_text(f"[megablocks.backends]\n{name} = {module}\n")
        source = (PRELUDE if prelude else "") + textwrap.dedent(body)
        (site / f"{module}.py").write_text(source)
        self.modules.add(module)
        self.names.append(name)
        importlib.invalidate_caches()
        return module

    def reload(self, env: Mapping[str, str] | None = None) -> megablocks_core.dispatch.Registry:
        """Reload with only reference and the fakes, unless ``env`` sets its own plugin lists
        (other installed backends, e.g. triton under TRITON_INTERPRET=1, would outrank the fakes)."""
        importlib.invalidate_caches()
        env = dict(env or {})
        if "MEGABLOCKS_PLUGINS" not in env and "MEGABLOCKS_DISABLE_PLUGINS" not in env:
            env["MEGABLOCKS_PLUGINS"] = ",".join(["reference", *self.names])
        return megablocks_core.reload(env)

    def module(self, name: str) -> ModuleType:
        """The imported module of plugin ``name`` (created with the default module name)."""
        return sys.modules[f"{MODULE_PREFIX}{name}"]

    def calls(self, name: str) -> list[str]:
        return self.module(name).CALLS

    def cleanup(self) -> None:
        megablocks_core.set_backend()
        for module in self.modules:
            sys.modules.pop(module, None)
        # syspath entries are removed by monkeypatch; do it now so reload({}) sees the normal set.
        for site in self.sites:
            while str(site) in sys.path:
                sys.path.remove(str(site))
        importlib.invalidate_caches()
        megablocks_core.reload({})


def kernels_body(hook: str, kernels: str, extra: str = "") -> str:
    """Module body with one kernel hook returning the Python list expression ``kernels``."""
    return f"{textwrap.dedent(extra)}\n\n@hookimpl\ndef {hook}():\n    return {kernels}\n"


def permutation(kernels: str, extra: str = "") -> str:
    return kernels_body("megablocks_permutation_kernels", kernels, extra)


def routing_inputs(
    tokens: int = 6,
    experts: int = 3,
    top_k: int = 2,
    hidden: int = 4,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
):
    """(x, indices, bin_ids, bins, weights) built the way a MoE layer builds them, with plain torch."""
    gen = torch.Generator().manual_seed(seed)
    top_experts = torch.randint(0, experts, (tokens * top_k,), generator=gen, dtype=torch.int32)
    bin_ids, indices = torch.sort(top_experts, stable=True)
    counts = torch.bincount(top_experts.long(), minlength=experts)
    bins = torch.cumsum(counts, 0).to(torch.int32)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    weights = torch.rand(tokens * top_k, generator=gen).to(dtype)
    return x, indices.to(torch.int32), bin_ids.to(torch.int32), bins, weights
