"""Writing a value's segments for Ray's object store: :func:`encode_segments` puts each new
segment of at least :data:`~mmpack.packed.ray_store.inline.INLINE_BELOW` bytes as a chunk of its
own (so a value pulls only the segments it references) and writes references; smaller segments
travel in the value's own bytes (``mmpack.packed.ray_store.inline``). See
``mmpack.packed.ray_store`` for the whole path.
"""

from __future__ import annotations

import operator
import os
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from mmpack.packed.buffers import BUFFER_DTYPES, bufferable, i64_bytes, one_dtype_if_bufferable
from mmpack.packed.ray_store.chunks import CHUNK_FORMAT, STORE_FORMAT, StoreSegment
from mmpack.packed.ray_store.counters import COUNTERS
from mmpack.packed.ray_store.inline import (
    INLINE_BELOW,
    Inline,
    earlier_member,
    written_so_far,
)
from mmpack.packed.ray_store.put_table import (
    LINGERING,
    Entry,
    Table,
    is_driver,
    lookup,
    one_node,
    record,
    session_table,
    signature_of,
)
from mmpack.packed.transfer import byte_view

__all__ = ["encode_segments"]

#: Threads that run the puts of one value's new segments (one object each): a put waits on the
#: object store more than it computes.
_PUT_THREADS = 4
_NBYTES = operator.attrgetter("nbytes")


class _Putter:
    """The helper threads that run ``ray.put`` outside the serializing thread."""

    pool: ThreadPoolExecutor | None = None
    pid = -1

    @classmethod
    def put(cls, payloads: list[Any]) -> list[Any]:
        import ray

        if cls.pool is None or cls.pid != os.getpid():  # a forked child needs its own threads
            cls.pool = ThreadPoolExecutor(_PUT_THREADS, thread_name_prefix="mmpack-ray-put")
            cls.pid = os.getpid()
        if len(payloads) == 1:
            return [cls.pool.submit(ray.put, payloads[0]).result()]
        return list(cls.pool.map(ray.put, payloads))


def encode_segments(segments: list[Any]) -> tuple[Any, ...]:
    """The store-segments tuple of a value (see the module docs). On the driver, each segment of
    at least :data:`INLINE_BELOW` bytes is a reference to a chunk that holds it alone (put now
    unless the put table has it); a segment read from the store in this session is a reference
    to its chunk; every other segment travels in the value's own bytes."""
    n = len(segments)
    driver = is_driver()
    written = written_so_far()
    if (
        n
        and _all_inline(segments, driver)
        and (not written or not any(map(written.__contains__, map(id, segments))))
    ):  # the usual small-segment value, in C-level passes
        COUNTERS.inline_segments += n
        codes = np.full(n, -2, dtype="<i8").tobytes()
        pos_b = np.arange(n, dtype="<i8").tobytes()
        return (STORE_FORMAT, codes, pos_b, [], Inline(list(segments), []))
    codes_l = [-1] * n
    pos = [0] * n
    refs: list[Any] = []
    ref_slot: dict[Any, int] = {}
    packed: list[torch.Tensor] = []  # plain CPU tensors in the value's own bytes
    rest: list[Any] = []  # any other segment, pickled as it is
    fresh: list[tuple[Any, tuple[Any, ...] | None]] = []  # (segment, signature) to put
    seen: dict[int, tuple[int, int]] = {}
    reused: list[tuple[int, Entry]] = []
    passed_on = 0
    table = session_table()
    if driver:
        one_node(table)  # a node that joined since the last look lets go of grouped objects

    def slot_of(ref: Any) -> int:
        k = ref_slot.get(ref)
        if k is None:
            k = ref_slot[ref] = len(refs)
            refs.append(ref)
        return k

    # codes while walking: -3 = fresh[pos], -4 = rest[pos] (fixed up once both are known)
    for i, t in enumerate(segments):
        if t is None:
            continue
        key = id(t)
        hit = seen.get(key)
        if hit is None:
            if type(t) is StoreSegment:
                t = t.current()  # its claimed copy, once something was written into it
            if type(t) is StoreSegment:
                if t.chunk.session == table.session and _first_view(t):
                    hit = (slot_of(t.chunk.ref), t.j)
                    passed_on += 1
                elif driver and t.numel() * t.element_size() >= INLINE_BELOW:
                    # an old session's chunk (its ref is useless here, its bytes are not), or
                    # a second view of one member: another tensor, sent as such
                    hit = (-3, len(fresh))
                    fresh.append((t, None))
                else:
                    hit = (-2, len(packed))
                    packed.append(t.private())
            elif bufferable(t):
                if driver and t.nbytes >= INLINE_BELOW:
                    signature = signature_of(t)
                    entry = lookup(table, t, signature)
                    if entry is not None:
                        reused.append((id(t), entry))
                        hit = (slot_of(entry.ref), entry.j)
                    else:
                        hit = (-3, len(fresh))
                        fresh.append((t, signature))
                else:
                    member = earlier_member(written, t)
                    if member is not None:  # written by an earlier value of this pickling
                        hit = (-4, len(rest))
                        rest.append(member)
                    else:
                        hit = (-2, len(packed))
                        packed.append(t)
            else:
                hit = (-4, len(rest))
                rest.append(t)
            seen[key] = hit
        codes_l[i], pos[i] = hit
    if reused:
        with table.lock:
            for key, entry in reused:
                table.touch(key, entry)
    if fresh or rest:
        placed = [(slot_of(ref), j) for ref, j in _put(table, fresh)] if fresh else []
        m = len(packed)
        for i, c in enumerate(codes_l):
            if c == -3:
                codes_l[i], pos[i] = placed[pos[i]]
            elif c == -4:
                codes_l[i], pos[i] = -2, pos[i] + m
    COUNTERS.reused_segments += passed_on + len(reused)
    COUNTERS.inline_segments += len(packed) + len(rest)
    others: Any = Inline(packed, rest) if packed else rest
    return (STORE_FORMAT, i64_bytes(codes_l), i64_bytes(pos), refs, others)


