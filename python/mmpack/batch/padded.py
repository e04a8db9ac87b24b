"""Padded batches: one row per sample, ``[B, L]``, for trainers without packing.

``pad_samples`` takes the same samples and options as ``mmpack.batch.pack_samples`` and builds
the same fields in the same native core (the table in the ``mmpack.batch`` docstring), row by
row instead of end to end: ``labels`` shifted within the row, ``loss_mask`` aligned with
``labels``, ``token_mask`` aligned with ``input_ids``, ``position_ids`` restarting at 0 in
every row, and ``attention_mask`` from the sample lengths (``p < lengths[r]``), never from token
values, so a padding token that is also a real token (pad = eos) keeps its real occurrences
attended. ``L`` is the longest sample rounded up to ``pad_to_multiple_of`` (and, when
``cp_size > 1``, to a multiple of ``2 * cp_size``), or ``pad_to_length``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from typing import Any

import torch

from mmpack import _native
from mmpack._coerce import sample_name
from mmpack.batch.fields import (
    check_scalars,
    check_tensor_fields,
    host_array,
    merge_keyed_media,
    move_fields,
)
from mmpack.batch.samples import EncodedSample
from mmpack.batch.thd import build_native
from mmpack.errors import BatchLayoutError

__all__ = ["PaddedBatch", "pad_samples"]

_ROW_DTYPES = {
    "input_ids": torch.int64,
    "labels": torch.int64,
    "loss_mask": torch.bool,
    "token_mask": torch.bool,
    "position_ids": torch.int64,
    "attention_mask": torch.bool,
}


@dataclasses.dataclass(frozen=True, eq=False)
class PaddedBatch:
    """Padded rows ``[B, L]``, one per sample; every field is described in the table of the
    ``mmpack.batch`` docstring.

    ``input_ids``, ``labels``, ``loss_mask`` (aligned with ``labels``), ``token_mask`` (aligned
    with ``input_ids``), ``position_ids``, ``attention_mask``: ``[B, L]``. ``lengths``: int64
    ``[B]``, the tokens of each row. ``sample_ids``: the samples in row order. ``media``: per
    key, the samples' values joined with ``PackedTensor.concat`` (one row per sample that has
    the key). ``pad_token_id`` / ``ignore_index``: what the padding and the untrained labels
    hold.

    Constructing one checks every field against the others (``BatchLayoutError``; ``TypeError``
    for a wrong dtype or shape), on a host copy for tensors off the host. Frozen: fields are
    not reassigned, ``to`` moves them all at once.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    token_mask: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor
    lengths: torch.Tensor
    sample_ids: list[Hashable]
    media: dict[str, Any] = dataclasses.field(default_factory=dict)
    pad_token_id: int = 0
    ignore_index: int = -100

    _TENSOR_FIELDS = (*_ROW_DTYPES, "lengths")

    def __post_init__(self) -> None:
        check_tensor_fields(self, _ROW_DTYPES, ndim=2)
        check_tensor_fields(self, {"lengths": torch.int64}, ndim=1)
        check_scalars(self)
        shape = tuple(self.input_ids.shape)
        for name in _ROW_DTYPES:
            if tuple(getattr(self, name).shape) != shape:
                raise BatchLayoutError(
                    f"inconsistent batch: {name} has shape {tuple(getattr(self, name).shape)}, "
                    f"input_ids {shape}"
                )
        rows, width = shape
        if len(self.lengths) != rows or len(self.sample_ids) != rows:
            raise BatchLayoutError(
                f"inconsistent batch: {rows} rows but {len(self.lengths)} lengths and "
                f"{len(self.sample_ids)} sample_ids"
            )
        if self.input_ids.device.type == "meta":
            return
        flat = {n: host_array(getattr(self, n).reshape(-1), n) for n in _ROW_DTYPES}
        _native.check_padded(
            rows,
            width,
            flat["input_ids"],
            flat["labels"],
            flat["loss_mask"],
            flat["token_mask"],
            flat["position_ids"],
            flat["attention_mask"],
            host_array(self.lengths, "lengths"),
            pad_token_id=self.pad_token_id,
            ignore_index=self.ignore_index,
        )

    def __len__(self) -> int:
        """The number of rows (samples)."""
        return len(self.sample_ids)

    def to(self, device: torch.device | str, non_blocking: bool = True) -> PaddedBatch:
        """Move every tensor (media included) to ``device``, in place; returns ``self`` (as
        ``PackedBatch.to``)."""
        move_fields(self, self._TENSOR_FIELDS, device, non_blocking)
        return self


def pad_samples(
    samples: Sequence[EncodedSample],
    *,
    loss_mask_mode: str | None = None,
    train_roles: Sequence[str] = ("assistant",),
    pad_token_id: int = 0,
    pad_to_multiple_of: int = 1,
    ignore_index: int = -100,
    cp_size: int = 1,
    pad_to_length: int | None = None,
) -> PaddedBatch:
    """Rows ``[B, L]`` of ``samples`` (in order), one per sample; see the module docstring.

    Samples, ``loss_mask_mode``, ``train_roles``, ``pad_token_id``, ``ignore_index`` and the
    errors are those of ``mmpack.batch.pack_samples``. ``L`` is the longest sample rounded up
    to the padding multiple (``pad_to_multiple_of``, and ``2 * cp_size`` when ``cp_size > 1``),
    or ``pad_to_length`` (a multiple of it; ``BatchOptionError`` when the longest sample does
    not fit). Media values are joined per key with ``PackedTensor.concat``.
    """
    out, samples = build_native(
        _native.build_padded,
        samples,
        loss_mask_mode=loss_mask_mode,
        train_roles=train_roles,
        pad_token_id=pad_token_id,
        pad_to_multiple_of=pad_to_multiple_of,
        ignore_index=ignore_index,
        cp_size=cp_size,
        pad_to_length=pad_to_length,
    )
    batch = object.__new__(PaddedBatch)  # built by the core: the fields agree already
    fields = {
        "input_ids": torch.from_numpy(out.input_ids),
        "labels": torch.from_numpy(out.labels),
        "loss_mask": torch.from_numpy(out.loss_mask),
        "token_mask": torch.from_numpy(out.token_mask),
        "position_ids": torch.from_numpy(out.position_ids),
        "attention_mask": torch.from_numpy(out.attention_mask),
        "lengths": torch.from_numpy(out.lengths),
        "sample_ids": [s.sample_id for s in samples],
        "media": merge_keyed_media(
            [s.sample_id for s in samples],
            [s.media for s in samples],
            "concat",
            name=sample_name,
        ),
        "pad_token_id": int(pad_token_id),
        "ignore_index": int(ignore_index),
    }
    batch.__dict__.update(fields)  # frozen: no setattr
    return batch
