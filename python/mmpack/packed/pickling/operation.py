"""Which tensors one pickling operation already wrote, and how a value's segments are written.

The values of one pickle share the tensors they have in common: the first value that writes a plain
CPU tensor puts it in a group (pickled as a private ``PackedTensor``, see
``mmpack.packed.pickling.format``), later values reference that group, which the pickler's memo
writes once. Nothing of this outlives or crosses operations: what a payload holds depends only on
the values given to its pickler. No pickler hook tells ``__reduce_ex__`` which pickler calls it, so
three facts stand in for it:

* an operation never spans threads: each thread has its own current operation;
* a pickler writes the ``mmpack.packed.PackedTensor`` global once, for its first value, right
  after that value's ``__reduce_ex__``: ``mmpack.packed.pickling.operation_start`` turns that
  lookup into a call of :meth:`ThreadState.pickler_started`, and that value starts a new
  operation (its segments are planned again on their own if they referenced another
  operation's groups);
* a group's ``__reduce_ex__`` runs only when the running pickler has not written it yet: it
  writes the members that the value being written needs and an empty placeholder for any
  other, so a group never carries tensors into a payload they do not belong to. A group
  written partly is never referenced again.

Groups hold their members until their first write and only weak references after it, so neither
a long-lived pickler's memo nor this bookkeeping keeps media alive.
"""

from __future__ import annotations

import copyreg
import itertools
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from mmpack.packed.buffers import bufferable, i64_bytes, one_dtype_if_bufferable
from mmpack.packed.pickling.group_codec import encode_group, encode_one_dtype

if TYPE_CHECKING:
    from mmpack.packed.value import PackedTensor

__all__ = [
    "SEGMENTS_FORMAT",
    "STATE_KEY",
    "THREADS",
    "Group",
    "Plan",
    "plan_segments",
]

#: The key that marks an mmpack state (a value's or a group's).
STATE_KEY = "__mmpack_packed_tensor__"
SEGMENTS_FORMAT = "mmpack.segments/2"


class PickleOp:
    """One pickling operation: which tensors its groups hold. ``written`` maps a tensor's id to
    an entry number, and entry ``e`` is slot ``slots[e]`` of the group ``owners[e]`` refers to
    (flat lists, not a tuple per tensor: fewer objects for the garbage collector to track)."""

    __slots__ = ("__weakref__", "owners", "slots", "written")

    def __init__(self) -> None:
        self.written: dict[int, int] = {}
        self.owners: list[weakref.ref[Group]] = []
        self.slots: list[int] = []

    def add(self, group: Group) -> None:
        members = group.members or ()
        start = len(self.owners)
        self.owners.extend(itertools.repeat(group.ref, len(members)))
        self.slots.extend(range(len(members)))
        # one C-level pass: tens of thousands of members are common
        self.written.update(zip(map(id, members), itertools.count(start)))

    def lookup(self, key: int) -> tuple[Group | None, int]:
        """The live group holding the tensor with id ``key`` and its slot (``None, -1``)."""
        entry = self.written.get(key)
        if entry is None:
            return None, -1
        return self.owners[entry](), self.slots[entry]

    def drop(self, group: Group) -> None:
        for t in group.members or ():
            entry = self.written.get(id(t))
            if entry is not None and self.owners[entry] is group.ref:
                del self.written[id(t)]


class Group:
    """Tensors written together (pickled as a private ``PackedTensor``, see the module docs).

    Holds its members until its first write and only weak references after it, so that
    neither a long-lived pickler's memo nor this module keeps media alive."""

    __slots__ = ("__weakref__", "cls", "dtype", "members", "op", "ref", "refs", "shareable")

    def __init__(
        self,
        op: PickleOp,
        members: list[torch.Tensor],
        cls: type[PackedTensor],
        dtype: torch.dtype | None = None,
    ) -> None:
        self.cls = cls  # a group unpickles as a legacy value of this class
        self.dtype = dtype  # the members' one dtype, when planning saw that they share it
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
        needed = THREADS.needed(self)
        n = len(self)
        if needed is None and self.members is not None:
            members: list[torch.Tensor | None] = list(self.members)  # the usual first write
        else:
            members = [self.member(j) if needed is None or j in needed else None for j in range(n)]
        if needed is not None and len(needed) < n:
            self.shareable = False  # this pickler's memo now holds a partial copy
        if self.members is not None:  # written: keep weak references only
            self.refs = list(map(weakref.ref, self.members))
            self.members = None
        proto = protocol if isinstance(protocol, int) else 2
        if self.dtype is not None and len(members) == n and needed is None:
            payload = encode_one_dtype(members, self.dtype, proto)  # type: ignore[arg-type]
        else:
            payload = encode_group(members, proto)
        state = {STATE_KEY: 1, "group": payload}
        # a group unpickles as a legacy PackedTensor
        return (copyreg._reconstructor, (self.cls, object, None), state)  # type: ignore[attr-defined]


