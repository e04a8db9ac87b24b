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
from typing import TYPE_CHECKING, Any

import torch

from mmpack import _native
from mmpack._coerce import sample_name
from mmpack.batch.fields import (
    PADDED_FIELDS,
    check_scalars,
    check_tensor_fields,
    layout_of,
    merge_keyed_media,
    move_fields,
    tensors_from_layout,
)
from mmpack.batch.options import BatchOptions, resolve_options
from mmpack.batch.samples import EncodedSample
from mmpack.batch.thd import build_native
from mmpack.errors import BatchLayoutError

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from mmpack.batch.options import BatchOptionKeywords

__all__ = ["PaddedBatch", "pad_samples"]

#: The ``[B, L]`` fields (every padded field but ``lengths``).
_ROW_FIELDS = tuple(f.name for f in PADDED_FIELDS if f.shape == "tokens")


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

    _TENSOR_FIELDS = tuple(f.name for f in PADDED_FIELDS)

    def __post_init__(self) -> None:
        check_tensor_fields(self, PADDED_FIELDS, layout="padded")
        check_scalars(self)
        shape = tuple(self.input_ids.shape)
        for name in _ROW_FIELDS:
            if tuple(getattr(self, name).shape) != shape:
                raise BatchLayoutError(
                    f"inconsistent batch: {name} has shape {tuple(getattr(self, name).shape)}, "
                    f"input_ids {shape}"
                )
        rows = shape[0]
        if len(self.lengths) != rows or len(self.sample_ids) != rows:
            raise BatchLayoutError(
                f"inconsistent batch: {rows} rows but {len(self.lengths)} lengths and "
                f"{len(self.sample_ids)} sample_ids"
            )
        if self.input_ids.device.type == "meta":
            return
        _native.check_padded(
            self.layout(), pad_token_id=self.pad_token_id, ignore_index=self.ignore_index
        )

    def layout(self) -> _native.PaddedLayout:
        """The fields as one native ``PaddedLayout`` (host arrays), as the native check reads
        them; a host batch's arrays share its tensors' memory."""
        return _native.PaddedLayout(**layout_of(self, PADDED_FIELDS))

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
    options: BatchOptions | None = None,
    **keywords: Unpack[BatchOptionKeywords],
) -> PaddedBatch:
    """Rows ``[B, L]`` of ``samples`` (in order), one per sample; see the module docstring.

    Samples, options (``options`` or keyword arguments) and errors are those of
    ``mmpack.batch.pack_samples``. ``L`` is the longest sample rounded up to the padding
    multiple (``pad_to_multiple_of``, and ``2 * cp_size`` when ``cp_size > 1``), or
    ``pad_to_length`` (a multiple of it; ``BatchOptionError`` when the longest sample does
    not fit, or naming the option when the rows it implies cannot be allocated). Media values
    are joined per key with ``PackedTensor.concat``.
    """
    opts = resolve_options(options, keywords, caller="pad_samples")
    out, samples = build_native(_native.build_padded, samples, opts)
    batch = object.__new__(PaddedBatch)  # built by the core: the fields agree already
    batch.__dict__.update(  # frozen: no setattr
        tensors_from_layout(out, PADDED_FIELDS),
        sample_ids=[s.sample_id for s in samples],
        media=merge_keyed_media(
            [s.sample_id for s in samples],
            [s.media for s in samples],
            "concat",
            name=sample_name,
        ),
        pad_token_id=opts.pad_token_id,
        ignore_index=opts.ignore_index,
    )
    return batch
