"""Every sample counted once at the loader's edges and across a checkpoint restore, on the real
Energon loader (0 and 2 workers) over WebDataset shards written by the test (both source
formats, broken and skippable samples):

* ``batch_drop_last``: the last short batch of each worker is counted as dropped, never packed;
* a batch that fails (in ``batch`` or ``encode_batch``) counts its samples only as failed;
* a plain ``WorkerConfig`` (as Megatron-LM builds) still counts failures, once per encoder;
* a restored run counts only what happens after the save: nothing of the buffers Energon
  refills, nothing of the batches it replays from a worker's internal checkpoint;
* checkpoints at the edges: step 0 (``None``), an epoch's last batches (``repeat=False``),
  after its end; a smaller ``capacity`` names the checkpoint; ``restore_batch`` rebuilds a
  batch where Energon's ``restore_sample`` asserts.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from megatron.energon import (
    WorkerConfig,
    get_loader,
    get_savable_loader,
    get_train_dataset,
    stateless,
)
from megatron.energon.errors import FatalSampleError
from mmpack.energon import (
    PackingEncoderConfig,
    PackingTaskEncoder,
    make_worker_config,
    restore_batch,
    restore_loader_state,
)
from mmpack.errors import EnergonConfigError
from mmpack_dev.energon_testing import batch_digest
from mmpack_dev.synthetic import PATCH_SIZE, write_synthetic_dataset

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*pin_memory.*:UserWarning"),
    pytest.mark.timeout(240),
]

CAPACITY = 384
N_SAMPLES = 60
BUFFER = 8
BATCH = 2
#: counters that add up across a save: the saved run's counts plus the restored run's
ADDITIVE = ("seen", "encoded", "packed", "packs", "skipped", "dropped", "failed_by_reason")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return write_synthetic_dataset(
        tmp_path_factory.mktemp("energon-resume"),
        N_SAMPLES,
        seed=3,
        shards_per_format=2,
        capacity=CAPACITY,
        mean_words=15,
        broken_every=12,
        skip_every=9,
        media_pool=6,
    )


def make_encoder(tokenizer: Any, cls: type[Any] = PackingTaskEncoder, **overrides: Any) -> Any:
    settings: dict[str, Any] = {
        "capacity": CAPACITY,
        "packing_buffer_size": BUFFER,
        "batch_size": BATCH,
        "loss_mask_mode": "precomputed",
        "algorithm": "first_fit_decreasing",
        **overrides,
    }
    return cls(
        PackingEncoderConfig(**settings), tokenizer=tokenizer, processor={"patch_size": PATCH_SIZE}
    )


def train_dataset(
    dataset: Any,
    encoder: Any,
    workers: int,
    *,
    worker_config: WorkerConfig | None = None,
    drop_last: bool = False,
) -> Any:
    return get_train_dataset(
        str(dataset.metadataset),
        worker_config=worker_config or make_worker_config(encoder, num_workers=workers),
        batch_size=encoder.config.batch_size,
        batch_drop_last=drop_last,
        packing_buffer_size=encoder.config.packing_buffer_size,
        shuffle_buffer_size=None,
        max_samples_per_sequence=None,
        task_encoder=encoder,
        repeat=False,
    )


def savable(dataset: Any, encoder: Any, workers: int, **options: Any) -> Any:
    return get_savable_loader(
        train_dataset(dataset, encoder, workers), watchdog_timeout_seconds=None, **options
    )


def keys(batches: list[Any]) -> list[list[str]]:
    return [list(b.sample_keys) for b in batches]


def n_samples(batches: list[list[str]]) -> int:
    return sum(len(b) for b in batches)


def ends(stats: dict[str, Any]) -> int:
    """The samples whose end the counters know: packed + skipped + failed + dropped."""
    return stats["packed"] + stats["skipped_total"] + stats["failed"] + stats["dropped_total"]


def additive(stats: dict[str, Any]) -> dict[str, Any]:
    """The `ADDITIVE` counters of a snapshot, per-reason counts without the zeros."""
    return {
        name: {k: v for k, v in stats[name].items() if v}
        if isinstance(stats[name], dict)
        else stats[name]
        for name in ADDITIVE
    }


def add(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in ADDITIVE:
        if isinstance(a[name], dict):
            merged = {k: a[name].get(k, 0) + b[name].get(k, 0) for k in {*a[name], *b[name]}}
            out[name] = {k: v for k, v in merged.items() if v}
        else:
            out[name] = a[name] + b[name]
    return out


def sub(a: dict[str, Any], b: dict[str, Any], name: str) -> int:
    return int(a[name]) - int(b[name])


@dataclasses.dataclass
class SavedRun:
    """An uninterrupted loader run (``repeat=False``) saved before every batch."""

    batches: list[list[str]]  # the first epoch, sample keys per batch
    next_epoch: list[list[str]]  # what the same loader gives after the first epoch ended
    states: list[Any]  # states[k]: saved after k batches (k = 0 .. len(batches))
    counts: list[dict[str, Any]]  # counts[k]: the encoder's counts at that save
    final: dict[str, Any]  # the counts of the whole first epoch


@pytest.fixture(scope="module")
def runs(dataset: Any, tokenizer: Any) -> dict[int, SavedRun]:
    """Per worker count. Saving does not change what a loader delivers, so one run serves every
    save point. Worker checkpoints are rare (``checkpoint_every_sec``): a restore replays."""
    out = {}
    for workers in (0, 2):
        encoder = make_encoder(tokenizer)
        loader = savable(dataset, encoder, workers, checkpoint_every_sec=1000)
        states, counts, batches = [loader.save_state_rank()], [encoder.stats.snapshot()], []
        it = iter(loader)
        while True:
            try:
                batches.append(list(next(it).sample_keys))
            except StopIteration:
                break
            states.append(loader.save_state_rank())
            counts.append(encoder.stats.snapshot())
        final = encoder.stats.snapshot()
        next_epoch = keys(list(loader))
        out[workers] = SavedRun(batches, next_epoch, states, counts, final)
    return out


def restored_run(
    dataset: Any, tokenizer: Any, workers: int, state: Any, **overrides: Any
) -> tuple[list[list[str]], dict[str, Any]]:
    """What a fresh loader restored from `state` delivers to the end, and its counts."""
    encoder = make_encoder(tokenizer, **overrides)
    loader = savable(dataset, encoder, workers)
    restore_loader_state(loader, state)
    return keys(list(loader)), encoder.stats.snapshot()


# ------------------------------------------------------------------ loader edges


# batch sizes with which some worker's packs do not fill its last batch
@pytest.mark.parametrize(("workers", "batch_size"), [(0, 4), (2, 3)])
def test_batch_drop_last_counts_the_last_short_batch_as_dropped_not_packed(
    dataset: Any, tokenizer: Any, workers: int, batch_size: int
) -> None:
    runs = {}
    for drop_last in (False, True):
        encoder = make_encoder(tokenizer, batch_size=batch_size)
        loader = get_loader(
            train_dataset(dataset, encoder, workers, drop_last=drop_last),
            watchdog_timeout_seconds=None,
        )
        batches = list(loader)
        runs[drop_last] = (batches, encoder.stats.snapshot())
    (kept, every), (dropped, stats) = runs[False], runs[True]
    short = [b for b in kept if len(b.packs) < batch_size]
    assert short, "some worker ends on a short batch"
    # the same batches, less each worker's last short one (the encoder drops it, as Energon)
    assert all(len(b.packs) == batch_size for b in dropped)
    assert sorted(keys(dropped)) == sorted(keys([b for b in kept if b not in short]))
    lost = n_samples(keys(short))
    assert stats["dropped"] == {"batch_drop_last": lost}
    assert stats["packed"] == n_samples(keys(dropped)) == every["packed"] - lost
    assert stats["packs"] == sum(len(b.packs) for b in dropped)
    assert stats["seen"] == dataset.num_samples == ends(stats)
    assert every["dropped_total"] == 0 and ends(every) == dataset.num_samples


class InjectedBatchFault(RuntimeError):
    """What the failing encoders raise for the batch that holds the victim."""


def _victim(dataset: Any) -> str:
    return sorted(dataset.keys_with("ok"))[5]


class FailsInBatch(PackingTaskEncoder):
    victim: str

    @stateless
    def batch(self, samples: list[Any]) -> Any:
        if any(self.victim in p.sample_keys for p in samples):
            raise InjectedBatchFault(f"batch of {self.victim}")
        return super().batch(samples)


class FailsInEncodeBatch(PackingTaskEncoder):
    victim: str

    @stateless
    def encode_batch(self, batch: Any) -> Any:
        if self.victim in batch.sample_keys:
            raise InjectedBatchFault(f"batch of {self.victim}")
        return batch


class FailsAfterSuperBatch(PackingTaskEncoder):
    """A subclass that checks the batch it built (a validation step) and refuses it."""

    victim: str

    @stateless
    def batch(self, samples: list[Any]) -> Any:
        built = super().batch(samples)
        if self.victim in built.sample_keys:
            raise InjectedBatchFault(f"batch of {self.victim}")
        return built


@pytest.mark.parametrize("cls", [FailsInBatch, FailsInEncodeBatch, FailsAfterSuperBatch])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_batch_that_fails_counts_its_samples_only_as_failed(
    dataset: Any, tokenizer: Any, runs: Any, workers: int, cls: type[Any]
) -> None:
    encoder = make_encoder(tokenizer, cls)
    encoder.victim = _victim(dataset)
    loader = get_loader(train_dataset(dataset, encoder, workers), watchdog_timeout_seconds=None)
    delivered = list(loader)
    batches = keys(delivered)
    stats = encoder.stats.snapshot()
    clean = runs[workers].final
    lost = clean["packed"] - n_samples(batches)
    assert lost >= 1 and encoder.victim not in {k for b in batches for k in b}
    assert stats["packed"] == n_samples(batches)
    assert stats["packs"] == sum(len(b.packs) for b in delivered)
    assert stats["failed_by_reason"]["InjectedBatchFault"] == lost
    assert stats["failed"] == clean["failed"] + lost
    assert stats["seen"] == dataset.num_samples == ends(stats)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_plain_worker_config_still_counts_failures(
    dataset: Any, tokenizer: Any, runs: Any, workers: int
) -> None:
    encoder = make_encoder(tokenizer)
    plain = WorkerConfig(rank=0, world_size=1, num_workers=workers)
    loader = get_loader(
        train_dataset(dataset, encoder, workers, worker_config=plain),
        watchdog_timeout_seconds=None,
    )
    batches = keys(list(loader))
    stats = encoder.stats.snapshot()
    assert stats["failed"] == len(dataset.keys_with("broken:")) > 0
    assert stats["seen"] == dataset.num_samples == ends(stats)
    assert additive(stats) == additive(runs[workers].final)
    assert n_samples(batches) == stats["packed"]


def test_a_worker_config_shared_by_two_encoders_counts_each_failure_once(
    dataset: Any, tokenizer: Any
) -> None:
    plain = WorkerConfig(rank=0, world_size=1, num_workers=0)
    first, second = make_encoder(tokenizer), make_encoder(tokenizer)
    loaders = [
        get_loader(train_dataset(dataset, e, 0, worker_config=plain), watchdog_timeout_seconds=None)
        for e in (first, second)
    ]
    for loader in loaders:
        list(loader)
    broken = len(dataset.keys_with("broken:"))
    for encoder in (first, second):
        stats = encoder.stats.snapshot()
        assert stats["failed"] == broken, "each encoder counts its own dataset's failures once"
        assert ends(stats) == dataset.num_samples
    # and a worker config made for the encoder is not wrapped twice
    third = make_encoder(tokenizer)
    list(get_loader(train_dataset(dataset, third, 0), watchdog_timeout_seconds=None))
    assert third.stats.snapshot()["failed"] == broken


# ------------------------------------------------------------------ restore accounting


def _buffered(state: Any) -> int:
    """Samples a 0-worker loader state holds in its buffers (read, not yet packed)."""
    todo, n = [state.worker_states[0]], 0
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            if node.get("__class__") == "SavableSampleBuffer":
                n += len(node["_restore_keys"])
            todo.extend(node.values())
        elif isinstance(node, list):
            todo.extend(node)
    return n


@pytest.mark.parametrize("save_after", [2, 3, 5])
def test_without_workers_the_saved_and_restored_counts_add_up_to_the_uninterrupted_run(
    dataset: Any, tokenizer: Any, runs: Any, save_after: int
) -> None:
    """The counts at the save plus the restored run's are exactly the uninterrupted run's: the
    samples of the saved buffers (read before the save, packed after) are not counted again."""
    run = runs[0]
    state = run.states[save_after]
    buffered = _buffered(state)
    assert buffered > 0, "saved mid-buffer"
    after, counts = restored_run(dataset, tokenizer, 0, state)
    assert run.batches[:save_after] + after == run.batches
    assert counts["packed"] == n_samples(after)
    assert add(additive(run.counts[save_after]), additive(counts)) == additive(run.final)
    # the buffered samples are the difference: read before the save, ended after it
    assert ends(counts) - counts["seen"] == buffered


def test_with_workers_a_restored_run_counts_only_what_follows_the_save(
    dataset: Any, tokenizer: Any, runs: Any
) -> None:
    """Energon restores each worker from its last internal checkpoint (here: its first batch,
    ``checkpoint_every_sec`` being long) and replays the batches up to the save, throwing them
    away: the restored run counts none of them, so the uninterrupted run's counts less the
    restored run's are those of the samples read before the save."""
    run, save_after = runs[2], 6
    state = run.states[save_after]
    assert max(s.offset for s in state.worker_states) >= 2, "the restore replays batches"
    after, counts = restored_run(dataset, tokenizer, 2, state)
    before = run.batches[:save_after]
    assert before + after == run.batches
    assert counts["packed"] == n_samples(after)
    assert sub(run.final, counts, "packed") == n_samples(before)
    for name in ("seen", "skipped_total", "failed", "packs"):
        assert 0 <= counts[name] <= run.final[name], name
    # read before the save, delivered after: at most each worker's packing buffer
    buffered = (
        sub(run.final, counts, "seen")
        - n_samples(before)
        - sub(run.final, counts, "skipped_total")
        - sub(run.final, counts, "failed")
    )
    assert 0 <= buffered <= 2 * BUFFER
    assert ends(counts) == counts["seen"] + buffered


