"""Argument coercion shared by the Python layer: integer scalars, int64 arrays, loss-mask and
flag arrays, role lists and the packing dimension.

The native core takes int64 and never wraps a value, so everything bound for it is checked
here first and refused with a typed exception that names the argument (and the sample, where
there is one). Three families of wording exist, one per caller family, and their messages are
part of the API:

* packing arguments (``mmpack.packing``, ``mmpack.packing.ranks``): ``PackingArgumentError`` /
  ``PackingDtypeError`` / ``ItemTooLargeError``, "invalid packing argument NAME: ...";
* batch options (``mmpack.batch``): ``TypeError`` for a non-integer, the given error class
  (``BatchOptionError``) for a value outside its range, "invalid NAME: ...";
* counts and per-sample arrays (``mmpack.batch.masks``, ``mmpack.batch``, ``mmpack.packed``):
  ``TypeError`` for a wrong type, a typed ``MmpackError`` for a value out of range,
  "WHAT must ...", with ``WHAT`` naming the sample when there is one.

No torch import here: tensors are recognised by duck typing, so numpy-only use stays cheap.
"""

from __future__ import annotations

import operator
from collections.abc import Hashable
from typing import Any

import numpy as np
from numpy.typing import NDArray

from mmpack.errors import (
    IndexOverflowError,
    ItemTooLargeError,
    LossMaskError,
    PackingArgumentError,
    PackingDtypeError,
)

I64_MIN = -(2**63)
I64_MAX = 2**63 - 1

IntArray = NDArray[np.int64]

_EMPTY_I64: IntArray = np.zeros(0, dtype=np.int64)
# dtypes the native mask validator reads as they are (no cast that could hide a bad value)
_NATIVE_MASK_DTYPES = frozenset(
    np.dtype(t) for t in (np.bool_, np.uint8, np.int8, np.int32, np.int64, np.float32, np.float64)
)


def sample_name(sample_id: Hashable | None) -> str:
    """How errors name a sample: its ``repr``, or ``<unnamed>``."""
    return "<unnamed>" if sample_id is None else repr(sample_id)


# ----------------------------------------------------------------------------- tensors


def is_tensor(x: Any) -> bool:
    """Whether ``x`` looks like a torch tensor (checked without importing torch)."""
    return hasattr(x, "detach") and hasattr(x, "numpy")


def tensor_numpy(t: Any, what: str, sample_id: Hashable | None = None) -> np.ndarray:
    """A torch tensor's values as a numpy array: a view on the CPU, else a host copy.

    Raises ``TypeError`` naming the sample for a ``meta`` tensor (it has no values; torch
    would raise ``NotImplementedError``) or a dtype numpy lacks (bfloat16).
    """
    if t.device.type == "meta":
        raise TypeError(
            f"{what} of sample {sample_name(sample_id)} is a meta tensor, which has no values"
        )
    try:
        return t.numpy()
    except (RuntimeError, TypeError):  # needs grad, not on the CPU, or no numpy dtype
        return t.detach().cpu().numpy()


def host_tensor(t: Any, name: str) -> Any:
    """A torch tensor on the CPU, detached; a ``meta`` tensor (no data to read) is a
    ``TypeError`` naming the argument."""
    if t.device.type == "meta":
        raise TypeError(f"{name} must hold data, got a tensor on the meta device")
    return t.detach().cpu()


# ----------------------------------------------------------------------------- scalars


