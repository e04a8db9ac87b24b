"""Segments read in place from Ray's object store: the formats, :class:`Chunk` (one object as
this process reads it) and :class:`StoreSegment` (a read-only view of one of its members), and
:func:`decode_segments`, which turns a value's store-segments tuple back into its segment list
(``mmpack.packed.ray_store.writing`` writes it). See ``mmpack.packed.ray_store`` for the whole
path.
"""

from __future__ import annotations

import asyncio
import math
import os
import threading
import weakref
from typing import Any

import numpy as np
import torch

from mmpack.packed.buffers import DTYPES_BY_NAME
from mmpack.packed.ray_store.counters import COUNTERS
from mmpack.packed.ray_store.put_table import session_table
from mmpack.packed.state import corrupt
from mmpack.packed.storage import SegmentStorage
from mmpack.packed.transfer import byte_view

__all__ = [
    "CHUNK_FORMAT",
    "MAX_NUMEL",
    "STORE_FORMAT",
    "Chunk",
    "StoreSegment",
    "decode_segments",
    "fetch",
    "ready",
]

#: The segments tuple of a value pickled for Ray: ``(STORE_FORMAT, codes, pos, refs, others)``,
#: ``codes[i] == k >= 0`` meaning member ``pos[i]`` of chunk ``refs[k]``, ``codes[i] == -2``
#: ``others[pos[i]]`` (in the value's own bytes, see :data:`INLINE_FORMAT`), ``-1`` ``None``.
STORE_FORMAT = "mmpack.store-segments/1"
#: What one ``ray.put`` holds: ``(CHUNK_FORMAT, dtype names, shapes, byte arrays)``.
CHUNK_FORMAT = "mmpack.store-chunk/1"
#: The largest element count a chunk or inline member may declare (torch allocates below it).
MAX_NUMEL = 2**62


# ---------------------------------------------------------------------------------------------
# what the receiver holds


#: Guards the one-time steps of a chunk (its read) and of a segment (its claim). Held only for a
#: few assignments, never across a ``ray.get`` or a copy.
_LOCK = threading.Lock()


def _new_lock_in_child() -> None:
    # A fork while another thread held the lock would leave it held forever in the child.
    global _LOCK
    _LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_lock_in_child)


class Chunk:
    """One chunk as this process reads it: the ref that keeps it, the Ray session it was read
    in, and, once read (:func:`fetch`, :func:`ready`, or at once outside an async actor), its
    members' read-only byte views into the store, dtypes and shapes (``arrays`` is ``None``
    until then).

    ``last`` is ``(ref object, {member: weak segment})`` of the latest deserialization that
    referenced the chunk: the pickle memo makes every value of one Ray object hold the same
    ``ObjectRef`` object, so values received together share their segments (see
    :func:`decode_segments`). Holding that ``ObjectRef`` keeps its ``id`` from being reused."""

    __slots__ = ("__weakref__", "arrays", "dtypes", "last", "ref", "session", "shapes")

    def __init__(self, ref: Any, payload: Any = None, session: Any = None) -> None:
        self.ref = ref
        #: what names the Ray session the chunk was read in (``put_table.Table.session``)
        self.session = session
        self.arrays: list[np.ndarray] | None = None
        self.dtypes: list[torch.dtype] = []
        self.shapes: list[tuple[int, ...]] = []
        self.last: tuple[Any, dict[int, Any]] | None = None
        if payload is not None:
            self.fill(payload)

    def fill(self, payload: Any) -> bool:
        """Take the chunk's fetched payload (checked: ``LayoutError`` for a corrupt one);
        ``False`` when another thread filled it first."""
        fmt, names, shapes, arrays = payload
        if fmt != CHUNK_FORMAT or not len(names) == len(shapes) == len(arrays):
            raise corrupt(f"unknown or inconsistent object-store chunk {fmt!r}")
        try:
            dtypes = [DTYPES_BY_NAME[name] for name in names]
        except (KeyError, TypeError):
            raise corrupt("an object-store chunk names an unknown dtype") from None
        shapes = [tuple(int(d) for d in s) for s in shapes]
        # the gather reads each member's bytes as its dtype and shape: they must be exactly so
        for array, dtype, shape in zip(arrays, dtypes, shapes, strict=True):
            if (
                not isinstance(array, np.ndarray)
                or array.dtype != np.uint8
                or array.ndim != 1
                or min(shape, default=0) < 0
                # an element count torch can allocate, zero-size dimensions aside
                or math.prod(d for d in shape if d) >= MAX_NUMEL
                or array.nbytes != math.prod(shape) * dtype.itemsize
            ):
                raise corrupt("an object-store chunk member does not hold its shape's bytes")
        with _LOCK:
            if self.arrays is not None:
                return False
            self.dtypes, self.shapes = dtypes, shapes
            self.arrays = arrays  # last: a reader that sees it sees the rest
        COUNTERS.get_objects += 1
        COUNTERS.get_bytes += sum(a.nbytes for a in arrays)
        return True


