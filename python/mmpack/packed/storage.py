"""How a ``PackedTensor`` holds its state: its physical segments (its own ``tensors`` list, or
read-only views read in place from Ray's object store) and its native row layout, and the state
surface serialization reads and builds (``mmpack.packed.state``).

``PackedTensor`` (``mmpack.packed.value``) is the NeMo-RL API over this base. Instance
attributes (plain ``__dict__`` entries, so that NeMo-RL code and pickles see what they expect):

* ``tensors``: the physical segments, a real Python list (``None`` for "no media");
* ``_store``: instead of ``tensors``, the store views of a value read in place, until ``tensors``
  is first read, which turns them into private copies (so that no API that hands out a segment
  can write into the store); a ``tensors`` list assigned since replaces them. A view stands for
  one tensor, as the segment it was sent for did: values that hold the same view (the values of
  one received object that shared a segment, the slices, shards and shallow copies of a value)
  get the same private copy, made once; a deep copy (without provenance) and values received
  apart get their own. The first read is atomic across threads (see ``_PrivateTensors``);
* ``_layout``: the immutable native handle (``mmpack._native.PackedLayout``: CSR row offsets
  over segment indices, per-segment provenance ids), ``None`` for NeMo-RL's legacy layout (row
  ``r`` is ``tensors[r]``). Missing on values built by ``__new__`` + ``__dict__`` assignment
  (old pickles, NeMo-RL's own tests): their raw fields are adopted on first use;
* ``dim_to_pack``, ``pad_to_max_shape``, and any other attribute a user sets (``extra``).
"""

from __future__ import annotations

from copy import deepcopy
from typing import Any, TypeVar

import numpy as np

from mmpack._native import PackedLayout
from mmpack.packed.nemo_fields import layout_from_fields
from mmpack.packed.state import (
    RAW_FIELDS,
    VALUE_FIELDS,
    PackedState,
    check,
    current_segments,
    private_segments,
)

__all__ = ["SegmentStorage"]

_S = TypeVar("_S", bound="SegmentStorage")
_RAW = frozenset(RAW_FIELDS)


