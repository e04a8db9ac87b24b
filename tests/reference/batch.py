"""Plain-Python/torch batch builders, the way SFT pipelines build batches today: a Python loop
over samples with per-sample torch calls (mask, pad, shift, arange, cat).

The oracle for ``mmpack.batch.pack_samples`` / ``micro_batch`` and
``mmpack.batch.padded.pad_samples``, and their benchmark baseline: the same fields (plain
dataclasses `PackedBatch` / `PaddedBatch` of torch tensors), errors of the same kinds
(`reference.errors`, compared by class name) and media joins, done with NeMo-RL's
``PackedTensor`` (`reference.packed_tensor`): a pack's media is each key's values merged with
``merge_segments`` in sample order. Samples are read by attribute (``sample_id``,
``token_ids``, ``loss_mask``, ``message_lengths``, ``message_roles``, ``media``), so any object
with those attributes is one; `EncodedSample` is the plain one. ``consistent`` states the rules
every batch's fields obey, the plain way, for the property tests of the native checks.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Hashable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from reference import masks as ref_masks
from reference.errors import (
    BatchLayoutError,
    BatchOptionError,
    EmptySampleError,
    InvalidTokenError,
    MissingFieldError,
)
from reference.packed_tensor import PackedTensor

__all__ = [
    "PACKED_FIELDS",
    "PADDED_FIELDS",
    "EncodedSample",
    "PackedBatch",
    "PaddedBatch",
    "consistent",
    "merge_media",
    "micro_batch",
    "pack_samples",
    "pad_samples",
]

#: The tensor fields of a pack, and of padded rows.
PACKED_FIELDS = (
    "input_ids",
    "labels",
    "loss_mask",
    "token_mask",
    "position_ids",
    "cu_seqlens",
    "cu_seqlens_padded",
)
PADDED_FIELDS = (
    "input_ids",
    "labels",
    "loss_mask",
    "token_mask",
    "position_ids",
    "attention_mask",
    "lengths",
)


@dataclasses.dataclass
class EncodedSample:
    """One tokenized sample: ``token_ids``; ``loss_mask`` (one 0/1 per token) for
    ``loss_mask_mode="precomputed"``; ``message_lengths`` / ``message_roles`` for masks from
    roles; ``media``: per key, a `reference.packed_tensor.PackedTensor` of this sample's media."""

    sample_id: Hashable
    token_ids: Any
    loss_mask: Any = None
    message_lengths: Any = None
    message_roles: Sequence[str] | None = None
    media: dict[str, PackedTensor] | None = None


@dataclasses.dataclass
class PackedBatch:
    """A THD pack (or micro-batch): one row of ``T`` positions holding the samples in order."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    token_mask: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_seqlens_padded: torch.Tensor
    max_seqlen: int
    sample_ids: list[Any]
    media: dict[str, PackedTensor]
    pad_token_id: int
    ignore_index: int


@dataclasses.dataclass
class PaddedBatch:
    """Padded rows ``[B, L]``, one sample per row."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    token_mask: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor
    lengths: torch.Tensor
    sample_ids: list[Any]
    media: dict[str, PackedTensor]
    pad_token_id: int
    ignore_index: int


def _media_values(owners: Sequence[Any], media: Sequence[dict[str, Any] | None]) -> dict[str, list]:
    """Per key, the values of the owners (samples or packs) that have it, in order; each must
    be a reference ``PackedTensor``."""
    out: dict[str, list[PackedTensor]] = {}
    for owner, values in zip(owners, media, strict=True):
        for key, value in (values or {}).items():
            if not isinstance(value, PackedTensor):
                raise TypeError(
                    f"media key {key!r} of {owner!r} is a {type(value).__name__}; the reference "
                    "builders join reference PackedTensors (reference.packed_tensor)"
                )
            out.setdefault(key, []).append(value)
    return out


def merge_media(samples: Sequence[Any]) -> dict[str, PackedTensor]:
    """Per key, the samples' media merged with ``PackedTensor.merge_segments``, in sample order;
    samples without the key contribute nothing."""
    values = _media_values([s.sample_id for s in samples], [s.media for s in samples])
    return {key: PackedTensor.merge_segments(v) for key, v in values.items()}


def _name(sample_id) -> str:
    return repr(sample_id)


