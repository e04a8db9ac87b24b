"""The error hierarchy, checked against the two tables that declare it: the native table
(``_native.ERROR_TABLE``, from ``rust/py/src/errors.rs``) and the Python table (the ``@_row``
classes of ``mmpack/errors.py``). The runtime classes, ``mmpack.errors`` and the stub agree with
them, every class sits under ``MmpackError`` and its area's base, every class pickles, and a
class sits in the native table only if Rust raises it (or subclasses it), so an error only
Python raises never needs a rebuild."""

from __future__ import annotations

import ast
import importlib
import pickle
import re
from pathlib import Path

import mmpack
import pytest
from mmpack import _native, errors

STUB = Path(mmpack.__file__).with_name("_native.pyi")
RUST_SRC = Path(__file__).resolve().parents[2] / "rust" / "py" / "src"
NATIVE_TABLE = _native.ERROR_TABLE
NATIVE = [row[0] for row in NATIVE_TABLE]
ROWS = {row[0]: row for row in NATIVE_TABLE}
#: Every class of both tables, by area, as ``mmpack.errors`` lists them.
AREA = {cls.__name__: area for area, classes in errors.AREAS.items() for cls in classes}
NAMES = list(AREA)
PYTHON = [name for name in NAMES if name not in ROWS]


def _mmpack_bases(cls: type) -> list[type]:
    return [b for b in cls.__bases__ if b.__module__ in ("mmpack._native", "mmpack.errors")]


def _resolve(base: str) -> type:
    """A base as the native table names it: an earlier row, a builtin, or ``module.Name``."""
    if base in ROWS:
        return getattr(_native, base)
    module, _, attr = base.rpartition(".")
    return getattr(importlib.import_module(module or "builtins"), attr)


def test_native_table_rows_are_well_formed() -> None:
    assert len(set(NATIVE)) == len(NATIVE) and NATIVE[0] == "MmpackError"
    for at, (name, bases, area, doc) in enumerate(NATIVE_TABLE):
        assert name.endswith("Error") and area and bases
        assert doc.strip() and doc == " ".join(doc.split()), f"{name}: docstring"
        # a base from the table comes before its subclass
        assert all(NATIVE.index(b) < at for b in bases if b in ROWS), name
        # one base from the table (the hierarchy is a tree); builtins only beside it
        assert sum(b in ROWS for b in bases) == (0 if name == "MmpackError" else 1), name
    # every area is one run of rows
    areas = [row[2] for row in NATIVE_TABLE]
    runs = [a for at, a in enumerate(areas) if at == 0 or areas[at - 1] != a]
    assert len(runs) == len(set(runs)), runs


def test_the_two_tables_make_one_tree() -> None:
    assert PYTHON, "the Python table is empty"
    assert sorted(NAMES) == sorted({*NATIVE, *PYTHON}) and len(NAMES) == len(NATIVE) + len(PYTHON)
    for at, name in enumerate(NAMES):
        cls = getattr(errors, name)
        assert cls.__name__ == cls.__qualname__ == name and name.endswith("Error")
        doc = cls.__doc__ or ""
        assert doc.strip() and doc == " ".join(doc.split()), f"{name}: docstring"
        # one mmpack base, listed earlier; builtins only beside it
        bases = _mmpack_bases(cls)
        assert len(bases) == (0 if name == "MmpackError" else 1), name
        assert all(NAMES.index(b.__name__) < at for b in bases), name
    # each area's first class is its base, right under MmpackError
    for area, classes in errors.AREAS.items():
        head = classes[0]
        assert area == "shared" or _mmpack_bases(head) == [errors.MmpackError], area


@pytest.mark.parametrize("name", NATIVE)
def test_native_class_is_its_row(name: str) -> None:
    _, bases, area, doc = ROWS[name]
    cls = getattr(_native, name)
    assert cls.__name__ == cls.__qualname__ == name
    assert cls.__module__ == "mmpack._native"
    assert cls.__doc__ == doc
    assert cls.__bases__ == tuple(_resolve(b) for b in bases)
    assert AREA[name] == area
    # the errors module re-exports the very same class
    assert getattr(errors, name) is cls


@pytest.mark.parametrize("name", PYTHON)
def test_python_class_lives_in_python_only(name: str) -> None:
    """A class of the Python table is a plain Python class, published as ``mmpack.errors``: the
    extension knows nothing of it, so changing it needs no rebuild and no ``make stubs``."""
    cls = getattr(errors, name)
    assert cls.__module__ == "mmpack.errors"
    assert not hasattr(_native, name)
    assert not re.search(rf"\bclass {name}\b", STUB.read_text())


