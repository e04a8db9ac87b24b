"""Packed media through a real Ray object store (``mmpack.packed.ray_store``): each unique
segment is put once however many shards reference it, the store returns to its baseline once
the values are gone (and not before), receivers read in place and no API can write into the
store, plain pickles are unchanged, and ``MMPACK_INSTALL=1`` reaches actors started the way
NeMo-RL starts its workers."""

from __future__ import annotations

import copy
import gc
import os
import pickle
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mmpack
import pytest
import ray
import torch
from mmpack.compat import nemo_rl
from mmpack.packed import PackedTensor, ray_store
from mmpack.packed.ray_store import put_table

G = 16
PROMPTS = 4
SHARDS = 8
STARTUP_PTH = Path(mmpack.__file__).resolve().parent.parent / "mmpack_startup.pth"


pytestmark = pytest.mark.usefixtures("ray_store_on", "tiny_segments_in_the_store")


def store_used() -> float:
    """Bytes in use in the object store, after the raylet's next report."""
    time.sleep(0.4)
    return ray_store.store_used_bytes()


def wait_store(predicate: Callable[[float], bool], timeout: float = 20.0) -> float:
    deadline = time.monotonic() + timeout
    used = store_used()
    while not predicate(used) and time.monotonic() < deadline:
        gc.collect()
        used = store_used()
    return used


