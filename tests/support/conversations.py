"""Conversations built in code for the Energon tests (what a cooker would hand the encoder)."""

from __future__ import annotations

from collections.abc import Sequence

from mmpack.energon.samples import Conversation, Turn


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
