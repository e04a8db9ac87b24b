"""The put table: which segment tensors this process put into Ray's object store (one object
each) and which of those objects it keeps alive for reuse (capped), for one Ray session.

An entry is reused only while the tensor still is what was put (see :meth:`Entry.holds` and the
``mmpack.packed.ray_store`` docs); it lives at most as long as its tensor (a weak reference whose
callback knows only the table and the tensor's key: nothing refers back to the entry, so an
entry the table lets go of is freed at once, with its ref, not by the cyclic garbage collector).
The bytes the table holds are a running total: a put costs its own segments, never the table's
size. Objects no table holds linger for :data:`LINGER_S` seconds after their last send
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
    "Table",
    "cap_of",
    "current_table",
    "held_bytes",
    "is_driver",
    "lookup",
    "one_node",
    "put_refs",
    "record",
    "session_table",
    "set_held_bytes",
    "shrink_to_setting",
    "signature_of",
]


class _Setting:
    #: the cap on the objects the put table holds; ``None``: half the node's object store
    held_bytes: int | None = None


def signature_of(t: torch.Tensor) -> tuple[Any, ...] | None:
    """What must not change for a put segment to be reused: where its bytes are, how they are
    laid out, and its version counter; ``None`` for a tensor without a version counter."""
    if t.is_inference():
        return None
    return (t._version, t.data_ptr(), t.dtype, tuple(t.shape), t.stride())


class _TensorRef(weakref.ref[torch.Tensor]):
    """A weak reference to a put tensor that carries the tensor's key in the table: its
    callback finds the entry by key and needs no reference to it."""

    __slots__ = ("key",)
    key: int

    def __new__(cls, t: torch.Tensor, callback: Any, key: int) -> _TensorRef:
        self = super().__new__(cls, t, callback)
        self.key = key
        return self

    def __init__(self, t: torch.Tensor, callback: Any, key: int) -> None:
        super().__init__(t, callback)  # type: ignore[call-arg]


class Entry:
    """A put tensor: the ref of the object that holds its bytes, their size, and what the tensor
    was when put: its signature and (a weak reference to) its storage, so that a storage swapped
    in since (``t.data = ...``, which bumps no counter) is noticed even when the allocator gave
    it the same address."""

    __slots__ = ("j", "nbytes", "ref", "signature", "storage", "wref")

    def __init__(
        self,
        ref: Any,
        nbytes: int,
        signature: tuple[Any, ...],
        storage: StorageWeakRef,
        wref: weakref.ref[torch.Tensor],
        j: int = 0,
    ) -> None:
        self.ref = ref
        #: the tensor's member in the chunk
        self.j = j
        self.nbytes = nbytes
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
    entries leave with their tensor) in the order they were last sent (the least recent first),
    the bytes of their objects (a running total), and the chunks this process read (by object
    id: a second value referencing one maps no new bytes). Mutated under ``LOCK`` (reentrant: a
    tensor freed by the garbage collector inside a locked section runs its callback there)."""

    def __init__(self, session: Any = None, lock: Any = None) -> None:
        self.session = session
        self.put: dict[int, Entry] = {}  # insertion order = least recently sent first
        self.held = 0
        self.cap: int | None = None
        # whether the cluster has one node, and when that was asked (`one_node`)
        self.one_node = True
        self.nodes_checked = -float("inf")
        self.read: weakref.WeakValueDictionary[bytes, Any] = weakref.WeakValueDictionary()
        # bound here, with the lock: tensors freed while the interpreter shuts down run the
        # callback after the module's globals are gone
        self.lock = LOCK if lock is None else lock
        self.on_dead = self._dead

    def _dead(self, wref: _TensorRef) -> None:
        """A put tensor died: nothing can be sending it, so its object goes at once."""
        with self.lock:
            entry = self.put.get(wref.key)
            if entry is not None and entry.wref is wref:
                del self.put[wref.key]
                self.held -= entry.nbytes

    def touch(self, key: int, entry: Entry) -> None:
        if self.put.get(key) is entry:
            self.put[key] = self.put.pop(key)

    def release(self, key: int, entry: Entry) -> None:
        """Stop holding ``entry`` (a stale one, or over the cap): its tensor is put again if
        sent. Its ref lingers a while: a value being sent may reference the object, and Ray
        counts that reference only once the task that carries the value is submitted."""
        if self.put.get(key) is not entry:
            return
        del self.put[key]
        self.held -= entry.nbytes
        LINGERING.keep(entry.ref)

    def shrink(self, cap: int) -> None:
        """Release the least recently sent objects until at most ``cap`` bytes are held."""
        put = self.put
        while self.held > cap and put:
            key = next(iter(put))
            self.release(key, put[key])

    def clear(self) -> None:
        """Let go of everything (a table of a session this process left)."""
        self.put = {}
        self.held = 0


