"""A restricted unpickler for PackedTensor payloads: read pickles written by NeMo-RL or mmpack
into ``mmpack.PackedTensor`` objects without trusting them.

``loads(data)`` / ``load(file)`` read pickles written by NeMo-RL or mmpack (``pickle`` protocols 0
to 5, ``cloudpickle`` or ``torch.save``; the old three-field ``__dict__`` state and the current
six-field one; values nested in dicts, lists and tuples) into mmpack objects, without
``nemo_rl`` installed and without ``mmpack.compat.nemo_rl.install()``. Both are re-exported as
``mmpack.compat.nemo_rl.loads`` / ``load``. Their unpickler admits only what a PackedTensor
payload needs:

* the PackedTensor class paths (NeMo-RL's and mmpack's), mapped to ``mmpack.PackedTensor``;
* torch's tensor rebuild function (checked against its storage first), storage types and
  dtypes;
* ``collections.OrderedDict``, ``set``, ``frozenset``, ``complex``, and copies of data only:
  ``bytes`` / ``bytearray`` of bytes or text (never of a size), ``_codecs.encode`` of text
  (bytes under protocols 0-2), ``copyreg._reconstructor`` of a PackedTensor (protocols 0-1).

Any other global raises :class:`mmpack.errors.UnsafePickleError` naming it (for example
``os.system``), before anything is called, and so does a tensor record that does not fit inside
its storage (torch would grow the storage), a ``torch.save`` archive entry that is compressed
(``torch.save`` stores them; a compressed entry can inflate a thousandfold) or an allocation
through an admitted name (``bytearray(2**31)``).

Memory: a load may allocate at most ``max_bytes`` (default: 32 times the input's size plus
64 MiB, see ``mmpack.safe_load.budget``). Each pickle's opcodes are checked and charged
before it is unpickled, and every storage, tensor and PackedTensor layout is charged before it
is built; over the bound, :class:`mmpack.errors.PickleTooLargeError`. Bytes that do not decode
(truncated, bit-flipped, length fields beyond the data) raise
:class:`mmpack.errors.CorruptPickleError` with the original error chained. All three are
``pickle.UnpicklingError`` subclasses. Tensors always load onto the CPU.
"""

from __future__ import annotations

import collections
import io
import os
import pickle
import sys
import warnings
import zipfile
from collections.abc import Callable
from typing import IO, Any

from mmpack.errors import CorruptPickleError, MmpackError, UnsafePickleError
from mmpack.packed.restore_charge import RESTORE_CHARGE
from mmpack.safe_load.budget import LOAD_BUDGET, Budget, check_max_bytes, scan
from mmpack.safe_load.budget import charge as _charge

__all__ = ["NEMO_RL_MODULE", "load", "loads"]

#: The NeMo-RL module that defines ``PackedTensor``: its payloads load as mmpack's class.
NEMO_RL_MODULE = "nemo_rl.data.multimodal_utils"

# Class paths whose payload is a PackedTensor ``__dict__`` state.
_PACKED_CLASS_PATHS = frozenset(
    {
        (NEMO_RL_MODULE, "PackedTensor"),
        ("mmpack.packed", "PackedTensor"),
        ("mmpack", "PackedTensor"),
    }
)
_ZIP_MAGIC = b"PK\x03\x04"
_PY2_MODULES = {"copy_reg": "copyreg", "__builtin__": "builtins"}
#: Bytes charged per tensor a record builds (measured: about 600).
_TENSOR_COST = 1024
#: Bytes charged per element of a set or frozenset built from a list.
_SET_ITEM_COST = 64
_LATIN1 = frozenset({"latin1", "latin-1"})


def _packed_tensor_class() -> type:
    from mmpack.packed.value import PackedTensor

    return PackedTensor


