"""Values read in place from a real Ray object store by code that runs several things at once:
plain threads, a threaded actor (``max_concurrency > 1``), an async actor and its helper
threads. The first read of ``tensors`` is atomic (every thread's in-place write lands in the one
list the value keeps), an async actor's argument deserialization never pulls a chunk (the
coroutine awaits ``ready`` instead), values received together share their segments as plain
Ray's values do, and each chunk read remembers its Ray session."""

from __future__ import annotations

import asyncio
import copy
import itertools
import threading
from typing import Any

import pytest
import ray
import torch
from mmpack.packed import PackedTensor, ray_store
from mmpack.packed.ray_store import put_table

pytestmark = pytest.mark.usefixtures("ray_store_on")

THREADS = 4
VALUES = 24
NUMEL = 32_768  # 128 KiB a segment: a first read copies long enough for threads to meet in it


def fresh_values() -> list[PackedTensor]:
    """VALUES values of THREADS zero segments each, new tensors (so the driver puts them)."""
    return [PackedTensor([torch.zeros(NUMEL) for _ in range(THREADS)], 0) for _ in range(VALUES)]


def edit_all(values: list[PackedTensor], k: int, barrier: threading.Barrier) -> None:
    """What thread ``k`` does: once all threads are there, write ``k + 1`` into segment ``k``
    of every value through ``tensors`` (the first read of each value races with the others)."""
    barrier.wait(timeout=60)
    for value in values:
        value.tensors[k].fill_(k + 1)


def seen(values: list[PackedTensor]) -> list[list[float]]:
    return [[float(t[0]) for t in v.tensors] for v in values]


EXPECTED = [[float(k + 1) for k in range(THREADS)]] * VALUES


def chunks_of(values: list[PackedTensor]) -> int:
    """How many chunks the store views of ``values`` reference."""
    views = [s for v in values for s in v.__dict__.get("_store", ())]
    return len({id(s.chunk) for s in views if isinstance(s, ray_store.StoreSegment)})


