"""Real Hugging Face processors built offline from their classes' defaults, with Qwen2-VL's real
tokenizer (Qwen2's BPE vocabulary), and the media files their oracles read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

# min/max pixels of the resize policy, small so the tests stay fast
MIN_PIXELS, MAX_PIXELS = 56 * 56, 112 * 112


def qwen_vl_processor(family: str = "qwen2_vl") -> Any:
    """Qwen2-VL's (``"qwen2_vl"``) or Qwen2.5-VL's (``"qwen2_5_vl"``) processor: its image and
    video processors' defaults with a small pixel budget, and the real Qwen2-VL tokenizer."""
    from mmpack_dev.qwen_vocab import qwen2_vl_tokenizer
    from transformers import Qwen2_5_VLProcessor, Qwen2VLImageProcessor, Qwen2VLProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    cls = {"qwen2_vl": Qwen2VLProcessor, "qwen2_5_vl": Qwen2_5_VLProcessor}[family]
    size = {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}
    tokenizer = qwen2_vl_tokenizer()
    return cls(
        image_processor=Qwen2VLImageProcessor(size=size),
        tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(size=size, cap_pixels_per_frame=True),
        chat_template=tokenizer.chat_template,
    )


def image_files(root: Path) -> dict[str, Path]:
    """One file per pixel layout a dataset holds, by name: RGBA, LA and palette-with-
    transparency PNGs, a 16-bit grayscale PNG, a CMYK JPEG, an 8-bit grayscale PNG and a
    plain RGB PNG, of different sizes."""
    from PIL import Image

    rng = np.random.default_rng(7)

    def pixels(h: int, w: int, c: int) -> np.ndarray:
        return rng.integers(0, 256, size=(h, w, c), dtype=np.uint8)

    made: dict[str, tuple[Any, str]] = {}
    rgba = pixels(60, 90, 4)
    rgba[..., 3] = np.linspace(0, 255, 90, dtype=np.uint8)[None, :]  # every alpha level
    made["rgba.png"] = (Image.fromarray(rgba, "RGBA"), "PNG")
    made["la.png"] = (Image.fromarray(pixels(70, 50, 2), "LA"), "PNG")
    palette = Image.fromarray(pixels(56, 84, 3), "RGB").quantize(colors=16)
    palette.info["transparency"] = 3  # palette entry 3 is transparent (a tRNS chunk)
    made["palette.png"] = (palette, "PNG")
    deep = rng.integers(0, 65536, size=(64, 64), dtype=np.uint16)
    made["gray16.png"] = (Image.fromarray(deep), "PNG")
    made["cmyk.jpg"] = (Image.fromarray(pixels(48, 80, 4), "CMYK"), "JPEG")
    made["gray.png"] = (Image.fromarray(pixels(90, 60, 1)[..., 0], "L"), "PNG")
    made["rgb.png"] = (Image.fromarray(pixels(57, 113, 3), "RGB"), "PNG")
    paths: dict[str, Path] = {}
    for name, (img, fmt) in made.items():
        path = root / name
        if fmt == "PNG" and "transparency" in img.info:
            img.save(path, fmt, transparency=img.info["transparency"])
        else:
            img.save(path, fmt)
        paths[name] = path
    return paths


def llava_next_processor() -> Any:
    """LLaVA-NeXT's processor: its image processor's any-resolution tiling (small crops and
    grid pinpoints, so the tests stay fast) and LLaVA's word-level tokenizer and template."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    import llava
    from transformers import LlavaNextImageProcessor, LlavaNextProcessor

    base = llava.build_processor()
    crop = llava.CROP
    image_processor = LlavaNextImageProcessor(
        size={"shortest_edge": crop},
        crop_size={"height": crop, "width": crop},
        image_grid_pinpoints=[[crop, 2 * crop], [2 * crop, crop], [2 * crop, 2 * crop]],
    )
    return LlavaNextProcessor(
        image_processor=image_processor,
        tokenizer=base.tokenizer,
        patch_size=llava.PATCH,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=llava.CHAT_TEMPLATE,
    )