def _load_storage_from_bytes(data: bytes) -> Any:
    """Stands in for ``torch.storage._load_from_bytes`` (which calls ``torch.load`` with
    ``weights_only=False``): a nested ``torch.save`` archive goes through this module's checked
    loader; the legacy format a pickled storage nests is size-checked, then read with torch's
    own ``weights_only`` loader. The result must be a storage."""
    import torch

    if not isinstance(data, bytes):
        raise UnsafePickleError(
            f"torch.storage._load_from_bytes expects bytes, got {type(data).__name__}"
        )
    if data[:4] == _ZIP_MAGIC:  # torch.save's current format: our checked loader
        storage = _loads_torch_zip(data)
    else:
        _check_legacy_storage_sizes(data)
        _charge(2 * len(data), "a nested storage")  # torch's reader and the storage it fills
        storage = _torch_load_weights_only(data)
    if not isinstance(storage, (torch.storage.TypedStorage, torch.UntypedStorage)):
        raise UnsafePickleError(
            f"torch.storage._load_from_bytes must give a storage, got {type(storage).__name__}"
        )
    return storage


def _torch_load_weights_only(data: bytes) -> Any:
    import torch

    try:
        return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as exc:  # torch's weights_only refusal
        raise UnsafePickleError(f"refusing nested torch.load payload: {exc}") from exc


def _check_legacy_storage_sizes(data: bytes) -> None:
    """torch's legacy format (what a pickled storage nests) is five pickles (magic number,
    protocol version, system info, the object, the storage keys) and then each storage's bytes;
    torch's loader allocates every storage at the size its record declares before it reads
    them. Refuse records that declare more bytes than follow (a few bytes asking for
    terabytes), reading the pickles with the restricted unpickler."""
    f = io.BytesIO(data)
    for _ in range(3):
        _scan_at(data, f, "nested storage")
        _RestrictedUnpickler(f).load()
    declared: dict[Any, int] = {}

    def persistent(pid: Any) -> None:
        if not (isinstance(pid, tuple) and len(pid) == 6 and pid[0] == "storage"):
            raise UnsafePickleError(f"refusing persistent id {pid!r} in a nested storage")
        storage_type, key, numel = pid[1], pid[2], pid[4]
        if not isinstance(storage_type, _StorageType) or not _is_int(numel) or numel < 0:
            raise UnsafePickleError(f"refusing storage record {pid!r} in a nested storage")
        declared.setdefault(key, numel * storage_type.dtype.itemsize)

    _scan_at(data, f, "nested storage")
    _RestrictedUnpickler(f, persistent).load()
    _scan_at(data, f, "nested storage")
    _RestrictedUnpickler(f).load()
    need = sum(declared.values()) + 8 * len(declared)  # each storage: an int64 header + bytes
    carried = len(data) - f.tell()
    if need > carried:
        raise UnsafePickleError(
            f"refusing nested storage: its records declare {need} bytes but {carried} follow"
        )


def _scan_at(data: bytes, f: io.BytesIO, what: str) -> None:
    """Check and charge the pickle that starts at ``f``'s position."""
    budget = LOAD_BUDGET.get()
    if budget is not None:
        scan(data, budget, what, f.tell())


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _rebuild_tensor_checked(
    storage: Any,
    storage_offset: Any,
    size: Any,
    stride: Any,
    requires_grad: Any,
    backward_hooks: Any,
    metadata: Any = None,
) -> Any:
    """``torch._utils._rebuild_tensor_v2`` after checking the record against its storage: torch
    grows a storage that is too small for the record (a 300-byte archive could ask for
    gigabytes of uninitialized memory, which becomes the tensor's contents), so sizes, strides
    and the offset must be non-negative ints whose highest element lies inside the storage."""
    import torch
    import torch._utils

    if not isinstance(storage, torch.storage.TypedStorage):
        raise UnsafePickleError(
            f"a tensor record needs a typed storage, got {type(storage).__name__}"
        )
    if not (
        isinstance(size, (tuple, list))
        and isinstance(stride, (tuple, list))
        and len(size) == len(stride)
        and all(_is_int(x) and x >= 0 for x in (*size, *stride))
        and _is_int(storage_offset)
        and storage_offset >= 0
    ):
        raise UnsafePickleError(
            f"refusing tensor record with size {size!r}, stride {stride!r}, "
            f"offset {storage_offset!r}: each must be a non-negative int"
        )
    if not isinstance(requires_grad, bool):
        raise UnsafePickleError(f"requires_grad must be a bool, got {type(requires_grad).__name__}")
    if backward_hooks:  # torch never pickles hooks: an empty OrderedDict
        raise UnsafePickleError("refusing a tensor record with backward hooks")
    available = (
        storage._size()
    )  # in elements; the public size() warns that TypedStorage is deprecated
    end = storage_offset
    if all(size):  # a tensor with elements: its last element must lie in the storage
        end += sum((n - 1) * st for n, st in zip(size, stride, strict=True)) + 1
    if end > available:
        raise UnsafePickleError(
            f"refusing tensor record with size {tuple(size)}, stride {tuple(stride)} and "
            f"offset {storage_offset}: it needs {end} elements but its storage holds {available}"
        )
    _charge(_TENSOR_COST, "a tensor record")
    return torch._utils._rebuild_tensor_v2(
        storage, storage_offset, tuple(size), tuple(stride), requires_grad, backward_hooks, metadata
    )


