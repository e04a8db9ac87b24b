"""Small segments in a value's own bytes: what the object-store path sends inline, as plain Ray
does, instead of one object each (a put, a reference to serialize and count, and a pull would
cost more than their bytes). :class:`Inline` writes a value's inline segments as one buffer per
dtype and unpickles as the plain list of them; values pickled together by one Ray
serialization share the tensors they share (:func:`written_so_far`, :func:`earlier_member`), as
plain Ray's values of one object do.
"""

from __future__ import annotations

import bisect
import itertools
import math
import operator
import pickle
import threading
import weakref
from typing import Any

import numpy as np
import torch

from mmpack.packed.buffers import BUFFER_DTYPES, DTYPES_BY_NAME, i64_bytes
from mmpack.packed.ray_store.chunks import MAX_NUMEL
from mmpack.packed.ray_store.counters import COUNTERS
from mmpack.packed.state import corrupt

__all__ = ["INLINE_BELOW", "INLINE_FORMAT", "Inline", "earlier_member", "written_so_far"]

#: Segments smaller than this travel in the value's own bytes, as plain Ray sends them: as an
#: object of their own they would cost more than their bytes (a put, a reference to serialize
#: and count, a pull; Ray itself passes task arguments under 100 KiB inline).
INLINE_BELOW = 64 * 1024
#: How a value's segments that travel in its own bytes are written: ``others`` of the segments
#: tuple pickles as ``(INLINE_FORMAT, dtypes, ranks, dims, buffers, rest)`` and unpickles as the
#: plain list of the segments. Member ``j`` has dtype ``buffers[dtypes[j]][0]`` and the shape
#: made of the next ``ranks[j]`` values of ``dims`` (all three little-endian int64 bytes);
#: ``buffers`` is a list of ``(dtype name, bytes)``, the members of that dtype back to back in C
#: order; the segments of ``rest`` (anything but a plain CPU tensor) follow the members.
INLINE_FORMAT = "mmpack.inline-segments/1"
_SHAPE = operator.attrgetter("shape")
_DTYPE = operator.attrgetter("dtype")
_NUMEL = torch.Tensor.numel


class Inline:
    """A value's segments that travel in its own bytes (see :data:`INLINE_FORMAT`): the plain
    CPU tensors ``packed`` as one buffer per dtype, then ``rest`` as they are. Unpickles as the
    plain list of them (the ``others`` of the segments tuple), one writable tensor per member."""

    __slots__ = ("__weakref__", "packed", "rest")

    def __init__(self, packed: list[torch.Tensor], rest: list[Any]) -> None:
        self.packed = packed
        self.rest = rest
        _OPS.add(self)

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        proto = protocol if isinstance(protocol, int) else 2
        return (_inline_segments, (INLINE_FORMAT, *_pack(self.packed, proto), self.rest))


class _Member:
    """Member ``j`` of an earlier value's :class:`Inline` of the same pickling: unpickles as
    that very tensor (the pickle memo writes the pack once), so values sent together share
    their small segments, as plain Ray's values of one object share the tensors they share."""

    __slots__ = ("j", "pack")

    def __init__(self, pack: Inline, j: int) -> None:
        self.pack = pack
        self.j = j

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        return (operator.getitem, (self.pack, self.j))


class _Ops(threading.local):
    """The :class:`Inline` s this thread's running Ray serialization wrote so far: ``at`` maps
    the id of each member to its place in them all (plain ints: tens of thousands of members
    must not feed the garbage collector), ``starts`` where each pack's members begin. A
    pickler's memo keeps what it wrote alive until its pickling ends, so a pack that died
    belongs to a pickling that is over (and so do all the packs noted with it)."""

    def __init__(self) -> None:
        self.at: dict[int, int] = {}
        self.packs: list[weakref.ref[Inline]] = []
        self.starts: list[int] = []
        self.indexed = 0  # packs whose members ``at`` holds: indexed when a later value asks
        self.size = 0

    def current(self) -> dict[int, int]:
        """``at`` for the running pickling, with every pack noted so far in it."""
        packs = self.packs
        if packs and packs[0]() is None:
            self.at, self.packs, self.starts, self.indexed, self.size = {}, [], [], 0, 0
            return self.at
        while self.indexed < len(packs):
            pack = packs[self.indexed]()
            if pack is not None:
                start = self.starts[self.indexed]
                self.at.update(zip(map(id, pack.packed), itertools.count(start), strict=False))
            self.indexed += 1
        return self.at

    def add(self, pack: Inline) -> None:
        if not pack.packed:
            return
        if self.packs and self.packs[0]() is None:
            self.at, self.packs, self.starts, self.indexed, self.size = {}, [], [], 0, 0
        self.packs.append(weakref.ref(pack))
        self.starts.append(self.size)
        self.size += len(pack.packed)

    def member(self, written: dict[int, int], t: Any) -> _Member | None:
        at = written.get(id(t)) if written else None
        if at is None:
            return None
        k = bisect.bisect_right(self.starts, at) - 1
        pack = self.packs[k]() if 0 <= k < len(self.packs) else None
        j = at - self.starts[k] if pack is not None else -1
        if pack is None or j >= len(pack.packed) or pack.packed[j] is not t:
            return None  # a pack of a pickling that is over
        return _Member(pack, j)


_OPS = _Ops()


def written_so_far() -> dict[int, int]:
    """The members this thread's running Ray serialization wrote inline so far, by tensor id."""
    return _OPS.current()


def earlier_member(written: dict[int, int], t: Any) -> Any:
    """``t`` as a member an earlier value of the running serialization wrote inline (it
    unpickles as that very tensor), or ``None``."""
    return _OPS.member(written, t)


