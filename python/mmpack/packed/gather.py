"""Materialization of packed media: what ``PackedTensor.as_tensor`` runs.

Two paths, one result:

* **CPU, native gather.** The logical segments (physical segments repeated by the row mapping)
  are copied by ``mmpack._native.gather_into`` straight into one preallocated output buffer
  (``out=``, or a new one, pinned when asked), with the GIL released and the copy spread over
  rayon's threads. Each physical segment is made contiguous (and padded, with
  ``pad_to_max_shape``) once, however many rows reference it. Packing along a non-leading
  dimension is the same gather repeated per index of the leading dimensions.
* **To a CUDA device.** The segments first move with ``mmpack.packed.transfer.move_segments`` (each
  unique physical segment crosses the bus once, through pinned staging); rows are then expanded
  on the device by ``torch.cat`` over those views. Host-to-device bytes equal the physical
  bytes, not the logical ones.

Anything the native path does not cover exactly (tensors that need autograd, mixed dtypes or
devices, tensor subclasses, sparse or quantized layouts, rank-0 tensors, shape mismatches, an
invalid ``dim_to_pack``) goes through the plain torch path, which is NeMo-RL's own algorithm, so
results and errors stay NeMo-RL's, except that segments ``torch.cat`` cannot join (different
devices, ranks or non-packed sizes) raise :class:`~mmpack.errors.SegmentMismatchError` naming
them, a ``RuntimeError`` like torch's.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from mmpack import _native
from mmpack._coerce import pack_dim as pack_dim_of
from mmpack._native import PackedLayout
from mmpack.errors import OutBufferError, SegmentMismatchError
from mmpack.packed.transfer import (
    DeviceLike,
    byte_view,
    gather_bytes,
    host_buffer,
    is_plain_cpu,
    move_segments,
)

__all__ = [
    "COMPACT_MIN_SEGMENTS",
    "NOT_COVERED",
    "as_tensor",
    "as_tensor_from_store",
    "logical_nbytes",
    "padded_logical_nbytes",
    "segment_nbytes",
]

#: Below this many output bytes (or with a one-thread gather pool), plain CPU segments are joined
#: by one ``torch.cat``: the native gather's setup (~0.2 ms a call in Python) only pays off when
#: its parallel copy does (it runs in parallel from 1 MiB on, as the core's gather does).
SMALL_OUTPUT_BYTES = 1 << 20

#: From this many referenced physical segments on, the CPU path first compacts them with one
#: ``torch.cat`` and gathers byte ranges of that buffer (per-segment numpy views cost ~2 us
#: each in Python, which dominates when segments are many and small).
COMPACT_MIN_SEGMENTS = 64

_FIRST_ROW = np.zeros(1, dtype=np.int64)
_FIRST_ROW.flags.writeable = False


def as_tensor(
    tensors: list[Any],
    segment_indices: Any,
    dim_to_pack: int,
    pad_to_max_shape: bool,
    device: DeviceLike | None = None,
    *,
    out: torch.Tensor | None = None,
    pin_memory: bool = False,
) -> torch.Tensor | None:
    """Concatenate the logical segments of a packed value along ``dim_to_pack``.

    ``tensors`` is the physical segment list (``None`` = no media) and is **moved to ``device``
    in place** first, as NeMo-RL does (to CUDA through :func:`move_segments`, so every unique
    segment crosses once). ``segment_indices`` lists the physical segment of each logical one in
    row order (``None`` = legacy layout, one segment per row). Returns ``None`` when no logical
    segment is left after dropping ``None`` s (``out`` is then untouched).

    ``out``: a contiguous tensor of exactly the result's shape, dtype and device to write into
    (:class:`~mmpack.errors.OutBufferError` otherwise); the result is ``out`` itself.
    ``pin_memory``: allocate a CPU result in page-locked memory
    (:class:`~mmpack.errors.PinMemoryUnavailableError` without CUDA); it has no effect on a
    device result (device transfers always stage through pinned memory).
    """
    if device is not None:
        moved = move_segments(tensors, device, non_blocking=True)
        for i, item in enumerate(moved):
            if item is not None:
                tensors[i] = item  # in place, as NeMo-RL does (the list keeps its identity)
    if device is None and out is None and not pin_memory and not pad_to_max_shape:
        joined = _small_cpu_cat(tensors, segment_indices, dim_to_pack)
        if joined is not _NOT_SMALL:
            return joined
    n = len(tensors)
    order = _logical_order(n, segment_indices)
    if order.size and (order.min() < 0 or order.max() >= n):
        # Not reachable from a validated PackedTensor: index exactly like Python lists do.
        logical = [t for t in (tensors[int(i)] for i in order) if t is not None]
        if not logical:
            return None
        result = _torch_path(logical, dim_to_pack, pad_to_max_shape, device)
        return _finish_fallback(result, out, pin_memory)

    is_none = np.fromiter((t is None for t in tensors), dtype=bool, count=n)
    if is_none.any():
        order = order[~is_none[order]]
    if order.size == 0:
        return None
    segs, src_order = _compact(tensors, order)

    plan = _native_plan(segs, dim_to_pack, pad_to_max_shape)
    if plan is None:
        if all(isinstance(t, torch.Tensor) for t in segs):
            return _torch_tensor_path(
                segs, src_order, dim_to_pack, pad_to_max_shape, device, out, pin_memory
            )
        logical = [segs[j] for j in src_order.tolist()]
        result = _torch_path(logical, dim_to_pack, pad_to_max_shape, device)
        return _finish_fallback(result, out, pin_memory)

    pack_dim, shapes, dtype = plan
    if pad_to_max_shape:
        max_shape = shapes.max(axis=0)
        for j in np.flatnonzero((shapes != max_shape).any(axis=1)).tolist():
            segs[j] = F.pad(segs[j], _padding(segs[j].shape, max_shape.tolist(), pack_dim))
            shapes[j] = max_shape
            shapes[j, pack_dim] = segs[j].shape[pack_dim]
    out_shape = shapes[0].tolist()
    out_shape[pack_dim] = int(shapes[src_order, pack_dim].sum())
    if out is not None:
        result = _check_out(out, out_shape, dtype, torch.device("cpu"))
        _check_no_overlap(result, segs)
    else:
        result = host_buffer(out_shape, dtype, pin_memory)
    outer = math.prod(out_shape[:pack_dim])
    if result.numel() == 0:
        return result
    if len(segs) < COMPACT_MIN_SEGMENTS:
        gather_bytes(result, [s.contiguous() for s in segs], src_order, outer)
        return result
    # Many segments: compact them into one buffer with one torch.cat (C++ loop, each physical
    # segment copied once), then gather byte ranges of it; one native view instead of one each.
    compact = torch.cat(segs, dim=pack_dim).contiguous()
    inner_bytes = math.prod(out_shape[pack_dim + 1 :]) * result.element_size()
    lens = shapes[:, pack_dim] * inner_bytes
    starts = np.cumsum(lens) - lens
    _native.gather_ranges_into(
        byte_view(result),
        byte_view(compact),
        starts,
        lens,
        src_order,
        outer,
        int(lens.sum()),
    )
    return result


#: What :func:`as_tensor_from_store` returns for segments it does not gather itself.
NOT_COVERED: Any = object()


def as_tensor_from_store(
    segments: list[Any],
    segment_indices: Any,
    dim_to_pack: int,
    pad_to_max_shape: bool,
    out: torch.Tensor | None,
    pin_memory: bool,
) -> Any:
    """``as_tensor`` on the CPU of segments read in place from Ray's object store
    (``mmpack.packed.ray_store.StoreSegment``): the native gather copies the referenced bytes
    straight from the store into the output, the only copy. Returns :data:`NOT_COVERED` for what
    it does not reproduce exactly (padding, mixed dtypes or shapes, rank 0, segments that are
    not store views); the caller then works on private copies."""
    if pad_to_max_shape:
        return NOT_COVERED
    n = len(segments)
    order = _logical_order(n, segment_indices)
    if any(map(operator.is_, segments, itertools.repeat(None))):  # identity, never __eq__
        is_none = np.fromiter((s is None for s in segments), dtype=bool, count=n)
        order = order[~is_none[order]]
    if order.size == 0:
        return None
    segs, src_order = _compact(segments, order)
    if not all(getattr(kind, "read_in_place", False) is True for kind in set(map(type, segs))):
        return NOT_COVERED  # tensors among them (sent in-band): the caller's private path
    shapes = [s.shape for s in segs]
    rank = len(shapes[0])
    pack_dim = pack_dim_of(dim_to_pack, rank) if rank else None
    if pack_dim is None or len({s.dtype for s in segs}) != 1:
        return NOT_COVERED
    # one set of every shape without its packed size: equal ranks and equal other sizes
    if len({sh[:pack_dim] + sh[pack_dim + 1 :] + (len(sh),) for sh in shapes}) != 1:
        return NOT_COVERED
    sizes = np.fromiter((sh[pack_dim] for sh in shapes), dtype=np.int64, count=len(shapes))
    out_shape = list(shapes[0])
    out_shape[pack_dim] = int(sizes[src_order].sum())
    dtype = segs[0].dtype
    if out is not None:
        result = _check_out(out, out_shape, dtype, torch.device("cpu"))
    else:
        result = host_buffer(out_shape, dtype, pin_memory)
    if result.numel():
        outer = math.prod(out_shape[:pack_dim])
        _native.gather_into(byte_view(result), [s.array for s in segs], src_order, outer)
    return result


_NOT_SMALL: Any = object()


def _small_cpu_cat(tensors: list[Any], segment_indices: Any, dim_to_pack: int) -> Any:
    """``torch.cat`` of the logical segments when they are plain CPU tensors of one dtype and
    the output is small (or the gather pool has one thread): the result the native gather would
    give. ``_NOT_SMALL`` otherwise, and whenever ``torch.cat`` refuses them, so that the main
    path gives its own results and errors."""
    n = len(tensors)
    order = range(n) if segment_indices is None else np.asarray(segment_indices).tolist()
    # Stop at the first byte past the limit: a large output goes native without a full pass.
    limit = SMALL_OUTPUT_BYTES if _native.gather_threads() >= 2 else None
    logical = []
    dtype = None
    nbytes = 0
    for i in order:
        if not 0 <= i < n:
            return _NOT_SMALL
        t = tensors[i]
        if t is None:
            continue
        if not is_plain_cpu(t) or t.dim() == 0 or (dtype is not None and t.dtype != dtype):
            return _NOT_SMALL
        dtype = t.dtype
        nbytes += t.nbytes
        if limit is not None and nbytes >= limit:
            return _NOT_SMALL
        logical.append(t)
    if not logical:
        return None
    try:
        return torch.cat(logical, dim=dim_to_pack)
    except (RuntimeError, IndexError):
        return _NOT_SMALL


def _logical_order(n_physical: int, segment_indices: Any) -> np.ndarray:
    if segment_indices is None:
        return np.arange(n_physical, dtype=np.int64)
    return np.asarray(segment_indices, dtype=np.int64).reshape(-1)


def _compact(tensors: list[Any], order: np.ndarray) -> tuple[list[Any], np.ndarray]:
    """The physical segments ``order`` references, in first-reference order, and ``order``
    renumbered over them: the core's compaction (``PackedLayout.slice`` of a one-row layout)."""
    row = PackedLayout.build(len(tensors), np.array([0, order.size], dtype=np.int64), order)
    sub, segs = row.slice(tensors if type(tensors) is list else list(tensors), _FIRST_ROW)
    src_order = sub.indices()
    assert src_order is not None  # a slice is always a row mapping
    return segs, src_order


