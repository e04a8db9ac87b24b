"""Whether the object-store path runs: :func:`enable` / :func:`enabled`, the start-up variable,
and :func:`serializing_for_ray`, which tells a value's pickling that Ray's serializer called it.
"""

from __future__ import annotations

import operator
import os
import sys
import types
from typing import Any

import numpy as np

from mmpack.errors import PackedTensorError
from mmpack.packed.ray_store import put_table

__all__ = ["ENV_VAR", "OFF_VALUES", "enable", "enabled", "env_on", "serializing_for_ray"]

#: The environment variable that turns the store path on at import (also read by the startup
#: hook, ``mmpack_startup``).
ENV_VAR = "MMPACK_INSTALL"
#: Values of :data:`ENV_VAR` that leave it off (after ``strip().lower()``; the hook's one line
#: in ``mmpack_startup.pth`` spells the same set).
OFF_VALUES = ("", "0", "false", "no", "off")


def env_on() -> bool:
    return os.environ.get(ENV_VAR, "").strip().lower() not in OFF_VALUES


class _State:
    on = env_on()


_UNCHANGED: Any = object()


def enable(on: bool = True, *, held_bytes: int | None = _UNCHANGED) -> None:
    """Turn the store path on (or off) in this process. ``held_bytes`` caps the bytes of the
    chunks the put table keeps alive for reuse (``None``: half of the object store of the
    driver's node, the default; not given: unchanged). A lower cap, or turning the path off,
    lets go of the chunks above it at once."""
    if not isinstance(on, (bool, np.bool_)):
        raise TypeError(f"enable(on=...) takes a bool, got {on!r}")
    if held_bytes is not _UNCHANGED:
        if held_bytes is not None:
            if isinstance(held_bytes, (bool, np.bool_)):
                raise TypeError(f"held_bytes must be an int or None, got {held_bytes!r}")
            try:
                held_bytes = operator.index(held_bytes)
            except TypeError:
                raise TypeError(f"held_bytes must be an int or None, got {held_bytes!r}") from None
            if held_bytes < 0:
                raise PackedTensorError(f"held_bytes must not be negative, got {held_bytes}")
        put_table.set_held_bytes(held_bytes)
    _State.on = bool(on)
    put_table.shrink_to_setting(off=not _State.on)


def enabled() -> bool:
    """Whether values pickled by Ray's serializer in this process put their segments once."""
    return _State.on


def serializing_for_ray() -> bool:
    """Whether the running pickling operation is Ray's serialization (and the path is on)."""
    if not _State.on:
        return False
    worker_module = sys.modules.get("ray._private.worker")
    if worker_module is None:
        return False
    # Ray flags the serializing thread on its job's serialization context; looking the
    # context up by job id costs microseconds a value, and there is one context a job.
    contexts = getattr(worker_module.global_worker, "serialization_context_map", None)
    if not contexts:
        return False
    if not any(ctx.is_in_band_serialization() for ctx in list(contexts.values())):
        return False
    # The flag is per thread: a plain ``pickle.dumps`` that user code runs while Ray pickles
    # (a ``__reduce__`` that nests a pickle) sees it too, and references inside those bytes
    # would never resolve. Ray's pickler calls the reducer straight from its ``dump``; a nested
    # pickle is called from the user's frame. So the first frame outside mmpack must be Ray's.
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__", "").startswith("mmpack."):
        frame = frame.f_back
    return frame is not None and frame.f_globals.get("__name__", "").startswith("ray.")
