"""How a pickling operation starts: the pickler's lookup of the ``mmpack.packed.PackedTensor``
global.

No pickler hook tells ``__reduce_ex__`` which pickler calls it (``persistent_id`` and
``reducer_override`` belong to the pickler, not the object, and ``copyreg``'s dispatch table is
global). What does tell: a pickler writes the global a value's reconstructor names,
``mmpack.packed.PackedTensor`` (the class's ``__module__`` and name), once, for its first value,
right after that value's ``__reduce_ex__``, and it finds it by looking the name up on the module
``mmpack.packed``. So that module does not bind the name: its module ``__getattr__`` (PEP 562,
only called for names a module does not hold) is :func:`packed_module_getattr`, which serves the
class and reports the lookup to ``operation.THREADS.pickler_started()``, starting a new
operation for the value reduced last.

Every other lookup (``from mmpack.packed import PackedTensor`` included) is harmless: with no
value reduced since, there is nothing to start. Pickles of earlier releases name the same
global, so they load unchanged. A traceback of a pickling operation's start shows the pickler's
frame, then :func:`packed_module_getattr`, then ``ThreadState.pickler_started``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CLASS_NAME", "packed_module_getattr"]

#: The name pickles give the class, on the module ``mmpack.packed``.
CLASS_NAME = "PackedTensor"


def packed_module_getattr(name: str) -> Any:
    """``mmpack.packed.__getattr__``: serves the class, and starts a pickling operation when the
    lookup is a pickler's (see the module docs)."""
    if name == CLASS_NAME:
        # imported here: ``import mmpack`` must not import torch
        from mmpack.packed.pickling.operation import THREADS
        from mmpack.packed.value import PackedTensor

        THREADS.pickler_started()
        return PackedTensor
    raise AttributeError(f"module 'mmpack.packed' has no attribute {name!r}")
