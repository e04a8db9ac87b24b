"""The restricted loader's unpickler: one pass over the exact bytes of one pickle, each opcode
charged to the load's budget and then executed.

There is no separate check of the opcodes: the bytes this machine charges are the bytes it
executes, frames included, so no payload can show one stream to a check and another to the
unpickler. Every object an opcode creates and every slot it adds to a container is charged
(``mmpack.safe_load.budget``) before it exists; what a global does when called, instantiated or
given a state is the :class:`Gate`'s to decide and charge. The semantics are those of CPython's
``pickle`` (protocols 0 to 5), with these refusals:

* a length field (bytes, strings, ints, frames) larger than the bytes that follow, an opcode
  that runs past the end of its frame, a memo index beyond the pickle's size, a protocol above
  5 and out-of-band buffers (:class:`~mmpack.errors.CorruptPickleError`);
* ``APPEND(S)`` to anything but a ``list``, ``SETITEM(S)`` to anything but a ``dict`` or an
  ``OrderedDict``, ``ADDITEMS`` to anything but a ``set``: CPython would call the object's own
  ``append`` / ``__setitem__`` / ``add`` (``tensor.add`` broadcasts two small tensors into a
  huge one); the copyreg extension registry (``EXT1/2/4``); a tuple or frozenset nested more
  than :data:`MAX_NESTING` deep (hashing one recurses in C, which a deep enough nesting
  overflows) (:class:`~mmpack.errors.UnsafePickleError`).
"""

from __future__ import annotations

import codecs
import pickle
import struct
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol

from mmpack.errors import CorruptPickleError, UnsafePickleError
from mmpack.safe_load import budget as cost
from mmpack.safe_load.budget import Budget

__all__ = ["MAX_NESTING", "Gate", "Unpickler", "describe"]

#: How deep tuples and frozensets may nest (what protocols 0 to 5 write for real data is a few).
MAX_NESTING = 100

# the longest FLOAT line (repr of a float is at most 24 characters)
_MAX_FLOAT_LINE = 64

_I32 = struct.Struct("<i")
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_F64 = struct.Struct(">d")
_ODICT = OrderedDict


class Gate(Protocol):
    """What a load admits: the globals a payload may name and what calling them does. Each
    method charges the objects it creates before creating them."""

    def find_class(self, module: str, name: str) -> Any: ...

    def call(self, func: Any, args: Any) -> Any: ...

    def new(self, cls: Any, args: Any, kwargs: Any) -> Any: ...

    def build(self, obj: Any, state: Any) -> None: ...

    def persistent(self, pid: Any) -> Any: ...