def _exact_int(value: Any) -> int | None:
    """``value`` as an ``int`` when it is an ``int`` or a numpy integer (never a bool)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        return None
    return operator.index(value)


def packing_int(value: Any, name: str, minimum: int) -> int:
    """A packing argument as an ``int`` in ``[minimum, 2**63 - 1]``, else
    ``PackingArgumentError`` naming the argument (a bool or a non-integer included)."""
    checked = _exact_int(value)
    if checked is None:
        raise PackingArgumentError(
            f"invalid packing argument {name}: must be an integer, got {value!r}"
        )
    if checked < minimum:
        raise PackingArgumentError(
            f"invalid packing argument {name}: must be >= {minimum}, got {checked}"
        )
    if checked > I64_MAX:
        raise PackingArgumentError(
            f"invalid packing argument {name}: must be <= 2**63 - 1, got {checked}"
        )
    return checked


def optional_packing_int(value: Any, name: str, minimum: int) -> int | None:
    """``packing_int`` for an argument whose ``None`` means "not set"."""
    return None if value is None else packing_int(value, name, minimum)


def option_int(value: Any, name: str, *, error: type[Exception], minimum: int = I64_MIN) -> int:
    """An option as an ``int`` in ``[minimum, 2**63 - 1]``: ``TypeError`` for a bool or a
    non-integer, ``error`` for a value out of that range."""
    checked = _exact_int(value)
    if checked is None:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not minimum <= checked <= I64_MAX:
        raise error(f"invalid {name}: must be >= {minimum} and <= 2**63 - 1, got {value}")
    return checked


def count_int(value: Any, what: str, *, error: type[Exception], minimum: int = I64_MIN) -> int:
    """A count or size as an ``int`` (anything with ``__index__`` but a bool): ``TypeError``
    for a non-integer (a float, a string, a bool: nothing is truncated or parsed), ``error``
    outside ``[minimum, 2**63 - 1]`` ("must fit in int64" when ``minimum`` is int64's own)."""
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an int, got bool")
    try:
        checked = operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an int, got {type(value).__name__}") from None
    if not minimum <= checked <= I64_MAX:
        if minimum == I64_MIN:
            raise error(f"{what} must fit in int64, got {checked}")
        raise error(f"{what} must be >= {minimum} and <= 2**63 - 1, got {value}")
    return checked


def token_count(value: Any, sample_id: Hashable | None) -> int:
    """A sample's token count: ``count_int`` with ``LossMaskError`` outside
    ``[0, 2**63 - 1]``."""
    return count_int(
        value, f"num_tokens of sample {sample_name(sample_id)}", error=LossMaskError, minimum=0
    )


# ----------------------------------------------------------------------------- int64 arrays


def lengths_array(values: Any, name: str) -> IntArray:
    """Packing input (lengths, media counts) as a 1-D ``int64`` array the caller cannot
    change: the core reads it with the GIL released, so a caller's array is copied (another
    thread could rewrite it between the checks and the packing); other integer dtypes and
    sequences are converted; floats, bools (also inside a list), strings and objects raise
    ``PackingDtypeError``, a ``uint64`` value beyond int64 ``ItemTooLargeError`` naming the
    item."""
    if isinstance(values, np.ndarray):
        arr = values
    else:
        if isinstance(values, (list, tuple)) and any(type(v) is bool for v in values):
            raise PackingDtypeError(
                f"{name} must be integers, got bools; convert explicitly, e.g. int(x)"
            )
        try:
            arr = np.asarray(values)
        except (OverflowError, ValueError, TypeError) as exc:
            raise PackingDtypeError(f"{name} must be a 1-D sequence of integers: {exc}") from None
        if arr.size == 0 and arr.dtype.kind == "f":  # [] -> float64
            arr = arr.astype(np.int64)
    if arr.ndim != 1:
        raise PackingDtypeError(f"{name} must be 1-D, got an array of shape {arr.shape}")
    kind = arr.dtype.kind
    if kind not in "iu":
        what = {"b": "bools", "f": "floats", "c": "complex numbers"}.get(kind, str(arr.dtype))
        raise PackingDtypeError(
            f"{name} must be integers, got {what} (dtype {arr.dtype}); convert explicitly, "
            "e.g. np.asarray(x).astype(np.int64), after checking the values are whole"
        )
    if arr.dtype == np.uint64 and arr.size and int(arr.max()) > I64_MAX:
        bad = int(np.argmax(arr > I64_MAX))
        singular = name[:-1] if name.endswith("s") else name  # "lengths" -> "length"; "media"
        raise ItemTooLargeError(f"item {bad} has {singular} {int(arr[bad])}, beyond int64")
    return _private(np.ascontiguousarray(arr, dtype=np.int64), values)


def _private(arr: IntArray, source: Any) -> IntArray:
    """``arr``, copied when it may share memory with the caller's ``source`` array."""
    if isinstance(source, np.ndarray) and np.may_share_memory(arr, source):
        return arr.copy()
    return arr


def int64_array(values: Any, what: str, sample_id: Hashable | None = None) -> IntArray:
    """A contiguous 1-D int64 numpy array from a numpy array, torch tensor or sequence of ints.

    Raises ``TypeError`` for other dtypes and shapes and ``IndexOverflowError`` for an integer
    beyond int64 (never wrapped into a negative value), both naming the sample.
    """
    if type(values) is np.ndarray:
        arr = values
    elif is_tensor(values):
        arr = tensor_numpy(values, what, sample_id)
    else:
        arr = np.asarray(values)
        if arr.size == 0:
            arr = arr.astype(np.int64)
    if arr.dtype != np.int64:
        if _beyond_int64(arr, values):
            raise IndexOverflowError(
                f"{what} of sample {sample_name(sample_id)} holds a value beyond int64"
            )
        if arr.dtype.kind not in "iu":
            raise TypeError(
                f"{what} of sample {sample_name(sample_id)} must be integers, got dtype {arr.dtype}"
            )
        arr = arr.astype(np.int64)
    if arr.ndim != 1:
        raise TypeError(
            f"{what} of sample {sample_name(sample_id)} must be 1-D, got shape {tuple(arr.shape)}"
        )
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)
    return arr


