"""Materialization of packed media: what ``PackedTensor.as_tensor`` and ``PackedBatch.to`` run.

Two paths, one result:

* **CPU, native gather.** The logical segments (physical segments repeated by the row mapping)
  are copied by ``mmpack._native.gather_into`` straight into one preallocated output buffer
  (``out=``, or a new one, pinned when asked), with the GIL released and the copy spread over
  rayon's threads. Each physical segment is made contiguous (and padded, with
  ``pad_to_max_shape``) once, however many rows reference it. Packing along a non-leading
  dimension is the same gather repeated per index of the leading dimensions.
* **To a CUDA device.** Each unique physical segment crosses the bus once: CPU segments are
  gathered (natively) into one pinned staging buffer per dtype, copied with
  ``non_blocking=True``, and become views of the device buffer; rows are then expanded on the
  device by ``torch.cat`` over those views. Host-to-device bytes equal the physical bytes, not the
  logical ones.

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
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from mmpack import _native
from mmpack.errors import OutBufferError, PinMemoryUnavailableError, SegmentMismatchError

__all__ = [
    "TransferCounters",
    "as_tensor",
    "move_segments",
    "transfer_counters",
]

DeviceLike = torch.device | str | int

#: From this many referenced physical segments on, the CPU path first compacts them with one
#: ``torch.cat`` and gathers byte ranges of that buffer (per-segment numpy views cost ~2 us
#: each in Python, which dominates when segments are many and small).
COMPACT_MIN_SEGMENTS = 64


@dataclass
class TransferCounters:
    """Host-to-device traffic of ``move_segments`` since the process started (or the last
    ``reset``): bytes that crossed through pinned staging buffers, and how many copies."""

    staged_bytes: int = 0
    staged_copies: int = 0
    direct_bytes: int = 0
    direct_copies: int = 0

    def reset(self) -> None:
        self.staged_bytes = self.staged_copies = self.direct_bytes = self.direct_copies = 0

    @property
    def total_bytes(self) -> int:
        return self.staged_bytes + self.direct_bytes


_COUNTERS = TransferCounters()
_COUNTERS_LOCK = threading.Lock()


def transfer_counters() -> TransferCounters:
    """The process-wide host-to-device counters (a live object; call ``reset()`` to zero)."""
    return _COUNTERS


# ---------------------------------------------------------------------------------------------
# device moves


def _is_plain_cpu(t: Any) -> bool:
    return (
        type(t) is torch.Tensor
        and t.is_cpu
        and t.layout == torch.strided
        and not t.is_nested  # a strided nested tensor has no flat shape or byte view
        and not t.requires_grad
        and not t.is_quantized
        and not t.is_conj()
        and not t.is_neg()
    )


def _byte_view(t: torch.Tensor) -> np.ndarray:
    """A 1-D ``uint8`` numpy view of a contiguous CPU tensor's bytes (no copy)."""
    if t.numel() == 0:
        return np.empty(0, dtype=np.uint8)
    if t.dim() != 1:
        t = t.reshape(-1)
    if t.stride(0) != 1:  # a contiguous tensor of one element may carry any stride
        t = t.as_strided((t.numel(),), (1,))
    if t.dtype != torch.uint8:
        t = t.view(torch.uint8)
    return t.numpy().reshape(-1)


def _gather_bytes(
    out: torch.Tensor, sources: Sequence[torch.Tensor], order: np.ndarray, outer: int
) -> None:
    if out.numel() == 0:
        return
    views = [_byte_view(s) for s in sources]
    _native.gather_into(_byte_view(out), views, order, outer)


def _stage(
    segs: Sequence[torch.Tensor], target: torch.device, *, non_blocking: bool, pin_memory: bool
) -> list[torch.Tensor]:
    """Copy same-dtype CPU tensors into one (pinned) staging buffer with the native gather,
    move that buffer to ``target`` in one copy, and return views of it shaped like ``segs``."""
    contiguous = [s.contiguous() for s in segs]
    numels = [c.numel() for c in contiguous]
    staging = torch.empty(sum(numels), dtype=segs[0].dtype, pin_memory=pin_memory)
    _gather_bytes(staging, contiguous, np.arange(len(segs), dtype=np.int64), 1)
    # with pinned memory, the caching host allocator keeps `staging` alive until the copy ran
    on_device = staging.to(target, non_blocking=non_blocking)
    views = []
    offset = 0
    for c, n in zip(contiguous, numels, strict=True):
        views.append(on_device[offset : offset + n].view(c.shape))
        offset += n
    return views


