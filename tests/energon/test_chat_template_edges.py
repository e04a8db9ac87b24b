"""Chat-template shapes and tokenizer states that could make the one-render encoder return
wrong data silently, each against its consumer (transformers' ``apply_chat_template`` and its
assistant mask) or refused with a typed error: nested and commented generation blocks, loops
that scan the messages, loops by index, tool calls rendered only through ``tojson``, flagged
text a template transforms, a tokenizer left truncating or padding, special tokens changed
after construction, and values transformers converts (dataclasses, numpy)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
from mmpack.batch import masks
from mmpack.energon import PackingEncoderConfig, PackingTaskEncoder
from mmpack.energon.samples import Conversation, Part, Turn
from mmpack.errors import ChatTemplateError, EnergonConfigError, SampleFormatError
from mmpack_dev.qwen_vocab import qwen2_vl_tokenizer
from support.conversations import cooked_conversation, cooked_messages, encoded_mask

CHATML = (
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' }}"
    "{{- message.content + '<|im_end|>\\n' }}{%- endfor %}"
)
MESSAGES = [
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "hello"},
    {"role": "user", "content": "again"},
    {"role": "assistant", "content": "bye"},
]


def hf(tok: Any, messages: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
    out = tok.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    return list(out["input_ids"]), list(out["assistant_masks"])


def trained(tok: Any, ids: Any, mask: Any) -> str:
    return str(tok.decode([t for t, m in zip(list(ids), list(mask), strict=True) if m]))


def cooked(messages: list[dict[str, Any]]) -> Conversation:
    return cooked_messages("edge", messages)


def energon(tok: Any, mode: str | None = None) -> PackingTaskEncoder:
    return PackingTaskEncoder(
        PackingEncoderConfig(modalities=[], loss_mask_mode=mode), tokenizer=tok
    )


def test_nested_generation_blocks_train_the_outer_block() -> None:
    template = (
        "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' }}"
        "{%- if message.role == 'assistant' %}{% generation %}{{- '<think>\\n' }}"
        "{% generation %}{{- message.reasoning_content }}{% endgeneration %}"
        "{{- '\\n</think>\\n\\n' + message.content + '<|im_end|>' }}{% endgeneration %}"
        "{%- else %}{{- message.content + '<|im_end|>' }}{%- endif %}{{- '\\n' }}{%- endfor %}"
    )
    tok = qwen2_vl_tokenizer(template)
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello friend", "reasoning_content": "greet back"},
    ]
    ids, mask = masks.from_chat_template(tok, messages)
    assert (ids.tolist(), mask.astype(int).tolist()) == hf(tok, messages)
    assert trained(tok, ids, mask) == "<think>\ngreet back\n</think>\n\nhello friend<|im_end|>"


def test_a_commented_generation_tag_marks_nothing() -> None:
    # the tag in a comment is no block: the roles rule decides, as for the plain template
    tok = qwen2_vl_tokenizer("{# {% generation %} is not used here #}" + CHATML)
    ids, mask = masks.from_chat_template(tok, MESSAGES)
    assert trained(tok, ids, mask) == "hello<|im_end|>\nbye<|im_end|>\n"
    enc = energon(tok)
    assert not enc.conversation_encoder.uses_generation_blocks


@pytest.mark.parametrize(
    "scan",
    [
        # a scan after the rendering loop
        CHATML + "{%- set ns = namespace(n=0) %}{%- for m in messages %}"
        "{%- set ns.n = ns.n + 1 %}{%- endfor %}",
        # a scan inside it
        "{%- for message in messages %}{%- set ns = namespace(n=0) %}{%- for m in messages %}"
        "{%- set ns.n = ns.n + 1 %}{%- endfor %}{{- '<|im_start|>' + message.role + '\\n' }}"
        "{{- message.content + '<|im_end|>\\n' }}{%- endfor %}",
    ],
    ids=["after", "inside"],
)
def test_a_loop_that_scans_the_messages_keeps_their_turns(scan: str) -> None:
    tok = qwen2_vl_tokenizer(scan)
    ids, mask = masks.from_chat_template(tok, MESSAGES)
    assert trained(tok, ids, mask) == "hello<|im_end|>\nbye<|im_end|>\n"
    assert encoded_mask(energon(tok), cooked(MESSAGES)) == (ids.tolist(), mask.astype(int).tolist())


def test_a_rebound_loop_variable_still_ends_each_turn() -> None:
    template = (
        "{%- for message in messages %}{%- set message = message %}"
        "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
        "{%- endfor %}"
    )
    tok = qwen2_vl_tokenizer(template)
    ids, mask = masks.from_chat_template(tok, MESSAGES)
    assert trained(tok, ids, mask) == "hello<|im_end|>\nbye<|im_end|>\n"


@pytest.mark.parametrize(
    "template",
    [
        # a loop by index: no loop over the messages themselves, so no turn is known
        "{%- for i in range(messages|length) %}{%- set message = messages[i] %}"
        "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
        "{%- endfor %}",
        # the reply transformed beyond following
        "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' }}"
        "{{- message.content | upper + '<|im_end|>\\n' }}{%- endfor %}",
    ],
    ids=["index-loop", "upper"],
)
def test_a_reply_that_cannot_be_placed_is_refused_on_both_paths(template: str) -> None:
    tok = qwen2_vl_tokenizer(template)
    with pytest.raises(ChatTemplateError, match="message 1"):
        masks.from_chat_template(tok, MESSAGES)
    # the Energon encoder's startup probe meets the same refusal: the run stops at construction
    with pytest.raises(EnergonConfigError, match=r"probe.*message 1"):
        energon(tok)


def test_a_tool_call_rendered_only_through_tojson_is_refused_not_left_untrained() -> None:
    template = (
        "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' }}"
        "{%- if message.content %}{{- message.content }}{%- endif %}"
        "{%- if message.tool_calls %}{{- '<tool_call>' + message.tool_calls | tojson + "
        "'</tool_call>' }}{%- endif %}{{- '<|im_end|>\\n' }}{%- endfor %}"
    )
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"c": "P"}}}
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
    ]
    tok = qwen2_vl_tokenizer(template)
    with pytest.raises(ChatTemplateError, match="message 1's values"):
        masks.from_chat_template(tok, messages)


def test_a_flagged_part_the_template_transforms_is_refused_in_precomputed_mode() -> None:
    # a generation block decides the reply, but the flag of a part it cannot follow (the
    # replace filter keeps no marks) cannot be honoured: refused, never trained anyway
    template = (
        "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' }}"
        "{%- if message.role == 'assistant' %}{% generation %}"
        "{{- message.content | replace('\\r\\n', '\\n') + '<|im_end|>' }}{% endgeneration %}"
        "{%- else %}{{- message.content + '<|im_end|>' }}{%- endif %}{{- '\\n' }}{%- endfor %}"
    )
    tok = qwen2_vl_tokenizer(template)
    conv = cooked_conversation(
        "flags",
        [
            Turn("user", (Part(text="q", trainable=False),)),
            Turn(
                "assistant",
                (
                    Part(text="public answer. ", trainable=True),
                    Part(text="SECRET", trainable=False),
                ),
            ),
        ],
    )
    with pytest.raises(ChatTemplateError, match=r"'flags'.*trainable=(True|False) flag cannot"):
        energon(tok, "precomputed").encode_conversation(conv)


@pytest.mark.parametrize("state", ["truncation", "padding", "split-special"])
def test_a_tokenizer_left_truncating_padding_or_splitting_changes_nothing(state: str) -> None:
    tok = qwen2_vl_tokenizer(CHATML)
    enc = energon(tok)
    expected_ids = hf(tok, MESSAGES)[0]
    if state == "truncation":
        tok("some text to truncate", truncation=True, max_length=3)  # leaves it truncating
        tok.backend_tokenizer.enable_truncation(3)
    elif state == "padding":
        tok.backend_tokenizer.enable_padding(length=96, pad_id=0)
    else:
        tok("x <|im_start|>", split_special_tokens=True)  # leaves special tokens split
    ids, mask = masks.from_chat_template(tok, MESSAGES)
    assert ids.tolist() == expected_ids
    assert trained(tok, ids, mask) == "hello<|im_end|>\nbye<|im_end|>\n"
    assert encoded_mask(enc, cooked(MESSAGES))[0] == expected_ids


def test_a_special_token_set_after_construction_renders_as_transformers_does() -> None:
    tok = qwen2_vl_tokenizer("{{ bos_token }}" + CHATML)
    tok.bos_token = "<|endoftext|>"
    enc = energon(tok)
    tok.bos_token = "<|vision_start|>"
    assert encoded_mask(enc, cooked(MESSAGES))[0] == hf(tok, MESSAGES)[0]


def test_values_transformers_converts_render_as_it_renders_them() -> None:
    @dataclasses.dataclass
    class Function:
        name: str
        arguments: dict[str, Any]

    template = (
        "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' }}"
        "{{- message.content }}{%- for call in message.tool_calls or [] %}"
        "{{- call.function.name + ' ' + call.extra | string }}{%- endfor %}"
        "{{- '<|im_end|>\\n' }}{%- endfor %}"
    )
    tok = qwen2_vl_tokenizer(template)
    messages = [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": "ok ",
            "tool_calls": [
                {"function": Function("f", {"x": 1}), "extra": np.zeros(2)},
                {"function": {"name": "g"}, "extra": np.float32(0.5)},
            ],
        },
    ]
    ids, _ = masks.from_chat_template(tok, messages)
    assert ids.tolist() == hf(tok, messages)[0]


def test_text_the_tokenizer_cannot_encode_is_a_typed_error_naming_the_sample() -> None:
    tok = qwen2_vl_tokenizer(CHATML)
    bad = [{"role": "user", "content": "lone \ud800 surrogate"}, MESSAGES[1]]
    with pytest.raises(ChatTemplateError, match="cannot encode"):
        masks.from_chat_template(tok, bad)
    with pytest.raises(SampleFormatError, match=r"'edge'.*cannot encode"):
        energon(tok).encode_conversation(cooked(bad))


def test_a_freed_tokenizers_plain_copy_is_never_reused_for_another() -> None:
    """Two tokenizers left truncating, one freed before the other is made (so it may take
    the same address): each encodes with its own vocabulary."""
    import gc

    tok = qwen2_vl_tokenizer(CHATML)
    tok.add_tokens(["ZZ"])
    tok.backend_tokenizer.enable_truncation(10_000)
    masks.from_chat_template(tok, [{"role": "user", "content": " ZZTOP"}])
    del tok
    gc.collect()
    other = qwen2_vl_tokenizer(CHATML)
    other.add_tokens(["ZZTO"])
    other.backend_tokenizer.enable_truncation(10_000)
    messages = [{"role": "user", "content": " ZZTOP"}]
    ids, _ = masks.from_chat_template(other, messages)
    assert ids.tolist() == other.apply_chat_template(messages)["input_ids"]


def test_with_flags_a_block_still_trains_an_unflagged_message_it_holds() -> None:
    """A block holding the assistant's call and the tool result after it: HF trains both; a
    flag on the call alone does not stop the result from training (the block decides for a
    message without flags of its own)."""
    template = (
        "{% for m in messages %}{% if m.role == 'assistant' %}<|im_start|>assistant\n"
        "{% generation %}{{ m.content }}<|im_end|>\n"
        "{% if not loop.last and messages[loop.index0 + 1].role == 'tool' %}<|im_start|>tool\n"
        "{{ messages[loop.index0 + 1].content }}<|im_end|>\n{% endif %}{% endgeneration %}"
        "{% elif m.role == 'tool' %}{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}"
        "<|im_end|>\n{% endif %}{% endfor %}"
    )
    tok = qwen2_vl_tokenizer(template)
    messages = [
        {"role": "user", "content": "USERQ"},
        {"role": "assistant", "content": "CALL"},
        {"role": "tool", "content": "TOOLOUT"},
        {"role": "assistant", "content": "FINAL"},
    ]
    expected = hf(tok, messages)
    assert "TOOLOUT" in trained(tok, *expected)
    conv = cooked_conversation(
        "block",
        [
            Turn("user", (Part(text="USERQ"),)),
            Turn("assistant", (Part(text="CALL", trainable=True),)),
            Turn("tool", (Part(text="TOOLOUT"),)),
            Turn("assistant", (Part(text="FINAL"),)),
        ],
    )
    assert encoded_mask(energon(tok, "precomputed"), conv) == expected
    flagged_off = cooked_conversation(
        "block",
        [
            Turn("user", (Part(text="USERQ"),)),
            Turn("assistant", (Part(text="CALL", trainable=True),)),
            Turn("tool", (Part(text="TOOLOUT", trainable=False),)),
            Turn("assistant", (Part(text="FINAL"),)),
        ],
    )
    ids, mask = encoded_mask(energon(tok, "precomputed"), flagged_off)
    assert "TOOLOUT" not in trained(tok, ids, mask) and "CALL" in trained(tok, ids, mask)


def test_an_images_wrapper_tokens_follow_its_placeholder_in_precomputed_mode(
    qwen_processor: Any,
) -> None:
    from mmpack.energon.media import MediaHandle
    from mmpack_dev.synthetic import png_bytes

    image = MediaHandle(
        kind="image",
        key="a.png",
        sample_key="img",
        source=("test", "a.png"),
        data=png_bytes(56, 56, seed=1),
        meta={},
    )
    enc = PackingTaskEncoder(
        PackingEncoderConfig(modalities=["image"], loss_mask_mode="precomputed"),
        processor=qwen_processor,
    )
    tok = qwen_processor.tokenizer
    for turns in (
        [
            Turn("user", (Part(text="draw"),)),
            Turn(
                "assistant",
                (
                    Part(text="here:", trainable=False),
                    Part(media=image),
                    Part(text="done", trainable=True),
                ),
            ),
        ],
        [
            Turn("user", (Part(media=image), Part(text="describe", trainable=True))),
            Turn("assistant", (Part(text="ok", trainable=True),)),
        ],
    ):
        ids, mask = encoded_mask(enc, cooked_conversation("img", turns))
        text = trained(tok, ids, mask)
        # the message flags its parts: the image is not trained, nor what wraps it
        assert "<|vision_start|>" not in text and "<|image_pad|>" not in text
        assert "<|vision_end|>" not in text
