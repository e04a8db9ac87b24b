"""The PackedTensor wing: a logical batch of rows over deduplicated physical media segments.

Rooms, in the direction a value travels: ``value`` (the class), ``state`` (the one surface
serialization reads and builds: :class:`~mmpack.packed.state.PackedState`), ``pickling`` (the
plain pickle format, its groups and operations), ``ray_store`` (through Ray's object store: each
unique segment put once, read in place), ``payload`` (physical vs logical bytes), ``gather``
(the one materialization path), ``transfer`` (device moves); ``nemo_fields`` (NeMo-RL's
row-mapping fields) and ``buffers`` (which segments travel as raw bytes) are shared by them.

This module does not bind ``PackedTensor``: a pickler's lookup of that global starts a pickling
operation, see ``mmpack.packed.pickling.operation_start``. ``from mmpack.packed import
PackedTensor`` works as usual.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mmpack.packed.pickling.operation_start import packed_module_getattr as __getattr__  # noqa: F401

if TYPE_CHECKING:
    from mmpack.packed.value import PackedTensor

__all__ = ["PackedTensor"]


def __dir__() -> list[str]:
    return sorted({*globals(), "PackedTensor"})
