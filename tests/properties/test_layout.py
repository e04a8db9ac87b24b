"""The package's layout holds: no import cycle inside ``python/mmpack``, dependencies point one
way (core wings never import an integration, the restricted loader or a tool), nothing imports
another room's private names, and development code never ships.

The graph is read from the source (every ``import`` statement, those inside functions
included, except under ``if TYPE_CHECKING:``), so a lazy import cannot hide a cycle."""

from __future__ import annotations

import ast
import importlib
import warnings
from collections.abc import Iterator
from pathlib import Path

import mmpack
import pytest
from mmpack import _moved

PACKAGE = Path(mmpack.__file__).resolve().parent

#: The wings: they import only each other and the shared root modules.
CORE = frozenset({"packed", "packing", "batch"})
#: Who may import whom (a room's own modules and the root are always allowed).
ALLOWED = {
    "packed": CORE,
    "packing": CORE,
    "batch": CORE,
    "safe_load": CORE,
    "energon": CORE,
    "compat": CORE | {"safe_load"},
    "vision": CORE,
    "root": CORE | {"safe_load", "energon", "compat", "vision"},
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
PACKAGES = {name for name, p in MODULES.items() if p.name == "__init__.py"}
KNOWN = set(MODULES) | {"mmpack._native"}


def room(module: str) -> str:
    parts = module.split(".")
    if len(parts) > 1 and f"mmpack.{parts[1]}" in PACKAGES:
        return parts[1]
    return "root"


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement, skipping ``if TYPE_CHECKING:`` bodies."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def _resolve(importer: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = importer.split(".")
    if importer not in PACKAGES:
        base = base[:-1]
    base = base[: len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def edges(module: str, path: Path) -> Iterator[tuple[str, str | None, int]]:
    """``(target module, imported name or None, line)`` for each import of ``module``."""
    for node in _imports(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None, node.lineno
            continue
        target = _resolve(module, node)
        for alias in node.names:
            sub = f"{target}.{alias.name}"
            if sub in KNOWN:
                yield sub, None, node.lineno
            else:
                yield target, alias.name, node.lineno


GRAPH: dict[str, list[tuple[str, str | None, int]]] = {
    m: list(edges(m, p)) for m, p in MODULES.items()
}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module, or a self-import (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph.get(v, ()):
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def internal_graph() -> dict[str, set[str]]:
    return {m: {t for t, _, _ in es if t in MODULES and t != "mmpack"} for m, es in GRAPH.items()}


def test_the_graph_sees_the_package() -> None:
    """The walk finds the wings and their imports, lazy ones included (a guard on the guard)."""
    assert {"mmpack.packed.value", "mmpack.packing.pack", "mmpack.batch.thd"} <= set(MODULES)
    targets = {t for t, _, _ in GRAPH["mmpack.packed.value"]}
    assert {"mmpack.packed.gather", "mmpack.packed.pickling.format"} <= targets
    # imported inside the function that serves ``mmpack.packed.PackedTensor``
    lazy = {t for t, _, _ in GRAPH["mmpack.packed.pickling.operation_start"]}
    assert "mmpack.packed.value" in lazy


def test_no_import_cycle() -> None:
    assert _cycles(internal_graph()) == []


def test_the_cycle_check_finds_cycles() -> None:
    graph = internal_graph()
    graph["mmpack.packing.ranks"].add("mmpack.packing")
    graph["mmpack.packing"].add("mmpack.packing.ranks")
    assert ["mmpack.packing", "mmpack.packing.ranks"] in _cycles(graph)


def test_dependencies_point_one_way() -> None:
    wrong = []
    for module, es in GRAPH.items():
        mine = room(module)
        for target, _, line in es:
            if not target.startswith("mmpack.") or target in ("mmpack._native",):
                continue
            theirs = room(target)
            if theirs not in (mine, "root") and theirs not in ALLOWED[mine]:
                wrong.append(f"{module}:{line} ({mine}) imports {target} ({theirs})")
    assert wrong == []


def test_nothing_imports_another_rooms_private_names() -> None:
    wrong = []
    for module, es in GRAPH.items():
        for target, name, line in es:
            if not target.startswith("mmpack"):
                continue
            private = [p for p in target.split(".")[1:] if p.startswith("_")]
            if name is not None and name.startswith("_") and not name.startswith("__"):
                private.append(name)
            # the root's private modules (_native, _coerce, _moved) are the shared base
            shared = target in ("mmpack._native", "mmpack._coerce", "mmpack._moved")
            if private and not shared and room(target) != room(module):
                wrong.append(f"{module}:{line} imports {target}.{name or ''}")
    assert wrong == []


def test_the_package_never_imports_development_code() -> None:
    dev = []
    for module, es in GRAPH.items():
        for target, _, line in es:
            top = target.split(".")[0]
            if top in ("mmpack_dev", "reference", "support", "tests", "benches", "examples"):
                dev.append(f"{module}:{line} imports {target}")
    assert dev == []
    assert not [m for m in MODULES if any(w in m for w in ("demo", "synthetic", "testing"))]


@pytest.mark.parametrize("old", sorted(_moved.MOVED))
def test_earlier_module_paths_import_the_new_module_with_a_warning(old: str) -> None:
    new = importlib.import_module(_moved.MOVED[old])
    import sys

    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=rf"{old} moved to {_moved.MOVED[old]}"):
        got = importlib.import_module(old)
    assert got is new
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert importlib.import_module(old) is new  # imported once, warned once


@pytest.mark.parametrize("gone", sorted(_moved.REMOVED))
def test_development_modules_that_left_the_package_say_where(gone: str) -> None:
    with pytest.raises(ModuleNotFoundError, match="mmpack_dev"):
        importlib.import_module(gone)


def test_an_old_path_leaves_the_new_module_as_it_was() -> None:
    """Importing through an old path must not rename the new module or take its spec: a
    later ``importlib.reload`` runs the real module again, and ``importlib.resources`` still
    sees a package."""
    import importlib.resources
    import sys

    new = importlib.import_module("mmpack.safe_load")
    spec = new.__spec__
    sys.modules.pop("mmpack.compat.safe_unpickle", None)
    with pytest.warns(DeprecationWarning):
        importlib.import_module("mmpack.compat.safe_unpickle")
    assert new.__spec__ is spec and new.__name__ == "mmpack.safe_load"
    assert importlib.resources.files("mmpack.safe_load").joinpath("loader.py").is_file()
    masks = importlib.import_module("mmpack.batch.masks")
    sys.modules.pop("mmpack.masks", None)
    with pytest.warns(DeprecationWarning):
        importlib.import_module("mmpack.masks")
    original = masks.validate
    masks.validate = None  # type: ignore[assignment]
    try:
        assert importlib.reload(masks) is masks and masks.validate is not None
        assert masks.__name__ == "mmpack.batch.masks"
    finally:
        if masks.validate is None:
            masks.validate = original
