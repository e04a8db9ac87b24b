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
same pickling operation reference that group object, which the memo writes once. An operation is
recognized by a token that only the groups of the running pickle keep alive.

**Reading.** ``restore`` takes that state, NeMo-RL's current six-field ``__dict__`` state and
its pre-deduplication three-field one (``tensors``, ``dim_to_pack``, ``pad_to_max_shape``). Any
inconsistency in a state (truncated or corrupt bytes) is a ``LayoutError`` starting with
"corrupt PackedTensor pickle".
"""

from __future__ import annotations

import copyreg
import importlib
import math
import pickle
import sys
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch._utils import _flatten_dense_tensors

from mmpack._native import LayoutError, MmpackError, PackedLayout
from mmpack.errors import LayoutMismatchError

if TYPE_CHECKING:
    from mmpack.packed import PackedTensor

__all__ = ["FIELDS", "RAW_FIELDS", "STATE_KEY", "reduce", "restore"]

#: The instance attributes every value has (``_layout`` is the native handle).
FIELDS = frozenset(("tensors", "dim_to_pack", "pad_to_max_shape", "_layout"))
#: NeMo-RL's row mapping and provenance attributes, as its ``__dict__`` states hold them.
RAW_FIELDS = ("_row_offsets", "_segment_indices", "_segment_provenance")
STATE_KEY = "__mmpack_packed_tensor__"
CORRUPT = "corrupt PackedTensor pickle"
_SEGMENTS_FORMAT = "mmpack.segments/2"
_GROUP_FORMAT = "mmpack.group/1"
_BUFFER_DTYPES = {
    d: str(d).removeprefix("torch.")
    for d in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.complex64,
        torch.complex128,
    )
}
_STRIDED = torch.strided
_TENSOR = torch.Tensor


# ---------------------------------------------------------------------------------------------
# writing


def reduce(value: PackedTensor) -> tuple[Any, ...]:
    """``value.__reduce_ex__``'s result: the reconstructor and the state described above."""
    lay = value._lay()
    tensors = value.tensors
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
    op = _THREADS.op()
    plan = _plan_segments(tensors, op)
    state = {
        STATE_KEY: 1,
        "dim_to_pack": value.dim_to_pack,
        "pad_to_max_shape": value.pad_to_max_shape,
        "layout": layout_state,
        "segments": plan.segments,
        "extra": extra,
    }
    _THREADS.begin_value(value, state, plan, op)
    return (copyreg._reconstructor, (type(value), object, None), state)  # type: ignore[attr-defined]


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


def _bufferable(t: Any) -> bool:
    """A plain CPU tensor whose bytes can be written as they are (no autograd, subclass,
    sparse/nested layout or lazy conjugate/negative bit)."""
    return (
        type(t) is _TENSOR
        and t.dtype in _BUFFER_DTYPES
        and t.is_cpu
        and not t.requires_grad
        and t.layout is _STRIDED
        and not t.is_nested
        and not t.is_neg()
        and not t.is_conj()
    )


# --- the state of one pickling operation ------------------------------------------------------
#
# A pickling operation (one pickler, from its first PackedTensor on) shares each plain CPU tensor
# between its values: the first value that writes it puts it in a group, later values reference
# that group, which the pickler's memo writes once. No pickler hook tells ``__reduce_ex__``
# which pickler calls it, so three facts stand in for it:
#
# * operations never span threads: each thread has its own current operation;
# * a pickler writes the ``mmpack.packed.PackedTensor`` global once, for its first value, right
#   after that value's ``__reduce_ex__``: the module reports the lookup (``pickler_started``),
#   and that value then starts a new operation (its state is re-planned on its own if it
#   referenced groups of another);
# * a group's ``__reduce_ex__`` runs only when the running pickler has not written it yet: it
#   writes the members that the value being written needs, and placeholders (empty tensors)
#   for any others, so a group never carries tensors into a payload they do not belong to.
#   A group written that way is never referenced again.


