"""Pixels through a processor family: the rows a model's vision tower reads per image or video
(before decoding, from the item's size; after, from the processor's real output), and the image
as transformers' loading opens it.

Each ``*_patches`` function is a `mmpack.energon.processors.families.UnitRule` ``before``, each
``*_rows`` function the matching ``after``."""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from mmpack.energon.media import upright_image

if TYPE_CHECKING:
    from mmpack.energon.processors.model import ModelProcessor

__all__ = [
    "anyres_patches",
    "anyres_rows",
    "crop_patches",
    "crop_rows",
    "grid_rows",
    "merged_patches",
    "open_image",
]


def open_image(data: bytes) -> Any:
    """The ``PIL.Image`` as opened, turned upright by its EXIF orientation, in its own mode
    (the processor's RGB conversion decides how transparency and other modes become pixels)."""
    from PIL import Image

    img = Image.open(io.BytesIO(data))
    img.load()  # the pixels now, while the bytes are at hand
    return upright_image(img)


def merged_patches(bridge: ModelProcessor, kind: str, size: tuple[int, ...], tokens: int) -> int:
    # Qwen2-VL / Qwen2.5-VL: one placeholder token per merge_size x merge_size patches, and
    # the vision tower reads every patch (a row of pixel_values / pixel_values_videos)
    merge = int(bridge.setting(kind, "merge_size"))
    return tokens * merge * merge


def grid_rows(bridge: ModelProcessor, kind: str, values: Mapping[str, Any]) -> int:
    key = "pixel_values" if kind == "image" else "pixel_values_videos"
    return int(values[key].shape[0])


def crop_patches(bridge: ModelProcessor, kind: str, size: tuple[int, ...], tokens: int) -> int:
    # LLaVA: every image is resized and cropped to crop_size; the vision tower reads its
    # (crop / patch_size)^2 patches, whatever the placeholder count (CLS, feature strategy)
    crop = bridge.setting(kind, "crop_size")
    patch = int(bridge.processor.patch_size)
    return (int(crop["height"]) // patch) * (int(crop["width"]) // patch)


def crop_rows(bridge: ModelProcessor, kind: str, values: Mapping[str, Any]) -> int:
    crops, _, height, width = values["pixel_values"].shape
    patch = int(bridge.processor.patch_size)
    return int(crops) * (int(height) // patch) * (int(width) // patch)


def anyres_patches(bridge: ModelProcessor, kind: str, size: tuple[int, ...], tokens: int) -> int:
    # LLaVA-NeXT: the base crop plus the tiles of the best grid pinpoint for the image's size;
    # the vision tower reads the (crop / patch_size)^2 patches of each (padding tiles dropped)
    from transformers.image_processing_utils import select_best_resolution

    height, width = size
    crop = bridge.setting("image", "crop_size")
    ch, cw = int(crop["height"]), int(crop["width"])
    pinpoints = bridge.setting("image", "image_grid_pinpoints")
    best_h, best_w = select_best_resolution((height, width), pinpoints)
    tiles = (int(best_h) // ch) * (int(best_w) // cw) + 1
    patch = int(bridge.processor.patch_size)
    return tiles * (ch // patch) * (cw // patch)


def anyres_rows(bridge: ModelProcessor, kind: str, values: Mapping[str, Any]) -> int:
    _, tiles, _, height, width = values["pixel_values"].shape
    patch = int(bridge.processor.patch_size)
    return int(tiles) * (int(height) // patch) * (int(width) // patch)