def _latin1_encode(text: str, encoding: str = "utf-8") -> bytes:
    """Stands in for ``_codecs.encode``, which protocols 0-2 use to rebuild ``bytes``; only the
    text encodings that use ever writes are admitted (no zlib/base64 codec tricks)."""
    if not isinstance(text, str) or not _is_latin1(encoding):
        raise UnsafePickleError(f"refusing _codecs.encode with encoding {encoding!r}")
    _charge(len(text) + 64, "bytes from text")
    return text.encode("latin-1")


def _is_latin1(encoding: Any) -> bool:
    return isinstance(encoding, str) and encoding.lower().replace("_", "-") in _LATIN1


def _bytes_of(what: str, args: tuple[Any, ...]) -> bytes:
    """The bytes a pickled ``bytes`` / ``bytearray`` call carries: none, a bytes-like value,
    or latin-1 text (protocols 0-2); never a size, which would allocate that many zeros."""
    if not args:
        return b""
    data = args[0]
    if len(args) == 1 and isinstance(data, (bytes, bytearray)):
        _charge(len(data) + 64, what)
        return bytes(data)
    if len(args) == 2 and isinstance(data, str) and _is_latin1(args[1]):
        _charge(len(data) + 64, what)
        return data.encode("latin-1")
    shown = ", ".join(type(a).__name__ for a in args)
    raise UnsafePickleError(
        f"refusing {what}({shown}): a pickle may rebuild {what} from its data, never allocate it "
        "from a size or another object"
    )


def _bytes_checked(*args: Any) -> bytes:
    """``builtins.bytes``: protocols 0-2 write ``b""`` as ``bytes()`` (an empty table)."""
    return _bytes_of("bytes", args)


def _bytearray_checked(*args: Any) -> bytearray:
    """``builtins.bytearray``: protocols 0-4 write one as ``bytearray(data)``."""
    return bytearray(_bytes_of("bytearray", args))


def _items_of(what: str, args: tuple[Any, ...]) -> Any:
    if not args:
        return ()
    items = args[0]
    if len(args) != 1 or not isinstance(items, (list, tuple, set, frozenset)):
        raise UnsafePickleError(f"refusing {what}() of anything but a list or tuple of items")
    _charge(_SET_ITEM_COST * len(items) + 256, what)
    return items


def _set_checked(*args: Any) -> set[Any]:
    return set(_items_of("set", args))


def _frozenset_checked(*args: Any) -> frozenset[Any]:
    return frozenset(_items_of("frozenset", args))


def _reconstructor_checked(cls: Any, base: Any, state: Any) -> Any:
    """``copyreg._reconstructor`` as protocols 0 and 1 write it for a PackedTensor:
    ``(PackedTensor, object, None)``, which only creates the instance; any other use would call
    a base class with payload arguments."""
    if cls is _packed_tensor_class() and base is object and state is None:
        return object.__new__(cls)
    raise UnsafePickleError(
        "refusing copyreg._reconstructor other than for a PackedTensor "
        f"(got {getattr(cls, '__name__', type(cls).__name__)}, "
        f"{getattr(base, '__name__', type(base).__name__)})"
    )