class _PickleOp:
    """One pickling operation: which tensors its groups hold (tensor id -> group, slot)."""

    __slots__ = ("__weakref__", "written")

    def __init__(self) -> None:
        self.written: dict[int, tuple[weakref.ref[_Group], int]] = {}

    def find(self, t: Any) -> tuple[_Group, int] | None:
        entry = self.written.get(id(t))
        if entry is None:
            return None
        group = entry[0]()
        slot = entry[1]
        if group is None or not group.shareable or group.member(slot) is not t:
            return None  # a dead group, one written partly, or an id reused by a new tensor
        return group, slot

    def add(self, group: _Group) -> None:
        for j, t in enumerate(group.members or ()):
            self.written[id(t)] = (group.ref, j)

    def drop(self, group: _Group) -> None:
        for t in group.members or ():
            entry = self.written.get(id(t))
            if entry is not None and entry[0] is group.ref:
                del self.written[id(t)]


class _Group:
    """Tensors written together (pickled as a private ``PackedTensor``, see the module docs).

    Holds its members until its first write and only weak references after it, so that
    neither a long-lived pickler's memo nor this module keeps media alive."""

    __slots__ = ("__weakref__", "members", "op", "ref", "refs", "shareable")

    def __init__(self, op: _PickleOp, members: list[torch.Tensor]) -> None:
        self.members: list[torch.Tensor] | None = members
        self.refs: list[weakref.ref[torch.Tensor]] | None = None
        self.op = op  # keeps the operation alive while the pickler's memo holds the group
        self.ref = weakref.ref(self)
        self.shareable = True

    def __len__(self) -> int:
        return len(self.members if self.members is not None else self.refs or ())

    def member(self, j: int) -> torch.Tensor | None:
        if self.members is not None:
            return self.members[j]
        assert self.refs is not None
        return self.refs[j]()

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        needed = _THREADS.needed(self)
        n = len(self)
        members = [self.member(j) if needed is None or j in needed else None for j in range(n)]
        if needed is not None and len(needed) < n:
            self.shareable = False  # this pickler's memo now holds a partial copy
        if self.members is not None:  # written: keep weak references only
            self.refs = [weakref.ref(t) for t in self.members]
            self.members = None
        proto = protocol if isinstance(protocol, int) else 2
        state = {STATE_KEY: 1, "group": _encode_group(members, proto)}
        # a group unpickles as a legacy PackedTensor
        return (copyreg._reconstructor, (packed_class(), object, None), state)  # type: ignore[attr-defined]


class _Plan:
    """How one value's segments are written: the segments tuple of its state, the group of
    its own new tensors (if any), the operation that group joined, and which slots of each
    referenced group it needs (``None`` = all, for its own)."""

    __slots__ = ("fresh", "needs", "op", "own", "segments", "shares")

    def __init__(
        self,
        segments: tuple[Any, ...],
        own: _Group | None,
        op: _PickleOp | None,
        needs: dict[int, tuple[weakref.ref[_Group], frozenset[int] | None]],
        shares: bool,
        fresh: bool,
    ) -> None:
        self.segments = segments
        self.own = own
        self.op = op
        self.needs = needs
        self.shares = shares  # references groups of earlier values
        self.fresh = fresh  # its own group started a new operation


def _plan_segments(tensors: list[Any], op: _PickleOp | None) -> _Plan:
    n = len(tensors)
    codes = [-1] * n
    pos = [0] * n
    groups: list[Any] = []
    group_slot: dict[int, int] = {}
    slots: dict[int, set[int]] = {}
    others: list[Any] = []
    seen: dict[int, tuple[int, int]] = {}
    own_members: list[torch.Tensor] = []
    own_slot = -1
    for i, t in enumerate(tensors):
        if t is None:
            continue
        key = id(t)
        hit = seen.get(key)
        if hit is None:
            found = op.find(t) if op is not None else None
            if found is not None:
                group, j = found
                k = group_slot.get(id(group))
                if k is None:
                    k = group_slot[id(group)] = len(groups)
                    groups.append(group)
                    slots[k] = set()
                slots[k].add(j)
                hit = (k, j)
            elif _bufferable(t):
                if own_slot < 0:
                    own_slot = len(groups)
                    groups.append(None)  # the group is made once its members are known
                hit = (own_slot, len(own_members))
                own_members.append(t)
            else:
                hit = (-2, len(others))
                others.append(t)
            seen[key] = hit
        codes[i], pos[i] = hit
    needs = {id(groups[k]): (groups[k].ref, frozenset(s)) for k, s in slots.items()}
    own = None
    fresh = False
    if own_members:
        if op is None:
            op = _PickleOp()
            fresh = True
        own = groups[own_slot] = _Group(op, own_members)
        op.add(own)
        needs[id(own)] = (own.ref, None)
    segments = (_SEGMENTS_FORMAT, _i64_bytes(codes), _i64_bytes(pos), groups, others)
    return _Plan(segments, own, op, needs, bool(slots), fresh)


