"""An item shared by several samples of one pack is read and decoded once for that pack: counted
over a real Energon epoch (0 workers) with the real decoders wrapped by a counter."""

from __future__ import annotations

import collections
import json
from pathlib import Path
from typing import Any

import pytest
from megatron.energon import get_loader, get_train_dataset
from mmpack.energon import MEDIA_LOG, PackingEncoderConfig, PackingTaskEncoder, make_worker_config
from mmpack.energon.decoders import DecodedMedia, MediaDecoder
from mmpack.energon.media import MediaHandle
from mmpack_dev.synthetic import build_tokenizer, png_bytes, write_metadataset, write_webdataset
from support.processors import qwen_vl_processor

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*pin_memory.*:UserWarning"),
    pytest.mark.timeout(240),
]

N_SAMPLES = 6


class CountingDecoder:
    """The encoder's own decoder, counting the items it decodes (by media store key)."""

    def __init__(self, inner: MediaDecoder) -> None:
        self.inner = inner
        self.calls: collections.Counter[str] = collections.Counter()

    def output_keys(self, kind: str) -> tuple[str, ...]:
        return self.inner.output_keys(kind)

    def padded_keys(self, kind: str) -> tuple[str, ...]:
        return self.inner.padded_keys(kind)

    def count(self, handle: MediaHandle) -> int:
        return self.inner.count(handle)

    def process(self, handle: MediaHandle) -> DecodedMedia:
        self.calls[handle.key] += 1
        return self.inner.process(handle)

    def check_tokens(
        self, sample_key: str, handle: MediaHandle, decoded: DecodedMedia, encoded: int
    ) -> None:
        self.inner.check_tokens(sample_key, handle, decoded, encoded)


def sample(i: int) -> tuple[str, list[Any]]:
    turns = [
        {
            "role": "user",
            "fragments": [
                {"media": "shared.png"},
                {"media": f"own-{i}.png"},
                {"text": "kaka", "trainable": False},
            ],
        },
        {"role": "assistant", "fragments": [{"text": "lolo", "trainable": True}]},
    ]
    return f"s{i}", [("json", json.dumps({"conversation": turns}).encode())]


@pytest.fixture(scope="module")
def metadataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("decode-once")
    store = root / "media"
    store.mkdir()
    (store / "shared.png").write_bytes(png_bytes(64, 48, seed=99))
    for i in range(N_SAMPLES):
        (store / f"own-{i}.png").write_bytes(png_bytes(32, 32, seed=i))
    write_webdataset(root / "fragments", [sample(i) for i in range(N_SAMPLES)])
    return write_metadataset(
        root / "blend.yaml",
        [{"path": "fragments", "subflavors": {"mmpack_format": "fragments"}, "media": str(store)}],
    )


@pytest.mark.parametrize("decoder", ["builtin", "qwen2_vl"])
def test_a_shared_item_is_read_and_decoded_once_per_pack(metadataset: Path, decoder: str) -> None:
    config = PackingEncoderConfig(
        capacity=4096, packing_buffer_size=N_SAMPLES, loss_mask_mode="precomputed"
    )
    if decoder == "builtin":
        encoder = PackingTaskEncoder(
            config, tokenizer=build_tokenizer(), processor={"patch_size": 16}
        )
    else:
        encoder = PackingTaskEncoder(config, processor=qwen_vl_processor("qwen2_vl"))
    counting = CountingDecoder(encoder.media_decoder)
    encoder.media_decoder = counting
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
    packs = [p for b in loader for p in b.packs]
    members = sorted(k for p in packs for k in p.sample_ids)
    assert members == [f"s{i}" for i in range(N_SAMPLES)]
    assert len(packs) < N_SAMPLES  # some pack holds several samples sharing the item
    assert counting.calls["shared.png"] == len(packs)
    assert all(counting.calls[f"own-{i}.png"] == 1 for i in range(N_SAMPLES))
    shared = f"{metadataset.parent}/media/shared.png"
    assert MEDIA_LOG.reads.count(shared) == len(packs)
    for pack in packs:
        values = pack.media["pixel_values"]
        # stored once per pack: the shared item and one own item per sample
        assert len(values.tensors) == 1 + len(pack.sample_ids)