def _beyond_int64(arr: np.ndarray, values: Any) -> bool:
    """Whether ``arr`` (``np.asarray(values)``, not int64) holds integers beyond int64: uint64
    values over its max, or Python ints numpy stored as floats or objects because they did
    not fit."""
    if arr.dtype == np.uint64:
        return bool(arr.size) and int(arr.max()) > I64_MAX
    return (
        arr.dtype.kind in "fO"
        and isinstance(values, (list, tuple))
        and all(isinstance(v, int) and not isinstance(v, bool) for v in values)
    )


def index_array(value: Any, name: str) -> IntArray | list[int]:
    """Indices or offsets as a contiguous int64 array; a ``list`` of Python ints when some do
    not fit in int64 (the caller reports them with its own message). ``TypeError`` naming the
    argument for anything that is not a flat sequence of integers (bools count as 0/1)."""
    if is_tensor(value):
        value = host_tensor(value, name).numpy()
    if isinstance(value, np.ndarray):
        arr = value
    else:
        if isinstance(value, (str, bytes)) or not hasattr(value, "__len__"):
            raise TypeError(f"{name} must be a sequence of int, got {type(value).__name__}")
        try:
            arr = np.asarray(value)
        except (OverflowError, ValueError) as exc:
            raise TypeError(f"{name} must be a sequence of int: {exc}") from None
    if arr.ndim != 1:
        raise TypeError(f"{name} must be a flat sequence of int, got {arr.ndim} dimensions")
    if arr.size == 0:
        return _EMPTY_I64
    if arr.dtype.kind in "iub":
        if arr.dtype.kind == "u" and arr.dtype.itemsize >= 8 and int(arr.max()) >= 2**63:
            return [int(x) for x in arr]
        return _private(np.ascontiguousarray(arr, dtype=np.int64), value)
    if arr.dtype == object and all(
        isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in arr
    ):
        return [int(x) for x in arr]
    raise TypeError(f"{name} must be a sequence of int, got elements of dtype {arr.dtype}")


# ----------------------------------------------------------------------------- masks, flags