def _multiple(pad_to_multiple_of: int, cp_size: int) -> int:
    if pad_to_multiple_of < 1 or cp_size < 1:
        raise BatchOptionError("pad_to_multiple_of and cp_size must be >= 1")
    if cp_size > 1:
        return math.lcm(pad_to_multiple_of, 2 * cp_size)
    return pad_to_multiple_of


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _check_options(samples, loss_mask_mode, pad_token_id, multiple, pad_to_length) -> None:
    if loss_mask_mode not in (None, "precomputed"):
        raise BatchOptionError(f"invalid loss_mask_mode: {loss_mask_mode!r}")
    if pad_to_length is not None and pad_to_length < 1:
        raise BatchOptionError("pad_to_length must be >= 1")
    # every option is checked when the options are made, before any sample is seen
    if pad_token_id < 0:
        raise BatchOptionError("pad_token_id must be a token id (>= 0)")
    if pad_to_length is not None and pad_to_length % multiple:
        raise BatchOptionError("pad_to_length must be a multiple of the padding multiple")
    if not samples:
        raise EmptySampleError("a batch needs at least one sample, got none")


def _tokens_and_mask(s: Any, loss_mask_mode, train_roles) -> tuple[Any, Any]:
    """A sample's int64 tokens and bool trainable flags, checked as the builders check them."""
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
        return tokens, torch.as_tensor(s.loss_mask) == 1
    for field in ("message_lengths", "message_roles"):
        if getattr(s, field) is None:
            raise MissingFieldError(
                f"sample {_name(s.sample_id)} has no {field}, which loss_mask_mode=None needs"
            )
    mask = ref_masks.from_roles(
        s.message_lengths, s.message_roles, train_roles, num_tokens=n, sample_id=s.sample_id
    )
    return tokens, mask


def _fields(tokens, mask, width: int, pad_token_id: int, ignore_index: int) -> dict[str, Any]:
    """One sample over ``width`` positions: tokens then padding, labels shifted."""
    pad = width - tokens.numel()
    target = torch.where(mask[1:], tokens[1:], torch.full_like(tokens[1:], ignore_index))
    labels = F.pad(target, (0, pad + 1), value=ignore_index)
    return {
        "input_ids": F.pad(tokens, (0, pad), value=pad_token_id),
        "labels": labels,
        "loss_mask": labels != ignore_index,
        "token_mask": F.pad(mask, (0, pad), value=False),
        "position_ids": torch.arange(width, dtype=torch.long),
    }


def _check_ignore_index(ignore_index: int, token_lists) -> None:
    top = max(int(t.max()) for t in token_lists)
    if 0 <= ignore_index <= top:
        raise BatchOptionError(f"ignore_index {ignore_index} is a token id of the batch")


def pack_samples(
    samples: Sequence[Any],
    *,
    loss_mask_mode: str | None = None,
    train_roles: Sequence[str] = ("assistant",),
    pad_token_id: int = 0,
    pad_to_multiple_of: int = 1,
    ignore_index: int = -100,
    cp_size: int = 1,
    pad_to_length: int | None = None,
) -> PackedBatch:
    multiple = _multiple(pad_to_multiple_of, cp_size)
    _check_options(samples, loss_mask_mode, pad_token_id, multiple, pad_to_length)
    lens = [len(s.token_ids) for s in samples]
    padded_lens = [_round_up(n, multiple) for n in lens]
    if pad_to_length is not None:
        if sum(padded_lens) > pad_to_length:
            raise BatchOptionError("the pack is longer than pad_to_length")
        padded_lens[-1] += pad_to_length - sum(padded_lens)

    parts, tokens_seen = [], []
    for s, width in zip(samples, padded_lens, strict=True):
        tokens, mask = _tokens_and_mask(s, loss_mask_mode, train_roles)
        tokens_seen.append(tokens)
        parts.append(_fields(tokens, mask, width, pad_token_id, ignore_index))
    _check_ignore_index(ignore_index, tokens_seen)

    cu = F.pad(torch.cumsum(torch.tensor(lens), 0), (1, 0)).to(torch.int32)
    cu_padded = F.pad(torch.cumsum(torch.tensor(padded_lens), 0), (1, 0)).to(torch.int32)
    return PackedBatch(
        **{k: torch.cat([p[k] for p in parts]) for k in parts[0]},
        cu_seqlens=cu,
        cu_seqlens_padded=cu_padded,
        max_seqlen=max(padded_lens),
        sample_ids=[s.sample_id for s in samples],
        media=merge_media(samples),
        pad_token_id=pad_token_id,
        ignore_index=ignore_index,
    )