def _native_plan(
    segs: Sequence[Any], dim_to_pack: int, pad_to_max_shape: bool
) -> tuple[int, np.ndarray, torch.dtype] | None:
    """``(pack_dim, shapes, dtype)`` when the native CPU gather reproduces ``torch.cat`` exactly
    for these (referenced, non-None) segments, else ``None``."""
    first = segs[0]
    if not is_plain_cpu(first):
        return None
    dtype = first.dtype
    rank = first.dim()
    if rank == 0:
        return None
    for t in segs:
        if not is_plain_cpu(t) or t.dtype != dtype or t.dim() != rank:
            return None
    pack_dim = pack_dim_of(dim_to_pack, rank)
    if pack_dim is None:
        return None
    shapes = np.fromiter(
        itertools.chain.from_iterable(t.shape for t in segs), dtype=np.int64, count=len(segs) * rank
    ).reshape(len(segs), rank)
    if not pad_to_max_shape:
        others = [d for d in range(rank) if d != pack_dim]
        if others and not (shapes[:, others] == shapes[0, others]).all():
            return None
    return pack_dim, shapes, dtype


# ---------------------------------------------------------------------------------------------
# padding


def _padded(items: list[Any], dim_to_pack: int) -> list[Any]:
    """NeMo-RL's ``pad_to_max_shape`` step (its checks and messages): every item zero-padded to
    the largest size of each dimension but ``dim_to_pack``; an object listed twice is padded
    once."""
    ranks = {t.ndim for t in items}
    if len(ranks) != 1:
        raise ValueError(
            "pad_to_max_shape requires tensors with the same rank, "
            f"but received ranks {sorted(ranks)}"
        )
    rank = ranks.pop()
    pack_dim = pack_dim_of(dim_to_pack, rank)
    if pack_dim is None:
        raise IndexError(f"dim_to_pack={dim_to_pack} is invalid for tensors with rank {rank}")
    max_shape = [max(t.shape[d] for t in items) for d in range(rank)]
    padded: dict[int, Any] = {}
    out = []
    for t in items:
        p = padded.get(id(t))
        if p is None:
            p = padded[id(t)] = F.pad(t, _padding(t.shape, max_shape, pack_dim))
        out.append(p)
    return out


