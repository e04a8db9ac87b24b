"""``PackedTensor``: a drop-in replacement for NeMo-RL's
``nemo_rl.data.multimodal_utils.PackedTensor``, with its row mapping and provenance in Rust.

A value is a logical batch of rows over physical tensor segments. ``tensors`` is a real Python
list (the physical segments, ``None`` for "no media"); the row mapping (CSR row offsets over
segment indices) and the per-segment provenance ids live in an immutable native handle
(``mmpack._native.PackedLayout``) stored in the instance ``__dict__`` as ``_layout``. The four
NeMo-RL states map onto it as:

* **L** (legacy): ``_layout is None``; row ``r`` is ``tensors[r]``.
* **LD** (legacy layout, dedup enabled): a handle without CSR, with provenance.
* **C** / **CD**: a handle with CSR, without / with provenance.

``_row_offsets``, ``_segment_indices`` and ``_segment_provenance`` stay readable (fresh lists
equal to NeMo-RL's) and assignable (revalidated). Whole-batch operations (``concat``,
``slice``, ``shard``, ``repeat_interleave``, counts) are one native call each. ``as_tensor``
delegates to ``mmpack.packed.gather`` (the only materialization path), ``to`` to
``mmpack.packed.transfer``, and pickling to ``mmpack.packed.pickle_format``. The class is
published as ``mmpack.packed.PackedTensor`` (its ``__module__``), the path pickles name; the
package serves it from there (see ``mmpack.packed`` for why).

Extras beyond NeMo-RL: :meth:`PackedTensor.repeat_interleave`, :meth:`PackedTensor.shard`,
:meth:`PackedTensor.csr`, :meth:`PackedTensor.physical_nbytes`,
:meth:`PackedTensor.logical_nbytes`, and a compact pickle format (see ``__reduce_ex__``).

Private hooks for other mmpack modules:

* ``csr()``: row offsets and segment indices as read-only int64 arrays;
* ``PackedTensor._make(tensors, dim_to_pack, pad_to_max_shape, layout)``: build a value without
  validation from a tensors list and a ``PackedLayout`` (or ``None`` for state L);
  ``PackedLayout.build(n_physical, offsets, indices, provenance=None, provenance_blob=None)``
  builds (and validates) a handle from int64 arrays and provenance;
* ``_layout_of(value)``: the handle of any PackedTensor-like value (the native ``concat``
  calls it for values without one).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from copy import deepcopy
from typing import Any

import numpy as np
import torch

from mmpack._coerce import I64_MAX, I64_MIN, count_int, host_tensor, index_array
from mmpack._native import (
    IndexOverflowError,
    LayoutError,
    PackedLayout,
    ShardError,
    packed_concat,
)
from mmpack.packed import gather as _gather
from mmpack.packed import pickle_format as _pickle_format
from mmpack.packed import ray_store as _ray_store
from mmpack.packed import transfer as _transfer

__all__ = ["PackedTensor"]

_EMPTY_I64 = np.zeros(0, dtype=np.int64)


def _rows_array(idx: Any, n_rows: int) -> np.ndarray:
    """Row selection as int64; NeMo-RL's IndexError for values beyond int64."""
    rows = index_array(idx, "indices")
    if isinstance(rows, list):
        for row in rows:
            r = row + n_rows if row < 0 else row
            if not 0 <= r < n_rows:
                raise IndexError(f"PackedTensor row index {r} is out of range")
        raise IndexError("PackedTensor row index out of range")  # pragma: no cover
    return rows


# ---------------------------------------------------------------------------------------------
# native handles from NeMo-RL's fields


