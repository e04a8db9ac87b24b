"""Chat templates of six model families, as released and generation-marked, on the real Qwen2
vocabulary (each family's control tokens added), against their consumer:

* Qwen2-VL (list contents with images and videos), Qwen2.5 (tool calls, parallel tool results
  grouped into one turn, a default system prompt), Qwen3 (reasoning kept only after the last
  user query), Llama 3.1 (content trimmed, a date header), Gemma 3 (the system message rendered
  inside the first user turn) and OLMo 2 / Tulu (a suffix only when a turn is not the last).
* With generation blocks: tokens and mask of ``masks.from_chat_template`` and of the Energon
  encoder, in both mask modes, equal ``apply_chat_template(..., return_assistant_tokens_mask=
  True)``'s, on drawn multi-turn conversations.
* Without: the roles rule holds character by character against `reference.chat_roles`, which
  derives each character's owner from transformers' own rendering; no header or injected
  text is ever trained, and a reply's first word the template joins to its own space (Llama 2
  / Mistral ``[INST]`` templates) is.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mmpack.batch import masks
from mmpack.energon import PackingEncoderConfig, PackingTaskEncoder
from mmpack.energon.samples import Conversation
from mmpack_dev.chat_conversations import conversations
from mmpack_dev.chat_templates import FAMILIES, family_tokenizer
from reference.chat_roles import owners
from support.conversations import cooked_messages, encoded_mask

FAMILY_NAMES = sorted(FAMILIES)
EXAMPLES = settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def hf_mask(tokenizer: Any, messages: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
    out = tokenizer.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    return list(out["input_ids"]), list(out["assistant_masks"])


def text_only(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages with list contents joined into their text (what the Energon encoder hands a
    template when the run has no media)."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(item.get("text", "") for item in content)
        out.append({**m, "content": content})
    return out


def cooked(messages: list[dict[str, Any]]) -> Conversation:
    return cooked_messages("drawn", messages)


def energon_encoders(family: str, generation: bool) -> dict[Any, PackingTaskEncoder]:
    tok = family_tokenizer(family, generation=generation)
    return {
        mode: PackingTaskEncoder(
            PackingEncoderConfig(modalities=[], loss_mask_mode=mode), tokenizer=tok
        )
        for mode in (None, "precomputed")
    }


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_masks_equal_the_templates_assistant_mask(family: str) -> None:
    tok = family_tokenizer(family, generation=True)

    @EXAMPLES
    @given(messages=conversations(family))
    def check(messages: list[dict[str, Any]]) -> None:
        ids, mask = masks.from_chat_template(tok, messages)
        assert (ids.tolist(), mask.astype(int).tolist()) == hf_mask(tok, messages)

    check()


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_energon_equals_the_templates_assistant_mask_in_both_modes(family: str) -> None:
    tok = family_tokenizer(family, generation=True)
    encoders = energon_encoders(family, generation=True)

    @EXAMPLES
    @given(messages=conversations(family).map(text_only))
    def check(messages: list[dict[str, Any]]) -> None:
        expected = hf_mask(tok, messages)
        for enc in encoders.values():
            assert encoded_mask(enc, cooked(messages)) == expected

    check()


_BREAKS = st.sampled_from([" ", ", ", ". ", " - "])
_WORDS = st.text(
    st.characters(
        codec="utf-8",
        categories=("L", "N", "P", "So"),
        # no template syntax; nothing JSON escapes (the reference locates values verbatim)
        exclude_characters='<>{}%|"\\',
    ),
    min_size=1,
    max_size=6,
)
CLEAN = st.builds(
    lambda first, rest: first + "".join(b + w for b, w in rest),
    _WORDS,
    st.lists(st.tuples(_BREAKS, _WORDS), max_size=4),
)


def cleaned(messages: list[dict[str, Any]], words: list[str]) -> list[dict[str, Any]]:
    """The messages with every string value (but roles and content item types) replaced by
    clean text (non-empty, no surrounding whitespace, no template syntax): values a template
    renders verbatim, which the reference can locate."""
    pool = iter(words * (1 + 200 // max(len(words), 1)))

    def clean(value: Any, key: Any = None) -> Any:
        if isinstance(value, str):
            return value if key in ("role", "type") else next(pool)
        if isinstance(value, dict):
            return {k: clean(v, k) for k, v in value.items()}
        if isinstance(value, list):
            return [clean(v) for v in value]
        return value

    return [clean(m) for m in messages]


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_the_roles_rule_holds_character_by_character(family: str) -> None:
    tok = family_tokenizer(family, generation=False)
    encoders = energon_encoders(family, generation=False)
    special = dict(tok.special_tokens_map)

    @EXAMPLES
    @given(
        messages=st.builds(
            cleaned, conversations(family).map(text_only), st.lists(CLEAN, min_size=1)
        )
    )
    def check(messages: list[dict[str, Any]]) -> None:
        text, owner = owners(tok.chat_template, messages, special)
        assert text == tok.apply_chat_template(messages, tokenize=False)
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        roles = [m["role"] for m in messages]
        expected = []
        for start, end in enc["offset_mapping"]:
            # a token is one message's when that message owns some of its characters and no
            # other message any (the template's own characters beside them aside)
            held = set(owner[start:end]) - {-1}
            (m,) = held if len(held) == 1 else (-1,)
            expected.append(int(m >= 0 and roles[m] == "assistant"))
        ids, mask = masks.from_chat_template(tok, messages)
        assert ids.tolist() == enc["input_ids"]
        assert mask.astype(int).tolist() == expected
        for e in encoders.values():
            assert encoded_mask(e, cooked(messages)) == (enc["input_ids"], expected)

    check()


@pytest.mark.parametrize("generation", [True, False], ids=["generation", "roles"])
def test_a_generic_sample_with_tool_calls_trains_its_calls(generation: bool) -> None:
    """A generic-format sample as stored (JSON messages with ``tool_calls``, null content and
    two parallel ``tool`` results) through the cooker and the encoder: the assistant's tool calls
    reach the template, so the calls are trained (as the template's own mask says, with
    blocks), never an empty reply."""
    import json

    from mmpack.energon.cookers import cook_generic

    call = {"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}
    messages = [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [call, call]},
        {"role": "tool", "content": "sunny"},
        {"role": "tool", "content": "rain"},
        {"role": "assistant", "content": "Sunny in Paris, rain in Rome."},
    ]
    tools = [
        {
            "type": "function",
            "function": {
                "name": "weather",
                "description": "The weather in a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    raw = {
        "__key__": "tools",
        "__restore_key__": ("test", "tools"),
        "__shard__": "s0",
        "json": json.dumps({"messages": messages, "tools": tools}).encode(),
    }
    conv = cook_generic(raw)
    tok = family_tokenizer("qwen2_5", generation=generation)
    enc = PackingTaskEncoder(PackingEncoderConfig(modalities=[]), tokenizer=tok)
    ids, mask = encoded_mask(enc, conv)
    # the sample's tool schemas reach the template, as apply_chat_template(tools=) hands them
    theirs = tok.apply_chat_template(
        messages, tools=tools, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    assert ids == list(theirs["input_ids"])
    assert '"description": "The weather in a city"' in tok.decode(ids)
    assert masks.from_chat_template(tok, messages, tools=tools)[0].tolist() == ids
    trained = tok.decode([t for t, m in zip(ids, mask, strict=True) if m])
    assert trained.count('<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}') == 2
    assert "<tool_response>" not in trained and "Weather in Paris" not in trained
    if generation:
        assert mask == list(theirs["assistant_masks"])


# Llama 2's released chat template (Mistral's [INST] templates have the same shape): the reply
# follows the template's own space, which byte-level BPE joins to its first word
LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}"
    "{% set loop_messages = messages %}{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}"
    "{% endif %}{% endfor %}"
)


@pytest.mark.parametrize("mode", [None, "precomputed"])
def test_a_reply_joined_to_the_templates_space_trains_its_first_word(mode: str | None) -> None:
    from mmpack_dev.qwen_vocab import qwen2_vl_tokenizer

    tok = qwen2_vl_tokenizer(LLAMA2_TEMPLATE)
    tok.bos_token = "<|endoftext|>"
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Is it?"},
        {"role": "assistant", "content": "Yes"},
        {"role": "user", "content": "Sure?"},
        {"role": "assistant", "content": "Yes, sure."},
    ]
    ids, mask = masks.from_chat_template(tok, messages)
    assert ids.tolist() == tok.apply_chat_template(messages)["input_ids"]
    trained = [t for t, m in zip(ids.tolist(), mask, strict=True) if m]
    eos = tok.eos_token
    assert tok.decode(trained) == f" Yes {eos} Yes, sure. {eos}"
    enc = PackingTaskEncoder(
        PackingEncoderConfig(modalities=[], loss_mask_mode=mode), tokenizer=tok
    )
    assert encoded_mask(enc, cooked(messages)) == (ids.tolist(), mask.astype(int).tolist())


@pytest.mark.parametrize("mode", [None, "precomputed"])
def test_the_released_templates_train_what_opens_a_reply_on_its_own_line(
    mode: str | None,
) -> None:
    """What a template writes on the lines after a reply's header, before the reply's values
    (Qwen3's ``<think>`` around the reasoning it moves out of the content, Llama 3.1's
    ``{"name": "`` opening a tool call), is the reply's: trained, so the model learns to open
    them; the header line never is."""
    qwen3 = family_tokenizer("qwen3", generation=False)
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "<think>\nPLAN\n</think>\n\nANSWER"},
    ]
    llama = family_tokenizer("llama3_1", generation=False)
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "P"}}}
    tool_turn = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
    ]
    for tok, msgs, reply in (
        (qwen3, messages, "<think>\nPLAN\n</think>\n\nANSWER<|im_end|>\n"),
        (llama, tool_turn, '{"name": "get_weather", "parameters": {"city": "P"}}<|eot_id|>'),
    ):
        ids, mask = masks.from_chat_template(tok, msgs)
        assert tok.decode([t for t, m in zip(ids.tolist(), mask, strict=True) if m]) == reply
        enc = PackingTaskEncoder(
            PackingEncoderConfig(modalities=[], loss_mask_mode=mode), tokenizer=tok
        )
        assert encoded_mask(enc, cooked(msgs)) == (ids.tolist(), mask.astype(int).tolist())