def _padding(shape: Sequence[int], max_shape: Sequence[int], pack_dim: int) -> list[int]:
    padding: list[int] = []
    for d in reversed(range(len(max_shape))):
        padding.extend((0, 0 if d == pack_dim else max_shape[d] - shape[d]))
    return padding


def logical_nbytes(
    tensors: Sequence[Any], csr: PackedLayout | None, dim_to_pack: int, pad_to_max_shape: bool
) -> int:
    """Bytes ``as_tensor`` materializes from ``tensors`` in the row order of ``csr`` (each
    segment once, in order, without one): every logical reference counts its segment's bytes;
    with ``pad_to_max_shape``, the padded bytes (unpadded when the segments cannot be padded,
    where ``as_tensor`` raises). O(segments)."""
    if pad_to_max_shape:
        if csr is None:
            refs = [0 if t is None else 1 for t in tensors]
        else:
            refs = csr.reference_counts(len(tensors)).tolist()
        return padded_logical_nbytes(tensors, refs, dim_to_pack)
    nbytes = [segment_nbytes(t) for t in tensors]
    return sum(nbytes) if csr is None else int(csr.logical_nbytes(nbytes))


def padded_logical_nbytes(tensors: Sequence[Any], refs: Sequence[int], dim_to_pack: int) -> int:
    """Bytes ``as_tensor`` materializes with ``pad_to_max_shape``: physical segment ``i``
    referenced ``refs[i]`` times, padded to the largest size of each dimension but
    ``dim_to_pack`` over the referenced segments (unpadded when they cannot be padded, where
    ``as_tensor`` raises)."""
    used = [t for t, c in zip(tensors, refs, strict=False) if c and t is not None]
    if not used:
        return 0
    ranks = {t.ndim for t in used}
    rank = next(iter(ranks))
    pack = pack_dim_of(dim_to_pack, rank)
    if len(ranks) != 1 or pack is None:
        # as_tensor raises here; count the unpadded bytes instead of failing a metric.
        return sum(c * segment_nbytes(t) for t, c in zip(tensors, refs, strict=False))
    max_shape = [max(t.shape[d] for t in used) for d in range(rank)]
    other = math.prod(s for d, s in enumerate(max_shape) if d != pack)
    total = 0
    for t, c in zip(tensors, refs, strict=False):
        if c and t is not None:
            total += c * int(t.shape[pack]) * other * int(t.element_size())
    return total


