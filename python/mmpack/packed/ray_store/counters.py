"""What this process moved through Ray's object store for packed media, and what the cluster's
stores hold."""

from __future__ import annotations

import dataclasses

__all__ = ["COUNTERS", "StoreCounters", "store_counters", "store_used_bytes"]


@dataclasses.dataclass
class StoreCounters:
    """What this process wrote into and read from Ray's object store for packed media, since
    it started (or the last ``reset``)."""

    #: objects put (a chunk each: one segment of at least ``INLINE_BELOW`` bytes)
    put_objects: int = 0
    put_bytes: int = 0
    put_segments: int = 0
    #: segments pickled as a reference to a chunk put earlier (by this process or another)
    reused_segments: int = 0
    #: segments sent in the value's own bytes, as plain Ray sends them (smaller than
    #: ``INLINE_BELOW``, or sent by a worker), and the bytes of those that are plain tensors
    inline_segments: int = 0
    inline_bytes: int = 0
    get_objects: int = 0
    get_bytes: int = 0

    def reset(self) -> None:
        for field in dataclasses.fields(self):
            setattr(self, field.name, 0)

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


COUNTERS = StoreCounters()


def store_counters() -> StoreCounters:
    """This process's object-store counters (a live object; ``reset()`` zeroes them)."""
    return COUNTERS


def store_used_bytes() -> float:
    """Bytes in use in the object stores of the running Ray cluster (Ray reports them as the
    unavailable part of the ``object_store_memory`` resource, refreshed on each raylet's
    heartbeat): a run's store memory before and after, to see it return to its baseline."""
    import ray

    total = ray.cluster_resources().get("object_store_memory", 0.0)
    return float(total - ray.available_resources().get("object_store_memory", 0.0))
