"""How long an async actor stops answering while a packed value's media is pulled onto its node
(``mmpack.packed.ray_store``).

Ray's multi-node test cluster (``ray.cluster_utils.Cluster``) runs two nodes on this machine,
each with its own object store. An async actor (``async def`` methods) lives on node B. The
driver (node A) puts a value of ``--mib`` MiB of media into the store once (a fresh tensor per
trial, so node B has to pull it), then calls the actor with that value as the argument while a
thread of the driver pings the same actor every few milliseconds. The ping latency during the
call tells whether the actor's event loop kept running while the chunk was pulled.

Modes (what the called coroutine does with the value):

* ``keep``: keeps it without reading it (only the argument's deserialization runs);
* ``ready``: ``await ray_store.ready(value)``: the chunks pulled without blocking the loop;
* ``ready+read``: the same, then ``as_tensor()`` on a helper thread (``asyncio.to_thread``);
* ``read``: ``as_tensor()`` straight away on the loop (a blocking pull, where Ray warns, then
  the gather);
* ``plain``: the store path off (plain Ray: the pickled value is an argument Ray pulls itself
  before the call), kept without reading: the reference.

The call's own time and the pings' are printed side by side; a ping that waits as long as the
call means the loop (or the thread that starts calls) was held for all of it. Inside the actor
a coroutine sleeps 2 ms at a time and records how late it wakes (the loop's own lag, without
the driver's and the network's share). The machine's other load shows in both: compare modes
run together, not runs apart.

Usage: ``python benches/bench_ray_async.py [--mib N] [--trials N] [--json PATH]``. Prints a
markdown table and writes ``bench-results/bench_ray_async.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import ray
import torch
from mmpack.packed import PackedTensor, ray_store
from ray.cluster_utils import Cluster

MODES = ("keep", "ready", "ready+read", "read", "plain")


@ray.remote(num_cpus=0)
class AsyncReader:
    """An async actor: its calls run as coroutines on one event loop."""

    def __init__(self) -> None:
        self.kept: Any = None
        self.lags: list[float] = []
        self.ticker: Any = None

    async def tick(self) -> None:
        """Sleeps 2 ms at a time and records how late the loop woke it: the loop's own lag."""
        self.lags = []
        while True:
            t0 = time.perf_counter()
            await asyncio.sleep(0.002)
            self.lags.append(time.perf_counter() - t0 - 0.002)

    async def start_ticking(self) -> None:
        self.ticker = asyncio.get_running_loop().create_task(self.tick())
        await asyncio.sleep(0.01)

    async def stop_ticking(self) -> float:
        self.ticker.cancel()
        return max(self.lags, default=0.0)

    async def ping(self) -> float:
        return time.monotonic()

    async def take(self, value: PackedTensor, mode: str) -> dict[str, float]:
        from mmpack.packed import ray_store as rs

        self.kept = value
        out = {"pull_s": 0.0, "read_s": 0.0}
        if mode in ("keep", "plain"):
            return out
        t0 = time.perf_counter()
        if mode.startswith("ready"):
            ready = getattr(rs, "ready", None) or getattr(rs.chunks, "ready", None)
            if ready is not None:  # an mmpack without it reads as in "read"
                await ready(value)
            out["pull_s"] = time.perf_counter() - t0
            if mode == "ready+read":
                t0 = time.perf_counter()
                await asyncio.to_thread(value.as_tensor)
                out["read_s"] = time.perf_counter() - t0
            return out
        value.as_tensor()
        out["read_s"] = time.perf_counter() - t0
        return out

    async def drop(self) -> None:
        self.kept = None
        gc.collect()


def one_call(actor: Any, mib: int, mode: str, seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    value = PackedTensor([torch.randn(mib * 2**20 // 4, generator=gen)], 0)
    ray_store.enable(mode != "plain")
    # the chunk (or, plain, the whole pickled value) goes into node A's store before the call
    held = ray.put(value)
    pings: list[float] = []
    stop = threading.Event()
    started = threading.Event()

    def pinger() -> None:
        ray.get(actor.ping.remote())
        started.set()
        while not stop.is_set():
            t0 = time.perf_counter()
            ray.get(actor.ping.remote())
            pings.append(time.perf_counter() - t0)
            time.sleep(0.002)

    thread = threading.Thread(target=pinger, daemon=True)
    thread.start()
    started.wait()
    ray.get(actor.start_ticking.remote())
    t0 = time.perf_counter()
    inside = ray.get(actor.take.remote(held if mode == "plain" else value, mode))
    seconds = time.perf_counter() - t0
    stop.set()
    thread.join()
    loop_lag = ray.get(actor.stop_ticking.remote())
    ray.get(actor.drop.remote())
    del value, held
    gc.collect()
    return {
        "mode": mode,
        "call_seconds": seconds,
        "pull_seconds": inside["pull_s"],
        "read_seconds": inside["read_s"],
        "max_loop_lag_ms": loop_lag * 1e3,
        "pings": len(pings),
        "max_ping_ms": max(pings) * 1e3,
        "median_ping_ms": statistics.median(pings) * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--json", type=Path, default=Path("bench-results/bench_ray_async.json"))
    args = parser.parse_args()

    store = (args.mib * 2 + 128) * 2**20
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "resources": {"node_a": 1},
            "object_store_memory": store,
            "include_dashboard": False,
        },
    )
    cluster.add_node(num_cpus=1, resources={"node_b": 1}, object_store_memory=store)
    ray_store.enable(True)
    rows: list[dict[str, Any]] = []
    try:
        ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
        cluster.wait_for_nodes()
        actor = AsyncReader.options(resources={"node_b": 1}).remote()  # type: ignore[attr-defined]
        one_call(actor, 1, "read", seed=0)  # warm-up: the actor's first call imports torch
        for mode in MODES:
            for trial in range(args.trials):
                rows.append(one_call(actor, args.mib, mode, seed=1 + trial))
    finally:
        ray.shutdown()
        cluster.shutdown()

    print(f"An async actor on node B receives {args.mib} MiB put on node A; pings meanwhile")
    head = ["mode", "call s", "pull in call s", "read in call s", "max loop lag ms"]
    head += ["max ping ms", "median ping ms"]
    print("| " + " | ".join(head) + " |")
    print("|---|" + "---:|" * (len(head) - 1))
    summary = {}
    for mode in MODES:  # medians over the trials
        mine = [r for r in rows if r["mode"] == mode]
        keys = ("call_seconds", "pull_seconds", "read_seconds", "max_loop_lag_ms")
        keys += ("max_ping_ms", "median_ping_ms")
        s = summary[mode] = {k: statistics.median(r[k] for r in mine) for k in keys}
        print(
            f"| {mode} | {s['call_seconds']:.2f} | {s['pull_seconds']:.2f} "
            f"| {s['read_seconds']:.2f} | {s['max_loop_lag_ms']:.1f} "
            f"| {s['max_ping_ms']:.1f} | {s['median_ping_ms']:.1f} |"
        )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"mib": args.mib, "summary": summary, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
