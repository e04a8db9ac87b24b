"""Capacity is the padded length of a pack. The encoder plans packs on each sample's padded
length (``pad_to_multiple_of``, and ``2 * cp_size`` for context parallelism), the oversize check
reads the same length, so every pack the real builder makes fits ``capacity`` and
``micro_batch(pad_to_length=capacity * batch_size)`` takes every batch; samples too long are
skipped with their reason (or fail by name), never lost. Run on packs built by hand and through
the real Energon loader over WebDataset shards."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from megatron.energon import SkipSample, get_loader, get_train_dataset
from mmpack.batch import PackedBatch
from mmpack.batch.options import BatchOptions
from mmpack.energon import (
    Conversation,
    PackingEncoderConfig,
    PackingTaskEncoder,
    cook_generic,
    make_worker_config,
)
from mmpack.errors import EnergonConfigError, SampleFormatError
from mmpack_dev.energon_testing import active_worker
from mmpack_dev.synthetic import PATCH_SIZE, write_synthetic_dataset

pytestmark = pytest.mark.filterwarnings("ignore:.*pin_memory.*:UserWarning")

#: tokens of a markup conversation with a one-word user turn, beside the answer's words
OVERHEAD = 5


def _multiple(pad: int, cp: int) -> int:
    return pad if cp == 1 else math.lcm(pad, 2 * cp)


def _padded(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _conversation(key: str, answer_words: int) -> Conversation:
    messages = [
        {"role": "user", "content": "kaka"},
        {"role": "assistant", "content": " ".join(["lolo"] * answer_words)},
    ]
    raw = {
        "__key__": key,
        "__restore_key__": ("t", key),
        "__shard__": "s",
        "json": json.dumps({"messages": messages}).encode(),
    }
    return cook_generic(raw)


def _encoder(tokenizer: Any, **changes: Any) -> PackingTaskEncoder:
    cfg = PackingEncoderConfig(**{"capacity": 64, **changes})
    return PackingTaskEncoder(cfg, tokenizer=tokenizer, processor={"patch_size": PATCH_SIZE})


class RecordsPlans(PackingTaskEncoder):
    """Records the lengths each buffer is planned on."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.planned: list[list[int]] = []
        super().__init__(*args, **kwargs)

    def plan_packs(self, lengths: np.ndarray, media: np.ndarray | None, *, seed: int) -> Any:
        self.planned.append(lengths.tolist())
        return super().plan_packs(lengths, media, seed=seed)