# ------------------------------------------------------------------ checkpoints at the edges


def test_a_step_zero_checkpoint_is_restored(dataset: Any, tokenizer: Any, runs: Any) -> None:
    """A loader with workers saves ``None`` before its first batch; Energon restores it as the
    start, and so does ``restore_loader_state``."""
    run = runs[2]
    assert run.states[0] is None
    batches, counts = restored_run(dataset, tokenizer, 2, None)
    assert batches == run.batches
    assert additive(counts) == additive(run.final)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_state_saved_after_the_last_batch_restores_to_the_next_epoch(
    dataset: Any, tokenizer: Any, runs: Any, workers: int
) -> None:
    """``repeat=False``: saved after the epoch's last batch, the restored loader starts the next
    epoch, as the uninterrupted loader does (a state saved in the last batches is Energon's
    trap, documented at `restore_loader_state`)."""
    run = runs[workers]
    after, _ = restored_run(dataset, tokenizer, workers, run.states[len(run.batches)])
    assert after == run.next_epoch


_CHILD = textwrap.dedent(
    """
    import sys, warnings
    warnings.filterwarnings("ignore")
    import torch
    from megatron.energon import get_savable_loader, get_train_dataset
    from mmpack.energon import (
        PackingEncoderConfig, PackingTaskEncoder, make_worker_config, save_loader_state,
    )
    from mmpack_dev.synthetic import PATCH_SIZE, build_tokenizer

    metadataset, out = sys.argv[1], sys.argv[2]
    encoder = PackingTaskEncoder(
        PackingEncoderConfig(capacity={capacity}, packing_buffer_size={buffer},
                             batch_size={batch}, loss_mask_mode="precomputed",
                             algorithm="first_fit_decreasing"),
        tokenizer=build_tokenizer(), processor={{"patch_size": {patch}}},
    )
    ds = get_train_dataset(metadataset, worker_config=make_worker_config(encoder, num_workers=2),
                           batch_size={batch}, packing_buffer_size={buffer},
                           shuffle_buffer_size=None, max_samples_per_sequence=None,
                           task_encoder=encoder, repeat=False)
    loader = get_savable_loader(ds, watchdog_timeout_seconds=None)
    it = iter(loader)
    # Energon's save_state_rank() waits forever here: iter() ran, no worker started yet
    print("before the first batch:", save_loader_state(loader), flush=True)
    n = 0
    while True:
        try:
            next(it)
        except StopIteration:
            break
        n += 1
    torch.save(loader.save_state_rank(), out)
    print("saved after", n, flush=True)
    """
).format(capacity=CAPACITY, buffer=BUFFER, batch=BATCH, patch=PATCH_SIZE)


