"""mmpack packing on the real Megatron-Energon loader, over real WebDataset shards written by the
test: native == reference packs, checkpoint save/restore, every sample accounted for, lazy media.
"""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import pytest
from megatron.energon import SkipSample, get_loader, get_savable_loader, get_train_dataset
from mmpack.energon import (
    MEDIA_LOG,
    PackingEncoderConfig,
    PackingTaskEncoder,
    make_worker_config,
    restore_loader_state,
)
from mmpack.errors import EnergonConfigError
from mmpack_dev.energon_testing import active_worker, batch_digest, batch_view
from mmpack_dev.synthetic import PATCH_SIZE, write_synthetic_dataset
from reference.energon import ReferencePackingTaskEncoder

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*pin_memory.*:UserWarning"),
    pytest.mark.timeout(240),
]

CAPACITY = 512
N_SAMPLES = 160
BUFFER = 16
BATCH = 2


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("energon-mixed")
    return write_synthetic_dataset(
        root,
        N_SAMPLES,
        seed=1,
        shards_per_format=2,
        capacity=CAPACITY,
        mean_words=20,
        broken_every=25,
        skip_every=12,
        media_pool=6,
    )


def make_encoder(tokenizer: Any, cls: type[Any] = PackingTaskEncoder, **overrides: Any) -> Any:
    # NeMo-RL's first-fit-decreasing: the reference packer implements the same algorithm
    overrides.setdefault("algorithm", "first_fit_decreasing")
    overrides.setdefault("loss_mask_mode", "precomputed")
    config = PackingEncoderConfig(
        capacity=CAPACITY, packing_buffer_size=BUFFER, batch_size=BATCH, **overrides
    )
    return cls(config, tokenizer=tokenizer, processor={"patch_size": PATCH_SIZE})


def train_dataset(path: Path, encoder: Any, workers: int, *, repeat: bool) -> Any:
    return get_train_dataset(
        str(path),
        worker_config=make_worker_config(encoder, num_workers=workers),
        batch_size=BATCH,
        packing_buffer_size=BUFFER,
        shuffle_buffer_size=None,
        max_samples_per_sequence=None,
        task_encoder=encoder,
        repeat=repeat,
    )


def run_epoch(path: Path, encoder: Any, workers: int) -> list[Any]:
    loader = get_loader(
        train_dataset(path, encoder, workers, repeat=False), watchdog_timeout_seconds=None
    )
    return list(loader)


@pytest.fixture(scope="module")
def epochs(dataset: Any, tokenizer: Any) -> dict[tuple[int, str], tuple[list[Any], dict[str, Any]]]:
    """One full epoch per (workers, implementation): the batches and the encoder's counters."""
    out = {}
    for workers in (0, 2):
        for name, cls in (
            ("native", PackingTaskEncoder),
            ("reference", ReferencePackingTaskEncoder),
        ):
            encoder = make_encoder(tokenizer, cls)
            batches = run_epoch(dataset.metadataset, encoder, workers)
            out[(workers, name)] = (batches, encoder.stats.snapshot())
    return out


@pytest.mark.parametrize("workers", [0, 2])
def test_packed_batches_equal_reference_sample_for_sample(epochs: Any, workers: int) -> None:
    """What reaches the trainer, as plain data: every field, the media's segments, which of
    them the rows share, and the materialized media."""
    native, _ = epochs[(workers, "native")]
    reference, _ = epochs[(workers, "reference")]
    assert len(native) == len(reference) > 10
    shared = 0
    for got, want in zip(native, reference, strict=True):
        assert got.sample_keys == want.sample_keys
        assert batch_view(got) == batch_view(want)
        for pack in got.packs:
            indices = pack.media["pixel_values"]._segment_indices
            shared += len(indices) - len(set(indices))
    # the comparison covers deduplicated media: some pack holds one item twice
    assert shared > 0


@pytest.mark.parametrize(
    "overrides",
    [
        # masks from roles: the fragments whose reasoning is not trained on fail to encode
        {"loss_mask_mode": None},
        {"pad_to_multiple_of": 8, "cp_size": 2, "algorithm": "modified_first_fit_decreasing"},
        {"media_identity": "content", "algorithm": "concatenative"},
    ],
    ids=["roles", "padded-mffd", "content-identity"],
)
def test_packed_batches_equal_reference_under_other_settings(
    dataset: Any, tokenizer: Any, overrides: dict[str, Any]
) -> None:
    runs = {}
    for name, cls in (("native", PackingTaskEncoder), ("reference", ReferencePackingTaskEncoder)):
        encoder = make_encoder(tokenizer, cls, **overrides)
        batches = run_epoch(dataset.metadataset, encoder, 0)
        runs[name] = ([batch_view(b) for b in batches], encoder.stats.snapshot())
    (native, got), (reference, want) = runs["native"], runs["reference"]
    assert len(native) > 5
    assert native == reference
    for field in ("seen", "packed", "skipped", "failed"):
        assert got[field] == want[field], field


