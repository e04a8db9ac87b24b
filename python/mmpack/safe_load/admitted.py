"""What the restricted loader admits: the globals a PackedTensor payload names, and what each may
do when a payload calls it (``REDUCE``), instantiates it (``NEWOBJ``) or gives it a state
(``BUILD``), each charged to the load's budget before it allocates.

``find_class`` gives the real objects (``bytes`` is ``bytes``, ``torch.float32`` is the dtype),
and the single gate is what may be done with them: :meth:`Admitted.call` runs a checked version
of the few callables a payload needs, found by identity; :meth:`Admitted.new` creates
PackedTensor instances only; :meth:`Admitted.build` sets the state of PackedTensor values only
(through ``mmpack.packed.pickling.format.restore``, which charges what it builds). Every other
use of an admitted object, and every other global, raises
:class:`~mmpack.errors.UnsafePickleError` before anything is called. SECURITY.md lists each
admitted global with how it is charged.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from mmpack.errors import UnsafePickleError
from mmpack.safe_load import budget as cost
from mmpack.safe_load.budget import Budget
from mmpack.safe_load.describe import describe

__all__ = ["NEMO_RL_MODULE", "Admitted", "storage_dtype"]

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
# protocols 0 to 2 write Python 2 module names
_PY2_MODULES = {"copy_reg": "copyreg", "__builtin__": "builtins"}
_LATIN1 = frozenset({"latin1", "latin-1"})
# tensor metadata torch writes: a few flags (conjugate, negative bits)
_MAX_METADATA = 16
#: How deep ``torch.storage._load_from_bytes`` may nest (a pickled storage in an archive in a
#: pickle is 2).
MAX_NESTED = 4

#: Which globals a gate resolves: a payload's, only storage types (the object pickle of a
#: nested storage), or none (the header pickles of a nested storage).
PAYLOAD, STORAGE_TYPES, NOTHING = "payload", "storage types", "nothing"

_STORAGE_DTYPES: dict[int, tuple[type, Any]] = {}


def _packed_tensor_class() -> type:
    from mmpack.packed.value import PackedTensor

    return PackedTensor


def _storage_type(name: str) -> type | None:
    """``torch.<Name>Storage``, a legacy typed storage class, or ``None``; reading its
    ``dtype`` warns that TypedStorage is deprecated, so read it once here, quietly."""
    import torch

    cls = getattr(torch, name, None) if name.endswith("Storage") else None
    if not isinstance(cls, type):
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dtype = getattr(cls, "dtype", None)
    if not isinstance(dtype, torch.dtype) or _is_quantized(dtype):
        # a quantized tensor comes from torch._utils._rebuild_qtensor (not admitted); one
        # rebuilt over its storage by _rebuild_tensor_v2 has no quantizer
        return None
    _STORAGE_DTYPES[id(cls)] = (cls, dtype)
    return cls


def _is_quantized(dtype: Any) -> bool:
    import torch

    return dtype in (torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4)


def storage_dtype(storage_type: Any) -> Any:
    """The dtype of an admitted storage class (what a persistent id names)."""
    entry = _STORAGE_DTYPES.get(id(storage_type))
    if entry is None or entry[0] is not storage_type:
        raise UnsafePickleError(f"refusing storage type {describe(storage_type)}")
    return entry[1]


def _refuse_global(module: str, name: str) -> UnsafePickleError:
    return UnsafePickleError(
        f"refusing to unpickle global '{module}.{name}': a PackedTensor payload never needs it "
        "(mmpack.compat.nemo_rl admits only PackedTensor, torch tensors/storages/dtypes, "
        "OrderedDict, builtin containers and copies of bytes)"
    )


class Admitted:
    """The gate of one restricted load (see the module docs). ``persistent`` resolves the
    persistent ids of a ``torch.save`` archive (none elsewhere); ``nested`` reads the bytes
    of ``torch.storage._load_from_bytes`` at nesting ``depth + 1``."""

    def __init__(
        self,
        budget: Budget,
        *,
        names: str = PAYLOAD,
        persistent: Callable[[Any], Any] | None = None,
        nested: Callable[[bytes, Budget, int], Any] | None = None,
        depth: int = 0,
    ) -> None:
        self.budget = budget
        self._names = names
        self._persistent = persistent
        self.nested = nested
        self.depth = depth

    def find_class(self, module: str, name: str) -> Any:
        module = _PY2_MODULES.get(module, module)
        if self._names == NOTHING:
            raise _refuse_global(module, name)
        if module == "torch":
            cls = _storage_type(name)
            if cls is not None:
                return cls
        if self._names == STORAGE_TYPES:
            raise _refuse_global(module, name)
        if (module, name) in _PACKED_CLASS_PATHS:
            return _packed_tensor_class()
        find = _GLOBALS.get((module, name))
        if find is not None:
            found = find()
            checked = _CHECKED.get((module, name))
            if checked is not None:
                _CALLS[id(found)] = (found, checked)
            return found
        if module == "torch":
            import torch

            dtype = getattr(torch, name, None)
            if isinstance(dtype, torch.dtype):
                return dtype
        raise _refuse_global(module, name)

    def call(self, func: Any, args: Any) -> Any:
        entry = _CALLS.get(id(func))
        if entry is None or entry[0] is not func:
            raise UnsafePickleError(
                f"refusing to call {describe(func)}: a payload calls only the admitted "
                "callables (PackedTensor values come from their state: NEWOBJ or "
                "copyreg._reconstructor, then BUILD)"
            )
        if type(args) is not tuple or len(args) > 8:
            raise UnsafePickleError(
                f"refusing a call of {describe(func)} with {describe(args)} as its arguments"
            )
        return entry[1](self, args)

    def new(self, cls: Any, args: Any, kwargs: Any) -> Any:
        if (
            cls is not _packed_tensor_class()
            or type(args) is not tuple
            or args
            or not (kwargs is None or (type(kwargs) is dict and not kwargs))
        ):
            raise UnsafePickleError(
                f"refusing to instantiate {describe(cls)} with {describe(args)}: a payload "
                "creates PackedTensor instances only, without arguments"
            )
        self.budget.charge(cost.INSTANCE, "a PackedTensor")
        return object.__new__(cls)

    def build(self, obj: Any, state: Any) -> None:
        if type(obj) is not _packed_tensor_class():
            raise UnsafePickleError(
                f"refusing to set the state of {describe(obj)}: a payload sets the state of "
                "PackedTensor values only (torch would, for one, resize a tensor's storage)"
            )
        if obj.__dict__:
            raise UnsafePickleError(
                "refusing a second state for one PackedTensor: a pickle sets each state once"
            )
        obj.__setstate__(state)  # type: ignore[attr-defined]  # restore charges what it builds

    def persistent(self, pid: Any) -> Any:
        if self._persistent is None:
            raise UnsafePickleError(
                f"refusing persistent id ({describe(pid)}): only torch.save archives may carry "
                "storages"
            )
        return self._persistent(pid)


# ---------------------------------------------------------------------------------------------
# the admitted callables, each checked and charged


def _is_int(value: Any) -> bool:
    return type(value) is int


def _is_latin1(encoding: Any) -> bool:
    return type(encoding) is str and encoding.lower().replace("_", "-") in _LATIN1


def _data_of(gate: Admitted, what: str, args: tuple[Any, ...]) -> Any:
    """What a pickled ``bytes`` / ``bytearray`` call copies: a bytes-like value or latin-1
    text (protocols 0 to 4), charged; never a size, which would allocate that many zeros."""
    data = args[0]
    if len(args) == 1 and type(data) in (bytes, bytearray):
        gate.budget.charge(cost.BYTES + len(data), what)
        return data
    if len(args) == 2 and type(data) is str and _is_latin1(args[1]):
        gate.budget.charge(cost.BYTES + 2 * len(data), what)  # the encoded copy, then ours
        return data.encode("latin-1")
    shown = ", ".join(type(a).__name__ for a in args)
    raise UnsafePickleError(
        f"refusing {what}({shown}): a pickle may rebuild {what} from its data, never allocate it "
        "from a size or another object"
    )


def _bytes(gate: Admitted, args: tuple[Any, ...]) -> bytes:
    """``builtins.bytes``: protocols 0 to 2 write ``b""`` as ``bytes()``."""
    if not args:
        return b""
    return bytes(_data_of(gate, "bytes", args))


def _bytearray(gate: Admitted, args: tuple[Any, ...]) -> bytearray:
    """``builtins.bytearray``: protocols 0 to 4 write one as ``bytearray(data)``."""
    if not args:
        gate.budget.charge(cost.BYTES, "bytearray")
        return bytearray()
    return bytearray(_data_of(gate, "bytearray", args))


def _items_of(gate: Admitted, what: str, args: tuple[Any, ...]) -> Any:
    if not args:
        gate.budget.charge(cost.SET, what)
        return ()
    items = args[0]
    if len(args) != 1 or type(items) not in (list, tuple, set, frozenset):
        raise UnsafePickleError(f"refusing {what}() of anything but a list or tuple of items")
    gate.budget.charge(cost.SET + cost.SET_ITEM * len(items), what)
    return items


def _set(gate: Admitted, args: tuple[Any, ...]) -> set[Any]:
    return set(_items_of(gate, "set", args))


def _frozenset(gate: Admitted, args: tuple[Any, ...]) -> frozenset[Any]:
    return frozenset(_items_of(gate, "frozenset", args))


def _complex(gate: Admitted, args: tuple[Any, ...]) -> complex:
    """``complex(real, imag)``, what ``complex.__reduce__`` writes: of numbers only (complex
    of another object would call its ``__complex__``)."""
    if not 1 <= len(args) <= 2 or not all(type(a) in (int, float) for a in args):
        raise UnsafePickleError(f"refusing complex() of {describe(args)}: it takes two numbers")
    gate.budget.charge(cost.SMALL, "a complex")
    return complex(*args)


def _ordered_dict(gate: Admitted, args: tuple[Any, ...]) -> OrderedDict[Any, Any]:
    """``collections.OrderedDict()``: every protocol writes one empty, then its items with
    ``SETITEM(S)`` (charged by the machine); built from an argument it would copy it."""
    if args:
        raise UnsafePickleError(
            f"refusing OrderedDict() of {describe(args[0])}: a pickle writes an OrderedDict "
            "empty, then its items"
        )
    gate.budget.charge(cost.ODICT, "an OrderedDict")
    return OrderedDict()


def _reconstructor(gate: Admitted, args: tuple[Any, ...]) -> Any:
    """``copyreg._reconstructor`` as protocols 0 and 1 write it for a PackedTensor:
    ``(PackedTensor, object, None)``, which only creates the instance; any other use would call
    a base class with payload arguments."""
    cls = _packed_tensor_class()
    if len(args) == 3 and args[0] is cls and args[1] is object and args[2] is None:
        gate.budget.charge(cost.INSTANCE, "a PackedTensor")
        return object.__new__(cls)
    shown = ", ".join(describe(a) for a in args[:3])
    raise UnsafePickleError(
        f"refusing copyreg._reconstructor other than for a PackedTensor (got {shown})"
    )


def _codecs_encode(gate: Admitted, args: tuple[Any, ...]) -> bytes:
    """``_codecs.encode``, which protocols 0 to 2 use to rebuild ``bytes``; only the text
    encoding that use writes is admitted (no zlib/base64 codec tricks)."""
    if len(args) != 2 or type(args[0]) is not str or not _is_latin1(args[1]):
        encoding = args[1] if len(args) == 2 else "utf-8"
        raise UnsafePickleError(
            f"refusing _codecs.encode with encoding {describe(encoding)}: only text to latin-1"
        )
    gate.budget.charge(cost.BYTES + len(args[0]), "bytes from text")
    return args[0].encode("latin-1")


def _rebuild_tensor(gate: Admitted, args: tuple[Any, ...]) -> Any:
    """``torch._utils._rebuild_tensor_v2`` after checking the record against its storage: torch
    grows a storage that is too small for the record (a 300-byte archive could ask for
    gigabytes of uninitialized memory, which becomes the tensor's contents), so sizes, strides
    and the offset must be non-negative ints whose highest element lies inside the storage.
    The tensor is a view (charged per dimension); the hooks and metadata it keeps are fresh
    copies, so that nothing the payload holds can change it after the check."""
    import torch
    import torch._utils

    if len(args) not in (6, 7):
        raise UnsafePickleError(f"a tensor record has 6 or 7 fields, got {len(args)}")
    storage, storage_offset, size, stride, requires_grad, backward_hooks = args[:6]
    metadata = args[6] if len(args) == 7 else None
    if type(storage) is not torch.storage.TypedStorage:
        raise UnsafePickleError(
            f"a tensor record needs a typed storage, got {type(storage).__name__}"
        )
    if not (
        type(size) in (tuple, list)
        and type(stride) in (tuple, list)
        and len(size) == len(stride)
        and all(_is_int(x) and x >= 0 for x in (*size, *stride))
        and _is_int(storage_offset)
        and storage_offset >= 0
    ):
        raise UnsafePickleError(
            f"refusing tensor record with size {describe(size)}, stride {describe(stride)}, "
            f"offset {describe(storage_offset)}: each must be a non-negative int"
        )
    if type(requires_grad) is not bool:
        raise UnsafePickleError(f"requires_grad must be a bool, got {type(requires_grad).__name__}")
    if type(backward_hooks) not in (OrderedDict, dict) or backward_hooks:
        raise UnsafePickleError(
            "refusing a tensor record with backward hooks (torch writes an empty OrderedDict)"
        )
    if metadata is not None and not (
        type(metadata) is dict
        and len(metadata) <= _MAX_METADATA
        and all(type(k) is str and type(v) is bool for k, v in metadata.items())
    ):
        raise UnsafePickleError(
            f"refusing tensor metadata {describe(metadata)}: torch writes a dict of flags"
        )
    available = storage._size()  # elements; the public size() warns that it is deprecated
    end = storage_offset
    if all(size):  # a tensor with elements: its last element must lie in the storage
        end += sum((n - 1) * st for n, st in zip(size, stride, strict=True)) + 1
    if end > available:
        raise UnsafePickleError(
            f"refusing tensor record with size {tuple(size)}, stride {tuple(stride)} and "
            f"offset {storage_offset}: it needs {end} elements but its storage holds {available}"
        )
    gate.budget.charge(cost.TENSOR + cost.TENSOR_DIM * len(size), "a tensor")
    return torch._utils._rebuild_tensor_v2(
        storage,
        storage_offset,
        tuple(size),
        tuple(stride),
        requires_grad,
        OrderedDict(),
        None if metadata is None else dict(metadata),
    )


def _load_from_bytes(gate: Admitted, args: tuple[Any, ...]) -> Any:
    """``torch.storage._load_from_bytes`` (which calls ``torch.load`` with
    ``weights_only=False``): its bytes are read by this loader's own formats, charged to the
    same budget, and must give a storage."""
    import torch

    if len(args) != 1 or type(args[0]) is not bytes:
        raise UnsafePickleError(
            f"torch.storage._load_from_bytes expects bytes, got {describe(args)}"
        )
    if gate.nested is None or gate.depth >= MAX_NESTED:
        raise UnsafePickleError(
            f"refusing torch.storage._load_from_bytes nested more than {MAX_NESTED} deep"
        )
    storage = gate.nested(args[0], gate.budget, gate.depth + 1)
    if type(storage) is not torch.storage.TypedStorage:
        raise UnsafePickleError(
            f"torch.storage._load_from_bytes must give a storage, got {type(storage).__name__}"
        )
    return storage


def _global(module: str, name: str) -> Callable[[], Any]:
    def find() -> Any:
        import importlib

        return getattr(importlib.import_module(module), name)

    return find


# (module, name) -> the object, found on first use (torch is imported only when named)
_GLOBALS: dict[tuple[str, str], Callable[[], Any]] = {
    ("collections", "OrderedDict"): lambda: OrderedDict,
    ("builtins", "set"): lambda: set,
    ("builtins", "frozenset"): lambda: frozenset,
    ("builtins", "bytes"): lambda: bytes,
    ("builtins", "bytearray"): lambda: bytearray,
    ("builtins", "complex"): lambda: complex,
    ("builtins", "object"): lambda: object,  # the base copyreg._reconstructor gets
    ("copyreg", "_reconstructor"): _global("copyreg", "_reconstructor"),
    ("_codecs", "encode"): _global("_codecs", "encode"),
    ("torch._utils", "_rebuild_tensor_v2"): _global("torch._utils", "_rebuild_tensor_v2"),
    ("torch.storage", "_load_from_bytes"): _global("torch.storage", "_load_from_bytes"),
}

# what a call of each admitted callable runs, by the callable's identity
_CHECKED: dict[tuple[str, str], Callable[[Admitted, tuple[Any, ...]], Any]] = {
    ("collections", "OrderedDict"): _ordered_dict,
    ("builtins", "set"): _set,
    ("builtins", "frozenset"): _frozenset,
    ("builtins", "bytes"): _bytes,
    ("builtins", "bytearray"): _bytearray,
    ("builtins", "complex"): _complex,
    ("copyreg", "_reconstructor"): _reconstructor,
    ("_codecs", "encode"): _codecs_encode,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch.storage", "_load_from_bytes"): _load_from_bytes,
}
# the same, by the callable's identity, as find_class hands each out (a payload holds no other)
_CALLS: dict[int, tuple[Any, Callable[[Admitted, tuple[Any, ...]], Any]]] = {}
