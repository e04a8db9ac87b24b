"""masks.from_chat_template on Qwen2-VL's real tokenizer (Qwen2's byte-level BPE, built
offline): the `{% generation %}` path and the per-message path agree."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from mmpack.batch import EncodedSample, masks, pack_samples
from mmpack.errors import ChatTemplateError
from mmpack_dev.qwen_vocab import qwen2_vl_tokenizer

# Qwen2-VL's released template (string contents), with each assistant message's reply and the
# end of its turn in a generation block: what the roles rule trains
WHOLE_MESSAGE_GENERATION = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "{% if message['role'] == 'assistant' %}<|im_start|>assistant\n{% generation %}"
    "{{ message['content'] }}<|im_end|>\n{% endgeneration %}{% else %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
)

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "Thanks! 谢谢"},
    {"role": "assistant", "content": "  You're welcome.\n\n"},
]


@pytest.fixture(scope="module")
def whole_message_generation() -> Any:
    return qwen2_vl_tokenizer(WHOLE_MESSAGE_GENERATION)


def test_generation_template_and_per_message_boundaries_agree(
    qwen_tokenizer: Any, whole_message_generation: Any
) -> None:
    ids_gen, mask_gen = masks.from_chat_template(whole_message_generation, MESSAGES)
    ids_msg, mask_msg = masks.from_chat_template(qwen_tokenizer, MESSAGES)
    assert qwen_tokenizer.decode(ids_gen.tolist()) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n<|im_start|>user\nThanks! 谢谢<|im_end|>\n"
        "<|im_start|>assistant\n  You're welcome.\n\n<|im_end|>\n"
    )
    assert ids_gen.dtype == np.int64 and mask_gen.dtype == np.bool_
    assert ids_gen.tolist() == ids_msg.tolist()
    assert mask_gen.tolist() == mask_msg.tolist()
    trained = [t for t, m in zip(ids_gen.tolist(), mask_gen, strict=True) if m]
    assert qwen_tokenizer.decode(trained) == "4<|im_end|>\n  You're welcome.\n\n<|im_end|>\n"


def test_per_message_path_honours_train_roles(whole_message_generation: Any) -> None:
    # other train roles than the assistant follow the roles rule beside the generation blocks
    ids, mask = masks.from_chat_template(whole_message_generation, MESSAGES, ("system",))
    trained = [t for t, m in zip(ids.tolist(), mask, strict=True) if m]
    assert whole_message_generation.decode(trained) == "Be brief.<|im_end|>\n"


def test_chat_template_output_feeds_pack_samples(qwen_tokenizer: Any) -> None:
    ids, mask = masks.from_chat_template(qwen_tokenizer, MESSAGES)
    b = pack_samples([EncodedSample("chat", ids, loss_mask=mask)], loss_mask_mode="precomputed")
    assert b.token_mask.tolist() == mask.tolist()
    assert b.loss_mask.tolist() == [*mask.tolist()[1:], False]  # the same, on the labels


def test_template_errors(qwen_tokenizer: Any) -> None:
    with pytest.raises(ChatTemplateError, match="at least one message"):
        masks.from_chat_template(qwen_tokenizer, [])
    # a template's own refusal (raise_exception) is a ChatTemplateError with its message
    strict = qwen2_vl_tokenizer(
        "{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('no system messages') }}{% endif %}{{ m['content'] }}{% endfor %}"
    )
    with pytest.raises(ChatTemplateError, match="no system messages"):
        masks.from_chat_template(strict, MESSAGES)
    strict.chat_template = None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        masks.from_chat_template(strict, MESSAGES)


def test_a_template_that_renders_the_last_message_differently_is_accepted(
    qwen_tokenizer: Any,
) -> None:
    # rendering each prefix would see the first message rendered differently once more
    # follow; one render of the whole conversation has no such question
    template = (
        "{% for m in messages %}{% if loop.last %}<|endoftext|>{% endif %}<|im_start|>"
        "{{ m['content'] }}{% endfor %}"
    )
    tok = qwen2_vl_tokenizer(template)
    ids, mask = masks.from_chat_template(tok, MESSAGES[1:3])
    assert ids.tolist() == tok.apply_chat_template(MESSAGES[1:3], tokenize=True)["input_ids"]
    trained = [t for t, m in zip(ids.tolist(), mask, strict=True) if m]
    assert tok.decode(trained) == "4"
