"""`RenderedTokens`: the tokens of one chat-template rendering, and what each belongs to.

The roles rule (templates without ``{% generation %}`` blocks, and the messages a template with
blocks leaves outside them). A message owns:

* every character its own values produced (`mmpack.batch.templates.Rendering.values`): its
  text, tool calls, reasoning, wherever the template put them (a system prompt the template
  renders inside the first user turn stays the system message's);
* the rest of its turn from its first value on, or from the first non-blank character after
  its header line (the last line before its first value that names its role), whichever
  comes first: what the template writes before its values on their own lines (Qwen3's
  ``<think>``, Llama 3.1's ``{"name": "`` of a tool call), between them, and closes the turn
  with (its end-of-turn token).

Nothing else belongs to a message: role headers, a default system prompt or date line the
template injects, separators, the text before the first turn. A token belongs to a message
when the message owns some of its characters and no other message owns any: a token that joins
the template's space to a reply's first word (``[/INST] Yes``) is the reply's, a token that
joins two messages is neither's. So injected text is never trained, whatever the message it
was injected beside, and a message to be trained that the rendering cannot place (its values
transformed beyond following, or no loop over the messages) is refused (`check_placed`).

With generation blocks, a token is in a block when it overlaps one, as transformers'
``return_assistant_tokens_mask`` says, and trains when the generation role (``assistant``)
does; the messages whose turn holds a block, and every ``assistant`` message, train only
through blocks. (Where transformers' tracker misplaces a block, inside a macro, a call or set
block or a nested block, the block's own text is what counts here.)
"""

from __future__ import annotations

import copy
import functools
import itertools
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from mmpack.batch.templates import Rendering
from mmpack.errors import ChatTemplateError

__all__ = ["GENERATION_ROLE", "RenderedTokens", "token_offsets", "untruncated_encode"]

_NON_BLANK = re.compile(r"\S")
#: The role whose output ``{% generation %}`` blocks mark.
GENERATION_ROLE = "assistant"


class RenderedTokens:
    """Per token of a rendering tokenized with character offsets (``(n, 2)``, as a fast
    tokenizer's ``offsets``): `owner` (the message that owns every character of it, or -1),
    `turn` (the message whose turn holds its first character, or -1) and `in_generation`."""

    def __init__(
        self,
        rendering: Rendering,
        offsets: np.ndarray,
        n_messages: int,
        roles: Sequence[str] = (),
    ) -> None:
        self.rendering = rendering
        #: each message's role, as the header that names it is looked for
        self.roles = tuple(roles)
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
        text = rendering.text
        out = np.full(len(text), -1, dtype=np.int64)
        starts: dict[int, list[int]] = {}
        for v in rendering.values:
            starts.setdefault(v.message, []).append(v.start)
        for m, (a, b) in enumerate(rendering.turns):
            inside = [s for s in starts.get(m, ()) if a <= s <= b] if a >= 0 else []
            if not inside:
                continue
            first = min(inside)
            role = self.roles[m] if m < len(self.roles) else ""
            # the header line: the last line before the first value that names the role
            at = text.rfind(role, a, first) if role else -1
            line_end = text.find("\n", at + len(role), first) if at >= 0 else -1
            if line_end >= 0:
                blank_run = _NON_BLANK.search(text, line_end, first)
                first = blank_run.start() if blank_run else first
            out[first:b] = m
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
        """Per token: the one message that owns some of its characters (the rest no
        message's), or -1."""
        size = len(self.rendering.text)
        n = len(self.offsets)
        if not size or not self.rendering.values:
            return np.full(n, -1, dtype=np.int64)
        starts = np.clip(self.offsets[:, 0], 0, size)
        lengths = np.clip(self.offsets[:, 1], 0, size) - starts
        lengths = np.maximum(lengths, 0)
        char_owner = self.char_owner
        # the lowest and highest owner among each token's owned characters
        nobody = np.iinfo(np.int64).max
        low_of = np.where(char_owner >= 0, char_owner, nobody)
        out = np.full(n, -1, dtype=np.int64)
        filled = lengths > 0
        if filled.any():
            at = np.concatenate([[0], np.cumsum(lengths)[:-1]])
            chars = np.repeat(starts - at, lengths) + np.arange(int(lengths.sum()))
            low = np.minimum.reduceat(low_of[chars], at[filled])
            high = np.maximum.reduceat(char_owner[chars], at[filled])
            out[filled] = np.where(low == high, high, -1)
        empty = ~filled
        out[empty] = char_owner[np.minimum(starts[empty], size - 1)]
        return out

    def check_placed(
        self, to_train: Sequence[bool], with_values: Sequence[bool], *, where: str = ""
    ) -> None:
        """Refuse (`ChatTemplateError`) a message to be trained by the roles rule that the
        rendering does not place: it has values to render but none was followed into the
        rendering (transformed beyond following: ``| upper``, ``| tojson`` of its only
        value), or it has no turn (no template loop over the messages reached it)."""
        placed = {v.message for v in self.rendering.values}
        for m, (train, has) in enumerate(zip(to_train, with_values, strict=True)):
            if not train or not has:
                continue
            if m not in placed:
                raise ChatTemplateError(
                    f"{where}the chat template does not render message {m}'s values as given, "
                    "nor cut or joined from them, so its tokens cannot be told from the "
                    "template's; give the template {% generation %} blocks to mark what trains"
                )
            if self.rendering.turns[m][0] < 0:
                raise ChatTemplateError(
                    f"{where}the chat template renders message {m} outside any loop over the "
                    "messages, so where its turn ends is unknown; give the template "
                    "{% generation %} blocks to mark what trains"
                )

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


