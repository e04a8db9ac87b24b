"""Failure and skip policy of `PackingTaskEncoder`, on the real Energon loader where it
matters: a broken or all-skipped dataset stops the job with a clear error (never an endless
loop), every hook keeps a finite failure tolerance, a few bad samples are dropped and counted
while the rest trains, subclass hooks must stay restorable, and hooks that use randomness run
in any test from a `WorkerConfig` fixture."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from megatron.energon import SkipSample, get_loader, get_train_dataset, stateless
from megatron.energon.errors import FatalSampleError
from megatron.energon.task_encoder.base import get_failure_tolerance, get_stateless
from mmpack.energon import (
    PackingEncoderConfig,
    PackingTaskEncoder,
    cook_generic,
    make_worker_config,
    stateless_with_tolerance,
)
from mmpack.energon.policy import seeded
from mmpack.errors import EnergonConfigError, TurnStructureError
from mmpack_dev.synthetic import PATCH_SIZE, write_synthetic_dataset

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*pin_memory.*:UserWarning"),
    pytest.mark.timeout(240),
]


def make_encoder(
    tokenizer: Any, cls: type[PackingTaskEncoder] = PackingTaskEncoder, **changes: Any
) -> PackingTaskEncoder:
    cfg = PackingEncoderConfig(
        **{"capacity": 512, "packing_buffer_size": 8, "batch_size": 2, **changes}
    )
    return cls(cfg, tokenizer=tokenizer, processor={"patch_size": PATCH_SIZE})


def iterate(path: Path, encoder: PackingTaskEncoder, workers: int, *, repeat: bool) -> list[Any]:
    dataset = get_train_dataset(
        str(path),
        worker_config=make_worker_config(encoder, num_workers=workers),
        **encoder.dataset_options(),
        shuffle_buffer_size=None,
        max_samples_per_sequence=None,
        task_encoder=encoder,
        repeat=repeat,
    )
    return list(get_loader(dataset, watchdog_timeout_seconds=None))


# -- hooks that use randomness run outside a loader -----------------------------------------------


class RandomDropEncoder(PackingTaskEncoder):
    """An augmentation that uses randomness: only from restore_seeds=True."""

    @stateless_with_tolerance(restore_seeds=True)
    def preencode_sample(self, sample: Any) -> Any:
        import random

        encoded = super().preencode_sample(sample)
        keep = random.randint(1, len(encoded.token_ids))
        return type(encoded).derive_from(
            encoded,
            token_ids=encoded.token_ids[:keep],
            loss_mask=encoded.loss_mask,
            message_lengths=encoded.message_lengths,
            message_roles=encoded.message_roles,
            media=encoded.media,
            media_units=encoded.media_units,
        )


def test_restore_seeded_hooks_run_from_a_worker_fixture(tokenizer: Any, worker: Any) -> None:
    enc = make_encoder(tokenizer, RandomDropEncoder)
    raw = {
        "__key__": "k",
        "__restore_key__": ("t", 0),
        "json": b'{"messages": [{"role": "user", "content": "kaka mimi lolo"}, '
        b'{"role": "assistant", "content": "lolo kaka mimi nene susu"}]}',
    }
    conv = cook_generic(raw)
    first = [len(enc.preencode_sample(conv).token_ids) for _ in range(3)]
    assert len(set(first)) == 1, "same sample index -> same randomness"
    lengths = set()
    for index in range(8):
        worker.worker_push_sample_index(index)
        try:
            lengths.add(len(enc.preencode_sample(conv).token_ids))
        finally:
            worker.worker_pop_sample_index()
    assert len(lengths) > 1, "the seed follows the sample index"


# -- a broken dataset stops; every tolerance is finite --------------------------------------------


@pytest.fixture(scope="module")
def broken_dataset(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return write_synthetic_dataset(
        tmp_path_factory.mktemp("all-broken"),
        40,
        formats=("generic",),
        shards_per_format=2,
        image_fraction=0.0,
        all_fates="broken",
    )


@pytest.mark.parametrize("workers", [0, 2])
def test_all_broken_dataset_stops(broken_dataset: Any, tokenizer: Any, workers: int) -> None:
    enc = make_encoder(tokenizer)
    with pytest.raises(FatalSampleError, match="failed 100 times in a row"):
        iterate(broken_dataset.metadataset, enc, workers, repeat=True)
    assert enc.stats.snapshot()["failed"] >= 100


def test_zero_failure_tolerance_is_rejected_with_an_explanation() -> None:
    with pytest.raises(EnergonConfigError, match="Energon reads 0 as 'never stop'"):
        PackingEncoderConfig(failure_tolerance=0)
    with pytest.raises(EnergonConfigError, match="never stop"):
        stateless_with_tolerance(failure_tolerance=0)


def _wrappers(dataset: Any) -> Iterator[Any]:
    stack, seen = [dataset], set()
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        yield node
        inner = node.__dict__.get("datasets") or (
            [node.__dict__["dataset"]] if "dataset" in node.__dict__ else []
        )
        stack.extend(x[0] if isinstance(x, tuple) else x for x in inner)


def test_every_failure_counter_of_the_pipeline_is_finite(
    broken_dataset: Any, tokenizer: Any
) -> None:
    """A tolerance of 0 would also disable the stop in Energon's packing loop: every error
    context Energon builds for the task encoder (cooker, encode, pre-packer, sample encoder,
    final packer, batch) gets the configured finite tolerance."""
    enc = make_encoder(tokenizer, failure_tolerance=37)
    dataset = get_train_dataset(
        str(broken_dataset.metadataset),
        worker_config=make_worker_config(enc, num_workers=0),
        **enc.dataset_options(),
        shuffle_buffer_size=None,
        max_samples_per_sequence=None,
        task_encoder=enc,
    )
    contexts = {}
    for node in _wrappers(dataset):
        for name, value in vars(node).items():
            if type(value).__name__ == "ErrorContext":
                contexts[f"{type(node).__name__}.{name}: {value.name}"] = value.tolerance
    ours = {k: v for k, v in contexts.items() if "_load_sample_raw" not in k}
    assert all(v > 0 for v in contexts.values()), contexts  # Energon's raw reader: its own 100
    assert len(ours) >= 7 and set(ours.values()) == {37}, ours
    assert any("pre_packer" in k.lower() or "select_samples_to_pack" in k for k in ours), ours
    assert any("cook_crude_sample" in k for k in ours), ours


def test_few_broken_samples_train_on_the_rest_and_are_counted(
    tmp_path: Path, tokenizer: Any
) -> None:
    ds = write_synthetic_dataset(
        tmp_path, 60, formats=("generic",), shards_per_format=1, broken_every=10, skip_every=0
    )
    enc = make_encoder(tokenizer, capacity=2048)
    batches = iterate(ds.metadataset, enc, 0, repeat=False)
    delivered = [k for b in batches for k in b.sample_keys]
    stats = enc.stats.snapshot()
    assert sorted(delivered) == sorted(ds.keys_with("ok"))
    assert stats["failed"] == len(ds.keys_with("broken:")) == 6
    assert len(delivered) + stats["failed"] + stats["skipped_total"] == 60


def test_stateless_restore_seeds_keeps_failure_tolerance(tmp_path: Path, tokenizer: Any) -> None:
    """Energon's bug: @stateless(restore_seeds=True, failure_tolerance=N) ignores N."""

    def f(self: Any, x: Any) -> Any:
        return x

    assert get_failure_tolerance(stateless(restore_seeds=True, failure_tolerance=5)(f), 100) == 100
    fixed = stateless_with_tolerance(restore_seeds=True, failure_tolerance=5)(f)
    assert get_failure_tolerance(fixed, 100) == 5
    assert get_stateless(fixed)

    class AlwaysFails(PackingTaskEncoder):
        @stateless_with_tolerance(restore_seeds=True, failure_tolerance=5)
        def preencode_sample(self, sample: Any) -> Any:
            raise ValueError(f"cannot encode {sample.__key__}")

    ds = write_synthetic_dataset(
        tmp_path, 12, formats=("generic",), shards_per_format=1, broken_every=0, skip_every=0
    )
    enc = make_encoder(tokenizer, AlwaysFails)
    with pytest.raises(FatalSampleError, match="failed 5 times in a row"):
        iterate(ds.metadataset, enc, 0, repeat=True)
    assert enc.stats.snapshot()["failed"] == 5


