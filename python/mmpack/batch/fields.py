"""The batch fields, declared once (``FIELDS``), and the plumbing shared by the batch classes
(``mmpack.batch.PackedBatch``, ``mmpack.batch.padded.PaddedBatch``) and their builders: field
type checks, host views for the native checks, in-place device moves of frozen batches, and
joining media per key."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np
import torch

from mmpack._coerce import I64_MIN, option_int, tensor_numpy
from mmpack.errors import BatchLayoutError, BatchMediaError

__all__ = [
    "FIELDS",
    "PADDED_FIELDS",
    "THD_FIELDS",
    "THD_MAX_LENGTH",
    "Field",
    "check_scalars",
    "check_tensor_fields",
    "host_array",
    "layout_of",
    "merge_keyed_media",
    "move_fields",
    "tensor_fields",
    "tensors_from_layout",
]

#: How a field is shaped: ``tokens`` one value per position (``[T]`` in a pack, ``[B, L]`` in
#: padded rows), ``offsets`` one per sample boundary (``[n + 1]``), ``rows`` one per padded row
#: (``[B]``), ``scalar`` one ``int`` for the batch.
ShapeKind = Literal["tokens", "offsets", "rows", "scalar"]


@dataclasses.dataclass(frozen=True)
class Field:
    """One batch field: its name, dtype (``None`` for a Python ``int``), shape kind, what its
    positions are aligned with, and the layouts that hold it (``thd``, ``padded``)."""

    name: str
    dtype: torch.dtype | None
    shape: ShapeKind
    alignment: str
    layouts: frozenset[str]

    def ndim(self, layout: str) -> int:
        """The rank of the field's tensor in ``layout``."""
        return 2 if self.shape == "tokens" and layout == "padded" else 1


_BOTH = frozenset({"thd", "padded"})
_THD = frozenset({"thd"})
_PADDED = frozenset({"padded"})

#: Every batch field, in the order of the table in the ``mmpack.batch`` docstring and of the
#: batch classes' dataclass fields.
FIELDS: tuple[Field, ...] = (
    Field("input_ids", torch.int64, "tokens", "input_ids", _BOTH),
    Field("labels", torch.int64, "tokens", "labels", _BOTH),
    Field("loss_mask", torch.bool, "tokens", "labels", _BOTH),
    Field("token_mask", torch.bool, "tokens", "input_ids", _BOTH),
    Field("position_ids", torch.int64, "tokens", "input_ids", _BOTH),
    Field("cu_seqlens", torch.int32, "offsets", "samples", _THD),
    Field("cu_seqlens_padded", torch.int32, "offsets", "samples", _THD),
    Field("max_seqlen", None, "scalar", "batch", _THD),
    Field("attention_mask", torch.bool, "tokens", "input_ids", _PADDED),
    Field("lengths", torch.int64, "rows", "rows", _PADDED),
)

#: The longest THD pack or micro-batch: ``cu_seqlens`` / ``cu_seqlens_padded`` are int32.
THD_MAX_LENGTH = 2**31 - 1

#: The fields of a THD pack, and of padded rows, in declaration order.
THD_FIELDS = tuple(f for f in FIELDS if "thd" in f.layouts)
PADDED_FIELDS = tuple(f for f in FIELDS if "padded" in f.layouts)


def tensor_fields(fields: Sequence[Field]) -> tuple[Field, ...]:
    """The fields that are tensors (every one but ``max_seqlen``)."""
    return tuple(f for f in fields if f.dtype is not None)


