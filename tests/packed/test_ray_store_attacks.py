"""Hostile uses of the object-store path with real Ray: a later send must never carry stale or
foreign bytes, shards outlive the driver's batch, the put table empties, and the
``MMPACK_INSTALL`` switch reads like a switch."""

from __future__ import annotations

import copy
import gc
import os
import pickle
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from mmpack import PackedTensor
from mmpack.errors import PackedTensorError
from mmpack.packed import ray_store
from mmpack.packed.ray_store import put_table, switch

ROOT = Path(__file__).resolve().parents[2]


pytestmark = pytest.mark.usefixtures("ray_store_on", "tiny_segments_in_the_store")


def _remote_as_tensor() -> Any:
    import ray

    @ray.remote
    def as_tensor(value: PackedTensor) -> torch.Tensor:
        return value.as_tensor().clone()

    return as_tensor


def sent(value: Any) -> torch.Tensor:
    """What a task receiving ``value`` as an argument gathers."""
    import ray

    return ray.get(_remote_as_tensor().remote(value))


def test_in_place_write_after_a_put_is_sent() -> None:
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    value = PackedTensor([t], dim_to_pack=0)
    assert torch.equal(sent(value), t)
    t.mul_(10)
    assert torch.equal(sent(value), t)
    value.tensors[0][0, 0] = -7.0  # a write through a view of the segment
    assert torch.equal(sent(value), t)


def test_segments_sharing_a_provenance_id_keep_their_own_bytes() -> None:
    provenance = [b"\x07" * 16]
    a = PackedTensor([torch.zeros(4, 2)], dim_to_pack=0, _segment_provenance=provenance)
    b = PackedTensor([torch.ones(4, 2)], dim_to_pack=0, _segment_provenance=provenance)
    assert torch.equal(sent(a), torch.zeros(4, 2))
    assert torch.equal(sent(b), torch.ones(4, 2))


def test_a_modified_deep_copy_of_a_dedup_value_is_sent_as_modified() -> None:
    value = PackedTensor([torch.zeros(3, 5)], dim_to_pack=0)
    value.enable_deduplication()
    assert torch.equal(sent(value), torch.zeros(3, 5))
    other = copy.deepcopy(value)
    other.__dict__["tensors"] = [torch.full((3, 5), 2.0)]  # same provenance, new bytes
    assert torch.equal(sent(other), torch.full((3, 5), 2.0))
    assert torch.equal(sent(value), torch.zeros(3, 5))


def test_a_segment_whose_storage_was_replaced_is_sent_anew() -> None:
    t = torch.zeros(6)
    value = PackedTensor([t], dim_to_pack=0)
    assert torch.equal(sent(value), torch.zeros(6))
    with torch.no_grad():
        t.set_(torch.arange(6, dtype=torch.float32))
    assert torch.equal(sent(value), torch.arange(6, dtype=torch.float32))


def test_views_of_one_storage_in_several_dtypes_and_strides() -> None:
    base = torch.arange(64, dtype=torch.int32)
    segs = [
        base[8:16].reshape(2, 4),  # an offset view
        base.reshape(8, 8)[:2, 1:5],  # non-contiguous
        base.reshape(8, 8).t()[:2, :4],  # transposed
    ]
    as_bytes = base.view(torch.uint8)[4:20].reshape(2, 8)  # another dtype over the same storage
    ints = PackedTensor(segs, dim_to_pack=0)
    raw = PackedTensor([as_bytes, as_bytes], dim_to_pack=0)
    assert torch.equal(sent(ints), torch.cat(segs))
    assert torch.equal(sent(raw), torch.cat([as_bytes, as_bytes]))
    base[:] = -1  # every view changes: every send must see it
    assert torch.equal(sent(ints), torch.cat(segs))
    assert torch.equal(sent(raw), torch.cat([as_bytes, as_bytes]))


def test_inference_tensors_are_sent_correctly() -> None:
    with torch.inference_mode():
        t = torch.arange(5, dtype=torch.float32)
    value = PackedTensor([t], dim_to_pack=0)
    assert torch.equal(sent(value), t)
    with torch.inference_mode():
        t.add_(1)
    assert torch.equal(sent(value), t)