def segment_nbytes(t: Any) -> int:
    """Bytes of one segment (0 for ``None``; a tensor or a store view)."""
    return 0 if t is None else int(t.numel()) * int(t.element_size())


# ---------------------------------------------------------------------------------------------
# out= and the torch fallbacks


def _check_out(
    out: Any, shape: Sequence[int], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    if not isinstance(out, torch.Tensor):
        raise OutBufferError(f"out= must be a torch.Tensor, got {type(out).__name__}")
    if tuple(out.shape) != tuple(shape):
        raise OutBufferError(
            f"out= has shape {tuple(out.shape)} "
            f"but the materialized result has shape {tuple(shape)}"
        )
    if out.dtype != dtype:
        raise OutBufferError(
            f"out= has dtype {out.dtype} but the materialized result has dtype {dtype}"
        )
    if out.device != device:
        raise OutBufferError(
            f"out= is on device {out.device} but the materialized result is on {device}"
        )
    if not out.is_contiguous():
        raise OutBufferError("out= must be contiguous")
    if out.requires_grad:
        raise OutBufferError("out= must not require grad")
    return out


def _byte_range(t: torch.Tensor) -> tuple[int, int] | None:
    """The bytes ``[start, end)`` that ``t`` reads or writes (``None`` when it has no elements):
    its first element's address (storage data pointer plus storage offset) to one past its
    last, over its strides; for a layout without strides, its whole storage."""
    if t.numel() == 0:
        return None
    if t.layout != torch.strided or t.is_nested:
        storage = t.untyped_storage()
        return storage.data_ptr(), storage.data_ptr() + storage.nbytes()
    start = t.data_ptr()
    last = sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))
    return start, start + (last + 1) * t.element_size()


