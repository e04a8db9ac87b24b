"""``_native.pyi`` against the extension: every public runtime name is declared, and every
declared class, function, method and property carries the docstring of its runtime object (the
Rust ``///`` comment pyo3 turns into ``__doc__``). ``mypy.stubtest`` checks the signatures."""

from __future__ import annotations

import ast
import inspect
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mmpack
import pytest
from mmpack import _native

STUB = Path(mmpack.__file__).with_name("_native.pyi")

#: Defined in rust/py/src/batch.rs, whose bindings are being reworked: their stub entries get
#: docstrings with that rework. Exempt from the docstring check only; remove names as they land.
BATCH_BINDINGS_WITHOUT_DOCS = frozenset(
    {
        "ThdLayout",
        "PaddedLayout",
        "build_pack",
        "build_padded",
        "check_pack",
        "check_padded",
        "concat_packs",
    }
)

_TREE = ast.parse(STUB.read_text())


def _declared() -> Iterator[tuple[str, ast.ClassDef | ast.FunctionDef, Any]]:
    """Every class, function, method and property of the stub, with its runtime object."""
    for node in _TREE.body:
        if not isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            continue
        runtime = getattr(_native, node.name)
        yield node.name, node, runtime
        if isinstance(node, ast.ClassDef):
            for member in node.body:
                if isinstance(member, ast.FunctionDef):
                    yield f"{node.name}.{member.name}", member, getattr(runtime, member.name)


DECLARED = {name: (node, runtime) for name, node, runtime in _declared()}


def _normalised(doc: str | None) -> str:
    return " ".join((doc or "").split())


def test_every_public_runtime_name_is_in_the_stub() -> None:
    declared = set()
    for node in _TREE.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            declared.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            declared.add(node.target.id)
    public = {name for name in dir(_native) if not name.startswith("_")}
    assert public - declared == set()
    assert BATCH_BINDINGS_WITHOUT_DOCS <= public, "an exempt name is gone: drop it from the set"


@pytest.mark.parametrize(
    "name", sorted(n for n in DECLARED if n.split(".")[0] not in BATCH_BINDINGS_WITHOUT_DOCS)
)
def test_stub_docstring_is_the_runtime_docstring(name: str) -> None:
    node, runtime = DECLARED[name]
    runtime_doc = inspect.getdoc(runtime)
    assert _normalised(runtime_doc), f"{name} has no runtime docstring: add a /// comment"
    if isinstance(node, ast.ClassDef):
        # its own docstring, not one inherited from a base
        assert runtime.__dict__.get("__doc__"), f"{name} has no docstring of its own"
    assert _normalised(ast.get_docstring(node)) == _normalised(runtime_doc), name


def test_the_exempt_batch_bindings_are_declared_without_docstrings_still() -> None:
    """Once an exempt entry has a docstring it is checked like the others: drop it from the
    set."""
    documented = {
        name
        for name in BATCH_BINDINGS_WITHOUT_DOCS
        if ast.get_docstring(DECLARED[name][0]) is not None
    }
    assert documented == set()
