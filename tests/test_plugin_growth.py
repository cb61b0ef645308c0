"""A core that grows keeps its plugins: each plugin declares the ops it provides as data, so an
op added to the core leaves every installed backend loaded with the kernels it had, and a test
(here) demands that the reference, the conformance oracle, covers every op of this core."""

from __future__ import annotations

import dataclasses
import sys

import pytest

import megablocks_core
from megablocks_core import contracts, dispatch

IN_REPO = ("reference", "triton", "rocm", "cuda")
PACKAGES = {f"megablocks_{name}" for name in IN_REPO}


def _records():
    return {name: dispatch.registry().plugins.get(name) for name in IN_REPO}


def _fresh_plugin_modules(patch: pytest.MonkeyPatch) -> None:
    """Plugins imported anew on the next load, as a process with the newer core would import
    them (module-level lists built from the core's then see the new op)."""
    for name in list(sys.modules):
        if name.split(".")[0] in PACKAGES:
            patch.delitem(sys.modules, name)


def test_every_plugin_still_loads_with_its_kernels_when_the_core_adds_an_op(clean_env):
    megablocks_core.reload({})
    before = {name: (r.status, r.ops) for name, r in _records().items() if r is not None}
    assert before.get("reference", ("",))[0] == "ok"
    grown = dataclasses.replace(contracts.BY_NAME["histogram"], name="histogram_of_a_newer_core")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(contracts, "ALL", (*contracts.ALL, grown))
        patch.setitem(contracts.BY_NAME, grown.name, grown)
        _fresh_plugin_modules(patch)
        megablocks_core.reload({})
        after = {name: (r.status, r.ops) for name, r in _records().items() if r is not None}
    megablocks_core.reload({})
    assert after == before  # same status ("ok" or "unavailable here"), same ops, none broken


def test_the_reference_provides_every_op_of_this_core(clean_env):
    megablocks_core.reload({})
    reference = dispatch.registry().plugins["reference"]
    dispatched = {c.name for c in contracts.ALL if c.dispatched}
    assert set(reference.ops) == dispatched


def test_triton_declares_every_op_of_this_core():
    plugin = pytest.importorskip("megablocks_triton.plugin")
    declared = (
        *plugin.ROUTING,
        *plugin.PERMUTATION,
        *plugin.GROUPED_GEMM,
        *plugin.SCALED_GEMM,
        *plugin.ACTIVATION,
        *plugin.QUANTIZATION,
    )
    assert len(declared) == len(set(declared))
    for family, ops in (
        ("routing", plugin.ROUTING),
        ("permutation", plugin.PERMUTATION),
        ("grouped_gemm", (*plugin.GROUPED_GEMM, *plugin.SCALED_GEMM)),
        ("activation", plugin.ACTIVATION),
        ("quantization", plugin.QUANTIZATION),
    ):
        assert set(ops) == set(contracts.family_ops(family)), family


@pytest.mark.parametrize(
    "missing, reason",
    [
        ("dtypes row", "megablocks_triton.plugin declares no dtypes for it"),
        ("size row", "megablocks_triton.plugin declares no (experts, rows) arguments"),
        ("function", "megablocks_triton.gmm has no function 'gmm_scatter'"),
    ],
)
def test_a_row_missing_from_tritons_tables_fails_that_op_alone(clean_env, missing, reason):
    """A per-op table of the triton plugin without a row for one op (as when an op is added to
    its list and not to every table) costs that op, reported, not every op of the backend."""
    plugin = pytest.importorskip("megablocks_triton.plugin")
    gmm = pytest.importorskip("megablocks_triton.gmm")
    env = {"MEGABLOCKS_PLUGINS": "reference,triton"}
    before = megablocks_core.reload(env).plugins["triton"]
    assert before.problems == () and "gmm_scatter" in before.ops
    with pytest.MonkeyPatch.context() as patch:
        if missing == "dtypes row":
            rows = plugin._gmm_dtypes()
            del rows["gmm_scatter"]
            patch.setattr(plugin, "_gmm_dtypes", lambda: rows)
        elif missing == "size row":
            patch.delitem(plugin._GMM_SIZES, "gmm_scatter")
        else:
            patch.delattr(gmm, "gmm_scatter")
        after = megablocks_core.reload(env).plugins["triton"]
    megablocks_core.reload({})
    assert after.status == before.status  # loaded ("ok" or "unavailable here"), not broken
    assert set(before.ops) - set(after.ops) == {"gmm_scatter"}
    assert [(p.op, p.variant) for p in after.problems] == [("gmm_scatter", "")]
    assert after.problems[0].reason.startswith(reason)