def _dead() -> None:
    return None


class _ThreadState(threading.local):
    """This thread's current operation, what the value being written needs, and the value
    whose ``__reduce_ex__`` ran last until its pickler writes the class global (or not)."""

    def __init__(self) -> None:
        self.op: Callable[[], _PickleOp | None] = _dead
        self.needs: dict[int, tuple[weakref.ref[_Group], frozenset[int] | None]] = {}
        self.pending: tuple[Any, ...] | None = None

    def begin_value(
        self, value: PackedTensor, state: dict[str, Any], plan: _Plan, op: _PickleOp | None
    ) -> None:
        self.needs = plan.needs
        if plan.op is not op:
            self.op = weakref.ref(plan.op) if plan.op is not None else _dead
        # Re-planning needs the value and its state only when it shares with earlier values.
        if plan.shares:
            self.pending = (plan, weakref.ref(value), state)
        else:
            self.pending = (plan, None, None)

    def needed(self, group: _Group) -> frozenset[int] | None:
        """The slots of ``group`` the value being written needs (``None``: all of them)."""
        self.pending = None  # the value's state is being written
        entry = self.needs.get(id(group))
        if entry is None or entry[0]() is not group:
            return None  # not written for a value: as a whole, as it was made
        return entry[1]

    def pickler_started(self) -> None:
        """A pickler wrote the class global for the first time: the value reduced last (if
        its state is not being written yet) is the first of a new operation."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        plan, value_ref, state = pending
        if not plan.shares:
            if plan.own is None:
                self.op = _dead  # the current operation belongs to another pickler
            elif not plan.fresh:
                # its own group joined another pickler's operation: move it to a new one
                plan.own.op.drop(plan.own)
                plan.own.op = op = _PickleOp()
                op.add(plan.own)
                self.op = weakref.ref(op)
            return
        value = value_ref() if value_ref is not None else None
        if value is None or state is None:
            return
        if plan.own is not None:
            plan.own.op.drop(plan.own)
        fresh = _plan_segments(value.tensors, None)
        state["segments"] = fresh.segments
        self.needs = fresh.needs
        self.op = weakref.ref(fresh.op) if fresh.op is not None else _dead


_THREADS = _ThreadState()


def packed_class() -> type[PackedTensor]:
    """``mmpack.packed.PackedTensor``, read without the lookup that ``pickler_started`` sees."""
    module = sys.modules.get("mmpack.packed") or importlib.import_module("mmpack.packed")
    cls: type[PackedTensor] = vars(module)["PackedTensor"]
    return cls


def pickler_started() -> None:
    """Called by ``mmpack.packed`` when something looks up its ``PackedTensor`` attribute: a
    pickler does that once, when it writes the class global for its first value."""
    _THREADS.pickler_started()


def _i64_bytes(values: Any) -> bytes:
    return np.asarray(values, dtype="<i8").tobytes()


def _i64_array(data: Any) -> np.ndarray:
    return np.frombuffer(data, dtype="<i8").astype(np.int64, copy=False)


def _encode_group(members: list[torch.Tensor | None], protocol: int) -> Any:
    """The group state of ``members``; a ``None`` member is written as an empty 1-d tensor (a
    placeholder that no value of the payload references)."""
    n = len(members)
    dtypes = [0] * n
    ranks = [0] * n
    dims: list[int] = []
    by_dtype: dict[torch.dtype, int] = {}
    parts: list[list[torch.Tensor]] = []
    placeholder = None
    for j, t in enumerate(members):
        if t is None:
            if placeholder is None:
                dtype = next((m.dtype for m in members if m is not None), torch.uint8)
                placeholder = torch.empty(0, dtype=dtype)
            t = placeholder
        dtype = t.dtype
        g = by_dtype.get(dtype)
        if g is None:
            g = by_dtype[dtype] = len(parts)
            parts.append([])
        parts[g].append(t)
        dtypes[j] = g
        shape = t.shape
        ranks[j] = len(shape)
        dims.extend(shape)
    buffers: list[tuple[str, Any]] = []
    for dtype, g in by_dtype.items():
        arr = _flatten_dense_tensors(parts[g]).view(torch.uint8).numpy()
        buf: Any = pickle.PickleBuffer(arr) if protocol >= 5 else arr.tobytes()
        buffers.append((_BUFFER_DTYPES[dtype], buf))
    return (_GROUP_FORMAT, _i64_bytes(dtypes), _i64_bytes(ranks), _i64_bytes(dims), buffers)


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
    lay = state.get("_layout")
    if lay is not None and not (
        isinstance(lay, PackedLayout) and lay.n_physical == len(state["tensors"])
    ):
        raise LayoutError(f"{CORRUPT}: _layout does not fit tensors")
    d = obj.__dict__
    d.update(state)
    if any(k in d for k in RAW_FIELDS) or "_layout" not in d:
        d.pop("_layout", None)
        obj._adopt_raw()


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
    with one shape become one ``view(k, *shape).unbind(0)``."""
    pos = 0
    j = 0
    n = len(slots)
    total = base.numel()
    while j < n:
        shape = shapes[slots[j]]
        k = j + 1
        while k < n and shapes[slots[k]] == shape:
            k += 1
        numel = math.prod(shape)
        count = k - j
        if pos + numel * count > total:
            break
        block = base[pos : pos + numel * count]
        if count == 1:
            out[slots[j]] = block.view(shape)
        else:
            pieces = block.view((count, *shape)).unbind(0)
            for i, piece in zip(slots[j:k], pieces, strict=True):
                out[i] = piece
        pos += numel * count
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
    if fmt != _GROUP_FORMAT:
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
        dtype = getattr(torch, name, None)
        if not isinstance(dtype, torch.dtype):
            raise LayoutError(f"unknown dtype {name!r} in a PackedTensor pickle")
        data = _writable_bytes(buf)
        if memoryview(data).nbytes == 0:
            base = torch.empty(0, dtype=dtype)
        else:
            base = torch.frombuffer(data, dtype=torch.uint8).view(dtype)
        _unflatten_into(out, base, members, shapes)
    return out


