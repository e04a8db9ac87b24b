"""What a payload costs to move: physical vs logical media bytes, and the policy-bound cast.

``measure(obj)`` walks any nested structure of dicts (any ``Mapping``), lists, tuples,
dataclasses (``PackedBatch``), ``PackedTensor`` s, torch tensors and numpy arrays, and reports
from shapes alone, in O(segments):

* **physical**: what a serializer has to move. Every distinct tensor object counts once, however
  many rows, keys or ``PackedTensor`` s reference it (pickle's memo moves it once too). A
  ``PackedTensor`` contributes its physical ``tensors`` (unreferenced ones included, ``None``
  excluded), as NeMo-RL's payload metrics do.
* **logical**: what the receiver materializes. A ``PackedTensor`` contributes each logical
  segment, repeats included (unpadded). A plain tensor or array is one physical and one logical
  segment; the same plain tensor reached twice is one physical segment and two logical ones.
  A container or ``PackedTensor`` object reached twice is walked once (pickle sends it once
  too), which also makes cycles harmless.

``measure(obj, serialized=True)`` also pickles ``obj`` (protocol 5, out-of-band buffers
collected) and reports the exact size: the pickle stream plus every out-of-band buffer.

``prepare_for_transfer(obj)`` casts policy-bound floating media (``pixel_values``,
``pixel_values_videos``) to bfloat16 once per physical segment before a transfer, as NeMo-RL's
``to_dtype`` does (integer metadata untouched, provenance re-minted), returning a new structure.
"""

from __future__ import annotations

import copy
import dataclasses
import pickle
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
import torch

from mmpack import _native
from mmpack.packed.value import PackedTensor

__all__ = ["PayloadStats", "measure", "prepare_for_transfer"]


@dataclasses.dataclass(frozen=True)
class PayloadStats:
    """Bytes and segment counts of a payload (see the module docs for what counts).

    ``serialized_bytes`` is ``None`` unless ``measure(..., serialized=True)`` was asked."""

    physical_bytes: int
    logical_bytes: int
    physical_segments: int
    logical_segments: int
    serialized_bytes: int | None = None

    @property
    def saved_bytes(self) -> int:
        """``logical_bytes - physical_bytes``, clamped at 0."""
        return max(self.logical_bytes - self.physical_bytes, 0)

    @property
    def physical_to_logical(self) -> float:
        """Physical over logical bytes (1.0 when there are no logical bytes), as NeMo-RL's
        ``payload_ratio/.../physical_to_logical``."""
        return self.physical_bytes / self.logical_bytes if self.logical_bytes else 1.0


def _is_packed(obj: Any) -> bool:
    """Duck-typed ``PackedTensor`` (mmpack's, the reference one, or NeMo-RL's); mmpack's by
    class, so that a value read in place is not turned into private copies by the look."""
    return isinstance(obj, PackedTensor) or (
        hasattr(obj, "iter_logical_segments")
        and hasattr(obj, "dim_to_pack")
        and isinstance(getattr(obj, "tensors", None), list)
    )


class _Acc:
    __slots__ = ("logical_bytes", "logical_segments", "physical_bytes", "physical_segments", "seen")

    def __init__(self) -> None:
        self.physical_bytes = 0
        self.logical_bytes = 0
        self.physical_segments = 0
        self.logical_segments = 0
        self.seen = _native.SeenSegments()

    def leaf(self, nbytes: int, key: int) -> None:
        self.logical_bytes += nbytes
        self.logical_segments += 1
        seen = self.seen
        if key not in seen:
            seen.add(key)
            self.physical_bytes += nbytes
            self.physical_segments += 1

    def packed(self, value: Any) -> None:
        """One ``PackedTensor``-like value, in one native call (no per-segment Python)."""
        if isinstance(value, PackedTensor):
            state = value.packed_state(in_place=True)  # shapes only: store views stay views
            lay = state.layout
            segments, order = state.segments, None if lay is None else lay.indices()
            if state.read_in_place:  # a view's bytes, shared by every value of its chunk
                segments = [s.array if _is_view(s) else s for s in segments]
        else:
            segments, order = value.tensors, _raw_segment_order(value)
        totals = _native.measure_segments(segments, order, self.seen, _ARRAY_TYPES)
        self.physical_bytes += totals.physical_bytes
        self.physical_segments += totals.physical_segments
        self.logical_bytes += totals.logical_bytes
        self.logical_segments += totals.logical_segments


def _is_view(segment: Any) -> bool:
    """A store view (``mmpack.packed.state``), whose bytes are its ``array``."""
    return getattr(segment, "read_in_place", False) is True


#: What counts as a segment inside a ``PackedTensor`` (any other entry, ``None`` included, is
#: absent).
_ARRAY_TYPES = (torch.Tensor, np.ndarray)


def _raw_segment_order(value: Any) -> np.ndarray | None:
    """The physical index of every logical segment of a foreign value (NeMo-RL's fields), or
    ``None`` for the legacy layout."""
    indices_list = getattr(value, "_segment_indices", None)
    if indices_list is None:
        return None
    return np.asarray(indices_list, dtype=np.int64).reshape(-1)


_SCALARS = frozenset((str, bytes, bytearray, int, float, bool, complex, type(None)))