def _check_no_overlap(out: torch.Tensor, sources: Sequence[torch.Tensor]) -> None:
    """Refuse ``out`` when its bytes overlap those of a segment (two views of one buffer, or
    of one storage, overlap when their byte ranges do; disjoint views of one arena do not)."""
    out_range = _byte_range(out)
    if out_range is None:
        return
    lo, hi = out_range
    for s in sources:
        seg = _byte_range(s)
        if seg is not None and seg[0] < hi and lo < seg[1]:
            raise OutBufferError(
                f"out= shares memory with a segment being materialized (a {tuple(s.shape)} "
                f"segment at bytes [{seg[0]:#x}, {seg[1]:#x}), out= at [{lo:#x}, {hi:#x})); "
                "the output cannot overlap its inputs"
            )


def _finish_fallback(
    result: torch.Tensor, out: torch.Tensor | None, pin_memory: bool
) -> torch.Tensor:
    if out is not None:
        _check_out(out, result.shape, result.dtype, result.device)
        out.copy_(result)
        return out
    if pin_memory and result.is_cpu and not result.is_pinned():
        pinned = host_buffer(result.shape, result.dtype, True)
        pinned.copy_(result)
        return pinned
    return result


def _torch_path(
    logical: list[Any], dim_to_pack: int, pad_to_max_shape: bool, device: DeviceLike | None
) -> torch.Tensor:
    """NeMo-RL's ``as_tensor`` after the device move and the None filter: the reference
    semantics, used for everything the native gather does not cover."""
    if pad_to_max_shape:
        logical = _padded(logical, dim_to_pack)
    return torch.cat(logical, dim=dim_to_pack).to(device)


