"""Video timing as the model's processor makes it: a clip's frames reach the processor with
their metadata (frame rate, frame indices), so the packed time-dependent fields (Qwen2.5-VL's
``second_per_grid_ts``) and the pixels equal the processor's own output on the same MP4 files
read by transformers' ``load_video``."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from mmpack.energon import PackingEncoderConfig, PackingTaskEncoder
from mmpack.energon.media import MediaHandle
from mmpack.energon.processors import video_frames
from mmpack.energon.samples import Conversation, Part, Turn
from mmpack_dev.synthetic import mp4_bytes
from support.conversations import cooked_conversation
from support.processors import qwen_vl_processor

#: processor family -> the output fields compared
FIELDS = {
    "qwen2_vl": ("pixel_values_videos", "video_grid_thw"),
    "qwen2_5_vl": ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts"),
}
#: (frames, width, height, fps) of each clip of the pack
CLIPS = ((8, 64, 48, 4), (6, 56, 56, 2), (5, 60, 40, 4))


@functools.cache
def processor_of(family: str) -> Any:
    return qwen_vl_processor(family)


@pytest.fixture(scope="module")
def clips(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("clips")
    paths = []
    for i, (frames, width, height, fps) in enumerate(CLIPS):
        path = root / f"clip{i}.mp4"
        path.write_bytes(mp4_bytes(frames, width, height, fps=fps, seed=i))
        paths.append(path)
    return paths


def conversation(key: str, clip: Path) -> Conversation:
    handle = MediaHandle(
        kind="video",
        key=clip.name,
        sample_key=key,
        source=("test", clip.name),
        data=clip.read_bytes(),
    )
    return cooked_conversation(
        key,
        [
            Turn("user", (Part(media=handle), Part(text="What happens?"))),
            Turn("assistant", (Part(text="Noise."),)),
        ],
    )


def load(path: Path) -> tuple[Any, Any]:
    from transformers.video_utils import load_video

    return load_video(str(path), backend="pyav")


@pytest.mark.parametrize("family", sorted(FIELDS))
def test_packed_video_fields_equal_the_processors_own_through_load_video(
    family: str, clips: list[Path]
) -> None:
    processor = processor_of(family)
    enc = PackingTaskEncoder(PackingEncoderConfig(modalities=["video"]), processor=processor)
    decoded = [
        enc.postencode_sample(enc.encode_conversation(conversation(f"s{i}", clip)))
        for i, clip in enumerate(clips)
    ]
    pack = enc.build_pack(decoded)
    loaded = [load(p) for p in clips]
    theirs = processor(
        text=[processor.video_token * len(clips)],
        videos=[frames for frames, _ in loaded],
        video_metadata=[meta for _, meta in loaded],
        return_tensors="pt",
    )
    for name in FIELDS[family]:
        ours = pack.media[name].as_tensor()
        assert ours.dtype == theirs[name].dtype and ours.shape == theirs[name].shape, name
        assert torch.equal(ours, theirs[name]), name
    if family == "qwen2_5_vl":
        # temporal_patch_size 2 frames per grid step: 0.5 s at 4 fps, 1 s at 2 fps
        steps = pack.media["second_per_grid_ts"].as_tensor().tolist()
        assert steps == [2 / fps for *_, fps in CLIPS] == [0.5, 1.0, 0.5]


def test_without_metadata_the_processor_assumes_24_fps(clips: list[Path]) -> None:
    # the trap the metadata avoids: frames alone are timed at the processor's default rate
    processor = processor_of("qwen2_5_vl")
    frames, _ = load(clips[0])
    out = processor(text=[processor.video_token], videos=[frames], return_tensors="pt")
    assert out["second_per_grid_ts"].tolist() == pytest.approx([2 / 24])


def test_decoded_frames_and_metadata_are_load_videos(clips: list[Path]) -> None:
    for path in clips:
        ours = video_frames(path.read_bytes())
        frames, meta = load(path)
        assert np.array_equal(ours.frames, frames)
        for field in ("total_num_frames", "fps", "width", "height", "duration", "video_backend"):
            assert ours.metadata[field] == meta[field], field
        assert np.array_equal(ours.metadata.frames_indices, meta.frames_indices)
        assert ours.metadata.sampled_fps == meta.sampled_fps
