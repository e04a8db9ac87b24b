"""The pickle format of ``PackedTensor``: what ``__reduce_ex__`` writes and ``__setstate__`` reads.

**Writing.** A value pickles as ``copyreg._reconstructor(cls, object, None)`` plus a state dict
that holds only builtin types and further such objects, so a restricted unpickler that admits
the class admits the value::

    {STATE_KEY: 1, "dim_to_pack": ..., "pad_to_max_shape": ...,
     "layout": layout, "segments": segments, "extra": extra}

* ``layout``: ``None`` (the legacy layout) or ``(offsets, indices, provenance)``: the row
  offsets and segment indices as little-endian int64 bytes (both ``None`` without a row
  mapping), and 16 bytes per physical segment back to back (``None`` without provenance).
* ``segments``: ``("mmpack.segments/2", codes, pos, groups, others)``. ``codes`` and ``pos`` are
  little-endian int64 bytes with one entry per physical slot ``i``:
  ``codes[i] == -1`` is ``None``; ``codes[i] == -2`` is ``others[pos[i]]`` (pickled normally);
  ``codes[i] == k >= 0`` is ``groups[k].tensors[pos[i]]``.
* ``extra``: the other instance attributes as a dict, or ``None``.

A **group** is an object pickled like a ``PackedTensor`` with the state
``{STATE_KEY: 1, "group": ("mmpack.group/1", dtypes, ranks, dims, buffers)}``. Member ``j`` has
dtype ``buffers[dtypes[j]][0]`` and the shape made of the next ``ranks[j]`` values of ``dims``
(all three little-endian int64 bytes). ``buffers`` is a list of ``(dtype name, bytes)``: the
bytes of every member of that dtype back to back in C order, as a ``PickleBuffer`` under
protocol 5 (out-of-band capable) or as ``bytes``. A group unpickles as a private legacy
``PackedTensor`` whose ``tensors`` are views into one writable buffer per dtype
(``requires_grad=False``). Only plain CPU tensors go into groups; any other segment (autograd,
subclasses, sparse or nested layouts, lazy conjugate or negative bits) goes to ``others``.

Groups keep tensor identity across the values of one pickle, as the pickle memo does for NeMo-RL:
the first value that pickles a tensor puts it in its own group, and later values of the same
pickling operation reference that group object, which the memo writes once. Which values belong to
one operation, and what a group writes when another operation references it, is
``mmpack.packed.pickling.operation``'s concern: a payload depends only on the values pickled into
it. A group's bytes are ``mmpack.packed.pickling.group_codec``'s. A group member that no value of
the payload references may be an empty placeholder.

**Through Ray.** While Ray's serializer runs (and the object-store path is on, see
``mmpack.packed.ray_store``), ``segments`` is ``("mmpack.store-segments/1", codes, pos, refs,
others)`` instead: ``codes[i] == k >= 0`` is member ``pos[i]`` of the chunk ``refs[k]`` (an
``ObjectRef``), each unique segment put into the object store once. Such a value restores with
its segments read in place (a state with ``read_in_place``) until ``tensors`` is first read.

**The value.** Writing reads the value only through ``value.packed_state()`` and reading
returns a :class:`~mmpack.packed.state.PackedState` that the value applies: this module never
touches a value's private members.

**Reading.** ``restore`` takes that state, NeMo-RL's current six-field ``__dict__`` state and
its pre-deduplication three-field one (``tensors``, ``dim_to_pack``, ``pad_to_max_shape``). Any
inconsistency in a state (truncated or corrupt bytes) is a ``LayoutError`` starting with
"corrupt PackedTensor pickle".
"""

from __future__ import annotations