def grpo_pixels(seed: int) -> PackedTensor:
    """PROMPTS prompts of 1-2 images, expanded G times (GRPO's G-expansion)."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for p in range(PROMPTS):
        images = [
            torch.randn(32 * (1 + (p + i) % 3), 1176, generator=gen) for i in range(1 + p % 2)
        ]
        rows.append(
            PackedTensor.merge_segments([PackedTensor(t, 0).enable_deduplication() for t in images])
        )
    return PackedTensor.flattened_concat(rows).repeat_interleave(G)


def interleaved_shards(batch: PackedTensor) -> list[PackedTensor]:
    """Every shard holds rows of every prompt (as NeMo-RL's balanced sharding does)."""
    n = len(batch)
    return [batch.slice([r for r in range(n) if r % SHARDS == s]) for s in range(SHARDS)]


@ray.remote
def read_shard(shard: PackedTensor) -> dict[str, Any]:
    from mmpack.packed import ray_store as rs

    store = shard.__dict__.get("_store")
    views = [s for s in store or () if s is not None]
    out = shard.as_tensor()
    return {
        "in_place": store is not None and all(isinstance(s, rs.StoreSegment) for s in views),
        "read_only": all(not s.array.flags.writeable for s in views),
        "values": out,
        "still_in_place": "_store" in shard.__dict__,
    }


@ray.remote
class Holder:
    def __init__(self) -> None:
        self.held: list[PackedTensor] = []

    def hold(self, shard: PackedTensor) -> int:
        self.held.append(shard)
        return len(shard)

    def values(self) -> list[torch.Tensor | None]:
        return [s.as_tensor() for s in self.held]

    def drop(self) -> None:
        self.held.clear()
        gc.collect()


def test_put_once_read_in_place_and_back_to_baseline() -> None:
    base = wait_store(lambda u: True)
    counters = ray_store.store_counters()
    counters.reset()
    batch = grpo_pixels(0)
    unique = batch.physical_nbytes()
    shards = interleaved_shards(batch)
    expected = [s.as_tensor() for s in shards]

    results = ray.get([read_shard.remote(s) for s in shards], timeout=120)
    assert counters.put_bytes == unique
    assert counters.put_segments == len(batch.tensors)
    assert counters.put_objects == 1  # the first shard holds every prompt's images (one node)
    # a second round of the same shards (and a ray.put of the whole batch) puts nothing more
    ray.get([read_shard.remote(s) for s in shards], timeout=120)
    batch_ref = ray.put(batch)
    assert counters.put_bytes == unique and counters.put_objects == 1
    used = store_used() - base
    assert unique <= used <= unique * 1.1 + 256 * 1024, (used, unique)

    for got, want in zip(results, expected, strict=True):
        assert got["in_place"] and got["read_only"] and got["still_in_place"]
        assert want is not None and torch.equal(got["values"], want)

    # the driver reading the batch back also reads in place, and materializes the same rows
    back = ray.get(batch_ref)
    assert "_store" in back.__dict__
    want_all = batch.as_tensor()
    assert want_all is not None and torch.equal(back.as_tensor(), want_all)
    # row selections and copies of it stay in place (no private copy until one is handed out)
    derived = {
        "slice": back.slice([0, 5]),
        "shard": back.shard(2)[1],
        "repeat_interleave": back.repeat_interleave(2),
        "to_dtype(same)": back.to_dtype(torch.float32),
        "deepcopy": copy.deepcopy(back),
    }
    for name, value in derived.items():
        assert "_store" in value.__dict__, name
    rows = batch.slice([0, 5]).as_tensor()
    assert rows is not None and torch.equal(derived["slice"].as_tensor(), rows)
    assert "_store" in back.__dict__
    del derived, value

    del results, batch_ref, back, shards, batch, expected
    gc.collect()
    used = wait_store(lambda u: u <= base + 1024)
    assert used <= base + 1024, (used, base)
    assert not put_table._TABLE.put  # the put table holds nothing once the segments are gone
    assert ray_store.held_bytes() == 0 and ray_store.put_refs() == []


def test_a_segment_lives_while_a_shard_that_references_it_lives() -> None:
    base = wait_store(lambda u: True)
    batch = grpo_pixels(1)
    unique = batch.physical_nbytes()
    shards = interleaved_shards(batch)
    expected = [s.as_tensor() for s in shards[:2]]
    holder = Holder.remote()  # type: ignore[attr-defined]
    ray.get([holder.hold.remote(s) for s in shards[:2]], timeout=120)

    del shards, batch
    gc.collect()
    # the driver holds nothing now: the actor's shards keep the chunk alive
    assert wait_store(lambda u: u < base + unique, timeout=2) >= base + unique
    got = ray.get(holder.values.remote(), timeout=60)
    for g, want in zip(got, expected, strict=True):
        assert want is not None and g is not None and torch.equal(g, want)

    ray.get(holder.drop.remote(), timeout=60)
    used = wait_store(lambda u: u <= base + 1024)
    assert used <= base + 1024, (used, base)
    ray.kill(holder)


def _write_everything(obj: Any) -> None:
    """Write into every tensor reachable from ``obj``: what a careless caller could do."""
    if isinstance(obj, torch.Tensor):
        obj.fill_(-7)
    elif isinstance(obj, PackedTensor):
        for t in obj.tensors:
            _write_everything(t)
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            _write_everything(item)


APIS: dict[str, Callable[[PackedTensor], Any]] = {
    "tensors": lambda v: v.tensors,
    "tensors[0]": lambda v: v.tensors[0],
    "iter(tensors)": lambda v: list(iter(v.tensors)),
    "tensors[:]": lambda v: v.tensors[:],
    "iter_logical_segments": lambda v: list(v.iter_logical_segments()),
    "to(cpu)": lambda v: v.to("cpu"),
    "slice": lambda v: v.slice([0, 1]),
    "shard": lambda v: v.shard(2),
    "repeat_interleave": lambda v: v.repeat_interleave(2),
    "to_dtype": lambda v: v.to_dtype(torch.float16).tensors,
    "to_dtype(same)": lambda v: v.to_dtype(torch.float32).tensors,
    "copy": lambda v: copy.copy(v),
    "deepcopy": lambda v: copy.deepcopy(v),
    "concat": lambda v: PackedTensor.concat([v, v]),
    "flattened_concat": lambda v: PackedTensor.flattened_concat([v.slice([0])]),
    "as_tensor": lambda v: v.as_tensor(),
    "as_tensor(device=cpu)": lambda v: v.as_tensor(device="cpu"),
    "pickle": lambda v: pickle.loads(pickle.dumps(v, protocol=5)),
    "csr": lambda v: [torch.from_numpy(a.copy()) for a in v.csr()],
}


def test_no_api_writes_into_the_store() -> None:
    batch = grpo_pixels(2)
    ref = ray.put(batch)
    want = batch.as_tensor()
    assert want is not None
    pristine = ray.get(ref)  # kept alive: its views must still read the original bytes
    views = [s for s in pristine._store if s is not None]
    originals = [s.array.copy() for s in views]
    for name, api in APIS.items():
        value = ray.get(ref)
        assert "_store" in value.__dict__, name
        _write_everything(api(value))
        _write_everything(value)  # the value itself, after the call
    for view, original in zip(views, originals, strict=True):
        assert (view.array == original).all()
    fresh = ray.get(ref)
    got = fresh.as_tensor()
    assert got is not None and torch.equal(got, want)
    # the private copies are real tensors with the store's values
    copies = fresh.tensors
    assert "_store" not in fresh.__dict__
    assert all(isinstance(t, torch.Tensor) for t in copies)
    assert [torch.equal(a, b) for a, b in zip(copies, batch.tensors, strict=True)]


def _odd_values() -> dict[str, PackedTensor]:
    """Values whose read-in-place gather must either reproduce the driver's result or leave
    the work to the private path: gaps, other packing dims, mixed dtypes and shapes, tensors
    that travel in-band beside store views."""
    gen = torch.Generator().manual_seed(7)

    def dedup(*tensors: torch.Tensor | None, dim: int = 0) -> PackedTensor:
        rows = [
            PackedTensor([t], dim) if t is None else PackedTensor(t, dim).enable_deduplication()
            for t in tensors
        ]
        return PackedTensor.flattened_concat(rows)

    a, b = torch.randn(3, 5, generator=gen), torch.randn(2, 5, generator=gen)
    wide = torch.randn(4, 7, generator=gen)
    return {
        "gaps": dedup(a, None, b, None).repeat_interleave(3),
        "dim 1": dedup(
            torch.randn(5, 3, generator=gen), torch.randn(5, 4, generator=gen), dim=1
        ).repeat_interleave(2),
        "dim -1, rank 3": dedup(
            torch.randn(2, 3, 4, generator=gen), torch.randn(2, 3, 1, generator=gen), dim=-1
        ).repeat_interleave(2),
        "rank 1": dedup(torch.arange(4), torch.arange(3)).repeat_interleave(2),
        "mixed dtypes": dedup(a, b.to(torch.bfloat16), a.to(torch.float64)).repeat_interleave(2),
        "mixed trailing shapes": dedup(a, wide).repeat_interleave(2),
        "in-band beside store views": dedup(a, b.clone().requires_grad_(), a).repeat_interleave(2),
        "all gaps": dedup(None, None),
    }


READ_IN_PLACE = {"gaps", "dim 1", "dim -1, rank 3", "rank 1", "all gaps"}


@pytest.mark.parametrize("name", list(_odd_values()))
def test_reading_in_place_gives_the_drivers_result_or_its_error(name: str) -> None:
    value = _odd_values()[name]
    try:
        want: Any = value.as_tensor()
    except Exception as exc:  # the private path's own refusal
        want = exc
    received = ray.get(ray.put(value))
    if isinstance(want, Exception):
        with pytest.raises(type(want)):
            received.as_tensor()
        return
    got = received.as_tensor()
    # store views of one dtype and layout are gathered in place; the rest from private copies
    assert ("_store" in received.__dict__) == (name in READ_IN_PLACE), name
    if want is None:
        assert got is None
        return
    assert got is not None and got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got.detach(), want.detach())
    assert got.requires_grad == want.requires_grad


