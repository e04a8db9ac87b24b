"""Packed media through Ray's object store: each unique physical segment is put once, and every
value that references it carries an ``ObjectRef``; a receiver reads the segments in place.

**Writing.** While Ray serializes an object (a task or actor argument, a return value,
``ray.put``), Ray's serialization context flags the thread as in-band; then, with the store path
on (:func:`enable`, which ``mmpack.compat.nemo_rl.install()`` calls), ``PackedTensor`` pickles its
plain CPU segments as references. Segments this process has not put yet go into the store as
one object per pickled value (a *chunk*: the segments' bytes as out-of-band buffers, their
dtypes and shapes); a process-wide table maps each segment tensor object to ``(chunk ref,
member)``. An entry is reused only while the tensor still is what was put: the same storage
(the same storage object, so ``t.data = ...`` is seen even at a reused address), the same
address, shape, strides and dtype, and the same autograd version counter, which every in-place
torch write bumps (on the tensor, its base or any view of it). Provenance ids never stand in for
the bytes: two values may share one while their tensors differ. Writes that bump no counter of
the tensor cannot be seen: through the tensor ``.data`` returns (it has a counter of its own),
through another tensor ``set_`` onto the same storage, into ``untyped_storage()``, through
DLPack or a ``.numpy()`` view; make them before the first send, or send a new tensor. Tensors
without a version counter (made under ``torch.inference_mode``) are put each time they are sent.

Only the driver puts chunks (the process that called ``ray.init``): an object belongs to the
process that put it and is lost when that process exits, so a chunk put by a worker would be
lost with the worker while the value it returned lives on. A worker sends its own new segments
inline, as plain Ray would, and passes on references to chunks it received.

An entry lives at most as long as the segment tensor it was made for (a weak reference). While
it lives, the table holds its chunk's ref, so a tensor sent again (by the next shard) reuses the
chunk; the chunks the table holds are capped at :func:`enable`'s ``held_bytes`` (half the
driver's node's object store by default), the least recently sent first to go (a value that
references a dropped chunk keeps it alive; a later send puts the segments again). A chunk the
table lets go, or never held (over the cap, tensors without a version counter), keeps one ref
for ``LINGER_S`` seconds after its last send: Ray counts a reference inside a small inline task
argument only once the task is submitted, after the pickled state that held it is gone. Once
the values that reference a chunk are gone and no ref is left, Ray frees it.
The table belongs to one Ray session: after ``ray.shutdown()`` and a new ``ray.init()`` it
starts empty. The pickled value holds the chunk refs, so Ray counts them as nested references
of whatever object carries the value. The put runs on a helper thread: Ray's per-thread
serialization state (which refs the outer object contains) must not be reset by a nested
serialization.

**Reading.** The segments come back as :class:`StoreSegment` s: read-only byte views into the
store plus dtype and shape, holding their chunk's ref (a segment is never freed while a value
that references it lives). ``PackedTensor`` keeps them out of its ``tensors`` list: reading
``tensors`` (or any API that hands out a segment) first turns them into private copies, so
nothing can write into the store; ``as_tensor()`` gathers straight from the views.

Outside Ray's serialization nothing here runs, and plain pickles are unchanged.
:func:`store_counters` reports what this process put into and read from the store.
"""

from __future__ import annotations

import collections
import dataclasses
import operator
import os
import sys
import threading
import time
import types
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from mmpack.packed.pickle_operation import BUFFER_DTYPES, bufferable, i64_bytes
from mmpack.packed.transfer import byte_view

__all__ = [
    "CHUNK_FORMAT",
    "STORE_FORMAT",
    "StoreCounters",
    "StoreSegment",
    "decode_segments",
    "enable",
    "enabled",
    "encode_segments",
    "held_bytes",
    "private_copies",
    "put_refs",
    "serializing_for_ray",
    "store_counters",
    "store_used_bytes",
]

#: The segments tuple of a value pickled for Ray: ``(STORE_FORMAT, codes, pos, refs, others)``,
#: ``codes[i] == k >= 0`` meaning member ``pos[i]`` of chunk ``refs[k]``.
STORE_FORMAT = "mmpack.store-segments/1"
#: What one ``ray.put`` holds: ``(CHUNK_FORMAT, dtype names, shapes, byte arrays)``.
CHUNK_FORMAT = "mmpack.store-chunk/1"
#: The environment variable that turns the store path on at import (also read by the startup
#: hook, ``mmpack._startup``).
ENV_VAR = "MMPACK_INSTALL"
#: Values of :data:`ENV_VAR` that leave it off (after ``strip().lower()``; the hook's one line
#: in ``mmpack_startup.pth`` spells the same set).
OFF_VALUES = ("", "0", "false", "no", "off")
_DTYPES = {name: dtype for dtype, name in BUFFER_DTYPES.items()}