def pad_samples(
    samples: Sequence[Any],
    *,
    loss_mask_mode: str | None = None,
    train_roles: Sequence[str] = ("assistant",),
    pad_token_id: int = 0,
    pad_to_multiple_of: int = 1,
    ignore_index: int = -100,
    cp_size: int = 1,
    pad_to_length: int | None = None,
) -> PaddedBatch:
    multiple = _multiple(pad_to_multiple_of, cp_size)
    _check_options(samples, loss_mask_mode, pad_token_id, multiple, pad_to_length)
    width = _round_up(max(len(s.token_ids) for s in samples), multiple)
    if pad_to_length is not None:
        if width > pad_to_length:
            raise BatchOptionError("the longest sample is longer than pad_to_length")
        width = pad_to_length
    rows, tokens_seen = [], []
    for s in samples:
        tokens, mask = _tokens_and_mask(s, loss_mask_mode, train_roles)
        tokens_seen.append(tokens)
        rows.append(_fields(tokens, mask, width, pad_token_id, ignore_index))
    _check_ignore_index(ignore_index, tokens_seen)
    lengths = torch.tensor([len(s.token_ids) for s in samples], dtype=torch.int64)
    media = _media_values([s.sample_id for s in samples], [s.media for s in samples])
    return PaddedBatch(
        **{k: torch.stack([r[k] for r in rows]) for k in rows[0]},
        attention_mask=torch.arange(width)[None, :] < lengths[:, None],
        lengths=lengths,
        sample_ids=[s.sample_id for s in samples],
        media={k: PackedTensor.concat(v) for k, v in media.items()},
        pad_token_id=pad_token_id,
        ignore_index=ignore_index,
    )


def micro_batch(
    packs: Sequence[PackedBatch],
    *,
    pad_to_length: int | None = None,
    pad_to_multiple_of: int = 1,
    cp_size: int = 1,
) -> PackedBatch:
    if not packs:
        raise EmptySampleError("micro_batch needs at least one pack, got none")
    multiple = _multiple(pad_to_multiple_of, cp_size)
    pad, ignore = packs[0].pad_token_id, packs[0].ignore_index
    if any(p.pad_token_id != pad or p.ignore_index != ignore for p in packs):
        raise BatchOptionError("packs disagree on pad_token_id / ignore_index")
    for p in packs:
        if bool((torch.diff(p.cu_seqlens_padded) % multiple != 0).any()):
            raise BatchLayoutError("a pack is not padded to the micro-batch's multiple")
    lens = torch.cat([torch.diff(p.cu_seqlens) for p in packs])
    widths = torch.cat([torch.diff(p.cu_seqlens_padded) for p in packs])
    fields = {k: torch.cat([getattr(p, k) for p in packs]) for k in PACKED_FIELDS}
    if pad_to_length is not None:
        extra = pad_to_length - int(widths.sum())
        if pad_to_length % multiple or extra < 0:
            raise BatchOptionError("pad_to_length does not fit the packs")
        last = int(widths[-1])
        widths[-1] += extra
        fields["input_ids"] = F.pad(fields["input_ids"], (0, extra), value=pad)
        fields["labels"] = F.pad(fields["labels"], (0, extra), value=ignore)
        fields["loss_mask"] = F.pad(fields["loss_mask"], (0, extra), value=False)
        fields["token_mask"] = F.pad(fields["token_mask"], (0, extra), value=False)
        tail = torch.arange(last, last + extra, dtype=torch.long)
        fields["position_ids"] = torch.cat([fields["position_ids"], tail])
    media = _media_values([f"pack {i}" for i in range(len(packs))], [p.media for p in packs])
    return PackedBatch(
        **{k: v for k, v in fields.items() if not k.startswith("cu_")},
        cu_seqlens=F.pad(torch.cumsum(lens, 0), (1, 0)).to(torch.int32),
        cu_seqlens_padded=F.pad(torch.cumsum(widths, 0), (1, 0)).to(torch.int32),
        max_seqlen=int(widths.max()),
        sample_ids=[sid for p in packs for sid in p.sample_ids],
        media={k: PackedTensor.merge_segments(v) for k, v in media.items()},
        pad_token_id=pad,
        ignore_index=ignore,
    )


def consistent(
    rows: Sequence[dict[str, list[int]]], lengths: Sequence[int], pad_token_id: int, ignore: int
) -> bool:
    """Whether per-sample slots obey every batch rule. ``rows[i]`` holds sample ``i``'s padded
    slots (``input_ids``, ``labels``, ``loss_mask``, ``token_mask``, ``position_ids``, plain
    lists) and ``lengths[i]`` its token count."""
    if pad_token_id < 0:
        return False
    top = -1
    for row, n in zip(rows, lengths, strict=True):
        ids, labels = row["input_ids"], row["labels"]
        lm, tm, pos = row["loss_mask"], row["token_mask"], row["position_ids"]
        width = len(ids)
        if not 1 <= n <= width or pos != list(range(width)):
            return False
        if any(v not in (0, 1) for v in lm + tm):
            return False
        if any(t < 0 for t in ids[:n]) or any(t != pad_token_id for t in ids[n:]):
            return False
        if any(tm[n:]):
            return False
        want = [ids[p + 1] if p + 1 < n and tm[p + 1] else ignore for p in range(width)]
        if labels != want or lm != [int(v != ignore) for v in labels]:
            return False
        top = max(top, *ids[:n])
    return not 0 <= ignore <= top
