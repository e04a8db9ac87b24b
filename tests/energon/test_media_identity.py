"""A sample always gets its own media: provenance names where an item really is (the dataset's or
media store's own path), so datasets and stores written with identical names can be blended in
one metadataset, read by the real Energon loader, without one sample's media replacing
another's in a pack; equal items still share one stored segment.
"""

from __future__ import annotations

import collections
import io
import json
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from megatron.energon import get_loader, get_train_dataset
from mmpack.batch import EncodedSample
from mmpack.energon import PackingEncoderConfig, PackingTaskEncoder, make_worker_config
from mmpack_dev.energon_testing import media_rows
from mmpack_dev.synthetic import (
    PATCH_SIZE,
    png_bytes,
    write_metadataset,
    write_synthetic_dataset,
    write_webdataset,
)
from PIL import Image

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*pin_memory.*:UserWarning"),
    pytest.mark.timeout(240),
]

CAPACITY = 1024


class OriginEncoder(PackingTaskEncoder):
    """Names each packed sample ``<origin subflavor>/<key>``: the blended datasets use the same
    keys, and the test must know whose media a pack row holds."""

    def to_encoded_sample(self, sample: Any) -> EncodedSample:
        encoded = super().to_encoded_sample(sample)
        encoded.sample_id = f"{sample.__subflavors__['origin']}/{sample.__key__}"
        return encoded


def run_epoch(path: Path, workers: int, **overrides: Any) -> tuple[list[Any], dict[str, Any]]:
    from mmpack_dev.synthetic import build_tokenizer

    config = PackingEncoderConfig(
        capacity=CAPACITY,
        packing_buffer_size=32,
        loss_mask_mode="precomputed",
        batch_size=2,
        **overrides,
    )
    encoder = OriginEncoder(config, tokenizer=build_tokenizer(), processor={"patch_size": 16})
    dataset = get_train_dataset(
        str(path),
        worker_config=make_worker_config(encoder, num_workers=workers),
        batch_size=config.batch_size,
        packing_buffer_size=config.packing_buffer_size,
        shuffle_buffer_size=None,
        max_samples_per_sequence=None,
        task_encoder=encoder,
        repeat=False,
    )
    packs = [p for b in get_loader(dataset, watchdog_timeout_seconds=None) for p in b.packs]
    return packs, encoder.stats.snapshot()


def decode(data: bytes) -> torch.Tensor:
    """The patches a picture must become (float32 ``[n_patches, 16*16*3]``), decoded here."""
    with Image.open(io.BytesIO(data)) as img:
        rgb = np.asarray(img.convert("RGB"), dtype=np.uint8)
    h, w = rgb.shape[0] // PATCH_SIZE, rgb.shape[1] // PATCH_SIZE
    assert rgb.shape[:2] == (h * PATCH_SIZE, w * PATCH_SIZE)
    grid = rgb.reshape(h, PATCH_SIZE, w, PATCH_SIZE, 3).transpose(0, 2, 1, 3, 4)
    patches = grid.reshape(h * w, -1).astype(np.float32) / np.float32(255.0)
    return torch.from_numpy(patches)


def check_packs(
    packs: list[Any], expected: dict[str, list[tuple[str, bytes]]]
) -> tuple[int, int, int]:
    """Compares every image reference of every packed sample with its own source's pixels.
    Returns (references, references carrying other pixels, packs whose stored segments are
    not one per distinct source)."""
    references = wrong = bad_dedup = 0
    for pack in packs:
        (row,) = media_rows(pack.media["pixel_values"])  # one logical row per pack
        cursor = 0
        sources = set()
        for sample_id in pack.sample_ids:
            for source, data in expected[sample_id]:
                references += 1
                sources.add(source)
                if not torch.equal(row[cursor], decode(data)):
                    wrong += 1
                cursor += 1
        assert cursor == len(row), f"{len(row)} image references in a pack, expected {cursor}"
        if len(pack.media["pixel_values"].tensors) != len(sources):
            bad_dedup += 1
    return references, wrong, bad_dedup


def _members(root: Path) -> dict[str, dict[str, bytes]]:
    out: dict[str, dict[str, bytes]] = collections.defaultdict(dict)
    for shard in sorted(root.glob("*.tar")):
        with tarfile.open(shard) as tar:
            for info in tar:
                key, _, suffix = info.name.partition(".")
                member = tar.extractfile(info)
                assert member is not None
                out[key][suffix] = member.read()
    return out


def expected_media(root: Path, origin: str) -> dict[str, list[tuple[str, bytes]]]:
    """``origin/key`` -> (source, bytes) of each image reference, in order, read from disk."""
    out: dict[str, list[tuple[str, bytes]]] = {}
    for key, parts in _members(root / origin / "generic").items():
        obj = json.loads(parts["json"])
        n = sum(m["content"].count("<image>") for m in obj["messages"])
        out[f"{origin}/{key}"] = [
            (f"{origin}/generic/{key}/{e['name']}", parts[e["name"]]) for e in obj["media"][:n]
        ]
    for key, parts in _members(root / origin / "fragments").items():
        obj = json.loads(parts["json"])
        refs = [f["media"] for t in obj["conversation"] for f in t["fragments"] if "media" in f]
        out[f"{origin}/{key}"] = [
            (f"{origin}/media/{r}", (root / origin / "media" / r).read_bytes()) for r in refs
        ]
    return out