def _walk(root: Any, acc: _Acc) -> None:
    """Iterative walk; every container object is entered once (which also ends cycles)."""
    entered: set[int] = set()
    todo = [root]
    pop = todo.pop
    push = todo.extend
    seen = acc.seen
    tensor_t = torch.Tensor
    while todo:
        obj = pop()
        tp = type(obj)
        if tp in _SCALARS:
            continue
        if tp is tensor_t:  # the common leaf: acc.leaf() inlined
            nb = obj.nbytes
            acc.logical_bytes += nb
            acc.logical_segments += 1
            key = id(obj)
            if key not in seen:
                seen.add(key)
                acc.physical_bytes += nb
                acc.physical_segments += 1
            continue
        if tp is dict or tp is list or tp is tuple:
            key = id(obj)
            if key in entered:
                continue
            entered.add(key)
            push(obj.values() if tp is dict else obj)
            continue
        if isinstance(obj, torch.Tensor):
            acc.leaf(obj.nbytes, id(obj))
        elif isinstance(obj, np.ndarray):
            acc.leaf(int(obj.nbytes), id(obj))
        elif _is_packed(obj):
            if id(obj) not in entered:
                entered.add(id(obj))
                acc.packed(obj)
        elif isinstance(obj, (Mapping, list, tuple, set, frozenset)) or (
            dataclasses.is_dataclass(obj) and not isinstance(obj, type)
        ):
            if id(obj) in entered:
                continue
            entered.add(id(obj))
            if isinstance(obj, Mapping):
                push(obj.values())
            elif isinstance(obj, (list, tuple, set, frozenset)):
                push(obj)
            else:
                push(getattr(obj, f.name) for f in dataclasses.fields(obj))


def serialized_nbytes(obj: Any) -> int:
    """The exact pickle protocol-5 size of ``obj``: the pickle stream plus every out-of-band
    buffer (what NeMo-RL's ``protocol5_serialized_nbytes`` reports)."""
    buffers: list[pickle.PickleBuffer] = []
    frame = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    total = len(frame)
    for buf in buffers:
        try:
            total += buf.raw().nbytes
        except BufferError:  # a non-contiguous buffer
            total += memoryview(buf).nbytes
    return total


def measure(obj: Any, *, serialized: bool = False) -> PayloadStats:
    """Physical and logical media bytes and segment counts of ``obj`` (see the module docs).

    From shapes only, in O(segments), unless ``serialized=True``, which also pickles ``obj``
    once to fill ``serialized_bytes``."""
    acc = _Acc()
    _walk(obj, acc)
    return PayloadStats(
        physical_bytes=acc.physical_bytes,
        logical_bytes=acc.logical_bytes,
        physical_segments=acc.physical_segments,
        logical_segments=acc.logical_segments,
        serialized_bytes=serialized_nbytes(obj) if serialized else None,
    )


# ---------------------------------------------------------------------------------------------


def prepare_for_transfer(
    obj: Any,
    dtype: torch.dtype = torch.bfloat16,
    keys: Iterable[str] = ("pixel_values", "pixel_values_videos"),
) -> Any:
    """Cast the policy-bound floating media under ``keys`` to ``dtype`` before a transfer.

    Walks nested mappings (and lists, tuples and dataclasses holding them). A value under one of
    ``keys`` that is a ``PackedTensor`` goes through its ``to_dtype(dtype)``: each floating
    physical segment is cast once however many rows share it, integer segments are kept as the
    same objects, and provenance is re-minted when values change. A plain floating tensor under
    such a key is cast with ``.to(dtype)``; integer tensors are never cast. Everything else is
    kept as the same object.

    Returns a new structure (mappings, lists and dataclasses on the path are shallow-copied);
    ``obj`` is not modified.
    """
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    wanted = frozenset(keys)
    memo: dict[int, Any] = {}

    def cast(value: Any) -> Any:
        key = id(value)
        if key in memo:
            return memo[key]
        if _is_packed(value):
            result = value.to_dtype(dtype)
        elif isinstance(value, torch.Tensor):
            result = value.to(dtype) if value.is_floating_point() else value
        elif isinstance(value, (list, tuple)):
            result = _rebuild(value, [cast(v) for v in value])
        else:
            result = value
        memo[key] = result
        return result

    def walk(value: Any, stack: frozenset[int]) -> Any:
        if id(value) in stack:
            return value
        inner = stack | {id(value)}
        if isinstance(value, Mapping):
            return _rebuild_mapping(
                value,
                lambda k, v: cast(v) if k in wanted else walk(v, inner),
            )
        if isinstance(value, (list, tuple)):
            return _rebuild(value, [walk(v, inner) for v in value])
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            changes = {}
            for f in dataclasses.fields(value):
                if not f.init:
                    continue
                old = getattr(value, f.name)
                new = cast(old) if f.name in wanted else walk(old, inner)
                if new is not old:
                    changes[f.name] = new
            return dataclasses.replace(value, **changes) if changes else value
        return value

    return walk(obj, frozenset())


def _rebuild(value: list[Any] | tuple[Any, ...], items: list[Any]) -> Any:
    if all(a is b for a, b in zip(value, items, strict=True)):
        return value if isinstance(value, tuple) else list(value)
    if isinstance(value, tuple):
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    return items


def _rebuild_mapping(value: Mapping[Any, Any], fn: Callable[[Any, Any], Any]) -> Any:
    new_items = {k: fn(k, v) for k, v in value.items()}
    if type(value) is dict:
        return new_items
    try:
        result = copy.copy(value)
        for k, v in new_items.items():
            result[k] = v  # type: ignore[index]
    except (TypeError, AttributeError):  # an immutable or exotic mapping: a plain dict instead
        return dict(new_items)
    return result