import copyreg
import operator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from mmpack._native import LayoutError, MmpackError, PackedLayout
from mmpack.errors import LayoutMismatchError, UnsafePickleError
from mmpack.packed import ray_store as _ray_store
from mmpack.packed.nemo_fields import layout_from_fields
from mmpack.packed.pickling.group_codec import decode_group, i64_array
from mmpack.packed.pickling.operation import (
    SEGMENTS_FORMAT,
    STATE_KEY,
    THREADS,
    Group,
    plan_segments,
)
from mmpack.packed.pickling.restore_charge import RESTORE_CHARGE, charge
from mmpack.packed.state import (
    RAW_FIELDS,
    VALUE_FIELDS,
    PackedState,
    corrupt,
    layout_misfit,
    private_segments,
    refuse_extra,
    refuse_shadowing,
)

if TYPE_CHECKING:
    from mmpack.packed.value import PackedTensor

__all__ = ["STATE_KEY", "reduce", "restore"]

# What restoring builds, charged to a restricted load's budget first: per segment slot, per
# group a value references, per byte of a row layout (the native handle's copies), and per
# attribute copied into the instance's __dict__ (a dict entry). Groups charge their own.
_SEGMENT_COST = 96
_GROUP_COST = 16
_LAYOUT_COST_PER_BYTE = 4
_ATTRIBUTE_COST = 128


# ---------------------------------------------------------------------------------------------
# writing


def reduce(
    value: PackedTensor, packed: PackedState, group_class: type[PackedTensor]
) -> tuple[Any, ...]:
    """``value.__reduce_ex__``'s result for its state ``packed`` (``packed_state(in_place=True)``):
    the reconstructor and the state described above; the groups it makes unpickle as
    ``group_class``. ``value`` is only named in errors and followed by the operation."""
    for_ray = _ray_store.serializing_for_ray()
    tensors = packed.segments
    if packed.read_in_place and not for_ray:
        tensors = private_segments(tensors)  # a plain pickle holds bytes, not store refs
    lay = packed.layout
    layout_state = None
    if lay is not None:
        offsets, indices = lay.offsets(), lay.indices()
        _check_fits(value, lay, indices, len(tensors))
        layout_state = (
            None if offsets is None else offsets.astype("<i8", copy=False).tobytes(),
            None if indices is None else indices.astype("<i8", copy=False).tobytes(),
            lay.provenance_blob(),
        )
    extra = packed.extra
    if extra:
        refuse_shadowing(type(value), extra, lambda why: _unwritable(value, why))
    dim_to_pack, pad_to_max_shape = _written_fields(value, packed)
    state = {
        STATE_KEY: 1,
        "dim_to_pack": dim_to_pack,
        "pad_to_max_shape": pad_to_max_shape,
        "layout": layout_state,
        "segments": None,
        "extra": extra,
    }
    if for_ray:
        state["segments"] = _ray_store.encode_segments(tensors)
        THREADS.pending = None  # no group of this value: the pickler's class lookup starts nothing
    else:
        op = THREADS.op()
        plan = plan_segments(tensors, op, group_class)
        state["segments"] = plan.segments
        THREADS.begin_value(value, state, plan, op)
    return (copyreg._reconstructor, (type(value), object, None), state)  # type: ignore[attr-defined]


def _unwritable(value: PackedTensor, why: str) -> LayoutMismatchError:
    return LayoutMismatchError(
        f"cannot pickle {type(value).__name__} at {id(value):#x} ({len(value)} rows): {why}; "
        "the pickle would not load"
    )


def _written_fields(value: PackedTensor, packed: PackedState) -> tuple[int, bool]:
    """``dim_to_pack`` and ``pad_to_max_shape`` as the state holds them: an int and a bool.
    numpy integers and booleans (and 0 / 1) are written as such; anything else is refused here,
    where the writer can see it, not on load in another process."""
    dim, pad = packed.dim_to_pack, packed.pad_to_max_shape
    if not isinstance(dim, int) or isinstance(dim, bool):
        try:
            if isinstance(dim, (bool, np.bool_)):
                raise TypeError
            dim = operator.index(dim)
        except TypeError:
            raise _unwritable(value, f"dim_to_pack must be an int, got {dim!r}") from None
    if not isinstance(pad, bool):
        if isinstance(pad, np.bool_) or (isinstance(pad, (int, np.integer)) and int(pad) in (0, 1)):
            pad = bool(pad)
        else:
            raise _unwritable(value, f"pad_to_max_shape must be a bool, got {pad!r}")
    return int(dim), pad


