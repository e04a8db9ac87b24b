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
  for a value read in place from Ray's object store (``read_in_place``), read-only store views:
  objects with ``read_in_place = True`` and a ``private()`` method that returns a writable copy.
* ``layout``: the native row layout (``mmpack._native.PackedLayout``: CSR row offsets and
  segment indices, provenance ids), or ``None`` for NeMo-RL's legacy layout (row ``r`` is
  segment ``r``).
* ``dim_to_pack``, ``pad_to_max_shape``: as on the value.
* ``extra``: the value's other instance attributes (a dict), or ``None``.
* ``read_in_place``: whether ``segments`` are store views.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from mmpack._native import LayoutError, PackedLayout

__all__ = [
    "CORRUPT",
    "RAW_FIELDS",
    "VALUE_FIELDS",
    "PackedState",
    "corrupt",
    "private_segments",
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


def private_segments(segments: list[Any]) -> list[Any]:
    """``segments`` with every store view replaced by its private copy (a view listed twice is
    copied once, and both slots get the same tensor)."""
    copies: dict[int, Any] = {}
    out: list[Any] = []
    for s in segments:
        if getattr(s, "read_in_place", False) is True:
            c = copies.get(id(s))
            if c is None:
                c = copies[id(s)] = s.private()
            out.append(c)
        else:
            out.append(s)
    return out


def corrupt(why: str) -> LayoutError:
    """The typed error for a serialized state that cannot be read (truncated, corrupt or
    inconsistent bytes), whichever adapter read it."""
    return LayoutError(f"{CORRUPT}: {why}")
