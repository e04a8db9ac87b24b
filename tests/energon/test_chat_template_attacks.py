"""Hostile conversations and templates for `ChatTemplateEncoder`, checked against the consumer:
``apply_chat_template(..., return_assistant_tokens_mask=True)`` over Qwen2-VL's real tokenizer."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from mmpack.batch import masks
from mmpack.energon.chat_template import ChatTemplateEncoder, hf_messages, markup_media
from mmpack.energon.media import MediaSettings
from mmpack.energon.samples import Conversation, Part, Turn

_HEADER = "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
# generation blocks around the reply's text only: an empty reply has no tokens in its block
CONTENT_ONLY_GENERATION = (
    _HEADER + "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}"
    "{% endgeneration %}{% else %}{{ message['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
)
# only the last reply is in a generation block (train on the final turn only)
LAST_REPLY_GENERATION = (
    _HEADER + "{% if message['role'] == 'assistant' and loop.last %}{% generation %}"
    "{{ message['content'] }}<|im_end|>{% endgeneration %}{% else %}{{ message['content'] }}"
    "<|im_end|>{% endif %}\n{% endfor %}"
)


def _conversation(*turns: tuple[str, str]) -> Conversation:
    return Conversation(
        __key__="attack",
        __restore_key__=(),
        __subflavors__={},
        source_format="test",
        turns=[Turn(role=role, parts=(Part(text=text),)) for role, text in turns],
    )


def _encoded_mask(tokenizer: Any, conversation: Conversation, mode: str | None) -> Any:
    encoder = ChatTemplateEncoder(
        tokenizer=tokenizer,
        media=markup_media(tokenizer, MediaSettings(), []),
        train_roles=("assistant",),
        loss_mask_mode=mode,
    )
    out = encoder.encode(conversation)
    if out.loss_mask is not None:
        mask = np.asarray(out.loss_mask, dtype=np.bool_)
    else:
        mask = masks.from_roles(out.message_lengths, out.message_roles, encoder.train_roles)
    return np.asarray(out.token_ids).tolist(), np.asarray(mask, dtype=np.bool_).tolist()


def _consumer_mask(tokenizer: Any, conversation: Conversation) -> Any:
    out = tokenizer.apply_chat_template(
        hf_messages(conversation),
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
    )
    return list(out["input_ids"]), [bool(v) for v in out["assistant_masks"]]


@pytest.mark.parametrize("mode", [None, "precomputed"])
@pytest.mark.parametrize(
    ("template", "turns"),
    [
        (CONTENT_ONLY_GENERATION, (("user", "q"), ("assistant", ""))),
        (
            CONTENT_ONLY_GENERATION,
            (("user", "q"), ("assistant", ""), ("user", "r"), ("assistant", "a")),
        ),
        (
            LAST_REPLY_GENERATION,
            (("user", "q"), ("assistant", "a1"), ("user", "r"), ("assistant", "a2")),
        ),
    ],
    ids=["empty-reply", "empty-then-reply", "last-reply-only"],
)
def test_reply_outside_generation_blocks_is_not_trained(
    template: str, turns: tuple[tuple[str, str], ...], mode: str | None
) -> None:
    # the template leaves an assistant reply outside its generation blocks: the consumer does
    # not train it, so neither may the encoder (not its header, not its text)
    from mmpack_dev.qwen_vocab import qwen2_vl_tokenizer

    tokenizer = qwen2_vl_tokenizer(template)
    conversation = _conversation(*turns)
    assert _encoded_mask(tokenizer, conversation, mode) == _consumer_mask(tokenizer, conversation)
