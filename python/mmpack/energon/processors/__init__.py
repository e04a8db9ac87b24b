"""A model's Hugging Face processor (``transformers.ProcessorMixin``), called for real on the
media of the samples that are packed (`ModelProcessor`).

What it reads from the processor (nothing is configured twice):

* which media kinds it handles: ``image`` (an ``image_processor`` and an ``image_token``),
  ``video`` (a ``video_processor`` and a ``video_token``), ``audio`` (a ``feature_extractor`` /
  ``audio_processor`` and an ``audio_token``);
* the placeholder token of each kind, and what the processor puts in its place (learned at
  construction by processing one small probe item per kind: a prefix, a run of placeholder
  tokens, a suffix);
* token counts before decoding, from the processor's own arithmetic on the item's size
  (``_get_num_multimodal_tokens`` for images and videos, which e.g. applies Qwen2-VL's
  min/max pixels, patch size and ``merge_size``; for audio, the feature extractor's window
  settings and the model family's length rule in `AUDIO_TOKEN_RULES`);
* media units before decoding (`MEDIA_UNIT_RULES`, per processor family): the rows the model's
  vision or audio tower reads for the item (image and video patches, audio feature frames),
  which is what ``media_capacity`` budgets; checked against the real output at construction;
* after decoding, the real output: every tensor the processor returns for the item
  (``pixel_values`` + ``image_grid_thw``, ``pixel_values_videos`` + ``video_grid_thw`` (+
  ``second_per_grid_ts``), ``input_features`` + ``feature_attention_mask``, ...) and the real
  placeholder expansion, which must equal the one the sample was encoded with (else
  `MediaTokenCountError`).

The processor gets what transformers' documented loading hands it (`ModelProcessor.decode`):
an image as ``PIL.Image.open`` gives it, unconverted, so its own RGB conversion decides how
transparency and other modes become pixels, turned upright by its EXIF orientation as
``load_image`` turns it (``ImageOps.exif_transpose``; token counts use the upright size); a
video's frames with their metadata (frame rate, frame indices), so time-dependent outputs are
the ones ``load_video`` would give.

`ModelProcessor` is a `MediaDecoder`: the loop of `mmpack.energon.decoders.decode_media` makes
each output key one `PackedTensor` row per sample; every key of one media item carries the
item's provenance, so coupled keys keep equal per-row counts and deduplicate together.

Modules: `model` (`ModelProcessor`), `calling` (one item through the processor), `probe` (the
startup probe), `families` (what mmpack knows per processor family), and one per modality:
`pixels` (image and video patches, opening an image), `video` (frames and their metadata),
`audio` (clip tokens and feature frames).
"""

from __future__ import annotations

from mmpack.energon.processors.families import (
    AUDIO_TOKEN_RULES,
    MEDIA_UNIT_RULES,
    PADDED_KEYS,
    UnitRule,
)
from mmpack.energon.processors.model import ModelProcessor, is_model_processor
from mmpack.energon.processors.video import VideoFrames, video_frames

__all__ = [
    "AUDIO_TOKEN_RULES",
    "MEDIA_UNIT_RULES",
    "PADDED_KEYS",
    "ModelProcessor",
    "UnitRule",
    "VideoFrames",
    "is_model_processor",
    "video_frames",
]
