"""The put table: which segment tensors this process put into Ray's object store, in which chunk,
and which chunks it keeps alive for reuse (capped), for one Ray session.

An entry is reused only while the tensor still is what was put (see :meth:`Entry.holds` and the
``mmpack.packed.ray_store`` docs); it lives at most as long as its tensor (a weak reference).
Chunks no table holds linger for :data:`LINGER_S` seconds after their last send
(:class:`Lingering`). Mutated under :data:`LOCK`.
"""

from __future__ import annotations

import collections
import os
import sys
import threading
import time
import weakref
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

__all__ = [
    "LINGERING",
    "LINGER_S",
    "LOCK",
    "Entry",
    "Held",
    "Table",
    "cap_of",
    "current_table",
    "forget",
    "held_bytes",
    "is_driver",
    "lookup",
    "put_refs",
    "session_table",
    "set_held_bytes",
    "shrink_to_setting",
    "signature_of",
]


class _Setting:
    #: the cap on the chunks the put table holds; ``None``: half the node's object store
    held_bytes: int | None = None


def signature_of(t: torch.Tensor) -> tuple[Any, ...] | None:
    """What must not change for a put segment to be reused: where its bytes are, how they are
    laid out, and its version counter; ``None`` for a tensor without a version counter."""
    if t.is_inference():
        return None
    return (t._version, t.data_ptr(), t.dtype, tuple(t.shape), t.stride())


class Held:
    """A chunk the put table holds: its ref, its bytes, the ids of the tensors whose entries
    map to it, and how many of those entries are live."""

    __slots__ = ("entries", "key", "keys", "nbytes", "ref")

    def __init__(self, ref: Any, nbytes: int) -> None:
        self.ref = ref
        self.key: bytes = ref.binary()
        self.nbytes = nbytes
        self.keys: list[int] = []
        self.entries = 0


class Entry:
    """Where a put tensor is in the store, and what it was when put: its signature and (a weak
    reference to) its storage, so that a storage swapped in since (``t.data = ...``, which
    bumps no counter) is noticed even when the allocator gave it the same address."""

    __slots__ = ("held", "j", "signature", "storage", "wref")

    def __init__(
        self,
        held: Held,
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


class Table:
    """This process's put table for one Ray session: each put segment tensor's entry (by id;
    entries leave with their tensor), the chunks they map to in the order they were last
    sent (the least recent first), and the chunks this process read (by object id: a second
    value referencing one maps no new bytes). Mutated under ``LOCK`` (reentrant: a tensor
    freed by the garbage collector inside a locked section runs its callback there)."""

    def __init__(self, session: Any = None) -> None:
        self.session = session
        self.put: dict[int, Entry] = {}
        self.chunks: dict[bytes, Held] = {}  # insertion order = least recently sent first
        self.cap: int | None = None
        self.read: weakref.WeakValueDictionary[bytes, Any] = weakref.WeakValueDictionary()

    @property
    def held(self) -> int:
        return sum(h.nbytes for h in list(self.chunks.values()))

    def touch(self, held: Held) -> None:
        if self.chunks.get(held.key) is held:
            self.chunks[held.key] = self.chunks.pop(held.key)

    def hold(self, held: Held) -> None:
        self.chunks[held.key] = held

    def release(self, held: Held) -> None:
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
        LINGERING.keep(held.ref)

    def shrink(self, cap: int) -> None:
        """Release the least recently sent chunks until at most ``cap`` bytes are held."""
        total = self.held
        while total > cap and self.chunks:
            oldest = self.chunks[next(iter(self.chunks))]
            self.release(oldest)
            total -= oldest.nbytes

    def add(self, key: int, entry: Entry) -> None:
        old = self.put.get(key)
        if old is not None:
            self.drop_entry(key, old, linger=True)  # a stale entry of the same tensor
        self.put[key] = entry
        entry.held.keys.append(key)
        entry.held.entries += 1

    def drop_entry(self, key: int, entry: Entry, linger: bool = False) -> None:
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
                LINGERING.keep(held.ref)


class Lingering:
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
        with LOCK:
            self.items.append((time.monotonic() + LINGER_S, ref))
            self._arm()

    def prune(self) -> None:
        with LOCK:
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


#: seconds a chunk's ref outlives its last send when no table holds it (see ``Lingering``)
LINGER_S = 60.0
LOCK = threading.RLock()
_TABLE = Table()
LINGERING = Lingering()


def _session(worker: Any) -> Any:
    """What names the Ray session a process is connected to (a new ``ray.init`` after
    ``ray.shutdown`` is another one): the session's name and this connection's job."""
    node = getattr(worker, "node", None)
    return (getattr(node, "session_name", None), worker.current_job_id.binary())


def session_table() -> Table:
    """The put table of the session this process is connected to (a fresh one after a
    reconnect: refs of an old session's chunks cannot be sent into a new one)."""
    global _TABLE
    from ray._private import worker as ray_worker

    session = _session(ray_worker.global_worker)
    with LOCK:
        if _TABLE.session != session:
            _TABLE = Table(session)
        return _TABLE


def current_table() -> Table | None:
    """The put table of the session this process is connected to, if it has one already."""
    ray_module = sys.modules.get("ray")
    if ray_module is None or not ray_module.is_initialized():
        return None
    from ray._private import worker as ray_worker

    table = _TABLE
    return table if table.session == _session(ray_worker.global_worker) else None


def is_driver() -> bool:
    from ray._private import worker as ray_worker

    return bool(ray_worker.global_worker.mode == ray_worker.SCRIPT_MODE)


def cap_of(table: Table) -> int:
    """The cap on the bytes ``table`` holds (see :func:`set_held_bytes`)."""
    if _Setting.held_bytes is not None:
        return _Setting.held_bytes
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


def forget(key: int, entry: Entry, table: Table, lock: Any = LOCK) -> Any:
    # The table and the lock are bound here: tensors freed while the interpreter shuts down
    # run this after the module's globals are gone.
    def callback(_: Any) -> None:
        with lock:
            table.drop_entry(key, entry)

    return callback


def lookup(table: Table, t: torch.Tensor, signature: tuple[Any, ...] | None) -> Entry | None:
    """The entry of ``t`` if what was put is still what ``t`` holds."""
    entry = table.put.get(id(t))
    if entry is None or signature is None:
        return None
    return entry if entry.holds(t, signature) else None


def set_held_bytes(held_bytes: int | None) -> None:
    """Cap the bytes of the chunks the put table keeps alive (``None``: half of the object store
    of the driver's node)."""
    _Setting.held_bytes = held_bytes


def shrink_to_setting(*, off: bool) -> None:
    """Let go of the chunks above the cap at once (all of them when the path is ``off``)."""
    with LOCK:
        table = _TABLE
        cap = 0 if off else _Setting.held_bytes
        if cap is None:
            cap = table.cap
        if cap is not None:
            table.shrink(cap)


def put_refs() -> list[Any]:
    """The chunks this process put that the put table still holds for reuse (one
    ``ObjectRef`` each): what ``ray.experimental.get_object_locations`` can follow across
    nodes."""
    table = current_table()
    with LOCK:
        return [] if table is None else [held.ref for held in table.chunks.values()]


def held_bytes() -> int:
    """Bytes of the chunks the put table holds for reuse (``mmpack.packed.ray_store.enable``)."""
    table = current_table()
    with LOCK:
        return 0 if table is None else table.held
