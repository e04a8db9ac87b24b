"""Hostile media against the real processors, each checked field by field against the
processor called on the same file the documented way (``load_image``, which turns a photo
upright by its EXIF orientation)."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from mmpack.energon.decoders import BuiltinDecoder
from mmpack.energon.media import MediaHandle, MediaSettings
from mmpack.energon.processors import ModelProcessor
from mmpack.errors import ModalityConfigError
from PIL import Image, ImageOps
from support.processors import qwen_vl_processor

_ORIENTATION = 0x0112


@pytest.fixture(scope="module")
def qwen() -> Any:
    return qwen_vl_processor()


@pytest.fixture(scope="module")
def bridge(qwen: Any) -> ModelProcessor:
    out = ModelProcessor(qwen)
    out.probe(["image"])
    return out


def exif_jpeg(width: int, height: int, orientation: int, *, seed: int = 0) -> bytes:
    """A JPEG stored `width` x `height`, displayed turned by its EXIF `orientation` (what a
    phone camera writes)."""
    rng = np.random.default_rng(seed)
    img = Image.fromarray(rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8))
    exif = Image.Exif()
    exif[_ORIENTATION] = orientation
    buf = io.BytesIO()
    img.save(buf, "JPEG", exif=exif)
    return buf.getvalue()


def handle(data: bytes, key: str = "photo.jpg") -> MediaHandle:
    return MediaHandle(kind="image", key=key, sample_key="s0", source=("test", key), data=data)


@pytest.mark.parametrize("orientation", [1, 3, 6, 8, 5])
def test_an_exif_rotated_photo_reaches_the_processor_upright(
    qwen: Any, bridge: ModelProcessor, tmp_path: Path, orientation: int
) -> None:
    from transformers.image_utils import load_image

    data = exif_jpeg(112, 56, orientation)
    path = tmp_path / "photo.jpg"
    path.write_bytes(data)
    oracle = qwen(text=[qwen.image_token], images=[load_image(str(path))], return_tensors="pt")
    item = handle(data)
    predicted = bridge.count(item)  # from the header: the upright size
    out = bridge.process(item)
    assert torch.equal(out.values["image_grid_thw"], oracle["image_grid_thw"])
    assert torch.equal(out.values["pixel_values"], oracle["pixel_values"])
    assert out.token_ids == oracle["input_ids"][0].tolist()
    assert predicted == sum(1 for t in out.token_ids if t == qwen.image_token_id)
    width, height = (56, 112) if orientation in (5, 6, 7, 8) else (112, 56)
    assert item.image_size() == (width, height)


def test_an_exif_rotated_photo_keeps_its_transparency_and_mode(
    qwen: Any, bridge: ModelProcessor
) -> None:
    # a palette PNG with a transparent entry and an EXIF orientation (eXIf before the pixels)
    rng = np.random.default_rng(3)
    palette = Image.fromarray(rng.integers(0, 256, size=(56, 84, 3), dtype=np.uint8)).quantize(8)
    exif = Image.Exif()
    exif[_ORIENTATION] = 6
    buf = io.BytesIO()
    palette.save(buf, "PNG", transparency=2, exif=exif)
    item = handle(buf.getvalue(), "palette.png")
    decoded = bridge.decode(item)
    upright = ImageOps.exif_transpose(Image.open(io.BytesIO(buf.getvalue())))
    assert decoded.mode == "P" and decoded.info.get("transparency") == 2
    assert decoded.size == upright.size == (56, 84)
    oracle = qwen(text=[qwen.image_token], images=[upright], return_tensors="pt")
    out = bridge.process(item)
    assert torch.equal(out.values["pixel_values"], oracle["pixel_values"])
    assert item.image_size() == (56, 84)


def test_the_builtin_patchifier_turns_a_photo_upright_too() -> None:
    data = exif_jpeg(56, 28, 6, seed=5)
    decoder = BuiltinDecoder(MediaSettings(image_patch_size=14))
    rotated = decoder.process(handle(data)).values["pixel_values"]
    upright = ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB")
    assert upright.size == (28, 56)
    arr = np.asarray(upright, dtype=np.uint8).reshape(4, 14, 2, 14, 3).transpose(0, 2, 1, 3, 4)
    expected = arr.reshape(8, 14 * 14 * 3).astype(np.float32) / np.float32(255.0)
    assert np.array_equal(rotated.numpy(), expected)


@pytest.mark.parametrize(
    "videos_kwargs",
    [{"fps": 2, "do_sample_frames": True}, {"num_frames": 4, "do_sample_frames": True}],
)
def test_a_video_processor_that_samples_frames_is_refused_at_construction(
    videos_kwargs: dict[str, Any],
) -> None:
    # the short startup clip hides fps sampling (clamped to min_frames); every real video
    # would then fail its token count after decoding
    bridge = ModelProcessor(
        qwen_vl_processor("qwen2_5_vl"), call_kwargs={"videos_kwargs": videos_kwargs}
    )
    with pytest.raises(ModalityConfigError, match=r"Qwen2_5_VLProcessor.*samples frames"):
        bridge.probe(["video"])


def test_a_video_processor_without_frame_sampling_still_starts(qwen: Any) -> None:
    from mmpack_dev.synthetic import mp4_bytes

    bridge = ModelProcessor(qwen, call_kwargs={"videos_kwargs": {"fps": 2}})
    bridge.probe(["video"])
    item = MediaHandle(
        kind="video",
        key="v.mp4",
        sample_key="s0",
        source=("test", "v"),
        data=mp4_bytes(12, 64, 48, fps=6),
    )
    out = bridge.process(item)
    assert sum(1 for t in out.token_ids if t == qwen.video_token_id) == bridge.count(item)
    assert int(out.values["video_grid_thw"][0, 0]) == 6