def _decode_segments(payload: Any) -> list[Any]:
    fmt, codes, pos, groups, others = payload
    if fmt != _SEGMENTS_FORMAT:
        raise LayoutError(f"unknown PackedTensor pickle format {fmt!r}")
    codes_a, pos_a = _i64_array(codes), _i64_array(pos)
    if len(codes_a) != len(pos_a) or (len(codes_a) and (codes_a.min() < -2 or pos_a.min() < 0)):
        raise LayoutError(f"{CORRUPT}: inconsistent segment tables")
    group_lists = [
        [g.member(j) for j in range(len(g))] if isinstance(g, _Group) else g.tensors
        for g in groups
    ]
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
        raise LayoutError(f"{CORRUPT}: {type(exc).__name__}: {exc}") from exc


def _restore_fields(obj: PackedTensor, state: dict[str, Any]) -> None:
    if "group" in state:
        obj.tensors = _decode_group(state["group"])
        obj.dim_to_pack = 0
        obj.pad_to_max_shape = False
        obj._layout = None
        return
    tensors = _decode_segments(state["segments"])
    lay = None
    layout_state = state["layout"]
    if layout_state is not None:
        offsets, indices, blob = layout_state
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
    obj.tensors = tensors
    obj.dim_to_pack = fields["dim_to_pack"]
    obj.pad_to_max_shape = fields["pad_to_max_shape"]
    obj._layout = lay
    if extra:
        obj.__dict__.update(extra)
