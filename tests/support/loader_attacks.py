"""Payloads written by hand against the restricted loader's memory bound, one per attack class.

Each is an :class:`Attack`: the bytes, the ``max_bytes`` it runs under, the typed error the
loader must raise and what it asked of the loader before the bound held by construction.
"""

from __future__ import annotations

import io
import zipfile
from dataclasses import dataclass

from mmpack.errors import (
    CorruptPickleError,
    PickleSecurityError,
    PickleTooLargeError,
    UnsafePickleError,
)

from support import pickle_ops as op

MIB = 1 << 20


@dataclass
class Attack:
    payload: bytes
    max_bytes: int | None
    error: type[PickleSecurityError]
    asks: str  # what the payload made the loader allocate before


def line_leaving_its_frame(index: int = 1 << 27) -> bytes:
    """``PUT`` whose line starts inside a frame: CPython's unpickler drops the frame's tail and
    reads the index from after the frame (2**27: a 2 GiB memo table), while a check that reads
    the bytes in order sees ``x134217728``, not a number."""
    return op.PROTO4 + op.frame(b"Npx") + b"%d\n" % index + op.STOP


def memo_index_behind_a_nul(index: int = 1 << 27) -> bytes:
    """``PUT`` of ``134217728\\0``: CPython parses the digits up to the NUL, ``int()`` refuses."""
    return op.PROTO2 + op.NONE + b"p%d\x00\n" % index + op.STOP


def _mutated_record(storage: bytes, numel: int) -> bytes:
    """A 4-element tensor, then ``BUILD`` with the legacy 4-tuple state ``(storage, 0,
    (numel,), (1,))``: ``Tensor.__setstate__`` calls ``set_``, which grows the storage."""
    record = op.tensor(storage + op.put(0), (4,), (1,))
    state = op.tuple_(op.get(0), op.int_(0), op.tuple_(op.int_(numel)), op.tuple_(op.int_(1)))
    return op.PROTO2 + record + state + op.BUILD + op.STOP


def mutated_record_pickle(numel: int = 1 << 26) -> bytes:
    return _mutated_record(op.nested_storage(4), numel)


def mutated_record_archive(numel: int = 1 << 26) -> bytes:
    return op.archive(_mutated_record(op.archived_storage(), numel), {"0": bytes(16)})


def broadcast_through_additems(n: int = 8192) -> bytes:
    """``ADDITEMS`` onto a tensor: CPython calls ``tensor.add(item)``, and an (n, 1) tensor plus
    a (1, n) one, both stride-0 views of one element, is an n x n tensor."""
    one = op.nested_storage(1) + op.put(0)
    column = op.tensor(one, (n, 1), (0, 0))
    row = op.tensor(op.get(0), (1, n), (0, 0))
    return op.PROTO2 + column + op.MARK + row + op.ADDITEMS + op.STOP


def _repeat(func: bytes, args: bytes, times: int) -> bytes:
    """``[func(*args) for _ in range(times)]`` with func and args memoized: 6 bytes a call."""
    head = func + b"q\x00" + args + b"q\x01" + op.EMPTY_LIST
    return op.PROTO4 + head + b"h\x00h\x01Ra" * times + op.STOP


def ordered_dict_copies(items: int = 1000, times: int = 2000) -> bytes:
    """``OrderedDict(pairs)`` of one memoized list of pairs, 2000 times: each call copies it."""
    pairs = op.EMPTY_LIST + op.MARK
    pairs += b"".join(op.int_(i) + op.int_(i) + op.TUPLE2 for i in range(items)) + op.APPENDS
    return _repeat(op.global_("collections", "OrderedDict"), pairs + op.TUPLE1, times)


def state_attribute_copies(attributes: int = 2000, times: int = 1000) -> bytes:
    """PackedTensor values restored from one memoized NeMo-RL state with 2000 extra
    attributes: each ``BUILD`` copies them into the new value's ``__dict__``."""
    state = op.EMPTY_DICT + op.MARK
    state += op.text("tensors") + op.EMPTY_LIST + op.text("dim_to_pack") + op.int_(0)
    state += op.text("pad_to_max_shape") + op.FALSE
    state += b"".join(op.text(f"a{i}") + op.int_(0) for i in range(attributes)) + op.SETITEMS
    cls = op.global_("mmpack.packed", "PackedTensor")
    args = op.tuple_(cls, op.global_("builtins", "object"), op.NONE)
    head = op.global_("copyreg", "_reconstructor") + b"q\x00" + args + b"q\x01"
    head += state + b"q\x02" + op.EMPTY_LIST
    return op.PROTO4 + head + b"h\x00h\x01Rh\x02ba" * times + op.STOP


def nested_tuples(depth: int = 300_000) -> bytes:
    """A tuple nested 300,000 deep as a dict key: hashing it recurses in C past the stack."""
    return (
        op.PROTO4
        + op.EMPTY_DICT
        + op.EMPTY_TUPLE
        + op.TUPLE1 * depth
        + op.NONE
        + op.SETITEM
        + op.STOP
    )


def quadratic_repr(chars: int = 10_000, refs: int = 20_000) -> bytes:
    """A persistent id outside an archive that is a list of 20,000 references to one string of
    10,000 characters: an error message with its repr is 200 MB."""
    body = op.text("x" * chars) + op.MEMOIZE + op.EMPTY_LIST + op.MARK + b"h\x00" * refs
    return op.PROTO4 + body + op.APPENDS + op.BINPERSID + op.STOP


def many_entry_archive(entries: int = 20_000) -> bytes:
    """A ``torch.save`` archive with 20,000 empty entries: ``zipfile`` keeps a ``ZipInfo`` of
    ~550 bytes for each 50-byte directory record."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        z.writestr("archive/data.pkl", op.PROTO2 + op.NONE + op.STOP)
        z.writestr("archive/byteorder", "little")
        for i in range(entries):
            z.writestr(f"{i}", b"")
    return out.getvalue()


def attacks() -> dict[str, Attack]:
    return {
        "a PUT line that leaves its frame": Attack(
            line_leaving_its_frame(), MIB, CorruptPickleError, "2 GiB memo table"
        ),
        "a memo index behind a NUL": Attack(
            memo_index_behind_a_nul(), MIB, CorruptPickleError, "2 GiB memo table"
        ),
        "a tensor record changed after its check (pickle)": Attack(
            mutated_record_pickle(), MIB, UnsafePickleError, "256 MiB uninitialized storage"
        ),
        "a tensor record changed after its check (torch.save)": Attack(
            mutated_record_archive(), MIB, UnsafePickleError, "256 MiB uninitialized storage"
        ),
        "ADDITEMS onto a tensor (broadcast add)": Attack(
            broadcast_through_additems(), MIB, UnsafePickleError, "256 MiB tensor"
        ),
        "OrderedDict copies of a memoized argument": Attack(
            ordered_dict_copies(), 16 * MIB, UnsafePickleError, "2,000 copies of 1,000 pairs"
        ),
        "PackedTensor states copying 2,000 attributes": Attack(
            state_attribute_copies(), 16 * MIB, PickleTooLargeError, "1,000 x 2,000 attributes"
        ),
        "tuples nested 300,000 deep as a dict key": Attack(
            nested_tuples(), None, UnsafePickleError, "C recursion past the stack"
        ),
        "a 200 MB repr in an error message": Attack(
            quadratic_repr(), 16 * MIB, UnsafePickleError, "a 200 MB message"
        ),
        "a torch.save directory of 20,000 entries": Attack(
            many_entry_archive(), MIB, PickleTooLargeError, "20,000 ZipInfo objects"
        ),
    }
