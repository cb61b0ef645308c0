"""megablocks_core's modules import each other without a circle.

The graph is read from the source with :mod:`ast`: each module's imports at module level (those
inside functions, which run later, and those under ``if TYPE_CHECKING:``, which never run, are
left out) that name a module of megablocks_core. A module's own parent packages are left out as
targets: Python imports them before the module anyway (``from . import __version__``). A circle
means some module runs half-imported.

A second graph counts every import, late and type-only ones too: a circle there does not break
importing, but it ties the modules together (neither can be understood, tested or moved without
the other) and turns into a real one as soon as an import moves to module level.
"""

from __future__ import annotations

import ast
from pathlib import Path

import megablocks_core

PACKAGE = "megablocks_core"
ROOT = Path(megablocks_core.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _top_level_imports(body: list[ast.stmt]) -> list[ast.Import | ast.ImportFrom]:
    """The import statements that run when the module is imported: at module level, including
    inside module-level ``if``/``try``/``with`` blocks, but not under ``if TYPE_CHECKING:`` nor in a
    function or class body."""
    found: list[ast.Import | ast.ImportFrom] = []
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        elif isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                found += _top_level_imports(node.body)
            found += _top_level_imports(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, *(h.body for h in node.handlers), node.orelse, node.finalbody):
                found += _top_level_imports(block)
        elif isinstance(node, ast.With):
            found += _top_level_imports(node.body)
    return found


def _targets(module: str, is_package: bool, node: ast.Import | ast.ImportFrom, known: set[str]):
    """The megablocks_core modules one import statement imports (a ``from X import name`` where
    ``name`` is a submodule of package X imports that submodule as well)."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            if alias.name.split(".")[0] == PACKAGE:
                yield alias.name
        return
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        source = ".".join([*base, *([node.module] if node.module else [])])
    else:
        source = node.module or ""
    if source.split(".")[0] != PACKAGE:
        return
    yield source
    for alias in node.names:
        if f"{source}.{alias.name}" in known:
            yield f"{source}.{alias.name}"


def _every_import(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement of a module: late (in a function) and type-only ones included."""
    return [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)]


def import_graph(every: bool = False) -> dict[str, set[str]]:
    """Module → the megablocks_core modules it imports: at import time, or with ``every``, by
    any import it contains."""
    modules = _modules()
    known = set(modules)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        edges = set()
        for node in _every_import(tree) if every else _top_level_imports(tree.body):
            for target in _targets(name, path.name == "__init__.py", node, known):
                if target in known and not name.startswith(target + ".") and target != name:
                    edges.add(target)
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of the graph (its modules, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_graph_is_read():
    graph = import_graph()
    assert "megablocks_core.entries" in graph["megablocks_core.ops"]  # the check can fail
    assert "megablocks_core.schema" in graph["megablocks_core.validation"]


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_megablocks_core_has_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or ())


def test_late_and_type_only_imports_are_counted():
    every, top_level = import_graph(every=True), import_graph()
    # cli imports the gate inside a function; the check can fail.
    assert "megablocks_core.aot" in every["megablocks_core.cli"]
    assert "megablocks_core.aot" not in top_level["megablocks_core.cli"]


def test_megablocks_core_has_no_import_cycle_even_late():
    cycle = find_cycle(import_graph(every=True))
    assert cycle is None, "import cycle (late or type-only imports counted): " + " -> ".join(
        cycle or ()
    )


#: The contracts as data, and what they are written with: they import no machinery of the core
#: (entries, dispatch, registry, autograd, ...), not even inside a function, so that a circle
#: cannot hide in a late import. An op they run (gmm_scatter's activation, served around a kernel
#: without it) goes through ``megablocks_core.calls``, which imports nothing of the core.
#: The formats (megablocks_core.formats) are data too; which encoding a device's matrix units take
#: needs its arch, from the device records (descriptors, devices), no machinery.
DATA = (
    "megablocks_core.contracts",
    "megablocks_core.schema",
    "megablocks_core.activations",
    "megablocks_core.formats",
)
DATA_MAY_IMPORT = (
    *DATA,
    "megablocks_core.bias",
    "megablocks_core.calls",
    "megablocks_core.descriptors",
    "megablocks_core.devices",
)


def _is_data(module: str, names: tuple[str, ...]) -> bool:
    return any(module == n or module.startswith(n + ".") for n in names)


def test_the_contracts_import_no_machinery_even_late():
    modules = _modules()
    known = set(modules)
    wrong = {}
    for name, path in modules.items():
        if not _is_data(name, DATA):
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        every = _every_import(tree)
        targets = {
            t
            for node in every
            for t in _targets(name, path.name == "__init__.py", node, known)
            if t in known and not name.startswith(t + ".")
        }
        bad = sorted(t for t in targets if not _is_data(t, DATA_MAY_IMPORT))
        if bad:
            wrong[name] = bad
    assert DATA[0] in modules  # the check can fail
    assert wrong == {}, wrong
