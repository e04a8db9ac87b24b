"""Which segments travel as raw bytes, and the int64 tables that describe them.

Both adapters that write segment bytes (the plain pickle format and the Ray object-store path)
and the NeMo-RL tensor path write a tensor's bytes as they are only when it is
:func:`bufferable`, and name its dtype by :data:`BUFFER_DTYPES`.
"""

from __future__ import annotations

import operator
from typing import Any

import numpy as np
import torch

__all__ = ["BUFFER_DTYPES", "DTYPES_BY_NAME", "bufferable", "i64_bytes", "one_dtype_if_bufferable"]

#: The dtypes whose bytes a group writes as they are, and their names in the format.
BUFFER_DTYPES = {
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


_COMPLEX = frozenset((torch.complex64, torch.complex128))


def bufferable(t: Any) -> bool:
    """A plain CPU tensor whose bytes can be written as they are (no autograd, subclass,
    sparse/nested layout or lazy conjugate/negative bit)."""
    if type(t) is not _TENSOR:
        return False
    dtype = t.dtype
    return (
        dtype in BUFFER_DTYPES
        and t.is_cpu
        and not t.requires_grad
        and t.layout is _STRIDED
        and not t.is_nested
        and not t.is_neg()
        # torch sets the conjugate bit on complex tensors only
        and (dtype not in _COMPLEX or not t.is_conj())
    )


_FLAGS = operator.attrgetter("dtype", "is_cpu", "requires_grad", "layout", "is_nested")
_IS_NEG = torch.Tensor.is_neg
_IS_CONJ = torch.Tensor.is_conj
_SHAPE = operator.attrgetter("shape")
_DTYPE = operator.attrgetter("dtype")


def one_dtype_if_bufferable(tensors: list[Any]) -> torch.dtype | None:
    """The one dtype of ``tensors`` if every one is ``bufferable`` and all share it, else
    ``None``: the same checks, made with C-level passes over the list (values often hold tens
    of thousands of segments)."""
    if not tensors or set(map(type, tensors)) != {_TENSOR}:
        return None
    flags = set(map(_FLAGS, tensors))
    if len(flags) != 1:
        return None
    ((dtype, is_cpu, requires_grad, layout, is_nested),) = flags
    if (
        dtype not in BUFFER_DTYPES
        or not is_cpu
        or requires_grad
        or layout is not _STRIDED
        or is_nested
        or any(map(_IS_NEG, tensors))
        or (dtype in _COMPLEX and any(map(_IS_CONJ, tensors)))
    ):
        return None
    return dtype


#: The dtype each name of :data:`BUFFER_DTYPES` stands for.
DTYPES_BY_NAME = {name: dtype for dtype, name in BUFFER_DTYPES.items()}


def i64_bytes(values: Any) -> bytes:
    return np.asarray(values, dtype="<i8").tobytes()