@pytest.mark.parametrize("name", ["native", "reference"])
@pytest.mark.parametrize("workers", [0, 2])
def test_every_sample_is_accounted_for(dataset: Any, epochs: Any, workers: int, name: str) -> None:
    batches, stats = epochs[(workers, name)]
    delivered = [k for b in batches for k in b.sample_keys]
    counts = collections.Counter(delivered)
    assert max(counts.values()) == 1, "a sample was packed twice"
    assert set(delivered) == dataset.keys_with("ok")
    expected_skips = collections.Counter(
        v.split(":", 1)[1] for v in dataset.expected.values() if v.startswith("skip:")
    )
    assert {k: v for k, v in stats["skipped"].items() if v} == dict(expected_skips)
    assert stats["failed"] == len(dataset.keys_with("broken:"))
    assert stats["seen"] == dataset.num_samples
    assert len(delivered) + stats["skipped_total"] + stats["failed"] == dataset.num_samples
    # every pack respects the capacity, padding included, and holds whole samples
    for b in batches:
        for pack in b.packs:
            assert int(pack.cu_seqlens_padded[-1]) <= CAPACITY
            assert len(pack.sample_ids) == len(pack.cu_seqlens) - 1


def _take(it: Any, n: int) -> list[Any]:
    return [batch_digest(next(it)) for _ in range(n)]


@pytest.mark.parametrize("workers", [0, 2])
def test_save_restore_mid_epoch_gives_identical_batches(
    dataset: Any, tokenizer: Any, workers: int
) -> None:
    def loader() -> Any:
        encoder = make_encoder(tokenizer)
        return get_savable_loader(
            train_dataset(dataset.metadataset, encoder, workers, repeat=True),
            checkpoint_every_sec=0,
            checkpoint_every_min_n_samples=1,
            watchdog_timeout_seconds=None,
        )

    first = loader()
    it = iter(first)
    _take(it, 5)
    state = first.save_state_rank()
    expected = _take(it, 8)
    del it, first

    second = loader()
    restore_loader_state(second, state)
    got = _take(iter(second), 8)
    assert got == expected


def test_restore_with_different_worker_count_is_a_clear_error(dataset: Any, tokenizer: Any) -> None:
    encoder = make_encoder(tokenizer)
    first = get_savable_loader(
        train_dataset(dataset.metadataset, encoder, 0, repeat=True), watchdog_timeout_seconds=None
    )
    it = iter(first)
    next(it)
    state = first.save_state_rank()
    del it, first
    other = get_savable_loader(
        train_dataset(dataset.metadataset, make_encoder(tokenizer), 2, repeat=True),
        watchdog_timeout_seconds=None,
    )
    with pytest.raises(EnergonConfigError, match=r"saved with num_workers=0.*num_workers=2"):
        restore_loader_state(other, state)


def test_media_is_decoded_only_for_packed_samples(dataset: Any, tokenizer: Any) -> None:
    """Lazy media: with 0 workers every decode happens in this process, so the log is complete."""
    MEDIA_LOG.clear()
    encoder = make_encoder(tokenizer)
    batches = run_epoch(dataset.metadataset, encoder, 0)
    decoded = collections.Counter(MEDIA_LOG.decodes)
    expected: collections.Counter[str] = collections.Counter()
    for b in batches:
        for pack in b.packs:
            for value in pack.media.values():
                assert value._segment_indices is not None
    # what the packed samples reference, one decode per (pack, media item): an item shared
    # by several samples of a pack is decoded once for it
    packed = {k for b in batches for k in b.sample_keys}
    for b in batches:
        for pack in b.packs:
            expected.update({m for k in pack.sample_ids for m in _media_identities(dataset, k)})
    assert decoded == expected
    assert encoder.stats.snapshot()["decoded"] == sum(expected.values())
    # nothing of a skipped or broken sample, and no unused manifest entry, was decoded
    assert not any("unused.png" in d for d in decoded)
    not_packed = set(dataset.expected) - packed
    generic = f"{dataset.root / 'generic'}/"
    assert not any(d.split("/")[-2] in not_packed for d in decoded if d.startswith(generic))


def _media_identities(dataset: Any, key: str) -> list[str]:
    import json
    import tarfile

    fmt = "generic" if key.startswith("gene") else "fragments"
    for shard in sorted((dataset.root / fmt).glob("*.tar")):
        with tarfile.open(shard) as tar:
            try:
                member = tar.extractfile(f"{key}.json")
            except KeyError:
                continue
            assert member is not None
            obj = json.loads(member.read())
            if fmt == "generic":
                n = sum(m["content"].count("<image>") for m in obj["messages"])
                where = f"{dataset.root / fmt}/{shard.name}/{key}"
                return [f"{where}/{e['name']}" for e in obj["media"][:n]]
            refs = {f["media"] for t in obj["conversation"] for f in t["fragments"] if "media" in f}
            return [f"{dataset.root / 'media'}/{r}" for r in refs]
    raise AssertionError(f"{key} not found")


def test_empty_group_is_skipped_not_a_crash(tokenizer: Any) -> None:
    encoder = make_encoder(tokenizer)
    with active_worker(), pytest.raises(SkipSample):
        encoder.pack_selected_samples([])
    assert encoder.stats.snapshot()["empty_pack"] == 1