_ATTRS = frozenset(("array", "dtype", "shape"))


class StoreSegment:
    """A physical segment read in place from Ray's object store: a read-only byte view, its
    dtype and shape. It holds its chunk (and so the chunk's ``ObjectRef``) alive.

    ``array``, ``dtype`` and ``shape`` are set once the chunk is read; a segment of a chunk not
    read yet (an async actor's argument) reads it on first use of any of them (one blocking
    ``ray.get``; :func:`ready` reads without blocking).

    The segment stands for one tensor, as the sender's segment tensor did: every value that
    holds this segment object (the values of one received object, the slices and shards made
    of them) gets the same private copy from its ``tensors`` (:meth:`claim`), made once. Once
    claimed, ``array`` is that copy's bytes, so that a gather sees what was written into it."""

    # Plain slots, not properties: a micro-batch's gather reads them for every segment.
    __slots__ = (
        "__weakref__",
        "array",
        "chunk",
        "claimed",
        "claimed_version",
        "dtype",
        "j",
        "shape",
    )
    #: what ``mmpack.packed.transfer`` recognises a store view by
    read_in_place = True

    def __init__(self, chunk: Chunk, j: int) -> None:
        self.chunk = chunk
        self.j = j
        #: the private copy every holder shares, once :meth:`claim` made it
        self.claimed: torch.Tensor | None = None
        self.claimed_version = 0
        if chunk.arrays is not None:
            self._bind()

    def _bind(self) -> None:
        chunk = self.chunk
        arrays = chunk.arrays
        assert arrays is not None
        if not 0 <= self.j < len(arrays):
            raise corrupt("a segment references a member its object-store chunk does not have")
        #: the segment's bytes (read-only ``uint8``, C order; the claimed copy's once claimed)
        self.dtype: torch.dtype = chunk.dtypes[self.j]
        self.shape: tuple[int, ...] = chunk.shapes[self.j]
        self.array: np.ndarray = arrays[self.j]

    def __getattr__(self, name: str) -> Any:
        # only for slots not set yet: the chunk was not read when the segment was made
        if name not in _ATTRS:
            raise AttributeError(f"'StoreSegment' object has no attribute {name!r}")
        fetch([self.chunk])
        with _LOCK:
            if self.claimed is None:  # a claim set ``array`` already
                self._bind()
        return object.__getattribute__(self, name)

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
        """A new private, writable copy of the segment (of its claimed copy, once claimed)."""
        # a copy made under torch.inference_mode must still take in-place writes outside it
        with torch.inference_mode(False):
            out = torch.empty(self.shape, dtype=self.dtype)
        if out.numel():
            byte_view(out)[:] = self.array
        return out

    def claim(self) -> torch.Tensor:
        """The private copy of the segment that every value holding it shares (made on the
        first call; threads that race get the same tensor)."""
        out = self.claimed
        if out is None:
            fresh = self.private()  # outside the lock: copying may take a while
            with _LOCK:
                out = self.claimed
                if out is None:
                    self.claimed = out = fresh
                    self.claimed_version = fresh._version
                    self.array = byte_view(fresh)
        return out

    def current(self) -> Any:
        """What a sender must send for this segment: the segment itself (its chunk), or its
        claimed copy once something was written into it (a write that bumps its version
        counter, as the put table tells a changed tensor)."""
        out = self.claimed
        if out is None or out._version == self.claimed_version:
            return self
        return out

    def twin(self) -> Any:
        """An unshared segment with the same bytes, for a deep copy: a new view, or a copy of
        the claimed copy once something was written into it."""
        out = self.current()
        return StoreSegment(self.chunk, self.j) if out is self else out.clone()

    def __repr__(self) -> str:
        return f"StoreSegment(shape={self.shape}, dtype={self.dtype}, read-only)"


