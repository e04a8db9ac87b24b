"""The model families ``encode_once`` adapts, and what each reads of its media.

Every family here computes its vision features with the model's own public
``get_<modality>_features`` (one feature tensor per image or video, in input order) and takes
them back through its forward's ``mm_encoder_outputs``, so the adapter changes only *which*
media the tower sees (each unique segment once) and repeats the resulting features to every
occurrence: the rest of the forward (placeholder checks, the scatter into the text embeddings,
Qwen's 3-D rope index) runs as the family wrote it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["FAMILIES", "Family", "Modality", "family_of"]


@dataclass(frozen=True)
class Modality:
    """One kind of media of a family.

    * ``name``: the key of ``mm_encoder_outputs`` and the ``get_<name>_features`` method;
    * ``values_key``: the forward kwarg holding the media;
    * ``items_key``: the kwarg whose entries along its packed dimension are one per feature
      tensor (an image or a video): Qwen's ``image_grid_thw``, LLaVA's ``pixel_values``;
    * ``encoder_keys``: kwargs the feature call reads per unique segment, beside the values
      (each optional: passed when the call has it);
    * ``logical_keys``: kwargs the rest of the forward still reads per occurrence (Qwen's
      ``image_grid_thw`` for its rope index), given to it as ``as_tensor()`` would;
    * ``config_keys``: feature-call options whose default is the model config's.
    """

    name: str
    values_key: str
    items_key: str
    encoder_keys: tuple[str, ...] = ()
    logical_keys: tuple[str, ...] = ()
    config_keys: tuple[str, ...] = ()


@dataclass(frozen=True)
class Family:
    """A model family: the ``config.model_type`` values it covers and its modalities."""

    name: str
    model_types: tuple[str, ...]
    modalities: tuple[Modality, ...]
    #: per-occurrence kwargs of no modality's own (Qwen2.5-VL's ``second_per_grid_ts``)
    logical_keys: tuple[str, ...] = ()


_QWEN_IMAGE = Modality(
    "image", "pixel_values", "image_grid_thw", ("image_grid_thw",), ("image_grid_thw",)
)
_QWEN_VIDEO = Modality(
    "video", "pixel_values_videos", "video_grid_thw", ("video_grid_thw",), ("video_grid_thw",)
)
_LLAVA_OPTIONS = ("vision_feature_layer", "vision_feature_select_strategy")
#: LLaVA's and LLaVA-NeXT's images: one feature tensor per ``pixel_values`` entry
_LLAVA_IMAGE = Modality(
    "image", "pixel_values", "pixel_values", ("image_sizes",), config_keys=_LLAVA_OPTIONS
)

FAMILIES: tuple[Family, ...] = (
    Family("Qwen2-VL", ("qwen2_vl",), (_QWEN_IMAGE, _QWEN_VIDEO)),
    Family(
        "Qwen2.5-VL",
        ("qwen2_5_vl",),
        (_QWEN_IMAGE, _QWEN_VIDEO),
        logical_keys=("second_per_grid_ts",),
    ),
    Family(
        "LLaVA",
        ("llava",),
        (_LLAVA_IMAGE,),
    ),
    Family(
        "LLaVA-NeXT",
        ("llava_next",),
        (_LLAVA_IMAGE,),
    ),
)


def family_of(model: Any) -> Family | None:
    """The family of ``model`` by its config's ``model_type``, or ``None``."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    return None
