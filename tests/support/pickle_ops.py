"""Pickle opcodes written by hand (see ``pickletools``), for payloads no pickler writes: each
helper returns the bytes of one opcode with its argument."""

from __future__ import annotations

import functools
import io
import struct
import sys
import warnings
import zipfile

PROTO2 = b"\x80\x02"
PROTO4 = b"\x80\x04"
PROTO5 = b"\x80\x05"
MARK = b"("
STOP = b"."
POP = b"0"
DUP = b"2"
NONE = b"N"
TRUE = b"\x88"
FALSE = b"\x89"
REDUCE = b"R"
BUILD = b"b"
APPEND = b"a"
APPENDS = b"e"
SETITEM = b"s"
SETITEMS = b"u"
ADDITEMS = b"\x90"
FROZENSET = b"\x91"
LIST = b"l"
DICT = b"d"
TUPLE = b"t"
TUPLE1 = b"\x85"
TUPLE2 = b"\x86"
TUPLE3 = b"\x87"
EMPTY_TUPLE = b")"
EMPTY_LIST = b"]"
EMPTY_DICT = b"}"
EMPTY_SET = b"\x8f"
NEWOBJ = b"\x81"
BINPERSID = b"Q"
MEMOIZE = b"\x94"


def frame(body: bytes) -> bytes:
    return b"\x95" + struct.pack("<Q", len(body)) + body


def global_(module: str, name: str) -> bytes:
    return b"c" + f"{module}\n{name}\n".encode()


def int_(value: int) -> bytes:
    if 0 <= value < 256:
        return b"K" + bytes([value])
    if -(2**31) <= value < 2**31:
        return b"J" + struct.pack("<i", value)
    raw = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw


def text(value: str) -> bytes:
    raw = value.encode("utf-8", "surrogatepass")
    return b"X" + struct.pack("<I", len(raw)) + raw


def bytes_(value: bytes) -> bytes:
    return b"B" + struct.pack("<I", len(value)) + value


def put(index: int) -> bytes:
    return b"r" + struct.pack("<I", index)


def get(index: int) -> bytes:
    return b"j" + struct.pack("<I", index)


def tuple_(*items: bytes) -> bytes:
    return MARK + b"".join(items) + TUPLE


def call(func: bytes, *args: bytes) -> bytes:
    """``func(*args)``: ``func`` and each argument are opcodes that push one value."""
    return func + tuple_(*args) + REDUCE


def empty_ordered_dict() -> bytes:
    return call(global_("collections", "OrderedDict"))


@functools.cache
def legacy_storage(numel: int) -> bytes:
    """The bytes ``torch.storage._load_from_bytes`` gets for a float32 storage of ``numel``
    ones (what pickling a tensor nests)."""
    import torch

    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TypedStorage is deprecated
        torch.save(torch.ones(numel).storage(), buf, _use_new_zipfile_serialization=False)
    return buf.getvalue()


def nested_storage(numel: int) -> bytes:
    """Opcodes that push a float32 storage of ``numel`` ones, as a plain pickle nests it."""
    return call(global_("torch.storage", "_load_from_bytes"), bytes_(legacy_storage(numel)))


def archived_storage(key: str = "0", numel: int = 4) -> bytes:
    """Opcodes that push the storage entry ``data/<key>`` of a ``torch.save`` archive."""
    pid = tuple_(text("storage"), global_("torch", "FloatStorage"), text(key), text("cpu"))
    return pid[:-1] + int_(numel) + TUPLE + BINPERSID


def tensor(
    storage: bytes, size: tuple[int, ...], stride: tuple[int, ...], offset: int = 0
) -> bytes:
    """``torch._utils._rebuild_tensor_v2`` of the storage that ``storage`` pushes."""
    return call(
        global_("torch._utils", "_rebuild_tensor_v2"),
        storage,
        int_(offset),
        tuple_(*map(int_, size)),
        tuple_(*map(int_, stride)),
        FALSE,
        empty_ordered_dict(),
    )


def archive(data_pkl: bytes, storages: dict[str, bytes]) -> bytes:
    """A ``torch.save``-style zip archive with ``data_pkl`` and the given storage entries."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        z.writestr("archive/data.pkl", data_pkl)
        z.writestr("archive/byteorder", sys.byteorder)
        for key, raw in storages.items():
            z.writestr(f"archive/data/{key}", raw)
    return out.getvalue()
