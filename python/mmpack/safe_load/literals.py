"""The opcodes of literal values: ``None``, ``True`` and ``False``, ints, floats, strings, bytes
and bytearrays, each read from its argument and charged before it is built; out-of-band buffers
are refused. Handlers of the restricted unpickler (``mmpack.safe_load.machine``), which maps
each opcode to one of them."""

from __future__ import annotations

import codecs
import pickle
import struct
from typing import TYPE_CHECKING

from mmpack.errors import CorruptPickleError
from mmpack.safe_load import budget as cost

if TYPE_CHECKING:
    from mmpack.safe_load.machine import Unpickler

__all__ = [
    "binbytes",
    "binbytes8",
    "binfloat",
    "binint",
    "binint1",
    "binint2",
    "binstring",
    "binunicode",
    "binunicode8",
    "buffer",
    "bytearray8",
    "false",
    "float_",
    "int_",
    "long",
    "long1",
    "long4",
    "none",
    "short_binbytes",
    "short_binstring",
    "short_binunicode",
    "string",
    "true",
    "unicode",
]

# the longest FLOAT line (repr of a float is at most 24 characters)
_MAX_FLOAT_LINE = 64

_I32 = struct.Struct("<i")
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_F64 = struct.Struct(">d")

# ------------------------------------------------------------------------ constants and numbers


def none(m: Unpickler) -> None:
    m.charge(cost.REF, "None")
    m.push(None)


def true(m: Unpickler) -> None:
    m.charge(cost.REF, "True")
    m.push(True)


def false(m: Unpickler) -> None:
    m.charge(cost.REF, "False")
    m.push(False)


def int_(m: Unpickler) -> None:
    line = m.line(cost.REF + cost.SMALL, cost.INT_PER_BYTE, "an int")
    if line == b"00":
        m.push(False)
    elif line == b"01":
        m.push(True)
    else:
        m.push(int(line, 0))


def long(m: Unpickler) -> None:
    line = m.line(cost.REF + cost.SMALL, cost.INT_PER_BYTE, "an int")
    if line.endswith(b"L"):
        line = line[:-1]
    m.push(int(line, 0))


def binint(m: Unpickler) -> None:
    m.charge(cost.REF + cost.SMALL, "an int")
    m.push(_I32.unpack_from(m.data, m.take(4))[0])


def binint1(m: Unpickler) -> None:
    m.charge(cost.REF + cost.SMALL, "an int")
    m.push(m.data[m.take(1)])


def binint2(m: Unpickler) -> None:
    m.charge(cost.REF + cost.SMALL, "an int")
    m.push(_U16.unpack_from(m.data, m.take(2))[0])


def long1(m: Unpickler) -> None:
    at = m.pos - 1
    n = m.data[m.take(1)]
    start = m.take(n, "LONG1", at)
    m.charge(cost.REF + cost.SMALL + cost.INT_PER_BYTE * n, "an int")
    m.push(int.from_bytes(m.view[start : start + n], "little", signed=True))


def long4(m: Unpickler) -> None:
    n, start = m.length(_I32, "LONG4")
    m.charge(cost.REF + cost.SMALL + cost.INT_PER_BYTE * n, "an int")
    m.push(int.from_bytes(m.view[start : start + n], "little", signed=True))


def float_(m: Unpickler) -> None:
    line = m.line(cost.REF + cost.SMALL, 3, "a float")
    if len(line) > _MAX_FLOAT_LINE:  # float()'s error would hold a repr of the whole line
        raise pickle.UnpicklingError(
            f"a FLOAT of {len(line)} bytes at {m.pos - len(line) - 2}: a pickler writes "
            f"repr(float), at most {_MAX_FLOAT_LINE}"
        )
    m.push(float(line))


def binfloat(m: Unpickler) -> None:
    m.charge(cost.REF + cost.SMALL, "a float")
    m.push(_F64.unpack_from(m.data, m.take(8))[0])


# ------------------------------------------------------------------------ strings and bytes


def _text_cost(m: Unpickler, nbytes: int) -> None:
    m.charge(cost.REF + cost.TEXT + cost.TEXT_PER_BYTE * nbytes, "a string")


def string(m: Unpickler) -> None:
    line = m.line(cost.REF + cost.TEXT, cost.TEXT_PER_BYTE, "a string")
    if len(line) < 2 or line[0] != line[-1] or line[0] not in b"\"'":
        raise pickle.UnpicklingError("the STRING opcode argument must be quoted")
    m.push(codecs.escape_decode(line[1:-1])[0].decode("ascii"))


def binstring(m: Unpickler) -> None:
    n, start = m.length(_I32, "BINSTRING")
    _text_cost(m, n)
    m.push(codecs.ascii_decode(m.view[start : start + n])[0])


def short_binstring(m: Unpickler) -> None:
    at = m.pos - 1
    n = m.data[m.take(1)]
    start = m.take(n, "SHORT_BINSTRING", at)
    _text_cost(m, n)
    m.push(codecs.ascii_decode(m.view[start : start + n])[0])


def unicode(m: Unpickler) -> None:
    line = m.line(cost.REF + cost.TEXT, cost.TEXT_PER_BYTE, "a string")
    m.push(codecs.raw_unicode_escape_decode(line)[0])


def _utf8(m: Unpickler, n: int, start: int) -> None:
    _text_cost(m, n)
    m.push(codecs.utf_8_decode(m.view[start : start + n], "surrogatepass", True)[0])


def binunicode(m: Unpickler) -> None:
    _utf8(m, *m.length(_U32, "BINUNICODE"))


def short_binunicode(m: Unpickler) -> None:
    at = m.pos - 1
    n = m.data[m.take(1)]
    _utf8(m, n, m.take(n, "SHORT_BINUNICODE", at))


def binunicode8(m: Unpickler) -> None:
    _utf8(m, *m.length(_U64, "BINUNICODE8"))


def _bytes(m: Unpickler, n: int, start: int) -> None:
    m.charge(cost.REF + cost.BYTES + n, "bytes")
    m.push(m.data[start : start + n])


def binbytes(m: Unpickler) -> None:
    _bytes(m, *m.length(_U32, "BINBYTES"))


def short_binbytes(m: Unpickler) -> None:
    at = m.pos - 1
    n = m.data[m.take(1)]
    _bytes(m, n, m.take(n, "SHORT_BINBYTES", at))


def binbytes8(m: Unpickler) -> None:
    _bytes(m, *m.length(_U64, "BINBYTES8"))


def bytearray8(m: Unpickler) -> None:
    n, start = m.length(_U64, "BYTEARRAY8")
    m.charge(cost.REF + cost.BYTES + n, "a bytearray")
    m.push(bytearray(m.view[start : start + n]))


def buffer(m: Unpickler) -> None:
    raise CorruptPickleError(
        f"not a readable {m.what}: out-of-band buffers (at {m.pos - 1}) are not supported"
    )
