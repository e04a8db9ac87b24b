"""How the restricted loader names a payload value in an error message: by its type and size,
never by its repr (the repr of a list that holds one large string many times is quadratic, and
an error message must not cost more than the payload may)."""

from __future__ import annotations

from typing import Any

__all__ = ["describe"]


def describe(value: Any) -> str:
    """A short description of a payload value for an error message: its type and size, never
    its repr (the repr of a list that holds one large string many times is quadratic)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an int of {value.bit_length()} bits"
    if value is None or isinstance(value, (bool, int, float)):
        return repr(value)
    if isinstance(value, (str, bytes)) and len(value) <= 40:
        return repr(value)
    if isinstance(value, (str, bytes, bytearray, tuple, list, dict, set, frozenset)):
        return f"a {type(value).__name__} of {len(value)}"
    if isinstance(value, type):
        return f"{value.__module__}.{value.__qualname__}"
    return f"a {type(value).__module__}.{type(value).__qualname__}"