def test_shards_outlive_the_driver_batch_and_travel_from_an_actor_on() -> None:
    import ray

    @ray.remote
    class Holder:
        def keep(self, shard: PackedTensor) -> int:
            self.shard = shard
            return len(shard)

        def hand(self) -> PackedTensor:
            return self.shard

    @ray.remote
    def read(nested: dict[str, list[Any]]) -> list[torch.Tensor]:
        return [ray.get(ref).as_tensor().clone() for ref in nested["x"]]

    segs = [torch.full((2, 3), float(i)) for i in range(4)]
    batch = PackedTensor(list(segs), dim_to_pack=0)
    expected = batch.slice([2, 3]).as_tensor().clone()
    ref = ray.put(batch.slice([2, 3]))
    del batch, segs
    gc.collect()  # the driver's segments are gone: only the refs keep the chunk
    holder = Holder.remote()
    assert ray.get(holder.keep.remote(ref)) == 2
    del ref
    handed = holder.hand.remote()
    got = ray.get(read.remote({"x": [handed, handed]}))
    assert len(got) == 2 and all(torch.equal(g, expected) for g in got)
    assert torch.equal(ray.get(handed).as_tensor(), expected)
    assert torch.equal(ray.get(handed).as_tensor(), expected)  # ray.get twice
    ray.kill(holder)


def test_the_put_table_empties_once_the_segments_are_gone() -> None:
    import ray

    def round_trip() -> None:
        value = PackedTensor([torch.ones(16, 4) for _ in range(3)], dim_to_pack=0)
        ray.get(ray.put([value, {"again": value}]))
        assert ray_store.put_refs()

    round_trip()
    gc.collect()
    assert ray_store.put_refs() == []


def test_two_threads_pickling_at_once_send_the_right_bytes() -> None:
    values = [PackedTensor([torch.full((8, 8), float(i))], dim_to_pack=0) for i in range(6)]
    errors: list[BaseException] = []
    results: dict[int, torch.Tensor] = {}

    def worker(i: int) -> None:
        try:
            results[i] = sent(values[i % len(values)])
        except BaseException as exc:  # report it on the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(12)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert not errors and not any(th.is_alive() for th in threads)
    for i, got in results.items():
        assert torch.equal(got, torch.full((8, 8), float(i % len(values))))


# ---------------------------------------------------------------------------------------------
# the switch