class Lingering:
    """Refs of objects no table holds, kept for ``LINGER_S`` seconds after their last send.

    An object's ref in a pickled value is counted by Ray as the outer object's (``ray.put``) or
    the task's (an argument) only after the pickling ends: a task argument small enough to
    travel inline (its pickle holds only the refs) is registered after the state that held
    the ref is gone, so an object nothing else holds would be freed before the task reads it."""

    def __init__(self) -> None:
        self.items: collections.deque[tuple[float, Any]] = collections.deque()
        self.timer: threading.Timer | None = None
        self.pid = os.getpid()

    def keep(self, *refs: Any) -> None:
        with LOCK:
            deadline = time.monotonic() + LINGER_S
            self.items.extend((deadline, ref) for ref in refs)
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


#: seconds an object's ref outlives its last send when no table holds it (see ``Lingering``)
LINGER_S = 60.0
LOCK = threading.RLock()
_TABLE = Table()
LINGERING = Lingering()


def _new_lock_in_child() -> None:
    # A fork while another thread held the lock (a put, the linger timer) would leave it held
    # forever in the child: the first tensor of the table to die there would hang.
    global LOCK
    LOCK = threading.RLock()
    _TABLE.lock = LOCK


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_lock_in_child)


def _session(worker: Any) -> Any:
    """What names the Ray session a process is connected to (a new ``ray.init`` after
    ``ray.shutdown`` is another one): the session's name and this connection's job."""
    node = getattr(worker, "node", None)
    return (getattr(node, "session_name", None), worker.current_job_id.binary())


def session_table() -> Table:
    """The put table of the session this process is connected to (a fresh one after a
    reconnect: refs of an old session's objects cannot be sent into a new one)."""
    global _TABLE
    from ray._private import worker as ray_worker

    session = _session(ray_worker.global_worker)
    with LOCK:
        if _TABLE.session != session:
            _TABLE.clear()  # the old session's refs are useless: let them go now
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


def lookup(table: Table, t: torch.Tensor, signature: tuple[Any, ...] | None) -> Entry | None:
    """The entry of ``t`` if what was put is still what ``t`` holds."""
    entry = table.put.get(id(t))
    if entry is None or signature is None:
        return None
    return entry if entry.holds(t, signature) else None


def record(
    table: Table, puts: list[tuple[torch.Tensor, tuple[Any, ...] | None, Any, int, int]]
) -> None:
    """Enter the tensors just put, ``(tensor, signature, chunk ref, nbytes, member)`` each, into
    ``table``:
    each is held for reuse if it has a version counter and its object fits under the cap (the
    least recently sent objects go to make room); every other ref lingers."""
    cap = cap_of(table) if any(item[1] is not None for item in puts) else 0
    lingering = []
    with table.lock:
        for t, signature, ref, nbytes, j in puts:
            key = id(t)
            old = table.put.get(key)
            if old is not None:  # an entry of this tensor from an earlier put is stale
                table.release(key, old)
            if signature is None or nbytes > cap:  # nothing tells a later send it is unchanged
                lingering.append(ref)
                continue
            wref = _TensorRef(t, table.on_dead, key)
            table.put[key] = Entry(
                ref, nbytes, signature, StorageWeakRef(t.untyped_storage()), wref, j
            )
            table.held += nbytes
        table.shrink(cap)
    if lingering:
        LINGERING.keep(*lingering)


#: seconds a cluster's node count is trusted before it is asked again (nodes come and go)
NODES_TTL_S = 10.0


def one_node(table: Table) -> bool:
    """Whether the cluster of ``table``'s session has one node alive (asked at most every
    :data:`NODES_TTL_S` seconds): nothing is pulled between object stores then."""
    now = time.monotonic()
    if now - table.nodes_checked > NODES_TTL_S:
        import ray

        was = table.one_node
        table.one_node = sum(1 for n in ray.nodes() if n.get("Alive")) <= 1
        table.nodes_checked = now
        if was and not table.one_node:
            # a node joined: objects that hold several segments would be pulled whole by a
            # value that needs one of them, so their segments are put again, one object each
            with table.lock:
                table.shrink(0)
    return table.one_node


def set_held_bytes(held_bytes: int | None) -> None:
    """Cap the bytes of the objects the put table keeps alive (``None``: half of the object
    store of the driver's node)."""
    _Setting.held_bytes = held_bytes


def shrink_to_setting(*, off: bool) -> None:
    """Let go of the objects above the cap at once (all of them when the path is ``off``)."""
    with LOCK:
        table = _TABLE
        cap = 0 if off else _Setting.held_bytes
        if cap is None:
            cap = table.cap
        if cap is not None:
            table.shrink(cap)


def put_refs() -> list[Any]:
    """The objects this process put that the put table still holds for reuse (one
    ``ObjectRef`` each): what ``ray.experimental.get_object_locations`` can follow across
    nodes."""
    table = current_table()
    with LOCK:
        return [] if table is None else [entry.ref for entry in table.put.values()]


def held_bytes() -> int:
    """Bytes of the objects the put table holds for reuse (``mmpack.packed.ray_store.enable``)."""
    table = current_table()
    with LOCK:
        return 0 if table is None else table.held
