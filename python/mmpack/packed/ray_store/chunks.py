"""Segments in Ray's object store: :func:`encode_segments` puts a value's new segments as one
chunk and writes references, :func:`decode_segments` reads them back as :class:`StoreSegment` s
(read-only views into the store). See ``mmpack.packed.ray_store`` for the whole path.
"""

from __future__ import annotations

import math
import os
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from mmpack.packed.buffers import BUFFER_DTYPES, DTYPES_BY_NAME, bufferable, i64_bytes
from mmpack.packed.ray_store.counters import COUNTERS
from mmpack.packed.ray_store.put_table import (
    LINGERING,
    LOCK,
    Entry,
    Held,
    Table,
    cap_of,
    forget,
    is_driver,
    lookup,
    session_table,
    signature_of,
)
from mmpack.packed.state import corrupt
from mmpack.packed.transfer import byte_view

__all__ = ["CHUNK_FORMAT", "STORE_FORMAT", "StoreSegment", "decode_segments", "encode_segments"]

#: The segments tuple of a value pickled for Ray: ``(STORE_FORMAT, codes, pos, refs, others)``,
#: ``codes[i] == k >= 0`` meaning member ``pos[i]`` of chunk ``refs[k]``.
STORE_FORMAT = "mmpack.store-segments/1"
#: What one ``ray.put`` holds: ``(CHUNK_FORMAT, dtype names, shapes, byte arrays)``.
CHUNK_FORMAT = "mmpack.store-chunk/1"
_MAX_NUMEL = 2**62


# ---------------------------------------------------------------------------------------------
# what the receiver holds


class Chunk:
    """One fetched chunk: read-only byte views into the store, and the ref that keeps it."""

    __slots__ = ("__weakref__", "arrays", "dtypes", "ref", "shapes")

    def __init__(self, ref: Any, payload: Any) -> None:
        fmt, names, shapes, arrays = payload
        if fmt != CHUNK_FORMAT or not len(names) == len(shapes) == len(arrays):
            raise corrupt(f"unknown or inconsistent object-store chunk {fmt!r}")
        self.ref = ref
        try:
            self.dtypes = [DTYPES_BY_NAME[name] for name in names]
        except (KeyError, TypeError):
            raise corrupt("an object-store chunk names an unknown dtype") from None
        self.shapes = [tuple(int(d) for d in s) for s in shapes]
        # the gather reads each member's bytes as its dtype and shape: they must be exactly so
        for array, dtype, shape in zip(arrays, self.dtypes, self.shapes, strict=True):
            if (
                not isinstance(array, np.ndarray)
                or array.dtype != np.uint8
                or array.ndim != 1
                or min(shape, default=0) < 0
                # an element count torch can allocate, zero-size dimensions aside
                or math.prod(d for d in shape if d) >= _MAX_NUMEL
                or array.nbytes != math.prod(shape) * dtype.itemsize
            ):
                raise corrupt("an object-store chunk member does not hold its shape's bytes")
        self.arrays = arrays


class StoreSegment:
    """A physical segment read in place from Ray's object store: a read-only byte view, its
    dtype and shape. It holds its chunk (and so the chunk's ``ObjectRef``) alive."""

    # Plain slots, not properties: a micro-batch's gather reads them for every segment.
    __slots__ = ("array", "chunk", "dtype", "j", "shape")
    #: what ``mmpack.packed.transfer`` recognises a store view by
    read_in_place = True

    def __init__(self, chunk: Chunk, j: int) -> None:
        self.chunk = chunk
        self.j = j
        #: the segment's bytes (read-only ``uint8``, C order)
        self.array: np.ndarray = chunk.arrays[j]
        self.dtype: torch.dtype = chunk.dtypes[j]
        self.shape: tuple[int, ...] = chunk.shapes[j]

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def element_size(self) -> int:
        return self.dtype.itemsize

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point

    def private(self) -> torch.Tensor:
        """A private, writable copy of the segment."""
        out = torch.empty(self.shape, dtype=self.dtype)
        if out.numel():
            byte_view(out)[:] = self.array
        return out

    def __repr__(self) -> str:
        return f"StoreSegment(shape={self.shape}, dtype={self.dtype}, read-only)"


# ---------------------------------------------------------------------------------------------
# writing


class _Putter:
    """The helper thread that runs ``ray.put`` outside the serializing thread."""

    pool: ThreadPoolExecutor | None = None
    pid = -1

    @classmethod
    def put(cls, payload: Any) -> Any:
        import ray

        if cls.pool is None or cls.pid != os.getpid():  # a forked child needs its own thread
            cls.pool = ThreadPoolExecutor(1, thread_name_prefix="mmpack-ray-put")
            cls.pid = os.getpid()
        return cls.pool.submit(ray.put, payload).result()


