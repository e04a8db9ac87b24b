"""Audio through a processor family: the tokens of a clip before decoding (from its sample
count and the feature extractor's window settings) and the feature frames the model's audio
tower reads (the `mmpack.energon.processors.families.UnitRule` of an audio family)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mmpack.energon.processors.model import ModelProcessor

__all__ = ["feature_frames", "feature_rows", "qwen2_audio_tokens"]


def qwen2_audio_tokens(samples: int, extractor: Any) -> int:
    """Qwen2-Audio's tokens for a clip of `samples` samples at `extractor`'s rate."""
    # the feature extractor pads to n_samples (30 s) and keeps one frame per hop_length
    # samples; the encoder's conv (stride 2) and pooling (stride 2) follow
    frames = min(math.ceil(samples / int(extractor.hop_length)), int(extractor.nb_max_frames))
    return (((frames - 1) // 2 + 1) - 2) // 2 + 1


def feature_frames(bridge: ModelProcessor, kind: str, size: tuple[int, ...], tokens: int) -> int:
    # Qwen2-Audio pads every clip's features to the extractor's 30 s window: the audio tower
    # reads nb_max_frames feature frames per clip
    return int(bridge.component("audio").nb_max_frames)


def feature_rows(bridge: ModelProcessor, kind: str, values: Mapping[str, Any]) -> int:
    return int(values["input_features"].shape[-1])
