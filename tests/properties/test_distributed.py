"""Deduplicated media across a real ``torch.distributed`` scatter (gloo, 2 CPU processes).

Rank 0 builds a G-expanded batch, shards it by rank with ``PackedTensor.shard`` and scatters the
shards with ``scatter_object_list``. Each rank checks that its shard holds only the physical
segments it references and that it materializes to exactly what the legacy (per-row copy) path
gives for its rows.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from mmpack.packed import PackedTensor

WORLD = 2
G = 4
PROMPTS = 6


def _batch() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(11)
    rows = []
    grids = []
    for p in range(PROMPTS):
        images = [torch.randn(4 + p + i, 12, generator=gen) for i in range(1 + p % 2)]
        rows.append(
            PackedTensor.merge_segments([PackedTensor(t, 0).enable_deduplication() for t in images])
        )
        grids.append(
            PackedTensor.merge_segments(
                [
                    PackedTensor(torch.tensor([[1, 2, 4 + p + i]]), 0).enable_deduplication()
                    for i in range(len(images))
                ]
            )
        )
    pixels = PackedTensor.flattened_concat(rows).repeat_interleave(G)
    grid = PackedTensor.flattened_concat(grids).repeat_interleave(G)
    return {
        "pixel_values": pixels,
        "image_grid_thw": grid,
        "input_ids": torch.arange(PROMPTS * G * 5).reshape(PROMPTS * G, 5),
    }


def _legacy_rows(value: PackedTensor, rows: range) -> torch.Tensor:
    """The legacy path: every row materialized on its own, as a separate copy, then cat."""
    per_row = [value.slice([r]).as_tensor() for r in rows]
    return torch.cat([t.clone() for t in per_row if t is not None], dim=value.dim_to_pack)


def _worker(rank: int, port: int, outdir: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD
    )
    try:
        shards: list[Any] | None = None
        if rank == 0:
            batch = _batch()
            per_key = {k: v.shard(WORLD) for k, v in batch.items() if isinstance(v, PackedTensor)}
            ids = batch["input_ids"].chunk(WORLD)
            shards = [
                {**{k: v[r] for k, v in per_key.items()}, "input_ids": ids[r]} for r in range(WORLD)
            ]
        received: list[Any] = [None]
        dist.scatter_object_list(received, shards, src=0)
        shard = received[0]

        full = _batch()  # every rank can rebuild the same batch for checking
        n = len(full["pixel_values"]) // WORLD
        rows = range(rank * n, (rank + 1) * n)
        report: dict[str, Any] = {"rank": rank}
        for key in ("pixel_values", "image_grid_thw"):
            value: PackedTensor = shard[key]
            _, indices = value.csr()
            referenced = sorted(set(indices.tolist()))
            report[key] = {
                "rows": len(value),
                "physical": len(value.tensors),
                "only_referenced": referenced == list(range(len(value.tensors))),
                "full_physical": len(full[key].tensors),
                "equal_to_legacy": bool(
                    torch.equal(value.as_tensor(), _legacy_rows(full[key], rows))
                ),
            }
        report["input_ids_equal"] = bool(
            torch.equal(shard["input_ids"], full["input_ids"][rows.start : rows.stop])
        )
        Path(outdir, f"rank{rank}.json").write_text(json.dumps(report))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.timeout(240)
def test_scatter_shards_over_gloo(tmp_path: Path) -> None:
    mp.spawn(_worker, args=(_free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    # prompts 0-2 go to rank 0 (1+2+1 images), prompts 3-5 to rank 1 (2+1+2 images)
    expected_physical = {0: 4, 1: 5}
    for report in reports:
        rank = report["rank"]
        assert report["input_ids_equal"]
        for key in ("pixel_values", "image_grid_thw"):
            r = report[key]
            assert r["rows"] == PROMPTS * G // WORLD
            assert r["only_referenced"], r
            assert r["physical"] == expected_physical[rank]
            assert r["physical"] < r["full_physical"] == 9
            assert r["equal_to_legacy"], (rank, key)