def test_subclass_hooks_must_stay_stateless_and_finite(tokenizer: Any) -> None:
    class NotStateless(PackingTaskEncoder):
        def preencode_sample(self, sample: Any) -> Any:  # no @stateless: breaks resume
            return super().preencode_sample(sample)

    with pytest.raises(EnergonConfigError, match="preencode_sample is not @stateless"):
        make_encoder(tokenizer, NotStateless)

    class NeverStops(PackingTaskEncoder):
        @stateless(failure_tolerance=0)
        def pack_selected_samples(self, samples: Any) -> Any:
            return super().pack_selected_samples(samples)

    with pytest.raises(EnergonConfigError, match="pack_selected_samples has failure_tolerance=0"):
        make_encoder(tokenizer, NeverStops)


def test_a_hook_seeded_by_energons_cached_seed_is_refused(tokenizer: Any) -> None:
    # Energon's restore_seeds wrapper keeps the seed of its first call in the process: packs
    # would depend on what ran before, and a resume in a fresh process would differ
    class EnergonSeeded(PackingTaskEncoder):
        @stateless(restore_seeds=True)
        def select_samples_to_pack(self, samples: Any) -> Any:
            return super().select_samples_to_pack(samples)

    with pytest.raises(EnergonConfigError, match=r"select_samples_to_pack is seeded by Energon"):
        make_encoder(tokenizer, EnergonSeeded)

    class OwnSeeded(PackingTaskEncoder):
        @seeded
        def select_samples_to_pack(self, samples: Any) -> Any:
            return super().select_samples_to_pack(samples)

    assert isinstance(make_encoder(tokenizer, OwnSeeded), OwnSeeded)