def _check_fits(value: PackedTensor, lay: PackedLayout, indices: np.ndarray | None, n: int) -> None:
    """Refuse to write a value whose ``tensors`` no longer fit its row layout (say, a segment
    appended to a deduplicated value's list): its pickle would not load."""
    problem = layout_misfit(lay, n, indices)
    if problem is not None:
        raise LayoutMismatchError(
            f"cannot pickle {type(value).__name__} at {id(value):#x} ({len(value)} rows): "
            f"its tensors list has {n} entries but {problem}; the pickle would not load "
            "(was a segment appended to or removed from .tensors?)"
        )


# ---------------------------------------------------------------------------------------------
# reading


def restore(cls: type[PackedTensor], state: Any) -> PackedState:
    """The value state of any of the pickled states described above (``cls.__setstate__``)."""
    if not isinstance(state, dict):
        raise corrupt(f"the state is a {type(state).__name__}, not a dict")
    if STATE_KEY in state:
        return _restore_mmpack(cls, state)
    _check_fields(state, "NeMo-RL state")
    if "_store" in state:  # object-store segments that methods would prefer over ``tensors``
        raise corrupt("a NeMo-RL state has no '_store'")
    tensors = state["tensors"]
    lay = state.get("_layout")
    if lay is not None and not (isinstance(lay, PackedLayout) and lay.n_physical == len(tensors)):
        raise corrupt("_layout does not fit tensors")
    refuse_shadowing(cls, state, corrupt)
    charge(64 * _raw_entries(state) + _ATTRIBUTE_COST * len(state), "a NeMo-RL state")
    if any(k in state for k in RAW_FIELDS) or "_layout" not in state:
        lay = layout_from_fields(len(tensors), *(state.get(k) for k in RAW_FIELDS))
    skip = VALUE_FIELDS.union(RAW_FIELDS)
    extra = {k: v for k, v in state.items() if k not in skip}
    return PackedState(tensors, lay, state["dim_to_pack"], state["pad_to_max_shape"], extra or None)


def _raw_entries(state: dict[str, Any]) -> int:
    """The entries NeMo-RL's row-mapping fields convert to arrays: a list's items, a tensor's
    elements (a stride-0 tensor over one stored element may claim billions). In a restricted
    load the fields must be lists of ints (of bytes for provenance) or tensors: a list holding
    a tensor would convert to an array of all its elements."""
    restricted = RESTORE_CHARGE.get() is not None
    n = 0
    for key in RAW_FIELDS:
        value = state.get(key)
        if value is None:
            continue
        if isinstance(value, torch.Tensor):
            n += value.numel()
            continue
        items = (bytes, bytearray) if key == "_segment_provenance" else (int, bool)
        if restricted and not (type(value) is list and all(type(x) in items for x in value)):
            raise corrupt(
                f"{key} must be a list of {items[0].__name__} or a tensor, got "
                f"{type(value).__name__}" + (" with other items" if type(value) is list else "")
            )
        if isinstance(value, list):
            n += len(value)
    return n


def _check_fields(state: dict[str, Any], what: str) -> None:
    """The fields every restored value needs: a ``tensors`` list, an int ``dim_to_pack`` and a
    bool ``pad_to_max_shape`` (``LayoutError`` naming the first that is missing or wrong)."""
    for key, types in (("tensors", list), ("dim_to_pack", int), ("pad_to_max_shape", bool)):
        if key not in state:
            raise corrupt(f"the {what} has no {key!r}")
        value = state[key]
        if not isinstance(value, types) or (types is int and isinstance(value, bool)):
            raise corrupt(f"{key} must be a {types.__name__}, got {type(value).__name__}")


