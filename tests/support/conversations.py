"""Conversations built in code for the Energon tests (what a cooker would hand the encoder)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from mmpack.batch import masks
from mmpack.energon.samples import Conversation, Part, Turn


def cooked_conversation(
    key: str, turns: Sequence[Turn], *, subflavors: object = None
) -> Conversation:
    """A cooked conversation named ``key``, from no real source."""
    return Conversation(
        __key__=key,
        __restore_key__=(),
        __subflavors__=subflavors,
        __sources__=(),
        source_format="test",
        turns=list(turns),
    )


def cooked_messages(key: str, messages: Sequence[Mapping[str, Any]]) -> Conversation:
    """Hugging Face messages as the generic cooker hands them over: each text one part (none
    when empty or null), every other key a field."""
    turns = []
    for m in messages:
        content = m.get("content") or ""
        fields = {k: v for k, v in m.items() if k not in ("role", "content")}
        turns.append(Turn(m["role"], (Part(text=content),) if content else (), fields=fields))
    return cooked_conversation(key, turns)


def encoded_mask(enc: Any, conv: Conversation) -> tuple[list[int], list[int]]:
    """Tokens and loss mask (0/1) of `conv` through an Energon task encoder `enc`: its
    precomputed mask, or in roles mode the mask of its spans training the assistant; the
    trainable count it reports is checked against the mask."""
    encoded = enc.encode_conversation(conv)
    if encoded.loss_mask is not None:
        mask = np.asarray(encoded.loss_mask, dtype=np.bool_)
    else:
        mask = masks.from_roles(encoded.message_lengths, encoded.message_roles, ("assistant",))
    assert encoded.trainable_tokens == int(mask.sum())
    return encoded.token_ids.tolist(), mask.astype(int).tolist()
