"""torch's two storage formats, read inside a restricted load: the zip archive ``torch.save``
writes (a ``data.pkl`` whose persistent ids name storage entries) and the legacy format a
pickled storage nests (``torch.storage._load_from_bytes``: five pickles, then the bytes of each
storage). Every pickle in them runs on ``mmpack.safe_load.machine``; every byte they make a
storage of is charged to the load's budget before it is copied.

An archive must be what ``torch.save`` writes: stored (uncompressed) entries, none larger than
the archive, one ``data.pkl``, the machine's byte order. Its directory is charged before
``zipfile`` parses it (one ``ZipInfo`` per entry). A nested legacy storage must carry the bytes
its records declare, one record per storage, and its object must be the storage itself.
"""

from __future__ import annotations

import io
import struct
import sys
import zipfile
from typing import Any

from mmpack.errors import CorruptPickleError, UnsafePickleError
from mmpack.safe_load import budget as cost
from mmpack.safe_load.admitted import NOTHING, STORAGE_TYPES, Admitted, storage_dtype
from mmpack.safe_load.budget import Budget
from mmpack.safe_load.describe import describe
from mmpack.safe_load.machine import Unpickler

__all__ = ["ZIP_MAGIC", "load_archive", "load_storage_bytes"]

ZIP_MAGIC = b"PK\x03\x04"
_ZIP_METHODS = {
    zipfile.ZIP_DEFLATED: "deflate",
    zipfile.ZIP_BZIP2: "bzip2",
    zipfile.ZIP_LZMA: "LZMA",
}
# torch.serialization's legacy header
_MAGIC_NUMBER = 0x1950A86A20F9469CFC6C
_PROTOCOL_VERSION = 1001
_I64 = struct.Struct("<q")
# zipfile's own reader of the end-of-directory record: the directory it parses next is this
# many bytes (private; without it the archive's size bounds the directory)
_END_RECORD = getattr(zipfile, "_EndRecData", None)
_END_SIZE = getattr(zipfile, "_ECD_SIZE", 5)


def _directory_size(data: bytes) -> int:
    if _END_RECORD is None:
        return len(data)
    end = _END_RECORD(io.BytesIO(data))
    if end is None:
        raise CorruptPickleError("not a readable torch.save archive: it has no zip directory")
    return min(int(end[_END_SIZE]), len(data))


def _check_entries(archive: zipfile.ZipFile, size: int) -> None:
    for info in archive.infolist():
        if info.compress_type != zipfile.ZIP_STORED:
            method = _ZIP_METHODS.get(info.compress_type, f"method {info.compress_type}")
            raise UnsafePickleError(
                f"refusing torch.save archive entry {describe(info.filename)} compressed with "
                f"{method}: torch.save stores its entries uncompressed"
            )
        if info.file_size != info.compress_size or info.file_size > size:
            raise CorruptPickleError(
                f"not a readable torch.save archive: entry {describe(info.filename)} declares "
                f"{info.file_size} bytes in an archive of {size}"
            )


