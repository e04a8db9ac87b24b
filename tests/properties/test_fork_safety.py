"""mmpack in processes forked after the parent used its parallel paths.

The core copies large outputs (``as_tensor`` of at least 1 MiB, ``PARALLEL_MIN_BYTES`` in
``rust/core/src/gather.rs``) on a rayon thread pool. A process forked from the parent (torch
DataLoader and Energon workers on Linux fork by default) inherits that pool's memory but not its
threads; handing it work would wait forever. Each test first materializes a large value in this
process, so the pool exists, then forks and runs mmpack there under a timeout: the child must
finish, get the right bytes, and copy in parallel on a pool of its own.

torch's own intra-op pool (OpenMP) has the same limitation; torch's DataLoader sets it to one
thread in its workers, and the plain ``multiprocessing`` child below only calls mmpack and
numpy (mmpack's CPU gather never enters torch's pool for fewer than 64 segments).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from megatron.energon import get_loader, get_train_dataset, reraise_exception
from mmpack import PackedTensor, _native, packing
from mmpack.batch import PackedBatch
from mmpack.energon import PackingEncoderConfig, PackingTaskEncoder, make_worker_config
from mmpack_dev.synthetic import PATCH_SIZE, write_synthetic_dataset
from torch.utils.data import DataLoader, Dataset

pytestmark = [
    pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork"),
    pytest.mark.filterwarnings("ignore:.*pin_memory.*:UserWarning"),
    pytest.mark.timeout(240),
]

SEGMENT = 1 << 22  # float32 elements: 16 MiB per segment
JOIN_SECONDS = 60


def _large_value() -> PackedTensor:
    """Four 16 MiB segments, rows referencing them with repeats: a 96 MiB materialization."""
    segs = [torch.from_numpy(np.full(SEGMENT, float(i), dtype=np.float32)) for i in range(4)]
    return PackedTensor(
        segs,
        0,
        _row_offsets=[0, 2, 4, 6],
        _segment_indices=[0, 1, 2, 3, 3, 0],
        _segment_provenance=[bytes([i]) * 16 for i in range(4)],
    )


def _expected_sums() -> list[float]:
    return [float(i) * SEGMENT for i in (0, 1, 2, 3, 3, 0)]


def _row_sums(result: torch.Tensor) -> list[float]:
    # numpy, not torch: the child stays out of torch's OpenMP pool
    return result.numpy().reshape(6, SEGMENT).sum(axis=1, dtype=np.float64).tolist()


@pytest.fixture(scope="module")
def parent_used_the_pool() -> Iterator[PackedTensor]:
    value = _large_value()
    assert value.logical_nbytes() >= 1 << 20  # the parallel path
    result = value.as_tensor()
    assert result is not None and _row_sums(result) == _expected_sums()
    yield value


def _child(value: PackedTensor, conn: Any) -> None:
    started = time.perf_counter()
    result = value.as_tensor()
    assert result is not None
    sums = _row_sums(result)
    pack = packing.pack(np.arange(1, 2_000, dtype=np.int64), 4096)
    merged = PackedTensor.concat([value, value.slice([2, 0])])
    conn.send(
        {
            "sums": sums,
            "threads": _native.gather_threads(),
            "packed_items": int(pack.item_indices.size),
            "merged_physical": len(merged.tensors),
            "seconds": time.perf_counter() - started,
        }
    )
    conn.close()


def test_multiprocessing_fork_child_materializes(parent_used_the_pool: PackedTensor) -> None:
    ctx = mp.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(parent_used_the_pool, send))
    started = time.perf_counter()
    proc.start()
    send.close()
    proc.join(JOIN_SECONDS)
    alive = proc.is_alive()
    if alive:
        proc.kill()
        proc.join()
    assert not alive, f"the forked child did not finish within {JOIN_SECONDS} s"
    assert proc.exitcode == 0
    got = recv.recv()
    print(f"fork child: {got['seconds']:.3f} s inside, {time.perf_counter() - started:.3f} s total")
    assert got["sums"] == _expected_sums()
    assert got["packed_items"] == 1_999 and got["merged_physical"] == 4
    # parallelism is rebuilt in the child, not just switched off
    assert got["threads"] == _native.gather_threads()


class _Materializing(Dataset[torch.Tensor]):
    """Each item materializes rows of a large parent-made value (>= 1 MiB), plus a value of
    many small segments (the compacting path)."""

    def __init__(self, value: PackedTensor) -> None:
        self.value = value
        small = [torch.full((3, 4), float(i)) for i in range(200)]
        order = list(range(200)) + list(range(100))
        self.many = PackedTensor(small, 0, _row_offsets=[0, 300], _segment_indices=order)

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> torch.Tensor:
        rows = self.value.slice([i % 3, (i + 1) % 3])
        out = rows.as_tensor()
        many = self.many.as_tensor()
        assert out is not None and many is not None
        threads = _native.gather_threads()
        return torch.tensor([out.double().sum().item(), many.double().sum().item(), threads])


def test_dataloader_fork_workers(parent_used_the_pool: PackedTensor) -> None:
    loader = DataLoader(
        _Materializing(parent_used_the_pool),
        batch_size=None,
        num_workers=2,
        multiprocessing_context="fork",
        timeout=JOIN_SECONDS,  # a hung worker fails the test instead of hanging it
    )
    started = time.perf_counter()
    items = list(loader)
    print(f"DataLoader, 2 fork workers: {time.perf_counter() - started:.3f} s")
    sums = [sum(_expected_sums()[2 * r : 2 * r + 2]) for r in range(3)]
    many = sum(float(i) * 12 for i in range(200)) + sum(float(i) * 12 for i in range(100))
    assert len(items) == 4  # every item came back from a worker
    for i, item in enumerate(items):
        assert item[0].item() == sums[i % 3] + sums[(i + 1) % 3]
        assert item[1].item() == many
        assert item[2].item() == _native.gather_threads()


class _MaterializingEncoder(PackingTaskEncoder):
    """Packs as usual, after materializing the large parent-made value in the worker."""

    large: PackedTensor | None = None

    def build_pack(self, samples: Any) -> PackedBatch:
        assert self.large is not None
        result = self.large.as_tensor()
        assert result is not None and _row_sums(result) == _expected_sums()
        return super().build_pack(samples)


def test_energon_loader_with_two_workers(
    parent_used_the_pool: PackedTensor, tmp_path: Path, tokenizer: Any
) -> None:
    data = write_synthetic_dataset(tmp_path, 24, seed=3, capacity=512, mean_words=12)
    config = PackingEncoderConfig(
        capacity=512, packing_buffer_size=8, loss_mask_mode="precomputed", batch_size=2
    )
    encoder = _MaterializingEncoder(
        config, tokenizer=tokenizer, processor={"patch_size": PATCH_SIZE}
    )
    encoder.large = parent_used_the_pool
    dataset = get_train_dataset(
        str(data.metadataset),
        # an error in a worker (the assertions of build_pack included) stops the loader and
        # reaches this process, instead of being counted and its pack dropped
        worker_config=make_worker_config(encoder, num_workers=2, inner_handler=reraise_exception),
        batch_size=config.batch_size,
        packing_buffer_size=config.packing_buffer_size,
        shuffle_buffer_size=None,
        max_samples_per_sequence=None,
        task_encoder=encoder,
        repeat=False,
    )
    started = time.perf_counter()
    batches = list(get_loader(dataset, watchdog_timeout_seconds=None))
    print(f"Energon loader, 2 workers: {time.perf_counter() - started:.3f} s")
    delivered = [k for b in batches for k in b.sample_keys]
    assert sorted(delivered) == sorted(data.keys_with("ok"))
    assert encoder.stats.snapshot()["failed"] == 0