def _torch_tensor_path(
    segs: list[torch.Tensor],
    src_order: np.ndarray,
    dim_to_pack: int,
    pad_to_max_shape: bool,
    device: DeviceLike | None,
    out: torch.Tensor | None,
    pin_memory: bool,
) -> torch.Tensor:
    """Segments the native gather does not take (on a CUDA device, needing autograd, mixed
    dtypes, ...): NeMo-RL's checks, each physical segment padded once, then one ``torch.cat``
    of the logical list; on a device this expands the rows there. When ``torch.cat`` refuses
    segments on different devices or of mismatched shapes, the error is
    :class:`~mmpack.errors.SegmentMismatchError` naming them (diagnosed only then: checking
    every segment first would cost more than the concatenation)."""
    if pad_to_max_shape:
        segs = _padded(segs, dim_to_pack)
    logical = [segs[j] for j in src_order.tolist()]
    try:
        if out is not None:
            expected = _cat_shape(segs, src_order, dim_to_pack)
            if expected is not None and _same_device(segs):
                dtype = segs[0].dtype
                for t in segs[1:]:
                    dtype = torch.promote_types(dtype, t.dtype)
                _check_out(out, expected, dtype, segs[0].device)
                if segs[0].is_cpu:
                    _check_no_overlap(out, segs)
                torch.cat(logical, dim=dim_to_pack, out=out)
                return out
        result = torch.cat(logical, dim=dim_to_pack)
    except RuntimeError as exc:
        mismatch = _mismatch(segs, dim_to_pack)
        if mismatch is None:
            raise
        raise SegmentMismatchError(mismatch) from exc
    return _finish_fallback(result.to(device), out, pin_memory)


def _cat_shape(
    segs: Sequence[torch.Tensor], src_order: np.ndarray, dim_to_pack: int
) -> list[int] | None:
    rank = segs[0].dim()
    if rank == 0 or any(t.dim() != rank for t in segs):
        return None
    pack_dim = pack_dim_of(dim_to_pack, rank)
    if pack_dim is None:
        return None
    sizes = np.array([t.shape[pack_dim] for t in segs], dtype=np.int64)
    shape = list(segs[0].shape)
    shape[pack_dim] = int(sizes[src_order].sum())
    return shape


def _same_device(segs: Sequence[torch.Tensor]) -> bool:
    first = segs[0].device
    return all(s.device == first for s in segs)


def _mismatch(segs: Sequence[torch.Tensor], dim_to_pack: int) -> str | None:
    """Why ``torch.cat`` refuses these segments, if it is one of its device or shape rules
    (devices first; same rank; equal sizes except along ``dim_to_pack``). 1-D empty tensors
    are skipped, as ``torch.cat`` does; an invalid ``dim_to_pack`` and nested tensors (no flat
    shape) are left to ``torch.cat``'s own error."""
    if not _same_device(segs):
        devices = sorted({str(s.device) for s in segs})
        return (
            f"cannot concatenate segments on different devices {devices}; "
            "pass device= to as_tensor (or call .to(device)) to move them first"
        )
    if any(t.is_nested for t in segs):
        return None
    shapes = [tuple(t.shape) for t in segs if t.shape != (0,)]
    if not shapes:
        return None
    rank = len(shapes[0])
    if rank == 0 or any(len(s) != rank for s in shapes):
        return (
            f"cannot concatenate segments of ranks {sorted({len(s) for s in shapes})} along "
            f"dim_to_pack={dim_to_pack} (rank-0 tensors cannot be concatenated); "
            "pad_to_max_shape cannot pad a rank difference either"
        )
    pack = pack_dim_of(dim_to_pack, rank)
    if pack is None:
        return None
    first = shapes[0]
    for s in shapes:
        if any(a != b for d, (a, b) in enumerate(zip(s, first, strict=True)) if d != pack):
            return (
                f"cannot concatenate segments of shapes {first} and {s} along "
                f"dim_to_pack={dim_to_pack}: every other dimension must match "
                "(or set pad_to_max_shape=True)"
            )
    return None
