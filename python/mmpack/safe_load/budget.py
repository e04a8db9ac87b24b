"""The memory one payload may cost ``mmpack.safe_load.loader``, and the check of a pickle's
opcodes that charges it before anything is built.

A :class:`Budget` is a byte count that every allocation the restricted loader makes, or lets a
payload make, is charged against *before* it happens; going over raises
:class:`~mmpack.errors.PickleTooLargeError`. Its limit is the caller's ``max_bytes`` or, by
default, ``DEFAULT_FACTOR`` times the input's size plus ``DEFAULT_FLOOR``.

:func:`scan` walks the opcodes of one pickle without building anything and charges, for each,
an upper bound of what the unpickler allocates for it (the object it pushes and its share of the
container that will hold it). It also refuses what would make the unpickler itself allocate
more than the input justifies: a length field (bytes, strings, big ints, frames) larger than the
bytes that follow (CPython's unpickler allocates the declared size before reading), a memo index
beyond the pickle's size (its memo table grows to the largest index), a protocol above 5, and
out-of-band buffers. What the admitted callables build (tensors, storages, PackedTensor layouts
and groups) is charged by them, through :data:`LOAD_BUDGET`; what restoring a PackedTensor state
builds is charged through the hook ``mmpack.packed.restore_charge.RESTORE_CHARGE``, which a load
points at its budget.
"""

from __future__ import annotations

import pickletools
from contextvars import ContextVar

from mmpack.errors import CorruptPickleError, PickleTooLargeError

__all__ = [
    "DEFAULT_FACTOR",
    "DEFAULT_FLOOR",
    "LOAD_BUDGET",
    "Budget",
    "charge",
    "check_max_bytes",
    "scan",
]

#: Without ``max_bytes``, a payload may cost this many times its own size ...
DEFAULT_FACTOR = 32
#: ... plus this many bytes (small payloads of many small objects).
DEFAULT_FLOOR = 64 << 20

#: Bytes charged for each object on the unpickler's stack: its reference and its share of the
#: list, tuple, dict or set that will hold it (a dict entry with its hash slot is about 50).
SLOT = 64


class Budget:
    """Bytes a load may still allocate; :meth:`charge` before each allocation."""

    __slots__ = ("input_bytes", "limit", "used")

    def __init__(self, input_bytes: int, max_bytes: int | None) -> None:
        bound = check_max_bytes(max_bytes)
        self.input_bytes = input_bytes
        self.limit = DEFAULT_FACTOR * input_bytes + DEFAULT_FLOOR if bound is None else bound
        self.used = 0

    def charge(self, nbytes: int, what: str) -> None:
        self.used += max(nbytes, 0)
        if self.used > self.limit:
            raise PickleTooLargeError(
                f"refusing a payload of {self.input_bytes} bytes that needs more than "
                f"{self.limit} bytes of memory to load (at {what}); the default bound is "
                f"{DEFAULT_FACTOR} x its size + {DEFAULT_FLOOR >> 20} MiB, pass max_bytes= to "
                "allow more"
            )


def check_max_bytes(max_bytes: object) -> int | None:
    """``max_bytes`` as a plain ``int`` (an ``int`` subclass's own comparisons could pass any
    value, and disable the bound), or ``None``; ``TypeError`` naming it unless it is ``None``
    or a non-negative ``int`` (checked before the payload is read or copied)."""
    if max_bytes is None:
        return None
    bound = int.__index__(max_bytes) if isinstance(max_bytes, int) else None
    if bound is None or isinstance(max_bytes, bool) or bound < 0:
        raise TypeError(f"max_bytes must be a non-negative int or None, got {max_bytes!r}")
    return bound


#: The budget of the restricted load running in this context (``None`` outside one). Restoring
#: a PackedTensor state (``mmpack.packed.pickle_format.restore``) charges what it builds to it.
LOAD_BUDGET: ContextVar[Budget | None] = ContextVar("mmpack_load_budget", default=None)


def charge(nbytes: int, what: str) -> None:
    """Charge the running restricted load, if any."""
    budget = LOAD_BUDGET.get()
    if budget is not None:
        budget.charge(nbytes, what)


