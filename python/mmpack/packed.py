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
and ``to`` delegate to ``mmpack._materialize``, the only materialization path.

Extras beyond NeMo-RL: :meth:`PackedTensor.repeat_interleave`, :meth:`PackedTensor.shard`,
:meth:`PackedTensor.csr`, :meth:`PackedTensor.physical_nbytes`,
:meth:`PackedTensor.logical_nbytes`, and a compact pickle format (see ``__reduce_ex__``).

Private hooks for other mmpack modules:

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
import threading
import weakref
from collections.abc import Iterator, Sequence
from copy import deepcopy
from typing import Any

import numpy as np
import torch
from torch._utils import _flatten_dense_tensors

from mmpack._native import (
    IndexOverflowError,
    LayoutError,
    MmpackError,
    PackedLayout,
    ShardError,
    packed_concat,
)

__all__ = ["PackedTensor"]

_CORE_KEYS = frozenset(("tensors", "dim_to_pack", "pad_to_max_shape", "_layout"))
_RAW_KEYS = ("_row_offsets", "_segment_indices", "_segment_provenance")
_BOTH_OR_NEITHER = "_row_offsets and _segment_indices must either both be set or both be None"
_EMPTY_I64 = np.zeros(0, dtype=np.int64)
_new_object = object.__new__


