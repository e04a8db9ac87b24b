"""Audio end to end on the real Energon loader: WAV files (16 kHz and 22.05 kHz, with a declared
duration or sized from the header) are decoded with soundfile and resampled with librosa/soxr to
the configured rate; each clip's waveform has the length its token count assumes, and a clip
whose declared duration lies fails its sample with `MediaTokenCountError`."""

from __future__ import annotations

import io
import json
import math
import wave
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from megatron.energon import get_loader, get_train_dataset
from mmpack.energon import PackingEncoderConfig, PackingTaskEncoder, make_worker_config
from mmpack_dev.energon_testing import media_rows
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

RATE, HOP, DOWN = 16000, 160, 2
PROCESSOR = {
    "patch_size": PATCH_SIZE,
    "sampling_rate": RATE,
    "hop_length": HOP,
    "downsample_factor": DOWN,
}
#: key -> (seconds, file rate, declared duration or None: from the header, with a picture)
CLIPS: dict[str, tuple[float, int, float | None, bool]] = {
    "native-declared": (0.5, 16000, 0.5, False),
    "native-header": (0.73, 16000, None, False),
    "resampled-declared": (1.0, 22050, 1.0, False),
    "resampled-header": (0.61, 22050, None, True),
    "lying-duration": (0.5, 16000, 1.5, False),
}


def sample(key: str) -> tuple[str, list[tuple[str, bytes]]]:
    seconds, rate, declared, with_image = CLIPS[key]
    entry: dict[str, Any] = {"name": "clip.wav", "kind": "audio"}
    if declared is not None:
        entry["duration"] = declared
    media = [entry]
    parts = [("clip.wav", wav_bytes(seconds, rate, freq=300.0 + len(key) * 10))]
    content = "<audio> kaka"
    if with_image:
        media.append({"name": "img0.png", "kind": "image", "width": 32, "height": 32})
        parts.append(("img0.png", png_bytes(32, 32)))
        content += " <image>"
    obj = {
        "messages": [
            {"role": "user", "content": content},
            {"role": "assistant", "content": "lolo"},
        ],
        "media": media,
    }
    return key, [("json", json.dumps(obj).encode()), *parts]


def expected_waveform(key: str) -> np.ndarray:
    """The clip's samples as written, at its own rate (int16 PCM scaled to [-1, 1))."""
    data = dict(sample(key)[1])["clip.wav"]
    with wave.open(io.BytesIO(data)) as clip:
        pcm = np.frombuffer(clip.readframes(clip.getnframes()), dtype="<i2")
    return pcm.astype(np.float32) / 32768.0


def tokens_of(samples: int) -> int:
    return max(1, math.ceil(math.ceil(samples / HOP) / DOWN))


@pytest.fixture(scope="module")
def clips(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("audio")
    write_webdataset(root / "generic", [sample(k) for k in CLIPS])
    return write_metadataset(
        root / "blend.yaml", [{"path": "generic", "subflavors": {"mmpack_format": "generic"}}]
    )


@pytest.mark.parametrize("workers", [0, 2])
def test_wav_audio_is_decoded_end_to_end(clips: Path, workers: int) -> None:
    config = PackingEncoderConfig(
        capacity=1024, packing_buffer_size=8, modalities=["image", "audio"], batch_size=1
    )
    encoder = PackingTaskEncoder(config, tokenizer=build_tokenizer(), processor=PROCESSOR)
    loader = get_loader(
        get_train_dataset(
            str(clips),
            worker_config=make_worker_config(encoder, num_workers=workers),
            batch_size=1,
            packing_buffer_size=config.packing_buffer_size,
            shuffle_buffer_size=None,
            max_samples_per_sequence=None,
            task_encoder=encoder,
            repeat=False,
        ),
        watchdog_timeout_seconds=None,
    )
    packs = [p for b in loader for p in b.packs]
    stats = encoder.stats.snapshot()
    assert stats["failed_by_reason"] == {"MediaTokenCountError": 1}  # the lying duration
    audio_id = build_tokenizer().get_vocab()["<audio>"]
    seen = set()
    for pack in packs:
        (row,) = media_rows(pack.media["audio_values"])
        bounds = pack.cu_seqlens.tolist()
        for i, key in enumerate(pack.sample_ids):
            _, rate, _, with_image = CLIPS[key]
            waveform = row[i].numpy()
            source = expected_waveform(key)
            length = -(-len(source) * RATE // rate)  # exact resampled length
            assert waveform.dtype == np.float32 and waveform.shape == (length,)
            if rate == RATE:  # no resampling: the very samples of the file
                np.testing.assert_array_equal(waveform, source)
            else:  # resampled: the same sine at the new rate
                t = np.arange(length) / RATE
                assert (
                    np.corrcoef(
                        waveform[100:-100],
                        np.interp(t, np.arange(len(source)) / rate, source)[100:-100],
                    )[0, 1]
                    > 0.99
                )
            ids = pack.input_ids[bounds[i] : bounds[i + 1]]
            assert int((ids == audio_id).sum()) == tokens_of(length)
            if with_image:
                (pictures,) = media_rows(pack.media["pixel_values"])
                assert len(pictures) == 1 and tuple(pictures[0].shape) == (4, 16 * 16 * 3)
            seen.add(key)
    assert seen == set(CLIPS) - {"lying-duration"}
