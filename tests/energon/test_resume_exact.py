"""A run restored from a loader checkpoint in a fresh process continues exactly as the
uninterrupted run, and counts exactly what happens after the save.

The real Energon loader (2 workers) over a weighted blend of two datasets (both source formats),
with a shuffle buffer, a packing buffer larger than a pack, the packer that draws on its seed
(``first_fit_shuffle``), Qwen2-VL's real processor and tokenizer, samples skipped by policy and
samples that fail: bad JSON, a corrupt image, a missing media file (the dataset's), a decode and
a pack that raise (the encoder's, `support.resume_child.FailingEncoder`). In both mask modes.

Every run is a process in which no loader ran before (`support.resume_child`): the saving run,
the uninterrupted run and each restored run. The uninterrupted run's packs are compared with
the restored runs' at the same steps, field by field (keys, tokens, labels, loss and token
masks, positions, ``cu_seqlens``, media tensors with their rows and provenance).

Accounting: the encoder's counters are read when the workers have built every batch the loader
asked them for (``prefetch_factor`` per worker ahead of the trainer), so they are those of the
first ``k + PREFETCH_BATCHES`` batches of the stream, whatever the timing. The counts of the
uninterrupted run up to a save (read after ``save - PREFETCH_BATCHES`` batches) plus those of
the run restored from it equal the uninterrupted run's (`mmpack.energon.stats`: nothing Energon
redoes to restore is counted).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from megatron.energon import WorkerConfig
from megatron.energon.rng import SystemRng
from mmpack.energon.policy import stateless_with_tolerance
from mmpack.energon.stats import combine_snapshots
from mmpack.errors import EnergonConfigError
from mmpack_dev.energon_testing import active_worker
from mmpack_dev.synthetic import write_synthetic_dataset
from support.resume_child import CAPACITY, PREFETCH, ChildServer, Job

pytestmark = [pytest.mark.timeout(600)]

WORKERS = 2
#: Batches the workers build ahead of the trainer.
PREFETCH_BATCHES = PREFETCH * WORKERS
STEPS = 12
#: Before the first batch, mid-buffer, later.
SAVES = (0, 5, 9)

BLEND = """\
__module__: megatron.energon
__class__: MetadatasetV2
splits:
  train:
    blend:
      - weight: 2
        path: generic
        subflavors: {mmpack_format: generic}
      - weight: 1
        path: fragments
        subflavors: {mmpack_format: fragments}
        aux:
          media: filesystem://media
"""


@pytest.fixture(scope="module")
def blend(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    root = tmp_path_factory.mktemp("resume-blend")
    dataset = write_synthetic_dataset(
        root,
        60,
        seed=11,
        shards_per_format=2,
        capacity=CAPACITY,
        mean_words=12,
        broken_every=8,
        skip_every=11,
        media_pool=4,
    )
    fates = set(dataset.expected.values())
    assert {"broken:json", "broken:corrupt_image", "broken:missing_media"} <= fates
    path = root / "blend.yaml"
    path.write_text(BLEND)
    return path, dataset


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    with ChildServer(tmp_path_factory.mktemp("resume-jobs")) as child:
        yield child


def _job(blend: tuple[Path, Any], out: Path, **fields: Any) -> Job:
    path, dataset = blend
    good = sorted(k for k, v in dataset.expected.items() if v == "ok")
    fields.setdefault("mode", "precomputed")
    return Job(
        blend=str(path),
        out=str(out),
        fail_decode=frozenset(good[3::11]),
        fail_pack=frozenset(good[8::19]),
        workers=WORKERS,
        **fields,
    )


def _first_difference(got: list[Any], want: list[Any]) -> str | None:
    """Where two lists of batches first differ (None when equal), without printing them."""
    for i, (a, b) in enumerate(zip(got, want, strict=False)):
        if a != b:
            return f"batch {i}: keys {a[0]} != {b[0]}" if a[0] != b[0] else f"batch {i} ({a[0]})"
    if len(got) != len(want):
        return f"{len(got)} batches != {len(want)}"
    return None


def _counts(snapshot: dict[str, Any]) -> dict[str, Any]:
    """The counts of a snapshot (not the timings)."""
    return {k: v for k, v in snapshot.items() if not k.endswith("_ns") and k != "settled"}


def test_packs_do_not_depend_on_a_loader_that_ran_before_in_the_process(
    blend: tuple[Path, Any], server: Any, tmp_path: Path
) -> None:
    """Energon's ``@stateless(restore_seeds=True)`` keeps the worker seed of its first call in
    the process: a dry run with 0 workers made every worker of the real loader pack with the
    main process's seed. The packer's seed must come from the loader's own state."""
    fresh = server.run(_job(blend, tmp_path / "fresh", steps=8))
    after_dry_run = server.run(_job(blend, tmp_path / "after", steps=8, dry_run=True))
    difference = _first_difference(after_dry_run["batches"], fresh["batches"])
    assert difference is None, f"packs after a dry run differ from a fresh process's: {difference}"