def mask_array(mask: Any, sample_id: Hashable | None = None) -> np.ndarray:
    """A loss mask as a 1-D numpy array the native validator reads directly (no value-changing
    cast).

    Accepts numpy arrays, torch tensors (any device; moved to the host) and sequences. Integer
    dtypes other than the native ones become int64 and floats become float64, both exact. A
    mask that is not 1-D is a ``LossMaskError``; a dtype that is neither bool, integer nor
    float a ``TypeError``; both name the sample.
    """
    if type(mask) is np.ndarray:
        arr = mask
    elif is_tensor(mask):
        t = mask
        if t.dtype.is_floating_point and t.dtype not in _torch_float_dtypes():
            t = t.double()  # bfloat16 / float16: exact in float64
        arr = tensor_numpy(t, "loss mask", sample_id)
    else:
        arr = np.asarray(mask)
    if arr.ndim != 1:
        raise LossMaskError(
            f"loss mask of sample {sample_name(sample_id)} has shape {tuple(arr.shape)} "
            "(rule: a mask is 1-D, one value per token)"
        )
    if arr.dtype not in _NATIVE_MASK_DTYPES:
        kind = arr.dtype.kind
        if kind in "iu":
            arr = arr.astype(np.int64)
        elif kind == "f":
            arr = arr.astype(np.float64)
        else:
            raise TypeError(
                f"loss mask of sample {sample_name(sample_id)} has dtype {arr.dtype}; "
                "expected bool, an integer or a float dtype"
            )
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)
    return bools_as_bytes(arr)


def bools_as_bytes(arr: np.ndarray) -> np.ndarray:
    """A ``bool`` array as a ``uint8`` view (no copy); other arrays unchanged.

    numpy and torch can hold bytes other than 0 and 1 in a bool array (through a view or a
    buffer); read as bytes, such a value is reported like any other bad value, instead of
    passing as ``True`` and landing in the packed mask as it is.
    """
    return arr.view(np.uint8) if arr.dtype == np.bool_ else arr


def flag_array(flags: Any, what: str, sample_id: Hashable | None = None) -> NDArray[np.bool_]:
    """Per-item on/off flags as a contiguous 1-D ``bool`` array: booleans or the integers 0
    and 1 only (a float, a 2 or a byte other than 0/1 in a bool array is a ``LossMaskError``
    naming the sample)."""
    arr = bools_as_bytes(np.asarray(flags))
    if arr.size == 0:
        arr = arr.astype(np.uint8)
    if arr.dtype.kind not in "iu" or not np.isin(arr, (0, 1)).all():
        raise LossMaskError(f"{what} of sample {sample_name(sample_id)} must be booleans or 0/1")
    return np.ascontiguousarray(arr.astype(np.bool_).reshape(-1))


def _torch_float_dtypes() -> tuple[Any, ...]:
    import torch

    return (torch.float32, torch.float64)


# ----------------------------------------------------------------------------- names, dims


def role_list(roles: Any, what: str, sample_id: Hashable | None = None) -> list[str]:
    """``roles`` as a list of role names; ``TypeError`` (naming the sample when given) for a
    single string or a non-string item."""
    of = "" if sample_id is None else f" of sample {sample_name(sample_id)}"
    if isinstance(roles, str):
        raise TypeError(
            f"{what}{of} must be a sequence of role names, not the single string {roles!r}"
        )
    out = list(roles)
    for r in out:
        if not isinstance(r, str):
            raise TypeError(f"{what}{of} must contain strings, got {type(r).__name__}")
    return out


def pack_dim(dim: Any, rank: int) -> int | None:
    """``dim_to_pack`` for tensors of ``rank`` dimensions, counted from the front
    (``-1`` is the last dimension); ``None`` when it is no integer or not in
    ``[-rank, rank)``."""
    if not isinstance(dim, (int, np.integer)):
        return None
    d = int(dim)
    d = d + rank if d < 0 else d
    return d if 0 <= d < rank else None