_BUILTINS: dict[str, Any] = {
    "set": _set_checked,
    "frozenset": _frozenset_checked,
    "bytes": _bytes_checked,
    "bytearray": _bytearray_checked,
    "complex": complex,
    # the base ``copyreg._reconstructor`` gets under protocols 0 and 1
    "object": object,
}


class _StorageType:
    """What a ``torch.<Dtype>Storage`` global resolves to: only its dtype is used (reading the
    legacy class's ``dtype`` warns, so read it once here, quietly)."""

    def __init__(self, name: str) -> None:
        import torch

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dtype = getattr(getattr(torch, name), "dtype", None)
        if not isinstance(dtype, torch.dtype):
            raise UnsafePickleError(f"refusing storage type 'torch.{name}'")
        self.dtype = dtype
        self.name = name


def _is_torch_dtype(name: str) -> bool:
    import torch

    return isinstance(getattr(torch, name, None), torch.dtype)


def _is_torch_storage_type(name: str) -> bool:
    import torch

    return name.endswith("Storage") and isinstance(getattr(torch, name, None), type)


def _resolve(module: str, name: str) -> Any:
    module = _PY2_MODULES.get(module, module)  # protocols 0-2 write Python 2 module names
    if (module, name) in _PACKED_CLASS_PATHS:
        return _packed_tensor_class()
    if module == "collections" and name == "OrderedDict":
        return collections.OrderedDict
    if module == "builtins" and name in _BUILTINS:
        return _BUILTINS[name]
    if module == "copyreg" and name == "_reconstructor":
        return _reconstructor_checked
    if module == "_codecs" and name == "encode":
        return _latin1_encode
    if module == "torch._utils" and name == "_rebuild_tensor_v2":
        return _rebuild_tensor_checked
    if module == "torch.storage" and name == "_load_from_bytes":
        return _load_storage_from_bytes
    if module == "torch" and _is_torch_dtype(name):
        import torch

        return getattr(torch, name)
    if module == "torch" and _is_torch_storage_type(name):
        return _StorageType(name)
    raise UnsafePickleError(
        f"refusing to unpickle global '{module}.{name}': a PackedTensor payload never needs it "
        "(mmpack.compat.nemo_rl admits only PackedTensor, torch tensors/storages/dtypes, "
        "OrderedDict, builtin containers and copies of bytes)"
    )


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(
        self, file: IO[bytes], persistent: Callable[[Any], Any] | None = None, **kw: Any
    ) -> None:
        super().__init__(file, **kw)
        self._persistent = persistent

    def find_class(self, module: str, name: str) -> Any:
        return _resolve(module, name)

    def persistent_load(self, pid: Any) -> Any:
        if self._persistent is None:
            raise UnsafePickleError(
                f"refusing persistent id {pid!r}: only torch.save archives may carry storages"
            )
        return self._persistent(pid)


def _loads_plain(data: bytes) -> Any:
    f = io.BytesIO(data)
    _scan_at(data, f, "pickle")
    return _RestrictedUnpickler(f).load()


def _check_archive_entries(archive: zipfile.ZipFile, size: int) -> None:
    """Only what ``torch.save`` writes: stored (uncompressed) entries, each no larger than the
    archive that holds it."""
    for info in archive.infolist():
        if info.compress_type != zipfile.ZIP_STORED:
            method = _ZIP_METHODS.get(info.compress_type, f"method {info.compress_type}")
            raise UnsafePickleError(
                f"refusing torch.save archive entry {info.filename!r} compressed with {method}: "
                "torch.save stores its entries uncompressed"
            )
        if info.file_size != info.compress_size or info.file_size > size:
            raise CorruptPickleError(
                f"not a readable torch.save archive: entry {info.filename!r} declares "
                f"{info.file_size} bytes in an archive of {size}"
            )


_ZIP_METHODS = {
    zipfile.ZIP_DEFLATED: "deflate",
    zipfile.ZIP_BZIP2: "bzip2",
    zipfile.ZIP_LZMA: "LZMA",
}


