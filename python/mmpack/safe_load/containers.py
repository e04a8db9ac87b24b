"""The opcodes of containers: tuples, lists, dicts, sets and frozensets, and the opcodes that add
items to one (``APPEND(S)``, ``SETITEM(S)``, ``ADDITEMS``), which grow only a ``list``, a
``dict`` or ``OrderedDict`` and a ``set`` (on anything else CPython would run the object's own
method). Each container and each slot is charged before it exists; tuples and frozensets are
refused nested too deep (``Unpickler.new_tuple`` / ``Unpickler.checked``). Handlers of the
restricted unpickler (``mmpack.safe_load.machine``), which maps each opcode to one of them."""

from __future__ import annotations

import pickle
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from mmpack.errors import UnsafePickleError
from mmpack.safe_load import budget as cost
from mmpack.safe_load.describe import describe

if TYPE_CHECKING:
    from mmpack.safe_load.machine import Unpickler

__all__ = [
    "additems",
    "append",
    "appends",
    "dict_",
    "empty_dict",
    "empty_list",
    "empty_set",
    "empty_tuple",
    "frozenset_",
    "list_",
    "setitem",
    "setitems",
    "tuple1",
    "tuple2",
    "tuple3",
    "tuple_",
]

_ODICT = OrderedDict

# ------------------------------------------------------------------------ new containers


def empty_tuple(m: Unpickler) -> None:
    m.charge(cost.REF, "a tuple")
    m.push(())


def tuple_(m: Unpickler) -> None:
    items = m.pop_mark()
    m.charge(cost.REF + cost.TUPLE + cost.TUPLE_ITEM * len(items), "a tuple")
    m.push(m.new_tuple(items))


def _tuple_n(m: Unpickler, n: int) -> None:
    stack = m.stack
    if len(stack) < n:
        raise pickle.UnpicklingError(f"unpickling stack underflow at {m.pos - 1}")
    m.charge(cost.TUPLE + cost.TUPLE_ITEM * n, "a tuple")
    value = m.new_tuple(stack[-n:])
    del stack[-n:]
    stack.append(value)


def tuple1(m: Unpickler) -> None:
    _tuple_n(m, 1)


def tuple2(m: Unpickler) -> None:
    _tuple_n(m, 2)


def tuple3(m: Unpickler) -> None:
    _tuple_n(m, 3)


def empty_list(m: Unpickler) -> None:
    m.charge(cost.REF + cost.LIST, "a list")
    m.push([])


def list_(m: Unpickler) -> None:
    items = m.pop_mark()  # the mark's list, charged as it grew, becomes the value
    m.charge(cost.REF, "a list")
    m.push(items)


def empty_dict(m: Unpickler) -> None:
    m.charge(cost.REF + cost.DICT, "a dict")
    m.push({})


def dict_(m: Unpickler) -> None:
    items = m.pop_mark()
    if len(items) % 2:
        raise pickle.UnpicklingError(f"odd number of items for DICT at {m.pos - 1}")
    m.charge(cost.REF + cost.DICT + cost.DICT_ITEM * (len(items) // 2), "a dict")
    m.push({items[i]: items[i + 1] for i in range(0, len(items), 2)})


def empty_set(m: Unpickler) -> None:
    m.charge(cost.REF + cost.SET, "a set")
    m.push(set())


def frozenset_(m: Unpickler) -> None:
    items = m.pop_mark()
    m.charge(cost.REF + cost.SET + cost.SET_ITEM * len(items), "a frozenset")
    m.push(m.checked(frozenset(items)))


# ------------------------------------------------------------------------ items added to one


def _target(m: Unpickler, kinds: tuple[type, ...], op: str, what: str) -> Any:
    target = m.top()
    if type(target) not in kinds:
        raise UnsafePickleError(
            f"refusing {op} at {m.pos - 1} of the {m.what} to {describe(target)}: "
            f"only {what} grow (anything else would run the object's own method)"
        )
    return target


def append(m: Unpickler) -> None:
    value = m.pop()
    target = _target(m, (list,), "APPEND", "lists")
    m.charge(cost.REF, "a list item")
    target.append(value)


def appends(m: Unpickler) -> None:
    items = m.pop_mark()
    target = _target(m, (list,), "APPENDS", "lists")
    m.charge(cost.REF * len(items), "list items")
    target.extend(items)


def _item_cost(m: Unpickler, target: Any, n: int) -> None:
    per = cost.ODICT_ITEM if type(target) is _ODICT else cost.DICT_ITEM
    m.charge(per * n, "dict items")


def setitem(m: Unpickler) -> None:
    value = m.pop()
    key = m.pop()
    target = _target(m, (dict, _ODICT), "SETITEM", "dicts")
    _item_cost(m, target, 1)
    target[key] = value


def setitems(m: Unpickler) -> None:
    items = m.pop_mark()
    target = _target(m, (dict, _ODICT), "SETITEMS", "dicts")
    if len(items) % 2:
        raise pickle.UnpicklingError(f"odd number of items for SETITEMS at {m.pos - 1}")
    _item_cost(m, target, len(items) // 2)
    for i in range(0, len(items), 2):
        target[items[i]] = items[i + 1]


def additems(m: Unpickler) -> None:
    items = m.pop_mark()
    target = _target(m, (set,), "ADDITEMS", "sets")
    m.charge(cost.SET_ITEM * len(items), "set members")
    target.update(items)
