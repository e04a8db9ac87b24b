"""Plain-Python/torch packed-batch builder, the way SFT pipelines build THD packs today: a
Python loop over samples with per-sample torch calls (mask, pad, shift, arange, cat).

The oracle for ``mmpack.batch.pack_samples`` and its benchmark baseline: same layout, labels,
errors (same exception classes) and media merge.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from mmpack.batch import EncodedSample, PackedBatch, merge_media
from mmpack.errors import (
    BatchOptionError,
    EmptySampleError,
    InvalidTokenError,
    MissingFieldError,
)

from reference import masks as ref_masks

__all__ = ["pack_samples"]


def _name(sample_id) -> str:
    return repr(sample_id)


def pack_samples(
    samples: Sequence[EncodedSample],
    *,
    loss_mask_mode: str | None = None,
    train_roles: Sequence[str] = ("assistant",),
    pad_token_id: int = 0,
    pad_to_multiple_of: int = 1,
    ignore_index: int = -100,
    cp_size: int = 1,
) -> PackedBatch:
    if loss_mask_mode not in (None, "precomputed"):
        raise BatchOptionError(f"invalid loss_mask_mode: {loss_mask_mode!r}")
    if pad_to_multiple_of < 1 or cp_size < 1:
        raise BatchOptionError("pad_to_multiple_of and cp_size must be >= 1")
    if not samples:
        raise EmptySampleError("pack_samples needs at least one sample, got none")
    multiple = pad_to_multiple_of
    if cp_size > 1:
        multiple = math.lcm(pad_to_multiple_of, 2 * cp_size)

    ids, labels, masks, positions = [], [], [], []
    lens, padded_lens = [], []
    for s in samples:
        tokens = torch.as_tensor(s.token_ids).long()
        n = tokens.numel()
        if n == 0:
            raise EmptySampleError(f"sample {_name(s.sample_id)} has no tokens")
        if bool((tokens < 0).any()):
            raise InvalidTokenError(f"sample {_name(s.sample_id)} has a negative token id")
        if loss_mask_mode == "precomputed":
            if s.loss_mask is None:
                raise MissingFieldError(
                    f"sample {_name(s.sample_id)} has no loss_mask, which "
                    "loss_mask_mode='precomputed' needs"
                )
            ref_masks.validate(s.loss_mask, n, sample_id=s.sample_id)
            mask = torch.as_tensor(s.loss_mask) == 1
        else:
            for field in ("message_lengths", "message_roles"):
                if getattr(s, field) is None:
                    raise MissingFieldError(
                        f"sample {_name(s.sample_id)} has no {field}, which "
                        "loss_mask_mode=None needs"
                    )
            mask = ref_masks.from_roles(
                s.message_lengths,
                s.message_roles,
                train_roles,
                num_tokens=n,
                sample_id=s.sample_id,
            )
        padded = -(-n // multiple) * multiple
        pad = padded - n
        ids.append(F.pad(tokens, (0, pad), value=pad_token_id))
        target = torch.where(mask[1:], tokens[1:], torch.full_like(tokens[1:], ignore_index))
        labels.append(F.pad(target, (0, pad + 1), value=ignore_index))
        masks.append(F.pad(mask, (0, pad), value=False))
        positions.append(torch.arange(padded, dtype=torch.long))
        lens.append(n)
        padded_lens.append(padded)

    cu = F.pad(torch.cumsum(torch.tensor(lens), 0), (1, 0)).to(torch.int32)
    cu_padded = F.pad(torch.cumsum(torch.tensor(padded_lens), 0), (1, 0)).to(torch.int32)
    return PackedBatch(
        input_ids=torch.cat(ids),
        labels=torch.cat(labels),
        loss_mask=torch.cat(masks),
        position_ids=torch.cat(positions),
        cu_seqlens=cu,
        cu_seqlens_padded=cu_padded,
        max_seqlen=max(padded_lens),
        sample_ids=[s.sample_id for s in samples],
        media=merge_media(samples),
    )
