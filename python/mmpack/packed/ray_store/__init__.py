"""Packed media through Ray's object store: each unique physical segment is put once, and every
value that references it carries an ``ObjectRef``; a receiver reads the segments in place.

**Writing.** While Ray serializes an object (a task or actor argument, a return value,
``ray.put``), Ray's serialization context flags the thread as in-band; then, with the store path
on (:func:`enable`, which ``mmpack.compat.nemo_rl.install()`` calls), ``PackedTensor`` pickles its
plain CPU segments as references. Each such segment of at least ``INLINE_BELOW`` bytes (64 KiB)
that this process has not put yet goes into the store as an object of its own (a *chunk*: its
bytes as an out-of-band buffer, its dtype and shape), so a value pulls exactly the segments it
references, never more than plain Ray carries; a process-wide table maps each segment tensor
object to its chunk's ref. Smaller segments, and every segment a worker sends, travel in the
value's own bytes as plain Ray sends them (``inline``: one buffer per dtype; values pickled
together share them): as objects of their own they would cost more than their bytes.
An entry is reused only while the tensor still is what was put: the same storage
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
starts empty, and a value read in place in an old session is sent by its bytes (the driver puts
them anew, a worker sends them inline): an old session's refs mean nothing in a new one. A
chunk the table lets go of leaves the store ``LINGER_S`` after its last send, not when the
garbage collector runs.
The pickled value holds the chunk refs, so Ray counts them as nested references
of whatever object carries the value. The put runs on a helper thread: Ray's per-thread
serialization state (which refs the outer object contains) must not be reset by a nested
serialization.

**Reading.** The segments come back as :class:`StoreSegment` s: read-only byte views into the
store plus dtype and shape, holding their chunk's ref (a segment is never freed while a value
that references it lives); a chunk is read once per process while a segment of it lives.
``PackedTensor`` keeps them out of its ``tensors`` list: reading ``tensors`` (or any API that
hands out a segment) first turns them into private copies, so nothing can write into the store;
``as_tensor()`` gathers straight from the views. A view stands for one tensor, as the segment it
was sent for did: the values of one received object that shared a segment, and the slices and
shards of a value, share its private copy, made once (as plain Ray's values of one object share
their tensors); values received apart get their own. The first read of ``tensors`` is atomic
across threads. Each chunk remembers the Ray session it was read in.

**Async actors.** Ray deserializes an async actor's arguments on the thread that starts all its
calls, so there nothing is read while a value is deserialized: the coroutine awaits
:func:`ready` (``await mmpack.packed.ray_store.ready(batch)``; the event loop runs meanwhile),
or its first read pulls with a blocking ``ray.get`` (Ray warns). A value passed on without being
read is never pulled. Elsewhere (the driver, tasks, threaded actors) chunks are read while the
value is deserialized.

Outside Ray's serialization nothing here runs, and plain pickles are unchanged.
:func:`store_counters` reports what this process put into and read from the store.

**Rooms.** ``switch`` (on or off, and whether Ray's serializer is running), ``writing`` (a
value's segments written as references and inline bytes), ``inline`` (small segments in the
value's own bytes), ``chunks`` (the formats, and the segments read back as views), ``put_table``
(what this process put and keeps alive), ``counters``.
The path is an adapter over the value's state surface
(``mmpack.packed.state``): ``mmpack.packed.pickling.format`` hands it a value's segments and
takes its decoded segments back; it never sees a value. A chunk or a segment table that cannot
be read raises ``LayoutError`` ("corrupt PackedTensor pickle: ..."), as the plain format does.
"""

from __future__ import annotations

from mmpack.packed.ray_store.chunks import (
    CHUNK_FORMAT,
    STORE_FORMAT,
    StoreSegment,
    decode_segments,
    ready,
)
from mmpack.packed.ray_store.counters import StoreCounters, store_counters, store_used_bytes
from mmpack.packed.ray_store.inline import INLINE_BELOW
from mmpack.packed.ray_store.put_table import LINGER_S, held_bytes, put_refs
from mmpack.packed.ray_store.switch import (
    ENV_VAR,
    OFF_VALUES,
    enable,
    enabled,
    serializing_for_ray,
)
from mmpack.packed.ray_store.writing import encode_segments

__all__ = [
    "CHUNK_FORMAT",
    "ENV_VAR",
    "INLINE_BELOW",
    "LINGER_S",
    "OFF_VALUES",
    "STORE_FORMAT",
    "StoreCounters",
    "StoreSegment",
    "decode_segments",
    "enable",
    "enabled",
    "encode_segments",
    "held_bytes",
    "put_refs",
    "ready",
    "serializing_for_ray",
    "store_counters",
    "store_used_bytes",
]