def encode_segments(segments: list[Any]) -> tuple[Any, ...]:
    """The store-segments tuple of a value (see the module docs); puts the segments not in the
    store yet as one chunk."""
    n = len(segments)
    codes = [-1] * n
    pos = [0] * n
    refs: list[Any] = []
    ref_slot: dict[Any, int] = {}
    others: list[Any] = []
    seen: dict[int, tuple[int, int]] = {}
    fresh: list[tuple[torch.Tensor, tuple[Any, ...] | None]] = []  # (tensor, signature)
    fresh_at: dict[int, int] = {}
    reused = 0
    table = session_table()
    driver = is_driver()
    touched: dict[int, Held] = {}  # the held chunks this value reuses

    def slot_of(ref: Any) -> int:
        k = ref_slot.get(ref)
        if k is None:
            k = ref_slot[ref] = len(refs)
            refs.append(ref)
        return k

    for i, t in enumerate(segments):
        if t is None:
            continue
        if id(t) in fresh_at:
            codes[i] = -3
            continue
        hit = seen.get(id(t))
        if hit is not None:
            codes[i], pos[i] = hit
            continue
        if isinstance(t, StoreSegment):
            hit = (slot_of(t.chunk.ref), t.j)
            reused += 1
        elif driver and bufferable(t):
            signature = signature_of(t)
            entry = lookup(table, t, signature)
            if entry is not None:
                touched[id(entry.held)] = entry.held
                hit = (slot_of(entry.held.ref), entry.j)
                reused += 1
            else:
                fresh_at[id(t)] = len(fresh)
                fresh.append((t, signature))
                codes[i] = -3  # filled in once the chunk is put
        else:
            hit = (-2, len(others))
            others.append(t)
        if hit is not None:
            seen[id(t)] = hit
            codes[i], pos[i] = hit
    if touched:
        with LOCK:
            for held in touched.values():
                table.touch(held)
    if fresh:
        ref = _put_chunk(table, fresh)
        k = slot_of(ref)
        for i, t in enumerate(segments):
            if codes[i] == -3:
                assert t is not None
                codes[i], pos[i] = k, fresh_at[id(t)]
    COUNTERS.reused_segments += reused
    return (STORE_FORMAT, i64_bytes(codes), i64_bytes(pos), refs, others)


def _put_chunk(table: Table, fresh: list[tuple[torch.Tensor, tuple[Any, ...] | None]]) -> Any:
    # the signatures were read before the bytes: a write racing the put makes the entry stale
    contiguous = [t.contiguous() for t, _ in fresh]
    arrays = [byte_view(c) for c in contiguous]
    payload = (
        CHUNK_FORMAT,
        [BUFFER_DTYPES[c.dtype] for c in contiguous],
        [tuple(c.shape) for c in contiguous],
        arrays,
    )
    ref = _Putter.put(payload)
    nbytes = sum(a.nbytes for a in arrays)
    # no version counter: nothing tells a later send it is unchanged
    kept = [(j, t, sig) for j, (t, sig) in enumerate(fresh) if sig is not None]
    cap = cap_of(table) if kept else 0
    with LOCK:
        for _, t, _sig in kept:  # entries of these tensors from an earlier put are stale
            old = table.put.get(id(t))
            if old is not None:
                table.drop_entry(id(t), old, linger=True)
        if kept and nbytes <= cap:
            held = Held(ref, nbytes)
            table.hold(held)
            for j, t, signature in kept:
                storage = StorageWeakRef(t.untyped_storage())
                entry = Entry(held, j, signature, storage, weakref.ref(t))
                entry.wref = weakref.ref(t, forget(id(t), entry, table))
                table.add(id(t), entry)
            table.shrink(cap)
        else:
            LINGERING.keep(ref)  # no table holds it: see _Lingering
    COUNTERS.put_objects += 1
    COUNTERS.put_segments += len(fresh)
    COUNTERS.put_bytes += nbytes
    return ref


# ---------------------------------------------------------------------------------------------
# reading


def decode_segments(payload: Any) -> list[Any]:
    """The physical segment list of a store-segments tuple: :class:`StoreSegment` s (one per
    referenced member), ``None`` and the inline ``others``."""
    import ray

    fmt, codes, pos, refs, others = payload
    if fmt != STORE_FORMAT:
        raise corrupt(f"unknown object-store segments format {fmt!r}")
    codes_a = np.frombuffer(codes, dtype="<i8").tolist()
    pos_a = np.frombuffer(pos, dtype="<i8").tolist()
    if len(codes_a) != len(pos_a):
        raise corrupt("inconsistent object-store segment tables")
    read = session_table().read
    chunks: list[Chunk | None] = [None] * len(refs)
    missing = []
    for k, ref in enumerate(refs):
        chunk = read.get(ref.binary())
        if chunk is None:
            missing.append(k)
        chunks[k] = chunk
    if missing:
        fetched = ray.get([refs[k] for k in missing])
        for k, data in zip(missing, fetched, strict=True):
            chunk = Chunk(refs[k], data)
            read[refs[k].binary()] = chunk
            chunks[k] = chunk
            COUNTERS.get_objects += 1
            COUNTERS.get_bytes += sum(a.nbytes for a in chunk.arrays)
    made: dict[tuple[int, int], StoreSegment] = {}
    out: list[Any] = []
    for c, j in zip(codes_a, pos_a, strict=True):
        if c >= 0:
            seg = made.get((c, j))
            if seg is None:
                chunk = chunks[c]
                assert chunk is not None
                if not 0 <= j < len(chunk.arrays):
                    raise corrupt(
                        "a segment references a member its object-store chunk does not have"
                    )
                seg = made[(c, j)] = StoreSegment(chunk, j)
            out.append(seg)
        elif c == -1:
            out.append(None)
        elif c == -2:
            out.append(others[j])
        else:
            raise corrupt("inconsistent object-store segment tables")
    return out
