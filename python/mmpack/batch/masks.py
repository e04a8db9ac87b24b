"""Loss masks: derive them from message roles or fragment spans, validate them, find turns.

A loss mask here has one entry per token, aligned with the token ids: 1 where the token is a
training *target*, 0 elsewhere. The batch builders (``mmpack.batch``) keep it as the batch's
``token_mask`` and shift it onto the labels: ``labels[p]`` is token ``p + 1`` where that token is
trainable, and the batch's ``loss_mask`` is ``labels != ignore_index`` (Megatron's alignment).
Every function here runs in the Rust core; masks come back as 1-D numpy ``bool`` arrays.

Errors are typed and name the sample: ``LossMaskError`` (length, values, no trainable token),
its subclass ``MessageSpanError`` (message / fragment lengths inconsistent with the roles, the
flags or the token count), ``TurnStructureError`` (turn markers missing or unpaired), and
``ChatTemplateError`` (a chat template whose rendering is not prefix-stable).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from mmpack import _native
from mmpack._coerce import (
    flag_array,
    int64_array,
    mask_array,
    role_list,
    sample_name,
    token_count,
)
from mmpack.batch import templates
from mmpack.batch.rendered_tokens import (
    GENERATION_ROLE,
    RenderedTokens,
    token_offsets,
    untruncated_encode,
)
from mmpack.errors import ChatTemplateError

__all__ = [
    "from_chat_template",
    "from_fragments",
    "from_roles",
    "turn_spans",
    "validate",
]


def validate(
    mask: Any,
    num_tokens: int,
    *,
    sample_id: Hashable | None = None,
    require_trainable: bool = False,
) -> None:
    """Check a loss mask; return ``None`` or raise ``LossMaskError``.

    Rules, checked in this order: the mask is 1-D and its length equals ``num_tokens``; every
    value is 0 or 1 (``True``/``False``, ``0.0``/``1.0`` count; nothing is cast first, so ``2``,
    ``-1`` or ``0.5`` are caught); with ``require_trainable``, at least one value is 1. The
    message names the sample (``sample_id``), the rule and, for a bad value, the first bad
    position.
    """
    arr = mask_array(mask, sample_id)
    n = token_count(num_tokens, sample_id)
    _native.validate_mask(arr, n, bool(require_trainable), sample_name(sample_id))


def from_roles(
    message_lengths: Sequence[int] | npt.ArrayLike,
    message_roles: Sequence[str],
    train_roles: Sequence[str] = ("assistant",),
    *,
    num_tokens: int | None = None,
    sample_id: Hashable | None = None,
) -> np.ndarray:
    """Mask from message roles: message ``i`` covers the next ``message_lengths[i]`` tokens and
    is trained on (1) when ``message_roles[i]`` is in ``train_roles`` (exact, case-sensitive).

    With ``num_tokens`` the lengths must sum to it. Raises ``MessageSpanError`` when the two
    sequences differ in length, a length is negative, or the sum is wrong.
    """
    lengths = int64_array(message_lengths, "message_lengths", sample_id)
    roles = role_list(message_roles, "message_roles", sample_id)
    train = role_list(train_roles, "train_roles")
    n = None if num_tokens is None else token_count(num_tokens, sample_id)
    return _native.mask_from_roles(lengths, roles, train, n, sample_name(sample_id))


def from_fragments(
    fragment_lengths: Sequence[int] | npt.ArrayLike,
    trainable: Sequence[bool] | npt.ArrayLike,
    *,
    num_tokens: int | None = None,
    sample_id: Hashable | None = None,
) -> np.ndarray:
    """Mask from per-fragment trainable spans: fragment ``i`` covers the next
    ``fragment_lengths[i]`` tokens, all set to ``trainable[i]``.

    With ``num_tokens`` the lengths must sum to it. Raises ``MessageSpanError`` when the two
    sequences differ in length, a length is negative, or the sum is wrong.
    """
    lengths = int64_array(fragment_lengths, "fragment_lengths", sample_id)
    flags = flag_array(trainable, "trainable flags", sample_id)
    n = None if num_tokens is None else token_count(num_tokens, sample_id)
    return _native.mask_from_fragments(lengths, flags, n, sample_name(sample_id))


def turn_spans(
    token_ids: Sequence[int] | npt.ArrayLike,
    turn_marker_ids: Sequence[int] | npt.ArrayLike,
    *,
    sample_id: Hashable | None = None,
) -> np.ndarray:
    """User/assistant turn spans from marker tokens.

    Every position whose token id is in ``turn_marker_ids`` starts a turn. Turns alternate
    user, assistant, user, assistant, ..., so markers must come in pairs. Returns an int64 array
    of shape ``(pairs, 4)``; row ``k`` is ``[user_start, user_end, assistant_start,
    assistant_end]``, half-open: ``user_start`` is the user marker's position, ``user_end ==
    assistant_start`` is the assistant marker's position (the marker belongs to the turn it
    opens), and ``assistant_end`` is the next user marker's position, or ``len(token_ids)`` for
    the last pair. Tokens before the first marker (a BOS, a system prompt) belong to no turn.

    Raises ``TurnStructureError`` naming the sample when there is no marker or an odd number of
    them (a conversation that ends on a user turn), never an ``IndexError``.
    """
    tokens = int64_array(token_ids, "token_ids", sample_id)
    markers = int64_array(turn_marker_ids, "turn_marker_ids", sample_id)
    flat = _native.turn_spans(tokens, markers, sample_name(sample_id))
    return flat.reshape(-1, 4)


def _template_of(tokenizer: Any) -> str:
    template = templates.template_text(tokenizer)
    if template is None:
        raise ChatTemplateError(
            f"tokenizer {type(tokenizer).__name__} has no chat template (set chat_template)"
        )
    return template


def from_chat_template(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    train_roles: Sequence[str] = ("assistant",),
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and loss mask of a conversation rendered by a Hugging Face chat template
    (with the JSON tool schemas `tools`, as ``apply_chat_template(..., tools=)``).

    Returns ``(token_ids, mask)``: 1-D int64 and bool numpy arrays of equal length; the tokens
    are ``apply_chat_template(messages, tokenize=True)``'s. The conversation is rendered once
    (`mmpack.batch.templates.render`; linear in its length, for any template):

    * Tokens in the template's ``{% generation %}`` blocks are exactly those of
      ``apply_chat_template(..., return_assistant_tokens_mask=True)``; they train when
      ``assistant`` is in ``train_roles``. An ``assistant`` message trains only through blocks
      when the template has them.
    * Every other token trains when the message that owns it has its role in
      ``train_roles``, by the roles rule of `mmpack.batch.rendered_tokens`: a message owns
      what its values rendered and the rest of its turn from its first value on (its
      end-of-turn token); role headers and text the template injects (a default system prompt,
      a date line) belong to no message and never train.

    Needs a fast tokenizer (character offsets). Raises `ChatTemplateError` when the template
    fails on the conversation.
    """
    roles = role_list(train_roles, "train_roles")
    template = _template_of(tokenizer)
    msgs = [dict(m) for m in messages]
    if not msgs:
        raise ChatTemplateError("from_chat_template needs at least one message")
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ChatTemplateError(
            f"from_chat_template needs a fast tokenizer (token offsets); "
            f"{type(tokenizer).__name__} has none"
        )
    msg_roles = [str(m.get("role", "")) for m in msgs]
    uses_blocks = templates.has_generation_markers(template)
    traced = RenderedTokens.needs_values(msg_roles, roles, uses_blocks)
    rendering = templates.render(
        template,
        msgs,
        variables=templates.template_variables(tokenizer, tools=tools),
        trace_values=traced,
        trace_turns=traced,
    )
    try:
        encoding = untruncated_encode(backend, rendering.text)
    except Exception as err:  # the tokenizer refuses the text (a lone surrogate)
        raise ChatTemplateError(
            f"the tokenizer cannot encode the rendering ({type(err).__name__}: {err})"
        ) from err
    tokens = RenderedTokens(rendering, token_offsets(encoding), len(msgs), msg_roles)
    labels = tokens.role_labels(msg_roles, uses_blocks)
    if traced:
        only_blocks = tokens.generation_messages(msg_roles, uses_blocks)
        tokens.check_placed(
            [r in roles and not only_blocks[m] for m, r in enumerate(msg_roles)],
            [_has_values(m) for m in msgs],
        )
    # labels: -2 (a block outside every turn), -1 (never), or the deciding message
    trains = np.asarray(
        [GENERATION_ROLE in roles, False, *(r in roles for r in msg_roles)], dtype=np.bool_
    )
    return np.asarray(encoding.ids, dtype=np.int64), trains[labels + 2]


def _has_values(message: Mapping[str, Any]) -> bool:
    """Whether a message has a non-empty string to render besides its role."""
    stack = [v for k, v in message.items() if k != "role"]
    while stack:
        value = stack.pop()
        if isinstance(value, str) and value:
            return True
        if isinstance(value, Mapping):
            stack.extend(value.values())
        elif isinstance(value, (list, tuple)):
            stack.extend(value)
    return False
