"""`TracedStr`: a string that remembers which of its characters came from where.

A chat template is rendered once with every message value (a text part, a tool call's name, a
reasoning trace) handed to it as a `TracedStr` whose marks label its characters. The string
operations templates apply to such values (``+``, ``~``, slicing, ``strip`` / ``| trim``,
``split`` / ``rsplit``, ``| join``) return `TracedStr`s with the marks moved along, so the
rendering says which characters each value produced, however the template cut and joined it.
Any other operation returns a plain `str`: its characters are then the template's own (never
wrongly attributed, at worst unattributed).

A mark is ``(start, end, label)``; a zero-width mark (``start == end``) records a position (an
empty value, the start of a loop iteration).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any, SupportsIndex

__all__ = ["Mark", "TracedStr", "traced_join"]

Mark = tuple[int, int, Any]
_WORDS = re.compile(r"\S+")


class TracedStr(str):
    """A `str` with marks (see the module docstring); equal, hashed and tested as its text."""

    marks: tuple[Mark, ...]

    def __new__(cls, text: str, marks: Iterable[Mark] = ()) -> TracedStr:
        obj = super().__new__(cls, text)
        obj.marks = tuple(marks)
        return obj

    def __str__(self) -> str:
        # Jinja writes ``str(value)`` for every output: the marks must survive it
        return self

    def __add__(self, other: object) -> str:
        if not isinstance(other, str):
            return NotImplemented
        return traced_join((self, other))

    def __radd__(self, other: object) -> str:
        # called before str.__add__ because TracedStr subclasses str
        if not isinstance(other, str):
            return NotImplemented
        return traced_join((other, self))

    def __getitem__(self, key: SupportsIndex | slice) -> str:
        if not isinstance(key, slice):
            return str.__getitem__(self, key)
        start, stop, step = key.indices(len(self))
        if step != 1:
            return str.__getitem__(self, key)
        return _cut(self, start, max(start, stop))

    def strip(self, chars: str | None = None) -> str:
        return self.lstrip(chars).rstrip(chars)

    def lstrip(self, chars: str | None = None) -> str:
        return _cut(self, len(self) - len(str.lstrip(self, chars)), len(self))

    def rstrip(self, chars: str | None = None) -> str:
        return _cut(self, 0, len(str.rstrip(self, chars)))

    def split(self, sep: str | None = None, maxsplit: SupportsIndex = -1) -> list[str]:
        plain = str.split(self, sep, maxsplit)
        return _pieces(self, _split_bounds(self, sep, int(maxsplit)), plain)

    def rsplit(self, sep: str | None = None, maxsplit: SupportsIndex = -1) -> list[str]:
        plain = str.rsplit(self, sep, maxsplit)
        return _pieces(self, _rsplit_bounds(self, sep, int(maxsplit)), plain)


def traced_join(pieces: Iterable[Any]) -> str:
    """The pieces joined (each through ``str``, as Jinja's ``~`` and output buffers do), their
    marks carried over; a plain `str` when no piece is traced."""
    parts = [p if isinstance(p, str) else str(p) for p in pieces]
    text = "".join(parts)
    marks: list[Mark] = []
    at = 0
    for part in parts:
        if type(part) is TracedStr:
            if at:
                marks.extend([(at + s, at + e, label) for s, e, label in part.marks])
            else:
                marks.extend(part.marks)
        at += len(part)
    return TracedStr(text, marks) if marks else text


def _cut(text: TracedStr, start: int, stop: int) -> str:
    """``text[start:stop]`` with the marks that touch it, clipped (a mark cut to nothing stays
    as a position)."""
    marks = [
        (max(s, start) - start, min(e, stop) - start, label)
        for s, e, label in text.marks
        if s <= stop and e >= start
    ]
    piece = str.__getitem__(text, slice(start, stop))
    return TracedStr(piece, marks) if marks else piece


def _pieces(text: TracedStr, bounds: Sequence[tuple[int, int]], plain: list[str]) -> list[str]:
    pieces = [_cut(text, a, b) for a, b in bounds]
    # a rule this module got wrong costs only the attribution, never the text
    return pieces if pieces == plain else plain


def _split_bounds(text: str, sep: str | None, maxsplit: int) -> list[tuple[int, int]]:
    if sep is None:
        words = [(m.start(), m.end()) for m in _WORDS.finditer(text)]
        if 0 <= maxsplit < len(words):
            # the rest after the last split keeps its trailing whitespace
            words = [*words[:maxsplit], (words[maxsplit][0], len(text))]
        return words
    if not sep:
        return []  # str.split raises for an empty separator; the fallback does too
    bounds: list[tuple[int, int]] = []
    at = 0
    while maxsplit < 0 or len(bounds) < maxsplit:
        found = text.find(sep, at)
        if found < 0:
            break
        bounds.append((at, found))
        at = found + len(sep)
    bounds.append((at, len(text)))
    return bounds


def _rsplit_bounds(text: str, sep: str | None, maxsplit: int) -> list[tuple[int, int]]:
    if sep is None:
        words = [(m.start(), m.end()) for m in _WORDS.finditer(text)]
        if 0 <= maxsplit < len(words):
            # the rest before the last split keeps its leading whitespace
            keep = len(words) - maxsplit
            words = [(0, words[keep - 1][1]), *words[keep:]]
        return words
    if not sep:
        return []
    bounds: list[tuple[int, int]] = []
    end = len(text)
    while maxsplit < 0 or len(bounds) < maxsplit:
        found = text.rfind(sep, 0, end)
        if found < 0:
            break
        bounds.append((found + len(sep), end))
        end = found
    bounds.append((0, end))
    return bounds[::-1]
