"""The bytes of a group: the tensors one pickle writes together, one buffer per dtype.

A group's state is ``("mmpack.group/1", dtypes, ranks, dims, buffers)`` (see
``mmpack.packed.pickling.format`` for the whole format): member ``j`` has dtype
``buffers[dtypes[j]][0]`` and the shape made of the next ``ranks[j]`` values of ``dims`` (all
three little-endian int64 bytes); ``buffers`` is a list of ``(dtype name, bytes)``, the bytes of
every member of that dtype back to back in C order, a ``PickleBuffer`` under protocol 5.
:func:`encode_group` writes it, :func:`decode_group` reads it back as views of one writable
buffer per dtype.
"""

from __future__ import annotations

import itertools
import math
import operator
import pickle
from typing import Any

import numpy as np
import torch
from torch._utils import _flatten_dense_tensors

from mmpack._native import LayoutError
from mmpack.packed.buffers import BUFFER_DTYPES, DTYPES_BY_NAME, i64_bytes
from mmpack.packed.pickling.restore_charge import charge
from mmpack.packed.state import corrupt

__all__ = ["GROUP_FORMAT", "decode_group", "encode_group", "encode_one_dtype", "i64_array"]

GROUP_FORMAT = "mmpack.group/1"
_SHAPE = operator.attrgetter("shape")
_DTYPE = operator.attrgetter("dtype")
# What decoding builds, charged to a restricted load's budget first: per member (a tensor view
# and its shape; measured 115-600 bytes), per shape value, per buffer (its tensor, its dtype view
# and its member list).
_MEMBER_COST = 640
_DIM_COST = 48
_BUFFER_COST = 2048


def i64_array(data: Any) -> np.ndarray:
    """Little-endian int64 bytes of a table as an int64 array."""
    return np.frombuffer(data, dtype="<i8").astype(np.int64, copy=False)


# ---------------------------------------------------------------------------------------------
# writing


def encode_group(members: list[torch.Tensor | None], protocol: int) -> Any:
    """The group state of ``members``; a ``None`` member is written as an empty 1-d tensor (a
    placeholder that no value of the payload references)."""
    n = len(members)
    if n and type(None) not in map(type, members):
        kinds = set(map(_DTYPE, members))
        if len(kinds) == 1:
            return encode_one_dtype(members, kinds.pop(), protocol)  # type: ignore[arg-type]
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
        buffers.append((BUFFER_DTYPES[dtype], buf))
    return (GROUP_FORMAT, i64_bytes(dtypes), i64_bytes(ranks), i64_bytes(dims), buffers)


def encode_one_dtype(members: list[torch.Tensor], dtype: torch.dtype, protocol: int) -> Any:
    """``encode_group`` for members of one dtype, none missing (the usual group)."""
    shapes = list(map(_SHAPE, members))
    ranks = list(map(len, shapes))
    dims = list(itertools.chain.from_iterable(shapes))
    flat = _cat_leading(members) if 0 not in ranks else None
    if flat is None:
        flat = _flatten_dense_tensors(members)
    arr: Any = flat.reshape(-1).view(torch.uint8).numpy()
    buf: Any = pickle.PickleBuffer(arr) if protocol >= 5 else arr.tobytes()
    zeros = np.zeros(len(members), dtype="<i8").tobytes()
    return (GROUP_FORMAT, zeros, i64_bytes(ranks), i64_bytes(dims), [(BUFFER_DTYPES[dtype], buf)])


def _cat_leading(members: list[torch.Tensor]) -> torch.Tensor | None:
    """The members' bytes back to back, when they differ only in their leading size: one
    ``torch.cat`` along it, without a flat view of each (``None`` when cat refuses the shapes
    or lays its result out otherwise). Where cat joins, its contiguous result holds exactly
    the members' bytes in order: the 1-d empty tensors it also accepts add none."""
    try:
        flat = torch.cat(members)
    except RuntimeError:
        return None
    return flat if flat.is_contiguous() else None


# ---------------------------------------------------------------------------------------------
# reading


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
        raise corrupt("its shape table does not match its buffer")


def _writable_bytes(buf: Any) -> Any:
    """A writable buffer holding ``buf``'s bytes (``torch.frombuffer`` warns on read-only)."""
    view = memoryview(buf)
    if view.readonly:
        return bytearray(view)
    return buf


def decode_group(payload: Any) -> list[Any]:
    """The members of a group state, as views of one writable buffer per dtype."""
    fmt, dtypes, ranks, dims, buffers = payload
    if fmt != GROUP_FORMAT:
        raise LayoutError(f"unknown PackedTensor pickle format {fmt!r}")
    dtypes_a, ranks_a, dims_a = i64_array(dtypes), i64_array(ranks), i64_array(dims)
    if (
        len(dtypes_a) != len(ranks_a)
        or (ranks_a < 0).any()
        or int(ranks_a.sum()) != len(dims_a)
        or (dims_a < 0).any()
        or (len(dtypes_a) and not 0 <= int(dtypes_a.min()) <= int(dtypes_a.max()) < len(buffers))
    ):
        raise corrupt("inconsistent tensor tables")
    copied = sum(memoryview(buf).nbytes for _, buf in buffers if memoryview(buf).readonly)
    tables = _MEMBER_COST * len(dtypes_a) + _DIM_COST * len(dims_a)
    charge(tables + _BUFFER_COST * len(buffers) + copied, "a PackedTensor group")
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
    dtype = DTYPES_BY_NAME.get(name) if isinstance(name, str) else None
    if dtype is None:  # only the dtypes a group writes (no quantized or float8 storage)
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
        raise corrupt("its shape table does not match its buffer")
    return list(base.view((-1, *rest.tolist())).split(sizes))