def test_plain_pickles_are_unchanged_with_the_store_path_on() -> None:
    batch = grpo_pixels(3)
    shards = interleaved_shards(batch)
    on = pickle.dumps(shards, protocol=5)
    ray_store.enable(False)
    try:
        off = pickle.dumps(shards, protocol=5)
    finally:
        ray_store.enable(True)
    assert on == off
    # and a value read from the store pickles like the one it came from
    back = ray.get(ray.put(shards[0]))
    assert pickle.dumps(back, protocol=5) == pickle.dumps(shards[0], protocol=5)


@ray.remote
class StartupWorker:
    """An actor like NeMo-RL's workers: a ``ray.remote`` class whose options carry
    ``runtime_env={"env_vars": ...}``."""

    def report(self) -> dict[str, Any]:
        from mmpack.packed import ray_store as rs

        return {"hook": "mmpack_startup" in sys.modules, "store_on": rs.enabled()}

    def make(self, seed: int) -> PackedTensor:
        return grpo_pixels(seed)

    def read(self, shard: PackedTensor) -> tuple[bool, torch.Tensor | None]:
        return "_store" in shard.__dict__, shard.as_tensor()

    def counters(self) -> dict[str, int]:
        from mmpack.packed import ray_store as rs

        return rs.store_counters().as_dict()