def _decode_segments(payload: Any) -> list[Any]:
    fmt, codes, pos, groups, others = payload
    if fmt != SEGMENTS_FORMAT:
        raise LayoutError(f"unknown PackedTensor pickle format {fmt!r}")
    codes_a, pos_a = i64_array(codes), i64_array(pos)
    if len(codes_a) != len(pos_a) or (len(codes_a) and (codes_a.min() < -2 or pos_a.min() < 0)):
        raise corrupt("inconsistent segment tables")
    charge(_SEGMENT_COST * len(codes_a) + _GROUP_COST * len(groups), "PackedTensor segments")
    group_lists = [
        [g.member(j) for j in range(len(g))] if isinstance(g, Group) else g.tensors for g in groups
    ]
    n = len(codes_a)
    if (
        len(group_lists) == 1
        and len(group_lists[0]) == n
        and not (codes_a != 0).any()
        and (pos_a == np.arange(n)).all()
    ):
        return list(group_lists[0])  # the usual value: its own group, every member in order
    out: list[Any] = []
    append = out.append
    for c, j in zip(codes_a.tolist(), pos_a.tolist(), strict=True):
        if c >= 0:
            append(group_lists[c][j])
        elif c == -1:
            append(None)
        else:
            append(others[j])
    return out


def _restore_mmpack(cls: type[PackedTensor], state: dict[str, Any]) -> PackedState:
    """Restore mmpack's own state; any inconsistency is a ``LayoutError`` (the state comes from
    bytes that may be truncated or corrupt)."""
    try:
        return _restore_fields(cls, state)
    except MmpackError:
        raise
    except Exception as exc:  # a decoding boundary: every failure means a corrupt state
        if type(exc).__module__.startswith("ray."):
            raise  # the object store's own errors (an owner that died, ...) say what happened
        raise corrupt(f"{type(exc).__name__}: {exc}") from exc


def _restore_fields(cls: type[PackedTensor], state: dict[str, Any]) -> PackedState:
    if "group" in state:  # a group: a private legacy value of its members
        return PackedState(decode_group(state["group"]), None, 0, False)
    segments = state["segments"]
    in_store = isinstance(segments, tuple) and segments[:1] == (_ray_store.STORE_FORMAT,)
    if in_store and RESTORE_CHARGE.get() is not None:
        # only Ray's own deserializer writes these; a payload would import Ray (uncharged) and
        # hand its own objects to the object-store path
        raise UnsafePickleError(
            "refusing Ray object-store segments in a restricted load: they come only from "
            "Ray's serializer"
        )
    tensors = _ray_store.decode_segments(segments) if in_store else _decode_segments(segments)
    lay = None
    layout_state = state["layout"]
    if layout_state is not None:
        offsets, indices, blob = layout_state
        nbytes = sum(len(part) for part in (offsets, indices, blob) if part is not None)
        charge(_LAYOUT_COST_PER_BYTE * nbytes, "a PackedTensor row layout")
        lay = PackedLayout.build(
            len(tensors),
            None if offsets is None else i64_array(offsets),
            None if indices is None else i64_array(indices),
            provenance_blob=None if blob is None else bytes(blob),
        )
    fields = {
        "tensors": tensors,
        "dim_to_pack": state["dim_to_pack"],
        "pad_to_max_shape": state["pad_to_max_shape"],
    }
    _check_fields(fields, "mmpack state")
    extra = state.get("extra")
    refuse_extra(cls, extra, corrupt)
    if extra:
        charge(_ATTRIBUTE_COST * len(extra), "PackedTensor attributes")
    dim_to_pack, pad_to_max_shape = fields["dim_to_pack"], fields["pad_to_max_shape"]
    return PackedState(tensors, lay, dim_to_pack, pad_to_max_shape, extra or None, in_store)
