"""The put-once object-store path (``mmpack.packed.ray_store``) against the store path off, on
the shapes that cost it most: side by side, the same data, one Ray instance, one run.

Shapes (each value built afresh for every pass, so the put-once path puts what it sends):

* ``many small segments``: one value of 20,000 ``image_grid_thw`` rows (one ``[1, 3]`` int64
  segment an image).
* ``many small values``: 4,096 values of one ``[16, 4]`` float32 segment each.
* ``put table``: 4,096 values of one 64 KiB segment each, each sent once: every segment goes
  into the store and the put table (the table ends up holding all 4,096). ``late / early puts``
  is the time of the last eighth of the puts over the first eighth: a put must cost its own
  segments, not the table's size. Sent once, a segment gains nothing from the store: this row
  shows the price of the store path's extra object per segment, not a workload it is for.
* ``GRPO, balanced shards``: ``--prompts`` prompts of 1-2 bf16 images (64-256 patches x 1176),
  G = 16, 8 shards that each hold rows of every prompt.
* ``GRPO, partial shards``: the same media at G = 2, rows dealt to 8 shards in a shuffled order
  (as a dynamic batching does): each shard needs part of what the others need.

Each pass times the driver's ``ray.put`` of every value and a task that receives them all and
materializes each (``as_tensor``), and checks the task's results against the driver's. The
``pulls`` column is, for the partial shards, the bytes of the objects a shard references (what a
node without them would pull) over the shard's own media, the most over the shards (plain Ray:
1.00). This bench runs one node, where a value's new segments go as one object (nothing is pulled
between stores there), so the column shows that grouping; across nodes each segment is an object
of its own and a shard pulls exactly its own media (``bench_ray_nodes.py``, partial shards).

Usage: ``python benches/bench_ray_store.py [--prompts N] [--repeats N] [--json PATH]``.
Prints a markdown table and writes ``bench-results/bench_ray_store.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
import torch
from mmpack.packed import PackedTensor, ray_store

SHARDS = 8
STORE_BYTES = 1536 * 1024 * 1024


def many_small_segments(seed: int) -> list[PackedTensor]:
    gen = torch.Generator().manual_seed(seed)
    hw = torch.randint(2, 40, (20_000, 2), generator=gen)
    rows = torch.cat([torch.ones(20_000, 1, dtype=torch.int64), hw], dim=1)
    return [PackedTensor([r.clone() for r in rows.split(1)], 0)]


def many_small_values(seed: int) -> list[PackedTensor]:
    gen = torch.Generator().manual_seed(seed)
    return [PackedTensor([torch.randn(16, 4, generator=gen)], 0) for _ in range(4096)]


def put_table_values(seed: int) -> list[PackedTensor]:
    gen = torch.Generator().manual_seed(seed)
    return [PackedTensor([torch.randn(4096, 4, generator=gen)], 0) for _ in range(4096)]


def grpo_batch(prompts: int, g: int, seed: int) -> PackedTensor:
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for p in range(prompts):
        images = [
            torch.randn(64 * (1 + (p + i) % 4), 1176, generator=gen).to(torch.bfloat16)
            for i in range(1 + p % 2)
        ]
        rows.append(
            PackedTensor.merge_segments([PackedTensor(t, 0).enable_deduplication() for t in images])
        )
    return PackedTensor.flattened_concat(rows).repeat_interleave(g)


def balanced(prompts: int) -> Callable[[int], list[PackedTensor]]:
    def make(seed: int) -> list[PackedTensor]:
        batch = grpo_batch(prompts, 16, seed)
        n = len(batch)
        return [batch.slice([r for r in range(n) if r % SHARDS == s]) for s in range(SHARDS)]

    return make


def partial(prompts: int) -> Callable[[int], list[PackedTensor]]:
    def make(seed: int) -> list[PackedTensor]:
        batch = grpo_batch(prompts, 2, seed)
        order = list(range(len(batch)))
        random.Random(seed).shuffle(order)
        return [batch.slice(sorted(order[s::SHARDS])) for s in range(SHARDS)]

    return make


def checksum(out: torch.Tensor | None) -> float:
    return 0.0 if out is None else float(out.double().sum())


@ray.remote
def receive(values: list[Any]) -> list[float]:
    return [checksum(ray.get(ref).as_tensor()) for ref in values]


def referenced_bytes(ref: Any) -> int:
    """Bytes of the objects the value behind ``ref`` references (Ray's owner-side table)."""
    inner = ray.get(ref)
    segments = inner.packed_state(in_place=True).segments
    chunks = {}
    for seg in segments:
        if getattr(seg, "read_in_place", False) is True:  # a store view (tensors have .chunk)
            chunks[seg.chunk.ref.binary()] = seg.chunk.ref
    if not chunks:
        return 0
    where = ray.experimental.get_object_locations(list(chunks.values()))
    return sum(int(w["object_size"] or 0) for w in where.values())


def run(make: Callable[[int], list[PackedTensor]], put_once: bool, seed: int) -> dict[str, Any]:
    ray_store.enable(put_once)
    values = make(seed)
    want = [checksum(v.as_tensor()) for v in values]
    counters = ray_store.store_counters()
    counters.reset()
    gc.collect()
    t0 = time.perf_counter()
    refs = []
    stamps = []
    for v in values:
        refs.append(ray.put(v))
        stamps.append(time.perf_counter())
    t_put = time.perf_counter() - t0
    # the put table's growth: the last eighth of the puts against the first
    k = len(values) // 8
    late_over_early = (stamps[-1] - stamps[-k - 1]) / (stamps[k - 1] - t0) if k >= 64 else 0.0
    got = ray.get(receive.remote(refs))
    t_all = time.perf_counter() - t0
    assert got == want
    pulls = 0.0
    if put_once and len(values) == SHARDS:
        pulls = max(
            referenced_bytes(r) / v.physical_nbytes() for r, v in zip(refs, values, strict=True)
        )
    row = {
        "put_s": t_put,
        "total_s": t_all,
        "put_objects": counters.put_objects,
        "put_bytes": counters.put_bytes,
        "pulls": pulls,
        "late_over_early": late_over_early,
    }
    del values, refs, got, want
    gc.collect()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", type=Path, default=Path("bench-results/bench_ray_store.json"))
    args = parser.parse_args()
    shapes: dict[str, Callable[[int], list[PackedTensor]]] = {
        "many small segments (20,000)": many_small_segments,
        "many small values (4,096)": many_small_values,
        "put table (4,096 x 64 KiB)": put_table_values,
        f"GRPO, balanced shards ({args.prompts} prompts, G=16)": balanced(args.prompts),
        f"GRPO, partial shards ({args.prompts} prompts, G=2)": partial(args.prompts),
    }
    ray.init(
        address="local",  # a Ray instance of its own, even beside a running cluster
        num_cpus=1,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
        object_store_memory=STORE_BYTES,
    )
    results: dict[str, dict[str, Any]] = {}
    try:
        # warm-up: the worker's first values import and set up what reading them needs
        for put_once in (False, True):
            run(lambda seed: balanced(2)(seed) + many_small_segments(seed), put_once, seed=99)
        for name, make in shapes.items():
            best: dict[bool, dict[str, Any]] = {}
            # a shape that takes milliseconds is timed more often: this machine's noise is larger
            repeats = args.repeats * 3 if name.startswith("many small segments") else args.repeats
            for rep in range(repeats):
                for put_once in (False, True):
                    row = run(make, put_once, seed=rep)
                    if put_once not in best or row["total_s"] < best[put_once]["total_s"]:
                        best[put_once] = row
            results[name] = {"off": best[False], "on": best[True]}
            print(f"{name}: {results[name]}", flush=True)
    finally:
        ray.shutdown()

    print(f"\nstore path off vs put-once, fastest of {args.repeats} (ray.put + a task reading all)")
    head = ["shape", "off ms", "put-once ms", "put-once / off", "put ms off", "put ms on"]
    head += ["objects put", "put MiB", "pulls / own media", "late / early puts (on)"]
    print("| " + " | ".join(head) + " |")
    print("|---|" + "---:|" * (len(head) - 1))
    for name, r in results.items():
        off, on = r["off"], r["on"]
        cells = [
            name,
            f"{off['total_s'] * 1e3:.0f}",
            f"{on['total_s'] * 1e3:.0f}",
            f"{on['total_s'] / off['total_s']:.2f}",
            f"{off['put_s'] * 1e3:.0f}",
            f"{on['put_s'] * 1e3:.0f}",
            f"{on['put_objects']:,}",
            f"{on['put_bytes'] / 2**20:.2f}",
            f"{on['pulls']:.2f}x" if on["pulls"] else "",
            f"{on['late_over_early']:.2f}" if on["late_over_early"] else "",
        ]
        print("| " + " | ".join(cells) + " |")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"prompts": args.prompts, "shapes": results}, indent=2))


if __name__ == "__main__":
    main()
