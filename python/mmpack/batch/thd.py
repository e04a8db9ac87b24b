"""Packed THD batches: encoded samples packed into Megatron's THD layout (``pack_samples``) and
several packs as one THD micro-batch (``micro_batch``). The fields and their rules are
``mmpack.batch``'s (see there)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from mmpack import _native
from mmpack._coerce import (
    bools_as_bytes,
    int64_array,
    mask_array,
    role_list,
    sample_name,
    tensor_numpy,
)
from mmpack.batch.fields import (
    THD_FIELDS,
    check_scalars,
    check_tensor_fields,
    layout_of,
    merge_keyed_media,
    move_fields,
    tensor_fields,
    tensors_from_layout,
)
from mmpack.batch.options import BatchOptions, resolve_options
from mmpack.batch.samples import EncodedSample
from mmpack.errors import BatchLayoutError, BatchOptionError, EmptySampleError

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from mmpack.batch.options import BatchOptionKeywords

__all__ = ["PackedBatch", "merge_media", "micro_batch", "pack_samples"]

_MEGATRON_EXTRA = "pip install 'mmpack[megatron]'"


@dataclasses.dataclass(frozen=True, eq=False)
class PackedBatch:
    """One pack (or micro-batch) in Megatron's THD layout; every field is described in the
    module docstring's table.

    Token tensors are flat ``[T]``: ``input_ids``, ``labels``, ``loss_mask`` (aligned with
    ``labels``), ``token_mask`` (aligned with ``input_ids``), ``position_ids``.
    ``cu_seqlens`` / ``cu_seqlens_padded``: int32 ``[n + 1]``. ``max_seqlen``: the longest
    padded sample. ``sample_ids``: the samples in pack order. ``media``: per key, the samples'
    values merged with ``PackedTensor.merge_segments`` in sample order (one logical row per
    pack when deduplication is on; equal provenance shares one physical segment).
    ``pad_token_id`` / ``ignore_index``: what the padding and the untrained labels hold.

    Constructing one checks every field against the others (``BatchLayoutError``; ``TypeError``
    for a wrong dtype or shape); tensors off the host are checked on a host copy, ``meta``
    tensors (no values) for dtype and shape only. Frozen: fields are not reassigned, ``to``
    moves them all at once. The fields are declared once, in ``mmpack.batch.fields.FIELDS``;
    ``layout()`` hands them to the native checks as one ``ThdLayout``.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    token_mask: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_seqlens_padded: torch.Tensor
    max_seqlen: int
    sample_ids: list[Hashable]
    media: dict[str, Any] = dataclasses.field(default_factory=dict)
    pad_token_id: int = 0
    ignore_index: int = -100

    _TENSOR_FIELDS = tuple(f.name for f in tensor_fields(THD_FIELDS))

    def __post_init__(self) -> None:
        check_tensor_fields(self, THD_FIELDS, layout="thd")
        check_scalars(self)
        if len(self.sample_ids) != len(self.cu_seqlens) - 1:
            raise BatchLayoutError(
                f"inconsistent batch: {len(self.sample_ids)} sample_ids for "
                f"{len(self.cu_seqlens) - 1} samples in cu_seqlens"
            )
        if self.input_ids.device.type != "meta":
            _native.check_pack(
                self.layout(),
                pad_token_id=self.pad_token_id,
                ignore_index=self.ignore_index,
            )

    @classmethod
    def _unchecked(cls, **fields: Any) -> PackedBatch:
        """A batch from fields the core built (and so already agree): skips the re-check."""
        batch = object.__new__(cls)
        batch.__dict__.update(fields)  # frozen: no setattr
        return batch

    @classmethod
    def _from_layout(cls, out: _native.ThdLayout, **rest: Any) -> PackedBatch:
        return cls._unchecked(**tensors_from_layout(out, THD_FIELDS), **rest)

    def layout(self) -> _native.ThdLayout:
        """The fields as one native ``ThdLayout`` (host arrays), as the native checks and
        ``micro_batch`` read them; a host batch's arrays share its tensors' memory."""
        return _native.ThdLayout(**layout_of(self, THD_FIELDS))

    def __len__(self) -> int:
        """The number of samples in the pack."""
        return len(self.sample_ids)

    def to(self, device: torch.device | str, non_blocking: bool = True) -> PackedBatch:
        """Move every tensor (media included) to ``device``, in place; returns ``self``.

        In place like ``PackedTensor.to`` and NeMo-RL's ``BatchedDataDict.to``. Everything
        crosses through ``mmpack.packed.transfer.move_segments``: towards CUDA the token tensors
        are staged in one pinned buffer per dtype and copied with ``non_blocking``; towards
        any other device the copy is blocking, since a non-blocking copy to the host can be
        read before it has completed.
        """
        move_fields(self, self._TENSOR_FIELDS, device, non_blocking)
        return self

    def packed_seq_params(self) -> Any:
        """Megatron-Core's ``PackedSeqParams`` for this pack (``qkv_format="thd"``).

        ``cu_seqlens_q/kv`` are the true (unpadded) offsets and ``cu_seqlens_q/kv_padded`` the
        padded ones (Transformer Engine skips the padding between sequences);
        ``max_seqlen_q/kv`` is ``max_seqlen``. Needs ``megatron-core``: without it this raises an
        ``ImportError`` naming the extra (``pip install 'mmpack[megatron]'``).
        """
        try:
            from megatron.core.packed_seq_params import PackedSeqParams
        except ImportError as exc:
            raise ImportError(
                f"PackedBatch.packed_seq_params() needs megatron-core: {_MEGATRON_EXTRA}"
            ) from exc
        return PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=self.cu_seqlens,
            cu_seqlens_kv=self.cu_seqlens,
            cu_seqlens_q_padded=self.cu_seqlens_padded,
            cu_seqlens_kv_padded=self.cu_seqlens_padded,
            max_seqlen_q=self.max_seqlen,
            max_seqlen_kv=self.max_seqlen,
        )