# ---------------------------------------------------------------------------------------------
# reading


def decode_segments(payload: Any) -> list[Any]:
    """The physical segment list of a store-segments tuple: :class:`StoreSegment` s (one per
    referenced member), ``None`` and the inline ``others``.

    Each chunk is read once per process while a segment of it lives (the session table's read
    cache). Inside an async actor nothing is read here: Ray deserializes the arguments of an
    async actor's calls on the thread that starts them, so a blocking pull would hold back
    every other call for its whole length; the coroutine awaits :func:`ready` instead (or its
    first read pulls). Values of one received object that reference the same member get the
    same segment object (see :class:`Chunk`), as plain Ray's values of one object share the
    tensor they shared when sent."""
    fmt, codes, pos, refs, others = payload
    if fmt != STORE_FORMAT:
        raise corrupt(f"unknown object-store segments format {fmt!r}")
    codes_a = np.frombuffer(codes, dtype="<i8").tolist()
    pos_a = np.frombuffer(pos, dtype="<i8").tolist()
    if len(codes_a) != len(pos_a):
        raise corrupt("inconsistent object-store segment tables")
    table = session_table()
    read = table.read
    chunks: list[Chunk] = []
    shared: list[dict[int, Any]] = []  # per chunk: member -> weak segment of this object
    for ref in refs:
        key = ref.binary()
        chunk = read.get(key)
        if chunk is None:
            chunk = read.setdefault(key, Chunk(ref, session=table.session))
        last = chunk.last
        if last is None or last[0] is not ref:  # the first value of this object to reference it
            last = chunk.last = (ref, {})
        chunks.append(chunk)
        shared.append(last[1])
    if not _in_async_actor():
        fetch(chunks)
    made: dict[tuple[int, int], StoreSegment] = {}
    out: list[Any] = []
    for c, j in zip(codes_a, pos_a, strict=True):
        if c >= 0:
            seg = made.get((c, j))
            if seg is None:
                if c >= len(chunks):
                    raise corrupt("inconsistent object-store segment tables")
                weak = shared[c].get(j)
                seg = None if weak is None else weak()
                if seg is None:
                    seg = StoreSegment(chunks[c], j)
                    shared[c][j] = weakref.ref(seg)
                made[(c, j)] = seg
            out.append(seg)
        elif c == -1:
            out.append(None)
        elif c == -2:
            out.append(others[j])
        else:
            raise corrupt("inconsistent object-store segment tables")
    return out


def _in_async_actor() -> bool:
    from ray._private import worker as ray_worker

    core = getattr(ray_worker.global_worker, "core_worker", None)
    return core is not None and bool(core.current_actor_is_asyncio())


def fetch(chunks: list[Chunk]) -> None:
    """Read the chunks not read yet, with one blocking ``ray.get``."""
    pending = {id(c): c for c in chunks if c.arrays is None}
    if not pending:
        return
    import ray

    todo = list(pending.values())
    for chunk, data in zip(todo, ray.get([c.ref for c in todo]), strict=True):
        chunk.fill(data)


async def ready(obj: Any) -> Any:
    """Read the chunks of every value read in place in ``obj`` (a ``PackedTensor``, or dicts,
    lists and tuples of them, nested) without blocking the event loop, and return ``obj``.

    For an async actor, whose arguments arrive with their chunks not read yet::

        async def step(self, batch):
            await mmpack.packed.ray_store.ready(batch)
            pixels = batch["pixel_values"].as_tensor()

    Elsewhere (values received by the driver, tasks, threaded actors) the chunks are read
    while the value is deserialized, and there is nothing left to read."""
    found: dict[int, Chunk] = {}
    stack = [obj]
    seen: set[int] = set()
    while stack:
        item = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, SegmentStorage):
            state = item.packed_state(in_place=True)  # the value's state surface
            for seg in state.segments if state.read_in_place else ():
                if type(seg) is StoreSegment and seg.chunk.arrays is None:
                    found[id(seg.chunk)] = seg.chunk
    if found:
        todo = list(found.values())
        payloads = await asyncio.gather(*(c.ref for c in todo))
        for chunk, data in zip(todo, payloads, strict=True):
            chunk.fill(data)  # a coroutine or thread that read it meanwhile: already filled
    return obj