def move_segments(
    tensors: Sequence[Any], device: DeviceLike, *, non_blocking: bool = True
) -> list[Any]:
    """Move every non-``None`` entry of ``tensors`` to ``device``; returns a new list.

    To a CUDA device, plain CPU tensors (no autograd, strided, not quantized) cross once per
    unique object: they are gathered natively into one pinned staging buffer per dtype, copied
    with ``non_blocking``, and come back as views of the device buffer. Every other entry moves
    with ``entry.to(device)`` (as NeMo-RL does, so a non-tensor entry without ``.to`` raises
    ``AttributeError``); ``non_blocking`` applies only towards CUDA, since a non-blocking copy to
    the host can return before the data has arrived. The same object listed twice moves once,
    and both slots receive the same moved tensor.
    """
    target = torch.device(device)
    to_cuda = target.type == "cuda"
    if to_cuda and target.index is None:
        target = torch.device("cuda", torch.cuda.current_device())
    nb = non_blocking and to_cuda
    moved: dict[int, Any] = {}
    staged: dict[torch.dtype, list[torch.Tensor]] = {}
    direct_bytes = 0
    direct_copies = 0
    for t in tensors:
        if t is None or id(t) in moved:
            continue
        if to_cuda and _is_plain_cpu(t) and t.numel() > 0:
            staged.setdefault(t.dtype, []).append(t)
            moved[id(t)] = None  # filled below
            continue
        if isinstance(t, torch.Tensor) and t.device != target:
            if t.is_meta:  # torch: NotImplementedError("Cannot copy out of meta tensor")
                raise SegmentMismatchError(
                    f"a segment on the meta device has no data to move to {target}"
                )
            direct_copies += 1
            direct_bytes += t.numel() * t.element_size()
        moved[id(t)] = t.to(target, non_blocking=nb)
    staged_bytes = 0
    for segs in staged.values():
        views = _stage(segs, target, non_blocking=nb, pin_memory=True)
        for seg, view in zip(segs, views, strict=True):
            moved[id(seg)] = view
            staged_bytes += view.numel() * view.element_size()
    if staged or direct_copies:
        with _COUNTERS_LOCK:
            _COUNTERS.staged_bytes += staged_bytes
            _COUNTERS.staged_copies += len(staged)
            _COUNTERS.direct_bytes += direct_bytes
            _COUNTERS.direct_copies += direct_copies
    return [None if t is None else moved[id(t)] for t in tensors]


# ---------------------------------------------------------------------------------------------
# materialization


def _torch_path(
    logical: list[Any], dim_to_pack: int, pad_to_max_shape: bool, device: DeviceLike | None
) -> torch.Tensor:
    """NeMo-RL's ``as_tensor`` after the device move and the None filter: the reference
    semantics, used for everything the native gather does not cover."""
    if pad_to_max_shape:
        logical = _padded(logical, dim_to_pack)
    return torch.cat(logical, dim=dim_to_pack).to(device)


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
    pack_dim = dim_to_pack if dim_to_pack >= 0 else rank + dim_to_pack
    if not 0 <= pack_dim < rank:
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


def _check_no_overlap(out: torch.Tensor, sources: Sequence[torch.Tensor]) -> None:
    if out.numel() == 0:
        return
    base = out.untyped_storage().data_ptr()
    for s in sources:
        if s.numel() and s.untyped_storage().data_ptr() == base:
            raise OutBufferError(
                "out= shares memory with a segment being materialized; "
                "the output cannot overlap its inputs"
            )


#: Outputs at least this large are allocated through numpy, which asks the kernel for
#: transparent huge pages (``madvise``) on large arrays; first-touch page faults on a fresh
#: torch allocation otherwise cost more than the gather itself (measured 3x on this class of
#: machine for 80 MiB).
_NUMPY_ALLOC_MIN_BYTES = 4 << 20
_ALIGN = 64


