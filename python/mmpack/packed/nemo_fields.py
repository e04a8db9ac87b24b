"""NeMo-RL's row-mapping fields (``_row_offsets``, ``_segment_indices``, ``_segment_provenance``)
turned into the native handle, with NeMo-RL's rules, order and messages.

NeMo-RL's constructor, its ``__dict__`` states (its pickles, its tests' ``__new__`` + attribute
assignment) and assignments to those attributes all arrive here; what comes out is a
``mmpack._native.PackedLayout`` (or ``None`` for the legacy layout), which validated them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from mmpack._coerce import I64_MAX, I64_MIN, index_array
from mmpack._native import IndexOverflowError, LayoutError, PackedLayout

__all__ = ["RawField", "empty_rows_layout", "layout_from_fields"]

_BOTH_OR_NEITHER = "_row_offsets and _segment_indices must either both be set or both be None"


def layout_from_fields(
    n_physical: int,
    row_offsets: Any,
    segment_indices: Any,
    provenance: Any,
) -> PackedLayout | None:
    """Validate NeMo-RL's fields for ``n_physical`` segments into a handle; ``None`` for the
    legacy layout (no row mapping, no provenance)."""
    if (row_offsets is None) != (segment_indices is None):
        raise LayoutError(_BOTH_OR_NEITHER)
    if row_offsets is None and provenance is None:
        return None
    if isinstance(provenance, (bytes, bytearray, str)) or (
        provenance is not None and not hasattr(provenance, "__len__")
    ):
        raise TypeError(
            f"_segment_provenance must be a list of bytes, got {type(provenance).__name__}"
        )
    if row_offsets is None:
        return PackedLayout.build(n_physical, provenance=provenance)
    offsets = index_array(row_offsets, "_row_offsets")
    indices = index_array(segment_indices, "_segment_indices")
    if isinstance(offsets, list) or isinstance(indices, list):
        _raise_beyond_int64([int(x) for x in offsets], [int(x) for x in indices], n_physical)
    assert isinstance(offsets, np.ndarray) and isinstance(indices, np.ndarray)
    return PackedLayout.build(n_physical, offsets, indices, provenance=provenance)


def _raise_beyond_int64(offsets: list[int], indices: list[int], n_physical: int) -> None:
    """Raise the core's error for a row mapping holding values beyond int64 (there always is
    one: such an offset breaks the ordering or the end rule, such an index is out of range).

    The core takes int64, so it validates stand-ins that keep every comparison its checks make
    (the order of adjacent offsets, offsets equal to 0 or to the number of references, indices
    in range); its ``LayoutError`` is the ``ValueError`` NeMo-RL raises, with its message."""
    stand_in_offsets = _order_stand_ins(offsets, 0, len(indices))
    stand_in_indices = [min(max(v, I64_MIN), I64_MAX) for v in indices]
    try:
        PackedLayout.build(n_physical, stand_in_offsets, np.array(stand_in_indices, dtype=np.int64))
    except LayoutError as exc:
        raise LayoutError(f"{exc} (values beyond int64 are shown as int64 stand-ins)") from None
    raise LayoutError("row mapping values do not fit in int64")  # pragma: no cover


def _order_stand_ins(values: list[int], lo: int, hi: int) -> np.ndarray:
    """``values`` as int64, in the same order among them and relative to ``[lo, hi]``: the
    values inside that span are kept, the others move to the int64 limits by rank."""
    above = sorted({v for v in values if v > hi})
    below = sorted({v for v in values if v < lo})
    stand_in = {v: I64_MAX - len(above) + 1 + i for i, v in enumerate(above)}
    stand_in.update({v: I64_MIN + i for i, v in enumerate(below)})
    return np.array([stand_in.get(v, v) for v in values], dtype=np.int64)


_EMPTY_I64 = np.zeros(0, dtype=np.int64)


def empty_rows_layout(n: int, *, provenance: bool) -> PackedLayout:
    """The handle of ``n`` rows without media (NeMo-RL's ``empty_rows_like`` for a value with a
    row mapping or provenance, and for ``n == 0``): CSR offsets of zeros, no segments, and
    empty provenance when ``provenance``."""
    too_big = f"num_rows={n} empty rows cannot be allocated"
    try:
        offsets = np.zeros(n + 1, dtype=np.int64)
    except (MemoryError, ValueError) as exc:  # numpy: "array is too big"
        raise IndexOverflowError(too_big) from exc
    try:
        return PackedLayout.build(
            0, offsets, _EMPTY_I64, provenance_blob=b"" if provenance else None
        )
    except IndexOverflowError as exc:  # the layout's own copy of the offsets
        raise IndexOverflowError(too_big) from exc


class RawField:
    """One of NeMo-RL's row-mapping attributes on a value, as a view over its handle: read as a
    fresh list (NeMo-RL's type), assigned by building a new handle (revalidated). Assigning
    ``None`` to ``_row_offsets`` or ``_segment_indices`` drops the row mapping (back to the
    legacy layout, provenance kept).

    The owning class passes how to read and replace a value's handle, so this module needs
    nothing of the class."""

    def __init__(
        self,
        field: str,
        handle: Callable[[Any], PackedLayout | None],
        set_handle: Callable[[Any, PackedLayout | None], None],
    ) -> None:
        if field not in ("offsets", "indices", "provenance"):
            raise AssertionError(field)
        self.field = field
        self.handle = handle
        self.set_handle = set_handle

    def __get__(self, obj: Any, cls: Any = None) -> Any:
        if obj is None:
            return self
        lay = self.handle(obj)
        if lay is None:
            return None
        if self.field == "offsets":
            return lay.offsets_list()
        if self.field == "indices":
            return lay.indices_list()
        return lay.provenance_list()

    def __set__(self, obj: Any, value: Any) -> None:
        lay = self.handle(obj)
        n = len(obj.tensors)
        if self.field == "provenance":
            self.set_handle(obj, _with_provenance(lay, n, value))
            return
        prov = None if lay is None else lay.provenance_list()
        if value is None:
            self.set_handle(obj, layout_from_fields(n, None, None, prov))
            return
        offsets = None if lay is None else lay.offsets()
        indices = None if lay is None else lay.indices()
        if self.field == "offsets":
            offsets = value
        else:
            indices = value
        self.set_handle(obj, layout_from_fields(n, offsets, indices, prov))


def _with_provenance(lay: PackedLayout | None, n: int, value: Any) -> PackedLayout | None:
    if lay is None or not lay.is_csr:
        return layout_from_fields(n, None, None, value)
    if value is None:
        return lay.with_provenance(None)
    return PackedLayout.build(n, lay.offsets(), lay.indices(), provenance=value)