def _pack(members: list[torch.Tensor], protocol: int) -> tuple[bytes, bytes, bytes, list[Any]]:
    """The tables and buffers of :data:`INLINE_FORMAT` for ``members`` (plain CPU tensors)."""
    kinds = list(map(_DTYPE, members))
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    if len(set(kinds)) == 1:
        groups[kinds[0]] = members
        slots = bytes(8 * len(members))  # every member in buffer 0
    else:
        index: dict[torch.dtype, int] = {}
        at = []
        for t, dtype in zip(members, kinds, strict=True):
            g = index.get(dtype)
            if g is None:
                g = index[dtype] = len(groups)
                groups[dtype] = []
            groups[dtype].append(t)
            at.append(g)
        slots = i64_bytes(at)
    buffers = []
    for dtype, parts in groups.items():
        arr: Any = _flat(parts).view(torch.uint8).numpy()
        buf: Any = pickle.PickleBuffer(arr) if protocol >= 5 else arr.tobytes()
        buffers.append((BUFFER_DTYPES[dtype], buf))
        COUNTERS.inline_bytes += arr.nbytes
    shapes = list(map(_SHAPE, members))
    ranks = i64_bytes(list(map(len, shapes)))
    dims = i64_bytes(list(itertools.chain.from_iterable(shapes)))
    return slots, ranks, dims, buffers


def _flat(parts: list[torch.Tensor]) -> torch.Tensor:
    """The bytes of ``parts`` back to back in C order, as one flat tensor: one ``torch.cat``
    when they differ only in their leading size (where cat joins, its contiguous result holds
    exactly the parts' elements in order)."""
    total = sum(map(_NUMEL, parts))
    try:
        flat: torch.Tensor | None = torch.cat(parts)
    except RuntimeError:  # other trailing shapes, or 0-d parts
        flat = None
    if flat is None or not flat.is_contiguous() or flat.numel() != total:
        flat = torch.cat([p.reshape(-1) for p in parts])
    return flat.reshape(-1)


def _inline_segments(
    fmt: Any, dtypes: Any, ranks: Any, dims: Any, buffers: Any, rest: Any
) -> list[Any]:
    """The segments an :class:`Inline` wrote: a writable tensor per member (views of one
    private buffer per dtype), then ``rest``."""
    if fmt != INLINE_FORMAT or not isinstance(buffers, list) or not isinstance(rest, list):
        raise corrupt(f"unknown or inconsistent inline segments {fmt!r}")
    try:
        members = _unpack(dtypes, ranks, dims, buffers)
    except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
        raise corrupt(f"inline segments: {type(exc).__name__}: {exc}") from None
    return members + rest


def _unpack(dtypes: Any, ranks: Any, dims: Any, buffers: list[Any]) -> list[Any]:
    slots_a = np.frombuffer(dtypes, dtype="<i8")
    ranks_a = np.frombuffer(ranks, dtype="<i8")
    dims_a = np.frombuffer(dims, dtype="<i8")
    n = len(ranks_a)
    if (
        len(slots_a) != n
        or (ranks_a < 0).any()
        or int(ranks_a.sum()) != len(dims_a)
        or (dims_a < 0).any()
        or (n and not 0 <= int(slots_a.min()) <= int(slots_a.max()) < len(buffers))
    ):
        raise corrupt("inconsistent inline segment tables")
    bases = [_writable_base(name, buf) for name, buf in buffers]
    r = int(ranks_a[0]) if n else 0
    if len(bases) == 1 and r >= 1 and (ranks_a == r).all():
        table = dims_a.reshape(n, r)
        trailing = table[0, 1:].tolist()
        row = math.prod(trailing)
        if row and (table[:, 1:] == table[0, 1:]).all():  # differ in their leading size only
            sizes = table[:, 0].tolist()
            if sum(sizes) * row != bases[0].numel():
                raise corrupt("inline segments: the shape table does not match the buffer")
            return list(bases[0].view(-1, *trailing).split(sizes))
    out: list[Any] = [None] * n
    at = [0] * len(bases)
    ranks_l, dims_l, slots_l = ranks_a.tolist(), dims_a.tolist(), slots_a.tolist()
    k = 0
    for j in range(n):
        shape = tuple(dims_l[k : k + ranks_l[j]])
        k += ranks_l[j]
        if math.prod(d for d in shape if d) >= MAX_NUMEL:
            raise corrupt("inline segments: a shape too large to allocate")
        b = slots_l[j]
        start = at[b]
        at[b] = end = start + math.prod(shape)
        if end > bases[b].numel():
            raise corrupt("inline segments: the shape table does not match the buffer")
        out[j] = bases[b][start:end].view(shape)
    if any(end != base.numel() for end, base in zip(at, bases, strict=True)):
        raise corrupt("inline segments: the shape table does not match the buffer")
    return out


def _writable_base(name: Any, buf: Any) -> torch.Tensor:
    """One buffer of inline segments as a flat tensor of its dtype, over writable bytes (a copy
    of a read-only buffer: the segments are the receiver's own)."""
    dtype = DTYPES_BY_NAME.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise corrupt(f"inline segments name an unknown dtype {name!r}")
    view = memoryview(buf)
    data: Any = bytearray(view) if view.readonly else buf
    nbytes = memoryview(data).nbytes
    if nbytes % dtype.itemsize:
        raise corrupt("inline segments: a buffer is not a whole number of its dtype's elements")
    if nbytes == 0:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(data, dtype=torch.uint8).view(dtype)
