"""The error hierarchy: ``mmpack.errors``, the stub ``_native.pyi`` and the native table
(``_native.ERROR_NAMES``) agree, and every class sits under ``MmpackError`` and its area base."""

from __future__ import annotations

import ast
import pickle
from pathlib import Path

import mmpack
import pytest
from mmpack import _native, errors

STUB = Path(mmpack.__file__).with_name("_native.pyi")

AREA_BASES = {
    errors.PackedTensorError,
    errors.PackingError,
    errors.BatchError,
    errors.EnergonDataError,
    errors.PickleSecurityError,
}

#: The area of every leaf class; classes outside any area are listed with ``None``.
AREA = {
    "IndexOverflowError": None,
    "LayoutError": errors.PackedTensorError,
    "LayoutMismatchError": errors.PackedTensorError,
    "ProvenanceError": errors.PackedTensorError,
    "ShardError": errors.PackedTensorError,
    "OutBufferError": errors.PackedTensorError,
    "PinMemoryUnavailableError": errors.PackedTensorError,
    "SegmentMismatchError": errors.PackedTensorError,
    "ItemTooLargeError": errors.PackingError,
    "InvalidLengthError": errors.PackingError,
    "PackingArgumentError": errors.PackingError,
    "BinCountError": errors.PackingError,
    "PackingDtypeError": errors.PackingError,
    "LossMaskError": errors.BatchError,
    "MessageSpanError": errors.BatchError,
    "TurnStructureError": errors.BatchError,
    "MissingFieldError": errors.BatchError,
    "EmptySampleError": errors.BatchError,
    "InvalidTokenError": errors.BatchError,
    "BatchOptionError": errors.BatchError,
    "BatchLayoutError": errors.BatchError,
    "BatchMediaError": errors.BatchError,
    "ChatTemplateError": errors.BatchError,
    "EnergonConfigError": errors.EnergonDataError,
    "ModalityConfigError": errors.EnergonDataError,
    "SampleFormatError": errors.EnergonDataError,
    "TooManySkippedError": errors.EnergonDataError,
    "MediaTokenCountError": errors.EnergonDataError,
    "UndeclaredModalityError": errors.EnergonDataError,
    "UnsafePickleError": errors.PickleSecurityError,
    "CorruptPickleError": errors.PickleSecurityError,
    "PickleTooLargeError": errors.PickleSecurityError,
}

#: Builtins a class must also be, for code written against NeMo-RL or the stdlib.
ALSO = {
    "PackingDtypeError": TypeError,
    "OutBufferError": TypeError,
    "LayoutMismatchError": pickle.PicklingError,
    "PinMemoryUnavailableError": RuntimeError,
    "SegmentMismatchError": RuntimeError,
    "PickleSecurityError": pickle.UnpicklingError,
    "UnsafePickleError": pickle.UnpicklingError,
    "CorruptPickleError": pickle.UnpicklingError,
}


def _stub_classes() -> dict[str, list[str]]:
    """Exception classes of the stub: name -> base names."""
    tree = ast.parse(STUB.read_text())
    out = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            bases = [b.id for b in node.bases if isinstance(b, ast.Name)]
            if bases and bases[0].endswith("Error"):
                out[node.name] = bases
    return out


def test_native_table_stub_and_errors_module_agree() -> None:
    names = _native.ERROR_NAMES
    assert isinstance(names, tuple) and len(set(names)) == len(names)
    assert names[0] == "MmpackError"
    stub = _stub_classes()
    assert list(stub) == list(names), "the stub lists other classes or another order"
    for name in names:
        cls = getattr(_native, name)
        assert cls.__module__ == "mmpack._native" and cls.__name__ == name
        # same base in the stub as at run time
        assert stub[name] == [cls.__bases__[0].__name__]
        # re-exported as the very same class
        assert getattr(errors, name) is cls
    pure = {
        n
        for n, v in vars(errors).items()
        if isinstance(v, type) and issubclass(v, BaseException) and v.__module__ == errors.__name__
    }
    assert sorted(errors.__all__) == sorted(set(names) | pure)
    assert set(names).isdisjoint(pure)


@pytest.mark.parametrize("name", sorted(errors.__all__))
def test_every_class_is_an_mmpack_error_under_its_area(name: str) -> None:
    cls = getattr(errors, name)
    assert issubclass(cls, errors.MmpackError) and issubclass(cls, ValueError)
    areas = [base for base in AREA_BASES if issubclass(cls, base)]
    if cls is errors.MmpackError or cls in AREA_BASES:
        assert areas == ([cls] if cls in AREA_BASES else [])
        return
    assert name in AREA, f"{name} has no area in this test"
    want = AREA[name]
    assert areas == ([] if want is None else [want])
    if name in ALSO:
        assert issubclass(cls, ALSO[name])
    # catching the area catches the leaf
    with pytest.raises(want or errors.MmpackError):
        raise cls("x")


def test_area_table_names_every_leaf() -> None:
    leaves = set(errors.__all__) - {"MmpackError"} - {b.__name__ for b in AREA_BASES}
    assert leaves == set(AREA)


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
