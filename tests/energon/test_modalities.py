"""Modalities that cannot vanish: media of a kind the config does not declare stops the job at
its first occurrence, with one error naming the kind and the setting to change; with
``on_undeclared_media: skip`` such samples are skipped and counted under their own reason, and
every other sample is still packed. Over a real Energon epoch, with good samples in between."""

from __future__ import annotations

import json
import types
from pathlib import Path
from typing import Any

import pytest
from megatron.energon import get_loader, get_train_dataset
from megatron.energon.errors import FatalSampleError
from mmpack.energon import PackingEncoderConfig, PackingTaskEncoder, make_worker_config
from mmpack.errors import EnergonConfigError
from mmpack_dev.demos.sft import RunResult, _accounting
from mmpack_dev.synthetic import (
    PATCH_SIZE,
    build_tokenizer,
    png_bytes,
    wav_bytes,
    write_metadataset,
    write_webdataset,
)

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*pin_memory.*:UserWarning"),
    pytest.mark.timeout(240),
]

N_SAMPLES = 24
FIRST_AUDIO = 5  # samples 5, 11, 17, 23 hold audio; the others a picture


def generic(i: int) -> tuple[str, list[tuple[str, bytes]]]:
    key = f"s{i:03d}"
    if i % 6 == FIRST_AUDIO:
        media = {"name": "clip.wav", "kind": "audio", "duration": 0.5}
        data, placeholder = wav_bytes(0.5), "<audio>"
    else:
        media = {"name": "img0.png", "kind": "image", "width": 32, "height": 32}
        data, placeholder = png_bytes(32, 32, seed=i), "<image>"
    obj = {
        "messages": [
            {"role": "user", "content": f"{placeholder} kaka"},
            {"role": "assistant", "content": "lolo mimi"},
        ],
        "media": [media],
    }
    return key, [("json", json.dumps(obj).encode()), (media["name"], data)]


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    root = tmp_path_factory.mktemp("mixed")
    write_webdataset(root / "generic", [generic(i) for i in range(N_SAMPLES)])
    n_audio = sum(1 for i in range(N_SAMPLES) if i % 6 == FIRST_AUDIO)
    path = write_metadataset(
        root / "blend.yaml", [{"path": "generic", "subflavors": {"mmpack_format": "generic"}}]
    )
    return path, n_audio


@pytest.fixture(scope="module")
def depth_scan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("depth")
    (root / "media").mkdir()
    (root / "media" / "scan.depth").write_bytes(b"not decoded")
    turns = [
        {"role": "user", "fragments": [{"media": "scan.depth", "kind": "depth"}]},
        {"role": "assistant", "fragments": [{"text": "lolo", "trainable": True}]},
    ]
    write_webdataset(
        root / "fragments", [("v0", [("json", json.dumps({"conversation": turns}).encode())])]
    )
    return write_metadataset(
        root / "blend.yaml",
        [{"path": "fragments", "subflavors": {"mmpack_format": "fragments"}, "media": "media"}],
    )


def loader(path: Path, workers: int, **overrides: Any) -> tuple[Any, PackingTaskEncoder]:
    config = PackingEncoderConfig(capacity=256, packing_buffer_size=8, batch_size=1, **overrides)
    encoder = PackingTaskEncoder(
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
    return get_loader(dataset, watchdog_timeout_seconds=None), encoder


@pytest.mark.parametrize("workers", [0, 2])
def test_undeclared_modality_stops_the_job_at_its_first_sample(mixed: Any, workers: int) -> None:
    path, _ = mixed
    batches, encoder = loader(path, workers)
    with pytest.raises(FatalSampleError) as info:
        for _ in batches:
            pass
    message = str(info.value)
    assert "audio media 'clip.wav'" in message
    assert "add 'audio' to modalities" in message and "on_undeclared_media: skip" in message
    if workers == 0:  # one process: the job stopped right at the first audio sample
        assert "'s005'" in message
        assert encoder.stats.snapshot()["seen"] == FIRST_AUDIO + 1


def test_unsupported_kind_stops_the_job_naming_it(depth_scan: Path) -> None:
    batches, _ = loader(depth_scan, 0)
    with pytest.raises(FatalSampleError, match=r"depth media 'scan.depth'.*does not support"):
        list(batches)


@pytest.mark.parametrize("workers", [0, 2])
def test_opted_in_undeclared_media_is_skipped_and_counted(mixed: Any, workers: int) -> None:
    path, n_audio = mixed
    batches, encoder = loader(path, workers, on_undeclared_media="skip")
    packed = [k for b in batches for k in b.sample_keys]
    stats = encoder.stats.snapshot()
    assert stats["skipped"]["undeclared_modality"] == n_audio == 4
    assert stats["skipped_total"] == n_audio and stats["failed"] == 0
    good = {f"s{i:03d}" for i in range(N_SAMPLES) if i % 6 != FIRST_AUDIO}
    assert sorted(packed) == sorted(good)
    # the demo's accounting balances and names the reason
    ds = types.SimpleNamespace(num_samples=N_SAMPLES, keys_with=lambda _fate: good)
    result = RunResult(name="mmpack", samples=len(packed), stats=stats, keys=packed)
    balanced, line = _accounting(ds, result)
    assert balanced and "undeclared_modality 4" in line


def test_undeclared_media_policy_is_validated() -> None:
    with pytest.raises(EnergonConfigError, match="on_undeclared_media must be one of"):
        PackingEncoderConfig(on_undeclared_media="drop")
    with pytest.raises(EnergonConfigError, match="media_identity must be one of"):
        PackingEncoderConfig(media_identity="path")