def _env_on() -> bool:
    return os.environ.get(ENV_VAR, "").strip().lower() not in OFF_VALUES


class _State:
    on = _env_on()
    #: the cap on the chunks the put table holds; ``None``: half the node's object store
    held_bytes: int | None = None


_UNCHANGED: Any = object()


def enable(on: bool = True, *, held_bytes: int | None = _UNCHANGED) -> None:
    """Turn the store path on (or off) in this process. ``held_bytes`` caps the bytes of the
    chunks the put table keeps alive for reuse (``None``: half of the object store of the
    driver's node, the default; not given: unchanged). A lower cap, or turning the path off,
    lets go of the chunks above it at once."""
    if not isinstance(on, (bool, np.bool_)):
        raise TypeError(f"enable(on=...) takes a bool, got {on!r}")
    if held_bytes is not _UNCHANGED:
        if held_bytes is not None:
            if isinstance(held_bytes, (bool, np.bool_)):
                raise TypeError(f"held_bytes must be an int or None, got {held_bytes!r}")
            try:
                held_bytes = operator.index(held_bytes)
            except TypeError:
                raise TypeError(f"held_bytes must be an int or None, got {held_bytes!r}") from None
            if held_bytes < 0:
                raise ValueError(f"held_bytes must not be negative, got {held_bytes}")
        _State.held_bytes = held_bytes
    _State.on = bool(on)
    with _LOCK:
        table = _TABLE
        cap = 0 if not _State.on else _State.held_bytes
        if cap is None:
            cap = table.cap
        if cap is not None:
            table.shrink(cap)


def enabled() -> bool:
    """Whether values pickled by Ray's serializer in this process put their segments once."""
    return _State.on


def serializing_for_ray() -> bool:
    """Whether the running pickling operation is Ray's serialization (and the path is on)."""
    if not _State.on:
        return False
    worker_module = sys.modules.get("ray._private.worker")
    if worker_module is None:
        return False
    # Ray flags the serializing thread on its job's serialization context; looking the
    # context up by job id costs microseconds a value, and there is one context a job.
    contexts = getattr(worker_module.global_worker, "serialization_context_map", None)
    if not contexts:
        return False
    if not any(ctx.is_in_band_serialization() for ctx in list(contexts.values())):
        return False
    # The flag is per thread: a plain ``pickle.dumps`` that user code runs while Ray pickles
    # (a ``__reduce__`` that nests a pickle) sees it too, and references inside those bytes
    # would never resolve. Ray's pickler calls the reducer straight from its ``dump``; a nested
    # pickle is called from the user's frame. So the first frame outside mmpack must be Ray's.
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__", "").startswith("mmpack."):
        frame = frame.f_back
    return frame is not None and frame.f_globals.get("__name__", "").startswith("ray.")


# ---------------------------------------------------------------------------------------------
# counters


@dataclasses.dataclass
class StoreCounters:
    """What this process wrote into and read from Ray's object store for packed media, since
    it started (or the last ``reset``)."""

    put_objects: int = 0
    put_bytes: int = 0
    put_segments: int = 0
    #: segments pickled as a reference to a chunk put earlier (by this process or another)
    reused_segments: int = 0
    get_objects: int = 0
    get_bytes: int = 0

    def reset(self) -> None:
        for field in dataclasses.fields(self):
            setattr(self, field.name, 0)

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


_COUNTERS = StoreCounters()


def store_counters() -> StoreCounters:
    """This process's object-store counters (a live object; ``reset()`` zeroes them)."""
    return _COUNTERS


def store_used_bytes() -> float:
    """Bytes in use in the object stores of the running Ray cluster (Ray reports them as the
    unavailable part of the ``object_store_memory`` resource, refreshed on each raylet's
    heartbeat): a run's store memory before and after, to see it return to its baseline."""
    import ray

    total = ray.cluster_resources().get("object_store_memory", 0.0)
    return float(total - ray.available_resources().get("object_store_memory", 0.0))


def put_refs() -> list[Any]:
    """The chunks this process put that the put table still holds for reuse (one
    ``ObjectRef`` each): what ``ray.experimental.get_object_locations`` can follow across
    nodes."""
    table = _current_table()
    with _LOCK:
        return [] if table is None else [held.ref for held in table.chunks.values()]