class Augment:
    """Hooks that draw random numbers, as an augmentation does."""

    current_sample_index = 3

    @stateless_with_tolerance(restore_seeds=True)
    def draw(self) -> float:
        return random.random()

    @stateless_with_tolerance(restore_seeds=True)
    def draws(self) -> Iterator[float]:
        yield random.random()
        yield random.random()


def test_seeded_hooks_draw_from_the_worker_running_them() -> None:
    """Energon's wrapper would draw the first call's numbers again under another worker
    config (here another ``seed_offset``), for the rest of the process."""
    hooks = Augment()
    drawn = {}
    for offset in (0, 1):
        config = WorkerConfig(rank=0, world_size=1, num_workers=0, seed_offset=offset)
        with active_worker(config):
            outside = random.getstate()
            drawn[offset] = (hooks.draw(), list(hooks.draws()))
            assert random.getstate() == outside  # the caller's random state is left alone
        # the numbers Energon's wrapper draws in a process where nothing ran before
        rng = random.Random(SystemRng.get_seed_from_args(config.worker_seed(), 3))
        first = rng.random()
        assert drawn[offset] == (first, [first, rng.random()])
    assert drawn[0] != drawn[1]
    with pytest.raises(EnergonConfigError, match="outside an active Energon worker"):
        hooks.draw()


@pytest.mark.parametrize(
    ("mode", "checkpoint"), [("roles", "every_batch"), ("precomputed", "default")]
)
def test_a_run_restored_in_a_fresh_process_continues_exactly(
    blend: tuple[Path, Any], server: Any, tmp_path: Path, mode: str, checkpoint: str
) -> None:
    """``every_batch``: Energon checkpoints each worker at every batch, so a restore re-creates
    the saved buffers (shuffle, reading and packing) from their samples' restore keys;
    ``default`` (every 60 s): each worker replays from its start to the save."""

    def job(name: str, **fields: Any) -> Job:
        return _job(blend, tmp_path / name, mode=mode, checkpoint=checkpoint, **fields)

    saving = server.run(job("saving", steps=STEPS + PREFETCH_BATCHES, save_at=SAVES))

    def built(first: int, last: int) -> tuple[int, int]:
        """The ``packed`` and ``packs`` counts of batches ``first`` to ``last`` (excluded)."""
        batches = saving["batches"][first:last]
        return sum(len(keys) for keys, _ in batches), sum(len(packs) for _, packs in batches)

    settle = {s - PREFETCH_BATCHES: built(0, s) for s in SAVES if s >= PREFETCH_BATCHES}
    settle[STEPS] = built(0, STEPS + PREFETCH_BATCHES)
    whole = server.run(job("whole", steps=STEPS, settle=settle))
    # saving states changes nothing
    assert _first_difference(whole["batches"], saving["batches"][:STEPS]) is None
    total = whole["stats"][STEPS]
    assert all(snap["settled"] for snap in whole["stats"].values()), whole["stats"]
    # the stream holds every kind of fault and skip, from both sources
    assert total["failed_by_reason"].get("SampleFormatError", 0) >= 2, total
    assert total["failed_by_reason"].get("InjectedFault", 0) >= 2, total
    assert total["skipped_total"] >= 2, total
    keys = {k for batch_keys, _ in whole["batches"] for k in batch_keys}
    assert any(k.startswith("gene") for k in keys) and any(k.startswith("frag") for k in keys)
    if checkpoint == "every_batch":
        # the save after 5 batches fell mid-buffer: planned groups not yet packed
        assert any(saving["buffers"][5]), saving["buffers"]

    for save in SAVES:
        restored = server.run(
            job(
                f"restored{save}",
                steps=STEPS - save,
                restore=saving["states"][save],
                settle={STEPS - save: built(save, STEPS + PREFETCH_BATCHES)},
            )
        )
        difference = _first_difference(restored["batches"], whole["batches"][save:])
        assert difference is None, f"restored at step {save}: {difference}"
        after = restored["stats"][STEPS - save]
        assert after["settled"], (save, after)
        # the counts up to the save plus the restored run's are the uninterrupted run's
        before = [whole["stats"][save - PREFETCH_BATCHES]] if save else []
        assert _counts(combine_snapshots([*before, after])) == _counts(total), save