def load_archive(data: bytes, budget: Budget, depth: int = 0) -> Any:
    """The value of a ``torch.save`` archive."""
    import torch

    budget.charge(
        cost.ZIP_ARCHIVE + cost.ZIP_DIRECTORY_PER_BYTE * _directory_size(data),
        "the archive's directory",
    )
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        _check_entries(archive, len(data))
        pkl = [n for n in archive.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
        if len(pkl) != 1:
            raise UnsafePickleError("not a torch.save archive: expected exactly one data.pkl")
        prefix = pkl[0][: -len("data.pkl")]
        if f"{prefix}byteorder" in archive.NameToInfo:
            with archive.open(f"{prefix}byteorder") as fh:
                order = fh.read(16).decode("ascii", "replace").strip()
            if order not in ("little", "big"):  # payload text: named, never echoed
                raise CorruptPickleError("not a torch.save archive: unreadable byteorder entry")
            if order != sys.byteorder:
                raise UnsafePickleError(
                    f"torch.save archive is {order}-endian; this machine is {sys.byteorder}-endian"
                )
        storages: dict[str, Any] = {}

        def persistent(pid: Any) -> Any:
            if not (
                type(pid) is tuple and len(pid) == 5 and type(pid[0]) is str and pid[0] == "storage"
            ):
                raise UnsafePickleError(
                    f"refusing unknown persistent id ({describe(pid)}) in torch.save data"
                )
            dtype = storage_dtype(pid[1])
            key = pid[2]
            info = archive.NameToInfo.get(f"{prefix}data/{key}") if type(key) is str else None
            if info is None:
                raise UnsafePickleError(f"torch.save archive has no storage record {describe(key)}")
            if key not in storages:
                # the entry's bytes, then the storage made from them
                budget.charge(2 * info.file_size + cost.STORAGE, f"storage {describe(key)}")
                raw = archive.read(info)
                storages[key] = (
                    torch.UntypedStorage.from_buffer(raw, dtype=torch.uint8)
                    if raw
                    else torch.UntypedStorage(0)
                )
            budget.charge(cost.STORAGE, "a typed storage")
            return torch.storage.TypedStorage(
                wrap_storage=storages[key], dtype=dtype, _internal=True
            )

        info = archive.getinfo(pkl[0])
        budget.charge(cost.BYTES + info.file_size, "data.pkl")
        body = archive.read(info)
        gate = Admitted(budget, persistent=persistent, nested=load_storage_bytes, depth=depth)
        value, _ = Unpickler(body, budget, gate, "torch.save data.pkl").load()
        return value


class _Declared:
    """A storage record of a nested legacy storage, before its bytes are read."""

    __slots__ = ("dtype", "key", "numel")

    def __init__(self, key: str, dtype: Any, numel: int) -> None:
        self.key = key
        self.dtype = dtype
        self.numel = numel


def load_storage_bytes(data: bytes, budget: Budget, depth: int) -> Any:
    """What ``torch.storage._load_from_bytes(data)`` gives: a nested archive's value, or the
    storage of a legacy record (what pickling a storage writes)."""
    if data[:4] == ZIP_MAGIC:
        return load_archive(data, budget, depth)
    before = budget.used
    storage, kept = _load_legacy(data, budget)
    # everything but the storages was dropped with _load_legacy's frame (the header pickles,
    # the records, the key list): what is kept stays charged, and the bytes read, so that the
    # work of reading one memoized record again and again stays in proportion to the budget
    budget.used = min(budget.used, before + kept + len(data))
    return storage


def _load_legacy(data: bytes, budget: Budget) -> tuple[Any, int]:
    """The storage of a legacy record and the bytes charged for what stays alive with it."""
    import torch

    what = "nested storage"
    plain = Unpickler(data, budget, Admitted(budget, names=NOTHING), what)
    magic, pos = plain.load(0)
    version, pos = plain.load(pos)
    if type(magic) is not int or magic != _MAGIC_NUMBER or version != _PROTOCOL_VERSION:
        raise CorruptPickleError(f"not a readable {what}: not torch's legacy format")
    info, pos = plain.load(pos)
    if type(info) is dict and info.get("little_endian", sys.byteorder == "little") is not (
        sys.byteorder == "little"
    ):
        raise UnsafePickleError(f"refusing a {what} of the other byte order")
    declared: dict[str, _Declared] = {}

    def persistent(pid: Any) -> Any:
        if not (
            type(pid) is tuple
            and len(pid) == 6
            and type(pid[0]) is str
            and pid[0] == "storage"
            and type(pid[2]) is str
            and type(pid[4]) is int
            and pid[4] >= 0
            and pid[5] is None
        ):
            raise UnsafePickleError(f"refusing storage record ({describe(pid)}) in a {what}")
        dtype = storage_dtype(pid[1])
        key, numel = pid[2], pid[4]
        record = declared.get(key)
        if record is None:
            budget.charge(cost.STORAGE, "a storage record")
            record = declared[key] = _Declared(key, dtype, numel)
        elif record.dtype != dtype or record.numel != numel:
            raise UnsafePickleError(f"refusing storage {describe(key)} declared twice in a {what}")
        return record

    objects = Admitted(budget, names=STORAGE_TYPES, persistent=persistent)
    result, pos = Unpickler(data, budget, objects, what).load(pos)
    keys, pos = plain.load(pos)
    if type(result) is not _Declared:
        raise UnsafePickleError(
            f"torch.storage._load_from_bytes must give a storage, got {type(result).__name__}"
        )
    if (
        type(keys) is not list
        or len(keys) != len(declared)
        or not all(type(k) is str and k in declared for k in keys)
        or len(set(keys)) != len(keys)
    ):
        raise UnsafePickleError(f"refusing a {what} whose key list does not match its records")
    sizes = {k: r.numel * r.dtype.itemsize for k, r in declared.items()}
    need = sum(sizes.values()) + _I64.size * len(sizes)  # each: an int64 count, then the bytes
    carried = len(data) - pos
    if need > carried:
        raise UnsafePickleError(
            f"refusing {what}: its records declare {need} bytes but {carried} follow"
        )
    view = memoryview(data)
    storages: dict[str, Any] = {}
    kept = 0
    for key in keys:
        record, nbytes = declared[key], sizes[key]
        (numel,) = _I64.unpack_from(data, pos)
        if numel != record.numel:
            raise CorruptPickleError(
                f"not a readable {what}: storage {describe(key)} holds {numel} elements, its "
                f"record declares {record.numel}"
            )
        pos += _I64.size
        budget.charge(nbytes + cost.STORAGE, f"storage {describe(key)}")
        kept += nbytes + cost.STORAGE
        untyped = (
            torch.UntypedStorage.from_buffer(view[pos : pos + nbytes], dtype=torch.uint8)
            if nbytes
            else torch.UntypedStorage(0)
        )
        pos += nbytes
        storages[key] = torch.storage.TypedStorage(
            wrap_storage=untyped, dtype=record.dtype, _internal=True
        )
    return storages[result.key], kept
