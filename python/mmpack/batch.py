"""Packed SFT batches: many encoded samples into one flat THD sequence for Megatron / NeMo-RL.

``pack_samples`` builds one pack in a single native call (layout, offsets, gathers, role-derived
masks and validation run in Rust with the GIL released); this module only converts inputs and
wraps the outputs as torch tensors (zero-copy from numpy).

Layout (Megatron's THD format). Sample ``i`` occupies
``[cu_seqlens_padded[i], cu_seqlens_padded[i] + len_i)`` of every token tensor, followed by
``padded_len_i - len_i`` padding positions, where ``padded_len_i`` is ``len_i`` rounded up to
``pad_to_multiple_of`` and, when ``cp_size > 1``, to the least common multiple of that and
``2 * cp_size`` (each sequence must split into ``2 * cp_size`` equal chunks for Megatron's
load-balanced context parallelism). The tensors hold the whole pack; sharding by CP rank is the
trainer's job.

Labels (next-token targets), stated exactly: for a position ``p`` of sample ``i``,
``labels[p] = input_ids[p + 1]`` when ``p + 1`` is still inside sample ``i`` (not padding, not
the next sample) **and** ``loss_mask[p + 1] == 1``; otherwise ``labels[p] = ignore_index``.
The mask at a token gates the label that *predicts* that token, so the worked example (7 tokens,
mask ``[0,0,0,0,1,1,1]``) trains the predictions of tokens 4, 5 and 6, made at positions 3, 4
and 5; the last token of every sample and every padding position get ``ignore_index``. Both
``loss_mask_mode`` values give the same labels for the same mask.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from mmpack import _native
from mmpack._coerce import (
    bools_as_bytes,
    int64_array,
    mask_array,
    option_int,
    role_list,
    sample_name,
    tensor_numpy,
)
from mmpack.errors import BatchMediaError, BatchOptionError

if TYPE_CHECKING:
    from mmpack.packed import PackedTensor

__all__ = ["EncodedSample", "PackedBatch", "merge_media", "pack_samples"]

_MEGATRON_EXTRA = "pip install 'mmpack[megatron]'"


@dataclasses.dataclass
class EncodedSample:
    """One tokenized sample, ready to pack.

    ``token_ids``: 1-D integer ids (numpy array, torch tensor or sequence). ``loss_mask``: one
    0/1 value per token, used when ``loss_mask_mode="precomputed"``. ``message_lengths`` and
    ``message_roles``: per-message token counts (summing to the token count) and role names,
    used when the mask is derived from roles (``loss_mask_mode=None``). ``media``: per key, a
    ``PackedTensor`` of this sample's media (for example ``pixel_values``).
    """

    sample_id: Hashable
    token_ids: Any
    loss_mask: Any = None
    message_lengths: Any = None
    message_roles: Sequence[str] | None = None
    media: dict[str, PackedTensor] | None = None


@dataclasses.dataclass
class PackedBatch:
    """One pack in Megatron's THD layout (see the module docstring for layout and labels).

    Token tensors are flat ``[T]`` (``T = cu_seqlens_padded[-1]``; add the batch dim with
    ``unsqueeze(0)`` where a ``[1, T]`` row is expected): ``input_ids`` (int64, padding is
    ``pad_token_id``), ``labels`` (int64), ``loss_mask`` (bool, aligned with ``input_ids``: the
    sample's mask, 0 on padding), ``position_ids`` (int64, restart at 0 per sample and count on
    through its padding). ``cu_seqlens`` / ``cu_seqlens_padded``: int32 ``[n + 1]`` offsets
    without / with the per-sample padding. ``max_seqlen``: the longest padded sample.
    ``sample_ids``: the samples in pack order. ``media``: per key, the samples' values merged
    with ``PackedTensor.merge_segments`` in sample order (one logical row per pack when
    deduplication is on; equal provenance shares one physical segment).
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_seqlens_padded: torch.Tensor
    max_seqlen: int
    sample_ids: list[Hashable]
    media: dict[str, Any] = dataclasses.field(default_factory=dict)

    _TENSOR_FIELDS = (
        "input_ids",
        "labels",
        "loss_mask",
        "position_ids",
        "cu_seqlens",
        "cu_seqlens_padded",
    )

    def __len__(self) -> int:
        """The number of samples in the pack."""
        return len(self.sample_ids)

    def to(self, device: torch.device | str, non_blocking: bool = True) -> PackedBatch:
        """Move every tensor (media included) to ``device``, in place; returns ``self``.

        In place like ``PackedTensor.to`` and NeMo-RL's ``BatchedDataDict.to``. Everything
        crosses through ``mmpack._transfer.move_segments``: towards CUDA the token tensors
        are staged in one pinned buffer per dtype and copied with ``non_blocking``; towards
        any other device the copy is blocking, since a non-blocking copy to the host can be
        read before it has completed.
        """
        from mmpack import _transfer
        from mmpack.packed import PackedTensor as Packed

        fields = self._TENSOR_FIELDS
        moved = _transfer.move_segments(
            [getattr(self, name) for name in fields], device, non_blocking=non_blocking
        )
        for name, tensor in zip(fields, moved, strict=True):
            setattr(self, name, tensor)
        for value in self.media.values():
            if isinstance(value, Packed):  # unique segments cross once (mmpack._transfer)
                value.to(device, non_blocking=non_blocking)
            else:
                value.to(device)
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


