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

Groups keep tensor identity across the values of one pickle, as the pickle memo does for
NeMo-RL: the first value that pickles a tensor puts it in its own group, and later values of the
same pickling operation reference that group object, which the memo writes once. Which values
belong to one operation, and what a group writes when another operation references it, is
``mmpack.packed.pickle_operation``'s concern: a payload depends only on the values pickled into it.
A group member that no value of the payload references may be an empty placeholder.

**Through Ray.** While Ray's serializer runs (and the object-store path is on, see
``mmpack.packed.ray_store``), ``segments`` is ``("mmpack.store-segments/1", codes, pos, refs,
others)`` instead: ``codes[i] == k >= 0`` is member ``pos[i]`` of the chunk ``refs[k]`` (an
``ObjectRef``), each unique segment put into the object store once. Such a value restores with
its segments read in place (``__dict__["_store"]``) until ``tensors`` is first read.

**Reading.** ``restore`` takes that state, NeMo-RL's current six-field ``__dict__`` state and
its pre-deduplication three-field one (``tensors``, ``dim_to_pack``, ``pad_to_max_shape``). Any
inconsistency in a state (truncated or corrupt bytes) is a ``LayoutError`` starting with
"corrupt PackedTensor pickle".
"""

from __future__ import annotations

import copyreg
import math
import operator
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from mmpack._native import LayoutError, MmpackError, PackedLayout
from mmpack.errors import LayoutMismatchError, UnsafePickleError
from mmpack.packed import ray_store as _ray_store
from mmpack.packed.pickle_operation import (
    GROUP_FORMAT,
    SEGMENTS_FORMAT,
    STATE_KEY,
    THREADS,
    Group,
    plan_segments,
)
from mmpack.packed.restore_charge import RESTORE_CHARGE, charge

if TYPE_CHECKING:
    from mmpack.packed.value import PackedTensor

__all__ = ["FIELDS", "RAW_FIELDS", "STATE_KEY", "reduce", "restore"]

#: The instance attributes every value has (``_layout`` is the native handle).
#: ``_store`` holds the segments of a value read in place from Ray's object store, until
#: ``tensors`` is first read (``mmpack.packed.ray_store``).
FIELDS = frozenset(("tensors", "dim_to_pack", "pad_to_max_shape", "_layout", "_store"))
#: NeMo-RL's row mapping and provenance attributes, as its ``__dict__`` states hold them.
RAW_FIELDS = ("_row_offsets", "_segment_indices", "_segment_provenance")
CORRUPT = "corrupt PackedTensor pickle"
# What restoring builds, charged to a restricted load's budget first: per
# group member (a tensor view and its shape; measured 115-600 bytes), per buffer, per segment
# slot, per group a value references, per byte of a row layout (the native handle's copies), and per
# attribute copied into the instance's __dict__ (a dict entry).
_MEMBER_COST = 640
_SEGMENT_COST = 96
_GROUP_COST = 16
_BUFFER_COST = 2048  # a buffer's tensor, its dtype view and its member list
_LAYOUT_COST_PER_BYTE = 4
_ATTRIBUTE_COST = 128


# ---------------------------------------------------------------------------------------------
# writing


def reduce(value: PackedTensor, group_class: type[PackedTensor]) -> tuple[Any, ...]:
    """``value.__reduce_ex__``'s result: the reconstructor and the state described above; the
    groups it makes unpickle as ``group_class``."""
    lay = value._lay()
    for_ray = _ray_store.serializing_for_ray()
    tensors = value._phys() if for_ray else value.tensors
    layout_state = None
    if lay is not None:
        offsets, indices = lay.offsets(), lay.indices()
        _check_fits(value, lay, indices, len(tensors))
        layout_state = (
            None if offsets is None else offsets.astype("<i8", copy=False).tobytes(),
            None if indices is None else indices.astype("<i8", copy=False).tobytes(),
            lay.provenance_blob(),
        )
    extra = {k: v for k, v in value.__dict__.items() if k not in FIELDS} or None
    if extra:
        _refuse_shadowing(type(value), extra, lambda why: _unwritable(value, why))
    dim_to_pack, pad_to_max_shape = _written_fields(value)
    if for_ray:
        state = {
            STATE_KEY: 1,
            "dim_to_pack": dim_to_pack,
            "pad_to_max_shape": pad_to_max_shape,
            "layout": layout_state,
            "segments": _ray_store.encode_segments(tensors),
            "extra": extra,
        }
        THREADS.pending = None  # no group of this value: the pickler's class lookup starts nothing
        return (copyreg._reconstructor, (type(value), object, None), state)  # type: ignore[attr-defined]
    op = THREADS.op()
    plan = plan_segments(tensors, op, group_class)
    state = {
        STATE_KEY: 1,
        "dim_to_pack": dim_to_pack,
        "pad_to_max_shape": pad_to_max_shape,
        "layout": layout_state,
        "segments": plan.segments,
        "extra": extra,
    }
    THREADS.begin_value(value, state, plan, op)
    return (copyreg._reconstructor, (type(value), object, None), state)  # type: ignore[attr-defined]


def _unwritable(value: PackedTensor, why: str) -> LayoutMismatchError:
    return LayoutMismatchError(
        f"cannot pickle {type(value).__name__} at {id(value):#x} ({len(value)} rows): {why}; "
        "the pickle would not load"
    )


def _written_fields(value: PackedTensor) -> tuple[int, bool]:
    """``dim_to_pack`` and ``pad_to_max_shape`` as the state holds them: an int and a bool.
    numpy integers and booleans (and 0 / 1) are written as such; anything else is refused here,
    where the writer can see it, not on load in another process."""
    dim, pad = value.dim_to_pack, value.pad_to_max_shape
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


def _refuse_shadowing(cls: type, attrs: dict[Any, Any], error: Callable[[str], Exception]) -> None:
    """Instance attributes may not hide the class's methods or properties: restored from a
    payload, ``{"as_tensor": OrderedDict}`` would make ``as_tensor()`` return whatever the
    payload chose. ``error(why)`` is raised for the first offender."""
    for key in attrs:
        if not isinstance(key, str):
            raise error(f"attribute name {key!r} is not a string")
        if key in FIELDS or key in RAW_FIELDS:
            continue
        if hasattr(cls, key):
            raise error(f"attribute {key!r} would hide {cls.__name__}.{key}")


def _check_fits(value: PackedTensor, lay: PackedLayout, indices: np.ndarray | None, n: int) -> None:
    """Refuse to write a value whose ``tensors`` no longer fit its row layout (say, a segment
    appended to a deduplicated value's list): its pickle would not load."""
    problem = None
    if lay.has_provenance:
        if lay.n_physical != n:
            problem = f"its layout has provenance for {lay.n_physical} physical segments"
    elif indices is not None and indices.size and int(indices.max()) >= n:
        problem = f"its row mapping references physical segment {int(indices.max())}"
    if problem is not None:
        raise LayoutMismatchError(
            f"cannot pickle {type(value).__name__} at {id(value):#x} ({len(value)} rows): "
            f"its tensors list has {n} entries but {problem}; the pickle would not load "
            "(was a segment appended to or removed from .tensors?)"
        )


def _i64_array(data: Any) -> np.ndarray:
    return np.frombuffer(data, dtype="<i8").astype(np.int64, copy=False)


# ---------------------------------------------------------------------------------------------
# reading


def restore(obj: PackedTensor, state: Any) -> None:
    """``obj.__setstate__(state)`` for any of the states described above."""
    if not isinstance(state, dict):
        raise LayoutError(f"{CORRUPT}: the state is a {type(state).__name__}, not a dict")
    if STATE_KEY in state:
        _restore_mmpack(obj, state)
        return
    _check_fields(state, "NeMo-RL state")
    if "_store" in state:  # object-store segments that methods would prefer over ``tensors``
        raise LayoutError(f"{CORRUPT}: a NeMo-RL state has no '_store'")
    lay = state.get("_layout")
    if lay is not None and not (
        isinstance(lay, PackedLayout) and lay.n_physical == len(state["tensors"])
    ):
        raise LayoutError(f"{CORRUPT}: _layout does not fit tensors")
    _refuse_shadowing(type(obj), state, _corrupt)
    charge(64 * _raw_entries(state) + _ATTRIBUTE_COST * len(state), "a NeMo-RL state")
    d = obj.__dict__
    if "_layout" not in state:
        d.pop("_layout", None)  # a state restored twice: the first one's layout is not this one's
    d.update(state)
    if any(k in d for k in RAW_FIELDS) or "_layout" not in d:
        d.pop("_layout", None)
        obj._adopt_raw()


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
            raise LayoutError(
                f"{CORRUPT}: {key} must be a list of {items[0].__name__} or a tensor, got "
                f"{type(value).__name__}" + (" with other items" if type(value) is list else "")
            )
        if isinstance(value, list):
            n += len(value)
    return n


def _corrupt(why: str) -> LayoutError:
    return LayoutError(f"{CORRUPT}: {why}")


def _check_fields(state: dict[str, Any], what: str) -> None:
    """The fields every restored value needs: a ``tensors`` list, an int ``dim_to_pack`` and a
    bool ``pad_to_max_shape`` (``LayoutError`` naming the first that is missing or wrong)."""
    for key, types in (("tensors", list), ("dim_to_pack", int), ("pad_to_max_shape", bool)):
        if key not in state:
            raise LayoutError(f"{CORRUPT}: the {what} has no {key!r}")
        value = state[key]
        if not isinstance(value, types) or (types is int and isinstance(value, bool)):
            raise LayoutError(
                f"{CORRUPT}: {key} must be a {types.__name__}, got {type(value).__name__}"
            )


def _unflatten_into(
    out: list[Any], base: torch.Tensor, slots: list[int], shapes: list[Any]
) -> None:
    """Views of ``base`` for the members ``slots`` (in order), into ``out``: runs of members
    that differ only in their leading size become one ``view(-1, *rest).split(sizes)``."""
    pos = 0
    j = 0
    n = len(slots)
    total = base.numel()
    while j < n:
        shape = shapes[slots[j]]
        rest = shape[1:]
        k = j + 1
        if shape and math.prod(rest):
            while k < n and (s := shapes[slots[k]])[1:] == rest and s:
                k += 1
        numel = sum(math.prod(shapes[i]) for i in slots[j:k]) if k > j + 1 else math.prod(shape)
        if pos + numel > total:
            break
        block = base[pos : pos + numel]
        if k == j + 1:
            out[slots[j]] = block.view(shape)
        else:
            sizes = [shapes[i][0] for i in slots[j:k]]
            pieces = block.view((-1, *rest)).split(sizes)
            for i, piece in zip(slots[j:k], pieces, strict=True):
                out[i] = piece
        pos += numel
        j = k
    if j < n or pos != total:
        raise LayoutError(f"{CORRUPT}: its shape table does not match its buffer")


def _writable_bytes(buf: Any) -> Any:
    """A writable buffer holding ``buf``'s bytes (``torch.frombuffer`` warns on read-only)."""
    view = memoryview(buf)
    if view.readonly:
        return bytearray(view)
    return buf


def _decode_group(payload: Any) -> list[Any]:
    fmt, dtypes, ranks, dims, buffers = payload
    if fmt != GROUP_FORMAT:
        raise LayoutError(f"unknown PackedTensor pickle format {fmt!r}")
    dtypes_a, ranks_a, dims_a = _i64_array(dtypes), _i64_array(ranks), _i64_array(dims)
    if (
        len(dtypes_a) != len(ranks_a)
        or (ranks_a < 0).any()
        or int(ranks_a.sum()) != len(dims_a)
        or (dims_a < 0).any()
        or (len(dtypes_a) and not 0 <= int(dtypes_a.min()) <= int(dtypes_a.max()) < len(buffers))
    ):
        raise LayoutError(f"{CORRUPT}: inconsistent tensor tables")
    copied = sum(memoryview(buf).nbytes for _, buf in buffers if memoryview(buf).readonly)
    charge(
        _MEMBER_COST * len(dtypes_a) + 48 * len(dims_a) + _BUFFER_COST * len(buffers) + copied,
        "a PackedTensor group",
    )
    if len(buffers) == 1:
        uniform = _decode_uniform(ranks_a, dims_a, buffers[0])
        if uniform is not None:
            return uniform
    dtypes_l, ranks_l, dims_l = dtypes_a.tolist(), ranks_a.tolist(), dims_a.tolist()
    n = len(dtypes_l)
    shapes: list[Any] = [None] * n
    slots: list[list[int]] = [[] for _ in buffers]
    at = 0
    for j in range(n):
        r = ranks_l[j]
        shapes[j] = tuple(dims_l[at : at + r])
        at += r
        slots[dtypes_l[j]].append(j)
    out: list[Any] = [None] * n
    for (name, buf), members in zip(buffers, slots, strict=True):
        _unflatten_into(out, _buffer_base(name, buf), members, shapes)
    return out


def _buffer_base(name: str, buf: Any) -> torch.Tensor:
    """One buffer of a group as a flat tensor of its dtype."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise LayoutError(f"unknown dtype {name!r} in a PackedTensor pickle")
    data = _writable_bytes(buf)
    if memoryview(data).nbytes == 0:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(data, dtype=torch.uint8).view(dtype)


def _decode_uniform(ranks: np.ndarray, dims: np.ndarray, buffer: Any) -> list[Any] | None:
    """The members of a one-dtype group whose shapes differ only in their leading size (the
    usual group), as one ``split`` of its buffer; ``None`` for any other group."""
    n = len(ranks)
    r = int(ranks[0]) if n else 0
    if r < 1 or not (ranks == r).all():
        return None
    table = dims.reshape(n, r)
    rest = table[0, 1:]
    row = math.prod(rest.tolist())
    if row == 0 or not (table[:, 1:] == rest).all():
        return None
    base = _buffer_base(*buffer)
    sizes = table[:, 0].tolist()
    if sum(sizes) * row != base.numel():
        raise LayoutError(f"{CORRUPT}: its shape table does not match its buffer")
    return list(base.view((-1, *rest.tolist())).split(sizes))


def _decode_segments(payload: Any) -> list[Any]:
    fmt, codes, pos, groups, others = payload
    if fmt != SEGMENTS_FORMAT:
        raise LayoutError(f"unknown PackedTensor pickle format {fmt!r}")
    codes_a, pos_a = _i64_array(codes), _i64_array(pos)
    if len(codes_a) != len(pos_a) or (len(codes_a) and (codes_a.min() < -2 or pos_a.min() < 0)):
        raise LayoutError(f"{CORRUPT}: inconsistent segment tables")
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


def _restore_mmpack(obj: PackedTensor, state: dict[str, Any]) -> None:
    """Restore mmpack's own state; any inconsistency is a ``LayoutError`` (the state comes from
    bytes that may be truncated or corrupt)."""
    try:
        _restore_fields(obj, state)
    except MmpackError:
        raise
    except Exception as exc:  # a decoding boundary: every failure means a corrupt state
        if type(exc).__module__.startswith("ray."):
            raise  # the object store's own errors (an owner that died, ...) say what happened
        raise LayoutError(f"{CORRUPT}: {type(exc).__name__}: {exc}") from exc


def _restore_fields(obj: PackedTensor, state: dict[str, Any]) -> None:
    if "group" in state:
        obj.tensors = _decode_group(state["group"])
        obj.dim_to_pack = 0
        obj.pad_to_max_shape = False
        obj._layout = None
        return
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
            None if offsets is None else _i64_array(offsets),
            None if indices is None else _i64_array(indices),
            provenance_blob=None if blob is None else bytes(blob),
        )
    fields = {
        "tensors": tensors,
        "dim_to_pack": state["dim_to_pack"],
        "pad_to_max_shape": state["pad_to_max_shape"],
    }
    _check_fields(fields, "mmpack state")
    extra = state.get("extra")
    if extra is not None and not (
        isinstance(extra, dict) and FIELDS.isdisjoint(extra) and not set(RAW_FIELDS) & extra.keys()
    ):
        raise LayoutError(f"{CORRUPT}: extra attributes must be a dict of non-field names")
    if extra:
        _refuse_shadowing(type(obj), extra, _corrupt)
        charge(_ATTRIBUTE_COST * len(extra), "PackedTensor attributes")
    if in_store:
        obj._store = tensors  # read in place; ``tensors`` makes private copies on first read
    else:
        obj.tensors = tensors
    obj.dim_to_pack = fields["dim_to_pack"]
    obj.pad_to_max_shape = fields["pad_to_max_shape"]
    obj._layout = lay
    if extra:
        obj.__dict__.update(extra)
