"""A plain-Python ``PackedTensor`` with NeMo-RL's semantics, written from the specification.

This is the oracle the tests compare ``mmpack.PackedTensor`` against, and the baseline the
benchmarks time it against. It is deliberately naive in the way NeMo-RL's class is: the state is
plain Python lists in the instance ``__dict__`` (``tensors``, ``dim_to_pack``,
``pad_to_max_shape``, ``_row_offsets``, ``_segment_indices``, ``_segment_provenance``), provenance
is one ``uuid4().bytes`` per physical segment, every operation loops over rows and segments in the
interpreter, and ``as_tensor`` materializes with ``torch.cat``.

The four states (see the NeMo-RL spec, section 1.3):

* L  (legacy): ``_row_offsets is None`` and ``_segment_provenance is None``; row ``r`` is
  ``tensors[r]`` (which may be ``None``).
* LD (legacy layout, dedup enabled): as L, with one provenance entry per physical segment.
* C  (CSR, no provenance): row ``r`` references
  ``tensors[i] for i in _segment_indices[_row_offsets[r]:_row_offsets[r + 1]]``.
* CD (CSR with provenance).

Beyond NeMo-RL, the same extras as ``mmpack.PackedTensor``, implemented the plain way:
``repeat_interleave`` (per-row slice + deepcopy + ``concat``, which is how NeMo-RL's GRPO
G-expansion shares media), ``shard`` (contiguous ``slice`` calls), ``csr``,
``physical_nbytes`` and ``logical_nbytes``.
"""

from __future__ import annotations

import copy
import itertools
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["PackedTensor"]


def _is_csr_or_dedup(value: PackedTensor) -> bool:
    return value._segment_provenance is not None or value._row_offsets is not None


