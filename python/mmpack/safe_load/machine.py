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

This module is the machine's core: reading (frames, length fields, lines), charging, the stack
and its marks, the nesting of tuples and frozensets, the load loop, the opcodes of framing and
of the stack itself, and the one table from each opcode to its handler. The handlers of the
other opcodes are functions of the machine, one module per family: ``literals`` (ints, floats,
strings, bytes), ``containers`` (tuples, lists, dicts, sets and their item opcodes), ``memo``
(put and get) and ``objects`` (globals, calls, instances, states, persistent ids, extensions).
They reach the machine only through its public methods and attributes.
"""

from __future__ import annotations

import pickle
import struct
from collections.abc import Callable
from typing import Any, Protocol

from mmpack.errors import CorruptPickleError, UnsafePickleError
from mmpack.safe_load import budget as cost
from mmpack.safe_load import containers, literals, memo, objects
from mmpack.safe_load.budget import Budget

__all__ = ["MAX_NESTING", "Gate", "Unpickler"]

#: How deep tuples and frozensets may nest (what protocols 0 to 5 write for real data is a few).
MAX_NESTING = 100

_U64 = struct.Struct("<Q")


class Gate(Protocol):
    """What a load admits: the globals a payload may name and what calling them does. Each
    method charges the objects it creates before creating them."""

    def find_class(self, module: str, name: str) -> Any: ...

    def call(self, func: Any, args: Any) -> Any: ...

    def new(self, cls: Any, args: Any, kwargs: Any) -> Any: ...

    def build(self, obj: Any, state: Any) -> None: ...

    def persistent(self, pid: Any) -> Any: ...


class Unpickler:
    """Runs pickles found in ``data`` (a pickle, or one of several back to back) against a
    budget and a gate. ``what`` names the data in error messages.

    What the opcode handlers use: ``data`` (the bytes), ``view`` (a memoryview of them),
    ``size`` (their length), ``pos`` (the next byte to read; the opcode being run is at
    ``pos - 1`` until it reads its argument), ``stack``, ``memo``, ``gate`` and ``what``, and
    the methods below. Frames, marks and the budget are the machine's own."""

    def __init__(self, data: bytes, budget: Budget, gate: Gate, what: str) -> None:
        self.data = data
        self.view = memoryview(data)
        self.size = len(data)
        self._budget = budget
        self.gate = gate
        self.what = what
        # tuples and frozensets nested 2 or more deep: id -> (object, depth); holding the
        # object keeps its id from being reused
        self._deep: dict[int, tuple[Any, int]] = {}
        budget.charge(cost.UNPICKLER, f"an unpickler for the {what}")
        self._reset(0)

    def _reset(self, start: int) -> None:
        self.pos = start
        self._limit = self.size
        self._framed = False
        self.stack: list[Any] = []
        self._metastack: list[list[Any]] = []
        self.memo: dict[int, Any] = {}
        self._result: Any = None

    def load(self, start: int = 0) -> tuple[Any, int]:
        """The value of the pickle at ``data[start]`` and the position after its ``STOP``."""
        self._reset(start)
        data = self.data
        dispatch = _DISPATCH
        while True:
            pos = self.pos
            if pos >= self._limit:
                self.take(1)  # leaves an exhausted frame or reports the end of the data
            op = data[pos]
            self.pos = pos + 1
            handler = dispatch[op]
            if handler is None:
                raise pickle.UnpicklingError(f"invalid load key, {bytes([op])!r} at {pos}")
            if handler(self):
                self.stack = []
                self._metastack = []
                self.memo = {}
                return self._result, self.pos

    # ----------------------------------------------------------------------------- reading

    def take(self, n: int, name: str | None = None, at: int = 0) -> int:
        """Consume ``n`` bytes and return where they start. A frame's bytes are read to its
        end; an opcode whose bytes cross the end is corrupt. ``name``: the opcode whose length
        field declared ``n`` (for the message)."""
        pos = self.pos
        end = pos + n
        if end > self._limit:
            if self._framed and pos == self._limit:
                self._framed = False
                self._limit = self.size
            if end > self._limit:
                if name is not None:
                    raise CorruptPickleError(
                        f"not a readable {self.what}: {name} at {at} declares {n} bytes but "
                        f"{self._limit - pos} follow"
                    )
                if self._framed:
                    raise pickle.UnpicklingError(f"pickle exhausted before end of frame at {pos}")
                raise EOFError(
                    "Ran out of input" if pos >= self.size else "pickle data was truncated"
                )
        self.pos = end
        return pos

    def line(self, fixed: int, per_byte: int, what: str) -> bytes:
        """The bytes up to the next newline (which is consumed), after charging ``fixed`` plus
        ``per_byte`` for each of them."""
        pos = self.pos
        if self._framed and pos == self._limit:
            self._framed = False
            self._limit = self.size
        end = self.data.find(b"\n", pos, self._limit)
        if end < 0:
            if self._framed:
                raise pickle.UnpicklingError(f"pickle exhausted before end of frame at {pos}")
            raise EOFError("pickle data was truncated")
        self.charge(fixed + per_byte * (end - pos), what)
        self.pos = end + 1
        return self.data[pos:end]

    def length(self, fmt: struct.Struct, name: str) -> tuple[int, int]:
        """A length field and its bytes: (length, where the bytes start)."""
        at = self.pos - 1
        (length,) = fmt.unpack_from(self.data, self.take(fmt.size))
        if length < 0:
            raise pickle.UnpicklingError(f"{name} at {at} has a negative byte count")
        return length, self.take(length, name, at)

    def charge(self, nbytes: int, what: str) -> None:
        """Charge ``nbytes`` for ``what`` to the load's budget, before it is allocated."""
        budget = self._budget
        budget.used += nbytes
        if budget.used > budget.limit:
            budget.used -= nbytes
            budget.charge(nbytes, f"{what} at byte {self.pos} of the {self.what}")

    # ----------------------------------------------------------------------------- the stack

    def pop(self) -> Any:
        stack = self.stack
        if not stack:
            raise pickle.UnpicklingError(f"unpickling stack underflow at {self.pos - 1}")
        return stack.pop()

    def top(self) -> Any:
        stack = self.stack
        if not stack:
            raise pickle.UnpicklingError(f"unpickling stack underflow at {self.pos - 1}")
        return stack[-1]

    def pop_mark(self) -> list[Any]:
        """The items above the last mark (the mark's own list), the stack below it restored."""
        if not self._metastack:
            raise pickle.UnpicklingError(f"could not find MARK at {self.pos - 1}")
        items = self.stack
        self.stack = self._metastack.pop()
        return items

    def push(self, value: Any) -> None:
        self.stack.append(value)

    # ----------------------------------------------------------------------------- nesting

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
                f"refusing a {kind} nested {depth} deep at {self.pos - 1} of the {self.what} "
                f"(at most {MAX_NESTING}): hashing it would recurse past the C stack"
            )
        if depth > 1:
            self.charge(cost.MEMO, f"a {kind} nested {depth} deep")

    def new_tuple(self, items: Any) -> tuple[Any, ...]:
        """A tuple of ``items`` (charged by the caller), refused nested too deep."""
        depth = self._nesting(items)
        self._check_depth("tuple", depth)
        value = tuple(items)
        if depth > 1:
            self._deep[id(value)] = (value, depth)
        return value

    def checked(self, value: Any) -> Any:
        """A gate's result: a frozenset nests what it holds one level deeper."""
        if isinstance(value, frozenset):
            depth = self._nesting(value)
            self._check_depth("frozenset", depth)
            if depth > 1:
                self._deep[id(value)] = (value, depth)
        return value