class _Missing:
    """Marks a value whose native handle was not built yet (raw ``__dict__`` state)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<no PackedLayout yet>"


_MISSING: Any = _Missing()


# ---------------------------------------------------------------------------------------------
# conversion helpers


def _index_array(value: Any, name: str) -> np.ndarray | list[int]:
    """``value`` as a contiguous int64 array; a ``list`` of Python ints when some do not fit
    in int64 (the caller reports them with NeMo-RL's message)."""
    if isinstance(value, torch.Tensor):
        value = _host_tensor(value, name).numpy()
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


def _host_tensor(value: torch.Tensor, name: str) -> torch.Tensor:
    """``value`` on the CPU, detached; a ``meta`` tensor (no data to read) is a TypeError."""
    if value.device.type == "meta":
        raise TypeError(f"{name} must hold data, got a tensor on the meta device")
    return value.detach().cpu()


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


_I64_MIN, _I64_MAX = -(2**63), 2**63 - 1


def _count_arg(value: Any, name: str, error: type[Exception]) -> int:
    """``value`` as an int64 count: TypeError for a non-integer, ``error`` (a typed
    ``MmpackError``) for an int outside int64, which the native layer cannot take."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got bool")
    try:
        k = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None
    if not _I64_MIN <= k <= _I64_MAX:
        raise error(f"{name} must fit in int64, got {k}")
    return k


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


def _nbytes(t: Any) -> int:
    return 0 if t is None else int(t.numel()) * int(t.element_size())


# ---------------------------------------------------------------------------------------------
# the class


class PackedTensor:
    """A logical batch of rows backed by packable tensor segments (NeMo-RL's semantics).

    See the module docstring for the states and the native handle.
    """

    # Class-level default: values built by ``__new__`` + ``__dict__`` assignment (old pickles,
    # NeMo-RL's own tests) have no handle yet; ``_lay()`` adopts their raw fields on first use.
    _layout: Any = _MISSING
    tensors: list[Any]
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
        raw = [d.pop(k, None) for k in _RAW_KEYS]
        lay = _build_layout(len(d.get("tensors", ())), *raw)
        d["_layout"] = lay
        return lay

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore mmpack's own pickles (see ``__reduce_ex__``) and NeMo-RL's: its current
        six-field state and the pre-deduplication three-field state (state L). A state that is
        neither (a corrupt pickle) raises ``LayoutError``."""
        if not isinstance(state, dict):
            raise LayoutError(f"{_CORRUPT}: the state is a {type(state).__name__}, not a dict")
        if _STATE_KEY in state:
            _restore_into(self, state)
            return
        _check_fields(state, "NeMo-RL state")
        lay = state.get("_layout")
        if lay is not None and not (
            isinstance(lay, PackedLayout) and lay.n_physical == len(state["tensors"])
        ):
            raise LayoutError(f"{_CORRUPT}: _layout does not fit tensors")
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
            return PackedLayout.presence(self._tensor_list())
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
        ``pin_memory=True`` (needs CUDA). See ``mmpack._materialize``."""
        from mmpack import _materialize as materialize

        lay = self._lay()
        indices = lay.indices() if lay is not None and lay.is_csr else None
        return materialize.as_tensor(
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
        ``non_blocking`` applies only towards CUDA). See ``mmpack._materialize.move_segments``."""
        from mmpack import _materialize as materialize

        self.__dict__["tensors"] = materialize.move_segments(
            self.tensors, device, non_blocking=non_blocking
        )
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
            idx = (
                _host_tensor(indices, "indices").tolist()
                if isinstance(indices, torch.Tensor)
                else indices
            )
            tensors = self.tensors
            return type(self)(
                [tensors[i] for i in idx],
                self.dim_to_pack,
                pad_to_max_shape=self.pad_to_max_shape,
            )
        if type(indices) is list:
            try:
                new_lay, new_tensors = lay.slice(self._tensor_list(), indices)
            except OverflowError:  # ints beyond int64: NeMo-RL's IndexError
                _rows_array(indices, len(self))
                raise
        else:
            new_lay, new_tensors = lay.slice(self._tensor_list(), _rows_array(indices, len(self)))
        return type(self)._make(new_tensors, self.dim_to_pack, self.pad_to_max_shape, new_lay)

    @classmethod
    def empty_like(cls, other: PackedTensor) -> PackedTensor:
        """Empty logical rows matching ``other``."""
        return cls.empty_rows_like(other, len(other))

    @classmethod
    def empty_rows_like(cls, other: PackedTensor, num_rows: int) -> PackedTensor:
        """``num_rows`` logical rows without media (NeMo-RL's three cases)."""
        n = _count_arg(num_rows, "num_rows", LayoutError)
        if n < 0:
            raise LayoutError("num_rows must be non-negative")
        if isinstance(other, PackedTensor):
            dedup_or_csr = other._lay() is not None
        else:
            dedup_or_csr = other.deduplication_enabled or other._row_offsets is not None
        csr = dedup_or_csr or n == 0
        try:
            rows: Any = np.zeros(n + 1, dtype=np.int64) if csr else [None] * n
        except (MemoryError, ValueError) as exc:  # numpy: "array is too big"
            raise IndexOverflowError(f"num_rows={n} empty rows cannot be allocated") from exc
        if csr:
            lay = PackedLayout.build(
                0, rows, _EMPTY_I64, provenance_blob=b"" if dedup_or_csr else None
            )
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
        k = _count_arg(repeats, "repeats", IndexOverflowError)
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
        k = _count_arg(num_shards, "num_shards", ShardError)
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
        ``__setstate__`` recognizes, holding only builtin types and further such objects (so a
        restricted unpickler that admits the class admits the value). The row mapping travels
        as int64 bytes and one provenance blob; plain CPU tensors travel as one byte buffer per
        dtype (see "pickle format" below), shared by every value of the same pickle."""
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
        state = {
            _STATE_KEY: 1,
            "dim_to_pack": self.dim_to_pack,
            "pad_to_max_shape": self.pad_to_max_shape,
            "layout": layout_state,
            "segments": _encode_segments(self.tensors),
            "extra": extra,
        }
        return (copyreg._reconstructor, (type(self), object, None), state)  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------------------------
# pickle format
#
# A value pickles as copyreg._reconstructor(cls, object, None) + a state dict
#   {_STATE_KEY: 1, dim_to_pack, pad_to_max_shape, layout, segments, extra}
# layout: None (state L) or (offsets, indices, provenance): little-endian int64 bytes (None
#   without CSR) and 16 bytes per segment (None without provenance).
# segments: ("mmpack.segments/2", codes, pos, groups, others); codes/pos are little-endian
#   int64 bytes, one entry per physical slot i:
#     codes[i] == -1: None;  codes[i] == -2: others[pos[i]] (pickled normally);
#     codes[i] == k >= 0: groups[k].tensors[pos[i]].
# A group is an object pickled like a PackedTensor with state
#   {_STATE_KEY: 1, "group": ("mmpack.group/1", dtypes, ranks, dims, buffers)}: member j has
#   dtype buffers[dtypes[j]][0] and shape = the next ranks[j] values of dims; buffers is a list of
#   (dtype name, bytes of the members of that dtype back to back in C order), as a PickleBuffer
#   (protocol >= 5, out-of-band capable) or bytes. It unpickles as a private legacy PackedTensor
#   whose ``tensors`` are views into one writable buffer per dtype (requires_grad=False).
# Groups are what keeps tensor identity across values in one pickle (NeMo-RL gets it from the
# pickle memo): the first value that pickles a tensor puts it in its own group; later values of
# the same pickling operation reference that group object, which the memo writes once. An
# operation is recognized by a token that only the groups of the running pickle keep alive.

_STATE_KEY = "__mmpack_packed_tensor__"
_CORRUPT = "corrupt PackedTensor pickle"
_SEGMENTS_FORMAT = "mmpack.segments/2"
_GROUP_FORMAT = "mmpack.group/1"
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


_STRIDED = torch.strided
_TENSOR = torch.Tensor


def _bufferable(t: Any) -> bool:
    """A plain CPU tensor whose bytes can be written as they are (no autograd, subclass,
    sparse/nested layout or lazy conjugate/negative bit)."""
    return (
        type(t) is _TENSOR
        and t.dtype in _BUFFER_DTYPES
        and t.is_cpu
        and not t.requires_grad
        and t.layout is _STRIDED
        and not t.is_nested
        and not t.is_neg()
        and not t.is_conj()
    )


class _PickleOp:
    """Token of one pickling operation: which tensors already sit in which group."""

    __slots__ = ("__weakref__", "written")

    def __init__(self) -> None:
        self.written: dict[int, tuple[weakref.ref[_Group], int]] = {}


class _Group:
    """Tensors written together (pickled as a private PackedTensor, see "pickle format")."""

    __slots__ = ("__weakref__", "members", "op", "ref")

    def __init__(self, op: _PickleOp) -> None:
        self.members: list[torch.Tensor] = []
        self.op = op  # keeps the operation's token alive while the pickler's memo holds us
        self.ref = weakref.ref(self)

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        proto = protocol if isinstance(protocol, int) else 2
        state = {_STATE_KEY: 1, "group": _encode_group(self.members, proto)}
        return (copyreg._reconstructor, (PackedTensor, object, None), state)  # type: ignore[attr-defined]


_current_op: Any = lambda: None  # noqa: E731  (a dead weak reference)
_op_lock = threading.Lock()


def _pickle_op() -> _PickleOp:
    global _current_op
    with _op_lock:
        op = _current_op()
        if op is None:
            op = _PickleOp()
            _current_op = weakref.ref(op)
        return op


def _i64_bytes(values: Any) -> bytes:
    return np.asarray(values, dtype="<i8").tobytes()


def _i64_array(data: Any) -> np.ndarray:
    return np.frombuffer(data, dtype="<i8").astype(np.int64, copy=False)


def _encode_segments(tensors: list[Any]) -> Any:
    n = len(tensors)
    codes = [-1] * n
    pos = [0] * n
    groups: list[_Group] = []
    group_slot: dict[int, int] = {}
    others: list[Any] = []
    seen: dict[int, tuple[int, int]] = {}
    op: _PickleOp | None = None
    own: _Group | None = None
    own_slot = 0
    for i, t in enumerate(tensors):
        if t is None:
            continue
        key = id(t)
        hit = seen.get(key)
        if hit is None:
            if op is None:
                op = _pickle_op()
            entry = op.written.get(key)
            group = entry[0]() if entry is not None else None
            if group is not None and entry is not None:
                k = group_slot.get(id(group))
                if k is None:
                    k = group_slot[id(group)] = len(groups)
                    groups.append(group)
                hit = (k, entry[1])
            elif _bufferable(t):
                if own is None:
                    own = _Group(op)
                    own_slot = group_slot[id(own)] = len(groups)
                    groups.append(own)
                j = len(own.members)
                own.members.append(t)
                op.written[key] = (own.ref, j)
                hit = (own_slot, j)
            else:
                hit = (-2, len(others))
                others.append(t)
            seen[key] = hit
        codes[i], pos[i] = hit
    return (_SEGMENTS_FORMAT, _i64_bytes(codes), _i64_bytes(pos), groups, others)


def _encode_group(members: list[torch.Tensor], protocol: int) -> Any:
    n = len(members)
    dtypes = [0] * n
    ranks = [0] * n
    dims: list[int] = []
    by_dtype: dict[torch.dtype, int] = {}
    parts: list[list[torch.Tensor]] = []
    for j, t in enumerate(members):
        dtype = t.dtype
        g = by_dtype.get(dtype)
        if g is None:
            g = by_dtype[dtype] = len(parts)
            parts.append([])
        parts[g].append(t)
        dtypes[j] = g
        shape = t.shape
        ranks[j] = len(shape)
        dims.extend(shape)
    buffers: list[tuple[str, Any]] = []
    for dtype, g in by_dtype.items():
        arr = _flatten_dense_tensors(parts[g]).view(torch.uint8).numpy()
        buf: Any = pickle.PickleBuffer(arr) if protocol >= 5 else arr.tobytes()
        buffers.append((_BUFFER_DTYPES[dtype], buf))
    return (_GROUP_FORMAT, _i64_bytes(dtypes), _i64_bytes(ranks), _i64_bytes(dims), buffers)


def _check_fields(state: dict[str, Any], what: str) -> None:
    """The fields every restored value needs: a ``tensors`` list, an int ``dim_to_pack`` and a
    bool ``pad_to_max_shape`` (``LayoutError`` naming the first that is missing or wrong)."""
    for key, types in (("tensors", list), ("dim_to_pack", int), ("pad_to_max_shape", bool)):
        if key not in state:
            raise LayoutError(f"{_CORRUPT}: the {what} has no {key!r}")
        value = state[key]
        if not isinstance(value, types) or (types is int and isinstance(value, bool)):
            raise LayoutError(
                f"{_CORRUPT}: {key} must be a {types.__name__}, got {type(value).__name__}"
            )


def _unflatten_into(
    out: list[Any], base: torch.Tensor, slots: list[int], shapes: list[Any]
) -> None:
    """Views of ``base`` for the members ``slots`` (in order), into ``out``: runs of members
    with one shape become one ``view(k, *shape).unbind(0)``."""
    pos = 0
    j = 0
    n = len(slots)
    total = base.numel()
    while j < n:
        shape = shapes[slots[j]]
        k = j + 1
        while k < n and shapes[slots[k]] == shape:
            k += 1
        numel = math.prod(shape)
        count = k - j
        if pos + numel * count > total:
            break
        block = base[pos : pos + numel * count]
        if count == 1:
            out[slots[j]] = block.view(shape)
        else:
            pieces = block.view((count, *shape)).unbind(0)
            for i, piece in zip(slots[j:k], pieces, strict=True):
                out[i] = piece
        pos += numel * count
        j = k
    if j < n or pos != total:
        raise LayoutError(f"{_CORRUPT}: its shape table does not match its buffer")


def _writable_bytes(buf: Any) -> Any:
    """A writable buffer holding ``buf``'s bytes (``torch.frombuffer`` warns on read-only)."""
    view = memoryview(buf)
    if view.readonly:
        return bytearray(view)
    return buf


def _decode_group(payload: Any) -> list[Any]:
    fmt, dtypes, ranks, dims, buffers = payload
    if fmt != _GROUP_FORMAT:
        raise LayoutError(f"unknown PackedTensor pickle format {fmt!r}")
    dtypes_a, ranks_a, dims_a = _i64_array(dtypes), _i64_array(ranks), _i64_array(dims)
    if (
        len(dtypes_a) != len(ranks_a)
        or (ranks_a < 0).any()
        or int(ranks_a.sum()) != len(dims_a)
        or (dims_a < 0).any()
        or (len(dtypes_a) and not 0 <= int(dtypes_a.min()) <= int(dtypes_a.max()) < len(buffers))
    ):
        raise LayoutError(f"{_CORRUPT}: inconsistent tensor tables")
    dtypes_l, ranks_l, dims_l = dtypes_a.tolist(), ranks_a.tolist(), dims_a.tolist()
    n = len(dtypes_l)
    shapes: list[Any] = [None] * n
    slots: list[list[int]] = [[] for _ in buffers]
    at = 0
    for j in range(n):
        r = ranks_l[j]
        shapes[j] = tuple(dims_l[at : at + r])
        at += r
        slots[dtypes_l[j]].append(j)
    out: list[Any] = [None] * n
    for (name, buf), members in zip(buffers, slots, strict=True):
        dtype = getattr(torch, name, None)
        if not isinstance(dtype, torch.dtype):
            raise LayoutError(f"unknown dtype {name!r} in a PackedTensor pickle")
        data = _writable_bytes(buf)
        if memoryview(data).nbytes == 0:
            base = torch.empty(0, dtype=dtype)
        else:
            base = torch.frombuffer(data, dtype=torch.uint8).view(dtype)
        _unflatten_into(out, base, members, shapes)
    return out


def _decode_segments(payload: Any) -> list[Any]:
    fmt, codes, pos, groups, others = payload
    if fmt != _SEGMENTS_FORMAT:
        raise LayoutError(f"unknown PackedTensor pickle format {fmt!r}")
    codes_a, pos_a = _i64_array(codes), _i64_array(pos)
    if len(codes_a) != len(pos_a) or (len(codes_a) and (codes_a.min() < -2 or pos_a.min() < 0)):
        raise LayoutError(f"{_CORRUPT}: inconsistent segment tables")
    group_lists = [g.members if isinstance(g, _Group) else g.tensors for g in groups]
    out: list[Any] = []
    append = out.append
    for c, j in zip(codes_a.tolist(), pos_a.tolist(), strict=True):
        if c >= 0:
            append(group_lists[c][j])
        elif c == -1:
            append(None)
        else:
            append(others[j])
    return out


def _restore_into(obj: PackedTensor, state: dict[str, Any]) -> None:
    """Restore mmpack's own pickle format; any inconsistency is a ``LayoutError`` (the state
    comes from bytes that may be truncated or corrupt)."""
    try:
        _restore_fields(obj, state)
    except MmpackError:
        raise
    except Exception as exc:  # a decoding boundary: every failure means a corrupt state
        raise LayoutError(f"{_CORRUPT}: {type(exc).__name__}: {exc}") from exc


def _restore_fields(obj: PackedTensor, state: dict[str, Any]) -> None:
    if "group" in state:
        obj.tensors = _decode_group(state["group"])
        obj.dim_to_pack = 0
        obj.pad_to_max_shape = False
        obj._layout = None
        return
    tensors = _decode_segments(state["segments"])
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
    fields = {
        "tensors": tensors,
        "dim_to_pack": state["dim_to_pack"],
        "pad_to_max_shape": state["pad_to_max_shape"],
    }
    _check_fields(fields, "mmpack state")
    extra = state.get("extra")
    if extra is not None and not (
        isinstance(extra, dict)
        and _CORE_KEYS.isdisjoint(extra)
        and not set(_RAW_KEYS) & extra.keys()
    ):
        raise LayoutError(f"{_CORRUPT}: extra attributes must be a dict of non-field names")
    obj.tensors = tensors
    obj.dim_to_pack = fields["dim_to_pack"]
    obj.pad_to_max_shape = fields["pad_to_max_shape"]
    obj._layout = lay
    if extra:
        obj.__dict__.update(extra)
