"""The memory one payload may cost ``mmpack.safe_load``, and what each thing a load creates is
charged against it.

A :class:`Budget` is a byte count that every allocation the restricted loader makes, or lets a
payload make, is charged against *before* it happens; going over raises
:class:`~mmpack.errors.PickleTooLargeError`. Its limit is the caller's ``max_bytes`` or, by
default, ``DEFAULT_FACTOR`` times the input's size plus ``DEFAULT_FLOOR``. Charges are never
refunded: the total charged bounds the peak, whatever is freed on the way.

The constants below are upper bounds of what CPython (64-bit, 3.10 to 3.13) allocates, measured
with ``tracemalloc`` at the container sizes where a resize makes the old and the new table live
together. The unpickler charges them per opcode (``mmpack.safe_load.machine`` and its opcode
families ``literals``, ``containers``, ``memo`` and ``objects``), the admitted callables
(``mmpack.safe_load.admitted``) per result, and restoring a PackedTensor state through the hook
``mmpack.packed.pickling.restore_charge.RESTORE_CHARGE``, which a load points at its budget.
"""

from __future__ import annotations

from mmpack.errors import PickleTooLargeError

__all__ = ["DEFAULT_FACTOR", "DEFAULT_FLOOR", "Budget", "check_max_bytes"]

#: Without ``max_bytes``, a payload may cost this many times its own size ...
DEFAULT_FACTOR = 32
#: ... plus this many bytes (small payloads of many small objects).
DEFAULT_FLOOR = 64 << 20

#: A reference on the unpickler's stack or in a list: 8 bytes, the list's growth slack and, while
#: it resizes, the old array next to the new one (measured 17).
REF = 24
#: A small object: an int of up to 8 bytes, a float, an empty tuple, a marker.
SMALL = 64
#: A memo entry: its slot in the memo dict and its int key (measured 122).
MEMO = 160
#: A tuple: its header, and per item (the list it is built from is freed after).
TUPLE = 64
TUPLE_ITEM = 16
LIST = 96
#: A dict and each entry (measured 98 per entry, 216 for the first table).
DICT = 256
DICT_ITEM = 128
#: An ``OrderedDict``: a dict plus a node and a slot of its node table per entry (measured 142).
ODICT = 512
ODICT_ITEM = 176
#: A set or frozenset and each member (measured 127 per member, 272 for the first table).
SET = 320
SET_ITEM = 160
#: ``bytes`` / ``bytearray``: a header plus one byte per byte.
BYTES = 64
#: Text: a header plus, per byte of UTF-8 or escaped input, what the decoder may hold at once
#: (measured 5 for UTF-8 that ends in a 4-byte character, 6 for ``raw_unicode_escape``).
TEXT = 128
TEXT_PER_BYTE = 8
#: An int from its two's-complement or decimal bytes (measured 2.07 per byte).
INT_PER_BYTE = 3
#: A tensor object over an existing storage (measured about 600) and each dimension.
TENSOR = 1024
TENSOR_DIM = 32
#: A storage object wrapping bytes the load already charged.
STORAGE = 512
#: An instance of an admitted class (``object.__new__``) with its ``__dict__``.
INSTANCE = 512
#: One run of the unpickler (its state, not what it builds).
UNPICKLER = 1024
#: A zip archive's directory, per byte of it: ``zipfile`` keeps one ``ZipInfo`` (measured 555
#: bytes) per entry of at least 46 bytes.
ZIP_DIRECTORY_PER_BYTE = 16
ZIP_ARCHIVE = 8192


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
