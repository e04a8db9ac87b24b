"""masks.from_chat_template with a tiny tokenizer built in the test (nothing downloaded): the
`{% generation %}` path and the per-message path agree."""

from __future__ import annotations

import numpy as np
import pytest
from mmpack.batch import EncodedSample, masks, pack_samples
from mmpack.errors import ChatTemplateError
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

WORDS = [
    "<unk>",
    "<pad>",
    "<s>",
    "</s>",
    "<user>",
    "<asst>",
    "<sys>",
    "what",
    "is",
    "two",
    "plus",
    "four",
    "thanks",
    "yes",
    "be",
    "brief",
]

BODY = "<{{ 'user' if m['role'] == 'user' else 'sys' }}> {{ m['content'] }} </s> "
GENERATION = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}"
    "{% generation %}<asst> {{ m['content'] }} </s> {% endgeneration %}"
    "{% else %}" + BODY + "{% endif %}{% endfor %}"
)
PLAIN = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}<asst> {{ m['content'] }} </s> "
    "{% else %}" + BODY + "{% endif %}{% endfor %}"
)

MESSAGES = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "what is two plus two"},
    {"role": "assistant", "content": "four"},
    {"role": "user", "content": "thanks"},
    {"role": "assistant", "content": "yes"},
]


def _tokenizer(template: str) -> PreTrainedTokenizerFast:
    vocab = {w: i for i, w in enumerate(WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        additional_special_tokens=["<user>", "<asst>", "<sys>"],
    )
    hf.chat_template = template
    return hf


def test_generation_template_and_per_message_boundaries_agree() -> None:
    ids_gen, mask_gen = masks.from_chat_template(_tokenizer(GENERATION), MESSAGES)
    ids_msg, mask_msg = masks.from_chat_template(_tokenizer(PLAIN), MESSAGES)
    words = [WORDS[i] for i in ids_gen]
    assert (
        words
        == (
            "<sys> be brief </s> <user> what is two plus two </s> <asst> four </s> "
            "<user> thanks </s> <asst> yes </s>"
        ).split()
    )
    assert ids_gen.dtype == np.int64 and mask_gen.dtype == np.bool_
    assert ids_gen.tolist() == ids_msg.tolist()
    assert mask_gen.tolist() == mask_msg.tolist()
    trained = [w for w, m in zip(words, mask_gen, strict=True) if m]
    assert trained == ["<asst>", "four", "</s>", "<asst>", "yes", "</s>"]


def test_per_message_path_honours_train_roles() -> None:
    # Other train roles than the assistant take the per-message path even with a generation tag.
    ids, mask = masks.from_chat_template(_tokenizer(GENERATION), MESSAGES, ("system",))
    words = [WORDS[i] for i, m in zip(ids, mask, strict=True) if m]
    assert words == ["<sys>", "be", "brief", "</s>"]


def test_chat_template_output_feeds_pack_samples() -> None:
    ids, mask = masks.from_chat_template(_tokenizer(PLAIN), MESSAGES)
    b = pack_samples([EncodedSample("chat", ids, loss_mask=mask)], loss_mask_mode="precomputed")
    assert b.token_mask.tolist() == mask.tolist()
    assert b.loss_mask.tolist() == [*mask.tolist()[1:], False]  # the same, on the labels


def test_template_errors() -> None:
    hf = _tokenizer(PLAIN)
    with pytest.raises(ChatTemplateError, match="at least one message"):
        masks.from_chat_template(hf, [])
    # not prefix-stable: the first message renders differently once more follow
    unstable = _tokenizer(
        "{% for m in messages %}{% if loop.last %}<s> {% endif %}<user> {{ m['content'] }} "
        "{% endfor %}"
    )
    with pytest.raises(ChatTemplateError, match="not prefix-stable"):
        masks.from_chat_template(unstable, MESSAGES[1:3])
    hf.chat_template = None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        masks.from_chat_template(hf, MESSAGES)
