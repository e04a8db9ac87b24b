"""What mmpack knows per processor family, by the processor's class name: how an audio clip's
tokens are counted (`AUDIO_TOKEN_RULES`), what an item costs the model's media towers
(`MEDIA_UNIT_RULES`), and which output keys are packed zero-padded (`PADDED_KEYS`). The
arithmetic itself lives with its modality (`pixels`, `audio`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from mmpack.energon.processors import audio, pixels

if TYPE_CHECKING:
    from mmpack.energon.processors.model import ModelProcessor

__all__ = ["AUDIO_TOKEN_RULES", "MEDIA_UNIT_RULES", "PADDED_KEYS", "UnitRule"]


#: processor class name -> tokens of an audio clip of `samples` samples (at the feature
#: extractor's rate), from the feature extractor's settings
AUDIO_TOKEN_RULES: dict[str, Callable[[int, Any], int]] = {
    "Qwen2AudioProcessor": audio.qwen2_audio_tokens,
}


@dataclasses.dataclass(frozen=True)
class UnitRule:
    """How many rows an item costs the model's vision / audio tower (`media_capacity`'s unit):
    ``before(bridge, kind, size, tokens)`` from the item's size (as `count_for_size` takes it)
    and token count (nothing decoded), ``after(bridge, kind, values)`` from the processor's
    real output (checked equal at construction)."""

    before: Callable[[ModelProcessor, str, tuple[int, ...], int], int]
    after: Callable[[ModelProcessor, str, Mapping[str, Any]], int]


_QWEN_VL_UNITS = UnitRule(pixels.merged_patches, pixels.grid_rows)

#: processor class name -> its media units rule: image and video patches the vision tower
#: reads, audio feature frames the audio tower reads
MEDIA_UNIT_RULES: dict[str, UnitRule] = {
    "Qwen2VLProcessor": _QWEN_VL_UNITS,
    "Qwen2_5_VLProcessor": _QWEN_VL_UNITS,
    "LlavaProcessor": UnitRule(pixels.crop_patches, pixels.crop_rows),
    "Qwen2AudioProcessor": UnitRule(audio.feature_frames, audio.feature_rows),
    "LlavaNextProcessor": UnitRule(pixels.anyres_patches, pixels.anyres_rows),
}

#: processor class name -> media kind -> output keys whose per-item rows differ in a
#: non-leading dimension (LLaVA-NeXT: one row per image of ``[tiles, 3, H, W]``, the tile
#: count depending on the image's aspect ratio). They are packed as the processor batches
#: them: zero-padded to the largest item (``PackedTensor(pad_to_max_shape=True)``); the model
#: drops the padding from ``image_sizes``. A key whose rows differ that is not listed here
#: refuses the processor at construction.
PADDED_KEYS: dict[str, dict[str, tuple[str, ...]]] = {
    "LlavaNextProcessor": {"image": ("pixel_values",)},
}