# --------------------------------------------------------------------------------- opcodes
# Each handler runs one opcode on the machine and returns None, or True at STOP. Here: framing
# and the stack's own opcodes; the families in their modules.

_Handler = Callable[[Unpickler], "bool | None"]


def _proto(m: Unpickler) -> None:
    proto = m.data[m.take(1)]
    if proto > 5:
        raise CorruptPickleError(f"not a readable {m.what}: unknown protocol {proto}")


def _frame(m: Unpickler) -> None:
    at = m.pos - 1
    (length,) = _U64.unpack_from(m.data, m.take(8))
    if m._framed and m.pos < m._limit:
        raise pickle.UnpicklingError(f"a frame at {at} begins before the end of the last")
    if length > m.size - m.pos:
        raise CorruptPickleError(
            f"not a readable {m.what}: a frame at {at} declares {length} bytes but "
            f"{m.size - m.pos} follow"
        )
    m._framed = True
    m._limit = m.pos + length


def _stop(m: Unpickler) -> bool:
    m._result = m.pop()
    return True


def _mark(m: Unpickler) -> None:
    m.charge(cost.REF + cost.LIST, "a mark")
    m._metastack.append(m.stack)
    m.stack = []


def _pop(m: Unpickler) -> None:
    if m.stack:
        m.stack.pop()
    else:
        m.pop_mark()