def held_bytes() -> int:
    """Bytes of the chunks the put table holds for reuse (see :func:`enable`)."""
    table = _current_table()
    with _LOCK:
        return 0 if table is None else table.held


# ---------------------------------------------------------------------------------------------
# what the receiver holds


class _Chunk:
    """One fetched chunk: read-only byte views into the store, and the ref that keeps it."""

    __slots__ = ("__weakref__", "arrays", "dtypes", "ref", "shapes")

    def __init__(self, ref: Any, payload: Any) -> None:
        fmt, names, shapes, arrays = payload
        if fmt != CHUNK_FORMAT or not len(names) == len(shapes) == len(arrays):
            raise ValueError(f"unknown or inconsistent store chunk {fmt!r}")
        self.ref = ref
        self.dtypes = [_DTYPES[name] for name in names]
        self.shapes = [tuple(int(d) for d in s) for s in shapes]
        self.arrays = arrays


class StoreSegment:
    """A physical segment read in place from Ray's object store: a read-only byte view, its
    dtype and shape. It holds its chunk (and so the chunk's ``ObjectRef``) alive."""

    # Plain slots, not properties: a micro-batch's gather reads them for every segment.
    __slots__ = ("array", "chunk", "dtype", "j", "shape")
    #: what ``mmpack.packed.transfer`` recognises a store view by
    read_in_place = True

    def __init__(self, chunk: _Chunk, j: int) -> None:
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


def private_copies(segments: list[Any]) -> list[Any]:
    """``segments`` with every :class:`StoreSegment` replaced by a private copy (a segment
    listed twice is copied once, and both slots get the same tensor)."""
    copies: dict[int, torch.Tensor] = {}
    out: list[Any] = []
    for s in segments:
        if isinstance(s, StoreSegment):
            c = copies.get(id(s))
            if c is None:
                c = copies[id(s)] = s.private()
            out.append(c)
        else:
            out.append(s)
    return out


# ---------------------------------------------------------------------------------------------
# writing


def _signature(t: torch.Tensor) -> tuple[Any, ...] | None:
    """What must not change for a put segment to be reused: where its bytes are, how they are
    laid out, and its version counter; ``None`` for a tensor without a version counter."""
    if t.is_inference():
        return None
    return (t._version, t.data_ptr(), t.dtype, tuple(t.shape), t.stride())


class _Held:
    """A chunk the put table holds: its ref, its bytes, the ids of the tensors whose entries
    map to it, and how many of those entries are live."""

    __slots__ = ("entries", "key", "keys", "nbytes", "ref")

    def __init__(self, ref: Any, nbytes: int) -> None:
        self.ref = ref
        self.key: bytes = ref.binary()
        self.nbytes = nbytes
        self.keys: list[int] = []
        self.entries = 0


class _Entry:
    """Where a put tensor is in the store, and what it was when put: its signature and (a weak
    reference to) its storage, so that a storage swapped in since (``t.data = ...``, which
    bumps no counter) is noticed even when the allocator gave it the same address."""

    __slots__ = ("held", "j", "signature", "storage", "wref")

    def __init__(
        self,
        held: _Held,
        j: int,
        signature: tuple[Any, ...],
        storage: StorageWeakRef,
        wref: weakref.ref[torch.Tensor],
    ) -> None:
        self.held = held
        self.j = j
        self.signature = signature
        self.storage = storage
        self.wref = wref

    def holds(self, t: torch.Tensor, signature: tuple[Any, ...]) -> bool:
        return (
            self.wref() is t
            and self.signature == signature
            and not self.storage.expired()
            and self.storage.cdata == t.untyped_storage()._cdata
        )


