"""`RenderedTokens`: the tokens of one chat-template rendering, and what each belongs to.

The roles rule (templates without ``{% generation %}`` blocks, and the messages a template with
blocks leaves outside them). A message owns:

* every character its own values produced (`mmpack.batch.templates.Rendering.values`): its
  text, tool calls, reasoning, wherever the template put them (a system prompt the template
  renders inside the first user turn stays the system message's);
* the rest of its turn from its first value on: what the template closes the turn with (its
  end-of-turn token) and writes between its values.

Nothing else belongs to a message: role headers, a default system prompt or date line the
template injects, separators, the text before the first turn. A token belongs to a message
only when every character it covers does. So injected text is never trained, whatever the
message it was injected beside.

With generation blocks, a token is in a block exactly as transformers'
``return_assistant_tokens_mask`` says (it overlaps a block) and trains when the generation role
(``assistant``) does; the messages whose turn holds a block, and every ``assistant`` message,
train only through blocks.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np

from mmpack.batch.templates import Rendering

__all__ = ["GENERATION_ROLE", "RenderedTokens", "token_offsets"]

#: The role whose output ``{% generation %}`` blocks mark.
GENERATION_ROLE = "assistant"


class RenderedTokens:
    """Per token of a rendering tokenized with character offsets (``(n, 2)``, as a fast
    tokenizer's ``offsets``): `owner` (the message that owns every character of it, or -1),
    `turn` (the message whose turn holds its first character, or -1) and `in_generation`."""

    def __init__(self, rendering: Rendering, offsets: np.ndarray, n_messages: int) -> None:
        self.rendering = rendering
        self.offsets = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
        self.n_messages = n_messages
        self.in_generation = _overlaps(rendering.generation, self.offsets[:, 0], self.offsets[:, 1])

    @functools.cached_property
    def char_turn(self) -> np.ndarray:
        """Per character: the message whose turn holds it, or -1."""
        out = np.full(len(self.rendering.text), -1, dtype=np.int64)
        for m, (a, b) in enumerate(self.rendering.turns):
            if a >= 0:
                out[a:b] = m
        return out

    @functools.cached_property
    def char_owner(self) -> np.ndarray:
        """Per character: the message that owns it (module docstring), or -1."""
        rendering = self.rendering
        out = np.full(len(rendering.text), -1, dtype=np.int64)
        value_starts: dict[int, list[int]] = {}
        for v in rendering.values:
            value_starts.setdefault(v.message, []).append(v.start)
        for m, (a, b) in enumerate(rendering.turns):
            inside = [s for s in value_starts.get(m, ()) if a <= s <= b] if a >= 0 else ()
            if inside:
                out[min(inside) : b] = m
        for v in rendering.values:
            out[v.start : v.end] = v.message
        return out

    def _first_char(self) -> np.ndarray:
        size = len(self.rendering.text)
        return np.minimum(self.offsets[:, 0], max(size - 1, 0))

    @functools.cached_property
    def turn(self) -> np.ndarray:
        """Per token: the message whose turn holds its first character, or -1."""
        if not len(self.rendering.text):
            return np.full(len(self.offsets), -1, dtype=np.int64)
        return self.char_turn[self._first_char()]

    @functools.cached_property
    def owner(self) -> np.ndarray:
        """Per token: the message that owns every character it covers, or -1."""
        size = len(self.rendering.text)
        if not size or not self.rendering.values:
            return np.full(len(self.offsets), -1, dtype=np.int64)
        starts, ends = self._first_char(), self.offsets[:, 1]
        last = np.clip(np.maximum(ends - 1, starts), 0, size - 1)
        char_owner = self.char_owner
        runs = np.concatenate([[0], np.cumsum(np.diff(char_owner) != 0)])
        return np.where(runs[starts] == runs[last], char_owner[starts], -1)

    def generation_messages(self, roles: Sequence[str], uses_blocks: bool) -> np.ndarray:
        """Per message: it trains only through generation blocks, when the template has
        them: an ``assistant`` message, or one whose turn holds a block token."""
        out = np.zeros(self.n_messages, dtype=np.bool_)
        if not uses_blocks:
            return out
        out |= np.asarray([r == GENERATION_ROLE for r in roles], dtype=np.bool_)
        held = self.turn[self.in_generation]
        out[held[held >= 0]] = True
        return out

    def role_labels(self, roles: Sequence[str], uses_blocks: bool) -> np.ndarray:
        """Per token, what decides whether it trains: -2 for a block token (the generation
        role: the template's author marked it, as ``return_assistant_tokens_mask`` reads
        it), the owning message for any other token unless that message trains only
        through blocks, else -1 (never trained)."""
        if not self.rendering.values:
            # nothing located: no token is a message's but through blocks
            return np.where(self.in_generation, -2, -1)
        only_blocks = self.generation_messages(roles, uses_blocks)
        owner = self.owner
        label = np.where((owner >= 0) & ~only_blocks[np.maximum(owner, 0)], owner, -1)
        return np.where(self.in_generation, -2, label)

    @staticmethod
    def needs_values(roles: Sequence[str], train_roles: Sequence[str], uses_blocks: bool) -> bool:
        """Whether deciding the tokens needs the messages' values traced: not when blocks
        decide everything that trains (no message of a role to train other than the
        generation role)."""
        return not uses_blocks or any(r in train_roles and r != GENERATION_ROLE for r in roles)


def token_offsets(encoding: Any) -> np.ndarray:
    """A `tokenizers.Encoding`'s character offsets as an ``(n, 2)`` int64 array (read
    without building an array of tuples)."""
    offsets = encoding.offsets
    flat = np.fromiter(
        itertools.chain.from_iterable(offsets), dtype=np.int64, count=2 * len(offsets)
    )
    return flat.reshape(-1, 2)


def _overlaps(spans: Sequence[tuple[int, int]], starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Tokens overlapping a span, by transformers' rule for ``assistant_masks``: the first span
    not ended by the token's start must begin before the token's end."""
    if not spans:
        return np.zeros(len(starts), dtype=np.bool_)
    span_starts = np.asarray([s for s, _ in spans], dtype=np.int64)
    span_ends = np.asarray([e for _, e in spans], dtype=np.int64)
    first = np.searchsorted(span_ends, starts, side="right")
    inside = first < len(spans)
    out = np.zeros(len(starts), dtype=np.bool_)
    out[inside] = ends[inside] > span_starts[first[inside]]
    return out