def test_saving_after_iter_and_after_the_epoch_ended_returns(
    dataset: Any, tokenizer: Any, runs: Any, tmp_path: Path
) -> None:
    """2 workers, in a child process with a timeout: `save_loader_state` between ``iter(loader)``
    and the first batch returns the start (``None``), where Energon's ``save_state_rank()``
    waits forever; ``save_state_rank()`` after ``StopIteration`` returns a state that restores
    to the start of the next epoch."""
    out = tmp_path / "state.pt"
    tests = Path(__file__).resolve().parents[1]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            p for p in (str(tests.parent / "dev"), str(tests), os.environ.get("PYTHONPATH")) if p
        ),
    }
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _CHILD, str(dataset.metadataset), str(out)],
            capture_output=True,
            text=True,
            timeout=200,
            env=env,
            check=False,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("saving the loader state hangs")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "before the first batch: None" in proc.stdout
    run = runs[2]
    assert f"saved after {len(run.batches)}" in proc.stdout
    after, _ = restored_run(dataset, tokenizer, 2, torch.load(out, weights_only=False))
    assert after == run.next_epoch


@pytest.mark.parametrize(
    ("workers", "save_after", "capacity", "error", "says"),
    [
        # a buffered sample the smaller capacity refuses: the restore itself stops
        (0, 3, 64, EnergonConfigError, r"sample '\w+' of the loader checkpoint being restored"),
        (2, 2, 64, EnergonConfigError, r"sample '\w+' of the loader checkpoint being restored"),
        # samples that fit, in a pack planned before the save that does not
        (0, 3, 256, FatalSampleError, r"over capacity 256: .* restored from the loader checkpoint"),
    ],
)
def test_resuming_with_a_smaller_capacity_names_the_checkpoint(
    dataset: Any,
    tokenizer: Any,
    runs: Any,
    workers: int,
    save_after: int,
    capacity: int,
    error: type[Exception],
    says: str,
) -> None:
    smaller = savable(dataset, make_encoder(tokenizer, capacity=capacity), workers)
    restore_loader_state(smaller, runs[workers].states[save_after])
    with pytest.raises(error, match=says) as info:
        list(smaller)
    message = str(info.value)
    assert "checkpoint" in message and "capacity" in message
    # not blamed on the encoder's hooks
    assert "pack_length must be" not in message and "check_policy must" not in message