class _Missing:
    """Marks a value whose native handle was not built yet (raw ``__dict__`` state)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<no PackedLayout yet>"


_MISSING: Any = _Missing()
_BOTH_OR_NEITHER = "_row_offsets and _segment_indices must either both be set or both be None"
_new_object = object.__new__


def _build_layout(
    n_physical: int,
    row_offsets: Any,
    segment_indices: Any,
    provenance: Any,
) -> PackedLayout | None:
    """Validate NeMo-RL's constructor arguments (its rules, order and messages) into a handle;
    ``None`` for state L."""
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


def _layouts_of(values: list[Any]) -> list[PackedLayout | None]:
    """The native handle of each PackedTensor-like value, for the native ``packed_concat``
    (a foreign class or raw NeMo-RL state gets one built from its fields). Stops at the first
    value without ``tensors``: the native call raises the ``TypeError`` naming it."""
    out: list[PackedLayout | None] = []
    for value in values:
        if isinstance(value, PackedTensor):
            out.append(value._lay())
        elif hasattr(value, "tensors"):
            out.append(
                _build_layout(
                    len(value.tensors),
                    getattr(value, "_row_offsets", None),
                    getattr(value, "_segment_indices", None),
                    getattr(value, "_segment_provenance", None),
                )
            )
        else:
            break
    return out


class _PrivateTensors:
    """``tensors`` of a value read in place from Ray's object store (its segments in
    ``__dict__["_store"]``): the first read replaces them with private copies, so that no API
    that hands out a segment can write into the store. Values built any other way hold
    ``tensors`` in their ``__dict__``, which takes precedence over this (non-data) descriptor."""

    def __get__(self, obj: Any, cls: Any = None) -> Any:
        if obj is None:
            return self
        d = obj.__dict__
        store = _store_views(obj)
        if store is None:
            raise AttributeError(f"{type(obj).__name__!r} object has no attribute 'tensors'")
        tensors = _ray_store.private_copies(store)
        d["tensors"] = tensors
        d.pop("_store", None)
        return tensors


def _store_views(obj: Any) -> list[Any] | None:
    """The store views of a value read in place, or ``None``. A ``tensors`` list assigned since
    (it sits in ``__dict__`` beside them) replaces them: the views are dropped."""
    d = obj.__dict__
    store = d.get("_store")
    if store is not None and "tensors" in d:
        del d["_store"]
        return None
    return store


# ---------------------------------------------------------------------------------------------
# the class


class PackedTensor:
    """A logical batch of rows backed by packable tensor segments (NeMo-RL's semantics).

    See the module docstring for the states and the native handle.
    """

    # The public path, which pickles name and ``mmpack.packed`` serves (pickling detection).
    __module__ = "mmpack.packed"

    # Class-level default: values built by ``__new__`` + ``__dict__`` assignment (old pickles,
    # NeMo-RL's own tests) have no handle yet; ``_lay()`` adopts their raw fields on first use.
    _layout: Any = _MISSING
    _store: list[Any]
    tensors: list[Any] = _PrivateTensors()  # type: ignore[assignment]
    dim_to_pack: Any
    pad_to_max_shape: Any

    def __init__(
        self,
        tensors: torch.Tensor | list[torch.Tensor | None] | list[None],
        dim_to_pack: int,
        *,
        pad_to_max_shape: bool = False,
        _row_offsets: list[int] | None = None,
        _segment_indices: list[int] | None = None,
        _segment_provenance: list[bytes] | None = None,
    ) -> None:
        if tensors is None:
            raise AssertionError("Input tensors to PackedTensor cannot be None")
        if isinstance(tensors, torch.Tensor):
            items: list[Any] = [tensors]
        elif isinstance(tensors, list):
            if not tensors and _row_offsets is None:
                raise AssertionError("Input tensors to PackedTensor must be a non-empty list")
            items = tensors
        else:
            raise ValueError(f"Unsupported type for input tensors to PackedTensor: {type(tensors)}")
        # Plain attribute stores (not ``__dict__[...]``) keep CPython's compact instance
        # values: fewer objects for the garbage collector when thousands of values live.
        self.tensors = items
        self.dim_to_pack = dim_to_pack
        self.pad_to_max_shape = pad_to_max_shape
        self._layout = _build_layout(
            len(items), _row_offsets, _segment_indices, _segment_provenance
        )

    @classmethod
    def _make_store(
        cls, store: list[Any], dim_to_pack: Any, pad_to_max_shape: Any, layout: PackedLayout | None
    ) -> PackedTensor:
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

    def _remake(self, phys: list[Any], new: list[Any], layout: PackedLayout | None) -> PackedTensor:
        """A value over ``new`` (selected from ``phys``, what ``_phys()`` gave), read in place
        like ``self`` when ``phys`` was its store views."""
        if phys is _store_views(self):
            return type(self)._make_store(new, self.dim_to_pack, self.pad_to_max_shape, layout)
        return type(self)._make(new, self.dim_to_pack, self.pad_to_max_shape, layout)

    @classmethod
    def _make(
        cls,
        tensors: list[Any],
        dim_to_pack: Any,
        pad_to_max_shape: Any,
        layout: PackedLayout | None,
    ) -> PackedTensor:
        """Build a value from parts the core already validated (no checks)."""
        obj = object.__new__(cls)
        obj.tensors = tensors
        obj.dim_to_pack = dim_to_pack
        obj.pad_to_max_shape = pad_to_max_shape
        obj._layout = layout
        return obj

    # ----------------------------------------------------------------- handle and raw state

    def _lay(self) -> PackedLayout | None:
        lay = self._layout
        if lay is _MISSING:
            return self._adopt_raw()
        return lay

    def _adopt_raw(self) -> PackedLayout | None:
        """Turn NeMo-RL's raw fields in ``__dict__`` (if any) into the native handle."""
        d = self.__dict__
        raw = [d.pop(k, None) for k in _pickle_format.RAW_FIELDS]
        lay = _build_layout(len(d.get("tensors", ())), *raw)
        d["_layout"] = lay
        return lay

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore mmpack's own pickles (see ``__reduce_ex__``) and NeMo-RL's: its current
        six-field state and the pre-deduplication three-field state (state L). A state that is
        neither (a corrupt pickle) raises ``LayoutError``. See ``mmpack.packed.pickle_format``."""
        _pickle_format.restore(self, state)

    # ------------------------------------------------------------------ NeMo-RL fields

    @property
    def _row_offsets(self) -> list[int] | None:
        lay = self._lay()
        return None if lay is None else lay.offsets_list()

    @_row_offsets.setter
    def _row_offsets(self, value: list[int] | None) -> None:
        self._set_fields(offsets=value)

    @property
    def _segment_indices(self) -> list[int] | None:
        lay = self._lay()
        return None if lay is None else lay.indices_list()

    @_segment_indices.setter
    def _segment_indices(self, value: list[int] | None) -> None:
        self._set_fields(indices=value)

    @property
    def _segment_provenance(self) -> list[bytes] | None:
        lay = self._lay()
        return None if lay is None else lay.provenance_list()

    @_segment_provenance.setter
    def _segment_provenance(self, value: list[bytes] | None) -> None:
        lay = self._lay()
        n = len(self.tensors)
        if lay is None or not lay.is_csr:
            self.__dict__["_layout"] = _build_layout(n, None, None, value)
        elif value is None:
            self.__dict__["_layout"] = lay.with_provenance(None)
        else:
            self.__dict__["_layout"] = PackedLayout.build(
                n, lay.offsets(), lay.indices(), provenance=value
            )

    _UNSET: Any = object()

    def _set_fields(self, *, offsets: Any = _UNSET, indices: Any = _UNSET) -> None:
        """Assignment to ``_row_offsets`` / ``_segment_indices``, revalidated. Assigning None
        to either drops the CSR mapping (back to the legacy layout)."""
        lay = self._lay()
        if offsets is None or indices is None:
            prov = None if lay is None else lay.provenance_list()
            self.__dict__["_layout"] = _build_layout(len(self.tensors), None, None, prov)
            return
        cur_off = None if lay is None else lay.offsets()
        cur_idx = None if lay is None else lay.indices()
        new_off = cur_off if offsets is self._UNSET else offsets
        new_idx = cur_idx if indices is self._UNSET else indices
        prov = None if lay is None else lay.provenance_list()
        self.__dict__["_layout"] = _build_layout(len(self.tensors), new_off, new_idx, prov)

    # ------------------------------------------------------------------ basics

    def __len__(self) -> int:
        lay = self._lay()
        if lay is not None and lay.is_csr:
            return lay.num_rows
        return len(self._phys())

    @property
    def deduplication_enabled(self) -> bool:
        """Whether this value carries provenance (NeMo-RL: ``_segment_provenance is not None``)."""
        lay = self._lay()
        return lay is not None and lay.has_provenance

    def _tensor_list(self) -> list[Any]:
        t = self.tensors
        return t if type(t) is list else list(t)

    def logical_segment_counts_by_row(self) -> list[int]:
        """The number of non-``None`` segments in each logical row."""
        lay = self._lay()
        if lay is None or not lay.is_csr:
            return PackedLayout.presence(self._phys())
        return lay.counts(self._phys())

    def iter_logical_segments(self) -> Iterator[Any]:
        """Segments in logical row/segment order, ``None`` entries and repeats included."""
        lay = self._lay()
        if lay is None or not lay.is_csr:
            yield from self.tensors
            return
        tensors = self.tensors
        for i in lay.indices_list() or ():
            yield tensors[i]

    def enable_deduplication(self) -> PackedTensor:
        """Give every physical segment fresh provenance, in place, if it has none; idempotent."""
        lay = self._lay()
        n = len(self.tensors)
        if lay is None:
            self.__dict__["_layout"] = PackedLayout.legacy_dedup(n)
        elif not lay.has_provenance:
            self.__dict__["_layout"] = lay.with_provenance(PackedLayout.mint(n))
        return self

    # ------------------------------------------------------------------ copies

    def __copy__(self) -> PackedTensor:
        obj = object.__new__(type(self))
        obj.__dict__.update(self.__dict__)
        return obj

    def __deepcopy__(self, memo: dict[int, Any]) -> PackedTensor:
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
        if store is not None:  # read-only views: the copy may share them
            return self._make_store(list(store), self.dim_to_pack, self.pad_to_max_shape, lay)
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

    # ------------------------------------------------------------------ materialization

    def as_tensor(
        self,
        device: torch.device | str | None = None,
        *,
        out: torch.Tensor | None = None,
        pin_memory: bool = False,
    ) -> torch.Tensor | None:
        """Concatenate the logical segments; with ``device``, first move every physical segment
        there **in place** (NeMo-RL's behaviour; to CUDA each unique segment crosses once,
        through pinned staging, and rows are expanded on the device). On the CPU the segments
        are gathered natively into one buffer: ``out`` (a contiguous tensor of the result's
        exact shape, dtype and device, returned as the result) or a new one, page-locked with
        ``pin_memory=True`` (needs CUDA). See ``mmpack.packed.gather``."""
        lay = self._lay()
        indices = lay.indices() if lay is not None and lay.is_csr else None
        store = _store_views(self)
        if store is not None and device is None:
            result = _gather.as_tensor_from_store(
                store, indices, self.dim_to_pack, self.pad_to_max_shape, out, pin_memory
            )
            if result is not _gather.NOT_COVERED:
                return result
        elif store is not None and device is not None:
            self.to(device)  # staged to the device straight from the store, in place
        return _gather.as_tensor(
            self.tensors,
            indices,
            self.dim_to_pack,
            self.pad_to_max_shape,
            device,
            out=out,
            pin_memory=pin_memory,
        )

    def to(self, device: torch.device | str, *, non_blocking: bool = True) -> PackedTensor:
        """Move the physical segments (a new list), keeping provenance; returns ``self``. Each
        unique segment moves once (to CUDA through one pinned staging buffer per dtype;
        ``non_blocking`` applies only towards CUDA). See
        ``mmpack.packed.transfer.move_segments``."""
        d = self.__dict__
        store = _store_views(self)
        d["tensors"] = _transfer.move_segments(
            self.tensors if store is None else store, device, non_blocking=non_blocking
        )
        d.pop("_store", None)
        return self

    def to_dtype(self, dtype: torch.dtype) -> PackedTensor:
        """A new wrapper with floating segments cast to ``dtype``. Integer segments and ``None``
        stay the same objects. A real cast mints fresh provenance for every segment."""
        store = _store_views(self)
        requires = any(
            item is not None and item.is_floating_point() and item.dtype != dtype
            for item in (self.tensors if store is None else store)
        )
        lay = self._lay()
        if store is not None and not requires:  # nothing to cast: still read in place
            return type(self)._make_store(list(store), self.dim_to_pack, self.pad_to_max_shape, lay)
        tensors = self.tensors
        if requires:
            new = [
                item if item is None or not item.is_floating_point() else item.to(dtype=dtype)
                for item in tensors
            ]
            if lay is not None and lay.has_provenance:
                lay = lay.reminted()
        else:
            new = list(tensors)
        return type(self)._make(new, self.dim_to_pack, self.pad_to_max_shape, lay)

    # ------------------------------------------------------------------ rows

    def slice(self, indices: Sequence[int] | torch.Tensor) -> PackedTensor:
        """Select rows. Legacy values keep Python list semantics; the others normalize negative
        indices and compact the physical segments in first-reference order."""
        lay = self._lay()
        if lay is None:
            idx = (
                host_tensor(indices, "indices").tolist()
                if isinstance(indices, torch.Tensor)
                else indices
            )
            tensors = self.tensors
            return type(self)(
                [tensors[i] for i in idx],
                self.dim_to_pack,
                pad_to_max_shape=self.pad_to_max_shape,
            )
        phys = self._phys()
        if type(indices) is list:
            try:
                new_lay, new_tensors = lay.slice(phys, indices)
            except OverflowError:  # ints beyond int64: NeMo-RL's IndexError
                _rows_array(indices, len(self))
                raise
        else:
            new_lay, new_tensors = lay.slice(phys, _rows_array(indices, len(self)))
        return self._remake(phys, new_tensors, new_lay)

    @classmethod
    def empty_like(cls, other: PackedTensor) -> PackedTensor:
        """Empty logical rows matching ``other``."""
        return cls.empty_rows_like(other, len(other))

    @classmethod
    def empty_rows_like(cls, other: PackedTensor, num_rows: int) -> PackedTensor:
        """``num_rows`` logical rows without media (NeMo-RL's three cases)."""
        n = count_int(num_rows, "num_rows", error=LayoutError)
        if n < 0:
            raise LayoutError("num_rows must be non-negative")
        if isinstance(other, PackedTensor):
            dedup_or_csr = other._lay() is not None
        else:
            dedup_or_csr = other.deduplication_enabled or other._row_offsets is not None
        csr = dedup_or_csr or n == 0
        too_big = f"num_rows={n} empty rows cannot be allocated"
        try:
            rows: Any = np.zeros(n + 1, dtype=np.int64) if csr else [None] * n
        except (MemoryError, ValueError) as exc:  # numpy: "array is too big"
            raise IndexOverflowError(too_big) from exc
        if csr:
            try:
                lay = PackedLayout.build(
                    0, rows, _EMPTY_I64, provenance_blob=b"" if dedup_or_csr else None
                )
            except IndexOverflowError as exc:  # the layout's own copy of the offsets
                raise IndexOverflowError(too_big) from exc
            return cls._make([], other.dim_to_pack, other.pad_to_max_shape, lay)
        return cls(rows, other.dim_to_pack, pad_to_max_shape=other.pad_to_max_shape)

    @classmethod
    def concat(cls, from_packed_tensors: list[PackedTensor]) -> PackedTensor:
        """Concatenate rows. If any input is dedup-enabled or CSR, physical segments are
        re-interned by provenance (first occurrence wins) and the result is dedup-enabled."""
        values = list(from_packed_tensors)
        out = packed_concat(values, _layouts_of(values), "concat")
        assert out.tensors is not None
        return cls._make(out.tensors, out.dim_to_pack, out.pad_to_max_shape, out.layout)

    @classmethod
    def merge_segments(cls, from_packed_tensors: list[PackedTensor]) -> PackedTensor:
        """Merge one conversation's per-turn values: legacy inputs give one row per turn,
        otherwise a single row re-interned like ``concat``."""
        values = list(from_packed_tensors)
        out = packed_concat(values, _layouts_of(values), "merge_segments")
        assert out.tensors is not None
        return cls._make(out.tensors, out.dim_to_pack, out.pad_to_max_shape, out.layout)

    @classmethod
    def flattened_concat(cls, from_packed_tensors: list[PackedTensor]) -> PackedTensor:
        """Cross-conversation batch step: dedup inputs (one row each) are re-interned like
        ``concat``; legacy inputs are each materialized into one row."""
        values = list(from_packed_tensors)
        out = packed_concat(values, _layouts_of(values), "flattened_concat")
        dim, pad = out.dim_to_pack, out.pad_to_max_shape
        if out.tensors is None:
            return cls([p.as_tensor() for p in values], dim, pad_to_max_shape=pad)
        return cls._make(out.tensors, dim, pad, out.layout)

    # ------------------------------------------------------------------ extras

    def repeat_interleave(self, repeats: int) -> PackedTensor:
        """Each row ``repeats`` times in place order (``[r0]*k + [r1]*k ...``), sharing physical
        segments and provenance: GRPO's G-expansion without deep copies. The result is
        dedup-enabled (provenance is minted for a value without it; ``self`` is not changed)
        and holds the referenced segments in first-reference order, merged by provenance."""
        k = count_int(repeats, "repeats", error=IndexOverflowError)
        lay = self._lay()
        tensors = self._phys()
        if lay is None:
            lay = PackedLayout.build(len(tensors))
        new_lay, new_tensors = lay.repeat_interleave(tensors, k)
        return self._remake(tensors, new_tensors, new_lay)

    def shard(self, num_shards: int) -> list[PackedTensor]:
        """``num_shards`` contiguous shards with equal row counts, each compacted to the
        physical segments it references (like ``slice``). Raises ``ShardError`` (a
        ``ValueError``) when the rows do not split evenly."""
        k = count_int(num_shards, "num_shards", error=ShardError)
        lay = self._lay()
        cls = type(self)
        if lay is not None:
            phys = self._phys()
            return [self._remake(phys, t, sub) for sub, t in lay.shard(phys, k)]
        # The core splits the legacy layout too (its checks and messages); each shard stays
        # legacy, or is an empty CSR value when it has no rows (NeMo-RL's empty_rows_like).
        return [
            cls(t, self.dim_to_pack, pad_to_max_shape=self.pad_to_max_shape)
            if t
            else cls.empty_rows_like(self, 0)
            for _, t in PackedLayout.build(len(self.tensors)).shard(self._tensor_list(), k)
        ]

    def csr(self) -> tuple[np.ndarray, np.ndarray]:
        """Row offsets and segment indices as read-only int64 arrays (the identity mapping
        ``arange(n + 1)``, ``arange(n)`` for the legacy layout)."""
        lay = self._lay()
        offsets = indices = None
        if lay is not None and lay.is_csr:
            offsets, indices = lay.offsets(), lay.indices()
        if offsets is None or indices is None:
            n = len(self.tensors)
            offsets = np.arange(n + 1, dtype=np.int64)
            indices = np.arange(n, dtype=np.int64)
        offsets.flags.writeable = False
        indices.flags.writeable = False
        return offsets, indices

    def physical_nbytes(self) -> int:
        """Bytes of the physical segments (every non-``None`` entry of ``tensors``, each
        counted once per entry; unreferenced entries included)."""
        return sum(_gather.segment_nbytes(t) for t in self._phys())

    def logical_nbytes(self) -> int:
        """Bytes ``as_tensor`` materializes: every logical reference counts its segment's
        bytes; with ``pad_to_max_shape``, the padded bytes (unpadded when the segments cannot
        be padded, where ``as_tensor`` raises). O(segments)."""
        lay = self._lay()
        tensors = self._phys()
        if self.pad_to_max_shape:
            return self._padded_logical_nbytes(lay, tensors)
        nbytes = [_gather.segment_nbytes(t) for t in tensors]
        if lay is None or not lay.is_csr:
            return sum(nbytes)
        return lay.logical_nbytes(nbytes)

    def _padded_logical_nbytes(self, lay: PackedLayout | None, tensors: list[Any]) -> int:
        if lay is None or not lay.is_csr:
            refs = [0 if t is None else 1 for t in tensors]
        else:
            refs = lay.reference_counts(len(tensors)).tolist()
        return _gather.padded_logical_nbytes(tensors, refs, self.dim_to_pack)

    # ------------------------------------------------------------------ pickling

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        """Pickle as ``copyreg._reconstructor(cls, object, None)`` plus a state dict of builtin
        types (so a restricted unpickler that admits the class admits the value): the row
        mapping as int64 bytes and one provenance blob, plain CPU tensors as one byte buffer per
        dtype shared by every value of the same pickle. See ``mmpack.packed.pickle_format``."""
        return _pickle_format.reduce(self, PackedTensor)
