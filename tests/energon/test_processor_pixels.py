"""Pixels as the model's processor makes them: the packed ``pixel_values`` (and grids) of images
of every pixel layout equal the processor's own output on the same files, called as
transformers documents it (``processor(images=[PIL.Image.open(path)], text=...)``): nothing is
converted before the processor, so its own RGB conversion composites transparency."""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from mmpack.energon import PackingEncoderConfig, PackingTaskEncoder
from mmpack.energon.media import MediaHandle
from mmpack.energon.samples import Conversation, Part, Turn
from PIL import Image
from support.processors import image_files, qwen_vl_processor

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import llava
from support.conversations import cooked_conversation

TRANSPARENT = ("rgba.png", "la.png", "palette.png")

#: processor family -> (its processor, the output fields compared)
FAMILIES = {
    "qwen2_vl": (lambda: qwen_vl_processor("qwen2_vl"), ("pixel_values", "image_grid_thw")),
    "qwen2_5_vl": (lambda: qwen_vl_processor("qwen2_5_vl"), ("pixel_values", "image_grid_thw")),
    "llava": (llava.build_processor, ("pixel_values",)),
}


@functools.cache
def processor_of(family: str) -> Any:
    """One processor per family for the module (building the real tokenizer takes seconds)."""
    return FAMILIES[family][0]()


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return image_files(tmp_path_factory.mktemp("images"))


def handle(path: Path, sample: str) -> MediaHandle:
    return MediaHandle(
        kind="image",
        key=path.name,
        sample_key=sample,
        source=("test", path.name),
        data=path.read_bytes(),
    )


def conversation(key: str, media: list[MediaHandle]) -> Conversation:
    return cooked_conversation(
        key,
        [
            Turn("user", (*(Part(media=m) for m in media), Part(text="What is shown?"))),
            Turn("assistant", (Part(text="A picture."),)),
        ],
    )


def packed_media(processor: Any, paths: list[Path]) -> dict[str, torch.Tensor]:
    """The media fields of one pack of two samples holding `paths`, through the task encoder."""
    enc = PackingTaskEncoder(PackingEncoderConfig(modalities=["image"]), processor=processor)
    half = len(paths) // 2
    samples = [
        conversation("s0", [handle(p, "s0") for p in paths[:half]]),
        conversation("s1", [handle(p, "s1") for p in paths[half:]]),
    ]
    decoded = [enc.postencode_sample(enc.encode_conversation(c)) for c in samples]
    pack = enc.build_pack(decoded)
    return {name: value.as_tensor() for name, value in pack.media.items()}


def processor_output(processor: Any, images: list[Any]) -> dict[str, torch.Tensor]:
    """The processor's own batched output for `images`, called as its documentation shows."""
    text = [processor.image_token * len(images)]
    return dict(processor(images=images, text=text, return_tensors="pt"))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_packed_pixels_equal_the_processors_own_on_the_same_files(
    family: str, files: dict[str, Path]
) -> None:
    processor, fields = processor_of(family), FAMILIES[family][1]
    paths = list(files.values())
    ours = packed_media(processor, paths)
    theirs = processor_output(processor, [Image.open(p) for p in paths])
    for name in fields:
        assert ours[name].dtype == theirs[name].dtype, name
        assert ours[name].shape == theirs[name].shape, name
        assert torch.equal(ours[name], theirs[name]), (
            f"{family} {name}: max difference "
            f"{(ours[name].double() - theirs[name].double()).abs().max().item()}"
        )


def test_converting_before_the_processor_would_change_transparent_pixels(
    files: dict[str, Path],
) -> None:
    # what a conversion to RGB ahead of the processor (dropping alpha instead of compositing
    # it onto white) gives: the comparison above would catch it
    processor = processor_of("qwen2_vl")
    for name in ("rgba.png", "la.png"):
        opened = processor_output(processor, [Image.open(files[name])])["pixel_values"]
        converted = processor_output(processor, [Image.open(files[name]).convert("RGB")])
        gap = (opened - converted["pixel_values"]).abs().max().item()
        assert gap > 1.0, (name, gap)  # normalised units


def test_opaque_files_also_equal_transformers_load_image(files: dict[str, Path]) -> None:
    # load_image converts to RGB itself (it drops alpha, so only opaque layouts agree with the
    # processor's compositing); for those both documented paths give the packed pixels
    from transformers.image_utils import load_image

    processor = processor_of("qwen2_vl")
    opaque = [p for name, p in files.items() if name not in TRANSPARENT]
    ours = packed_media(processor, opaque)
    theirs = processor_output(processor, [load_image(str(p)) for p in opaque])
    assert torch.equal(ours["pixel_values"], theirs["pixel_values"])
    assert torch.equal(ours["image_grid_thw"], theirs["image_grid_thw"])