@ray.remote
def plain_report() -> dict[str, Any]:
    """A worker started without the variable."""
    from mmpack.packed import ray_store as rs

    return {"hook": "mmpack_startup" in sys.modules, "store_on": rs.enabled()}


def test_mmpack_install_reaches_actors_through_runtime_env(tmp_path: Path) -> None:
    # what an installed wheel does: the startup .pth is read from a site directory
    assert STARTUP_PTH.is_file()
    site_dir = tmp_path / "site"
    site_dir.mkdir()
    (site_dir / "sitecustomize.py").write_text(
        f"import site\nsite.addsitedir({str(STARTUP_PTH.parent)!r})\n"
    )
    path = os.pathsep.join([str(site_dir), os.environ.get("PYTHONPATH", "")])
    env = {"MMPACK_INSTALL": "1", "PYTHONPATH": path}
    workers = [
        StartupWorker.options(runtime_env={"env_vars": env}).remote()  # type: ignore[attr-defined]
        for _ in range(2)
    ]
    reports = ray.get([w.report.remote() for w in workers], timeout=120)
    assert reports == [{"hook": True, "store_on": True}] * 2
    assert ray.get(plain_report.remote(), timeout=60) == {"hook": False, "store_on": False}

    assert nemo_rl.install() in ("patched", "shim")
    try:
        # worker -> driver -> other worker: the worker returns its value inline (a chunk it
        # put would die with it), the driver puts the media once for every shard
        counters = ray_store.store_counters()
        counters.reset()
        made_ref = workers[0].make.remote(4)
        made = ray.get(made_ref, timeout=120)
        held = made.__dict__.get("_store") or ()
        assert not any(isinstance(s, ray_store.StoreSegment) for s in held)
        shards = made.shard(4)
        reads = ray.get([workers[1].read.remote(s) for s in shards], timeout=120)
        want = grpo_pixels(4)
        for (in_place, got), shard in zip(reads, want.shard(4), strict=True):
            expected = shard.as_tensor()
            assert in_place and got is not None and expected is not None
            assert torch.equal(got, expected)
        producer = ray.get(workers[0].counters.remote(), timeout=60)
        assert producer["put_bytes"] == 0 and producer["put_objects"] == 0
        reader = ray.get(workers[1].counters.remote(), timeout=60)
        assert reader["put_bytes"] == 0 and reader["get_objects"] >= 1
        assert counters.put_bytes == want.physical_nbytes()  # each unique segment once
    finally:
        nemo_rl.uninstall()
        for w in workers:
            ray.kill(w)


def test_put_table_callbacks_survive_interpreter_teardown(monkeypatch: pytest.MonkeyPatch) -> None:
    # At exit the interpreter may clear module globals before the last tensors are freed (3.13
    # does); the callbacks that drop a freed tensor's entry must not need them.
    raised: list[BaseException | None] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda hook: raised.append(hook.exc_value))
    pixels = PackedTensor(torch.randn(64, 1176), dim_to_pack=0).enable_deduplication()
    ref = ray.put(pixels)
    table = put_table._TABLE.put
    assert any(e.wref() is not None for e in table.values())
    monkeypatch.setattr(put_table, "_TABLE", None)
    monkeypatch.setattr(put_table, "LOCK", None)
    del pixels
    gc.collect()
    assert raised == []
    del ref