def _empty(shape: Sequence[int], dtype: torch.dtype, pin_memory: bool) -> torch.Tensor:
    if not pin_memory:
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < _NUMPY_ALLOC_MIN_BYTES:
            return torch.empty(tuple(shape), dtype=dtype)
        raw = np.empty(nbytes + _ALIGN, dtype=np.uint8)
        skip = -raw.ctypes.data % _ALIGN
        flat = torch.from_numpy(raw[skip : skip + nbytes])
        return flat.view(dtype).view(tuple(shape))
    if not torch.cuda.is_available():
        raise PinMemoryUnavailableError(
            "pin_memory=True needs a CUDA device to pin host memory for, and torch reports none; "
            "call as_tensor() without pin_memory on this machine"
        )
    return torch.empty(tuple(shape), dtype=dtype, pin_memory=True)


def _finish_fallback(
    result: torch.Tensor, out: torch.Tensor | None, pin_memory: bool
) -> torch.Tensor:
    if out is not None:
        _check_out(out, result.shape, result.dtype, result.device)
        out.copy_(result)
        return out
    if pin_memory and result.is_cpu and not result.is_pinned():
        pinned = _empty(result.shape, result.dtype, True)
        pinned.copy_(result)
        return pinned
    return result


def _logical_order(n_physical: int, segment_indices: Any) -> np.ndarray:
    if segment_indices is None:
        return np.arange(n_physical, dtype=np.int64)
    return np.asarray(segment_indices, dtype=np.int64).reshape(-1)


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
    referenced_mask = np.zeros(n, dtype=bool)
    referenced_mask[order] = True
    referenced = np.flatnonzero(referenced_mask)
    remap = np.full(n, -1, dtype=np.int64)
    remap[referenced] = np.arange(referenced.size, dtype=np.int64)
    src_order = remap[order]
    segs: list[Any] = [tensors[i] for i in referenced.tolist()]

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
        result = _empty(out_shape, dtype, pin_memory)
    outer = math.prod(out_shape[:pack_dim])
    if result.numel() == 0:
        return result
    if len(segs) < COMPACT_MIN_SEGMENTS:
        _gather_bytes(result, [s.contiguous() for s in segs], src_order, outer)
        return result
    # Many segments: compact them into one buffer with one torch.cat (C++ loop, each physical
    # segment copied once), then gather byte ranges of it; one native view instead of one each.
    compact = torch.cat(segs, dim=pack_dim).contiguous()
    inner_bytes = math.prod(out_shape[pack_dim + 1 :]) * result.element_size()
    lens = shapes[:, pack_dim] * inner_bytes
    starts = np.cumsum(lens) - lens
    _native.gather_ranges_into(
        _byte_view(result),
        _byte_view(compact),
        starts,
        lens,
        src_order,
        outer,
        int(lens.sum()),
    )
    return result


def _native_plan(
    segs: Sequence[Any], dim_to_pack: int, pad_to_max_shape: bool
) -> tuple[int, np.ndarray, torch.dtype] | None:
    """``(pack_dim, shapes, dtype)`` when the native CPU gather reproduces ``torch.cat`` exactly
    for these (referenced, non-None) segments, else ``None``."""
    first = segs[0]
    if not _is_plain_cpu(first):
        return None
    dtype = first.dtype
    rank = first.dim()
    if rank == 0:
        return None
    for t in segs:
        if not _is_plain_cpu(t) or t.dtype != dtype or t.dim() != rank:
            return None
    pack_dim = dim_to_pack + rank if dim_to_pack < 0 else dim_to_pack
    if not 0 <= pack_dim < rank:
        return None
    shapes = np.fromiter(
        itertools.chain.from_iterable(t.shape for t in segs), dtype=np.int64, count=len(segs) * rank
    ).reshape(len(segs), rank)
    if not pad_to_max_shape:
        others = [d for d in range(rank) if d != pack_dim]
        if others and not (shapes[:, others] == shapes[0, others]).all():
            return None
    return pack_dim, shapes, dtype


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
    pack_dim = dim_to_pack + rank if dim_to_pack < 0 else dim_to_pack
    if not 0 <= pack_dim < rank:
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
    if not isinstance(dim_to_pack, int) or not -rank <= dim_to_pack < rank:
        return None
    pack = dim_to_pack % rank
    first = shapes[0]
    for s in shapes:
        if any(a != b for d, (a, b) in enumerate(zip(s, first, strict=True)) if d != pack):
            return (
                f"cannot concatenate segments of shapes {first} and {s} along "
                f"dim_to_pack={dim_to_pack}: every other dimension must match "
                "(or set pad_to_max_shape=True)"
            )
    return None
