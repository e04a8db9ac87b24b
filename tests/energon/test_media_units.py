"""``media_capacity`` counts media units: the rows the model's vision or audio tower processes
(image and video patches, audio feature frames), for every processor family, read off the
processor's real output; the placeholder tokens count in ``capacity``."""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any

import pytest
from megatron.energon import SkipSample
from mmpack.energon import PackingEncoderConfig, PackingTaskEncoder
from mmpack.energon.media import MediaHandle
from mmpack.energon.samples import Conversation, Part, Turn
from mmpack.errors import ModalityConfigError
from mmpack_dev.synthetic import mp4_bytes, png_bytes, wav_bytes
from support.processors import qwen_vl_processor

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import llava
import qwen2_audio
from support.conversations import cooked_conversation


@functools.cache
def processor_of(family: str) -> Any:
    if family == "llava":
        return llava.build_processor()
    if family == "qwen2_audio":
        return qwen2_audio.build_processor()
    return qwen_vl_processor(family)


def item(kind: str, name: str, data: bytes, sample: str = "s0") -> MediaHandle:
    return MediaHandle(kind=kind, key=name, sample_key=sample, source=("test", name), data=data)


def conversation(key: str, *media: MediaHandle) -> Conversation:
    return cooked_conversation(
        key,
        [
            Turn("user", (*(Part(media=m) for m in media), Part(text="Describe it."))),
            Turn("assistant", (Part(text="It is noise."),)),
        ],
    )


def tower_rows(family: str, kind: str, values: dict[str, Any]) -> int:
    """Rows the model's tower reads for one decoded item, from the processor's output."""
    if family == "llava":
        crops, _, height, width = values["pixel_values"].shape
        return int(crops) * (height // llava.PATCH) * (width // llava.PATCH)
    if kind == "audio":
        return int(values["input_features"].shape[-1])
    grid = values["image_grid_thw" if kind == "image" else "video_grid_thw"]
    rows = int(values["pixel_values" if kind == "image" else "pixel_values_videos"].shape[0])
    assert rows == int(grid.prod())
    return rows


CASES = [
    ("qwen2_vl", "image", [("a.png", png_bytes(200, 150)), ("b.png", png_bytes(56, 84, seed=1))]),
    ("qwen2_vl", "video", [("c.mp4", mp4_bytes(6, 64, 48, fps=4))]),
    ("qwen2_5_vl", "image", [("a.png", png_bytes(113, 57))]),
    ("qwen2_5_vl", "video", [("c.mp4", mp4_bytes(5, 56, 56, fps=2))]),
    ("llava", "image", [("a.png", png_bytes(64, 48)), ("b.png", png_bytes(30, 90, seed=2))]),
    ("qwen2_audio", "audio", [("a.wav", wav_bytes(0.7)), ("b.wav", wav_bytes(2.0, 22050))]),
]


@pytest.mark.parametrize(("family", "kind", "files"), CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_media_units_are_the_rows_the_tower_processes(
    family: str, kind: str, files: list[tuple[str, bytes]]
) -> None:
    processor = processor_of(family)
    enc = PackingTaskEncoder(PackingEncoderConfig(modalities=[kind]), processor=processor)
    handles = [item(kind, name, data) for name, data in files]
    encoded = enc.encode_conversation(conversation("s0", *handles))
    rows = sum(
        tower_rows(family, kind, enc.model_processor.process(h).values)  # type: ignore[union-attr]
        for h in handles
    )
    assert encoded.media_units == rows
    tokens = sum(encoded.media_tokens)
    if family.startswith("qwen2") and kind != "audio":
        assert rows == 4 * tokens  # one placeholder token per 2x2 merged patches
    if family == "qwen2_audio":
        assert rows == 3000 * len(files)  # the 30 s window of features per clip
        assert tokens < rows


def test_the_builtin_patchifier_counts_patches_and_feature_frames() -> None:
    from mmpack_dev.synthetic import build_tokenizer

    cfg = PackingEncoderConfig(modalities=["image", "audio"], conversation_format="markup")
    settings = {"patch_size": 16, "sampling_rate": 16000, "hop_length": 160, "downsample_factor": 4}
    enc = PackingTaskEncoder(cfg, tokenizer=build_tokenizer(), processor=settings)
    picture = item("image", "a.png", png_bytes(64, 32))
    clip = item("audio", "a.wav", wav_bytes(0.5))
    encoded = enc.encode_conversation(conversation("s0", picture, clip))
    assert encoded.media_tokens == [8, 13]  # 4x2 patches; 50 frames / 4
    assert encoded.media_units == 8 + 50


def test_media_capacity_plans_packs_on_patches_not_tokens(worker: Any) -> None:
    processor = processor_of("qwen2_vl")
    # 200x150 -> 12 tokens, 48 patches: two fit a budget of 60 tokens, not of 60 patches
    cfg = PackingEncoderConfig(modalities=["image"], media_capacity=60, capacity=1024)
    enc = PackingTaskEncoder(cfg, processor=processor)
    samples = [
        enc.preencode_sample(
            conversation(f"s{i}", item("image", f"{i}.png", png_bytes(200, 150), f"s{i}"))
        )
        for i in range(2)
    ]
    assert [s.media_units for s in samples] == [48, 48]
    assert [s.media_tokens for s in samples] == [[12], [12]]
    groups = enc.select_samples_to_pack(samples)
    assert sorted(len(g) for g in groups) == [1, 1]
    # a sample alone over the budget is over it in patches
    small = PackingTaskEncoder(
        PackingEncoderConfig(modalities=["image"], media_capacity=40), processor=processor
    )
    with pytest.raises(SkipSample):
        small.preencode_sample(conversation("big", item("image", "x.png", png_bytes(200, 150))))
    assert small.stats.snapshot()["skipped"]["media_over_budget"] == 1


def test_a_processor_family_without_a_unit_rule_is_refused_with_media_capacity() -> None:
    from transformers import Qwen2VLProcessor

    class HomegrownVLProcessor(Qwen2VLProcessor):
        pass

    qwen = processor_of("qwen2_vl")
    mine = HomegrownVLProcessor(
        image_processor=qwen.image_processor,
        tokenizer=qwen.tokenizer,
        video_processor=qwen.video_processor,
    )
    cfg = PackingEncoderConfig(modalities=["image"], media_capacity=100)
    with pytest.raises(ModalityConfigError, match=r"no media unit rule.*HomegrownVLProcessor"):
        PackingTaskEncoder(cfg, processor=mine)
    # without a media budget its items are not counted in units, and it runs
    enc = PackingTaskEncoder(PackingEncoderConfig(modalities=["image"]), processor=mine)
    encoded = enc.encode_conversation(conversation("s0", item("image", "a.png", png_bytes(56, 56))))
    assert encoded.media_units == 0 and encoded.media_tokens == [4]