def _check_count(name: str, value: Any, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


class PackedTensor:
    """A logical batch of rows over physical tensor segments (NeMo-RL semantics)."""

    def __init__(
        self,
        tensors: torch.Tensor | list[torch.Tensor | None],
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
            self.tensors: list[torch.Tensor | None] = [tensors]
        elif isinstance(tensors, list):
            if len(tensors) == 0 and _row_offsets is None:
                raise AssertionError("Input tensors to PackedTensor must be a non-empty list")
            self.tensors = tensors  # stored as is: the constructor never copies
        else:
            raise ValueError(f"Unsupported type for input tensors to PackedTensor: {type(tensors)}")
        self.dim_to_pack = dim_to_pack
        self.pad_to_max_shape = pad_to_max_shape

        if (_row_offsets is None) != (_segment_indices is None):
            raise ValueError(
                "_row_offsets and _segment_indices must either both be set or both be None"
            )
        if _row_offsets is not None and _segment_indices is not None:
            if len(_row_offsets) == 0 or _row_offsets[0] != 0:
                raise ValueError("_row_offsets must start with 0")
            for prev, cur in itertools.pairwise(_row_offsets):
                if cur < prev:
                    raise ValueError("_row_offsets must be non-decreasing")
            if _row_offsets[-1] != len(_segment_indices):
                raise ValueError(
                    "_row_offsets must end at the number of logical segment references"
                )
            if _segment_indices and (
                min(_segment_indices) < 0 or max(_segment_indices) >= len(self.tensors)
            ):
                raise ValueError(
                    "_segment_indices cannot reference an out-of-range physical segment"
                )
        if _segment_provenance is not None and len(_segment_provenance) != len(self.tensors):
            raise ValueError("_segment_provenance must have one entry per physical segment")

        self._row_offsets = _row_offsets
        self._segment_indices = _segment_indices
        self._segment_provenance = _segment_provenance

    # ------------------------------------------------------------------ basic queries

    def __len__(self) -> int:
        if self._row_offsets is not None:
            return len(self._row_offsets) - 1
        return len(self.tensors)

    @property
    def deduplication_enabled(self) -> bool:
        return self._segment_provenance is not None

    def _row_segment_indices(self, row: int) -> list[int]:
        if self._row_offsets is None or self._segment_indices is None:
            return [row]
        return self._segment_indices[self._row_offsets[row] : self._row_offsets[row + 1]]

    def logical_segment_counts_by_row(self) -> list[int]:
        if self._row_offsets is None or self._segment_indices is None:
            return [0 if t is None else 1 for t in self.tensors]
        counts = []
        for row in range(len(self)):
            counts.append(
                sum(1 for i in self._row_segment_indices(row) if self.tensors[i] is not None)
            )
        return counts

    def iter_logical_segments(self) -> Iterator[torch.Tensor | None]:
        if self._segment_indices is None:
            yield from self.tensors
        else:
            for i in self._segment_indices:
                yield self.tensors[i]

    def enable_deduplication(self) -> PackedTensor:
        if self._segment_provenance is None:
            self._segment_provenance = [uuid.uuid4().bytes for _ in self.tensors]
        return self

    # ------------------------------------------------------------------ copying and pickling

    def __deepcopy__(self, memo: dict[int, Any]) -> PackedTensor:
        if not _is_csr_or_dedup(self):
            copied = type(self)(
                [copy.deepcopy(t, memo) for t in self.tensors],
                self.dim_to_pack,
                pad_to_max_shape=self.pad_to_max_shape,
            )
        else:
            if self.deduplication_enabled:
                tensors = list(self.tensors)
            else:
                tensors = [copy.deepcopy(t, memo) for t in self.tensors]
            copied = type(self)(
                tensors,
                self.dim_to_pack,
                pad_to_max_shape=self.pad_to_max_shape,
                _row_offsets=None if self._row_offsets is None else list(self._row_offsets),
                _segment_indices=(
                    None if self._segment_indices is None else list(self._segment_indices)
                ),
                _segment_provenance=(
                    None if self._segment_provenance is None else list(self._segment_provenance)
                ),
            )
        memo[id(self)] = copied
        return copied

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.__dict__.setdefault("_row_offsets", None)
        self.__dict__.setdefault("_segment_indices", None)
        self.__dict__.setdefault("_segment_provenance", None)

    # ------------------------------------------------------------------ materialization

    def as_tensor(self, device: torch.device | str | None = None) -> torch.Tensor | None:
        if device is not None:
            for i, t in enumerate(self.tensors):
                if t is not None:
                    self.tensors[i] = t.to(device)
        logical = list(self.iter_logical_segments())
        present = [t for t in logical if t is not None]
        if not present:
            return None
        if self.pad_to_max_shape:
            present = self._pad(present)
        return torch.cat(present, dim=self.dim_to_pack).to(device)

    def _pad(self, items: list[torch.Tensor]) -> list[torch.Tensor]:
        ranks = sorted({t.dim() for t in items})
        if len(ranks) != 1:
            raise ValueError(
                f"pad_to_max_shape requires tensors with the same rank, but received ranks {ranks}"
            )
        rank = ranks[0]
        dim = self.dim_to_pack + rank if self.dim_to_pack < 0 else self.dim_to_pack
        if not 0 <= dim < rank:
            raise IndexError(
                f"dim_to_pack={self.dim_to_pack} is invalid for tensors with rank {rank}"
            )
        max_shape = [max(t.shape[d] for t in items) for d in range(rank)]
        padded = []
        for t in items:
            target = list(max_shape)
            target[dim] = t.shape[dim]
            if list(t.shape) == target:
                padded.append(t)
                continue
            out = torch.zeros(target, dtype=t.dtype, device=t.device)
            out[tuple(slice(0, s) for s in t.shape)] = t
            padded.append(out)
        return padded

    def to(self, device: torch.device | str) -> PackedTensor:
        self.tensors = [None if t is None else t.to(device) for t in self.tensors]
        return self

    def to_dtype(self, dtype: torch.dtype) -> PackedTensor:
        requires_conversion = any(
            t is not None and t.is_floating_point() and t.dtype != dtype for t in self.tensors
        )
        provenance = self._segment_provenance
        if requires_conversion:
            tensors = [
                t.to(dtype=dtype) if t is not None and t.is_floating_point() else t
                for t in self.tensors
            ]
            if provenance is not None:
                provenance = [uuid.uuid4().bytes for _ in tensors]
        else:
            tensors = list(self.tensors)
            if provenance is not None:
                provenance = list(provenance)
        return type(self)(
            tensors,
            self.dim_to_pack,
            pad_to_max_shape=self.pad_to_max_shape,
            _row_offsets=None if self._row_offsets is None else list(self._row_offsets),
            _segment_indices=None if self._segment_indices is None else list(self._segment_indices),
            _segment_provenance=provenance,
        )

    # ------------------------------------------------------------------ row selection

    def slice(self, indices: Sequence[int] | torch.Tensor) -> PackedTensor:
        idx = indices.tolist() if isinstance(indices, torch.Tensor) else indices
        if not _is_csr_or_dedup(self):
            return type(self)(
                [self.tensors[i] for i in idx],
                self.dim_to_pack,
                pad_to_max_shape=self.pad_to_max_shape,
            )
        n = len(self)
        remap: dict[int, int] = {}
        tensors: list[torch.Tensor | None] = []
        provenance: list[bytes] | None = None if self._segment_provenance is None else []
        offsets = [0]
        seg_indices: list[int] = []
        for row in idx:
            r = row + n if row < 0 else row
            if r < 0 or r >= n:
                raise IndexError(f"PackedTensor row index {r} is out of range")
            for phys in self._row_segment_indices(r):
                new = remap.get(phys)
                if new is None:
                    new = len(tensors)
                    remap[phys] = new
                    tensors.append(self.tensors[phys])
                    if provenance is not None and self._segment_provenance is not None:
                        provenance.append(self._segment_provenance[phys])
                seg_indices.append(new)
            offsets.append(len(seg_indices))
        return type(self)(
            tensors,
            self.dim_to_pack,
            pad_to_max_shape=self.pad_to_max_shape,
            _row_offsets=offsets,
            _segment_indices=seg_indices,
            _segment_provenance=provenance,
        )

    # ------------------------------------------------------------------ constructors from others

    @classmethod
    def empty_like(cls, other: PackedTensor) -> PackedTensor:
        return cls.empty_rows_like(other, len(other))

    @classmethod
    def empty_rows_like(cls, other: PackedTensor, num_rows: int) -> PackedTensor:
        if num_rows < 0:
            raise ValueError("num_rows must be non-negative")
        if _is_csr_or_dedup(other):
            return cls(
                [],
                other.dim_to_pack,
                pad_to_max_shape=other.pad_to_max_shape,
                _row_offsets=[0] * (num_rows + 1),
                _segment_indices=[],
                _segment_provenance=[],
            )
        if num_rows == 0:
            return cls(
                [],
                other.dim_to_pack,
                pad_to_max_shape=other.pad_to_max_shape,
                _row_offsets=[0],
                _segment_indices=[],
            )
        return cls([None] * num_rows, other.dim_to_pack, pad_to_max_shape=other.pad_to_max_shape)

    @staticmethod
    def _check_compatible(values: Sequence[PackedTensor]) -> None:
        if len({p.dim_to_pack for p in values}) != 1:
            raise AssertionError("All packed tensors must have the same dim_to_pack")
        if len({p.pad_to_max_shape for p in values}) != 1:
            raise AssertionError("All packed tensors must have the same pad_to_max_shape setting")

    @classmethod
    def concat(cls, values: Sequence[PackedTensor]) -> PackedTensor:
        cls._check_compatible(values)
        first = values[0]
        if not any(_is_csr_or_dedup(p) for p in values):
            tensors: list[torch.Tensor | None] = []
            for p in values:
                tensors.extend(p.tensors)
            return cls(tensors, first.dim_to_pack, pad_to_max_shape=first.pad_to_max_shape)

        seen: dict[bytes, int] = {}
        out_tensors: list[torch.Tensor | None] = []
        out_provenance: list[bytes] = []
        offsets = [0]
        seg_indices: list[int] = []
        for p in values:
            local: list[int] = []
            for i, t in enumerate(p.tensors):
                prov = None if p._segment_provenance is None else p._segment_provenance[i]
                if prov is not None and prov in seen:
                    local.append(seen[prov])
                    continue
                if prov is None:
                    prov = uuid.uuid4().bytes
                seen[prov] = len(out_tensors)
                local.append(len(out_tensors))
                out_tensors.append(t)
                out_provenance.append(prov)
            for row in range(len(p)):
                for phys in p._row_segment_indices(row):
                    seg_indices.append(local[phys])
                offsets.append(len(seg_indices))
        return cls(
            out_tensors,
            first.dim_to_pack,
            pad_to_max_shape=first.pad_to_max_shape,
            _row_offsets=offsets,
            _segment_indices=seg_indices,
            _segment_provenance=out_provenance,
        )

    @classmethod
    def merge_segments(cls, values: Sequence[PackedTensor]) -> PackedTensor:
        if not any(_is_csr_or_dedup(p) for p in values):
            return cls.concat(values)
        merged = cls.concat(values)
        assert merged._segment_indices is not None
        return cls(
            merged.tensors,
            merged.dim_to_pack,
            pad_to_max_shape=merged.pad_to_max_shape,
            _row_offsets=[0, len(merged._segment_indices)],
            _segment_indices=merged._segment_indices,
            _segment_provenance=merged._segment_provenance,
        )

    @classmethod
    def flattened_concat(cls, values: Sequence[PackedTensor]) -> PackedTensor:
        cls._check_compatible(values)
        if any(_is_csr_or_dedup(p) for p in values):
            for p in values:
                if len(p) != 1:
                    raise AssertionError(
                        "flattened_concat requires one logical row per input; "
                        "merge_segments only collapses dedup-enabled values"
                    )
            return cls.concat(values)
        first = values[0]
        return cls(
            [p.as_tensor() for p in values],
            first.dim_to_pack,
            pad_to_max_shape=first.pad_to_max_shape,
        )

    # ------------------------------------------------------------------ extras (mmpack's API)

    def repeat_interleave(self, repeats: int) -> PackedTensor:
        """Each logical row ``repeats`` times in place order, sharing physical segments and
        provenance; the result is dedup-enabled. Done the way NeMo-RL's GRPO expansion does it:
        make the value dedup-enabled, then per row deep-copy it ``repeats`` times and ``concat``
        everything (re-interning collapses the copies). A value without provenance is not
        mutated: a shallow copy gets the fresh provenance."""
        _check_count("repeats", repeats, minimum=0)
        src = self
        if not src.deduplication_enabled:
            src = type(self)(
                list(self.tensors),
                self.dim_to_pack,
                pad_to_max_shape=self.pad_to_max_shape,
                _row_offsets=None if self._row_offsets is None else list(self._row_offsets),
                _segment_indices=(
                    None if self._segment_indices is None else list(self._segment_indices)
                ),
            ).enable_deduplication()
        copies: list[PackedTensor] = []
        for row in range(len(src)):
            one = src.slice([row])
            for _ in range(repeats):
                copies.append(copy.deepcopy(one))
        if not copies:
            return type(self).empty_rows_like(src, 0)
        return type(self).concat(copies)

    def shard(self, num_shards: int) -> list[PackedTensor]:
        """``num_shards`` contiguous equal shards, each a ``slice`` of its row range (so each is
        compacted to the physical segments it references, in first-reference order)."""
        _check_count("num_shards", num_shards, minimum=1)
        n = len(self)
        if n % num_shards != 0:
            raise ValueError(
                f"cannot shard a PackedTensor of {n} rows into {num_shards} equal shards"
            )
        size = n // num_shards
        return [self.slice(list(range(s * size, (s + 1) * size))) for s in range(num_shards)]

    def csr(self) -> tuple[np.ndarray, np.ndarray]:
        """Row offsets and segment indices as read-only int64 arrays (identity for legacy)."""
        if self._row_offsets is None or self._segment_indices is None:
            n = len(self.tensors)
            offsets = np.arange(n + 1, dtype=np.int64)
            indices = np.arange(n, dtype=np.int64)
        else:
            offsets = np.array(self._row_offsets, dtype=np.int64)
            indices = np.array(self._segment_indices, dtype=np.int64)
        offsets.setflags(write=False)
        indices.setflags(write=False)
        return offsets, indices

    def physical_nbytes(self) -> int:
        """Bytes of the physical segments (every non-``None`` entry of ``tensors``)."""
        return sum(t.numel() * t.element_size() for t in self.tensors if t is not None)

    def logical_nbytes(self) -> int:
        """Bytes ``as_tensor`` materializes: every logical segment, repeats included; with
        ``pad_to_max_shape``, the padded segments (the unpadded bytes when they cannot be
        padded, where ``as_tensor`` raises). Computed the plain way: pad, then measure."""
        present = [t for t in self.iter_logical_segments() if t is not None]
        if self.pad_to_max_shape and present:
            try:
                present = self._pad(present)
            except (ValueError, IndexError):
                pass
        return sum(t.numel() * t.element_size() for t in present)
