"""Lazy means lazy: before selection nothing reads a media store item except the few header
bytes its token count needs (when the fragment gives no size), and a sample skipped by policy
before encoding reads none at all. Counted with `MEDIA_LOG` over a real Energon epoch (0 workers,
so every read happens in this process)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from megatron.energon import get_loader, get_train_dataset
from mmpack.energon import MEDIA_LOG, PackingEncoderConfig, PackingTaskEncoder, make_worker_config
from mmpack_dev.synthetic import (
    PATCH_SIZE,
    build_tokenizer,
    png_bytes,
    write_metadataset,
    write_webdataset,
)

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*pin_memory.*:UserWarning"),
    pytest.mark.timeout(240),
]

MEDIA_CAPACITY = 16  # image patches per sample and pack; a 96x96 picture takes 36
#: sample key -> (its picture's side, how the sample ends); no fragment declares a size
SAMPLES = {
    "packed-0": (32, "answer"),
    "packed-1": (48, "answer"),
    "packed-2": (64, "answer"),
    "ends-on-user-0": (96, "question"),
    "ends-on-user-1": (32, "question"),
    "over-budget-0": (96, "answer"),
    "over-budget-1": (80, "answer"),
}


def sample(key: str, side: int, ending: str, declared: bool) -> tuple[str, list[Any]]:
    image: dict[str, Any] = {"media": f"{key}.png"}
    if declared:
        image.update(width=side, height=side)
    turns: list[dict[str, Any]] = [
        {"role": "user", "fragments": [image, {"text": "kaka", "trainable": False}]},
        {"role": "assistant", "fragments": [{"text": "lolo", "trainable": True}]},
    ]
    if ending == "question":
        turns.append({"role": "user", "fragments": [{"text": "mimi", "trainable": False}]})
    return key, [("json", json.dumps({"conversation": turns}).encode())]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    store = tmp_path_factory.mktemp("lazy") / "media"
    store.mkdir()
    for i, (key, (side, _)) in enumerate(SAMPLES.items()):
        (store / f"{key}.png").write_bytes(png_bytes(side, side, seed=i))
    return store


@pytest.mark.parametrize("declared", [False, True], ids=["size-from-header", "size-declared"])
def test_skipped_and_over_budget_samples_read_no_media_bytes(store: Path, declared: bool) -> None:
    root = store.parent / ("declared" if declared else "undeclared")
    write_webdataset(
        root / "fragments", [sample(k, s, e, declared) for k, (s, e) in SAMPLES.items()]
    )
    metadataset = write_metadataset(
        root / "blend.yaml",
        [{"path": "fragments", "subflavors": {"mmpack_format": "fragments"}, "media": str(store)}],
    )
    config = PackingEncoderConfig(
        capacity=512,
        packing_buffer_size=16,
        loss_mask_mode="precomputed",
        media_capacity=MEDIA_CAPACITY,
    )
    encoder = PackingTaskEncoder(
        config, tokenizer=build_tokenizer(), processor={"patch_size": PATCH_SIZE}
    )
    loader = get_loader(
        get_train_dataset(
            str(metadataset),
            worker_config=make_worker_config(encoder, num_workers=0),
            batch_size=1,
            packing_buffer_size=config.packing_buffer_size,
            shuffle_buffer_size=None,
            max_samples_per_sequence=None,
            task_encoder=encoder,
            repeat=False,
        ),
        watchdog_timeout_seconds=None,
    )
    MEDIA_LOG.clear()
    packed = sorted(k for b in loader for k in b.sample_keys)
    stats = encoder.stats.snapshot()
    assert packed == ["packed-0", "packed-1", "packed-2"]
    assert stats["skipped"]["ends_on_user_turn"] == 2
    assert stats["skipped"]["media_over_budget"] == 2

    def item(key: str) -> str:
        return f"{store}/{key}.png"

    def file_size(key: str) -> int:
        return (store / f"{key}.png").stat().st_size

    # full reads: exactly the packed samples' pictures, once each, at decode time
    assert len(MEDIA_LOG.reads) == len(packed), MEDIA_LOG.reads
    assert sorted(MEDIA_LOG.reads) == [item(k) for k in packed]
    assert sorted(MEDIA_LOG.decodes) == [item(k) for k in packed]
    assert MEDIA_LOG.bytes_read == sum(file_size(k) for k in packed)
    if declared:  # the fragments give the sizes: not even a header is read before selection
        assert MEDIA_LOG.header_reads == [] and MEDIA_LOG.header_bytes == 0
        return
    # header reads: the samples that were encoded (packed or over budget), never the ones
    # skipped before encoding
    encoded = [k for k in SAMPLES if not k.startswith("ends-on-user")]
    assert sorted(MEDIA_LOG.header_reads) == sorted(item(k) for k in encoded)
    # a header is a few dozen bytes of a file of kilobytes
    assert MEDIA_LOG.header_bytes <= 128 * len(encoded)
    assert MEDIA_LOG.header_bytes * 20 < sum(file_size(k) for k in encoded)
