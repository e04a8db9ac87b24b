"""Unique media into the model: the vision tower once per unique segment, with exact gradients.

``encode_once(model)`` adapts a Hugging Face model of a supported family (``FAMILIES``:
Qwen2-VL, Qwen2.5-VL, LLaVA, LLaVA-NeXT) to take media as ``UniqueSegments``
(``PackedTensor.unique_segments()``); ``encode_stats(model)`` counts what its tower encoded.
Rooms: ``families`` (what each family reads), ``encode_once`` (the adapted forward),
``feature_cache`` (features reused across no-grad micro-batches of a step).
"""

from __future__ import annotations

from mmpack.packed.unique import UniqueSegments
from mmpack.vision.encode_once import EncodeStats, encode_once, encode_stats
from mmpack.vision.families import FAMILIES

__all__ = ["FAMILIES", "EncodeStats", "UniqueSegments", "encode_once", "encode_stats"]