def _hook_armed(value: str) -> bool:
    """Whether ``mmpack_startup.pth`` arms the hook in a fresh interpreter with ``value`` set."""
    probe = "import site, sys; site.addsitedir(sys.argv[1]); print('mmpack_startup' in sys.modules)"
    got = subprocess.run(
        [sys.executable, "-c", probe, str(ROOT / "python")],
        env=dict(os.environ, MMPACK_INSTALL=value, PYTHONPATH=str(ROOT / "python")),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert got.returncode == 0, got.stderr
    return {"True": True, "False": False}[got.stdout.strip()]


OFF = ["0", "", " ", "false", "False", "no", "OFF"]
ON = ["1", "true", "yes"]


def test_the_hook_reads_off_values_as_off() -> None:
    assert [_hook_armed(v) for v in OFF + ON] == [False] * len(OFF) + [True] * len(ON)


def test_the_store_path_reads_the_variable_like_the_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    for value, on in [(v, False) for v in OFF] + [(v, True) for v in ON]:
        monkeypatch.setenv(ray_store.ENV_VAR, value)
        assert switch.env_on() is on, value


def test_a_broken_mmpack_never_breaks_interpreter_start(tmp_path: Path) -> None:
    (tmp_path / "mmpack").mkdir()
    (tmp_path / "mmpack" / "__init__.py").write_text("raise ImportError('a broken build')\n")
    for name in ("mmpack_startup.pth", "mmpack_startup.py"):
        (tmp_path / name).write_text((ROOT / "python" / name).read_text())
    probe = "import site, sys; site.addsitedir(sys.argv[1]); print('mmpack_startup' in sys.modules)"
    got = subprocess.run(
        [sys.executable, "-c", probe, str(tmp_path)],
        env=dict(os.environ, MMPACK_INSTALL="1", PYTHONPATH=""),
        capture_output=True,
        text=True,
        timeout=60,
    )
    # the hook is armed: it never imports mmpack at start (an import of NeMo-RL's module would)
    assert got.returncode == 0 and got.stdout.strip() == "True", got.stderr


def test_a_received_value_combines_and_hands_out_only_private_tensors() -> None:
    import ray

    @ray.remote
    def combine(value: PackedTensor) -> dict[str, Any]:
        out: dict[str, Any] = {}
        out["concat"] = PackedTensor.concat([value, value.slice([1])]).as_tensor().clone()
        out["flat"] = PackedTensor.flattened_concat([value, value]).as_tensor().clone()
        out["merge"] = PackedTensor.merge_segments([value, value]).as_tensor().clone()
        out["repeat"] = value.repeat_interleave(2).as_tensor().clone()
        for shard in value.shard(2):
            for t in shard.tensors:
                t.fill_(-5)  # private copies (or value's own): the store keeps its bytes
                torch.from_dlpack(t).fill_(-6)
        value.as_tensor().fill_(-7)
        value.slice([0]).to("cpu").as_tensor().fill_(-8)
        return out

    segs = [torch.arange(6, dtype=torch.int64).reshape(2, 3) + 10 * i for i in range(2)]
    value = PackedTensor(list(segs), dim_to_pack=0)
    got = ray.get(combine.remote(value))
    whole = torch.cat(segs)
    assert torch.equal(got["concat"], torch.cat([whole, segs[1]]))
    assert torch.equal(got["flat"], torch.cat([whole, whole]))
    assert torch.equal(got["merge"], torch.cat([whole, whole]))
    assert torch.equal(got["repeat"], torch.cat([segs[0], segs[0], segs[1], segs[1]]))
    reused = ray_store.store_counters().reused_segments
    assert torch.equal(sent(value), whole)  # the chunk put first, read again: unchanged
    assert ray_store.store_counters().reused_segments == reused + 2


def test_values_made_and_returned_inside_tasks() -> None:
    import ray

    on = {"env_vars": {ray_store.ENV_VAR: "1"}}  # workers of their own: the pool's stay off

    @ray.remote(runtime_env=on)
    def make(i: int) -> PackedTensor:
        seg = torch.full((3, 2), float(i))
        return PackedTensor([seg, seg], dim_to_pack=0)

    @ray.remote(runtime_env=on)
    def relay(i: int) -> list[PackedTensor]:
        return ray.get([make.remote(i), make.remote(i + 1)])  # ray.get inside a task, then a put

    got = ray.get(relay.remote(1), timeout=180)  # three fresh workers, each importing torch
    assert all(
        torch.equal(v.as_tensor(), torch.full((6, 2), float(i)))
        for v, i in zip(got, (1, 2), strict=True)
    )


@pytest.mark.timeout(180)
def test_a_plain_pickle_nested_inside_rays_is_self_contained() -> None:
    import pickle

    import ray

    def unnest(blob: bytes) -> PackedTensor:
        return pickle.loads(blob)

    class NestsAPlainPickle:
        """Pickles its PackedTensor with plain ``pickle`` while Ray pickles it: those bytes
        must not carry object-store references (defined here so Ray sends it by value)."""

        def __init__(self, value: PackedTensor) -> None:
            self.value = value

        def __reduce__(self) -> Any:
            return (unnest, (pickle.dumps(self.value),))

    @ray.remote
    def total(holder: Any) -> float:
        return float(holder.as_tensor().sum())

    t = torch.arange(1000, dtype=torch.float32).reshape(10, 100)
    value = PackedTensor([t], dim_to_pack=0)
    before = ray_store.store_counters().put_bytes
    # a hang here was the failure: the nested bytes held references Ray never tracked
    for _ in range(2):
        assert ray.get(total.remote(NestsAPlainPickle(value)), timeout=60) == float(t.sum())
    assert ray_store.store_counters().put_bytes == before  # nothing went through the store


def test_tensors_assigned_on_a_received_value_replace_its_store_views() -> None:
    import ray

    def build() -> PackedTensor:
        return PackedTensor([torch.zeros(2), torch.zeros(1)], dim_to_pack=0)

    local, received = build(), ray.get(ray.put(build()))
    assert "_store" in received.__dict__
    for value in (local, received):
        value.tensors = [torch.ones(3)]
    assert len(received) == len(local) == 1
    assert torch.equal(received.as_tensor(), local.as_tensor())
    assert torch.equal(sent(received), torch.ones(3))
    assert torch.equal(copy.deepcopy(received).as_tensor(), torch.ones(3))
    assert torch.equal(pickle.loads(pickle.dumps(received)).as_tensor(), torch.ones(3))
    assert torch.equal(received.to("cpu").as_tensor(), torch.ones(3))
    assert [t.tolist() for t in received.tensors] == [[1.0, 1.0, 1.0]]


def test_a_value_returned_by_an_actor_outlives_the_actor() -> None:
    # an object belongs to the process that put it: only the driver puts chunks
    import ray

    @ray.remote
    class Maker:
        def make(self) -> PackedTensor:
            ray_store.enable(True)
            segs = [torch.full((2, 3), float(i)) for i in range(3)]
            return PackedTensor(segs, dim_to_pack=0).repeat_interleave(4)

    maker = Maker.remote()
    ref = maker.make.remote()
    ray.wait([ref], timeout=60)
    ray.kill(maker)
    deadline = time.monotonic() + 60
    while True:  # until the driver has seen the owner die: a call to it fails
        try:
            ray.get(maker.make.remote(), timeout=60)
        except ray.exceptions.RayActorError:
            break
        assert time.monotonic() < deadline, "the killed actor still answers"
        time.sleep(0.1)
    value = ray.get(ref, timeout=60)
    expected = PackedTensor([torch.full((2, 3), float(i)) for i in range(3)], 0)
    assert torch.equal(value.as_tensor(), expected.repeat_interleave(4).as_tensor())
    assert torch.equal(sent(value), value.as_tensor())  # and the driver sends it on


def test_the_put_table_holds_at_most_its_cap_the_least_recently_sent_going_first() -> None:
    import ray

    with pytest.raises(PackedTensorError, match="held_bytes"):
        ray_store.enable(True, held_bytes=-1)
    size = 64 * 1024  # one chunk: 16,384 float32
    ray_store.enable(True, held_bytes=0)  # what earlier tests left: let go at once
    ray_store.enable(True, held_bytes=int(size * 2.5))
    try:
        values = [PackedTensor([torch.full((4096, 4), float(i))], 0) for i in range(4)]
        counters = ray_store.store_counters()
        counters.reset()
        refs = [ray.put(v) for v in values[:2]]
        assert counters.put_objects == 2 and ray_store.held_bytes() == 2 * size
        ray.put(values[0])  # sent again: reused, and now the most recent
        assert counters.put_objects == 2
        refs.append(ray.put(values[2]))  # over the cap: values[1]'s chunk goes
        assert ray_store.held_bytes() == 2 * size and counters.put_objects == 3
        assert ray.get(refs[1]).as_tensor().eq(1.0).all()  # the object still holds it
        ray.put(values[1])
        assert counters.put_objects == 4  # put again, and right
        ray.put(values[0])
        assert counters.put_objects == 5  # values[2] and values[1] were sent since
        for v, ref in zip(values, refs, strict=False):
            assert torch.equal(ray.get(ref).as_tensor(), v.as_tensor())
        assert ray_store.held_bytes() <= int(size * 2.5)
        ray_store.enable(True, held_bytes=0)  # hold nothing: every send puts
        ray.put(values[3])
        ray.put(values[3])
        assert counters.put_objects == 7 and ray_store.put_refs() == []  # let go at once
    finally:
        ray_store.enable(True, held_bytes=None)
    del values, refs
    gc.collect()
    assert ray_store.put_refs() == [] and ray_store.held_bytes() == 0


def test_the_default_cap_is_half_the_nodes_object_store() -> None:
    import ray

    ray_store.enable(True, held_bytes=0)  # what earlier tests left: let go at once
    ray_store.enable(True, held_bytes=None)
    value = PackedTensor([torch.ones(1024, 4)], 0)
    ray.put(value)
    assert ray_store.held_bytes() == value.physical_nbytes()
    node = ray.get_runtime_context().get_node_id()
    store = next(n["Resources"]["object_store_memory"] for n in ray.nodes() if n["NodeID"] == node)
    assert put_table._TABLE.cap == int(store // 2)


RECONNECT = """
import ray, torch
from mmpack.packed import PackedTensor, ray_store
from mmpack.packed.ray_store import writing
writing.INLINE_BELOW = 0  # these tiny segments through the store
ray_store.enable(True)
kw = dict(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False,
          object_store_memory=80 * 2**20)
t = torch.full((4, 3), 5.0)
value = PackedTensor([t], 0)

@ray.remote
def total(v):
    return float(v.as_tensor().sum())

ray.init(**kw)
kept = ray.get(ray.put(value))  # a value read in place, alive across the reconnect
assert float(ray.get(ray.put(value)).as_tensor().sum()) == 60.0
held_before = ray_store.held_bytes()
ray.shutdown()
ray.init(**kw)
assert ray_store.held_bytes() == 0 and ray_store.put_refs() == [], "the old session's table"
assert held_before > 0
other = PackedTensor([torch.full((4, 3), 2.0)], 0)
print(float(ray.get(ray.put(value)).as_tensor().sum()), ray.get(total.remote(value)),
      float(ray.get(ray.put(other)).as_tensor().sum()), float(kept.as_tensor().sum()))
ray.shutdown()
"""


def test_a_new_ray_session_in_the_same_process_starts_a_new_table(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", RECONNECT],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["60.0", "60.0", "24.0", "60.0"]


@pytest.mark.parametrize("case", ["over_the_cap", "inference_mode", "cap_zero"])
def test_a_task_argument_whose_chunk_no_table_holds_is_read(case: str) -> None:
    # the value travels inline in the task's arguments (its pickle holds only the chunk ref)
    import ray

    @ray.remote
    def gathered(value: PackedTensor) -> torch.Tensor:
        return value.as_tensor().clone()

    if case == "inference_mode":
        with torch.inference_mode():
            t = torch.arange(100_000, dtype=torch.float32)
    else:
        t = torch.arange(100_000, dtype=torch.float32)
    ray_store.enable(True, held_bytes=0 if case == "cap_zero" else 1000)
    try:
        got = ray.get(gathered.remote(PackedTensor([t], 0)), timeout=60)
        assert ray_store.held_bytes() == 0
    finally:
        ray_store.enable(True, held_bytes=None)
    assert torch.equal(got, t)


def test_a_storage_swapped_in_at_the_same_address_is_sent_anew() -> None:
    import numpy as np

    arr = np.zeros(4096, dtype=np.float32)
    t = torch.from_numpy(arr)
    value = PackedTensor([t], 0)
    assert torch.equal(sent(value), torch.zeros(4096))
    arr[:] = 5.0  # bypasses the counter (documented) ...
    t.data = torch.from_numpy(arr)  # ... but a new storage at the same address is seen
    assert t.data_ptr() == arr.ctypes.data
    assert torch.equal(sent(value), torch.full((4096,), 5.0))


def test_a_lower_cap_or_turning_off_lets_go_at_once() -> None:
    import numpy as np
    import ray

    values = [PackedTensor([torch.full((4096,), float(i))], 0) for i in range(4)]
    for v in values:
        ray.put(v)
    assert ray_store.held_bytes() == 4 * 4096 * 4
    try:
        ray_store.enable(True, held_bytes=np.int64(2 * 4096 * 4))
        assert ray_store.held_bytes() == 2 * 4096 * 4 and len(ray_store.put_refs()) == 2
        ray_store.enable(False)
        assert ray_store.held_bytes() == 0 and ray_store.put_refs() == []
        for bad in ("off", None, 1):
            with pytest.raises(TypeError, match="bool"):
                ray_store.enable(bad)  # type: ignore[arg-type]
        for bad_cap in (1.5, True, "10"):
            with pytest.raises(TypeError, match="held_bytes"):
                ray_store.enable(True, held_bytes=bad_cap)  # type: ignore[arg-type]
    finally:
        ray_store.enable(True, held_bytes=None)
    for v in values:
        assert torch.equal(ray.get(ray.put(v)).as_tensor(), v.as_tensor())


def test_deleting_tensors_of_a_received_value_deletes_its_store_views() -> None:
    import ray

    local, received = (PackedTensor([torch.zeros(3)], 0) for _ in range(2))
    received = ray.get(ray.put(received))
    for value in (local, received):
        value.tensors = [torch.ones(3)]
        del value.tensors
        with pytest.raises(AttributeError):
            _ = value.tensors
    fresh = ray.get(ray.put(PackedTensor([torch.zeros(3)], 0)))
    del fresh.tensors  # never read: the views go all the same
    with pytest.raises(AttributeError):
        _ = fresh.tensors