# ----------------------------------------------------------------------------- media


def merge_media(samples: Sequence[EncodedSample]) -> dict[str, Any]:
    """Per key, the samples' media merged with ``merge_segments`` of their ``PackedTensor``
    class, in sample order; samples without the key contribute nothing.

    Raises ``TypeError`` when a value is not a ``PackedTensor`` (or values of one key mix
    classes), and ``BatchMediaError`` naming the key and samples when the merge fails (for
    example different ``dim_to_pack``).
    """
    return merge_keyed_media(
        [s.sample_id for s in samples],
        [s.media for s in samples],
        "merge_segments",
        name=sample_name,
    )


# ----------------------------------------------------------------------------- builders


def build_native(
    build: Callable[[Any, _native.BatchOptions], Any],
    samples: Sequence[EncodedSample],
    options: BatchOptions,
) -> tuple[Any, list[EncodedSample]]:
    """Convert the samples and run the native builder ``build`` (``build_pack`` or
    ``build_padded``) with ``options``; returns its result and the samples as a list."""
    samples = list(samples)
    for i, s in enumerate(samples):
        if not isinstance(s, EncodedSample):
            raise TypeError(f"samples[{i}] is a {type(s).__name__}, not an EncodedSample")
    precomputed = options.precomputed
    n = len(samples)
    columns: dict[str, list[Any]] = {
        "names": [sample_name(s.sample_id) for s in samples],
        "tokens": [_tokens(s) for s in samples],
        "masks": [None] * n,
        "message_lengths": [None] * n,
        "message_roles": [None] * n,
    }
    if precomputed:
        columns["masks"] = [_mask(s) for s in samples]
    else:
        # Short per-message lists go to Rust as they are (extracted there); a wrong type is
        # diagnosed per sample below, only when the native call rejects it.
        columns["message_lengths"] = [_lengths(s) for s in samples]
        columns["message_roles"] = [s.message_roles for s in samples]
    try:
        out = build(columns, options.native)
    except (TypeError, OverflowError):
        # a wrong type or an int beyond int64 in a message field: name the sample
        if not precomputed:
            for s in samples:
                _check_messages(s)
        raise
    return out, samples


