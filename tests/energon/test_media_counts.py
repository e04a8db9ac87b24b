"""Token counts that cannot lie: a sample is encoded with the token counts its manifest or
fragments declare, and after decoding each media item must really take that many tokens. A
sample whose metadata over- or under-declares an image fails with `MediaTokenCountError`
(counted as failed); it is never packed with its pictures shifted against their placeholder
tokens, even when a liar in each direction lands in the same pack and the totals agree.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from megatron.energon import get_loader, get_train_dataset
from mmpack.energon import PackingEncoderConfig, PackingTaskEncoder, make_worker_config
from mmpack_dev.energon_testing import media_rows
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

#: sample key -> (declared side, real side) of its one image
GENERIC = {
    "good-0": (32, 32),
    "over": (96, 32),  # declares 36 tokens, decodes to 4
    "good-1": (48, 48),
    "under": (32, 96),  # declares 4 tokens, decodes to 36
    "good-2": (64, 64),
}
FRAGMENTS = {"frag-good": (48, 48), "frag-over": (64, 32), "frag-under": (32, 64)}
LIARS = {"over": (36, 4), "under": (4, 36), "frag-over": (16, 4), "frag-under": (4, 16)}


def generic_sample(key: str, declared: int, real: int) -> tuple[str, list[tuple[str, bytes]]]:
    obj = {
        "messages": [
            {"role": "user", "content": "<image> kaka lolo"},
            {"role": "assistant", "content": "mimi nene"},
        ],
        "media": [{"name": "img0.png", "kind": "image", "width": declared, "height": declared}],
    }
    seed = sum(map(ord, key))
    return key, [("json", json.dumps(obj).encode()), ("img0.png", png_bytes(real, real, seed=seed))]


def fragments_sample(key: str, declared: int) -> tuple[str, list[tuple[str, bytes]]]:
    image = {"media": f"{key}.png", "kind": "image", "width": declared, "height": declared}
    obj = {
        "conversation": [
            {"role": "user", "fragments": [image, {"text": "kaka", "trainable": False}]},
            {"role": "assistant", "fragments": [{"text": "lolo", "trainable": True}]},
        ]
    }
    return key, [("json", json.dumps(obj).encode())]


@pytest.fixture(scope="module")
def liars(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("liars")
    write_webdataset(root / "generic", [generic_sample(k, d, r) for k, (d, r) in GENERIC.items()])
    (root / "media").mkdir()
    for key, (_declared, real) in FRAGMENTS.items():
        (root / "media" / f"{key}.png").write_bytes(png_bytes(real, real, seed=len(key)))
    write_webdataset(
        root / "fragments", [fragments_sample(k, d) for k, (d, _) in FRAGMENTS.items()]
    )
    return write_metadataset(
        root / "blend.yaml",
        [
            {"path": "generic", "subflavors": {"mmpack_format": "generic"}},
            {"path": "fragments", "subflavors": {"mmpack_format": "fragments"}, "media": "media"},
        ],
    )


class RecordingEncoder(PackingTaskEncoder):
    """Records the keys of each selected group (complete with 0 workers)."""

    groups: list[list[str]]

    def select_samples_to_pack(self, samples: list[Any]) -> list[list[Any]]:
        groups = super().select_samples_to_pack(samples)
        self.groups.extend([s.__key__ for s in g] for g in groups)
        return groups


def run(path: Path, workers: int) -> tuple[list[Any], RecordingEncoder]:
    config = PackingEncoderConfig(capacity=1024, packing_buffer_size=16, batch_size=1)
    encoder = RecordingEncoder(
        config, tokenizer=build_tokenizer(), processor={"patch_size": PATCH_SIZE}
    )
    dataset = get_train_dataset(
        str(path),
        worker_config=make_worker_config(encoder, num_workers=workers),
        batch_size=1,
        packing_buffer_size=config.packing_buffer_size,
        shuffle_buffer_size=None,
        max_samples_per_sequence=None,
        task_encoder=encoder,
        repeat=False,
    )
    encoder.groups = []
    packs = [p for b in get_loader(dataset, watchdog_timeout_seconds=None) for p in b.packs]
    return packs, encoder


def image_tokens_and_patches(pack: Any, image_id: int) -> list[tuple[str, int, int]]:
    """Per packed sample: (key, image placeholder tokens, patch rows of its pictures)."""
    (row,) = media_rows(pack.media["pixel_values"])
    bounds = pack.cu_seqlens.tolist()
    out = []
    cursor = 0
    for i, key in enumerate(pack.sample_ids):
        ids = pack.input_ids[bounds[i] : bounds[i + 1]]
        tokens = int((ids == image_id).sum())
        n_images = 1  # every sample here has one picture
        patches = sum(int(t.shape[0]) for t in row[cursor : cursor + n_images])
        cursor += n_images
        out.append((key, tokens, patches))
    assert cursor == len(row)
    return out


@pytest.mark.parametrize("workers", [0, 2])
def test_lying_manifests_fail_their_samples_instead_of_shifting_a_pack(
    liars: Path, workers: int
) -> None:
    packs, encoder = run(liars, workers)
    stats = encoder.stats.snapshot()
    image_id = build_tokenizer().get_vocab()["<image>"]
    packed = {key for p in packs for key in p.sample_ids}
    # the liars of the generic dataset were selected into one pack with good samples
    assert stats["seen"] == len(GENERIC) + len(FRAGMENTS)
    assert stats["failed_by_reason"] == {"MediaTokenCountError": len(LIARS)}
    assert packed == {*GENERIC, *FRAGMENTS} - set(LIARS)
    assert stats["packed"] + stats["failed"] == stats["seen"]
    for pack in packs:
        for key, tokens, patches in image_tokens_and_patches(pack, image_id):
            assert tokens == patches, f"{key}: {tokens} image tokens but {patches} patches"
    if workers == 0:
        # both generic liars were selected into one group with good samples: their counts
        # cancel out, so only the per-item check can tell
        (group,) = [g for g in encoder.groups if "over" in g]
        assert "under" in group and any(k.startswith("good") for k in group)
        # the error names the sample, the item and both counts
        failures = sorted(encoder.stats.failures)
        assert len(failures) == len(LIARS)
        for key, (declared, real) in LIARS.items():
            (line,) = [f for f in failures if f.startswith(f"{key}: ")]
            assert "MediaTokenCountError" in line and ".png" in line
            assert f"decodes to {real} tokens" in line
            assert f"encoded with {declared} tokens" in line