class _Missing:
    """Marks a value whose native handle was not built yet (raw ``__dict__`` state)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<no PackedLayout yet>"


_MISSING: Any = _Missing()
_new_object = object.__new__


class _PrivateTensors:
    """``tensors`` of a value read in place (its store views in ``__dict__["_store"]``, see
    ``mmpack.packed.state``): the first read replaces them with the views' private copies, so
    that no API that hands out a segment can write into the store. Values built any other way
    hold ``tensors`` in their ``__dict__``, which takes precedence over this (non-data)
    descriptor.

    The first read is atomic: threads that race in it (a threaded or async actor's calls, a
    prefetch thread) all get the one list the value keeps, so no thread's in-place writes are
    lost. Each view makes its copy once (``claim()``, shared by every value that holds the
    view), and the list is published with one ``dict.setdefault``: no lock on the value, so
    nothing changes for pickling or after a fork."""

    def __get__(self, obj: Any, cls: Any = None) -> Any:
        if obj is None:
            return self
        d = obj.__dict__
        store = _store_views(obj)
        if store is None:  # another thread published the list since the lookup missed it
            tensors = d.get("tensors", _ABSENT)
            if tensors is _ABSENT:
                raise AttributeError(f"{type(obj).__name__!r} object has no attribute 'tensors'")
            return tensors
        tensors = private_segments(store, claim=True)
        published = d.setdefault("tensors", tensors)  # the first thread's list wins
        d.pop("_store", None)
        return published


_ABSENT: Any = object()


def _store_views(obj: Any) -> list[Any] | None:
    """The store views of a value read in place, or ``None``. A ``tensors`` list assigned since
    (it sits in ``__dict__`` beside them) replaces them: the views are dropped."""
    d = obj.__dict__
    store = d.get("_store")
    if store is not None and "tensors" in d:
        d.pop("_store", None)  # another thread may drop them at the same time
        return None
    return store


class SegmentStorage:
    """A value's segments and row layout (see the module docs), and its state surface."""

    # Class-level default: values built by ``__new__`` + ``__dict__`` assignment have no handle
    # yet; ``_lay()`` adopts their raw fields on first use.
    _layout: Any = _MISSING
    _store: list[Any]
    tensors: list[Any] = _PrivateTensors()  # type: ignore[assignment]
    dim_to_pack: Any
    pad_to_max_shape: Any

    @classmethod
    def _make_store(
        cls: type[_S],
        store: list[Any],
        dim_to_pack: Any,
        pad_to_max_shape: Any,
        layout: PackedLayout | None,
    ) -> _S:
        """Like ``_make``, for segments read in place from the object store."""
        obj = object.__new__(cls)
        obj._store = store
        obj.dim_to_pack = dim_to_pack
        obj.pad_to_max_shape = pad_to_max_shape
        obj._layout = layout
        return obj

    def __delattr__(self, name: str) -> None:
        d = self.__dict__
        if name == "tensors" and "_store" in d:  # the store views go with the tensors
            del d["_store"]
            d.pop("tensors", None)
            return
        object.__delattr__(self, name)

    def _phys(self) -> list[Any]:
        """The physical segments as held: ``tensors``, or the store views of a value read in
        place (which only internal, read-only paths may see)."""
        store = _store_views(self)
        return self._tensor_list() if store is None else store

    def _remake(self: _S, phys: list[Any], new: list[Any], layout: PackedLayout | None) -> _S:
        """A value over ``new`` (selected from ``phys``, what ``_phys()`` gave), read in place
        like ``self`` when ``phys`` was its store views."""
        if phys is _store_views(self):
            return type(self)._make_store(new, self.dim_to_pack, self.pad_to_max_shape, layout)
        return type(self)._make(new, self.dim_to_pack, self.pad_to_max_shape, layout)

    @classmethod
    def _make(
        cls: type[_S],
        tensors: list[Any],
        dim_to_pack: Any,
        pad_to_max_shape: Any,
        layout: PackedLayout | None,
    ) -> _S:
        """Build a value from parts the core already validated (no checks)."""
        obj = object.__new__(cls)
        obj.tensors = tensors
        obj.dim_to_pack = dim_to_pack
        obj.pad_to_max_shape = pad_to_max_shape
        obj._layout = layout
        return obj

    def _lay(self) -> PackedLayout | None:
        lay = self._layout  # hot: once per value in ``concat``
        if lay is _MISSING:
            return self._adopt_raw()
        return lay

    def _adopt_raw(self) -> PackedLayout | None:
        """Turn NeMo-RL's raw fields in ``__dict__`` (if any) into the native handle; a field
        not there keeps its current value."""
        d = self.__dict__
        lay = d.get("_layout")
        current: list[Any] = [None, None, None]
        if isinstance(lay, PackedLayout):
            current = [lay.offsets_list(), lay.indices_list(), lay.provenance_list()]
        raw = [d.pop(k) if k in d else c for k, c in zip(RAW_FIELDS, current, strict=True)]
        lay = layout_from_fields(len(d.get("tensors", d.get("_store", ()))), *raw)
        d["_layout"] = lay
        return lay

    def packed_state(self, *, in_place: bool = False) -> PackedState:
        """What serialization reads of this value (``mmpack.packed.state``). ``in_place``: a
        value read in place from the object store hands out its store views as they are
        (``read_in_place``); otherwise its segments are its ``tensors`` (private copies)."""
        d = self.__dict__
        if len(d) > 4 and not _RAW.isdisjoint(d):  # NeMo-RL's fields written into __dict__
            self._adopt_raw()
        lay = self._lay()  # first: it turns NeMo-RL's raw fields into the handle
        store = _store_views(self) if in_place else None
        if store is not None:
            segments = current_segments(store)  # a view written through its copy: the copy
        else:
            segments = self._tensor_list() if in_place else self.tensors
        extra = {k: v for k, v in self.__dict__.items() if k not in VALUE_FIELDS}
        return PackedState(
            segments, lay, self.dim_to_pack, self.pad_to_max_shape, extra or None, store is not None
        )

    @classmethod
    def from_packed_state(cls: type[_S], state: PackedState) -> _S:
        """A value of ``state`` (checked: ``LayoutError`` for one no value can hold), holding
        its own copies of the segment list and the extra attributes."""
        check(state, cls)
        obj = _new_object(cls)
        extra = None if state.extra is None else dict(state.extra)
        obj._take_state(state._replace(segments=list(state.segments), extra=extra))
        return obj

    def _take_state(self, state: PackedState) -> None:
        d = self.__dict__
        d.pop("tensors", None)  # a state restored twice: nothing of the first one stays
        d.pop("_store", None)
        if state.read_in_place:
            self._store = state.segments  # ``tensors`` makes private copies on first read
        else:
            self.tensors = state.segments
        self.dim_to_pack = state.dim_to_pack
        self.pad_to_max_shape = state.pad_to_max_shape
        self._layout = state.layout
        if state.extra:
            d.update(state.extra)

    def segment_identities(self) -> np.ndarray | None:
        """The provenance id of every physical segment as a read-only array of 16-byte void
        scalars (equal ids: the same segment), or ``None`` without provenance. For grouping
        rows by the media they share; the ids are never compared with anything but ids."""
        lay = self._lay()
        blob = lay.provenance_blob() if lay is not None else None
        if blob is None:
            return None
        ids = np.frombuffer(blob, dtype=np.dtype((np.void, 16)))
        return ids

    def segment_numels(self) -> np.ndarray:
        """Elements of every physical segment (0 for an empty entry), as int64, without reading
        any segment's data."""
        return np.fromiter(
            (0 if t is None else t.numel() for t in self._phys()), np.int64, len(self._phys())
        )

    def _tensor_list(self) -> list[Any]:
        t = self.tensors
        return t if type(t) is list else list(t)

    def __copy__(self: _S) -> _S:
        obj = object.__new__(type(self))
        obj.__dict__.update(self.__dict__)
        return obj

    def __deepcopy__(self: _S, memo: dict[int, Any]) -> _S:
        """Dedup values share their tensors and provenance; others deep-copy their tensors.

        Hot in NeMo-RL's G-expansion (one call per copy of every prompt's value).
        """
        # copy.deepcopy keeps the original alive in ``memo[id(memo)]`` and creates that list by
        # catching a KeyError on a fresh memo; creating it here skips the exception.
        memo.setdefault(id(memo), [])
        lay = self._layout
        if lay is _MISSING:
            lay = self._lay()
        store = _store_views(self)
        if store is not None:
            if lay is not None and lay.has_provenance:  # shared, as the tensors of one below
                new = list(store)
            else:  # views of their own (a view stands for one tensor, its claimed copy)
                new = [
                    s.twin() if getattr(s, "read_in_place", False) is True else deepcopy(s, memo)
                    for s in store
                ]
            return self._make_store(new, self.dim_to_pack, self.pad_to_max_shape, lay)
        if lay is not None and lay.has_provenance:
            tensors = list(self.tensors)
        else:
            tensors = [deepcopy(item, memo) for item in self.tensors]
        copied = _new_object(type(self))
        copied.tensors = tensors
        copied.dim_to_pack = self.dim_to_pack
        copied.pad_to_max_shape = self.pad_to_max_shape
        copied._layout = lay
        return copied

    def _set_layout(self, layout: PackedLayout | None) -> None:
        self.__dict__["_layout"] = layout

    def _store_views(self) -> list[Any] | None:
        """The store views of a value read in place, or ``None``."""
        return _store_views(self)