def pack_samples(
    samples: Sequence[EncodedSample],
    options: BatchOptions | None = None,
    **keywords: Unpack[BatchOptionKeywords],
) -> PackedBatch:
    """Pack ``samples`` (in order) into one THD sequence; see the module docstring.

    ``options``: a ``mmpack.batch.BatchOptions``; or the same options as keyword arguments
    (``loss_mask_mode``, ``train_roles``, ``pad_token_id``, ``pad_to_multiple_of``,
    ``ignore_index``, ``cp_size``, ``pad_to_length``), from which one is built. Both at once:
    ``BatchOptionTypeError`` unless the keywords repeat the options' values.

    ``loss_mask_mode=None``: each sample's mask is derived from ``message_lengths`` and
    ``message_roles`` (roles in ``train_roles`` are trained on; ``loss_mask`` is ignored).
    ``loss_mask_mode="precomputed"``: each sample's own ``loss_mask`` is validated (length equal
    to its token count, values only 0/1) and used (message fields are ignored).
    ``pad_to_length``: the total length of the pack (a multiple of the padding multiple); the
    last sample absorbs the padding.

    Errors (typed, naming the sample or argument): ``EmptySampleError`` for an empty list or a
    sample without tokens; ``MissingFieldError`` when a sample lacks what its mode needs;
    ``LossMaskError`` / ``MessageSpanError`` for a bad mask or inconsistent message spans;
    ``InvalidTokenError`` for a negative token id; ``IndexOverflowError`` for a token id or
    message length beyond int64; ``BatchOptionError`` for options out of range (int64
    included), a negative ``pad_token_id``, an ``ignore_index`` in ``[0, largest token id of
    the batch]`` (a label equal to it would silently leave the loss), a pack longer than
    ``pad_to_length``, or a size no pack can have (``pad_to_length``, ``pad_to_multiple_of`` or
    ``cp_size`` taking it past the 2**31 - 1 positions of its int32 offsets, or past memory:
    checked before anything is allocated); ``BatchMediaError`` / ``TypeError`` for media that
    cannot be merged.
    ``TypeError`` too for an item that is not an ``EncodedSample``, a field or option of the
    wrong type (bools as ``message_lengths`` included) or a ``meta`` tensor (it has no values).
    """
    opts = resolve_options(options, keywords, caller="pack_samples")
    out, samples = build_native(_native.build_pack, samples, opts)
    return PackedBatch._from_layout(
        out,
        sample_ids=[s.sample_id for s in samples],
        media=merge_media(samples),
        pad_token_id=opts.pad_token_id,
        ignore_index=opts.ignore_index,
    )