# -- policy skips: counted, never an IndexError, and an all-skipped dataset stops -----------------


def test_conversation_ending_on_user_turn_is_skipped_not_indexerror(
    tokenizer: Any, worker: Any
) -> None:
    enc = make_encoder(tokenizer)
    raw = {
        "__key__": "ends-on-user",
        "__restore_key__": ("t", 1),
        "json": b'{"messages": [{"role": "user", "content": "kaka"}, {"role": "assistant", '
        b'"content": "lolo"}, {"role": "user", "content": "mimi"}]}',
    }
    with pytest.raises(SkipSample, match="ends_on_user_turn"):
        enc.preencode_sample(cook_generic(raw))
    assert enc.stats.snapshot()["skipped"]["ends_on_user_turn"] == 1
    # token-level turn markers: an odd count is a typed error naming the sample
    from mmpack.batch.masks import turn_spans

    with pytest.raises(TurnStructureError, match="ends-on-user"):
        turn_spans([3, 10, 4, 11, 3, 12], [3, 4], sample_id="ends-on-user")


@pytest.fixture(scope="module")
def skipped_dataset(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return write_synthetic_dataset(
        tmp_path_factory.mktemp("all-skipped"),
        30,
        formats=("generic", "fragments"),
        shards_per_format=2,
        all_fates="skip",
        capacity=512,
    )


@pytest.mark.parametrize("workers", [0, 2])
def test_all_skipped_dataset_stops_with_a_clear_error(
    skipped_dataset: Any, tokenizer: Any, workers: int
) -> None:
    enc = make_encoder(tokenizer, max_consecutive_skips=300, loss_mask_mode="precomputed")
    with pytest.raises(
        FatalSampleError, match=r"300 consecutive samples were skipped by policy \("
    ):
        iterate(skipped_dataset.metadataset, enc, workers, repeat=True)
    stats = enc.stats.snapshot()
    assert stats["skipped_total"] >= 300
    assert stats["packed"] == 0