@pytest.mark.parametrize("workers", [0, 2])
def test_a_loader_already_iterated_is_not_restored_into(
    dataset: Any, tokenizer: Any, runs: Any, workers: int
) -> None:
    loader = savable(dataset, make_encoder(tokenizer), workers)
    it = iter(loader)
    next(it)
    with pytest.raises(EnergonConfigError, match="has not been iterated yet"):
        restore_loader_state(loader, runs[workers].states[3])
    fresh = savable(dataset, make_encoder(tokenizer), workers)
    restore_loader_state(fresh, runs[workers].states[3])  # what to do instead
    assert keys(list(fresh)) == runs[workers].batches[3:]


def test_resuming_with_another_batch_size_without_workers_names_it(
    dataset: Any, tokenizer: Any, runs: Any
) -> None:
    other = savable(dataset, make_encoder(tokenizer, batch_size=BATCH + 1), 0)
    with pytest.raises(EnergonConfigError, match=rf"saved with batch_size={BATCH}, .*"):
        restore_loader_state(other, runs[0].states[3])


def test_resuming_in_another_mask_mode_names_the_checkpoint(
    dataset: Any, tokenizer: Any, runs: Any
) -> None:
    # the fragments format marks trainable spans that roles would not: precomputed masks only
    roles = savable(dataset, make_encoder(tokenizer, loss_mask_mode=None), 0)
    restore_loader_state(roles, runs[0].states[3])
    with pytest.raises(EnergonConfigError, match=r"loader checkpoint being restored") as info:
        list(roles)
    assert "SampleFormatError" in str(info.value) and "restore with the config" in str(info.value)


@pytest.mark.parametrize("workers", [0, 2])
def test_restore_batch_rebuilds_a_delivered_batch(
    dataset: Any, tokenizer: Any, workers: int
) -> None:
    encoder = make_encoder(tokenizer)
    loader = savable(dataset, encoder, workers)
    it = iter(loader)
    batches = [next(it) for _ in range(3)]
    before = encoder.stats.snapshot()
    key = batches[-1].__restore_key__
    # Energon's own call asserts for an encoder with a postencode_sample
    with pytest.raises(AssertionError):
        loader.restore_sample(key)
    rebuilt = restore_batch(loader, key)
    assert rebuilt.__restore_key__ == key
    assert rebuilt.sample_keys == batches[-1].sample_keys
    assert batch_digest(rebuilt) == batch_digest(batches[-1])
    if workers == 0:  # the workers of a running loader prepare batches meanwhile
        assert encoder.stats.snapshot() == before, "rebuilding counts nothing"
