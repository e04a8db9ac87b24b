"""The opcodes of the memo: ``PUT`` / ``BINPUT`` / ``LONG_BINPUT`` / ``MEMOIZE`` store the top of
the stack under an index, ``GET`` / ``BINGET`` / ``LONG_BINGET`` push it again. An index beyond
the pickle's size is refused (a pickler numbers its entries from 0, one per object), and each
entry and each reference is charged. Handlers of the restricted unpickler
(``mmpack.safe_load.machine``), which maps each opcode to one of them."""

from __future__ import annotations

import pickle
import struct
from typing import TYPE_CHECKING

from mmpack.errors import CorruptPickleError
from mmpack.safe_load import budget as cost

if TYPE_CHECKING:
    from mmpack.safe_load.machine import Unpickler

__all__ = ["binget", "binput", "get", "long_binget", "long_binput", "memoize", "put"]

_U32 = struct.Struct("<I")


def _memo_put(m: Unpickler, index: int) -> None:
    if index < 0:
        raise pickle.UnpicklingError(f"negative memo index at {m.pos}")
    if index >= m.size:  # a pickler numbers its memo entries from 0, one per object
        raise CorruptPickleError(
            f"not a readable {m.what}: memo index {index} at {m.pos} is beyond its {m.size} bytes"
        )
    m.charge(cost.MEMO, "a memo entry")
    m.memo[index] = m.top()


def _memo_get(m: Unpickler, index: int) -> None:
    try:
        value = m.memo[index]
    except KeyError:
        raise pickle.UnpicklingError(f"memo value not found at index {index}") from None
    m.charge(cost.REF, "a reference")
    m.push(value)


def put(m: Unpickler) -> None:
    _memo_put(m, int(m.line(0, cost.INT_PER_BYTE, "a memo index")))


def binput(m: Unpickler) -> None:
    _memo_put(m, m.data[m.take(1)])


def long_binput(m: Unpickler) -> None:
    _memo_put(m, _U32.unpack_from(m.data, m.take(4))[0])


def memoize(m: Unpickler) -> None:
    _memo_put(m, len(m.memo))


def get(m: Unpickler) -> None:
    _memo_get(m, int(m.line(0, cost.INT_PER_BYTE, "a memo index")))


def binget(m: Unpickler) -> None:
    _memo_get(m, m.data[m.take(1)])


def long_binget(m: Unpickler) -> None:
    _memo_get(m, _U32.unpack_from(m.data, m.take(4))[0])
