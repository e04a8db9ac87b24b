"""The writing side of the object-store path with real Ray: what the put table lets go of leaves
the store without the cyclic garbage collector, a put costs its own segments, small segments
travel in the value's own bytes (and values sent together still share them), a value pulls only
the objects of its own segments, and values of an old Ray session can be sent into a new one."""

from __future__ import annotations

import functools
import gc
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from mmpack import PackedTensor
from mmpack.packed import ray_store
from mmpack.packed.ray_store import put_table

pytestmark = pytest.mark.usefixtures("ray_store_on")

BIG = (128, 1024)  # float32: 512 KiB, an object of its own


def big(fill: float) -> torch.Tensor:
    return torch.full(BIG, fill)


def referenced(ref_hex: str) -> bool:
    """Whether this process's Ray core worker still counts a reference to the object."""
    from ray._private import worker

    counts = worker.global_worker.core_worker.get_all_reference_counts()
    entry = counts.get(ref_hex.encode())
    return entry is not None and (entry["local"] > 0 or entry["submitted"] > 0)


def wait_for(predicate: Callable[[], bool], timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.fixture
def short_linger(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Released refs linger 0.2 s, and the cyclic garbage collector does not run: what frees
    them must be their reference count alone."""
    monkeypatch.setattr(put_table, "LINGER_S", 0.2)
    lingering = put_table.LINGERING
    with put_table.LOCK:  # earlier tests' refs (60 s) would hold the queue's timer
        lingering.items.clear()
        if lingering.timer is not None:
            lingering.timer.cancel()
            lingering.timer = None
    ray_store.enable(True, held_bytes=0)  # what earlier tests left: let go at once
    ray_store.enable(True, held_bytes=None)
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        ray_store.enable(True, held_bytes=None)


def _release_by_cap(value: PackedTensor) -> None:
    ray_store.enable(True, held_bytes=0)


def _release_stale(value: PackedTensor) -> None:
    import ray

    value.tensors[0].add_(1.0)  # the entry no longer holds what the tensor holds
    ray.put(value)


def _release_by_off(value: PackedTensor) -> None:
    ray_store.enable(False)


@pytest.mark.parametrize(
    "release",
    [_release_by_cap, _release_stale, _release_by_off],
    ids=["lower cap", "stale entry", "path off"],
)
@pytest.mark.usefixtures("short_linger")
def test_an_object_the_table_lets_go_is_freed_after_its_linger_without_the_gc(
    release: Callable[[PackedTensor], None],
) -> None:
    import ray

    value = PackedTensor([big(1.0)], 0)
    ray.put(value)  # the outer object is dropped at once: only the table holds the chunk
    (held_hex,) = [ref.hex() for ref in ray_store.put_refs()]
    assert referenced(held_hex)
    release(value)
    assert held_hex not in [ref.hex() for ref in ray_store.put_refs()]
    # the tensor is alive (its entry could still be reached through a reference cycle); the
    # ref must go once it stopped lingering, with the garbage collector off
    assert wait_for(lambda: not referenced(held_hex)), "the released object is still held"
    assert value.tensors[0].eq(2.0 if release is _release_stale else 1.0).all()


def test_an_entry_whose_tensor_died_frees_its_object_at_once() -> None:
    import ray

    gc.collect()
    gc.disable()
    try:
        t = big(3.0)
        ray.put(PackedTensor([t], 0))
        (held_hex,) = [ref.hex() for ref in ray_store.put_refs()]
        del t  # the last reference: its entry goes, and its object with it (no linger)
        assert ray_store.put_refs() == [] and ray_store.held_bytes() == 0
        assert wait_for(lambda: not referenced(held_hex), timeout=5)
    finally:
        gc.enable()


def _calls_into_the_store_path(run: Callable[[], Any]) -> int:
    """Python calls (generator steps included) made in ``mmpack.packed.ray_store`` while
    ``run()`` runs."""
    calls = 0

    def profile(frame: Any, event: str, _: Any) -> None:
        nonlocal calls
        if event == "call" and frame.f_globals.get("__name__", "").startswith(
            "mmpack.packed.ray_store"
        ):
            calls += 1

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return calls


def test_a_put_costs_its_own_segments_not_the_tables_size() -> None:
    import ray

    ray_store.enable(True, held_bytes=0)
    ray_store.enable(True, held_bytes=None)
    kept: list[PackedTensor] = []
    costs = {}
    for held in (4, 64):
        while len(kept) < held:
            kept.append(PackedTensor([big(float(len(kept)))], 0))
            ray.put(kept[-1])
        assert ray_store.held_bytes() == held * kept[0].physical_nbytes()
        probe = PackedTensor([big(-1.0)], 0)
        costs[held] = _calls_into_the_store_path(functools.partial(ray.put, probe))
        assert ray_store.held_bytes() == (held + 1) * kept[0].physical_nbytes()
        del probe  # its entry goes with it
    assert costs[64] == costs[4], costs
    # the running total follows every way bytes leave the table
    size = kept[0].physical_nbytes()
    ray_store.enable(True, held_bytes=size * 10)
    assert ray_store.held_bytes() == size * 10 and len(ray_store.put_refs()) == 10
    del kept[-1]
    assert ray_store.held_bytes() == size * 9
    kept[-1].tensors[0].mul_(2.0)
    ray.put(kept[-1])  # stale: its old object goes, its new one comes
    assert ray_store.held_bytes() == size * 9
    ray_store.enable(False)
    assert ray_store.held_bytes() == 0 and ray_store.put_refs() == []
    ray_store.enable(True, held_bytes=None)


def _grid_rows(n: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(n)
    hw = torch.randint(2, 40, (n, 2), generator=gen)
    rows = torch.cat([torch.ones(n, 1, dtype=torch.int64), hw], dim=1)
    return [r.clone() for r in rows.split(1)]


def test_many_small_segments_travel_in_the_values_bytes_and_put_nothing() -> None:
    import ray

    value = PackedTensor(_grid_rows(5000), 0)
    counters = ray_store.store_counters()
    counters.reset()
    back = ray.get(ray.put(value))
    assert counters.put_objects == 0 and ray_store.put_refs() == []
    assert counters.inline_segments == 5000
    assert torch.equal(back.as_tensor(), value.as_tensor())
    got = back.tensors
    assert [t.shape for t in got] == [(1, 3)] * 5000
    got[0].fill_(-1)  # the receiver's own writable tensors
    assert value.tensors[0][0, 0] == 1


def _odd_small_segments() -> list[Any]:
    base = torch.arange(24, dtype=torch.int32)
    return [
        torch.tensor(2.5),  # 0-d
        torch.zeros(0, 3),  # empty
        base.reshape(4, 6).t()[:3],  # non-contiguous
        base.view(torch.uint8)[:5],
        torch.tensor([True, False, True]),
        torch.arange(3, dtype=torch.bfloat16),
        torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64),
        torch.ones(2, 2, requires_grad=True),  # not a plain tensor: pickled as it is
        big(4.0),  # an object of its own, beside the rest
        None,
    ]


def test_small_segments_of_every_kind_come_back_as_sent() -> None:
    import ray

    segments = _odd_small_segments()
    segments.append(segments[2])  # the same tensor twice
    value = PackedTensor(segments, 0)
    counters = ray_store.store_counters()
    counters.reset()

    @ray.remote
    def echo(v: PackedTensor) -> list[Any]:
        return [t if t is None else t.detach().clone() for t in v.tensors]

    for got in (ray.get(ray.put(value)).tensors, ray.get(echo.remote(value))):
        assert len(got) == len(segments)
        for g, want in zip(got, segments, strict=True):
            if want is None:
                assert g is None
                continue
            assert g.dtype == want.dtype and g.shape == want.shape
            assert torch.equal(g.detach(), want.detach())
    assert counters.put_objects == 1  # only the big segment


def test_values_sent_together_share_their_small_segments() -> None:
    import ray

    value = PackedTensor([torch.randn(8, 32) for _ in range(3)], 0)
    a, b = ray.get(ray.put([value, value.slice([2, 0])]))
    assert a.tensors[2] is b.tensors[0] and a.tensors[0] is b.tensors[1]
    assert a.tensors[1] is not a.tensors[0]
    assert torch.equal(b.as_tensor(), value.slice([2, 0]).as_tensor())


def test_a_later_send_carries_only_its_own_small_segments() -> None:
    import ray

    rows = _grid_rows(20_000)
    batch = PackedTensor(rows, 0)
    whole = ray.put(batch)
    part = ray.put(batch.slice([7, 11]))  # sent on its own: the batch's bytes stay out
    sizes = ray.experimental.get_object_locations([whole, part])
    assert sizes[whole]["object_size"] > 20_000 * 24
    assert sizes[part]["object_size"] < 8 * 1024, sizes[part]
    assert torch.equal(ray.get(part).as_tensor(), torch.cat([rows[7], rows[11]]))


@pytest.fixture
def ranks() -> Iterator[Any]:
    import ray

    @ray.remote
    class Rank:
        def take(self, boxed: list[Any]) -> tuple[int, torch.Tensor]:
            from mmpack.packed import ray_store as rs

            before = rs.store_counters().get_bytes
            value = ray.get(boxed[0])
            out = value.as_tensor().clone()
            return rs.store_counters().get_bytes - before, out

    actors = [Rank.remote() for _ in range(2)]
    yield actors
    for actor in actors:
        ray.kill(actor)


@pytest.fixture
def across_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The put side as on a cluster of several nodes (where a pulled object crosses between
    object stores); the receiving side is the same on one node."""
    from mmpack.packed.ray_store import writing

    monkeypatch.setattr(writing, "one_node", lambda table: False)


def test_one_node_puts_a_values_new_segments_as_one_object() -> None:
    import ray

    counters = ray_store.store_counters()
    counters.reset()
    value = PackedTensor([big(7.0), big(8.0), big(9.0)], 0)
    back = ray.get(ray.put(value))
    assert counters.put_objects == 1 and counters.put_segments == 3
    assert torch.equal(back.as_tensor(), value.as_tensor())
    assert put_table.one_node(put_table.session_table())  # what chose it: this cluster


@pytest.mark.usefixtures("across_nodes")
def test_a_shard_pulls_only_the_objects_of_its_own_segments(ranks: list[Any]) -> None:
    import ray

    rows = [
        PackedTensor.merge_segments(
            [PackedTensor(big(float(p)), 0).enable_deduplication() for p in (p, -p - 1)]
        )
        for p in range(4)
    ]
    batch = PackedTensor.flattened_concat(rows).repeat_interleave(2)
    kept = ray.put(batch)  # every segment put first, by a value that needs them all
    shards = [batch.slice([0, 1]), batch.slice([4, 7])]  # prompt 0; prompts 2 and 3
    for rank, shard in zip(ranks, shards, strict=True):
        ref = ray.put(shard)
        pulled, got = ray.get(rank.take.remote([ref]))
        own = shard.physical_nbytes()
        assert pulled == own, (pulled, own)  # what plain Ray would carry, not the batch
        assert torch.equal(got, shard.as_tensor())
        # and the objects the shard references are its own segments, each once
        views = ray.get(ref).packed_state(in_place=True).segments
        objects = {s.chunk.ref.hex(): s.chunk.ref for s in views if s is not None}
        where = ray.experimental.get_object_locations(list(objects.values()))
        assert sum(int(w["object_size"]) for w in where.values()) < own + 4096 * len(objects)
    del kept


RECONNECT = """
import sys
import ray, torch
from mmpack.packed import PackedTensor, ray_store
ray_store.enable(True)
kw = dict(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False,
          object_store_memory=80 * 2**20)
big = torch.full((128, 1024), 5.0)
value = PackedTensor([big, torch.full((1, 1024), 2.0), big], 0)
want = value.as_tensor()

@ray.remote
def total(v):
    return float(v.as_tensor().sum())

ray.init(**kw)
received = ray.get(ray.put(value))  # read in place in the first session
sent_refs = ray_store.put_refs()
assert sent_refs and ray_store.held_bytes() > 0
del sent_refs
ray.shutdown()
ray.init(**kw)
counters = ray_store.store_counters()
counters.reset()
again = ray.get(ray.put(received))  # its chunks are the old session's: put anew
out = [torch.equal(again.as_tensor(), want), ray.get(total.remote(received)) == float(want.sum())]
out.append(counters.put_objects >= 1)
counters.reset()
out.append(torch.equal(ray.get(ray.put(value)).as_tensor(), want))  # tensors sent before
out.append(counters.put_objects == 1 and ray_store.held_bytes() == big.nbytes)
out.append(ray.get(total.remote(value)) == float(want.sum()))
out.append(torch.equal(received.as_tensor(), want))
print(" ".join(map(str, out)))
ray.shutdown()
"""


def test_values_of_an_old_session_are_sent_into_a_new_one(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", RECONNECT],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["True"] * 7


def test_the_inline_threshold_is_where_segments_start_going_to_the_store() -> None:
    import ray

    below = torch.zeros(ray_store.INLINE_BELOW // 4 - 1)
    at = torch.zeros(ray_store.INLINE_BELOW // 4)
    counters = ray_store.store_counters()
    counters.reset()
    ray.get(ray.put(PackedTensor([below, at], 0)))
    assert counters.put_objects == 1 and counters.put_bytes == at.nbytes
    assert counters.inline_segments == 1 and counters.inline_bytes == below.nbytes


def test_a_node_that_joins_lets_go_of_objects_that_group_segments(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import ray

    counters = ray_store.store_counters()
    value = PackedTensor([big(11.0), big(12.0), big(13.0)], 0)
    ray.put(value)  # one node: the three segments go as one object
    table = put_table.session_table()
    assert put_table.one_node(table)
    alive = [n for n in ray.nodes() if n.get("Alive")]
    monkeypatch.setattr(ray, "nodes", lambda: alive * 2)  # a second node joined
    monkeypatch.setattr(table, "nodes_checked", -float("inf"))
    counters.reset()
    part = ray.put(value.slice([1]))
    # the grouped object would be pulled whole for one segment: put again, on its own
    assert counters.put_objects == 1 and counters.put_bytes == big(0.0).nbytes
    views = ray.get(part).packed_state(in_place=True).segments
    where = ray.experimental.get_object_locations([s.chunk.ref for s in views])
    # one object of about one segment, not the grouped three
    assert [int(w["object_size"]) < 2 * big(0.0).nbytes for w in where.values()] == [True]
    assert torch.equal(ray.get(part).as_tensor(), value.slice([1]).as_tensor())


def _lock_in_child(conn: Any) -> None:
    got = put_table.LOCK.acquire(timeout=10)
    conn.send(got)


def test_a_child_forked_while_a_thread_holds_the_table_lock_can_take_it() -> None:
    import multiprocessing
    import threading

    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with put_table.LOCK:
            held.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait(10)
    try:
        ctx = multiprocessing.get_context("fork")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_lock_in_child, args=(child,))
        proc.start()
        assert parent.poll(30) and parent.recv() is True
        proc.join(30)
    finally:
        release.set()
        holder.join(30)


def test_a_value_sent_on_does_not_keep_its_chunk_once_it_is_gone() -> None:
    import ray

    received = ray.get(ray.put(PackedTensor([big(21.0)], 0)))  # its tensor died: not held
    (view,) = received.packed_state(in_place=True).segments
    chunk_hex = view.chunk.ref.hex()
    del view
    ray.get(ray.put(received))  # sent on: the chunk by reference
    del received
    gc.collect()
    assert wait_for(lambda: not referenced(chunk_hex))
