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
``mmpack.packed.transfer``, and pickling to ``mmpack.packed.pickling``. The class is
published as ``mmpack.packed.PackedTensor`` (its ``__module__``), the path pickles name; the
package serves it from there (see ``mmpack.packed.pickling.operation_start`` for why).

Extras beyond NeMo-RL: :meth:`PackedTensor.repeat_interleave`, :meth:`PackedTensor.shard`,
:meth:`PackedTensor.csr`, :meth:`PackedTensor.physical_nbytes`,
:meth:`PackedTensor.logical_nbytes`, a compact pickle format (see ``__reduce_ex__``), and the
state surface serialization reads (``packed_state()`` / ``from_packed_state()``, see
``mmpack.packed.state``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Literal

import numpy as np
import torch

from mmpack._coerce import count_int, host_tensor, index_array
from mmpack._native import (
    IndexOverflowError,
    LayoutError,
    PackedLayout,
    ShardError,
    packed_concat,
)
from mmpack.packed import gather as _gather
from mmpack.packed import transfer as _transfer
from mmpack.packed import unique as _unique
from mmpack.packed.nemo_fields import RawField, empty_rows_layout
from mmpack.packed.nemo_fields import layout_from_fields as _build_layout
from mmpack.packed.pickling import format as _pickle_format
from mmpack.packed.storage import SegmentStorage
from mmpack.packed.unique import UniqueSegments

__all__ = ["PackedTensor", "materialize"]

#: How the native concat combines values (one of NeMo-RL's three class methods).
_Combine = Literal["concat", "merge_segments", "flattened_concat"]


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


# ---------------------------------------------------------------------------------------------
# the class


def materialize(
    value: PackedTensor,
    indices: Any,
    device: torch.device | str | None,
    out: torch.Tensor | None,
    pin_memory: bool,
) -> torch.Tensor | None:
    """The physical segments of ``value`` that ``indices`` lists (``None``: one per row),
    concatenated: ``as_tensor``'s path, shared with ``unique_segments``."""
    store = value._store_views()
    if store is not None and device is None:
        result = _gather.as_tensor_from_store(
            store, indices, value.dim_to_pack, value.pad_to_max_shape, out, pin_memory
        )
        if result is not _gather.NOT_COVERED:
            return result
    elif store is not None and device is not None:
        value.to(device)  # staged to the device straight from the store, in place
    return _gather.as_tensor(
        value.tensors,
        indices,
        value.dim_to_pack,
        value.pad_to_max_shape,
        device,
        out=out,
        pin_memory=pin_memory,
    )


class PackedTensor(SegmentStorage):
    """A logical batch of rows backed by packable tensor segments (NeMo-RL's semantics); see the
    module docs for its states and ``mmpack.packed.storage`` for how a value holds them."""

    # The public path, which pickles name and ``mmpack.packed`` serves (pickling detection).
    __module__ = "mmpack.packed"

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

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore mmpack's own pickles (see ``__reduce_ex__``) and NeMo-RL's: its current
        six-field state and the pre-deduplication three-field state (state L). A state that is
        neither (a corrupt pickle) raises ``LayoutError``. See ``mmpack.packed.pickling``."""
        self._take_state(_pickle_format.restore(type(self), state))

    # NeMo-RL's row-mapping attributes, as views over the handle
    _row_offsets = RawField("offsets", SegmentStorage._lay, SegmentStorage._set_layout)
    _segment_indices = RawField("indices", SegmentStorage._lay, SegmentStorage._set_layout)
    _segment_provenance = RawField("provenance", SegmentStorage._lay, SegmentStorage._set_layout)

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
        n = len(self._phys())
        if lay is None:
            self._set_layout(PackedLayout.legacy_dedup(n))
        elif not lay.has_provenance:
            self._set_layout(lay.with_provenance(PackedLayout.mint(n)))
        return self

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
        return materialize(self, indices, device, out, pin_memory)

    def unique_segments(self, device: torch.device | str | None = None) -> UniqueSegments | None:
        """The media of ``as_tensor()`` with each unique segment once (same provenance id: same
        segment), and the index from every logical occurrence to its unique segment; ``None``
        when no row has media. ``device`` moves the physical segments first, in place, as
        ``as_tensor`` does. The input of models adapted by ``mmpack.vision.encode_once``; see
        ``mmpack.packed.unique``."""
        return _unique.unique_segments(self, device, materialize)

    def to(self, device: torch.device | str, *, non_blocking: bool = True) -> PackedTensor:
        """Move the physical segments (a new list), keeping provenance; returns ``self``. Each
        unique segment moves once (to CUDA through one pinned staging buffer per dtype;
        ``non_blocking`` applies only towards CUDA). See
        ``mmpack.packed.transfer.move_segments``."""
        d = self.__dict__
        store = self._store_views()
        if store is None or torch.device(device).type != "cuda":
            # a value read in place moves its views' shared copies, as a local value its tensors
            d["tensors"] = _transfer.move_segments(self.tensors, device, non_blocking=non_blocking)
            return self
        moved = _transfer.move_segments(store, device, non_blocking=non_blocking)  # staged
        published = d.setdefault("tensors", moved)
        if published is not moved:  # another thread read ``tensors`` meanwhile: move those
            d["tensors"] = _transfer.move_segments(published, device, non_blocking=non_blocking)
        d.pop("_store", None)
        return self

    def to_dtype(self, dtype: torch.dtype) -> PackedTensor:
        """A new wrapper with floating segments cast to ``dtype``. Integer segments and ``None``
        stay the same objects. A real cast mints fresh provenance for every segment."""
        store = self._store_views()
        lay = self._lay()
        if store is not None and not _transfer.casts(store, dtype):  # still read in place
            return type(self)._make_store(list(store), self.dim_to_pack, self.pad_to_max_shape, lay)
        new = _transfer.cast_floating(self.tensors, dtype)
        if new is None:
            new = list(self.tensors)
        elif lay is not None and lay.has_provenance:
            lay = lay.reminted()
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
        if dedup_or_csr or n == 0:
            lay = empty_rows_layout(n, provenance=dedup_or_csr)
            return cls._make([], other.dim_to_pack, other.pad_to_max_shape, lay)
        try:
            rows = [None] * n
        except MemoryError as exc:
            raise IndexOverflowError(f"num_rows={n} empty rows cannot be allocated") from exc
        return cls(rows, other.dim_to_pack, pad_to_max_shape=other.pad_to_max_shape)

    @classmethod
    def concat(cls, from_packed_tensors: list[PackedTensor]) -> PackedTensor:
        """Concatenate rows. If any input is dedup-enabled or CSR, physical segments are
        re-interned by provenance (first occurrence wins) and the result is dedup-enabled."""
        return cls._combined(from_packed_tensors, "concat")

    @classmethod
    def merge_segments(cls, from_packed_tensors: list[PackedTensor]) -> PackedTensor:
        """Merge one conversation's per-turn values: legacy inputs give one row per turn,
        otherwise a single row re-interned like ``concat``."""
        return cls._combined(from_packed_tensors, "merge_segments")

    @classmethod
    def flattened_concat(cls, from_packed_tensors: list[PackedTensor]) -> PackedTensor:
        """Cross-conversation batch step: dedup inputs (one row each) are re-interned like
        ``concat``; legacy inputs are each materialized into one row."""
        return cls._combined(from_packed_tensors, "flattened_concat")

    @classmethod
    def _combined(cls, from_packed_tensors: list[PackedTensor], how: _Combine) -> PackedTensor:
        values = list(from_packed_tensors)
        out = packed_concat(values, _layouts_of(values), how)
        dim, pad = out.dim_to_pack, out.pad_to_max_shape
        if out.tensors is None:  # flattened_concat of legacy values: each materialized
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
        if lay is not None and lay.is_csr:
            offsets, indices = lay.offsets(), lay.indices()
        else:
            n = len(self._phys())
            offsets, indices = np.arange(n + 1, dtype=np.int64), np.arange(n, dtype=np.int64)
        assert offsets is not None and indices is not None
        offsets.flags.writeable = indices.flags.writeable = False
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
        csr = lay if lay is not None and lay.is_csr else None
        return _gather.logical_nbytes(self._phys(), csr, self.dim_to_pack, self.pad_to_max_shape)

    # ------------------------------------------------------------------ pickling

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        """Pickle as ``copyreg._reconstructor(cls, object, None)`` plus a state dict of builtin
        types (so a restricted unpickler that admits the class admits the value): the row
        mapping as int64 bytes and one provenance blob, plain CPU tensors as one byte buffer per
        dtype shared by every value of the same pickle. See ``mmpack.packed.pickling``."""
        return _pickle_format.reduce(self, self.packed_state(in_place=True), PackedTensor)