def merge_media(samples: Sequence[EncodedSample]) -> dict[str, Any]:
    """Per key, the samples' media merged with ``merge_segments`` of their ``PackedTensor``
    class, in sample order; samples without the key contribute nothing.

    Raises ``TypeError`` when a value is not a ``PackedTensor`` (or values of one key mix
    classes), and ``BatchMediaError`` naming the key and samples when the merge fails (for
    example different ``dim_to_pack``).
    """
    per_key: dict[str, list[Any]] = {}
    owners: dict[str, list[Hashable]] = {}
    for s in samples:
        if not s.media:
            continue
        for key, value in s.media.items():
            per_key.setdefault(key, []).append(value)
            owners.setdefault(key, []).append(s.sample_id)
    merged: dict[str, Any] = {}
    for key, values in per_key.items():
        cls = type(values[0])
        for value, owner in zip(values, owners[key], strict=True):
            if type(value) is not cls or not hasattr(cls, "merge_segments"):
                raise TypeError(
                    f"media key {key!r} of sample {sample_name(owner)} is a "
                    f"{type(value).__name__}; every media value of a key must be a PackedTensor "
                    f"of one class ({cls.__name__} first)"
                )
        try:
            merged[key] = cls.merge_segments(values)
        except Exception as exc:
            names = ", ".join(sample_name(o) for o in owners[key])
            raise BatchMediaError(
                f"cannot merge media key {key!r} across samples [{names}]: {exc}"
            ) from exc
    return merged


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
    """Pack ``samples`` (in order) into one THD sequence; see the module docstring.

    ``loss_mask_mode=None``: each sample's mask is derived from ``message_lengths`` and
    ``message_roles`` (roles in ``train_roles`` are trained on; ``loss_mask`` is ignored).
    ``loss_mask_mode="precomputed"``: each sample's own ``loss_mask`` is validated (length equal
    to its token count, values only 0/1) and used (message fields are ignored).

    Errors (typed, naming the sample): ``EmptySampleError`` for an empty list or a sample
    without tokens; ``MissingFieldError`` when a sample lacks what its mode needs;
    ``LossMaskError`` / ``MessageSpanError`` for a bad mask or inconsistent message spans;
    ``InvalidTokenError`` for a negative token id; ``IndexOverflowError`` for a token id or
    message length beyond int64; ``BatchOptionError`` for options out of range (int64
    included); ``BatchMediaError`` / ``TypeError`` for media that cannot be merged.
    ``TypeError`` too for an item that is not an ``EncodedSample``, a field of the wrong type
    or a ``meta`` tensor (it has no values).
    """
    if loss_mask_mode not in (None, "precomputed"):
        raise BatchOptionError(
            f"invalid loss_mask_mode: {loss_mask_mode!r} (expected None or 'precomputed')"
        )
    precomputed = loss_mask_mode == "precomputed"
    roles_train = role_list(train_roles, "train_roles")
    pad_token_id = option_int(pad_token_id, "pad_token_id", error=BatchOptionError)
    ignore_index = option_int(ignore_index, "ignore_index", error=BatchOptionError)
    pad_to_multiple_of = option_int(
        pad_to_multiple_of, "pad_to_multiple_of", error=BatchOptionError, minimum=1
    )
    cp_size = option_int(cp_size, "cp_size", error=BatchOptionError, minimum=1)

    samples = list(samples)
    for i, s in enumerate(samples):
        if not isinstance(s, EncodedSample):
            raise TypeError(f"samples[{i}] is a {type(s).__name__}, not an EncodedSample")
    names = [sample_name(s.sample_id) for s in samples]
    tokens = [_tokens(s) for s in samples]
    n = len(samples)
    masks: list[np.ndarray | None] = [None] * n
    lengths: list[Any] = [None] * n
    roles: list[Any] = [None] * n
    if precomputed:
        masks = [_mask(s) for s in samples]
    else:
        # Short per-message lists go to Rust as they are (extracted there); a wrong type is
        # diagnosed per sample below, only when the native call rejects it.
        lengths = [_lengths(s) for s in samples]
        roles = [s.message_roles for s in samples]
    try:
        out = _native.build_pack(
            names,
            tokens,
            masks,
            lengths,
            roles,
            precomputed=precomputed,
            train_roles=roles_train,
            pad_token_id=pad_token_id,
            pad_to_multiple_of=pad_to_multiple_of,
            ignore_index=ignore_index,
            cp_size=cp_size,
        )
    except (TypeError, OverflowError):
        # a wrong type or an int beyond int64 in a message field: name the sample
        if not precomputed:
            for s in samples:
                _check_messages(s)
        raise
    return PackedBatch(
        input_ids=torch.from_numpy(out.input_ids),
        labels=torch.from_numpy(out.labels),
        loss_mask=torch.from_numpy(out.loss_mask),
        position_ids=torch.from_numpy(out.position_ids),
        cu_seqlens=torch.from_numpy(out.cu_seqlens),
        cu_seqlens_padded=torch.from_numpy(out.cu_seqlens_padded),
        max_seqlen=int(out.max_seqlen),
        sample_ids=[s.sample_id for s in samples],
        media=merge_media(samples),
    )


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
