"""A restricted unpickler for PackedTensor payloads: read pickles written by NeMo-RL or mmpack
into ``mmpack.PackedTensor`` objects without trusting them.

``loads(data)`` / ``load(file)`` read pickles written by NeMo-RL (``pickle``, ``cloudpickle`` or
``torch.save``; the old three-field ``__dict__`` state and the current six-field one; values nested
in dicts, lists and tuples) into mmpack objects, without ``nemo_rl`` installed and without
``mmpack.compat.nemo_rl.install()``. Both are re-exported as ``mmpack.compat.nemo_rl.loads`` /
``load``. Their unpickler admits only what a PackedTensor payload needs:

* the PackedTensor class paths (NeMo-RL's and mmpack's), mapped to ``mmpack.PackedTensor``;
* torch's tensor rebuild function (checked against its storage first), storage types and
  dtypes;
* ``collections.OrderedDict``, a few builtin containers, ``copyreg._reconstructor`` (protocols 0
  and 1) and ``_codecs.encode`` (bytes under protocol 2).

Any other global raises :class:`mmpack.errors.UnsafePickleError` naming it (for example
``os.system``), before anything is called, and so does a tensor record that does not fit inside
its storage (torch would grow the storage). Bytes that do not decode (truncated, bit-flipped)
raise :class:`mmpack.errors.CorruptPickleError` with the original error chained. Both are
``pickle.UnpicklingError`` subclasses. Tensors always load onto the CPU.
"""

from __future__ import annotations

import builtins
import collections
import copyreg
import io
import os
import pickle
import sys
import warnings
import zipfile
from collections.abc import Callable
from typing import IO, Any

from mmpack.compat import NEMO_RL_MODULE
from mmpack.errors import CorruptPickleError, MmpackError, UnsafePickleError

__all__ = ["load", "loads"]

# Class paths whose payload is a PackedTensor ``__dict__`` state.
_PACKED_CLASS_PATHS = frozenset(
    {
        (NEMO_RL_MODULE, "PackedTensor"),
        ("mmpack.packed", "PackedTensor"),
        ("mmpack", "PackedTensor"),
    }
)
# builtins that pickles reference by name (containers and bytes use opcodes); ``object`` is the
# base ``copyreg._reconstructor`` gets under protocols 0 and 1
_BUILTINS = frozenset({"set", "frozenset", "bytearray", "complex", "object"})
_ZIP_MAGIC = b"PK\x03\x04"
_PY2_MODULES = {"copy_reg": "copyreg", "__builtin__": "builtins"}


def _packed_tensor_class() -> type:
    from mmpack.packed import PackedTensor

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
        _RestrictedUnpickler(f).load()
    declared: dict[Any, int] = {}

    def persistent(pid: Any) -> None:
        if not (isinstance(pid, tuple) and len(pid) == 6 and pid[0] == "storage"):
            raise UnsafePickleError(f"refusing persistent id {pid!r} in a nested storage")
        storage_type, key, numel = pid[1], pid[2], pid[4]
        if not isinstance(storage_type, _StorageType) or not _is_int(numel) or numel < 0:
            raise UnsafePickleError(f"refusing storage record {pid!r} in a nested storage")
        declared.setdefault(key, numel * storage_type.dtype.itemsize)

    _RestrictedUnpickler(f, persistent).load()
    _RestrictedUnpickler(f).load()
    need = sum(declared.values()) + 8 * len(declared)  # each storage: an int64 header + bytes
    carried = len(data) - f.tell()
    if need > carried:
        raise UnsafePickleError(
            f"refusing nested storage: its records declare {need} bytes but {carried} follow"
        )


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
    return torch._utils._rebuild_tensor_v2(
        storage, storage_offset, tuple(size), tuple(stride), requires_grad, backward_hooks, metadata
    )


def _latin1_encode(text: str, encoding: str = "utf-8") -> bytes:
    """Stands in for ``_codecs.encode``, which protocols 0-2 use to rebuild ``bytes``; only the
    text encodings that use ever writes are admitted (no zlib/base64 codec tricks)."""
    if not isinstance(text, str) or encoding.lower().replace("_", "-") not in {"latin1", "latin-1"}:
        raise UnsafePickleError(f"refusing _codecs.encode with encoding {encoding!r}")
    return text.encode("latin-1")


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
        return getattr(builtins, name)
    if module == "copyreg" and name == "_reconstructor":
        return copyreg._reconstructor  # type: ignore[attr-defined]
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
        "OrderedDict and builtin containers)"
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
    return _RestrictedUnpickler(io.BytesIO(data)).load()


def _loads_torch_zip(data: bytes) -> Any:
    import torch

    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        names = archive.namelist()
        pkl = [n for n in names if n.endswith("/data.pkl") or n == "data.pkl"]
        if len(pkl) != 1:
            raise UnsafePickleError("not a torch.save archive: expected exactly one data.pkl")
        prefix = pkl[0][: -len("data.pkl")]
        if f"{prefix}byteorder" in names:
            order = archive.read(f"{prefix}byteorder").decode("ascii", "replace").strip()
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
                raw = archive.read(f"{prefix}data/{key}")
                untyped = (
                    torch.UntypedStorage.from_buffer(raw, dtype=torch.uint8)
                    if raw
                    else (torch.UntypedStorage(0))
                )
                storages[key] = untyped
            return torch.storage.TypedStorage(
                wrap_storage=storages[key], dtype=dtype, _internal=True
            )

        return _RestrictedUnpickler(io.BytesIO(archive.read(pkl[0])), persistent).load()


def loads(data: bytes | bytearray | memoryview) -> Any:
    """Unpickle ``data`` (a pickle, or the bytes of a ``torch.save`` file) with PackedTensor
    values coming back as ``mmpack.PackedTensor``. Raises ``UnsafePickleError`` for any global
    a PackedTensor payload does not need (or a tensor record larger than its storage),
    ``CorruptPickleError`` (with the original error chained) for bytes that do not decode, and
    ``TypeError`` for ``data`` that is not bytes-like."""
    if isinstance(data, str) or not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"loads expects bytes, got {type(data).__name__}")
    raw = bytes(data)
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


def load(file: str | os.PathLike[str] | IO[bytes]) -> Any:
    """``loads`` for a path or a binary file object (a pickle or a ``torch.save`` file)."""
    if isinstance(file, (str, os.PathLike)):
        with open(file, "rb") as fh:
            return loads(fh.read())
    return loads(file.read())
