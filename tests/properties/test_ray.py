"""Deduplicated media through a real Ray object store (local, 2 CPUs).

A G=16 GRPO batch and its expanded legacy twin travel from one task to another through the
object store; the object store reports their sizes. Shards handed to different tasks come back
and re-intern by provenance when concatenated.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import mmpack.packed.payload as payload
import pytest
import ray
import torch
from mmpack.packed import PackedTensor

G = 16
PROMPTS = 4


@pytest.fixture(scope="module", autouse=True)
def _by_value(ray_session: Any) -> None:
    # ship this module's helpers by value: the workers do not have tests/ on sys.path
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def make_prompts(seed: int = 0) -> dict[str, PackedTensor]:
    """PROMPTS prompts with 1-2 images each (dynamic resolution), one row per prompt."""
    gen = torch.Generator().manual_seed(seed)
    pixel_rows = []
    grid_rows = []
    for p in range(PROMPTS):
        n_images = 1 + p % 2
        images = [torch.randn(64 * (1 + (p + i) % 3), 1176, generator=gen) for i in range(n_images)]
        grids = [torch.tensor([[1, 8, 8 * (1 + (p + i) % 3)]]) for i in range(n_images)]
        pixel_rows.append(
            PackedTensor.merge_segments([PackedTensor(t, 0).enable_deduplication() for t in images])
        )
        grid_rows.append(
            PackedTensor.merge_segments([PackedTensor(t, 0).enable_deduplication() for t in grids])
        )
    return {
        "pixel_values": PackedTensor.flattened_concat(pixel_rows),
        "image_grid_thw": PackedTensor.flattened_concat(grid_rows),
    }


def dedup_batch(seed: int = 0) -> dict[str, Any]:
    prompts = make_prompts(seed)
    batch: dict[str, Any] = {k: v.repeat_interleave(G) for k, v in prompts.items()}
    batch["input_ids"] = torch.arange(PROMPTS * G * 32).reshape(PROMPTS * G, 32)
    return batch


def legacy_twin(batch: dict[str, Any]) -> dict[str, Any]:
    """What NeMo-RL moves without deduplication: every row its own materialized copy."""
    out: dict[str, Any] = {}
    for key, value in batch.items():
        if isinstance(value, PackedTensor):
            rows = [value.slice([r]).as_tensor() for r in range(len(value))]
            out[key] = PackedTensor(
                [None if t is None else t.clone() for t in rows], value.dim_to_pack
            )
        else:
            out[key] = value.clone()
    return out


@ray.remote
def produce(kind: str, seed: int) -> dict[str, Any]:
    batch = dedup_batch(seed)
    return batch if kind == "dedup" else legacy_twin(batch)


@ray.remote
def consume(batch: dict[str, Any]) -> dict[str, Any]:
    pixels = batch["pixel_values"].as_tensor()
    grids = batch["image_grid_thw"].as_tensor()
    return {
        "pid": os.getpid(),
        "pixels": pixels,
        "grids": grids,
        "physical": len(batch["pixel_values"].tensors),
        "stats": payload.measure(batch),
    }


@ray.remote
def echo_shard(shard: PackedTensor) -> tuple[int, PackedTensor]:
    return os.getpid(), shard


def _object_store_size(ref: Any) -> int:
    locations = ray.experimental.get_object_locations([ref])
    return int(locations[ref]["object_size"])


@pytest.mark.timeout(240)
def test_dedup_batch_moves_ten_times_fewer_bytes(ray_session: Any) -> None:
    dedup_ref = produce.remote("dedup", 0)
    legacy_ref = produce.remote("legacy", 0)
    dedup_out, legacy_out = ray.get(
        [consume.remote(dedup_ref), consume.remote(legacy_ref)], timeout=180
    )

    dedup_size = _object_store_size(dedup_ref)
    legacy_size = _object_store_size(legacy_ref)
    assert legacy_size >= 10 * dedup_size, (legacy_size, dedup_size)

    # the receiver materializes the same values from both
    assert torch.equal(dedup_out["pixels"], legacy_out["pixels"])
    assert torch.equal(dedup_out["grids"], legacy_out["grids"])
    assert dedup_out["physical"] == sum(1 + p % 2 for p in range(PROMPTS))
    assert legacy_out["physical"] == PROMPTS * G
    # the object store's view agrees with the shape-based estimate to within framing
    d_stats, l_stats = dedup_out["stats"], legacy_out["stats"]
    assert d_stats.logical_bytes == l_stats.logical_bytes
    assert d_stats.physical_bytes <= dedup_size <= d_stats.physical_bytes * 1.25 + 64 * 1024
    assert l_stats.physical_bytes <= legacy_size <= l_stats.physical_bytes * 1.25 + 64 * 1024
    # and so does the exact protocol-5 size measured on the driver
    local = payload.measure(dedup_batch(0), serialized=True)
    assert local.serialized_bytes is not None
    assert local.serialized_bytes <= dedup_size * 1.25 + 64 * 1024


@pytest.mark.timeout(240)
def test_shards_from_different_tasks_reintern_on_concat(ray_session: Any) -> None:
    batch = dedup_batch(1)
    pixels: PackedTensor = batch["pixel_values"]
    shards = pixels.shard(8)  # 8 rows each: every prompt group is split over two shards
    returned = ray.get([echo_shard.remote(s) for s in shards], timeout=180)
    back = [shard for _, shard in returned]
    # every shard crossed a process boundary: pickled out, restored in a Ray worker and back
    assert os.getpid() not in {pid for pid, _ in returned}
    assert sum(len(s.tensors) for s in back) == 2 * len(pixels.tensors)
    # object identity is gone after the hop, provenance is not: concat collapses the copies
    merged = PackedTensor.concat(back)
    assert len(merged) == len(pixels)
    assert len(merged.tensors) == len(pixels.tensors)
    assert merged._segment_indices == pixels._segment_indices
    assert merged._segment_provenance == pixels._segment_provenance
    expected = pixels.as_tensor()
    assert expected is not None
    got = merged.as_tensor()
    assert got is not None and torch.equal(got, expected)
