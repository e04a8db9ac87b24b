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
``slice``, ``shard``, ``repeat_interleave``, counts) are one native call each.

Extras beyond NeMo-RL: :meth:`PackedTensor.repeat_interleave`, :meth:`PackedTensor.shard`,
:meth:`PackedTensor.csr`, :meth:`PackedTensor.physical_nbytes`,
:meth:`PackedTensor.logical_nbytes`, and a compact pickle format (see ``__reduce_ex__``).

Private hooks for other mmpack modules:

* ``_logical_tensors()``: the logical segment list (``None`` entries included);
* ``_materialize(device)``: what ``as_tensor`` returns after any in-place device move;
* ``csr()``: row offsets and segment indices as read-only int64 arrays;
* ``PackedTensor._make(tensors, dim_to_pack, pad_to_max_shape, layout)``: build a value without
  validation from a tensors list and a ``PackedLayout`` (or ``None`` for state L);
  ``PackedLayout.build(n_physical, offsets, indices, provenance=None, provenance_blob=None)``
  builds (and validates) a handle from int64 arrays and provenance.
"""

from __future__ import annotations

import copyreg
import itertools
import math
import operator
import pickle
from collections.abc import Iterator, Sequence
from copy import deepcopy
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch._utils import _flatten_dense_tensors

from mmpack._native import (
    LayoutError,
    PackedLayout,
    ShardError,
    packed_concat,
)

__all__ = ["PackedTensor"]

_CORE_KEYS = frozenset(("tensors", "dim_to_pack", "pad_to_max_shape", "_layout"))
_RAW_KEYS = ("_row_offsets", "_segment_indices", "_segment_provenance")
_BOTH_OR_NEITHER = "_row_offsets and _segment_indices must either both be set or both be None"
_EMPTY_I64 = np.zeros(0, dtype=np.int64)


# ---------------------------------------------------------------------------------------------
# conversion helpers


def _index_array(value: Any, name: str) -> np.ndarray | list[int]:
    """``value`` as a contiguous int64 array; a ``list`` of Python ints when some do not fit
    in int64 (the caller reports them with NeMo-RL's message)."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    if isinstance(value, np.ndarray):
        arr = value
    else:
        if isinstance(value, (str, bytes)) or not hasattr(value, "__len__"):
            raise TypeError(f"{name} must be a sequence of int, got {type(value).__name__}")
        try:
            arr = np.asarray(value)
        except (OverflowError, ValueError) as exc:
            raise TypeError(f"{name} must be a sequence of int: {exc}") from None
    if arr.ndim != 1:
        raise TypeError(f"{name} must be a flat sequence of int, got {arr.ndim} dimensions")
    if arr.size == 0:
        return _EMPTY_I64
    if arr.dtype.kind in "iub":
        if arr.dtype.kind == "u" and arr.dtype.itemsize >= 8 and int(arr.max()) >= 2**63:
            return [int(x) for x in arr]
        return np.ascontiguousarray(arr, dtype=np.int64)
    if arr.dtype == object and all(
        isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in arr
    ):
        return [int(x) for x in arr]
    raise TypeError(f"{name} must be a sequence of int, got elements of dtype {arr.dtype}")


def _raise_like_nemo(offsets: Sequence[int], indices: Sequence[int], n_physical: int) -> None:
    """NeMo-RL's checks on Python ints (values beyond int64): raise its first error."""
    if len(offsets) == 0 or offsets[0] != 0:
        raise LayoutError("_row_offsets must start with 0")
    if any(a > b for a, b in itertools.pairwise(offsets)):
        raise LayoutError("_row_offsets must be non-decreasing")
    if offsets[-1] != len(indices):
        raise LayoutError("_row_offsets must end at the number of logical segment references")
    if len(indices) and (min(indices) < 0 or max(indices) >= n_physical):
        raise LayoutError("_segment_indices cannot reference an out-of-range physical segment")
    raise LayoutError("row mapping values do not fit in int64")


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
    offsets = _index_array(row_offsets, "_row_offsets")
    indices = _index_array(segment_indices, "_segment_indices")
    if isinstance(offsets, list) or isinstance(indices, list):
        _raise_like_nemo(
            [int(x) for x in offsets], [int(x) for x in indices], n_physical
        )  # always raises
    assert isinstance(offsets, np.ndarray) and isinstance(indices, np.ndarray)
    return PackedLayout.build(n_physical, offsets, indices, provenance=provenance)


def _rows_array(idx: Any, n_rows: int) -> np.ndarray:
    """Row selection as int64; NeMo-RL's IndexError for values beyond int64."""
    rows = _index_array(idx, "indices")
    if isinstance(rows, list):
        for row in rows:
            r = row + n_rows if row < 0 else row
            if not 0 <= r < n_rows:
                raise IndexError(f"PackedTensor row index {r} is out of range")
        raise IndexError("PackedTensor row index out of range")  # pragma: no cover
    return rows


def _count_arg(value: Any, name: str) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got bool")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None


def _layout_of(value: Any) -> PackedLayout | None:
    """The native handle of any PackedTensor-like value (used by the native ``concat`` for
    values whose ``__dict__`` lacks a handle: raw NeMo-RL state or a foreign class)."""
    if isinstance(value, PackedTensor):
        return value._lay()
    return _build_layout(
        len(value.tensors),
        getattr(value, "_row_offsets", None),
        getattr(value, "_segment_indices", None),
        getattr(value, "_segment_provenance", None),
    )


def _nbytes(t: Any) -> int:
    return 0 if t is None else int(t.numel()) * int(t.element_size())


# ---------------------------------------------------------------------------------------------
# the class


class PackedTensor:
    """A logical batch of rows backed by packable tensor segments (NeMo-RL's semantics).

    See the module docstring for the states and the native handle.
    """

    # Class-level default so values built by ``__new__`` + ``__dict__`` assignment (old
    # pickles, NeMo-RL's own tests) read as legacy until their raw fields are adopted.
    _layout: PackedLayout | None = None
    tensors: list[Any]
    dim_to_pack: Any
    pad_to_max_shape: Any

    # Values with at least this many segments pickle through one buffer per dtype; smaller
    # ones pickle their tensors normally, so tensors shared between many small values in one
    # pickle stay shared (the pickle memo), as with NeMo-RL.
    _PICKLE_BUFFER_MIN_SEGMENTS = 8

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
        d = self.__dict__
        d["tensors"] = items
        d["dim_to_pack"] = dim_to_pack
        d["pad_to_max_shape"] = pad_to_max_shape
        d["_layout"] = None
        d["_layout"] = _build_layout(
            len(items), _row_offsets, _segment_indices, _segment_provenance
        )

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
        obj.__dict__ = {
            "tensors": tensors,
            "dim_to_pack": dim_to_pack,
            "pad_to_max_shape": pad_to_max_shape,
            "_layout": layout,
        }
        return obj

    # ----------------------------------------------------------------- handle and raw state

    def _lay(self) -> PackedLayout | None:
        lay = self._layout
        if lay is None and "_layout" not in self.__dict__:
            lay = self._adopt_raw()
        return lay

    def _adopt_raw(self) -> PackedLayout | None:
        """Turn NeMo-RL's raw fields in ``__dict__`` (if any) into the native handle."""
        d = self.__dict__
        raw = [d.pop(k, None) for k in _RAW_KEYS]
        lay = _build_layout(len(d.get("tensors", ())), *raw)
        d["_layout"] = lay
        return lay

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore mmpack's own pickles (see ``__reduce_ex__``) and NeMo-RL's: its current
        six-field state and the pre-deduplication three-field state (state L)."""
        if _STATE_KEY in state:
            _restore_into(self, state)
            return
        d = self.__dict__
        d.update(state)
        if any(k in d for k in _RAW_KEYS) or "_layout" not in d:
            d.pop("_layout", None)
            self._adopt_raw()

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
        return len(self.tensors)

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
            return [0 if t is None else 1 for t in self.tensors]
        return lay.counts(self._tensor_list())

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

    def _row_segment_indices(self, row: int) -> list[int]:
        lay = self._lay()
        if lay is None or not lay.is_csr:
            return [row]
        offsets, indices = lay.offsets(), lay.indices()
        assert offsets is not None and indices is not None
        return [int(x) for x in indices[offsets[row] : offsets[row + 1]]]

    # ------------------------------------------------------------------ copies

    def __copy__(self) -> PackedTensor:
        obj = object.__new__(type(self))
        obj.__dict__.update(self.__dict__)
        return obj

    def __deepcopy__(self, memo: dict[int, Any]) -> PackedTensor:
        """Dedup values share their tensors and provenance; others deep-copy their tensors."""
        lay = self._lay()
        if lay is not None and lay.has_provenance:
            tensors = list(self.tensors)
        else:
            tensors = [deepcopy(item, memo) for item in self.tensors]
        copied = type(self)._make(tensors, self.dim_to_pack, self.pad_to_max_shape, lay)
        memo[id(self)] = copied
        return copied

    # ------------------------------------------------------------------ materialization

    def _logical_tensors(self) -> list[Any]:
        """The logical segment list (``None`` entries and repeats included)."""
        lay = self._lay()
        if lay is None or not lay.is_csr:
            return self.tensors
        tensors = self.tensors
        return [tensors[i] for i in lay.indices_list() or ()]

    def _materialize(self, device: Any = None) -> torch.Tensor | None:
        """NeMo-RL's ``as_tensor`` after its in-place device move: concatenate the non-``None``
        logical segments along ``dim_to_pack`` (padding first with ``pad_to_max_shape``)."""
        items = [t for t in self._logical_tensors() if t is not None]
        if not items:
            return None
        if self.pad_to_max_shape:
            items = _pad_to_max(items, self.dim_to_pack)
        return torch.cat(items, dim=self.dim_to_pack).to(device)

    def as_tensor(self, device: torch.device | str | None = None) -> torch.Tensor | None:
        """Concatenate the logical segments; with ``device``, first move every physical segment
        there **in place** (NeMo-RL's behaviour)."""
        if device is not None:
            tensors = self.tensors
            for i, item in enumerate(tensors):
                if item is not None:
                    tensors[i] = item.to(device)
        return self._materialize(device)

    def to(self, device: torch.device | str) -> PackedTensor:
        """Move the physical segments (a new list), keeping provenance; returns ``self``."""
        self.__dict__["tensors"] = [
            item.to(device) if item is not None else None for item in self.tensors
        ]
        return self

    def to_dtype(self, dtype: torch.dtype) -> PackedTensor:
        """A new wrapper with floating segments cast to ``dtype``. Integer segments and ``None``
        stay the same objects. A real cast mints fresh provenance for every segment."""
        tensors = self.tensors
        requires = any(
            item is not None and item.is_floating_point() and item.dtype != dtype
            for item in tensors
        )
        lay = self._lay()
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
            idx = indices.tolist() if isinstance(indices, torch.Tensor) else indices
            tensors = self.tensors
            return type(self)(
                [tensors[i] for i in idx],
                self.dim_to_pack,
                pad_to_max_shape=self.pad_to_max_shape,
            )
        rows = _rows_array(indices, len(self))
        new_lay, new_tensors = lay.slice(self._tensor_list(), rows)
        return type(self)._make(new_tensors, self.dim_to_pack, self.pad_to_max_shape, new_lay)

    @classmethod
    def empty_like(cls, other: PackedTensor) -> PackedTensor:
        """Empty logical rows matching ``other``."""
        return cls.empty_rows_like(other, len(other))

    @classmethod
    def empty_rows_like(cls, other: PackedTensor, num_rows: int) -> PackedTensor:
        """``num_rows`` logical rows without media (NeMo-RL's three cases)."""
        if num_rows < 0:
            raise LayoutError("num_rows must be non-negative")
        if isinstance(other, PackedTensor):
            dedup_or_csr = other._lay() is not None
        else:
            dedup_or_csr = other.deduplication_enabled or other._row_offsets is not None
        if dedup_or_csr or num_rows == 0:
            n = operator.index(num_rows)
            lay = PackedLayout.build(
                0,
                np.zeros(n + 1, dtype=np.int64),
                _EMPTY_I64,
                provenance_blob=b"" if dedup_or_csr else None,
            )
            return cls._make([], other.dim_to_pack, other.pad_to_max_shape, lay)
        return cls([None] * num_rows, other.dim_to_pack, pad_to_max_shape=other.pad_to_max_shape)

    @classmethod
    def concat(cls, from_packed_tensors: list[PackedTensor]) -> PackedTensor:
        """Concatenate rows. If any input is dedup-enabled or CSR, physical segments are
        re-interned by provenance (first occurrence wins) and the result is dedup-enabled."""
        dim, pad, lay, tensors = packed_concat(from_packed_tensors, 0)
        assert tensors is not None
        return cls._make(tensors, dim, pad, lay)

    @classmethod
    def merge_segments(cls, from_packed_tensors: list[PackedTensor]) -> PackedTensor:
        """Merge one conversation's per-turn values: legacy inputs give one row per turn,
        otherwise a single row re-interned like ``concat``."""
        dim, pad, lay, tensors = packed_concat(from_packed_tensors, 1)
        assert tensors is not None
        return cls._make(tensors, dim, pad, lay)

    @classmethod
    def flattened_concat(cls, from_packed_tensors: list[PackedTensor]) -> PackedTensor:
        """Cross-conversation batch step: dedup inputs (one row each) are re-interned like
        ``concat``; legacy inputs are each materialized into one row."""
        dim, pad, lay, tensors = packed_concat(from_packed_tensors, 2)
        if tensors is None:
            return cls([p.as_tensor() for p in from_packed_tensors], dim, pad_to_max_shape=pad)
        return cls._make(tensors, dim, pad, lay)

    # ------------------------------------------------------------------ extras

    def repeat_interleave(self, repeats: int) -> PackedTensor:
        """Each row ``repeats`` times in place order (``[r0]*k + [r1]*k ...``), sharing physical
        segments and provenance: GRPO's G-expansion without deep copies. The result is
        dedup-enabled (provenance is minted for a value without it; ``self`` is not changed)
        and holds the referenced segments in first-reference order, merged by provenance."""
        k = _count_arg(repeats, "repeats")
        lay = self._lay()
        tensors = self._tensor_list()
        if lay is None:
            lay = PackedLayout.build(len(tensors))
        new_lay, new_tensors = lay.repeat_interleave(tensors, k)
        return type(self)._make(new_tensors, self.dim_to_pack, self.pad_to_max_shape, new_lay)

    def shard(self, num_shards: int) -> list[PackedTensor]:
        """``num_shards`` contiguous shards with equal row counts, each compacted to the
        physical segments it references (like ``slice``). Raises ``ShardError`` (a
        ``ValueError``) when the rows do not split evenly."""
        k = _count_arg(num_shards, "num_shards")
        lay = self._lay()
        cls = type(self)
        if lay is not None:
            return [
                cls._make(t, self.dim_to_pack, self.pad_to_max_shape, sub)
                for sub, t in lay.shard(self._tensor_list(), k)
            ]
        tensors = self.tensors
        n = len(tensors)
        if k <= 0:
            raise ShardError(f"num_shards must be a positive integer, got {k}")
        if n % k:
            raise ShardError(
                f"cannot split {n} rows into {k} equal shards: {n} is not a multiple of {k}"
            )
        size = n // k
        if size == 0:
            return [cls.empty_rows_like(self, 0) for _ in range(k)]
        return [
            cls(tensors[s * size : (s + 1) * size], self.dim_to_pack,
                pad_to_max_shape=self.pad_to_max_shape)
            for s in range(k)
        ]  # fmt: skip

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
        return sum(_nbytes(t) for t in self.tensors)

    def logical_nbytes(self) -> int:
        """Bytes ``as_tensor`` materializes: every logical reference counts its segment's
        bytes; with ``pad_to_max_shape``, the padded bytes (unpadded when the segments cannot
        be padded, where ``as_tensor`` raises). O(segments)."""
        lay = self._lay()
        tensors = self._tensor_list()
        if self.pad_to_max_shape:
            return self._padded_logical_nbytes(lay, tensors)
        nbytes = [_nbytes(t) for t in tensors]
        if lay is None or not lay.is_csr:
            return sum(nbytes)
        return lay.logical_nbytes(nbytes)

    def _padded_logical_nbytes(self, lay: PackedLayout | None, tensors: list[Any]) -> int:
        if lay is None or not lay.is_csr:
            refs = [0 if t is None else 1 for t in tensors]
        else:
            refs = lay.reference_counts(len(tensors)).tolist()
        used = [t for t, c in zip(tensors, refs, strict=False) if c and t is not None]
        if not used:
            return 0
        ranks = {t.ndim for t in used}
        rank = next(iter(ranks))
        dim = self.dim_to_pack
        pack = dim if dim >= 0 else rank + dim
        if len(ranks) != 1 or not 0 <= pack < rank:
            # as_tensor raises here; count the unpadded bytes instead of failing a metric.
            return sum(c * _nbytes(t) for t, c in zip(tensors, refs, strict=False))
        max_shape = [max(t.shape[d] for t in used) for d in range(rank)]
        other = math.prod(s for d, s in enumerate(max_shape) if d != pack)
        total = 0
        for t, c in zip(tensors, refs, strict=False):
            if c and t is not None:
                total += c * int(t.shape[pack]) * other * int(t.element_size())
        return total

    # ------------------------------------------------------------------ pickling

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        """Pickle as ``copyreg._reconstructor(cls, object, None)`` plus a state dict that
        ``__setstate__`` recognizes (only builtin types inside, so restricted unpicklers that
        admit the class admit the value): the row mapping as int64 bytes and one provenance
        blob, and the segments either as the plain list (small values, pickled normally) or as
        one byte buffer per dtype plus a shape table (see ``_encode_tensors``)."""
        lay = self._lay()
        layout_state = None
        if lay is not None:
            offsets, indices = lay.offsets(), lay.indices()
            layout_state = (
                None if offsets is None else offsets.astype("<i8", copy=False).tobytes(),
                None if indices is None else indices.astype("<i8", copy=False).tobytes(),
                lay.provenance_blob(),
            )
        d = self.__dict__
        extra = {k: v for k, v in d.items() if k not in _CORE_KEYS} or None
        proto = protocol if isinstance(protocol, int) else 2
        payload = _encode_tensors(self.tensors, self._PICKLE_BUFFER_MIN_SEGMENTS, proto)
        state = {
            _STATE_KEY: 1,
            "dim_to_pack": self.dim_to_pack,
            "pad_to_max_shape": self.pad_to_max_shape,
            "layout": layout_state,
            "payload": payload,
            "extra": extra,
        }
        return (copyreg._reconstructor, (type(self), object, None), state)  # type: ignore[attr-defined]


def _pad_to_max(items: list[torch.Tensor], dim_to_pack: int) -> list[torch.Tensor]:
    ranks = {t.ndim for t in items}
    if len(ranks) != 1:
        raise ValueError(
            "pad_to_max_shape requires tensors with the same rank, "
            f"but received ranks {sorted(ranks)}"
        )
    rank = ranks.pop()
    pack = dim_to_pack if dim_to_pack >= 0 else rank + dim_to_pack
    if not 0 <= pack < rank:
        raise IndexError(f"dim_to_pack={dim_to_pack} is invalid for tensors with rank {rank}")
    max_shape = [max(t.shape[d] for t in items) for d in range(rank)]

    def pad(t: torch.Tensor) -> torch.Tensor:
        padding: list[int] = []
        for d in reversed(range(rank)):
            padding.extend((0, 0 if d == pack else max_shape[d] - t.shape[d]))
        return F.pad(t, padding)

    return [pad(t) for t in items]


# ---------------------------------------------------------------------------------------------
# pickle format
#
# The state dict holds (_STATE_KEY: 1, dim_to_pack, pad_to_max_shape, layout, payload, extra).
# layout is None (state L) or (offsets, indices, provenance): little-endian int64 bytes (None
# without CSR) and 16 bytes per segment (None without provenance). payload is either the plain
# ``tensors`` list (pickled normally), or the tuple
#   ("mmpack.segments/1", codes, refs, ranks, dims, groups, others)
# where codes/refs/ranks/dims are little-endian int64 bytes with, per physical slot i:
#   codes[i] >= 0: a tensor in dtype group codes[i]; its shape is the next ranks[i] values of
#                  dims; its elements follow the previous member's in the group's buffer;
#   codes[i] == -1: None;   codes[i] == -2: others[refs[i]] (pickled normally);
#   codes[i] == -3: the same object as slot refs[i] (sharing inside one value).
# groups is a list of (dtype name, buffer): the group members' bytes back to back in C order,
# as a PickleBuffer (protocol 5: out-of-band capable) or bytes. Restored tensors are views
# into one writable buffer per dtype, with requires_grad=False.

_STATE_KEY = "__mmpack_packed_tensor__"
_FORMAT = "mmpack.segments/1"
_BUFFER_DTYPES = {
    d: str(d).removeprefix("torch.")
    for d in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.complex64,
        torch.complex128,
    )
}


def _bufferable(t: Any) -> bool:
    return (
        type(t) is torch.Tensor
        and t.dtype in _BUFFER_DTYPES
        and t.is_cpu
        and not t.requires_grad
        and t.layout == torch.strided
        and not t.is_nested
        and not t.is_neg()
        and not (t.is_complex() and t.is_conj())
    )


def _oversized_view(t: Any) -> bool:
    """A CPU tensor whose storage is much larger than itself (pickling it normally would
    write the whole storage)."""
    if not _bufferable(t):
        return False
    return bool(t.untyped_storage().nbytes() > 2 * _nbytes(t) + 4096)


def _i64_bytes(values: Any) -> bytes:
    return np.asarray(values, dtype="<i8").tobytes()


def _i64_list(data: Any) -> list[int]:
    return np.frombuffer(data, dtype="<i8").tolist()


def _i64_array(data: Any) -> np.ndarray:
    return np.frombuffer(data, dtype="<i8").astype(np.int64, copy=False)


def _encode_tensors(tensors: list[Any], min_segments: int, protocol: int) -> Any:
    n = len(tensors)
    if n < min_segments and not any(_oversized_view(t) for t in tensors):
        return tensors
    codes = [0] * n
    refs = [0] * n
    ranks = [0] * n
    dims: list[int] = []
    group_of: dict[torch.dtype, int] = {}
    members: list[list[torch.Tensor]] = []
    others: list[Any] = []
    seen: dict[int, int] = {}
    for i, t in enumerate(tensors):
        if t is None:
            codes[i] = -1
            continue
        first = seen.get(id(t))
        if first is not None:
            codes[i] = -3
            refs[i] = first
            continue
        seen[id(t)] = i
        if _bufferable(t):
            dtype = t.dtype
            g = group_of.get(dtype)
            if g is None:
                g = group_of[dtype] = len(members)
                members.append([])
            members[g].append(t)
            codes[i] = g
            shape = t.shape
            ranks[i] = len(shape)
            dims.extend(shape)
        else:
            codes[i] = -2
            refs[i] = len(others)
            others.append(t)
    groups: list[tuple[str, Any]] = []
    for dtype, g in group_of.items():
        flat = _flatten_dense_tensors(members[g])
        arr = flat.view(torch.uint8).numpy()
        buf: Any = pickle.PickleBuffer(arr) if protocol >= 5 else arr.tobytes()
        groups.append((_BUFFER_DTYPES[dtype], buf))
    return (
        _FORMAT,
        _i64_bytes(codes),
        _i64_bytes(refs),
        _i64_bytes(ranks),
        _i64_bytes(dims),
        groups,
        others,
    )


def _unflatten_into(
    out: list[Any], base: torch.Tensor, slots: list[int], shapes: list[Any]
) -> None:
    """Views of ``base`` for the group members ``slots`` (in order), into ``out``: runs of
    members with one shape become one ``view(k, *shape).unbind(0)``."""
    pos = 0
    j = 0
    n = len(slots)
    while j < n:
        shape = shapes[slots[j]]
        k = j + 1
        while k < n and shapes[slots[k]] == shape:
            k += 1
        numel = math.prod(shape)
        count = k - j
        block = base[pos : pos + numel * count]
        if count == 1:
            out[slots[j]] = block.view(shape)
        else:
            pieces = block.view((count, *shape)).unbind(0)
            for i, piece in zip(slots[j:k], pieces, strict=True):
                out[i] = piece
        pos += numel * count
        j = k
    if pos != base.numel():
        raise LayoutError("a PackedTensor pickle's shape table does not match its buffer")


def _writable_bytes(buf: Any) -> Any:
    """A writable buffer holding ``buf``'s bytes (``torch.frombuffer`` warns on read-only)."""
    view = memoryview(buf)
    if view.readonly:
        return bytearray(view)
    return buf


def _decode_tensors(payload: Any) -> list[Any]:
    if isinstance(payload, list):
        return payload
    fmt, codes, refs, ranks, dims, groups, others = payload
    if fmt != _FORMAT:
        raise LayoutError(f"unknown PackedTensor pickle format {fmt!r}")
    codes_l, refs_l = _i64_list(codes), _i64_list(refs)
    ranks_l, dims_l = _i64_list(ranks), _i64_list(dims)
    n = len(codes_l)
    shapes: list[Any] = [None] * n
    group_slots: list[list[int]] = [[] for _ in groups]
    pos = 0
    for i, c in enumerate(codes_l):
        if c >= 0:
            r = ranks_l[i]
            shapes[i] = tuple(dims_l[pos : pos + r])
            pos += r
            group_slots[c].append(i)
    out: list[Any] = [None] * n
    for (name, buf), slots in zip(groups, group_slots, strict=False):
        dtype = getattr(torch, name, None)
        if not isinstance(dtype, torch.dtype):
            raise LayoutError(f"unknown dtype {name!r} in a PackedTensor pickle")
        data = _writable_bytes(buf)
        if memoryview(data).nbytes == 0:
            base = torch.empty(0, dtype=dtype)
        else:
            base = torch.frombuffer(data, dtype=torch.uint8).view(dtype)
        _unflatten_into(out, base, slots, shapes)
    for i, c in enumerate(codes_l):
        if c == -2:
            out[i] = others[refs_l[i]]
        elif c == -3:
            out[i] = out[refs_l[i]]
    return out


def _restore_into(obj: PackedTensor, state: dict[str, Any]) -> None:
    tensors = _decode_tensors(state["payload"])
    lay = None
    layout_state = state["layout"]
    if layout_state is not None:
        offsets, indices, blob = layout_state
        lay = PackedLayout.build(
            len(tensors),
            None if offsets is None else _i64_array(offsets),
            None if indices is None else _i64_array(indices),
            provenance_blob=None if blob is None else bytes(blob),
        )
    obj.__dict__ = {
        "tensors": tensors,
        "dim_to_pack": state["dim_to_pack"],
        "pad_to_max_shape": state["pad_to_max_shape"],
        "_layout": lay,
    }
    extra = state.get("extra")
    if extra:
        obj.__dict__.update(extra)