def _pop_mark(m: Unpickler) -> None:
    m.pop_mark()


def _dup(m: Unpickler) -> None:
    m.charge(cost.REF, "a reference")
    m.push(m.top())


#: Every opcode the machine runs, and its handler; any other byte is an invalid load key.
_OPCODES: dict[bytes, _Handler] = {
    # framing and the stack
    pickle.PROTO: _proto,
    pickle.FRAME: _frame,
    pickle.STOP: _stop,
    pickle.MARK: _mark,
    pickle.POP: _pop,
    pickle.POP_MARK: _pop_mark,
    pickle.DUP: _dup,
    # constants and numbers
    pickle.NONE: literals.none,
    pickle.NEWTRUE: literals.true,
    pickle.NEWFALSE: literals.false,
    pickle.INT: literals.int_,
    pickle.LONG: literals.long,
    pickle.BININT: literals.binint,
    pickle.BININT1: literals.binint1,
    pickle.BININT2: literals.binint2,
    pickle.LONG1: literals.long1,
    pickle.LONG4: literals.long4,
    pickle.FLOAT: literals.float_,
    pickle.BINFLOAT: literals.binfloat,
    # strings and bytes
    pickle.STRING: literals.string,
    pickle.BINSTRING: literals.binstring,
    pickle.SHORT_BINSTRING: literals.short_binstring,
    pickle.UNICODE: literals.unicode,
    pickle.BINUNICODE: literals.binunicode,
    pickle.SHORT_BINUNICODE: literals.short_binunicode,
    pickle.BINUNICODE8: literals.binunicode8,
    pickle.BINBYTES: literals.binbytes,
    pickle.SHORT_BINBYTES: literals.short_binbytes,
    pickle.BINBYTES8: literals.binbytes8,
    pickle.BYTEARRAY8: literals.bytearray8,
    pickle.NEXT_BUFFER: literals.buffer,
    pickle.READONLY_BUFFER: literals.buffer,
    # containers
    pickle.EMPTY_TUPLE: containers.empty_tuple,
    pickle.TUPLE: containers.tuple_,
    pickle.TUPLE1: containers.tuple1,
    pickle.TUPLE2: containers.tuple2,
    pickle.TUPLE3: containers.tuple3,
    pickle.EMPTY_LIST: containers.empty_list,
    pickle.LIST: containers.list_,
    pickle.EMPTY_DICT: containers.empty_dict,
    pickle.DICT: containers.dict_,
    pickle.EMPTY_SET: containers.empty_set,
    pickle.FROZENSET: containers.frozenset_,
    pickle.APPEND: containers.append,
    pickle.APPENDS: containers.appends,
    pickle.SETITEM: containers.setitem,
    pickle.SETITEMS: containers.setitems,
    pickle.ADDITEMS: containers.additems,
    # the memo
    pickle.PUT: memo.put,
    pickle.BINPUT: memo.binput,
    pickle.LONG_BINPUT: memo.long_binput,
    pickle.MEMOIZE: memo.memoize,
    pickle.GET: memo.get,
    pickle.BINGET: memo.binget,
    pickle.LONG_BINGET: memo.long_binget,
    # globals, calls, instances, states, persistent ids, extensions
    pickle.GLOBAL: objects.global_,
    pickle.STACK_GLOBAL: objects.stack_global,
    pickle.REDUCE: objects.reduce,
    pickle.NEWOBJ: objects.newobj,
    pickle.NEWOBJ_EX: objects.newobj_ex,
    pickle.INST: objects.inst,
    pickle.OBJ: objects.obj,
    pickle.BUILD: objects.build,
    pickle.PERSID: objects.persid,
    pickle.BINPERSID: objects.binpersid,
    pickle.EXT1: objects.ext,
    pickle.EXT2: objects.ext,
    pickle.EXT4: objects.ext,
}

# per opcode byte, its handler (a module-level table: no cycle through each instance)
_DISPATCH: list[_Handler | None] = [None] * 256
for _code, _handler in _OPCODES.items():
    _DISPATCH[ord(_code)] = _handler