def check_tensor_fields(batch: Any, fields: Sequence[Field], *, layout: str) -> None:
    """Every tensor field of ``batch`` is a torch tensor of its dtype and rank, all on one
    device; else ``TypeError`` naming the field (shared by ``PackedBatch`` and
    ``PaddedBatch``)."""
    cls = type(batch).__name__
    device = None
    for field in tensor_fields(fields):
        name, dtype, ndim = field.name, field.dtype, field.ndim(layout)
        t = getattr(batch, name)
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{cls}.{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != dtype or t.ndim != ndim:
            raise TypeError(
                f"{cls}.{name} must be a {ndim}-D {dtype} tensor, got a {t.ndim}-D {t.dtype} one"
            )
        if device is None:
            device = t.device
        elif t.device != device:
            raise TypeError(f"{cls}.{name} is on {t.device}, the other fields on {device}")


def check_scalars(batch: Any) -> None:
    """``pad_token_id`` and ``ignore_index`` are int64 ints, ``max_seqlen`` (where there is
    one) a non-negative one, ``sample_ids`` a list; the ints are stored as plain ``int``."""
    cls = type(batch).__name__
    minimums = {"pad_token_id": I64_MIN, "ignore_index": I64_MIN}
    if hasattr(batch, "max_seqlen"):
        minimums["max_seqlen"] = 0
    for name, minimum in minimums.items():
        value = option_int(
            getattr(batch, name), f"{cls}.{name}", error=BatchLayoutError, minimum=minimum
        )
        object.__setattr__(batch, name, value)
    if not isinstance(batch.sample_ids, list):
        raise TypeError(f"{cls}.sample_ids must be a list, got {type(batch.sample_ids).__name__}")


def host_array(t: torch.Tensor, name: str) -> np.ndarray:
    """A tensor field as a contiguous host numpy array for the native checks (which read bool
    arrays as bytes)."""
    return np.ascontiguousarray(tensor_numpy(t, name))


def tensors_from_layout(out: Any, fields: Sequence[Field]) -> dict[str, Any]:
    """The fields of a native layout (``ThdLayout``, ``PaddedLayout``) as batch fields:
    tensors sharing the arrays' memory, scalars as ``int``."""
    return {
        f.name: int(getattr(out, f.name))
        if f.dtype is None
        else torch.from_numpy(getattr(out, f.name))
        for f in fields
    }


def layout_of(batch: Any, fields: Sequence[Field]) -> dict[str, Any]:
    """A batch's fields as the native layout constructors take them (host arrays, ints)."""
    return {
        f.name: int(getattr(batch, f.name))
        if f.dtype is None
        else host_array(getattr(batch, f.name), f.name)
        for f in fields
    }


def move_fields(
    batch: Any, names: Sequence[str], device: torch.device | str, non_blocking: bool
) -> None:
    """``batch.to(device)`` of a frozen batch: its tensor fields and media, in place."""
    from mmpack.packed import transfer as _transfer
    from mmpack.packed.value import PackedTensor as Packed

    moved = _transfer.move_segments(
        [getattr(batch, name) for name in names], device, non_blocking=non_blocking
    )
    for name, tensor in zip(names, moved, strict=True):
        object.__setattr__(batch, name, tensor)
    for value in batch.media.values():
        if isinstance(value, Packed):  # unique segments cross once (mmpack.packed.transfer)
            value.to(device, non_blocking=non_blocking)
        else:
            value.to(device)


def merge_keyed_media(
    owners: Sequence[Any],
    media: Sequence[dict[str, Any] | None],
    how: str,
    *,
    what: tuple[str, str] = ("sample", "samples"),
    name: Callable[[Any], str] = str,
) -> dict[str, Any]:
    """Per key, the values of ``media`` (one mapping per owner, ``None`` for none) joined with
    the ``how`` class method (``merge_segments`` or ``concat``) of their ``PackedTensor``
    class, in order. ``TypeError`` when a value is not a ``PackedTensor`` (or values of one
    key mix classes); ``BatchMediaError`` naming the key and owners when the join fails.
    Messages call one owner ``what[0]``, several ``what[1]``, each by ``name(owner)`` (only
    formatted for an error)."""
    per_key: dict[str, list[Any]] = {}
    holders: dict[str, list[Any]] = {}
    for owner, mapping in zip(owners, media, strict=True):
        if not mapping:
            continue
        for key, value in mapping.items():
            per_key.setdefault(key, []).append(value)
            holders.setdefault(key, []).append(owner)
    merged: dict[str, Any] = {}
    for key, values in per_key.items():
        cls = type(values[0])
        for value, owner in zip(values, holders[key], strict=True):
            if type(value) is not cls or not hasattr(cls, how):
                raise TypeError(
                    f"media key {key!r} of {what[0]} {name(owner)} is a "
                    f"{type(value).__name__}; every media value of a key must be a "
                    f"PackedTensor of one class ({cls.__name__} first)"
                )
        try:
            merged[key] = getattr(cls, how)(values)
        except Exception as exc:
            names = ", ".join(name(o) for o in holders[key])
            raise BatchMediaError(
                f"cannot merge media key {key!r} across {what[1]} [{names}]: {exc}"
            ) from exc
    return merged