# What each opcode costs, by name: a fixed charge, plus 4 bytes per byte of a text argument
# (a str is at most 4 bytes per character) or 1 per byte of a bytes argument.
_FIXED = {
    **dict.fromkeys(("INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4"), SLOT + 40),
    **dict.fromkeys(("FLOAT", "BINFLOAT"), SLOT + 24),
    **dict.fromkeys(("STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE", "BINUNICODE"), SLOT + 80),
    **dict.fromkeys(("SHORT_BINUNICODE", "BINUNICODE8"), SLOT + 80),
    **dict.fromkeys(("BINBYTES", "SHORT_BINBYTES", "BINBYTES8", "BYTEARRAY8"), SLOT + 64),
    **dict.fromkeys(
        (
            "NONE",
            "NEWTRUE",
            "NEWFALSE",
            "EMPTY_TUPLE",
            "GET",
            "BINGET",
            "LONG_BINGET",
            "DUP",
            "GLOBAL",
            "STACK_GLOBAL",
            "EXT1",
            "EXT2",
            "EXT4",
            "PERSID",
            "BINPERSID",
        ),
        SLOT,
    ),
    "EMPTY_LIST": SLOT + 64,
    "EMPTY_DICT": SLOT + 300,
    "EMPTY_SET": SLOT + 256,
    **dict.fromkeys(("LIST", "TUPLE", "DICT", "FROZENSET"), 300),
    **dict.fromkeys(("TUPLE1", "TUPLE2", "TUPLE3"), 64),
    "MARK": 16,
    "MEMOIZE": 16,
    **dict.fromkeys(("REDUCE", "NEWOBJ", "NEWOBJ_EX", "OBJ", "INST", "BUILD"), 256),
}
_TEXT = frozenset(("STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE", "BINUNICODE"))
_TEXT |= frozenset(("SHORT_BINUNICODE", "BINUNICODE8"))
_LINES = {"GLOBAL": 2, "INST": 2}
_PUTS = frozenset(("PUT", "BINPUT", "LONG_BINPUT"))
_GETS = frozenset(("GET", "BINGET", "LONG_BINGET"))
_BUFFERS = frozenset(("NEXT_BUFFER", "READONLY_BUFFER"))
_FIXED_ARG, _LINE_ARG, _COUNTED_ARG, _NO_ARG = range(4)
_COUNT_WIDTH = {
    pickletools.TAKEN_FROM_ARGUMENT1: (1, False),
    pickletools.TAKEN_FROM_ARGUMENT4: (4, True),
    pickletools.TAKEN_FROM_ARGUMENT4U: (4, False),
    pickletools.TAKEN_FROM_ARGUMENT8U: (8, False),
}


def _table() -> list[tuple[str, int, int, bool, int, int] | None]:
    """Per opcode byte: (name, argument kind, width, signed width, charge, text factor)."""
    table: list[tuple[str, int, int, bool, int, int] | None] = [None] * 256
    for op in pickletools.opcodes:
        arg = op.arg
        signed = False
        if arg is None:
            kind, width = _NO_ARG, 0
        elif arg.n == pickletools.UP_TO_NEWLINE:
            kind, width = _LINE_ARG, _LINES.get(op.name, 1)
        elif arg.n >= 0:
            kind, width = _FIXED_ARG, arg.n
        else:
            kind = _COUNTED_ARG
            width, signed = _COUNT_WIDTH[arg.n]
        factor = 4 if op.name in _TEXT else 1
        table[ord(op.code)] = (op.name, kind, width, signed, _FIXED.get(op.name, 0), factor)
    return table


_OPS = _table()


def scan(raw: bytes, budget: Budget, what: str, start: int = 0) -> int:
    """Check and charge the opcodes of the pickle that starts at ``raw[start]``, up to its
    ``STOP``; return the position after it (the end of ``raw`` for a truncated pickle, which
    the unpickler then reports)."""
    n = len(raw)
    pos = start
    cost = 0
    memo_top = -1
    while pos < n:
        entry = _OPS[raw[pos]]
        if entry is None:
            raise CorruptPickleError(
                f"not a readable {what}: unknown opcode {raw[pos]:#04x} at {pos}"
            )
        name, kind, width, signed, charge, factor = entry
        at = pos
        pos += 1
        cost += charge
        if kind == _FIXED_ARG:
            if pos + width > n:
                break
            if name in _PUTS or name in _GETS or name == "FRAME" or name == "PROTO":
                value = int.from_bytes(raw[pos : pos + width], "little")
                if name in _PUTS:
                    memo_top = max(memo_top, _memo_index(value, n, at, what))
                elif name == "FRAME" and value > n - pos - width:
                    raise CorruptPickleError(
                        f"not a readable {what}: a frame at {at} declares {value} bytes but "
                        f"{n - pos - width} follow"
                    )
                elif name == "PROTO" and value > 5:
                    raise CorruptPickleError(f"not a readable {what}: unknown protocol {value}")
            pos += width
        elif kind == _LINE_ARG:
            for _ in range(width):
                end = raw.find(b"\n", pos)
                if end < 0:
                    pos = n
                    break
                if name in _TEXT:
                    cost += factor * (end - pos)
                elif name in _PUTS:
                    memo_top = max(memo_top, _memo_index(_decimal(raw[pos:end]), n, at, what))
                pos = end + 1
        elif kind == _COUNTED_ARG:
            if pos + width > n:
                break
            length = int.from_bytes(raw[pos : pos + width], "little", signed=signed)
            pos += width
            if length < 0 or length > n - pos:
                raise CorruptPickleError(
                    f"not a readable {what}: {name} at {at} declares {length} bytes but "
                    f"{n - pos} follow"
                )
            cost += factor * length
            pos += length
        elif name in _BUFFERS:
            raise CorruptPickleError(
                f"not a readable {what}: out-of-band buffers ({name} at {at}) are not supported"
            )
        elif name == "STOP":
            break
    cost += 16 * (memo_top + 1)
    budget.charge(cost, f"the objects of the {what}")
    return pos


def _decimal(text: bytes) -> int:
    try:
        return int(text)
    except ValueError:
        return -1  # the unpickler reports it


def _memo_index(index: int, n: int, at: int, what: str) -> int:
    """A memo index must be below the pickle's size: a pickler numbers its memo entries from
    0, one per object, and the unpickler's memo table grows to the largest index it sees."""
    if index >= n:
        raise CorruptPickleError(
            f"not a readable {what}: memo index {index} at {at} is beyond its {n} bytes"
        )
    return index
