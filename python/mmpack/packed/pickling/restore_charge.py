"""Where what restoring a PackedTensor state builds is charged, before it is built.

A restricted load (``mmpack.safe_load``) points ``RESTORE_CHARGE`` at its budget's ``charge`` for
the duration of the load; outside one (plain ``pickle``) it is ``None`` and nothing is charged.
The loader depends on the pickle format, never the other way round, and this module needs
neither torch nor the loader.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar

__all__ = ["RESTORE_CHARGE", "charge"]

RESTORE_CHARGE: ContextVar[Callable[[int, str], None] | None] = ContextVar(
    "mmpack_restore_charge", default=None
)


def charge(nbytes: int, what: str) -> None:
    """Charge the running restricted load, if any."""
    hook = RESTORE_CHARGE.get()
    if hook is not None:
        hook(nbytes, what)