def untruncated_encode(backend: Any, text: str) -> Any:
    """`text` tokenized without special tokens added, truncation, padding or special tokens
    split, whatever the backend tokenizer was left set to (transformers' ``__call__`` resets
    all three on every call; a ``tokenizer.json`` may configure them)."""
    if (
        backend.truncation is None
        and backend.padding is None
        and not getattr(backend, "encode_special_tokens", False)
    ):
        return backend.encode(text, add_special_tokens=False)
    return _plain_copy(backend).encode(text, add_special_tokens=False)


#: id of a backend -> (that backend, its plain copy); the backend is held so its id is not
#: reused by another tokenizer while the entry lives
_PLAIN_COPIES: dict[int, tuple[Any, Any, str]] = {}


def _plain_copy(backend: Any) -> Any:
    state = repr(
        (backend.truncation, backend.padding, getattr(backend, "encode_special_tokens", False))
    )
    held = _PLAIN_COPIES.get(id(backend))
    if held is not None and held[0] is backend and held[2] == state:
        plain = held[1]
        if plain.get_vocab_size() == backend.get_vocab_size():
            return plain
    plain = copy.deepcopy(backend)
    plain.no_truncation()
    plain.no_padding()
    if hasattr(plain, "encode_special_tokens"):
        plain.encode_special_tokens = False
    if len(_PLAIN_COPIES) >= 8:
        _PLAIN_COPIES.clear()
    _PLAIN_COPIES[id(backend)] = (backend, plain, state)
    return plain


def _overlaps(spans: Sequence[tuple[int, int]], starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Tokens overlapping a block: the blocks' union (nested blocks mark their outer block's
    text), then the first block not ended by the token's start must begin before its end."""
    if not spans:
        return np.zeros(len(starts), dtype=np.bool_)
    union: list[list[int]] = []
    for s, e in sorted(spans):
        if union and s <= union[-1][1] and e > s:
            union[-1][1] = max(union[-1][1], e)
        else:
            union.append([s, e])
    span_starts = np.asarray([s for s, _ in union], dtype=np.int64)
    span_ends = np.asarray([e for _, e in union], dtype=np.int64)
    first = np.searchsorted(span_ends, starts, side="right")
    inside = first < len(union)
    out = np.zeros(len(starts), dtype=np.bool_)
    out[inside] = ends[inside] > span_starts[first[inside]]
    return out
