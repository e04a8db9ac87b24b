"""Nothing lost across data-parallel ranks: 2 ranks (real processes, ``torch.distributed`` gloo)
with 2 Energon loader workers each read one dataset (both source formats, with broken and
skippable samples). Over an epoch every sample is packed exactly once on exactly one rank, or
skipped / failed with its reason, and the counters summed over the ranks
(`LoaderStats.global_snapshot`) balance. A checkpoint saved on each rank (written to disk and
read back) is restored into a fresh loader that continues with exactly the batches the first
loader produced after the save.
"""

from __future__ import annotations

import collections
import pickle
import socket
from pathlib import Path
from typing import Any

import megatron.energon  # noqa: F401  (collected only with Energon installed)
import pytest
import torch.multiprocessing as mp

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*pin_memory.*:UserWarning"),
    pytest.mark.timeout(240),
]

WORLD = 2
WORKERS = 2
CAPACITY = 384
N_SAMPLES = 96
BEFORE_SAVE, AFTER_SAVE = 3, 5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank(rank: int, port: int, metadataset: str, outdir: str) -> None:
    """One data-parallel rank: an epoch, then a checkpoint round trip."""
    import warnings

    import torch
    import torch.distributed as dist
    from megatron.energon import get_loader, get_savable_loader, get_train_dataset
    from mmpack.energon import (
        PackingEncoderConfig,
        PackingTaskEncoder,
        make_worker_config,
        restore_loader_state,
    )
    from mmpack_dev.energon_testing import batch_digest
    from mmpack_dev.synthetic import PATCH_SIZE, build_tokenizer

    warnings.filterwarnings("ignore", message=".*pin_memory.*")
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD
    )
    tokenizer = build_tokenizer()

    def dataset(repeat: bool) -> tuple[Any, PackingTaskEncoder]:
        encoder = PackingTaskEncoder(
            PackingEncoderConfig(
                capacity=CAPACITY,
                packing_buffer_size=8,
                loss_mask_mode="precomputed",
                batch_size=2,
            ),
            tokenizer=tokenizer,
            processor={"patch_size": PATCH_SIZE},
        )
        worker_config = make_worker_config(
            encoder, num_workers=WORKERS, rank=rank, world_size=WORLD
        )
        ds = get_train_dataset(
            metadataset,
            worker_config=worker_config,
            batch_size=2,
            packing_buffer_size=8,
            shuffle_buffer_size=None,
            max_samples_per_sequence=None,
            task_encoder=encoder,
            repeat=repeat,
        )
        return ds, encoder

    ds, encoder = dataset(repeat=False)
    keys = [k for b in get_loader(ds, watchdog_timeout_seconds=None) for k in b.sample_keys]
    local = encoder.stats.snapshot()
    total = encoder.stats.global_snapshot()
    everyone: list[Any] = [None] * WORLD
    dist.all_gather_object(everyone, keys)

    def savable() -> Any:
        return get_savable_loader(
            dataset(repeat=True)[0],
            checkpoint_every_sec=0,
            checkpoint_every_min_n_samples=1,
            watchdog_timeout_seconds=None,
        )

    first = savable()
    it = iter(first)
    for _ in range(BEFORE_SAVE):
        next(it)
    state_file = Path(outdir) / f"state-{rank}.pt"
    torch.save(first.save_state_rank(), state_file)
    expected = [next(it) for _ in range(AFTER_SAVE)]
    expected_digests = [batch_digest(b) for b in expected]
    expected_keys = [b.sample_keys for b in expected]
    del it, first
    second = savable()
    restore_loader_state(second, torch.load(state_file, weights_only=False))
    resumed = iter(second)
    got = [next(resumed) for _ in range(AFTER_SAVE)]
    result = {
        "keys": keys,
        "local": local,
        "total": total,
        "everyone": everyone,
        "resumed_identical": [batch_digest(b) for b in got] == expected_digests,
        "resumed_keys": expected_keys,
    }
    (Path(outdir) / f"rank-{rank}.pkl").write_bytes(pickle.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, list[dict[str, Any]]]:
    from mmpack_dev.synthetic import write_synthetic_dataset

    root = tmp_path_factory.mktemp("dp")
    ds = write_synthetic_dataset(
        root / "data",
        N_SAMPLES,
        seed=5,
        shards_per_format=4,
        capacity=CAPACITY,
        mean_words=12,
        broken_every=10,
        skip_every=7,
        media_pool=6,
    )
    out = root / "out"
    out.mkdir()
    mp.spawn(_rank, args=(_free_port(), str(ds.metadataset), str(out)), nprocs=WORLD, join=True)
    return ds, [pickle.loads((out / f"rank-{r}.pkl").read_bytes()) for r in range(WORLD)]


def test_every_sample_is_packed_once_on_one_rank_or_counted(results: Any) -> None:
    ds, ranks = results
    per_rank = [r["keys"] for r in ranks]
    assert all(r["everyone"] == per_rank for r in ranks)  # what the ranks exchanged over gloo
    assert all(len(keys) == len(set(keys)) for keys in per_rank), "a sample was packed twice"
    assert not set(per_rank[0]) & set(per_rank[1]), "two ranks packed the same sample"
    assert all(per_rank), "a rank got no data"
    assert set(per_rank[0]) | set(per_rank[1]) == ds.keys_with("ok")
    # the global accounting, the same on every rank, balances by reason
    total = ranks[0]["total"]
    assert all(r["total"] == total for r in ranks)
    expected_skips = collections.Counter(
        v.split(":", 1)[1] for v in ds.expected.values() if v.startswith("skip:")
    )
    assert {k: v for k, v in total["skipped"].items() if v} == dict(expected_skips)
    assert total["failed"] == len(ds.keys_with("broken:"))
    assert total["seen"] == ds.num_samples
    assert total["packed"] + total["skipped_total"] + total["failed"] == ds.num_samples
    # each rank's own counters are its share of the total
    for field in ("seen", "packed", "skipped_total", "failed"):
        assert sum(r["local"][field] for r in ranks) == total[field]
    assert [r["local"]["packed"] for r in ranks] == [len(k) for k in per_rank]


def test_each_rank_resumes_its_checkpoint_with_the_same_batches(results: Any) -> None:
    _, ranks = results
    for r in ranks:
        assert r["resumed_identical"]
        assert sum(len(k) for k in r["resumed_keys"]) >= AFTER_SAVE
    # after the save too, the ranks read different samples
    first, second = ({k for b in r["resumed_keys"] for k in b} for r in ranks)
    assert not first & second