@pytest.mark.parametrize("name", NAMES)
def test_every_class_is_an_mmpack_error_under_its_area(name: str) -> None:
    cls = getattr(errors, name)
    assert issubclass(cls, errors.MmpackError) and issubclass(cls, ValueError)
    bases = {area: classes[0] for area, classes in errors.AREAS.items()}
    area = AREA[name]
    under = [a for a, base in bases.items() if a != "shared" and issubclass(cls, base)]
    assert under == ([] if area == "shared" else [area])
    # catching the area catches the class
    with pytest.raises(bases[area]):
        raise cls("x")


@pytest.mark.parametrize("name", NAMES)
def test_every_class_pickles(name: str) -> None:
    cls = getattr(errors, name)
    assert pickle.loads(pickle.dumps(cls)) is cls
    err = cls("message naming sample 3")
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is cls and back.args == err.args and str(back) == str(err)


def test_errors_module_exports_every_class() -> None:
    assert errors.__all__ == NAMES
    defined = [
        n
        for n, v in vars(errors).items()
        if isinstance(v, type) and issubclass(v, BaseException) and not n.startswith("_")
    ]
    assert sorted(defined) == sorted(NAMES)
    exported = {n for n in dir(_native) if n.endswith("Error")}
    assert exported == set(NATIVE), "a native exception class outside the native table"


def test_stub_declares_every_native_class_with_its_bases_and_doc() -> None:
    classes = {
        node.name: node
        for node in ast.parse(STUB.read_text()).body
        if isinstance(node, ast.ClassDef) and node.name in ROWS
    }
    assert list(classes) == NATIVE, "the stub lists other classes or another order"
    for name, node in classes.items():
        _, bases, _, doc = ROWS[name]
        assert [ast.unparse(b) for b in node.bases] == list(bases), name
        assert " ".join((ast.get_docstring(node) or "").split()) == doc, name


def _rust_without_the_table() -> str:
    """The bindings' Rust source, less the ``error_table!`` rows that declare the classes."""
    if not RUST_SRC.is_dir():
        pytest.skip("the Rust sources are not beside the tests")
    text = "\n".join(p.read_text() for p in sorted(RUST_SRC.rglob("*.rs")))
    table = re.search(r"^error_table! \{$.*?^\}$", text, re.M | re.S)
    assert table, "no error_table! block in rust/py/src"
    return text[: table.start()] + text[table.end() :]


def test_a_native_class_is_one_rust_raises() -> None:
    """A native row is raised by Rust (``ErrorClass::X`` or the ``E::X`` of the ``CoreError``
    match) or is the base of a native row; any other class belongs in the Python table."""
    raised = set(re.findall(r"\b(?:ErrorClass|E)::([A-Za-z]+Error)\b", _rust_without_the_table()))
    bases = {b for _, row_bases, _, _ in NATIVE_TABLE for b in row_bases}
    idle = [name for name in NATIVE if name not in raised | bases]
    assert not idle, f"declared in rust/py/src/errors.rs but never raised by Rust: {idle}"


def test_rust_raises_the_classes_of_the_table() -> None:
    """The Rust side raises the very classes made at module init: a mask of the wrong length is
    ``mmpack.errors.LossMaskError``, caught as its area's base."""
    import numpy as np

    with pytest.raises(errors.BatchError) as info:
        _native.validate_mask(np.ones(3, dtype=np.uint8), 4, False, "sample 0")
    assert type(info.value) is errors.LossMaskError
    assert isinstance(info.value, errors.MmpackError)


def test_internal_gather_errors_map_to_the_area_base() -> None:
    """Only a wrong call of the private gather functions reaches the core's gather errors:
    they have no class of their own."""
    import numpy as np

    assert not hasattr(_native, "GatherIndexError") and not hasattr(errors, "GatherSizeError")
    out = np.zeros(4, dtype=np.uint8)
    with pytest.raises(errors.PackedTensorError) as info:
        _native.gather_into(out, [np.arange(4, dtype=np.uint8)], np.array([3], dtype=np.int64))
    assert type(info.value) is errors.PackedTensorError
    assert "order[0] = 3 is out of range for 1 source segments" in str(info.value)


def test_packed_concat_refuses_an_unknown_mode_and_missing_layouts() -> None:
    from mmpack import PackedTensor

    with pytest.raises(ValueError, match='unknown concat mode "stack"; known: concat, merge'):
        _native.packed_concat([], [], "stack")  # type: ignore[arg-type]
    v = PackedTensor([None], 0)
    with pytest.raises(ValueError, match="layouts must have one entry per value"):
        _native.packed_concat([v, v], [None], "concat")
    out = _native.packed_concat([v, v], [None, None], "concat")
    assert out.layout is None and out.tensors == [None, None] and out.dim_to_pack == 0