class _Views(threading.local):
    """The store views this thread's running Ray serialization wrote as references, by (chunk,
    member); ``token`` is the id of Ray's set of the refs that serialization contains, which
    Ray replaces at the end of each one. Nothing here holds a view or that set (it holds the
    refs): the last serialization must not keep its chunks in the store. A reused id can only
    make a later view go by its bytes, never share what it should not."""

    token = -1
    views: dict[tuple[int, int], weakref.ref[StoreSegment]]


_VIEWS = _Views()


def _first_view(t: StoreSegment) -> bool:
    """Whether ``t`` is the first view of its chunk member that the running serialization
    writes. Views of one member are one tensor on the receiver (values of one object that
    shared a segment share it): two views received apart (two ``ray.get`` s of one ref, a deep
    copy) are two tensors, so the later one is sent by its bytes."""
    from ray._private import worker as ray_worker

    local = ray_worker.global_worker.get_serialization_context()._thread_local
    token = getattr(local, "object_refs", None)
    if token is None:
        token = local.object_refs = set()
    if _VIEWS.token != id(token):
        _VIEWS.token, _VIEWS.views = id(token), {}
    first = _VIEWS.views.get((id(t.chunk), t.j))
    seen = None if first is None else first()
    if seen is None:  # none yet (or a dead one: its chunk's id may be another chunk's now)
        _VIEWS.views[(id(t.chunk), t.j)] = weakref.ref(t)
        return True
    return seen is t


def _all_inline(segments: list[Any], driver: bool) -> bool:
    """Whether every segment travels in the value's own bytes: distinct plain CPU tensors of
    one dtype, each under :data:`INLINE_BELOW` bytes (any size from a worker)."""
    return (
        one_dtype_if_bufferable(segments) is not None
        and (not driver or max(map(_NBYTES, segments)) < INLINE_BELOW)
        and len(set(map(id, segments))) == len(segments)
    )


def _put(table: Table, fresh: list[tuple[Any, tuple[Any, ...] | None]]) -> list[tuple[Any, int]]:
    """Put ``fresh`` (``(segment, signature)`` each) into the store; the put table keeps what it
    can for reuse. Where each went, in order: ``(chunk ref, member)``.

    Across nodes each segment is a chunk of its own, so that a value pulls only the segments it
    references, never more than plain Ray carries. On a one-node cluster nothing is pulled (a
    value maps its chunks in place), so the segments go as one chunk: one put instead of one a
    segment, each of which costs Ray about a millisecond."""
    # the signatures were read before the bytes: a write racing the put makes the entry stale
    names, shapes, arrays = [], [], []
    for t, _ in fresh:
        if type(t) is StoreSegment:
            array, dtype, shape = t.array, t.dtype, tuple(t.shape)
        else:
            c = t.contiguous()
            array, dtype, shape = byte_view(c), c.dtype, tuple(c.shape)
        names.append(BUFFER_DTYPES[dtype])
        shapes.append(shape)
        arrays.append(array)
    if len(fresh) > 1 and one_node(table):
        (ref,) = _Putter.put([(CHUNK_FORMAT, names, shapes, arrays)])
        placed = [(ref, j) for j in range(len(fresh))]
    else:
        payloads = [
            (CHUNK_FORMAT, [n], [s], [a]) for n, s, a in zip(names, shapes, arrays, strict=True)
        ]
        placed = [(ref, 0) for ref in _Putter.put(payloads)]
    sizes = [a.nbytes for a in arrays]
    items = [
        (t, sig, ref, nb, j) for (t, sig), (ref, j), nb in zip(fresh, placed, sizes, strict=True)
    ]
    record(table, [item for item in items if type(item[0]) is not StoreSegment])
    copies = {id(item[2]): item[2] for item in items if type(item[0]) is StoreSegment}
    if copies:
        LINGERING.keep(*copies.values())  # no table holds them: see put_table.Lingering
    COUNTERS.put_objects += len({id(ref) for ref, _ in placed})
    COUNTERS.put_segments += len(fresh)
    COUNTERS.put_bytes += sum(sizes)
    return placed