def micro_batch(
    packs: Sequence[PackedBatch],
    options: BatchOptions | None = None,
    **keywords: Unpack[BatchOptionKeywords],
) -> PackedBatch:
    """Several packs as one THD micro-batch (``batch_size > 1`` packs per step): their samples
    in order in one ``[T]`` sequence, offsets shifted, media merged per key.

    Of the options (``options``, or keyword arguments as in ``pack_samples``), the micro-batch
    reads ``pad_to_length``: its total length (one shape for every micro-batch, as pipeline
    parallelism needs), the last sample absorbing the padding; and ``pad_to_multiple_of`` /
    ``cp_size``: the padding the packs were built with. Every sample must be padded to that
    multiple (each sequence splits into ``2 * cp_size`` chunks for context parallelism), and
    ``pad_to_length`` must be one too. ``cu_seqlens`` / ``cu_seqlens_padded`` / ``max_seqlen``
    then fit ``packed_seq_params()`` for that choice. Given ``options``, the packs must also
    hold its ``pad_token_id`` and ``ignore_index`` (the options they were built with).

    Packs are joined on the host (join first, then ``.to(device)``). Errors:
    ``EmptySampleError`` for no packs; ``TypeError`` for an item that is not a
    ``PackedBatch`` or a pack off the host; ``BatchOptionError`` for options out of range, packs
    with different ``pad_token_id`` / ``ignore_index``, or packs longer than ``pad_to_length``;
    ``BatchLayoutError`` naming the pack whose fields disagree or whose samples are not padded
    to the multiple.
    """
    opts = resolve_options(options, keywords, caller="micro_batch")
    packs = list(packs)
    if not packs:
        raise EmptySampleError("micro_batch needs at least one pack, got none")
    for i, p in enumerate(packs):
        if not isinstance(p, PackedBatch):
            raise TypeError(f"packs[{i}] is a {type(p).__name__}, not a PackedBatch")
        if p.input_ids.device.type != "cpu":
            raise TypeError(
                f"packs[{i}] is on {p.input_ids.device}; join packs on the host, then move "
                "the micro-batch with .to(device)"
            )
    first = packs[0]
    # the values the caller gave (``options``, or these keywords) must be the packs' own
    pinned = {
        name: getattr(opts, name)
        for name in ("pad_token_id", "ignore_index")
        if options is not None or name in keywords
    }
    for i, p in enumerate(packs):
        for name in ("pad_token_id", "ignore_index"):
            if getattr(p, name) != getattr(first, name):
                raise BatchOptionError(
                    f"invalid packs: packs[{i}] has {name}={getattr(p, name)}, packs[0] "
                    f"{getattr(first, name)}; a micro-batch has one of each"
                )
            if name in pinned and getattr(p, name) != pinned[name]:
                raise BatchOptionError(
                    f"invalid packs: packs[{i}] has {name}={getattr(p, name)}, the options "
                    f"{pinned[name]}; build the packs with the micro-batch's options"
                )
    if (first.pad_token_id, first.ignore_index) != (opts.pad_token_id, opts.ignore_index):
        opts = opts.replace(pad_token_id=first.pad_token_id, ignore_index=first.ignore_index)
    out = _native.concat_packs([p.layout() for p in packs], opts.native)
    return PackedBatch._from_layout(
        out,
        sample_ids=[sid for p in packs for sid in p.sample_ids],
        media=merge_keyed_media(
            range(len(packs)),
            [p.media for p in packs],
            "merge_segments",
            what=("pack", "packs"),
        ),
        pad_token_id=first.pad_token_id,
        ignore_index=first.ignore_index,
    )


# ----------------------------------------------------------------------------- sample fields

_I64 = np.dtype(np.int64)


def _tokens(s: EncodedSample) -> np.ndarray:
    """``token_ids`` as a contiguous 1-D int64 array (zero-copy when it already is one)."""
    x = s.token_ids
    if type(x) is torch.Tensor:
        x = tensor_numpy(x, "token_ids", s.sample_id)
    if type(x) is np.ndarray and x.dtype is _I64 and x.ndim == 1 and x.flags.c_contiguous:
        return x
    return int64_array(x, "token_ids", s.sample_id)


def _mask(s: EncodedSample) -> np.ndarray | None:
    x = s.loss_mask
    if x is None:
        return None
    if type(x) is torch.Tensor and x.dtype in _TORCH_NATIVE_MASK:
        x = tensor_numpy(x, "loss mask", s.sample_id)
        if x.ndim == 1 and x.flags.c_contiguous:
            return bools_as_bytes(x)
    return mask_array(x, s.sample_id)


_TORCH_NATIVE_MASK = frozenset(
    (torch.bool, torch.uint8, torch.int8, torch.int32, torch.int64, torch.float32, torch.float64)
)


def _lengths(s: EncodedSample) -> Any:
    """``message_lengths`` as the native call reads it: a list or tuple as it is (bools are
    refused there, naming the sample), arrays and tensors as lists."""
    x = s.message_lengths
    if x is None or type(x) is list or type(x) is tuple:
        return x
    if type(x) is torch.Tensor:
        x = tensor_numpy(x, "message_lengths", s.sample_id)
    if hasattr(x, "tolist"):  # a numpy array
        return x.tolist()
    return list(x)


def _check_messages(s: EncodedSample) -> None:
    """Raise a ``TypeError`` (wrong types) or ``IndexOverflowError`` (a length beyond int64)
    naming the sample, for what the native call refused without naming it."""
    if s.message_lengths is not None:
        int64_array(s.message_lengths, "message_lengths", s.sample_id)
    if s.message_roles is not None:
        role_list(s.message_roles, "message_roles", s.sample_id)