def describe(value: Any) -> str:
    """A short description of a payload value for an error message: its type and size, never
    its repr (the repr of a list that holds one large string many times is quadratic)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an int of {value.bit_length()} bits"
    if value is None or isinstance(value, (bool, int, float)):
        return repr(value)
    if isinstance(value, (str, bytes)) and len(value) <= 40:
        return repr(value)
    if isinstance(value, (str, bytes, bytearray, tuple, list, dict, set, frozenset)):
        return f"a {type(value).__name__} of {len(value)}"
    if isinstance(value, type):
        return f"{value.__module__}.{value.__qualname__}"
    return f"a {type(value).__module__}.{type(value).__qualname__}"


class Unpickler:
    """Runs pickles found in ``data`` (a pickle, or one of several back to back) against a
    budget and a gate. ``what`` names the data in error messages."""

    def __init__(self, data: bytes, budget: Budget, gate: Gate, what: str) -> None:
        self._data = data
        self._view = memoryview(data)
        self._n = len(data)
        self._budget = budget
        self._gate = gate
        self._what = what
        # tuples and frozensets nested 2 or more deep: id -> (object, depth); holding the
        # object keeps its id from being reused
        self._deep: dict[int, tuple[Any, int]] = {}
        budget.charge(cost.UNPICKLER, f"an unpickler for the {what}")
        self._reset(0)

    def _reset(self, start: int) -> None:
        self._pos = start
        self._limit = self._n
        self._framed = False
        self._stack: list[Any] = []
        self._metastack: list[list[Any]] = []
        self._memo: dict[int, Any] = {}
        self._result: Any = None

    def load(self, start: int = 0) -> tuple[Any, int]:
        """The value of the pickle at ``data[start]`` and the position after its ``STOP``."""
        self._reset(start)
        data = self._data
        dispatch = _DISPATCH
        while True:
            pos = self._pos
            if pos >= self._limit:
                self._take(1)  # leaves an exhausted frame or reports the end of the data
            op = data[pos]
            self._pos = pos + 1
            handler = dispatch[op]
            if handler is None:
                raise pickle.UnpicklingError(f"invalid load key, {bytes([op])!r} at {pos}")
            if handler(self):
                self._stack = []
                self._metastack = []
                self._memo = {}
                return self._result, self._pos

    # ----------------------------------------------------------------------------- reading

    def _take(self, n: int, name: str | None = None, at: int = 0) -> int:
        """Consume ``n`` bytes and return where they start. A frame's bytes are read to its
        end; an opcode whose bytes cross the end is corrupt. ``name``: the opcode whose length
        field declared ``n`` (for the message)."""
        pos = self._pos
        end = pos + n
        if end > self._limit:
            if self._framed and pos == self._limit:
                self._framed = False
                self._limit = self._n
            if end > self._limit:
                if name is not None:
                    raise CorruptPickleError(
                        f"not a readable {self._what}: {name} at {at} declares {n} bytes but "
                        f"{self._limit - pos} follow"
                    )
                if self._framed:
                    raise pickle.UnpicklingError(f"pickle exhausted before end of frame at {pos}")
                raise EOFError(
                    "Ran out of input" if pos >= self._n else "pickle data was truncated"
                )
        self._pos = end
        return pos

    def _line(self, fixed: int, per_byte: int, what: str) -> bytes:
        """The bytes up to the next newline (which is consumed), after charging ``fixed`` plus
        ``per_byte`` for each of them."""
        pos = self._pos
        if self._framed and pos == self._limit:
            self._framed = False
            self._limit = self._n
        end = self._data.find(b"\n", pos, self._limit)
        if end < 0:
            if self._framed:
                raise pickle.UnpicklingError(f"pickle exhausted before end of frame at {pos}")
            raise EOFError("pickle data was truncated")
        self._charge(fixed + per_byte * (end - pos), what)
        self._pos = end + 1
        return self._data[pos:end]

    def _length(self, fmt: struct.Struct, name: str) -> tuple[int, int]:
        """A length field and its bytes: (length, where the bytes start)."""
        at = self._pos - 1
        (length,) = fmt.unpack_from(self._data, self._take(fmt.size))
        if length < 0:
            raise pickle.UnpicklingError(f"{name} at {at} has a negative byte count")
        return length, self._take(length, name, at)

    def _charge(self, nbytes: int, what: str) -> None:
        budget = self._budget
        budget.used += nbytes
        if budget.used > budget.limit:
            budget.used -= nbytes
            budget.charge(nbytes, f"{what} at byte {self._pos} of the {self._what}")

    # ----------------------------------------------------------------------------- the stack

    def _pop(self) -> Any:
        stack = self._stack
        if not stack:
            raise pickle.UnpicklingError(f"unpickling stack underflow at {self._pos - 1}")
        return stack.pop()

    def _top(self) -> Any:
        stack = self._stack
        if not stack:
            raise pickle.UnpicklingError(f"unpickling stack underflow at {self._pos - 1}")
        return stack[-1]

    def _pop_mark(self) -> list[Any]:
        if not self._metastack:
            raise pickle.UnpicklingError(f"could not find MARK at {self._pos - 1}")
        items = self._stack
        self._stack = self._metastack.pop()
        return items

    def _push(self, value: Any) -> None:
        self._stack.append(value)

    def _nesting(self, items: Any) -> int:
        """1 + the deepest tuple or frozenset among ``items``."""
        deep = self._deep
        depth = 0
        for item in items:
            if isinstance(item, (tuple, frozenset)):
                d = deep[id(item)][1] if id(item) in deep else 1
                if d > depth:
                    depth = d
        return depth + 1

    def _check_depth(self, kind: str, depth: int) -> None:
        if depth > MAX_NESTING:
            raise UnsafePickleError(
                f"refusing a {kind} nested {depth} deep at {self._pos - 1} of the {self._what} "
                f"(at most {MAX_NESTING}): hashing it would recurse past the C stack"
            )
        if depth > 1:
            self._charge(cost.MEMO, f"a {kind} nested {depth} deep")

    def _tuple(self, items: Any) -> tuple[Any, ...]:
        depth = self._nesting(items)
        self._check_depth("tuple", depth)
        value = tuple(items)
        if depth > 1:
            self._deep[id(value)] = (value, depth)
        return value

    def _checked(self, value: Any) -> Any:
        """A gate's result: a frozenset nests what it holds one level deeper."""
        if isinstance(value, frozenset):
            depth = self._nesting(value)
            self._check_depth("frozenset", depth)
            if depth > 1:
                self._deep[id(value)] = (value, depth)
        return value

    # ----------------------------------------------------------------------------- opcodes
    # Each returns None, or True at STOP.

    def _proto(self) -> None:
        proto = self._data[self._take(1)]
        if proto > 5:
            raise CorruptPickleError(f"not a readable {self._what}: unknown protocol {proto}")

    def _frame(self) -> None:
        at = self._pos - 1
        (length,) = _U64.unpack_from(self._data, self._take(8))
        if self._framed and self._pos < self._limit:
            raise pickle.UnpicklingError(f"a frame at {at} begins before the end of the last")
        if length > self._n - self._pos:
            raise CorruptPickleError(
                f"not a readable {self._what}: a frame at {at} declares {length} bytes but "
                f"{self._n - self._pos} follow"
            )
        self._framed = True
        self._limit = self._pos + length

    def _stop(self) -> bool:
        self._result = self._pop()
        return True

    def _mark(self) -> None:
        self._charge(cost.REF + cost.LIST, "a mark")
        self._metastack.append(self._stack)
        self._stack = []

    def _pop_op(self) -> None:
        if self._stack:
            self._stack.pop()
        else:
            self._pop_mark()

    def _pop_mark_op(self) -> None:
        self._pop_mark()

    def _dup(self) -> None:
        self._charge(cost.REF, "a reference")
        self._push(self._top())

    # --- constants and numbers

    def _none(self) -> None:
        self._charge(cost.REF, "None")
        self._push(None)

    def _true(self) -> None:
        self._charge(cost.REF, "True")
        self._push(True)

    def _false(self) -> None:
        self._charge(cost.REF, "False")
        self._push(False)

    def _int(self) -> None:
        line = self._line(cost.REF + cost.SMALL, cost.INT_PER_BYTE, "an int")
        if line == b"00":
            self._push(False)
        elif line == b"01":
            self._push(True)
        else:
            self._push(int(line, 0))

    def _long(self) -> None:
        line = self._line(cost.REF + cost.SMALL, cost.INT_PER_BYTE, "an int")
        if line.endswith(b"L"):
            line = line[:-1]
        self._push(int(line, 0))

    def _binint(self) -> None:
        self._charge(cost.REF + cost.SMALL, "an int")
        self._push(_I32.unpack_from(self._data, self._take(4))[0])

    def _binint1(self) -> None:
        self._charge(cost.REF + cost.SMALL, "an int")
        self._push(self._data[self._take(1)])

    def _binint2(self) -> None:
        self._charge(cost.REF + cost.SMALL, "an int")
        self._push(_U16.unpack_from(self._data, self._take(2))[0])

    def _long1(self) -> None:
        at = self._pos - 1
        n = self._data[self._take(1)]
        start = self._take(n, "LONG1", at)
        self._charge(cost.REF + cost.SMALL + cost.INT_PER_BYTE * n, "an int")
        self._push(int.from_bytes(self._view[start : start + n], "little", signed=True))

    def _long4(self) -> None:
        n, start = self._length(_I32, "LONG4")
        self._charge(cost.REF + cost.SMALL + cost.INT_PER_BYTE * n, "an int")
        self._push(int.from_bytes(self._view[start : start + n], "little", signed=True))

    def _float(self) -> None:
        line = self._line(cost.REF + cost.SMALL, 3, "a float")
        if len(line) > _MAX_FLOAT_LINE:  # float()'s error would hold a repr of the whole line
            raise pickle.UnpicklingError(
                f"a FLOAT of {len(line)} bytes at {self._pos - len(line) - 2}: a pickler writes "
                f"repr(float), at most {_MAX_FLOAT_LINE}"
            )
        self._push(float(line))

    def _binfloat(self) -> None:
        self._charge(cost.REF + cost.SMALL, "a float")
        self._push(_F64.unpack_from(self._data, self._take(8))[0])

    # --- strings and bytes

    def _text_cost(self, nbytes: int) -> None:
        self._charge(cost.REF + cost.TEXT + cost.TEXT_PER_BYTE * nbytes, "a string")

    def _string(self) -> None:
        line = self._line(cost.REF + cost.TEXT, cost.TEXT_PER_BYTE, "a string")
        if len(line) < 2 or line[0] != line[-1] or line[0] not in b"\"'":
            raise pickle.UnpicklingError("the STRING opcode argument must be quoted")
        self._push(codecs.escape_decode(line[1:-1])[0].decode("ascii"))

    def _counted_string(self, fmt: struct.Struct, name: str) -> None:
        n, start = self._length(fmt, name)
        self._text_cost(n)
        self._push(codecs.ascii_decode(self._view[start : start + n])[0])

    def _binstring(self) -> None:
        self._counted_string(_I32, "BINSTRING")

    def _short_binstring(self) -> None:
        at = self._pos - 1
        n = self._data[self._take(1)]
        start = self._take(n, "SHORT_BINSTRING", at)
        self._text_cost(n)
        self._push(codecs.ascii_decode(self._view[start : start + n])[0])

    def _unicode(self) -> None:
        line = self._line(cost.REF + cost.TEXT, cost.TEXT_PER_BYTE, "a string")
        self._push(codecs.raw_unicode_escape_decode(line)[0])

    def _utf8(self, n: int, start: int) -> None:
        self._text_cost(n)
        self._push(codecs.utf_8_decode(self._view[start : start + n], "surrogatepass", True)[0])

    def _binunicode(self) -> None:
        self._utf8(*self._length(_U32, "BINUNICODE"))

    def _short_binunicode(self) -> None:
        at = self._pos - 1
        n = self._data[self._take(1)]
        self._utf8(n, self._take(n, "SHORT_BINUNICODE", at))

    def _binunicode8(self) -> None:
        self._utf8(*self._length(_U64, "BINUNICODE8"))

    def _bytes(self, n: int, start: int) -> None:
        self._charge(cost.REF + cost.BYTES + n, "bytes")
        self._push(self._data[start : start + n])

    def _binbytes(self) -> None:
        self._bytes(*self._length(_U32, "BINBYTES"))

    def _short_binbytes(self) -> None:
        at = self._pos - 1
        n = self._data[self._take(1)]
        self._bytes(n, self._take(n, "SHORT_BINBYTES", at))

    def _binbytes8(self) -> None:
        self._bytes(*self._length(_U64, "BINBYTES8"))

    def _bytearray8(self) -> None:
        n, start = self._length(_U64, "BYTEARRAY8")
        self._charge(cost.REF + cost.BYTES + n, "a bytearray")
        self._push(bytearray(self._view[start : start + n]))

    def _buffer(self) -> None:
        raise CorruptPickleError(
            f"not a readable {self._what}: out-of-band buffers (at {self._pos - 1}) are not "
            "supported"
        )

    # --- containers

    def _empty_tuple(self) -> None:
        self._charge(cost.REF, "a tuple")
        self._push(())

    def _tuple_op(self) -> None:
        items = self._pop_mark()
        self._charge(cost.REF + cost.TUPLE + cost.TUPLE_ITEM * len(items), "a tuple")
        self._push(self._tuple(items))

    def _tuple_n(self, n: int) -> None:
        stack = self._stack
        if len(stack) < n:
            raise pickle.UnpicklingError(f"unpickling stack underflow at {self._pos - 1}")
        self._charge(cost.TUPLE + cost.TUPLE_ITEM * n, "a tuple")
        value = self._tuple(stack[-n:])
        del stack[-n:]
        stack.append(value)

    def _tuple1(self) -> None:
        self._tuple_n(1)

    def _tuple2(self) -> None:
        self._tuple_n(2)

    def _tuple3(self) -> None:
        self._tuple_n(3)

    def _empty_list(self) -> None:
        self._charge(cost.REF + cost.LIST, "a list")
        self._push([])

    def _list(self) -> None:
        items = self._pop_mark()  # the mark's list, charged as it grew, becomes the value
        self._charge(cost.REF, "a list")
        self._push(items)

    def _empty_dict(self) -> None:
        self._charge(cost.REF + cost.DICT, "a dict")
        self._push({})

    def _dict(self) -> None:
        items = self._pop_mark()
        if len(items) % 2:
            raise pickle.UnpicklingError(f"odd number of items for DICT at {self._pos - 1}")
        self._charge(cost.REF + cost.DICT + cost.DICT_ITEM * (len(items) // 2), "a dict")
        self._push({items[i]: items[i + 1] for i in range(0, len(items), 2)})

    def _empty_set(self) -> None:
        self._charge(cost.REF + cost.SET, "a set")
        self._push(set())

    def _frozenset(self) -> None:
        items = self._pop_mark()
        self._charge(cost.REF + cost.SET + cost.SET_ITEM * len(items), "a frozenset")
        self._push(self._checked(frozenset(items)))

    def _target(self, kinds: tuple[type, ...], op: str, what: str) -> Any:
        target = self._top()
        if type(target) not in kinds:
            raise UnsafePickleError(
                f"refusing {op} at {self._pos - 1} of the {self._what} to {describe(target)}: "
                f"only {what} grow (anything else would run the object's own method)"
            )
        return target

    def _append(self) -> None:
        value = self._pop()
        target = self._target((list,), "APPEND", "lists")
        self._charge(cost.REF, "a list item")
        target.append(value)

    def _appends(self) -> None:
        items = self._pop_mark()
        target = self._target((list,), "APPENDS", "lists")
        self._charge(cost.REF * len(items), "list items")
        target.extend(items)

    def _item_cost(self, target: Any, n: int) -> None:
        per = cost.ODICT_ITEM if type(target) is _ODICT else cost.DICT_ITEM
        self._charge(per * n, "dict items")

    def _setitem(self) -> None:
        value = self._pop()
        key = self._pop()
        target = self._target((dict, _ODICT), "SETITEM", "dicts")
        self._item_cost(target, 1)
        target[key] = value

    def _setitems(self) -> None:
        items = self._pop_mark()
        target = self._target((dict, _ODICT), "SETITEMS", "dicts")
        if len(items) % 2:
            raise pickle.UnpicklingError(f"odd number of items for SETITEMS at {self._pos - 1}")
        self._item_cost(target, len(items) // 2)
        for i in range(0, len(items), 2):
            target[items[i]] = items[i + 1]

    def _additems(self) -> None:
        items = self._pop_mark()
        target = self._target((set,), "ADDITEMS", "sets")
        self._charge(cost.SET_ITEM * len(items), "set members")
        target.update(items)

    # --- the memo

    def _memo_put(self, index: int) -> None:
        if index < 0:
            raise pickle.UnpicklingError(f"negative memo index at {self._pos}")
        if index >= self._n:  # a pickler numbers its memo entries from 0, one per object
            raise CorruptPickleError(
                f"not a readable {self._what}: memo index {index} at {self._pos} is beyond its "
                f"{self._n} bytes"
            )
        self._charge(cost.MEMO, "a memo entry")
        self._memo[index] = self._top()

    def _memo_get(self, index: int) -> None:
        try:
            value = self._memo[index]
        except KeyError:
            raise pickle.UnpicklingError(f"memo value not found at index {index}") from None
        self._charge(cost.REF, "a reference")
        self._push(value)

    def _put(self) -> None:
        self._memo_put(int(self._line(0, cost.INT_PER_BYTE, "a memo index")))

    def _binput(self) -> None:
        self._memo_put(self._data[self._take(1)])

    def _long_binput(self) -> None:
        self._memo_put(_U32.unpack_from(self._data, self._take(4))[0])

    def _memoize(self) -> None:
        self._memo_put(len(self._memo))

    def _get(self) -> None:
        self._memo_get(int(self._line(0, cost.INT_PER_BYTE, "a memo index")))

    def _binget(self) -> None:
        self._memo_get(self._data[self._take(1)])

    def _long_binget(self) -> None:
        self._memo_get(_U32.unpack_from(self._data, self._take(4))[0])

    # --- globals, calls, states

    def _global(self) -> None:
        module = self._line(cost.REF + cost.TEXT, cost.TEXT_PER_BYTE, "a module name")
        name = self._line(cost.TEXT, cost.TEXT_PER_BYTE, "a global name")
        self._push(self._gate.find_class(module.decode("utf-8"), name.decode("utf-8")))

    def _stack_global(self) -> None:
        name = self._pop()
        module = self._pop()
        if type(name) is not str or type(module) is not str:
            raise pickle.UnpicklingError("STACK_GLOBAL requires str")
        self._charge(cost.REF, "a global")
        self._push(self._gate.find_class(module, name))

    def _reduce(self) -> None:
        args = self._pop()
        func = self._top()
        self._stack[-1] = self._checked(self._gate.call(func, args))

    def _newobj(self) -> None:
        args = self._pop()
        cls = self._pop()
        self._charge(cost.REF, "an instance")
        self._push(self._gate.new(cls, args, None))

    def _newobj_ex(self) -> None:
        kwargs = self._pop()
        args = self._pop()
        cls = self._pop()
        self._charge(cost.REF, "an instance")
        self._push(self._gate.new(cls, args, kwargs))

    def _instantiate(self, klass: Any, args: list[Any]) -> None:
        """``INST`` / ``OBJ`` (protocols 0 and 1): ``klass(*args)``, or ``klass.__new__`` for a
        class without arguments, as CPython does; both through the gate."""
        self._charge(cost.REF + cost.TUPLE + cost.TUPLE_ITEM * len(args), "an instance")
        if args or not isinstance(klass, type):
            self._push(self._checked(self._gate.call(klass, tuple(args))))
        else:
            self._push(self._gate.new(klass, (), None))

    def _inst(self) -> None:
        module = self._line(cost.TEXT, cost.TEXT_PER_BYTE, "a module name")
        name = self._line(cost.TEXT, cost.TEXT_PER_BYTE, "a class name")
        klass = self._gate.find_class(module.decode("ascii"), name.decode("ascii"))
        self._instantiate(klass, self._pop_mark())

    def _obj(self) -> None:
        args = self._pop_mark()
        if not args:
            raise pickle.UnpicklingError(f"unpickling stack underflow at {self._pos - 1}")
        self._instantiate(args[0], args[1:])

    def _build(self) -> None:
        state = self._pop()
        self._gate.build(self._top(), state)

    def _persid(self) -> None:
        pid = self._line(cost.REF + cost.TEXT, cost.TEXT_PER_BYTE, "a persistent id")
        self._push(self._gate.persistent(pid.decode("ascii")))

    def _binpersid(self) -> None:
        pid = self._pop()
        self._charge(cost.REF, "a persistent object")
        self._push(self._gate.persistent(pid))

    def _ext(self) -> None:
        raise UnsafePickleError(
            f"refusing the extension code at {self._pos - 1} of the {self._what}: the copyreg "
            "extension registry is not admitted"
        )


_OPCODES: dict[int, str] = {
    ord(code): name
    for code, name in {
        "(": "_mark",
        ".": "_stop",
        "0": "_pop_op",
        "1": "_pop_mark_op",
        "2": "_dup",
        "F": "_float",
        "I": "_int",
        "J": "_binint",
        "K": "_binint1",
        "L": "_long",
        "M": "_binint2",
        "N": "_none",
        "P": "_persid",
        "Q": "_binpersid",
        "R": "_reduce",
        "S": "_string",
        "T": "_binstring",
        "U": "_short_binstring",
        "V": "_unicode",
        "X": "_binunicode",
        "a": "_append",
        "b": "_build",
        "c": "_global",
        "d": "_dict",
        "}": "_empty_dict",
        "e": "_appends",
        "g": "_get",
        "h": "_binget",
        "i": "_inst",
        "j": "_long_binget",
        "l": "_list",
        "]": "_empty_list",
        "o": "_obj",
        "p": "_put",
        "q": "_binput",
        "r": "_long_binput",
        "s": "_setitem",
        "t": "_tuple_op",
        ")": "_empty_tuple",
        "u": "_setitems",
        "G": "_binfloat",
        "B": "_binbytes",
        "C": "_short_binbytes",
        "\x80": "_proto",
        "\x81": "_newobj",
        "\x82": "_ext",
        "\x83": "_ext",
        "\x84": "_ext",
        "\x85": "_tuple1",
        "\x86": "_tuple2",
        "\x87": "_tuple3",
        "\x88": "_true",
        "\x89": "_false",
        "\x8a": "_long1",
        "\x8b": "_long4",
        "\x8c": "_short_binunicode",
        "\x8d": "_binunicode8",
        "\x8e": "_binbytes8",
        "\x8f": "_empty_set",
        "\x90": "_additems",
        "\x91": "_frozenset",
        "\x92": "_newobj_ex",
        "\x93": "_stack_global",
        "\x94": "_memoize",
        "\x95": "_frame",
        "\x96": "_bytearray8",
        "\x97": "_buffer",
        "\x98": "_buffer",
    }.items()
}

# per opcode byte, the method that runs it (a class-level table: no cycle through each instance)
_DISPATCH: list[Callable[[Unpickler], bool | None] | None] = [None] * 256
for _code, _name in _OPCODES.items():
    _DISPATCH[_code] = getattr(Unpickler, _name)