@pytest.fixture(scope="module")
def twins(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """Two datasets written the same way (same shard names, keys, members and media store
    keys) with different content, both formats of each blended in one metadataset."""
    root = tmp_path_factory.mktemp("twins")
    entries = []
    for seed, origin in ((1, "a"), (2, "b")):
        write_synthetic_dataset(
            root / origin,
            60,
            seed=seed,
            shards_per_format=2,
            capacity=CAPACITY,
            image_fraction=0.9,
            mean_words=10,
            broken_every=0,
            skip_every=0,
            media_pool=4,
        )
        for fmt in ("generic", "fragments"):
            entries.append(
                {
                    "path": f"{origin}/{fmt}",
                    "subflavors": {"mmpack_format": fmt, "origin": origin},
                    "media": f"{origin}/media" if fmt == "fragments" else None,
                }
            )
    metadataset = write_metadataset(root / "blend.yaml", entries)
    expected = {**expected_media(root, "a"), **expected_media(root, "b")}
    return metadataset, expected


@pytest.mark.parametrize("workers", [0, 2])
def test_blended_twin_datasets_give_every_sample_its_own_images(twins: Any, workers: int) -> None:
    metadataset, expected = twins
    packs, stats = run_epoch(metadataset, workers)
    assert stats["packed"] == len(expected) == 120 and stats["failed"] == 0
    packed = [sid for p in packs for sid in p.sample_ids]
    assert sorted(packed) == sorted(expected)
    references, wrong, bad_dedup = check_packs(packs, expected)
    assert references > 100
    # a collision would make the pack merge keep the first item and drop the other
    assert wrong == 0, f"{wrong} of {references} image references carried another image"
    # each distinct source is stored once per pack: equal items dedup, different never do
    assert bad_dedup == 0


@pytest.fixture(scope="module")
def two_stores(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """Two media stores with the same key ``img_0000.png`` holding different pictures (and in
    store b a copy of store a's picture under another key), each read by a fragments dataset
    whose samples have the same keys."""
    root = tmp_path_factory.mktemp("stores")
    red, blue = png_bytes(32, 32, seed=1), png_bytes(32, 32, seed=2)
    assert red != blue
    contents = {"a": {"img_0000.png": red}, "b": {"img_0000.png": blue, "copy.png": red}}
    entries = []
    expected: dict[str, list[tuple[str, bytes]]] = {}
    for origin, files in contents.items():
        store = root / origin / "media"
        store.mkdir(parents=True)
        samples = []
        for i, (name, data) in enumerate(sorted(files.items())):
            (store / name).write_bytes(data)
            obj = {
                "conversation": [
                    {"role": "user", "fragments": [{"media": name, "kind": "image"}]},
                    {"role": "assistant", "fragments": [{"text": "kaka", "trainable": True}]},
                ]
            }
            samples.append((f"s-{i}", [("json", json.dumps(obj).encode())]))
            expected[f"{origin}/s-{i}"] = [(f"{origin}/media/{name}", data)]
        write_webdataset(root / origin / "fragments", samples)
        entries.append(
            {
                "path": f"{origin}/fragments",
                "subflavors": {"mmpack_format": "fragments", "origin": origin},
                "media": f"{origin}/media",
            }
        )
    return write_metadataset(root / "blend.yaml", entries), expected


def test_two_media_stores_with_equal_keys_keep_their_own_pictures(two_stores: Any) -> None:
    metadataset, expected = two_stores
    packs, stats = run_epoch(metadataset, 0)
    assert len(packs) == 1 and stats["packed"] == 3  # all three samples in one pack
    (pack,) = packs
    _, wrong, bad_dedup = check_packs(packs, expected)
    assert wrong == 0, "a sample received the other store's img_0000.png"
    # three sources, three stored pictures (the copy is another item, so stored apart)
    assert bad_dedup == 0 and len(pack.media["pixel_values"].tensors) == 3


def test_content_identity_shares_equal_bytes_across_stores(two_stores: Any) -> None:
    metadataset, expected = two_stores
    packs, _ = run_epoch(metadataset, 0, media_identity="content")
    (pack,) = packs
    _, wrong, _ = check_packs(packs, expected)
    assert wrong == 0
    # a's img_0000.png and b's copy.png are the same bytes: one stored picture for both
    assert len(pack.media["pixel_values"].tensors) == 2


def test_free_form_identity_is_deprecated_and_kept_apart_from_sources() -> None:
    from mmpack.energon import MediaHandle
    from mmpack.energon.media import webdataset_source

    with pytest.warns(DeprecationWarning, match=r"identity=.*deprecated; pass source="):
        old = MediaHandle(
            kind="image", key="a.png", identity="s/k/a.png", sample_key="k", data=b"x"
        )
    assert old.identity == "s/k/a.png"
    new = MediaHandle(
        kind="image",
        key="a.png",
        source=webdataset_source("", "s", "k", "a.png"),
        sample_key="k",
        data=b"x",
    )
    assert old.provenance != new.provenance
