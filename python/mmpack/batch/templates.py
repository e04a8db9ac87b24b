"""A tokenizer's chat template: its text, whether it marks assistant output with
``{% generation %}`` blocks, and the rendering of each message prefix (how per-message
boundaries are found, by `mmpack.batch.masks.from_chat_template` and by the Energon
chat-template encoder)."""

from __future__ import annotations

import re
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

from mmpack.errors import ChatTemplateError

__all__ = ["GENERATION_TAG", "has_generation_markers", "render_prefixes", "template_text"]

#: ``{% generation %}`` in a Jinja chat template, with Jinja's optional whitespace control
#: (``-``) or its override (``+``) on either side, as Jinja itself parses the tag
GENERATION_TAG = re.compile(r"\{%[-+]?\s*generation\s*[-+]?%\}")


def template_text(tokenizer: Any) -> str | None:
    """The tokenizer's chat template (the default one of named templates), or None."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default")
    return template if isinstance(template, str) and template else None


def has_generation_markers(template: str | None) -> bool:
    """Whether `template` marks assistant output with ``{% generation %}``."""
    return template is not None and bool(GENERATION_TAG.search(template))


def render_prefixes(
    tokenizer: Any, messages: Sequence[Mapping[str, Any]], *, sample_id: Hashable | None = None
) -> list[str]:
    """The template's rendering (``tokenize=False``) of each prefix ``messages[:k]``, for
    ``k = 1 .. len(messages)``. Raises `ChatTemplateError` naming the sample when the template
    fails or renders something other than a string."""
    where = "" if sample_id is None else f"sample {sample_id!r}: "
    msgs = [dict(m) for m in messages]
    renderings = []
    for k in range(1, len(msgs) + 1):
        try:
            text = tokenizer.apply_chat_template(msgs[:k], tokenize=False)
        except Exception as err:
            raise ChatTemplateError(
                f"{where}the chat template failed to render ({type(err).__name__}: {err})"
            ) from err
        if not isinstance(text, str):
            raise ChatTemplateError(f"{where}the chat template rendered {type(text)}")
        renderings.append(text)
    return renderings