class _Table:
    """This process's put table for one Ray session: each put segment tensor's entry (by id;
    entries leave with their tensor), the chunks they map to in the order they were last
    sent (the least recent first), and the chunks this process read (by object id: a second
    value referencing one maps no new bytes). Mutated under ``_LOCK`` (reentrant: a tensor
    freed by the garbage collector inside a locked section runs its callback there)."""

    def __init__(self, session: Any = None) -> None:
        self.session = session
        self.put: dict[int, _Entry] = {}
        self.chunks: dict[bytes, _Held] = {}  # insertion order = least recently sent first
        self.cap: int | None = None
        self.read: weakref.WeakValueDictionary[bytes, _Chunk] = weakref.WeakValueDictionary()

    @property
    def held(self) -> int:
        return sum(h.nbytes for h in list(self.chunks.values()))

    def touch(self, held: _Held) -> None:
        if self.chunks.get(held.key) is held:
            self.chunks[held.key] = self.chunks.pop(held.key)

    def hold(self, held: _Held) -> None:
        self.chunks[held.key] = held

    def release(self, held: _Held) -> None:
        """Stop holding ``held``: its entries go, so its segments are put again if sent. Its
        ref lingers a while: a value being sent may reference the chunk, and Ray counts that
        reference only once the task that carries the value is submitted."""
        if self.chunks.pop(held.key, None) is None:
            return
        for key in held.keys:
            entry = self.put.get(key)
            if entry is not None and entry.held is held:
                del self.put[key]
        held.entries = 0
        _LINGERING.keep(held.ref)

    def shrink(self, cap: int) -> None:
        """Release the least recently sent chunks until at most ``cap`` bytes are held."""
        total = self.held
        while total > cap and self.chunks:
            oldest = self.chunks[next(iter(self.chunks))]
            self.release(oldest)
            total -= oldest.nbytes

    def add(self, key: int, entry: _Entry) -> None:
        old = self.put.get(key)
        if old is not None:
            self.drop_entry(key, old, linger=True)  # a stale entry of the same tensor
        self.put[key] = entry
        entry.held.keys.append(key)
        entry.held.entries += 1

    def drop_entry(self, key: int, entry: _Entry, linger: bool = False) -> None:
        """Drop ``entry``: its tensor died (nothing can be sending it, so a chunk left without
        entries goes at once) or went stale (``linger``: another thread may be sending it)."""
        if self.put.get(key) is not entry:
            return
        del self.put[key]
        held = entry.held
        held.entries -= 1
        if held.entries <= 0 and self.chunks.get(held.key) is held:
            del self.chunks[held.key]
            if linger:
                _LINGERING.keep(held.ref)


class _Lingering:
    """Refs of chunks no table holds, kept for ``LINGER_S`` seconds after their last send.

    A chunk's ref in a pickled value is counted by Ray as the outer object's (``ray.put``) or
    the task's (an argument) only after the pickling ends: a task argument small enough to
    travel inline (its pickle holds only the refs) is registered after the state that held
    the ref is gone, so a chunk nothing else holds would be freed before the task reads it."""

    def __init__(self) -> None:
        self.items: collections.deque[tuple[float, Any]] = collections.deque()
        self.timer: threading.Timer | None = None
        self.pid = os.getpid()

    def keep(self, ref: Any) -> None:
        with _LOCK:
            self.items.append((time.monotonic() + LINGER_S, ref))
            self._arm()

    def prune(self) -> None:
        with _LOCK:
            now = time.monotonic()
            while self.items and self.items[0][0] <= now:
                self.items.popleft()
            self.timer = None
            self._arm()

    def _arm(self) -> None:
        if self.pid != os.getpid():  # a forked child: the parent's timer thread is not here
            self.pid, self.timer = os.getpid(), None
        if self.items and self.timer is None:
            self.timer = threading.Timer(max(0.0, self.items[0][0] - time.monotonic()), self.prune)
            self.timer.daemon = True
            self.timer.start()


#: seconds a chunk's ref outlives its last send when no table holds it (see ``_Lingering``)
LINGER_S = 60.0
_LOCK = threading.RLock()
_TABLE = _Table()
_LINGERING = _Lingering()


def _session(worker: Any) -> Any:
    """What names the Ray session a process is connected to (a new ``ray.init`` after
    ``ray.shutdown`` is another one): the session's name and this connection's job."""
    node = getattr(worker, "node", None)
    return (getattr(node, "session_name", None), worker.current_job_id.binary())


def _table() -> _Table:
    """The put table of the session this process is connected to (a fresh one after a
    reconnect: refs of an old session's chunks cannot be sent into a new one)."""
    global _TABLE
    from ray._private import worker as ray_worker

    session = _session(ray_worker.global_worker)
    with _LOCK:
        if _TABLE.session != session:
            _TABLE = _Table(session)
        return _TABLE


def _current_table() -> _Table | None:
    """The put table of the session this process is connected to, if it has one already."""
    ray_module = sys.modules.get("ray")
    if ray_module is None or not ray_module.is_initialized():
        return None
    from ray._private import worker as ray_worker

    table = _TABLE
    return table if table.session == _session(ray_worker.global_worker) else None


def _is_driver() -> bool:
    from ray._private import worker as ray_worker

    return bool(ray_worker.global_worker.mode == ray_worker.SCRIPT_MODE)


