"""The one surface through which a ``PackedTensor`` is serialized: :class:`PackedState`.

A value hands its state out with ``value.packed_state()`` and takes one back with
``PackedTensor.from_packed_state(state)`` (or, while unpickling, ``__setstate__``). The
adapters that move values (the plain pickle format in ``mmpack.packed.pickling``, the Ray
object-store path in ``mmpack.packed.ray_store``, the payload meter in ``mmpack.packed.payload``)
read and build only this object, never a value's private members, so a new serialized field
changes this module, the value's two methods that fill and apply it, and the adapters that
write it.

The state:

* ``segments``: the physical segments, in slot order (``None`` for "no media"). Tensors, or,
  for a value read in place from Ray's object store (``read_in_place``), read-only store views
  (among tensors sent inline beside them): objects with ``read_in_place = True``, a
  ``private()`` method that returns a new writable copy, ``claim()``, the one writable copy
  that every value holding the view shares (a view stands for one tensor, as the sender's
  segment did), and ``current()``, what a sender must send for it (the view, or its claimed
  copy once written into). A view's bytes may be read only when first used (an async actor's
  arguments, see ``mmpack.packed.ray_store``).
* ``layout``: the native row layout (``mmpack._native.PackedLayout``: CSR row offsets and
  segment indices, provenance ids), or ``None`` for NeMo-RL's legacy layout (row ``r`` is
  segment ``r``).
* ``dim_to_pack``, ``pad_to_max_shape``: as on the value.
* ``extra``: the value's other instance attributes (a dict), or ``None``.
* ``read_in_place``: whether ``segments`` are store views.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from mmpack._native import LayoutError, PackedLayout

__all__ = [
    "CORRUPT",
    "RAW_FIELDS",
    "VALUE_FIELDS",
    "PackedState",
    "check",
    "corrupt",
    "current_segments",
    "layout_misfit",
    "private_segments",
    "refuse_extra",
    "refuse_shadowing",
]

#: The instance attributes a value's own state occupies (never part of ``extra``): the
#: segments (``tensors``, or ``_store`` for store views), the two options and the native
#: handle (``_layout``).
VALUE_FIELDS = frozenset(("tensors", "dim_to_pack", "pad_to_max_shape", "_layout", "_store"))
#: NeMo-RL's row mapping and provenance attributes, as its ``__dict__`` states hold them.
RAW_FIELDS = ("_row_offsets", "_segment_indices", "_segment_provenance")
#: How every error about a state that cannot be read starts.
CORRUPT = "corrupt PackedTensor pickle"


class PackedState(NamedTuple):
    """What serialization reads of a value and builds one from (see the module docs)."""

    segments: list[Any]
    layout: PackedLayout | None
    dim_to_pack: Any
    pad_to_max_shape: Any
    extra: dict[str, Any] | None = None
    read_in_place: bool = False


def private_segments(segments: list[Any], *, claim: bool = False) -> list[Any]:
    """``segments`` with every store view replaced by a private copy (a view listed twice is
    copied once, and both slots get the same tensor). ``claim``: the view's shared copy, made
    once for every value that holds the view (a value's ``tensors``); otherwise its shared copy
    if one was made, else a new one nothing keeps (what a plain pickle writes)."""
    copies: dict[int, Any] = {}
    out: list[Any] = []
    for s in segments:
        if getattr(s, "read_in_place", False) is True:
            c = copies.get(id(s))
            if c is None:
                if claim:
                    c = s.claim()
                else:
                    c = getattr(s, "claimed", None)
                    if c is None:
                        c = s.private()
                copies[id(s)] = c
            out.append(c)
        else:
            out.append(s)
    return out


def current_segments(segments: list[Any]) -> list[Any]:
    """``segments`` (store views among them) as a sender must send them: a view whose shared
    copy was written into since it was made is that copy; the other views stay views."""
    return [s.current() if getattr(s, "read_in_place", False) is True else s for s in segments]


def refuse_shadowing(cls: type, attrs: dict[Any, Any], error: Callable[[str], Exception]) -> None:
    """Instance attributes may not hide the class's methods or properties: restored from a
    payload, ``{"as_tensor": OrderedDict}`` would make ``as_tensor()`` return whatever the
    payload chose. ``error(why)`` is raised for the first offender."""
    for key in attrs:
        if not isinstance(key, str):
            raise error(f"attribute name {key!r} is not a string")
        if key in VALUE_FIELDS or key in RAW_FIELDS:
            continue
        if hasattr(cls, key):
            raise error(f"attribute {key!r} would hide {cls.__name__}.{key}")


def layout_misfit(lay: PackedLayout, n: int, indices: np.ndarray | None = None) -> str | None:
    """Why ``lay`` cannot describe ``n`` physical segments (``None`` when it can): its
    provenance is for another count, or its row mapping references a segment beyond them."""
    if lay.has_provenance:
        if lay.n_physical != n:
            return f"its layout has provenance for {lay.n_physical} physical segments"
        return None
    if indices is None:
        indices = lay.indices()
    if indices is not None and indices.size and int(indices.max()) >= n:
        return f"its row mapping references physical segment {int(indices.max())}"
    return None


def check(state: PackedState, cls: type) -> None:
    """Refuse (``LayoutError``) a state that no value of ``cls`` can hold: segments that are
    not a list, a layout that is not a handle or does not fit them, options of the wrong type,
    extra attributes that are not a dict of names outside the value's fields and methods."""
    if not isinstance(state, PackedState):
        raise LayoutError(f"a PackedState is needed, got {type(state).__name__}")
    segments, lay, dim, pad, extra, in_place = state
    if not isinstance(segments, list):
        raise LayoutError(f"segments must be a list, got {type(segments).__name__}")
    if lay is not None:
        if not isinstance(lay, PackedLayout):
            raise LayoutError(f"layout must be a PackedLayout or None, got {type(lay).__name__}")
        problem = layout_misfit(lay, len(segments))
        if problem is not None:
            raise LayoutError(f"{len(segments)} segments do not fit the state: {problem}")
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise LayoutError(f"dim_to_pack must be an int, got {dim!r}")
    if not isinstance(pad, bool):
        raise LayoutError(f"pad_to_max_shape must be a bool, got {pad!r}")
    if not isinstance(in_place, bool):
        raise LayoutError(f"read_in_place must be a bool, got {in_place!r}")
    refuse_extra(cls, extra, LayoutError)


def refuse_extra(cls: type, extra: Any, error: Callable[[str], Exception]) -> None:
    """Extra attributes are ``None`` or a dict of names that are neither the value's own
    fields (NeMo-RL's included) nor its class's methods; ``error(why)`` otherwise."""
    if extra is None:
        return
    if not isinstance(extra, dict):
        raise error(f"extra attributes must be a dict or None, got {type(extra).__name__}")
    for key in extra:
        if key in VALUE_FIELDS or key in RAW_FIELDS:
            raise error(f"extra attribute {key!r} is one of the value's own fields")
    refuse_shadowing(cls, extra, error)


def corrupt(why: str) -> LayoutError:
    """The typed error for a serialized state that cannot be read (truncated, corrupt or
    inconsistent bytes), whichever adapter read it."""
    return LayoutError(f"{CORRUPT}: {why}")
