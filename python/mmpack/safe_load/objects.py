"""The opcodes that reach objects beyond literals and containers: globals (``GLOBAL``,
``STACK_GLOBAL``), calls (``REDUCE``), instances (``NEWOBJ``, ``NEWOBJ_EX``, ``INST``, ``OBJ``),
states (``BUILD``) and persistent ids (``PERSID``, ``BINPERSID``), each handed to the load's
gate (``mmpack.safe_load.machine.Gate``: which globals are admitted and what using them does and
costs), and the copyreg extension registry (``EXT1/2/4``), which is refused. Handlers of the
restricted unpickler (``mmpack.safe_load.machine``), which maps each opcode to one of them."""

from __future__ import annotations

import pickle
from typing import TYPE_CHECKING, Any

from mmpack.errors import UnsafePickleError
from mmpack.safe_load import budget as cost

if TYPE_CHECKING:
    from mmpack.safe_load.machine import Unpickler

__all__ = [
    "binpersid",
    "build",
    "ext",
    "global_",
    "inst",
    "newobj",
    "newobj_ex",
    "obj",
    "persid",
    "reduce",
    "stack_global",
]


def global_(m: Unpickler) -> None:
    module = m.line(cost.REF + cost.TEXT, cost.TEXT_PER_BYTE, "a module name")
    name = m.line(cost.TEXT, cost.TEXT_PER_BYTE, "a global name")
    m.push(m.gate.find_class(module.decode("utf-8"), name.decode("utf-8")))


def stack_global(m: Unpickler) -> None:
    name = m.pop()
    module = m.pop()
    if type(name) is not str or type(module) is not str:
        raise pickle.UnpicklingError("STACK_GLOBAL requires str")
    m.charge(cost.REF, "a global")
    m.push(m.gate.find_class(module, name))


def reduce(m: Unpickler) -> None:
    args = m.pop()
    func = m.top()
    m.stack[-1] = m.checked(m.gate.call(func, args))


def newobj(m: Unpickler) -> None:
    args = m.pop()
    cls = m.pop()
    m.charge(cost.REF, "an instance")
    m.push(m.gate.new(cls, args, None))


def newobj_ex(m: Unpickler) -> None:
    kwargs = m.pop()
    args = m.pop()
    cls = m.pop()
    m.charge(cost.REF, "an instance")
    m.push(m.gate.new(cls, args, kwargs))


def _instantiate(m: Unpickler, klass: Any, args: list[Any]) -> None:
    """``INST`` / ``OBJ`` (protocols 0 and 1): ``klass(*args)``, or ``klass.__new__`` for a
    class without arguments, as CPython does; both through the gate."""
    m.charge(cost.REF + cost.TUPLE + cost.TUPLE_ITEM * len(args), "an instance")
    if args or not isinstance(klass, type):
        m.push(m.checked(m.gate.call(klass, tuple(args))))
    else:
        m.push(m.gate.new(klass, (), None))


def inst(m: Unpickler) -> None:
    module = m.line(cost.TEXT, cost.TEXT_PER_BYTE, "a module name")
    name = m.line(cost.TEXT, cost.TEXT_PER_BYTE, "a class name")
    klass = m.gate.find_class(module.decode("ascii"), name.decode("ascii"))
    _instantiate(m, klass, m.pop_mark())


def obj(m: Unpickler) -> None:
    args = m.pop_mark()
    if not args:
        raise pickle.UnpicklingError(f"unpickling stack underflow at {m.pos - 1}")
    _instantiate(m, args[0], args[1:])


def build(m: Unpickler) -> None:
    state = m.pop()
    m.gate.build(m.top(), state)


def persid(m: Unpickler) -> None:
    pid = m.line(cost.REF + cost.TEXT, cost.TEXT_PER_BYTE, "a persistent id")
    m.push(m.gate.persistent(pid.decode("ascii")))


def binpersid(m: Unpickler) -> None:
    pid = m.pop()
    m.charge(cost.REF, "a persistent object")
    m.push(m.gate.persistent(pid))


def ext(m: Unpickler) -> None:
    raise UnsafePickleError(
        f"refusing the extension code at {m.pos - 1} of the {m.what}: the copyreg "
        "extension registry is not admitted"
    )
