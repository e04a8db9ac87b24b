"""Plain tensors through Ray's object store as out-of-band bytes.

Ray pickles a torch tensor the way ``pickle`` does: torch writes its storage with ``torch.save``
into an in-band byte string, which Ray then copies into the store (about 0.2 GB/s measured on
this project's machines). A numpy array Ray writes out of band, one copy straight into the store
(about 4 GB/s). Opt-in with ``install(accelerate=True)``, which sets this module's
``__reduce_ex__`` on ``torch.Tensor``: while Ray serializes a value (``ray_store.
serializing_for_ray``: a task or actor argument, a return value, ``ray.put``; a
``BatchedDataDict``'s token ids, lengths and masks among them), a plain CPU tensor laid out
contiguously over all of its storage is sent as a ``uint8`` view of its bytes with its dtype and
shape, and the receiver copies them into a fresh tensor, so nothing it returns aliases the
read-only store. What it receives is what torch's pickling gives: the same values, dtype, shape
and strides, a writable and resizable storage of its own, no autograd. The reduction is the
tensor's own, so the pickle's memo keeps one tensor object one object wherever it appears in the
value, as torch's does.

Every other tensor keeps torch's pickling: autograd, attributes or names, subclasses, other
devices, dtypes and layouts, conjugate or negative views, views into a larger storage (torch
sends the whole storage), strides other than the contiguous ones, empty tensors. Torch's
pickling keeps no storage shared between two tensors (each storage goes through its own
``torch.save``). A serializer registered with Ray for ``torch.Tensor`` (``register_serializer``,
Ray's zero-copy tensors) comes first, as it does for torch's reduction. Outside Ray's serializer
nothing changes. Every process that receives such a value needs mmpack importable, as it does
for mmpack's PackedTensor.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from mmpack.errors import CorruptPickleError
from mmpack.packed import ray_store
from mmpack.packed.buffers import BUFFER_DTYPES, bufferable
from mmpack.packed.transfer import byte_view

__all__ = ["accelerated_tensor_reduce", "tensor_from_bytes"]

_DTYPES = {name: dtype for dtype, name in BUFFER_DTYPES.items()}


def accelerated_tensor_reduce(original: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """The ``__reduce_ex__`` to set on ``torch.Tensor``, over torch's own (``original``)."""

    def __reduce_ex__(self: Any, protocol: Any) -> Any:
        if (
            type(self) is torch.Tensor
            and type(protocol) is int
            and protocol >= 5
            and ray_store.serializing_for_ray()
            and _candidate(self)
        ):
            return tensor_from_bytes, (
                byte_view(self),
                BUFFER_DTYPES[self.dtype],
                tuple(self.shape),
            )
        return original(self, protocol)

    return __reduce_ex__


def tensor_from_bytes(data: Any, dtype_name: Any, shape: Any) -> torch.Tensor:
    """A fresh contiguous tensor of ``dtype_name`` and ``shape`` holding a copy of the bytes
    ``data``."""
    dtype = _DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
    if dtype is None:
        raise CorruptPickleError(f"a pickled tensor has an unknown dtype {dtype_name!r}")
    if (
        not isinstance(data, np.ndarray)
        or data.dtype != np.uint8
        or data.ndim != 1
        or not data.flags.c_contiguous
        or not isinstance(shape, tuple)
        or not all(type(n) is int and n >= 0 for n in shape)
    ):
        raise CorruptPickleError(
            f"a pickled tensor's bytes or shape are malformed (shape {shape!r})"
        )
    needed = math.prod(shape) * dtype.itemsize
    if needed != data.nbytes:
        raise CorruptPickleError(
            f"a pickled tensor of shape {shape} and dtype {dtype_name} needs {needed} bytes; "
            f"the pickle holds {data.nbytes}"
        )
    try:
        # on the CPU whatever the receiver's default device is: the bytes are host memory
        out = torch.empty(shape, dtype=dtype, device="cpu")
    except (TypeError, RuntimeError, OverflowError) as exc:
        raise CorruptPickleError(f"a pickled tensor's shape {shape} is refused: {exc}") from exc
    if type(out) is not torch.Tensor or out.device.type != "cpu":
        # a mode that intercepts factories (fake or meta tensors) has no host memory to fill
        raise RuntimeError(
            f"a pickled tensor cannot be rebuilt under an active torch mode ({type(out).__name__} "
            f"on {out.device})"
        )
    # A raw copy: a numpy view of ``out`` would make its storage unresizable, and torch warns on
    # a tensor over the read-only store.
    ctypes.memmove(out.data_ptr(), data.ctypes.data, data.nbytes)
    return out


def _candidate(t: torch.Tensor) -> bool:
    """A plain, bufferable, non-empty CPU tensor with the contiguous strides, over all of its
    storage (torch's pickling sends a view's whole storage), without attributes or names."""
    if not bufferable(t):
        return False
    shape = t.shape
    return bool(
        t.numel() != 0
        and t.stride() == _contiguous_strides(shape)
        and t.storage_offset() == 0
        and t.untyped_storage().nbytes() == t.nbytes
        and not t.__dict__
        # torch warns that it drops the hooks: its own reduction says so
        and not t._backward_hooks
        # named tensors, where this torch still has them
        and not any(getattr(t, "names", ()))
    )


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    """The strides ``torch.empty(shape)`` has (``is_contiguous`` ignores size-1 dimensions)."""
    strides = []
    step = 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))