def test_threads_reading_tensors_first_all_write_into_the_one_list() -> None:
    for _ in range(3):
        values = ray.get(ray.put(fresh_values()))
        assert all("_store" in v.__dict__ for v in values)  # read in place, not read yet
        barrier = threading.Barrier(THREADS)
        threads = [
            threading.Thread(target=edit_all, args=(values, k, barrier)) for k in range(THREADS)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert seen(values) == EXPECTED


@ray.remote(max_concurrency=THREADS)
class ThreadedEditor:
    """A threaded actor: THREADS calls run at once, each on its own thread."""

    def __init__(self) -> None:
        self.values: list[PackedTensor] = []
        self.barrier = threading.Barrier(THREADS)

    def keep(self, values: list[PackedTensor]) -> bool:
        self.values = values
        return all("_store" in v.__dict__ for v in values)

    def edit(self, k: int) -> int:
        edit_all(self.values, k, self.barrier)
        return threading.get_ident()

    def seen(self) -> list[list[float]]:
        return seen(self.values)


@ray.remote
class AsyncEditor:
    """An async actor whose coroutine hands the edits to helper threads (a prefetch thread,
    ``asyncio.to_thread``)."""

    async def keep(self, values: list[PackedTensor]) -> bool:
        self.values = values
        return all("_store" in v.__dict__ for v in values)

    async def edit(self) -> None:
        barrier = threading.Barrier(THREADS)
        await asyncio.gather(
            *(asyncio.to_thread(edit_all, self.values, k, barrier) for k in range(THREADS))
        )

    async def seen(self) -> list[list[float]]:
        return seen(self.values)


def test_a_threaded_actor_keeps_every_threads_write() -> None:
    actor = ThreadedEditor.remote()  # type: ignore[attr-defined]
    try:
        assert ray.get(actor.keep.remote(fresh_values()), timeout=120)
        idents = ray.get([actor.edit.remote(k) for k in range(THREADS)], timeout=120)
        assert len(set(idents)) == THREADS  # the barrier let them through together
        assert ray.get(actor.seen.remote(), timeout=60) == EXPECTED
    finally:
        ray.kill(actor)


def test_an_async_actor_and_its_threads_keep_every_write() -> None:
    actor = AsyncEditor.remote()  # type: ignore[attr-defined]
    try:
        assert ray.get(actor.keep.remote(fresh_values()), timeout=120)
        ray.get(actor.edit.remote(), timeout=120)
        assert ray.get(actor.seen.remote(), timeout=60) == EXPECTED
    finally:
        ray.kill(actor)


# ---------------------------------------------------------------------------------------------
# an async actor's event loop never waits for a chunk


@ray.remote
def total(value: PackedTensor) -> float:
    out = value.as_tensor()
    return 0.0 if out is None else float(out.sum())


@ray.remote
def gathered(value: PackedTensor) -> torch.Tensor | None:
    return value.as_tensor()


@ray.remote
class AsyncReader:
    """Reports the object-store reads (``get_objects``) of this process around each step."""

    async def gets(self) -> int:
        return ray_store.store_counters().get_objects

    async def ready_then_read(self, value: PackedTensor) -> dict[str, Any]:
        counters = ray_store.store_counters()
        out: dict[str, Any] = {"at_entry": counters.get_objects}
        out["in_place"] = "_store" in value.__dict__
        out["chunks"] = chunks_of([value])
        same, _ = await asyncio.gather(ray_store.ready(value), ray_store.ready(value))  # read once
        out["returns_its_argument"] = same is value
        out["after_ready"] = counters.get_objects
        await ray_store.ready([{"again": value}])  # nothing left to read
        out["after_second_ready"] = counters.get_objects
        out["values"] = value.as_tensor()
        out["after_read"] = counters.get_objects
        return out

    async def read(self, value: PackedTensor) -> dict[str, Any]:
        counters = ray_store.store_counters()
        out: dict[str, Any] = {"at_entry": counters.get_objects}
        out["values"] = value.as_tensor()  # no ready: the first read pulls (blocking)
        out["after_read"] = counters.get_objects
        out["private"] = value.tensors[0].clone()
        return out

    async def relay(self, value: PackedTensor) -> dict[str, Any]:
        ray_store.enable(True)  # this worker sends by reference too
        counters = ray_store.store_counters()
        at_entry = counters.get_objects
        summed = await total.remote(value)  # passed on by reference, never read here
        return {"at_entry": at_entry, "total": summed, "after": counters.get_objects}


@ray.remote(max_concurrency=2)
class ThreadedReader:
    def gets(self) -> int:
        return ray_store.store_counters().get_objects

    def take(self, value: PackedTensor) -> int:
        return ray_store.store_counters().get_objects


def test_an_async_actor_deserializes_without_pulling_and_awaits_ready() -> None:
    t = torch.arange(3 * 1024 * 1024, dtype=torch.float32).reshape(-1, 1024)  # 12 MiB
    value = PackedTensor([t, t[:100]], 0)  # two segments, two chunks
    want = value.as_tensor()
    reader = AsyncReader.remote()  # type: ignore[attr-defined]
    try:
        base = ray.get(reader.gets.remote(), timeout=120)
        got = ray.get(reader.ready_then_read.remote(value), timeout=120)
        assert got["at_entry"] == base and got["in_place"]  # deserialized: nothing read yet
        assert got["returns_its_argument"]
        n = got["chunks"]
        assert n >= 1 and got["after_ready"] == base + n  # awaited without blocking
        assert got["after_second_ready"] == got["after_read"] == base + n
        assert torch.equal(got["values"], want)
        base += n

        other = PackedTensor([t * 2], 0)
        got = ray.get(reader.read.remote(other), timeout=120)
        assert got["at_entry"] == base and got["after_read"] == base + 1
        assert torch.equal(got["values"], t * 2) and torch.equal(got["private"], t * 2)

        relayed = PackedTensor([torch.full_like(t, 2.0)], 0)  # a sum exact in any order
        got = ray.get(reader.relay.remote(relayed), timeout=120)
        assert got["at_entry"] == got["after"] == base + 1  # forwarding reads nothing
        assert got["total"] == 2.0 * t.numel()
    finally:
        ray.kill(reader)
    # a threaded actor's calls may block: its argument is read while it is deserialized
    threaded = ThreadedReader.remote()  # type: ignore[attr-defined]
    try:
        base = ray.get(threaded.gets.remote(), timeout=120)
        assert ray.get(threaded.take.remote(PackedTensor([t - 1], 0)), timeout=120) == base + 1
    finally:
        ray.kill(threaded)


def test_ready_outside_an_actor_and_on_values_not_from_the_store() -> None:
    local = PackedTensor([torch.ones(3)], 0)
    received = ray.get(ray.put(PackedTensor([torch.full((5,), 2.0)], 0)))
    nested = {"a": [local, (received,)], "b": "text", "c": None}
    assert asyncio.run(ray_store.ready(nested)) is nested  # already read (the driver is not async)
    assert torch.equal(received.as_tensor(), torch.full((5,), 2.0))
    assert asyncio.run(ray_store.ready(local)) is local


# ---------------------------------------------------------------------------------------------
# values that share segments


def shared_batch() -> tuple[PackedTensor, list[PackedTensor]]:
    """Two prompts' images expanded G = 4 times, cut into 4 shards that each hold rows of
    both prompts: every shard references every segment."""
    gen = torch.Generator().manual_seed(3)
    rows = [PackedTensor(torch.randn(16, 2048, generator=gen), 0).enable_deduplication()]
    rows.append(PackedTensor(torch.randn(24, 2048, generator=gen), 0).enable_deduplication())
    batch = PackedTensor.flattened_concat(rows).repeat_interleave(4)
    return batch, [batch.slice([s, s + 4]) for s in range(4)]


@ray.remote
class ShardReader:
    def gets(self) -> int:
        return ray_store.store_counters().get_objects

    def read(self, shards: list[PackedTensor]) -> dict[str, Any]:
        out: dict[str, Any] = {"chunks": chunks_of(shards)}
        first = [s.tensors for s in shards]
        out["gets"] = ray_store.store_counters().get_objects
        out["one_copy_per_segment"] = all(
            a is b for lists in zip(*first, strict=True) for a, b in itertools.pairwise(lists)
        )
        first[0][0].fill_(-1.0)  # shard 0's edit: its siblings share the tensor, as plain Ray's
        out["siblings"] = [s.as_tensor() for s in shards]
        return out


@pytest.mark.parametrize("store_path", [True, False])
def test_values_received_together_share_their_segments_as_plain_rays_do(store_path: bool) -> None:
    batch, shards = shared_batch()
    reader = ShardReader.remote()  # type: ignore[attr-defined]
    ray_store.enable(store_path)
    try:
        base = ray.get(reader.gets.remote(), timeout=120)
        got = ray.get(reader.read.remote(shards), timeout=120)
    finally:
        ray_store.enable(True)
        ray.kill(reader)
    if store_path:  # each chunk is read once for the four values
        assert got["chunks"] >= 1 and got["gets"] == base + got["chunks"]
    assert got["one_copy_per_segment"]
    edited = batch.tensors[0].clone().fill_(-1.0)
    for shard, value in zip(shards, got["siblings"], strict=True):
        rows = [edited if t is batch.tensors[0] else t for t in shard.tensors]
        assert torch.equal(value, torch.cat(rows))


def test_values_received_apart_or_deep_copied_stay_private() -> None:
    _, shards = shared_batch()
    ref = ray.put(shards[0])
    one, two = ray.get(ref), ray.get(ref)  # two reads: two objects, as plain Ray gives
    sliced, unread = one.slice([0, 1]), one.slice([0, 1])  # one's views, as slices share tensors
    shared_deep = copy.deepcopy(one)  # with provenance a deep copy shares, as a local one does
    one.tensors[0].fill_(5.0)
    assert float(two.as_tensor()[0, 0]) != 5.0 and float(two.tensors[0][0, 0]) != 5.0
    assert float(sliced.as_tensor()[0, 0]) == 5.0  # its gather reads the shared copy
    assert sliced.tensors[0] is one.tensors[0] and shared_deep.tensors[0] is one.tensors[0]
    # sent on, the segment written into travels as written, the other one as its chunk
    counters = ray_store.store_counters()
    reused, put = counters.reused_segments, counters.put_segments
    assert "_store" in unread.__dict__
    assert torch.equal(ray.get(gathered.remote(unread), timeout=60), one.as_tensor())
    assert (counters.reused_segments, counters.put_segments) == (reused + 1, put + 1)

    plain = ray.get(ray.put(PackedTensor([torch.zeros(32_768)], 0)))  # without provenance
    deep = copy.deepcopy(plain)
    assert "_store" in deep.__dict__  # still read in place, with views of its own
    plain.tensors[0].fill_(9.0)
    assert float(deep.tensors[0][0]) == 0.0 and float(deep.as_tensor()[0]) == 0.0
    assert float(copy.deepcopy(plain).tensors[0][0]) == 9.0


def test_a_chunk_remembers_the_session_it_was_read_in() -> None:
    received = ray.get(ray.put(PackedTensor([torch.ones(32_768)], 0)))
    (segment,) = received.__dict__["_store"]
    assert isinstance(segment, ray_store.StoreSegment)
    assert segment.chunk.session == put_table.session_table().session is not None


@ray.remote
def _edit_first(values: list[PackedTensor]) -> list[float]:
    values[0].tensors[0][0, 0] = -1.0
    return [float(v.as_tensor()[0, 0]) for v in values]


@pytest.mark.parametrize("size", [64, 64 * 1024], ids=["inline", "chunk"])
def test_views_received_apart_stay_apart_when_sent_on_together(size: int) -> None:
    import copy

    value = PackedTensor([torch.arange(float(size)).reshape(-1, 8)], 0)
    ref = ray.put(value)
    apart = [ray.get(ref), ray.get(ref)]  # two tensors on this side, as plain Ray gives
    twin = ray.get(ref)
    for pair in (apart, [twin, copy.deepcopy(twin)]):
        back = ray.get(ray.put(pair))
        back[0].tensors[0][0, 0] = -1.0
        assert float(back[1].as_tensor()[0, 0]) == 0.0  # no edit shows through the other
        assert ray.get(_edit_first.remote(pair)) == [-1.0, 0.0]
    together = ray.get(ray.put([apart[0], apart[0].slice([0])]))  # one tensor: shared
    together[0].tensors[0][0, 0] = -1.0
    assert float(together[1].as_tensor()[0, 0]) == -1.0
