"""The error hierarchy, checked against the one table that declares it
(``_native.ERROR_TABLE``, from ``rust/py/src/errors.rs``): the runtime classes, ``mmpack.errors``
and the stub agree with it, every class sits under ``MmpackError`` and its area's base, and every
class pickles."""

from __future__ import annotations

import ast
import importlib
import pickle
from pathlib import Path

import mmpack
import pytest
from mmpack import _native, errors

STUB = Path(mmpack.__file__).with_name("_native.pyi")
TABLE = _native.ERROR_TABLE
NAMES = [row[0] for row in TABLE]
ROWS = {row[0]: row for row in TABLE}


def _area_bases() -> dict[str, type]:
    """The base class of each area: its first row (``shared`` has none but ``MmpackError``)."""
    out: dict[str, type] = {}
    for name, _, area, _ in TABLE:
        out.setdefault(area, getattr(_native, name))
    return out


def _resolve(base: str) -> type:
    """A base as the table names it: an earlier row, a builtin, or ``module.Name``."""
    if base in ROWS:
        return getattr(_native, base)
    module, _, attr = base.rpartition(".")
    return getattr(importlib.import_module(module or "builtins"), attr)


def test_table_rows_are_well_formed() -> None:
    assert len(set(NAMES)) == len(NAMES) and NAMES[0] == "MmpackError"
    for at, (name, bases, area, doc) in enumerate(TABLE):
        assert name.endswith("Error") and area and bases
        assert doc.strip() and doc == " ".join(doc.split()), f"{name}: docstring"
        # a base from the table comes before its subclass
        assert all(NAMES.index(b) < at for b in bases if b in ROWS), name
        # one base from the table (the hierarchy is a tree); builtins only beside it
        assert sum(b in ROWS for b in bases) == (0 if name == "MmpackError" else 1), name
    # every area is one run of rows
    areas = [row[2] for row in TABLE]
    runs = [a for at, a in enumerate(areas) if at == 0 or areas[at - 1] != a]
    assert len(runs) == len(set(runs)), runs


@pytest.mark.parametrize("name", NAMES)
def test_runtime_class_is_its_row(name: str) -> None:
    _, bases, _, doc = ROWS[name]
    cls = getattr(_native, name)
    assert cls.__name__ == cls.__qualname__ == name
    assert cls.__module__ == "mmpack._native"
    assert cls.__doc__ == doc
    assert cls.__bases__ == tuple(_resolve(b) for b in bases)
    # the errors module re-exports the very same class
    assert getattr(errors, name) is cls


@pytest.mark.parametrize("name", NAMES)
def test_every_class_is_an_mmpack_error_under_its_area(name: str) -> None:
    cls = getattr(_native, name)
    assert issubclass(cls, errors.MmpackError) and issubclass(cls, ValueError)
    bases = _area_bases()
    area = ROWS[name][2]
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


def test_errors_module_exports_exactly_the_table() -> None:
    assert errors.__all__ == NAMES
    defined = [
        n
        for n, v in vars(errors).items()
        if isinstance(v, type) and issubclass(v, BaseException) and not n.startswith("_")
    ]
    assert sorted(defined) == sorted(NAMES)
    exported = {n for n in dir(_native) if n.endswith("Error")}
    assert exported == set(NAMES), "a native exception class outside the table"


def test_stub_declares_every_class_with_its_bases_and_doc() -> None:
    classes = {
        node.name: node
        for node in ast.parse(STUB.read_text()).body
        if isinstance(node, ast.ClassDef) and node.name in ROWS
    }
    assert list(classes) == NAMES, "the stub lists other classes or another order"
    for name, node in classes.items():
        _, bases, _, doc = ROWS[name]
        assert [ast.unparse(b) for b in node.bases] == list(bases), name
        assert " ".join((ast.get_docstring(node) or "").split()) == doc, name


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