class Plan:
    """How one value's segments are written: the segments tuple of its state, the group of
    its own new tensors (if any), the operation that group joined, and which slots of each
    referenced group it needs (``None`` = all, for its own)."""

    __slots__ = ("cls", "fresh", "needs", "op", "own", "segments", "shares")

    def __init__(
        self,
        cls: type[PackedTensor],
        segments: tuple[Any, ...],
        own: Group | None,
        op: PickleOp | None,
        needs: dict[int, tuple[weakref.ref[Group], frozenset[int] | None]],
        shares: bool,
        fresh: bool,
    ) -> None:
        self.cls = cls
        self.segments = segments
        self.own = own
        self.op = op
        self.needs = needs
        self.shares = shares  # references groups of earlier values
        self.fresh = fresh  # its own group started a new operation


def plan_segments(tensors: list[Any], op: PickleOp | None, cls: type[PackedTensor]) -> Plan:
    """How ``tensors`` are written under ``op``; new groups unpickle as ``cls``."""
    ids = list(map(id, tensors))
    if op is not None and op.written and not op.written.keys().isdisjoint(ids):
        return _plan_sharing(tensors, ids, op, op, cls)
    n = len(tensors)
    # The usual value: distinct plain CPU tensors of one dtype, all written into one group of
    # its own.
    if n and len(set(ids)) == n:
        dtype = one_dtype_if_bufferable(tensors)
        if dtype is not None:
            codes: Any = np.zeros(n, dtype="<i8")
            pos: Any = np.arange(n, dtype="<i8")
            return _own_plan(cls, list(tensors), op, 0, [None], [], codes, pos, {}, dtype)
    return _plan_sharing(tensors, ids, op, None, cls)


def _plan_sharing(
    tensors: list[Any],
    ids: list[int],
    op: PickleOp | None,
    shared: PickleOp | None,
    cls: type[PackedTensor],
) -> Plan:
    """The general plan: ``None`` slots, repeated tensors, tensors that groups of ``shared``
    (this operation, when some of its groups may hold them) already hold, and tensors that
    cannot go into a group."""
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
        key = ids[i]
        hit = seen.get(key)
        if hit is None:
            # a group of this operation holding t: alive, not written partly, and t itself
            # (not a new tensor that reuses the id of a dead one)
            group, j = shared.lookup(key) if shared is not None else (None, -1)
            if group is not None and group.shareable:
                members = group.members
                member = members[j] if members is not None else group.refs[j]()  # type: ignore[index]
                if member is not t:
                    group = None
            else:
                group = None
            if group is not None:
                k = group_slot.get(id(group))
                if k is None:
                    k = group_slot[id(group)] = len(groups)
                    groups.append(group)
                    slots[k] = set()
                slots[k].add(j)
                hit = (k, j)
            elif bufferable(t):
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
    needs: dict[int, tuple[weakref.ref[Group], frozenset[int] | None]] = {
        id(groups[k]): (groups[k].ref, frozenset(s)) for k, s in slots.items()
    }
    return _own_plan(cls, own_members, op, own_slot, groups, others, codes, pos, needs)


def _own_plan(
    cls: type[PackedTensor],
    own_members: list[torch.Tensor],
    op: PickleOp | None,
    own_slot: int,
    groups: list[Any],
    others: list[Any],
    codes: Any,
    pos: Any,
    needs: dict[int, tuple[weakref.ref[Group], frozenset[int] | None]],
    dtype: torch.dtype | None = None,
) -> Plan:
    """The plan, once the value's own new tensors (``own_members``, slot ``own_slot`` of
    ``groups``) are known: they become a group that joins ``op`` (a new one if ``None``)."""
    shares = len(needs) > 0
    own = None
    fresh = False
    if own_members:
        if op is None:
            op = PickleOp()
            fresh = True
        own = groups[own_slot] = Group(op, own_members, cls, dtype)
        op.add(own)
        needs[id(own)] = (own.ref, None)
    segments = (SEGMENTS_FORMAT, i64_bytes(codes), i64_bytes(pos), groups, others)
    return Plan(cls, segments, own, op, needs, shares, fresh)


def _dead() -> None:
    return None


class ThreadState(threading.local):
    """This thread's current operation, what the value being written needs, and the value
    whose ``__reduce_ex__`` ran last until its pickler writes the class global (or not)."""

    def __init__(self) -> None:
        self.op: Callable[[], PickleOp | None] = _dead
        self.needs: dict[int, tuple[weakref.ref[Group], frozenset[int] | None]] = {}
        self.pending: tuple[Any, ...] | None = None

    def begin_value(
        self, value: PackedTensor, state: dict[str, Any], plan: Plan, op: PickleOp | None
    ) -> None:
        self.needs = plan.needs
        if plan.op is not op:
            self.op = weakref.ref(plan.op) if plan.op is not None else _dead
        # Re-planning needs the value and its state only when it shares with earlier values.
        if plan.shares:
            self.pending = (plan, weakref.ref(value), state)
        else:
            self.pending = (plan, None, None)

    def needed(self, group: Group) -> frozenset[int] | None:
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
                plan.own.op = op = PickleOp()
                op.add(plan.own)
                self.op = weakref.ref(op)
            return
        value = value_ref() if value_ref is not None else None
        if value is None or state is None:
            return
        if plan.own is not None:
            plan.own.op.drop(plan.own)
        fresh = plan_segments(value.tensors, None, plan.cls)
        state["segments"] = fresh.segments
        self.needs = fresh.needs
        self.op = weakref.ref(fresh.op) if fresh.op is not None else _dead


THREADS = ThreadState()
