"""Bytes that cross between two nodes' object stores on GRPO's data path, with and without
mmpack's put-once object-store path (``mmpack.packed.ray_store``).

Ray's own multi-node test cluster (``ray.cluster_utils.Cluster``) runs two nodes on this
machine, each with its own object store. The driver (on node A) builds a batch of ``--prompts``
prompts with dynamic-resolution bf16 images, expands it G = 16 times (GRPO's
``repeat_interleave``), splits it into 8 DP shards that each hold rows of every prompt (as a
balanced sharding does), and sends one shard to each of 8 actors, 4 pinned to each node by a
custom resource. Each actor keeps its shard and materializes it (``as_tensor``).

With the store path on, each unique segment is put once and node B pulls it once, however many
ranks on B reference it; without it, every shard carries its own copy of its media and node B
pulls each of its 4 shards. Node B's bytes are read from Ray's own accounting: the part of
objects with a copy on node B that were made on node A, from Ray's owner-side location table
(``ray.experimental.get_object_locations``): the shard objects (one ``ray.put`` per rank, as
NeMo-RL's sharded calls send one object per rank) and the chunks the store path put. Node A's
bytes are the part of its ``object_store_memory`` resource in use while the ranks hold their
shards.

A second table sends shards that each need part of what the others need, as NeMo-RL's dynamic
batching makes them at a small G: the same prompts at G = 2 (``--partial-g``), the rows dealt to
the 8 shards in a shuffled order, the whole batch put first (so every segment is in the store
before any shard needs it). Plain Ray carries each shard's own media into node B; the store path
must never carry more (each segment is a chunk of its own, so a shard pulls only its own).

Usage: ``python benches/bench_ray_nodes.py [--prompts N] [--partial-g G] [--json PATH]``.
Prints two markdown tables and writes ``bench-results/bench_ray_nodes.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time
from pathlib import Path
from typing import Any

import ray
import torch
from mmpack.packed import PackedTensor, ray_store
from ray.cluster_utils import Cluster

G = 16
SHARDS = 8
STORE_BYTES = 300 * 1024 * 1024


def build_batch(prompts: int, seed: int, g: int = G) -> PackedTensor:
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


def balanced_shards(batch: PackedTensor) -> list[PackedTensor]:
    n = len(batch)
    return [batch.slice([r for r in range(n) if r % SHARDS == s]) for s in range(SHARDS)]


def partial_shards(batch: PackedTensor, seed: int) -> list[PackedTensor]:
    """Rows dealt to the shards in a shuffled order: each shard needs part of the media."""
    order = list(range(len(batch)))
    random.Random(seed).shuffle(order)
    return [batch.slice(sorted(order[s::SHARDS])) for s in range(SHARDS)]


def unique_bytes(values: list[PackedTensor]) -> int:
    """Bytes of the distinct segment tensors of ``values`` (slices share the batch's)."""
    seen = {id(t): t.nbytes for v in values for t in v.tensors if t is not None}
    return sum(seen.values())


@ray.remote(num_cpus=0)
class Rank:
    def __init__(self) -> None:
        self.shard: PackedTensor | None = None

    def take(self, boxed: list[Any]) -> int:
        shard = ray.get(boxed[0])
        self.shard = shard
        out = shard.as_tensor()
        return 0 if out is None else out.numel() * out.element_size()

    def drop(self) -> None:
        self.shard = None
        gc.collect()


def crossed_bytes(refs: list[Any], into: str) -> tuple[int, int]:
    """Bytes and count of the objects ``refs`` that have a copy on node ``into`` but were made
    on another node (Ray's owner-side location table)."""
    nodes = {n["NodeID"]: n for n in ray.nodes() if n["Alive"]}
    target = next(i for i, n in nodes.items() if into in n["Resources"])
    locations = ray.experimental.get_object_locations(refs)
    total = count = 0
    for ref in refs:
        where = locations[ref]
        if target in where["node_ids"] and where.get("primary_node_id") != target:
            total += int(where["object_size"] or 0)
            count += 1
    return total, count


def shard_pulls(shard_ref: Any, shard: PackedTensor) -> float:
    """Bytes of the objects a shard's value references (the most a node without them pulls for
    it: the shard object itself and the store path's chunks) over its own media."""
    sizes = [shard_ref]
    segments = ray.get(shard_ref).packed_state(in_place=True).segments
    chunks = {
        s.chunk.ref.hex(): s.chunk.ref
        for s in segments
        if getattr(s, "read_in_place", False) is True
    }
    where = ray.experimental.get_object_locations(sizes + list(chunks.values()))
    total = sum(int(w["object_size"] or 0) for w in where.values())
    return total / shard.physical_nbytes()


def node_used() -> dict[str, float]:
    """Bytes in use in each node's object store, by the node's custom resource name."""
    from ray._private import state

    total = state.total_resources_per_node()
    avail = state.available_resources_per_node()
    out = {}
    for node_id, res in total.items():
        name = next((k for k in res if k.startswith("node_")), node_id)
        out[name] = res["object_store_memory"] - avail.get(node_id, {}).get(
            "object_store_memory", 0.0
        )
    return out


def settle() -> dict[str, float]:
    time.sleep(1.5)  # the raylets report store use on their heartbeat
    return node_used()


def run_path(put_once: bool, prompts: int, ranks: list[Any], partial_g: int = 0) -> dict[str, Any]:
    ray_store.enable(put_once)
    counters = ray_store.store_counters()
    counters.reset()
    base = settle()
    if partial_g:
        batch = build_batch(prompts, seed=0, g=partial_g)
        shards = partial_shards(batch, seed=0)
        whole = [ray.put(batch)]  # every segment into the store first
    else:
        batch = build_batch(prompts, seed=0)
        shards = balanced_shards(batch)
        whole = []
    unique = batch.physical_nbytes()
    shard_physical = [s.physical_nbytes() for s in shards]
    t0 = time.perf_counter()
    # each shard goes through the store as NeMo-RL's sharded calls do (one object per rank)
    shard_refs = [ray.put(s) for s in shards]
    logical = ray.get([r.take.remote([ref]) for r, ref in zip(ranks, shard_refs, strict=True)])
    seconds = time.perf_counter() - t0
    held = settle()
    worst_shard = max(shard_pulls(r, v) for r, v in zip(shard_refs, shards, strict=True))
    objects = shard_refs + ray_store.put_refs()
    crossed_b, crossed_objects = crossed_bytes(objects, "node_b")
    store_a = held["node_a"] - base["node_a"]
    ray.get([r.drop.remote() for r in ranks])
    on_b = shards[SHARDS // 2 :]
    needed_b = unique_bytes(on_b)  # each segment a rank on B needs, once
    plain_b = sum(shard_physical[SHARDS // 2 :])  # plain Ray: each of B's shards its own media
    del batch, shards, shard_refs, objects, whole, on_b
    gc.collect()
    after = settle()
    return {
        "put_once": put_once,
        "unique_media_bytes": unique,
        "shard_physical_bytes": sum(shard_physical),
        "logical_bytes": sum(logical),
        "node_a_store_bytes": store_a,
        "crossed_into_node_b_bytes": crossed_b,
        "crossed_into_node_b_objects": crossed_objects,
        "node_b_needs_bytes": needed_b,
        "node_b_plain_ray_bytes": plain_b,
        "crossed_over_needed": crossed_b / needed_b if needed_b else 0.0,
        "crossed_over_plain_ray": crossed_b / plain_b if plain_b else 0.0,
        "worst_shard_pulls_over_own_media": worst_shard,
        "driver_put_bytes": counters.put_bytes,
        "seconds": seconds,
        "store_after_drop_bytes": sum(after.values()) - sum(base.values()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--partial-g", type=int, default=2)
    parser.add_argument("--json", type=Path, default=Path("bench-results/bench_ray_nodes.json"))
    args = parser.parse_args()

    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 2,
            "resources": {"node_a": SHARDS},
            "object_store_memory": STORE_BYTES,
            "include_dashboard": False,
        },
    )
    cluster.add_node(num_cpus=2, resources={"node_b": SHARDS}, object_store_memory=STORE_BYTES)
    try:
        ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
        cluster.wait_for_nodes()
        ranks = [
            Rank.options(resources={"node_a" if r < SHARDS // 2 else "node_b": 1}).remote()  # type: ignore[attr-defined]
            for r in range(SHARDS)
        ]
        ray.get([r.drop.remote() for r in ranks])
        run_path(False, 1, ranks)  # warm-up: the ranks' first calls import torch and mmpack
        rows = [run_path(False, args.prompts, ranks), run_path(True, args.prompts, ranks)]
        partial = [
            run_path(False, args.prompts, ranks, args.partial_g),
            run_path(True, args.prompts, ranks, args.partial_g),
        ]
    finally:
        ray.shutdown()
        cluster.shutdown()

    mib = 1024 * 1024
    print(f"GRPO path over two nodes: {args.prompts} prompts x G={G}, {SHARDS} DP shards")
    head = ["path", "unique media MiB", "node A store MiB", "crossed into node B MiB"]
    head += ["crossed / needed", "driver put MiB", "store after drop MiB", "seconds"]
    print("| " + " | ".join(head) + " |")
    print("|---|" + "---:|" * (len(head) - 1))
    for row in rows:
        cells = [
            "mmpack put-once" if row["put_once"] else "without put-once",
            f"{row['unique_media_bytes'] / mib:.2f}",
            f"{row['node_a_store_bytes'] / mib:.2f}",
            f"{row['crossed_into_node_b_bytes'] / mib:.2f}",
            f"{row['crossed_over_needed']:.2f}x",
            f"{row['driver_put_bytes'] / mib:.2f}",
            f"{row['store_after_drop_bytes'] / mib:.2f}",
            f"{row['seconds']:.2f}",
        ]
        print("| " + " | ".join(cells) + " |")
    print(
        f"\nShards that need part of the media: G={args.partial_g}, rows dealt to {SHARDS} "
        "shards in a shuffled order, the whole batch put first"
    )
    head = ["path", "node B needs MiB", "plain Ray carries into B MiB", "crossed into node B MiB"]
    head += ["crossed / plain Ray", "crossed / needed", "most a shard pulls / its media"]
    print("| " + " | ".join(head) + " |")
    print("|---|" + "---:|" * (len(head) - 1))
    for row in partial:
        cells = [
            "mmpack put-once" if row["put_once"] else "without put-once",
            f"{row['node_b_needs_bytes'] / mib:.2f}",
            f"{row['node_b_plain_ray_bytes'] / mib:.2f}",
            f"{row['crossed_into_node_b_bytes'] / mib:.2f}",
            f"{row['crossed_over_plain_ray']:.2f}x",
            f"{row['crossed_over_needed']:.2f}x",
            f"{row['worst_shard_pulls_over_own_media']:.2f}x",
        ]
        print("| " + " | ".join(cells) + " |")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    out = {"prompts": args.prompts, "rows": rows, "partial_g": args.partial_g, "partial": partial}
    args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