@st.composite
def cases(draw: st.DrawFn) -> dict[str, Any]:
    pad = draw(st.integers(1, 12))
    cp = draw(st.integers(1, 4))
    multiple = _multiple(pad, cp)
    capacity = multiple * draw(st.integers(1, max(1, 160 // multiple)))
    # answers from one word to past the capacity, so some samples are oversize
    words = draw(st.lists(st.integers(1, capacity + multiple), min_size=1, max_size=20))
    return {
        "pad_to_multiple_of": pad,
        "cp_size": cp,
        "capacity": capacity,
        "words": words,
        "batch_size": draw(st.integers(1, 3)),
        "packing_buffer_size": draw(st.integers(4, 16)),
        "algorithm": draw(
            st.sampled_from(["best_fit_decreasing", "first_fit_decreasing", "first_fit_shuffle"])
        ),
        "max_items_per_bin": draw(st.none() | st.integers(1, 6)),
    }


@given(case=cases())
def test_every_pack_fits_the_capacity_padded_and_every_sample_is_accounted_for(
    tokenizer: Any, case: dict[str, Any]
) -> None:
    case = dict(case)
    words = case.pop("words")
    capacity, batch_size = case["capacity"], case["batch_size"]
    multiple = _multiple(case["pad_to_multiple_of"], case["cp_size"])
    with active_worker():
        enc = RecordsPlans(
            PackingEncoderConfig(modalities=[], **case),
            tokenizer=tokenizer,
            processor={"patch_size": PATCH_SIZE},
        )
        encoded, skipped = [], []
        for i, n in enumerate(words):
            try:
                encoded.append(enc.preencode_sample(_conversation(f"c{i}", n)))
            except SkipSample:
                skipped.append(f"c{i}")
        # the oversize check reads the padded length
        too_long = [
            f"c{i}" for i, n in enumerate(words) if _padded(OVERHEAD + n, multiple) > capacity
        ]
        assert skipped == too_long
        assert all(s.num_tokens == OVERHEAD + words[int(s.__key__[1:])] for s in encoded)
        buffer = case["packing_buffer_size"]
        chunks = [encoded[i : i + buffer] for i in range(0, len(encoded), buffer)]
        selected = [pack for chunk in chunks for pack in enc.select_samples_to_pack(chunk)]
        packs = [enc.pack_selected_samples([enc.postencode_sample(s) for s in p]) for p in selected]
        for pack, members in zip(packs, selected, strict=True):
            widths = np.diff(pack.packed.cu_seqlens_padded.numpy()).tolist()
            assert widths == [enc.batch_options.padded_length(s.num_tokens) for s in members]
            assert sum(widths) <= capacity
        fixed = enc.batch_options.replace(pad_to_length=capacity * batch_size)
        for start in range(0, len(packs), batch_size):
            step = enc.batch(packs[start : start + batch_size]).micro_batch(fixed)
            assert isinstance(step, PackedBatch)
            assert tuple(step.input_ids.shape) == (capacity * batch_size,)
    # the planner saw the padded lengths, as the builder pads them
    assert enc.planned[1:] == [[_padded(s.num_tokens, multiple) for s in c] for c in chunks]
    delivered = [k for p in packs for k in p.sample_keys]
    assert sorted(delivered + skipped) == sorted(f"c{i}" for i in range(len(words)))
    stats = enc.stats.snapshot()
    assert stats["skipped"]["oversize"] == stats["skipped_total"] == len(too_long)
    assert stats["packed"] + stats["skipped_total"] + stats["failed"] == len(words)


@pytest.mark.parametrize(("pad", "cp"), [(8, 1), (1, 4), (6, 2), (16, 2)])
def test_padded_length_rounds_to_the_padding_multiple_and_bounds_the_oversize_check(
    tokenizer: Any, worker: Any, pad: int, cp: int
) -> None:
    multiple = _multiple(pad, cp)
    enc = _encoder(tokenizer, pad_to_multiple_of=pad, cp_size=cp, capacity=multiple * 4)
    options = enc.batch_options
    assert options.padding_multiple == multiple
    assert BatchOptions(pad_to_multiple_of=pad, cp_size=cp).padding_multiple == multiple
    for n in (0, 1, multiple - 1, multiple, multiple + 1, 3 * multiple + 2):
        assert options.padded_length(n) == _padded(n, multiple)
    # a sample whose padded length is exactly the capacity is kept; one token more is not
    fits = enc.config.capacity - OVERHEAD
    assert enc.preencode_sample(_conversation("fits", fits)).num_tokens == enc.config.capacity
    with pytest.raises(SkipSample, match=rf"padded to {enc.config.capacity + multiple}"):
        enc.preencode_sample(_conversation("over", fits + 1))


def test_the_planner_and_the_oversize_check_read_the_one_pack_length(
    tokenizer: Any, worker: Any
) -> None:
    class Reserves(RecordsPlans):
        """Reserves 8 positions per sample (a subclass may count positions its own way)."""

        def pack_length(self, sample: Any) -> int:
            return super().pack_length(sample) + 8

    enc = Reserves(
        PackingEncoderConfig(capacity=64, pad_to_multiple_of=8, modalities=[]),
        tokenizer=tokenizer,
        processor={"patch_size": PATCH_SIZE},
    )
    kept = enc.preencode_sample(_conversation("kept", 56 - OVERHEAD))
    with pytest.raises(SkipSample, match=r"57 tokens, padded to 72 .* > capacity 64"):
        enc.preencode_sample(_conversation("over", 57 - OVERHEAD))
    enc.select_samples_to_pack([kept, kept])
    assert enc.planned[-1] == [64, 64]


def test_oversize_under_error_names_the_sample_and_its_padded_length(
    tokenizer: Any, worker: Any
) -> None:
    enc = _encoder(tokenizer, pad_to_multiple_of=8, on_oversize="error")
    with pytest.raises(
        SampleFormatError,
        match=r"sample 'long' is too long: 70 tokens, padded to 72 \(pad_to_multiple_of=8, "
        r"cp_size=1\) > capacity 64",
    ):
        enc.preencode_sample(_conversation("long", 70 - OVERHEAD))


@pytest.mark.parametrize(
    ("changes", "multiple"),
    [
        ({"pad_to_multiple_of": 8}, 8),
        ({"cp_size": 3}, 6),
        ({"pad_to_multiple_of": 4, "cp_size": 3}, 12),
    ],
)
def test_a_capacity_that_is_no_padded_length_is_refused_at_construction(
    tokenizer: Any, changes: dict[str, int], multiple: int
) -> None:
    capacity = 10 * multiple + 2
    with pytest.raises(
        EnergonConfigError,
        match=rf"capacity={capacity} is not a multiple of {multiple}.*use "
        rf"{10 * multiple} or {11 * multiple}",
    ):
        _encoder(tokenizer, capacity=capacity, **changes)


CAPACITY = 192


def test_the_real_loader_delivers_packs_that_fit_the_fixed_micro_batch(
    tmp_path: Path, tokenizer: Any
) -> None:
    dataset = write_synthetic_dataset(
        tmp_path,
        48,
        seed=5,
        shards_per_format=1,
        capacity=CAPACITY,
        mean_words=10,
        broken_every=0,
        skip_every=8,
        media_pool=4,
    )
    config = PackingEncoderConfig(
        capacity=CAPACITY,
        packing_buffer_size=12,
        loss_mask_mode="precomputed",
        batch_size=2,
        pad_to_multiple_of=8,
        cp_size=2,
    )
    encoder = PackingTaskEncoder(config, tokenizer=tokenizer, processor={"patch_size": PATCH_SIZE})
    loader = get_loader(
        get_train_dataset(
            str(dataset.metadataset),
            worker_config=make_worker_config(encoder, num_workers=0),
            **encoder.dataset_options(),
            shuffle_buffer_size=None,
            max_samples_per_sequence=None,
            task_encoder=encoder,
            repeat=False,
        ),
        watchdog_timeout_seconds=None,
    )
    fixed = encoder.batch_options.replace(pad_to_length=CAPACITY * config.batch_size)
    delivered, padding = [], 0
    for batch in loader:
        for pack in batch.packs:
            assert int(pack.cu_seqlens_padded[-1]) <= CAPACITY
            padding += int(pack.cu_seqlens_padded[-1] - pack.cu_seqlens[-1])
        step = batch.micro_batch(fixed)
        assert tuple(step.input_ids.shape) == (CAPACITY * config.batch_size,)
        delivered += batch.sample_keys
    assert padding > 0  # the padding is real, and planned for
    assert set(delivered) == dataset.keys_with("ok")
    stats = encoder.stats.snapshot()
    assert stats["seen"] == dataset.num_samples
    assert len(delivered) + stats["skipped_total"] + stats["failed"] == dataset.num_samples
