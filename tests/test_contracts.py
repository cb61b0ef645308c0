"""The contracts drive docs, the public signatures and the custom-op schemas; check they agree."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch

from megablocks_core import contracts, docgen, library, ops
from megablocks_core.entries import ENTRIES
from megablocks_core.schema import BoolArg, ChoiceArg, FloatArg, IntArg, TensorArg

ROOT = Path(__file__).resolve().parents[1]


def test_docs_contracts_md_is_generated_from_the_contracts():
    path = ROOT / "docs" / "contracts.md"
    assert path.read_text() == docgen.render_markdown(), (
        "docs/contracts.md is stale: regenerate it with `megablocks contracts > docs/contracts.md`"
    )


def _cells(row: str) -> int:
    """The cells of a Markdown table row as GitHub splits it: at every ``|`` not escaped, inside
    code spans too."""
    return len(re.findall(r"(?<!\\)\|", row.strip())) - 1


@pytest.mark.parametrize(
    "path", [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))], ids=lambda p: p.name
)
def test_every_table_row_of_the_docs_has_its_headers_cells(path):
    """A ``|`` inside a cell (``str | None``) must be escaped, or the row breaks its table."""
    separator = re.compile(r"\|[-:| ]+\|")
    lines = path.read_text().splitlines()
    width = None
    broken = []
    for number, line in enumerate(lines, 1):
        if not line.startswith("|"):
            width = None
        elif width is None:
            if number < len(lines) and separator.fullmatch(lines[number].strip()):
                width = _cells(line)
        elif not separator.fullmatch(line.strip()) and _cells(line) != width:
            broken.append(f"{path.name}:{number}: {_cells(line)} cells, its header {width}")
    assert not broken, "\n".join(broken)


def test_public_signatures_match_the_contracts():
    for contract in contracts.ALL:
        fn = getattr(ops, contract.name, None)
        if not contract.public:
            assert fn is None, f"{contract.name} is kernel-only but exported from ops"
            continue
        assert fn is not None and contract.name in ops.__all__, contract.name
        params = inspect.signature(fn).parameters
        assert list(params) == [a.name for a in contract.public_args], contract.name
        for a in contract.public_args:
            default = params[a.name].default
            if isinstance(a, BoolArg) or (
                isinstance(a, IntArg) and (a.optional or a.default is not None)
            ):
                assert default == a.default, (contract.name, a.name)
            elif isinstance(a, ChoiceArg | FloatArg) or (
                isinstance(a, TensorArg) and a.serve is not None
            ):
                assert default is None, (contract.name, a.name)
            else:
                assert default is inspect.Parameter.empty, (contract.name, a.name)


def test_every_dispatched_op_has_an_entry_and_a_custom_op():
    dispatched = {c.name for c in contracts.ALL if c.dispatched}
    assert set(ENTRIES) == dispatched
    for name in dispatched:
        schema = str(getattr(torch.ops.megablocks, name).default._schema)
        assert schema.startswith(
            f"megablocks::{library.schema(contracts.BY_NAME[name])}".split("->")[0].strip()[:-1]
        )


def test_rule_expressions_only_name_arguments_and_helpers():
    import ast

    from megablocks_core.schema import HELPER_NAMES

    for contract in contracts.ALL:
        allowed = set(contract.arg_names) | HELPER_NAMES
        for rule in contract.rules:
            names = {
                n.id for n in ast.walk(ast.parse(rule.expr, mode="eval")) if isinstance(n, ast.Name)
            }
            assert names <= allowed, (contract.name, rule.expr, names - allowed)


def test_version_is_single_sourced():
    import importlib.metadata

    import megablocks_core

    assert importlib.metadata.version("megablocks-core") == megablocks_core.__version__


def test_this_repositorys_backends_cover_every_dispatched_op():
    """The reference is the oracle for every op; the triton backend also implements them all."""
    import megablocks_core

    dispatched = {c.name for c in contracts.ALL if c.dispatched}
    plugins = megablocks_core.registry().plugins
    assert set(plugins["reference"].ops) == dispatched
    if "triton" in plugins and plugins["triton"].status != "broken":
        assert set(plugins["triton"].ops) == dispatched, plugins["triton"].reason


def test_a_choice_argument_names_its_target_and_transform_together():
    """An option the core applies for kernels without it needs both; glu's needs neither."""
    with pytest.raises(ValueError, match="applies_to and apply together"):
        ChoiceArg("activation", "doc", ("gelu",), applies_to="x")
    with pytest.raises(ValueError, match="applies_to and apply together"):
        ChoiceArg("activation", "doc", ("gelu",), apply=lambda x, name: x)
    assert contracts.GLU.arg("activation").apply is None
    assert contracts.GMM_SCATTER.arg("activation").apply is not None
