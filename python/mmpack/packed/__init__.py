"""The PackedTensor wing: a logical batch of rows over deduplicated physical media segments.

Rooms: ``value`` (the class), ``pickle_format`` (what a pickle holds and how it is read back),
``pickle_operation`` (which tensors one pickling operation already wrote), ``ray_store``
(through Ray's object store: each unique segment put once, read in place), ``gather`` (the one
materialization path), ``transfer`` (device moves), ``payload`` (physical vs logical bytes).

**How a pickling operation is detected.** The values of one pickle share the tensors they have
in common, but no pickler hook tells ``__reduce_ex__`` which pickler calls it. What does tell: a
pickler writes the global ``mmpack.packed.PackedTensor`` (the class's ``__module__`` and name)
once, for its first value, right after that value's ``__reduce_ex__``, by looking the name up on
this module. The name is therefore not bound here: this module's ``__getattr__`` (PEP 562, only
called for names the module does not hold) serves it and reports the lookup to
``pickle_operation.THREADS.pickler_started()``, which starts a new operation for the value
reduced last. Every other lookup (``from mmpack.packed import PackedTensor`` included) is
harmless: with no value reduced since, there is nothing to start. Pickles of earlier releases name
the same global, so they load unchanged. ``mmpack.PackedTensor`` reads the class from
``mmpack.packed.value`` directly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mmpack.packed.value import PackedTensor

__all__ = ["PackedTensor"]


def __getattr__(name: str) -> Any:
    if name == "PackedTensor":
        from mmpack.packed.pickle_operation import THREADS
        from mmpack.packed.value import PackedTensor

        THREADS.pickler_started()
        return PackedTensor
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), "PackedTensor"})
