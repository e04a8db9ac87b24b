"""The roles rule of a chat template without generation blocks, derived from transformers' own
rendering: which characters of ``apply_chat_template(..., tokenize=False)`` each message owns.

The rule: a message owns every character its values rendered, and the rest of its turn (its
iteration of the template's loop over the messages) from the first of: its first value, the
first iteration over one of its own items (a tool call, a content item) that wrote something,
and the first non-blank character of the line after the one that wrote its role. Nothing else
belongs to a message.

Derived here without the product's renderer, in plain Python around transformers:

* turns and item iterations: the template's loop over the messages (in one render) and each
  loop over a message's own list (in another: transformers' tracker places a block nested in
  another at the outer block's start) is wrapped, by text surgery, in ``{% generation %}``
  blocks, and transformers' generation tracker reports their spans;
* values: every string value of a message is replaced by a unique sentinel, whose place in the
  rendering is found by search, and the real values are put back (so this oracle holds for
  templates that render each value verbatim: the tests draw values such templates keep whole).
"""

from __future__ import annotations

import re
from typing import Any

from transformers.utils.chat_template_utils import render_jinja_template

__all__ = ["owners", "wrapped_template"]

_TAG = re.compile(r"\{%([-+]?)\s*(for|endfor)\b(.*?)([-+]?)%\}", re.S)
_TURN_LOOP = re.compile(r"^\s*\w+\s+in\s+(messages|loop_messages)\s*$")
_ITEM_LOOP = re.compile(r"^\s*\w+\s+in\s+message(\.\w+|\[['\"]\w+['\"]\])\s*$")
_OPEN, _CLOSE = "\U0010fff0", "\U0010fff1"


def wrapped_template(template: str, loops: re.Pattern[str]) -> str:
    """`template` with the body of each loop whose header matches `loops` (the loop over the
    messages, or over one of a message's lists) in a ``{% generation %}`` block (same
    whitespace control as the loop's tags, so the rendering is unchanged)."""
    stack: list[tuple[bool, re.Match[str]]] = []
    edits: list[tuple[int, str]] = []
    for tag in _TAG.finditer(template):
        left, kind, rest, _ = tag.groups()
        if kind == "for":
            wrap = bool(loops.match(rest))
            stack.append((wrap, tag))
            continue
        wrap, opening = stack.pop()
        if wrap:
            edits.append((opening.end(), "{%" + "generation" + opening.group(4) + "%}"))
            edits.append((tag.start(), "{%" + left + " endgeneration %}"))
    for at, text in sorted(edits, reverse=True):
        template = template[:at] + text + template[at:]
    return template


def _sentinels(value: Any, found: list[str], path: tuple[Any, ...]) -> Any:
    if isinstance(value, str):
        found.append(value)
        return f"{_OPEN}{len(found) - 1}{_CLOSE}"
    if isinstance(value, dict):
        return {k: _sentinels(v, found, (*path, k)) for k, v in value.items()}
    if isinstance(value, list):
        return [_sentinels(v, found, (*path, i)) for i, v in enumerate(value)]
    return value


def owners(
    template: str, messages: list[dict[str, Any]], special_tokens: dict[str, Any]
) -> tuple[str, list[int]]:
    """The rendering and, per character, the message owning it (-1: none)."""
    values: list[str] = []
    owner_of_value: list[int] = []
    marked_messages = []
    for m, message in enumerate(messages):
        before = len(values)
        marked = {
            k: (v if k == "role" else _sentinels(v, values, (k,)))
            for k, v in message.items()
            if v is not None
        }
        owner_of_value += [m] * (len(values) - before)
        marked_messages.append(marked)
    spans = {}
    for name, loops in (("turns", _TURN_LOOP), ("items", _ITEM_LOOP)):
        rendered, indices = render_jinja_template(
            [marked_messages],
            chat_template=wrapped_template(template, loops),
            return_assistant_tokens_mask=True,
            **special_tokens,
        )
        sentinel_text, spans[name] = rendered[0], indices[0]
    # sentinel text -> real text: each sentinel becomes its value, positions shift
    pieces = re.split(f"{_OPEN}([0-9]+){_CLOSE}", sentinel_text)
    real_at = []  # per sentinel-text position, the real position (for span ends too)
    text = ""
    value_spans: list[tuple[int, int, int]] = []
    for i, piece in enumerate(pieces):
        if i % 2 == 0:
            real_at += [len(text) + k for k in range(len(piece))]
            text += piece
        else:
            v = int(piece)
            sentinel_len = len(_OPEN) + len(piece) + len(_CLOSE)
            value_spans.append((len(text), len(text) + len(values[v]), owner_of_value[v]))
            real_at += [len(text)] * sentinel_len
            text += values[v]
    real_at.append(len(text))
    turns = sorted((real_at[a], real_at[b]) for a, b in spans["turns"])
    # an item iteration that wrote nothing (a scan) marks nothing
    items = [(real_at[a], real_at[b]) for a, b in spans["items"] if b > a]
    looped = messages[1:] if len(turns) == len(messages) - 1 else messages
    first = 1 if looped is not messages else 0
    owner = [-1] * len(text)
    for k, (a, b) in enumerate(turns):
        m = first + k
        starts = [s for s, _, o in value_spans if o == m and a <= s <= b]
        starts += [s for s, e in items if a <= s and e <= b]
        # the line after the header line that wrote the message's role (its last writing
        # before the message's first value), from its first non-blank character
        role = messages[m].get("role", "")
        at = text.rfind(role, a, min(starts, default=b)) if role else -1
        line_end = text.find("\n", at + len(role), b) if at >= 0 else -1
        if line_end >= 0:
            starts.append(len(text) - len(text[line_end:].lstrip()))
        if starts:
            for c in range(min(starts), b):
                owner[c] = m
    for s, e, m in value_spans:
        for c in range(s, e):
            owner[c] = m
    return text, owner
