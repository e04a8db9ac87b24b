"""The batch of the no-packing path: one row per sample, padded to the longest sample.

Keys: ``input_ids`` (int64, padding is ``pad_token_id``), ``labels`` (int64 next-token targets:
``labels[r, p] = input_ids[r, p + 1]`` where ``loss_mask[r, p + 1]`` is 1, else
``ignore_index``), ``loss_mask`` (int8), ``attention_mask`` (bool, ``input_ids !=
pad_token_id``), and per media key (``pixel_values``, ...) the samples' media concatenated.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from mmpack import masks
from mmpack.energon.config import PackingEncoderConfig
from mmpack.energon.media import MEDIA_KEYS
from mmpack.energon.samples import EncodedConversation

__all__ = ["build_padded"]


def build_padded(
    samples: Sequence[EncodedConversation],
    config: PackingEncoderConfig,
    packed_tensor_type: Any,
) -> dict[str, Any]:
    """Rows padded to the longest sample; media values are joined with
    ``packed_tensor_type.concat``."""
    import torch

    width = max(s.num_tokens for s in samples)
    n = len(samples)
    input_ids = np.full((n, width), config.pad_token_id, dtype=np.int64)
    mask = np.zeros((n, width), dtype=np.int8)
    for row, s in enumerate(samples):
        input_ids[row, : s.num_tokens] = s.token_ids
        if s.loss_mask is not None:
            mask[row, : s.num_tokens] = s.loss_mask
        else:
            mask[row, : s.num_tokens] = masks.from_roles(
                s.message_lengths, s.message_roles or [], config.train_roles, sample_id=s.__key__
            )
    labels = np.full((n, width), config.ignore_index, dtype=np.int64)
    shifted = mask[:, 1:].astype(bool)
    labels[:, :-1] = np.where(shifted, input_ids[:, 1:], config.ignore_index)
    out: dict[str, Any] = {
        "input_ids": torch.from_numpy(input_ids),
        "labels": torch.from_numpy(labels),
        "loss_mask": torch.from_numpy(mask),
        "attention_mask": torch.from_numpy(input_ids != config.pad_token_id),
    }
    media = [s.decoded_media for s in samples if s.decoded_media]
    for key in MEDIA_KEYS.values():
        values = [m[key] for m in media if key in m]
        if values:
            out[key] = packed_tensor_type.concat(values)
    return out
