"""Media through a model's real Hugging Face processor (`mmpack.energon.processors`): token
counts from the processor's own arithmetic before decoding agree with its real output, a lying
size is caught after decoding, coupled keys travel and deduplicate together, and the startup
checks read everything from the processor."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from mmpack.energon import PackingEncoderConfig, PackingTaskEncoder
from mmpack.energon.media import MediaHandle
from mmpack.energon.processors import ModelProcessor
from mmpack.energon.samples import Conversation, Part, Turn
from mmpack.errors import (
    EnergonConfigError,
    MediaTokenCountError,
    ModalityConfigError,
    SampleFormatError,
    UncountableMediaError,
)
from mmpack_dev.synthetic import png_bytes

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import llava
import qwen2_vl
from support.conversations import cooked_conversation


@pytest.fixture(scope="module")
def qwen() -> Any:
    return qwen2_vl.build_processor()


def image(key: str, size: tuple[int, int], *, sample: str = "s0", meta: Any = None) -> MediaHandle:
    return MediaHandle(
        kind="image",
        key=key,
        sample_key=sample,
        source=("test", key),
        data=png_bytes(*size, seed=sum(size)),
        meta={} if meta is None else meta,
    )


def conversation(key: str, *media: MediaHandle) -> Conversation:
    return cooked_conversation(
        key,
        [
            Turn("user", (*(Part(media=m) for m in media), Part(text="ka lo mi"))),
            Turn("assistant", (Part(text="ne su"),)),
        ],
    )


@pytest.mark.parametrize("size", [(56, 56), (84, 56), (30, 20), (200, 150), (1000, 30), (113, 57)])
def test_qwen2_vl_counts_before_decoding_match_the_real_output(qwen: Any, size: Any) -> None:
    bridge = ModelProcessor(qwen)
    bridge.probe(["image"])
    handle = image("a.png", size)
    predicted = bridge.count(handle)  # from the PNG header: nothing decoded
    processed = bridge.process(handle)
    grid = processed.values["image_grid_thw"]
    merge = qwen.image_processor.merge_size
    assert predicted == int(grid.prod()) // merge**2
    assert processed.values["pixel_values"].shape[0] == int(grid.prod())
    assert processed.token_ids == [qwen.image_token_id] * predicted
    # the resize policy applies: at most max_pixels (unless a side would fall below one
    # merged patch, as with 1000x30), at least min_pixels
    patch = qwen.image_processor.patch_size
    pixels = int(grid.prod()) * patch * patch
    assert pixels >= qwen2_vl.MIN_PIXELS
    if min(size) >= 56:
        assert pixels <= qwen2_vl.MAX_PIXELS


def test_settings_come_from_the_processor(qwen: Any) -> None:
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor

    small = Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(
            size={"shortest_edge": 56 * 56, "longest_edge": 56 * 56}
        ),
        tokenizer=qwen.tokenizer,
        video_processor=qwen.video_processor,
    )
    big, capped = ModelProcessor(qwen), ModelProcessor(small)
    assert big.count_for_size("image", (150, 200)) == 12
    assert capped.count_for_size("image", (150, 200)) == 2  # its own max_pixels
    settings = big.settings("image")
    assert settings["patch_size"] == 14 and settings["merge_size"] == 2
    assert big.modalities == ("image", "video")


def test_a_lying_size_is_caught_after_decoding(qwen: Any) -> None:
    cfg = PackingEncoderConfig(modalities=["image"])
    enc = PackingTaskEncoder(cfg, processor=qwen)
    lying = image("a.png", (200, 150), meta={"width": 56, "height": 56})
    encoded = enc.encode_conversation(conversation("s0", lying))
    assert encoded.media_tokens == [4]  # what the declared size takes
    with pytest.raises(MediaTokenCountError, match=r"takes 12 tokens.*encoded with 4 tokens"):
        enc.postencode_sample(encoded)


@pytest.mark.parametrize("declared", [False, True], ids=["header", "metadata"])
def test_an_image_the_processor_cannot_count_is_refused_by_name(qwen: Any, declared: bool) -> None:
    # Qwen2-VL's smart_resize refuses an aspect ratio of 200 or more (here 400)
    cfg = PackingEncoderConfig(modalities=["image"])
    enc = PackingTaskEncoder(cfg, processor=qwen)
    meta = {"width": 1, "height": 400} if declared else None
    thin = image("thin.png", (1, 400), sample="s-thin", meta=meta)
    with pytest.raises(UncountableMediaError) as info:
        enc.encode_conversation(conversation("s-thin", thin))
    err = info.value
    assert isinstance(err, SampleFormatError)
    message = str(err)
    assert "sample 's-thin'" in message and "image 'thin.png'" in message
    assert "Qwen2VLProcessor" in message and "1x400" in message
    assert "absolute aspect ratio must be smaller than 200" in message
    assert type(err.__cause__) is ValueError  # the processor's own error, chained
    # counted directly, as after decoding when no encoded counts are carried
    with pytest.raises(UncountableMediaError, match=r"sample 's-thin'.*'thin.png'"):
        ModelProcessor(qwen).count(thin)


def test_coupled_keys_keep_equal_counts_and_deduplicate_together(qwen: Any) -> None:
    cfg = PackingEncoderConfig(modalities=["image"])
    enc = PackingTaskEncoder(cfg, processor=qwen)
    shared = image("shared.png", (84, 56))
    first = conversation("s0", shared, image("own.png", (56, 56)))
    second = conversation("s1", shared)
    decoded = [enc.postencode_sample(enc.encode_conversation(c)) for c in (first, second)]
    pack = enc.build_pack(decoded)
    values, grid = pack.media["pixel_values"], pack.media["image_grid_thw"]
    assert values.logical_segment_counts_by_row() == grid.logical_segment_counts_by_row() == [3]
    assert len(values.tensors) == len(grid.tensors) == 2  # the shared image is stored once
    assert values._segment_indices == grid._segment_indices
    rows = grid.as_tensor()
    assert rows.tolist() == [[1, 4, 6], [1, 4, 4], [1, 4, 6]]
    assert values.as_tensor().shape[0] == int(rows.prod(-1).sum())
    # the model's placeholder count: one token per merged patch group
    image_tokens = int((pack.input_ids == qwen.image_token_id).sum())
    assert image_tokens == int(rows.prod(-1).sum()) // 4


def test_a_text_only_processor_with_audio_configured_stops_at_construction(qwen: Any) -> None:
    cfg = PackingEncoderConfig(modalities=["image", "audio"])
    with pytest.raises(ModalityConfigError, match=r"\['audio'\].*handles image, video"):
        PackingTaskEncoder(cfg, processor=qwen)
    only_images = llava.build_processor()
    with pytest.raises(ModalityConfigError, match=r"\['video'\].*LlavaProcessor handles image"):
        PackingTaskEncoder(PackingEncoderConfig(modalities=["video"]), processor=only_images)
    with pytest.raises(ModalityConfigError, match=r"video.*needs a model's Hugging Face processor"):
        PackingTaskEncoder(
            PackingEncoderConfig(modalities=["video"]),
            tokenizer=qwen.tokenizer,
            processor={"patch_size": 14},
        )


def test_a_model_processor_needs_the_chat_template(qwen: Any) -> None:
    with pytest.raises(EnergonConfigError, match="needs the tokenizer's chat template"):
        PackingTaskEncoder(
            PackingEncoderConfig(modalities=["image"], conversation_format="markup"),
            processor=qwen,
        )


def test_llava_counts_are_fixed_by_its_crop(qwen: Any) -> None:
    bridge = ModelProcessor(llava.build_processor())
    bridge.probe(["image"])
    for size in ((64, 48), (300, 20), (14, 14)):
        handle = image("a.png", size)
        processed = bridge.process(handle)
        assert (
            bridge.count(handle) == 16 == processed.token_ids.count(bridge.placeholder_id("image"))
        )
        assert tuple(processed.values["pixel_values"].shape) == (1, 3, llava.CROP, llava.CROP)
        assert np.isfinite(processed.values["pixel_values"].numpy()).all()


def test_video_counts_from_the_container_header_match_the_real_output(qwen: Any) -> None:
    bridge = ModelProcessor(qwen)
    bridge.probe(["video"])
    for frames, width, height in ((4, 64, 48), (3, 120, 90), (6, 56, 56)):
        clip = MediaHandle(
            kind="video",
            key="clip.mp4",
            sample_key="s0",
            source=("test", f"{frames}x{width}x{height}"),
            data=qwen2_vl.video_bytes(frames, width, height),
        )
        assert clip.video_shape() == (frames, height, width)  # header only, no frame decoded
        predicted = bridge.count(clip)
        processed = bridge.process(clip)
        grid = processed.values["video_grid_thw"]
        assert predicted == int(grid.prod()) // 4 == processed.token_ids.count(qwen.video_token_id)
        assert processed.values["pixel_values_videos"].shape[0] == int(grid.prod())
        # Qwen2-VL pairs frames (temporal_patch_size 2): an odd count is padded
        assert int(grid[0, 0]) == -(-frames // 2)
    lying = MediaHandle(
        kind="video",
        key="clip.mp4",
        sample_key="s0",
        source=("test", "lying"),
        data=qwen2_vl.video_bytes(6, 64, 48),
        meta={"frames": 2, "width": 64, "height": 48},
    )
    with pytest.raises(MediaTokenCountError, match=r"video 'clip.mp4'"):
        bridge.check_tokens("s0", lying, bridge.process(lying), bridge.count(lying))


def test_audio_counts_follow_the_feature_extractors_settings() -> None:
    import qwen2_audio
    from mmpack_dev.synthetic import wav_bytes

    processor = qwen2_audio.build_processor()
    bridge = ModelProcessor(processor)
    bridge.probe(["audio"])
    audio_id = bridge.placeholder_id("audio")
    for seconds, rate in ((0.3, 16000), (1.0, 16000), (0.77, 22050), (40.0, 16000)):
        clip = MediaHandle(
            kind="audio",
            key="a.wav",
            sample_key="s0",
            source=("test", f"{seconds}@{rate}"),
            data=wav_bytes(seconds, rate),
        )
        predicted = bridge.count(clip)  # from the WAV header
        processed = bridge.process(clip)
        assert processed.token_ids.count(audio_id) == predicted
        frames = int(processed.values["feature_attention_mask"].sum())
        assert frames == min(-(-round(seconds * 16000) // 160), 3000)  # 30 s at most
        assert tuple(processed.values["input_features"].shape) == (1, 128, 3000)
    assert bridge.settings("audio")["hop_length"] == 160
