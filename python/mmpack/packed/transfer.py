"""Host memory and host-to-device moves of packed media: what ``PackedTensor.to`` and
``PackedBatch.to`` run, and the buffers ``mmpack.packed.gather`` writes into.

* :func:`move_segments` moves a list of segments to a device. Towards CUDA each unique plain CPU
  tensor crosses the bus once: same-dtype tensors are gathered (natively) into one pinned staging
  buffer, copied with ``non_blocking=True``, and come back as views of the device buffer, so
  host-to-device bytes equal the physical bytes. :func:`transfer_counters` counts that traffic.
* :func:`host_buffer` allocates a CPU output, page-locked on request
  (:class:`~mmpack.errors.PinMemoryUnavailableError` without CUDA).
* :func:`is_plain_cpu`, :func:`byte_view` and :func:`gather_bytes` are the byte-level view of
  tensors that the native gather (``mmpack._native.gather_into``) works on.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from mmpack import _native
from mmpack.errors import PinMemoryUnavailableError, SegmentMismatchError

__all__ = [
    "DeviceLike",
    "TransferCounters",
    "byte_view",
    "cast_floating",
    "casts",
    "gather_bytes",
    "host_buffer",
    "is_plain_cpu",
    "move_segments",
    "transfer_counters",
]

DeviceLike = torch.device | str | int


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


def _new_lock_in_child() -> None:
    # A fork while another thread held the lock would leave it held forever in the child.
    global _COUNTERS_LOCK
    _COUNTERS_LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_lock_in_child)


def transfer_counters() -> TransferCounters:
    """The process-wide host-to-device counters (a live object; call ``reset()`` to zero)."""
    return _COUNTERS


# ---------------------------------------------------------------------------------------------
# bytes of host tensors


def is_plain_cpu(t: Any) -> bool:
    """A CPU tensor whose bytes are its values: no autograd, subclass, quantization, sparse or
    nested layout, or lazy conjugate/negative bit."""
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


class _Bytes:
    """A tensor's bytes through numpy's array interface, keeping the tensor alive: a view made
    with ``Tensor.numpy()`` would mark the tensor's storage unresizable for good."""

    __slots__ = ("__array_interface__", "tensor")

    def __init__(self, t: torch.Tensor) -> None:
        self.tensor = t
        self.__array_interface__ = {
            "data": (t.data_ptr(), False),
            "shape": (t.nbytes,),
            "typestr": "|u1",
            "version": 3,
        }


def casts(segments: Sequence[Any], dtype: torch.dtype) -> bool:
    """Whether :func:`cast_floating` would cast any of ``segments`` (store views included)."""
    return any(
        item is not None and item.is_floating_point() and item.dtype != dtype for item in segments
    )


def cast_floating(segments: Sequence[Any], dtype: torch.dtype) -> list[Any] | None:
    """``segments`` with every floating segment cast to ``dtype`` (integer segments and ``None``
    the same objects), or ``None`` when none needs a cast."""
    if not casts(segments, dtype):
        return None
    return [
        item if item is None or not item.is_floating_point() else item.to(dtype=dtype)
        for item in segments
    ]


def byte_view(t: torch.Tensor) -> np.ndarray:
    """A 1-D ``uint8`` numpy view of a contiguous CPU tensor's bytes (no copy)."""
    if t.numel() == 0:
        return np.empty(0, dtype=np.uint8)
    if not t.is_contiguous() or not t.is_cpu:
        raise ValueError("byte_view needs a contiguous CPU tensor")
    return np.asarray(_Bytes(t))


def gather_bytes(
    out: torch.Tensor, sources: Sequence[torch.Tensor], order: np.ndarray, outer: int
) -> None:
    """Write ``sources[order[0]], sources[order[1]], ...`` (contiguous CPU tensors) into
    ``out``, ``outer`` times interleaved, with the native gather."""
    if out.numel() == 0:
        return
    views = [byte_view(s) for s in sources]
    _native.gather_into(byte_view(out), views, order, outer)


#: Outputs at least this large are allocated through numpy, which asks the kernel for
#: transparent huge pages (``madvise``) on large arrays; first-touch page faults on a fresh
#: torch allocation otherwise cost more than the gather itself (measured 3x on this class of
#: machine for 80 MiB).
_NUMPY_ALLOC_MIN_BYTES = 4 << 20
_ALIGN = 64


def host_buffer(shape: Sequence[int], dtype: torch.dtype, pin_memory: bool) -> torch.Tensor:
    """An uninitialized CPU tensor, page-locked with ``pin_memory`` (which needs CUDA)."""
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


# ---------------------------------------------------------------------------------------------
# device moves


def _in_store(t: Any) -> bool:
    """A segment read in place from Ray's object store (``ray_store.StoreSegment``, which
    depends on this module, hence the marker rather than the class)."""
    return type(t) is not torch.Tensor and getattr(t, "read_in_place", False) is True


def _stage(
    segs: Sequence[Any], target: torch.device, *, non_blocking: bool, pin_memory: bool
) -> list[torch.Tensor]:
    """Copy same-dtype CPU tensors into one (pinned) staging buffer with the native gather,
    move that buffer to ``target`` in one copy, and return views of it shaped like ``segs``."""
    # store views (read in place from Ray's object store) are gathered from their bytes
    sources = [s.array if _in_store(s) else byte_view(s.contiguous()) for s in segs]
    shapes = [s.shape for s in segs]
    numels = [math.prod(shape) for shape in shapes]
    staging = torch.empty(sum(numels), dtype=segs[0].dtype, pin_memory=pin_memory)
    if staging.numel():
        order = np.arange(len(segs), dtype=np.int64)
        _native.gather_into(byte_view(staging), sources, order, 1)
    # with pinned memory, the caching host allocator keeps `staging` alive until the copy ran
    on_device = staging.to(target, non_blocking=non_blocking)
    views = []
    offset = 0
    for shape, n in zip(shapes, numels, strict=True):
        views.append(on_device[offset : offset + n].view(shape))
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
    staged: dict[torch.dtype, list[Any]] = {}
    direct_bytes = 0
    direct_copies = 0
    for t in tensors:
        if t is None or id(t) in moved:
            continue
        if _in_store(t):  # read-only store bytes: staged, or a private copy
            if to_cuda and t.numel() > 0:
                staged.setdefault(t.dtype, []).append(t)
                moved[id(t)] = None
            else:
                moved[id(t)] = t.private().to(target)
            continue
        if to_cuda and is_plain_cpu(t) and t.numel() > 0:
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