def _cap(table: _Table) -> int:
    if _State.held_bytes is not None:
        return _State.held_bytes
    if table.cap is None:
        import ray

        node_id = ray.get_runtime_context().get_node_id()
        store = next(
            (
                n.get("Resources", {}).get("object_store_memory", 0.0)
                for n in ray.nodes()
                if n.get("NodeID") == node_id
            ),
            0.0,
        )
        table.cap = int(store // 2)
    return table.cap


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


def _forget(key: int, entry: _Entry, table: _Table, lock: Any = _LOCK) -> Any:
    # The table and the lock are bound here: tensors freed while the interpreter shuts down
    # run this after the module's globals are gone.
    def callback(_: Any) -> None:
        with lock:
            table.drop_entry(key, entry)

    return callback


def _lookup(table: _Table, t: torch.Tensor, signature: tuple[Any, ...] | None) -> _Entry | None:
    """The entry of ``t`` if what was put is still what ``t`` holds."""
    entry = table.put.get(id(t))
    if entry is None or signature is None:
        return None
    return entry if entry.holds(t, signature) else None


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
    table = _table()
    driver = _is_driver()
    touched: dict[int, _Held] = {}  # the held chunks this value reuses

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
            signature = _signature(t)
            entry = _lookup(table, t, signature)
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
        with _LOCK:
            for held in touched.values():
                table.touch(held)
    if fresh:
        ref = _put_chunk(table, fresh)
        k = slot_of(ref)
        for i, t in enumerate(segments):
            if codes[i] == -3:
                assert t is not None
                codes[i], pos[i] = k, fresh_at[id(t)]
    _COUNTERS.reused_segments += reused
    return (STORE_FORMAT, i64_bytes(codes), i64_bytes(pos), refs, others)


def _put_chunk(table: _Table, fresh: list[tuple[torch.Tensor, tuple[Any, ...] | None]]) -> Any:
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
    cap = _cap(table) if kept else 0
    with _LOCK:
        for _, t, _sig in kept:  # entries of these tensors from an earlier put are stale
            old = table.put.get(id(t))
            if old is not None:
                table.drop_entry(id(t), old, linger=True)
        if kept and nbytes <= cap:
            held = _Held(ref, nbytes)
            table.hold(held)
            for j, t, signature in kept:
                storage = StorageWeakRef(t.untyped_storage())
                entry = _Entry(held, j, signature, storage, weakref.ref(t))
                entry.wref = weakref.ref(t, _forget(id(t), entry, table))
                table.add(id(t), entry)
            table.shrink(cap)
        else:
            _LINGERING.keep(ref)  # no table holds it: see _Lingering
    _COUNTERS.put_objects += 1
    _COUNTERS.put_segments += len(fresh)
    _COUNTERS.put_bytes += nbytes
    return ref


# ---------------------------------------------------------------------------------------------
# reading


def decode_segments(payload: Any) -> list[Any]:
    """The physical segment list of a store-segments tuple: :class:`StoreSegment` s (one per
    referenced member), ``None`` and the inline ``others``."""
    import ray

    fmt, codes, pos, refs, others = payload
    if fmt != STORE_FORMAT:
        raise ValueError(f"unknown PackedTensor store format {fmt!r}")
    codes_a = np.frombuffer(codes, dtype="<i8").tolist()
    pos_a = np.frombuffer(pos, dtype="<i8").tolist()
    if len(codes_a) != len(pos_a):
        raise ValueError("inconsistent segment tables")
    read = _table().read
    chunks: list[_Chunk | None] = [None] * len(refs)
    missing = []
    for k, ref in enumerate(refs):
        chunk = read.get(ref.binary())
        if chunk is None:
            missing.append(k)
        chunks[k] = chunk
    if missing:
        fetched = ray.get([refs[k] for k in missing])
        for k, data in zip(missing, fetched, strict=True):
            chunk = _Chunk(refs[k], data)
            read[refs[k].binary()] = chunk
            chunks[k] = chunk
            _COUNTERS.get_objects += 1
            _COUNTERS.get_bytes += sum(a.nbytes for a in chunk.arrays)
    made: dict[tuple[int, int], StoreSegment] = {}
    out: list[Any] = []
    for c, j in zip(codes_a, pos_a, strict=True):
        if c >= 0:
            seg = made.get((c, j))
            if seg is None:
                chunk = chunks[c]
                assert chunk is not None
                if not 0 <= j < len(chunk.arrays):
                    raise ValueError("a segment references a member its chunk does not have")
                seg = made[(c, j)] = StoreSegment(chunk, j)
            out.append(seg)
        elif c == -1:
            out.append(None)
        elif c == -2:
            out.append(others[j])
        else:
            raise ValueError("inconsistent segment tables")
    return out