def _loads_torch_zip(data: bytes) -> Any:
    import torch

    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        _check_archive_entries(archive, len(data))
        names = archive.namelist()
        pkl = [n for n in names if n.endswith("/data.pkl") or n == "data.pkl"]
        if len(pkl) != 1:
            raise UnsafePickleError("not a torch.save archive: expected exactly one data.pkl")
        prefix = pkl[0][: -len("data.pkl")]
        if f"{prefix}byteorder" in names:
            order = archive.read(f"{prefix}byteorder")[:16].decode("ascii", "replace").strip()
            if order != sys.byteorder:
                raise UnsafePickleError(
                    f"torch.save archive is {order}-endian; this machine is {sys.byteorder}-endian"
                )
        storages: dict[str, Any] = {}

        def persistent(pid: Any) -> Any:
            if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
                raise UnsafePickleError(
                    f"refusing unknown persistent id {pid!r} in torch.save data"
                )
            storage_type, key = pid[1], pid[2]
            if not isinstance(key, str) or f"{prefix}data/{key}" not in names:
                raise UnsafePickleError(f"torch.save archive has no storage record {key!r}")
            if not isinstance(storage_type, _StorageType):
                raise UnsafePickleError(f"refusing storage type {storage_type!r}")
            dtype = storage_type.dtype
            if key not in storages:
                entry = f"{prefix}data/{key}"
                # the entry's bytes, then the storage made from them
                _charge(2 * archive.getinfo(entry).file_size, f"storage {key!r}")
                raw = archive.read(entry)
                untyped = (
                    torch.UntypedStorage.from_buffer(raw, dtype=torch.uint8)
                    if raw
                    else (torch.UntypedStorage(0))
                )
                storages[key] = untyped
            return torch.storage.TypedStorage(
                wrap_storage=storages[key], dtype=dtype, _internal=True
            )

        _charge(archive.getinfo(pkl[0]).file_size, "data.pkl")
        body = archive.read(pkl[0])
        f = io.BytesIO(body)
        _scan_at(body, f, "torch.save data.pkl")
        return _RestrictedUnpickler(f, persistent).load()


def loads(data: bytes | bytearray | memoryview, *, max_bytes: int | None = None) -> Any:
    """Unpickle ``data`` (a pickle, or the bytes of a ``torch.save`` file) with PackedTensor
    values coming back as ``mmpack.PackedTensor``.

    ``max_bytes``: the most memory the load may allocate, by default 32 times ``len(data)``
    plus 64 MiB. Raises ``UnsafePickleError`` for any global a PackedTensor payload does not
    need (or a tensor record larger than its storage, a compressed archive entry),
    ``PickleTooLargeError`` for a payload that needs more memory than ``max_bytes``,
    ``CorruptPickleError`` (with the original error chained) for bytes that do not decode,
    and ``TypeError`` for ``data`` that is not bytes-like."""
    if isinstance(data, str) or not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"loads expects bytes, got {type(data).__name__}")
    check_max_bytes(max_bytes)
    raw = bytes(data)
    budget = Budget(len(raw), max_bytes)
    token = LOAD_BUDGET.set(budget)
    restore_token = RESTORE_CHARGE.set(budget.charge)  # what restoring PackedTensor states builds
    try:
        if raw[:4] == _ZIP_MAGIC:
            return _loads_torch_zip(raw)
        return _loads_plain(raw)
    except MmpackError:
        raise
    except Exception as exc:  # the decoding boundary: UnpicklingError, EOFError, MemoryError, ...
        what = "torch.save archive" if raw[:4] == _ZIP_MAGIC else "pickle"
        raise CorruptPickleError(
            f"not a readable {what}: {type(exc).__name__}: {str(exc)[:200]}"
        ) from exc
    finally:
        RESTORE_CHARGE.reset(restore_token)
        LOAD_BUDGET.reset(token)


def load(file: str | os.PathLike[str] | IO[bytes], *, max_bytes: int | None = None) -> Any:
    """``loads`` for a path or a binary file object (a pickle or a ``torch.save`` file)."""
    check_max_bytes(max_bytes)
    if isinstance(file, (str, os.PathLike)):
        with open(file, "rb") as fh:
            return loads(fh.read(), max_bytes=max_bytes)
    return loads(file.read(), max_bytes=max_bytes)
