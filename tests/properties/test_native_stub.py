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


@pytest.mark.parametrize("name", sorted(DECLARED))
def test_stub_docstring_is_the_runtime_docstring(name: str) -> None:
    node, runtime = DECLARED[name]
    runtime_doc = inspect.getdoc(runtime)
    assert _normalised(runtime_doc), f"{name} has no runtime docstring: add a /// comment"
    if isinstance(node, ast.ClassDef):
        # its own docstring, not one inherited from a base
        assert runtime.__dict__.get("__doc__"), f"{name} has no docstring of its own"
    assert _normalised(ast.get_docstring(node)) == _normalised(runtime_doc), name
