"""Conversations in Hugging Face message format that the templates of `mmpack_dev.chat_templates`
render: hypothesis strategies (`conversations`, `texts`) for property tests, and `turns` for a
deterministic conversation of any length for benchmarks.

Drawn texts mix unicode (CJK, emoji, combining sequences), runs of whitespace and newlines at either
end, empty strings, and template-like text (other families' markup, Jinja syntax, role names), but
never one of the family tokenizer's added tokens (`Family.reserved`).
"""

from __future__ import annotations

import functools
from typing import Any

from hypothesis import strategies as st

from mmpack_dev.chat_templates import FAMILIES

# Template-like strings; each family draws those that are not among its tokenizer's added tokens
_TEMPLATE_LIKE = (
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<|vision_start|>",
    "<|image_pad|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<bos>",
    "<eos>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>\n",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</think>",
    "<think>",
    "<image>",
    "<video>",
    "[INST]",
    "</s>",
    "{{ bos_token }}",
    "{% generation %}",
    "{% endgeneration %}",
    "{%- if %}",
    "{#",
    "}}",
    "assistant\n",
    "model\n",
    "user",
    "system",
    '{"name": "f", "arguments": {}}',
    "\ue000",
)
_PLAIN_PIECES = (
    "世界",
    "你好，",
    "🙂",
    "👩‍👩‍👧",
    "é",
    "0123",
    " 42",
    "a",
    "'s",
    "Hello",
    " world",
    "  ",
    " ",
    "\t",
    "\n",
    "\n\n\n",
    " \t ",
    "\r\n",
)
_WHITESPACE = st.sampled_from(["", "", " ", "  ", "\n", "\n\n", " \n", "\t", "\r\n", "\u3000"])
_TOOL_NAMES = ("get_weather", "search", "calc", "lookup_user", "f")


def _free_of(reserved: tuple[str, ...]):
    return lambda text: not any(token in text for token in reserved)


@functools.cache
def texts(family: str) -> st.SearchStrategy[str]:
    """Message texts for `family`: empty, short mixes of unicode, whitespace and template-like
    pieces, with whitespace or newlines at either end."""
    reserved = FAMILIES[family].reserved
    pieces = st.one_of(
        st.text(st.characters(exclude_categories=("Cs",)), max_size=8),
        st.sampled_from(_PLAIN_PIECES),
        st.sampled_from([t for t in _TEMPLATE_LIKE if _free_of(reserved)(t)]),
    )
    body = st.lists(pieces, min_size=1, max_size=5).map("".join)
    padded = st.builds(lambda a, b, c: a + b + c, _WHITESPACE, body, _WHITESPACE)
    # about one text in ten is empty by construction (more when the pieces are)
    text = st.integers(0, 9).flatmap(lambda k: st.just("") if k == 9 else body if k < 4 else padded)
    return text.filter(_free_of(reserved))


# 1..8 turns, and now and then 9..30 (shrinking towards few turns)
_TURN_COUNTS = st.integers(0, 9).flatmap(
    lambda k: st.integers(9, 30) if k == 9 else st.integers(1, 8)
)
# Tool rounds before an answer: mostly none (shrinking to none)
_TOOL_ROUNDS = st.integers(0, 5).map(lambda k: max(0, k - 3))


def _json_values(text: st.SearchStrategy[str]) -> st.SearchStrategy[Any]:
    scalars = st.one_of(
        text, st.integers(-(10**6), 10**6), st.booleans(), st.none(), st.floats(-1e3, 1e3)
    )
    return st.recursive(
        scalars,
        lambda inner: st.one_of(
            st.lists(inner, max_size=3),
            st.dictionaries(st.sampled_from(["a", "b", "query", "城市"]), inner, max_size=3),
        ),
        max_leaves=6,
    )


def _tool_calls(text: st.SearchStrategy[str]) -> st.SearchStrategy[list[dict]]:
    call = st.builds(
        lambda name, arguments: {
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        },
        st.sampled_from(_TOOL_NAMES),
        st.dictionaries(
            st.sampled_from(["location", "q", "x", "n", "单位"]), _json_values(text), max_size=3
        ),
    )
    return st.lists(call, min_size=1, max_size=3)


@st.composite
def _qwen3_assistant(draw, text: st.SearchStrategy[str]) -> dict:
    """An assistant message with no reasoning, `reasoning_content`, or reasoning written into the
    content as <think>...</think> (which the template splits off)."""
    content = draw(text)
    form = draw(st.sampled_from(["none", "field", "inline"]))
    if form == "field":
        return {"role": "assistant", "content": content, "reasoning_content": draw(text)}
    if form == "inline":
        opening = draw(st.sampled_from(["<think>\n", "<think>", ""]))
        content = f"{opening}{draw(text)}\n</think>\n\n{content}"
    return {"role": "assistant", "content": content}


def _content(family: str, role: str, text: st.SearchStrategy[str]) -> st.SearchStrategy[Any]:
    """A message's content: a string, or for Qwen2-VL and Gemma 3 sometimes a list of parts."""
    if family == "qwen2_vl":
        text_part = st.builds(lambda t: {"type": "text", "text": t}, text)
        if role == "user":
            part = st.one_of(text_part, st.just({"type": "image"}), st.just({"type": "video"}))
        else:
            part = text_part
        return st.one_of(text, st.lists(part, min_size=1, max_size=4))
    if family == "gemma3" and role == "user":
        part = st.one_of(
            st.builds(lambda t: {"type": "text", "text": t}, text), st.just({"type": "image"})
        )
        return st.one_of(text, st.lists(part, min_size=1, max_size=4))
    return text


@st.composite
def _conversation(draw, family: str) -> list[dict]:
    text = texts(family)
    messages: list[dict] = []
    if draw(st.booleans()):
        messages.append({"role": "system", "content": draw(text)})
    tools = family in ("qwen2_5", "qwen3")
    for _ in range(draw(_TURN_COUNTS)):
        messages.append({"role": "user", "content": draw(_content(family, "user", text))})
        for _ in range(draw(_TOOL_ROUNDS) if tools else 0):
            if family == "qwen3":
                calling = draw(_qwen3_assistant(text))
            else:
                calling = {"role": "assistant", "content": draw(st.one_of(st.just(""), text))}
            calling["tool_calls"] = draw(_tool_calls(text))
            messages.append(calling)
            # one result per call, or another count: consecutive tool messages share one user turn
            results = draw(st.one_of(st.just(len(calling["tool_calls"])), st.integers(1, 3)))
            messages.extend({"role": "tool", "content": draw(text)} for _ in range(results))
        if family == "qwen3":
            messages.append(draw(_qwen3_assistant(text)))
        else:
            messages.append(
                {"role": "assistant", "content": draw(_content(family, "assistant", text))}
            )
    return messages


@functools.cache
def conversations(family: str) -> st.SearchStrategy[list[dict]]:
    """Message lists `family`'s template renders: an optional system message, then 1..8 (now
    and then up to 30) user/assistant turns, ending on an assistant message. Qwen2.5 and Qwen3
    turns may call tools (OpenAI-format `tool_calls`, each round answered by one or several `tool`
    messages); Qwen3 assistant messages may carry reasoning; Qwen2-VL contents (and Gemma 3 user
    contents) may be lists of text, image and video parts."""
    if family not in FAMILIES:
        raise KeyError(f"unknown family {family!r}; known: {sorted(FAMILIES)}")
    return _conversation(family)


_QUESTIONS = (
    "What is the capital of France?",
    "Summarise the paragraph above in two sentences, keeping the numbers.",
    "把这句话翻译成英文：今天天气很好。",
    "List three prime numbers greater than 100.",
    "Write a haiku about packing sequences into fixed-length batches.",
    "Why does the loss spike after step 1200?",
    "ok",
)
_ANSWERS = (
    "Paris.",
    "The text reports 42 samples across 3 shards. Each shard holds 14 samples.",
    "The weather is nice today.",
    "101, 103 and 107.",
    "Tokens fill the row,\nno padding left to waste here,\nthe batch is complete.",
    "A learning-rate warmup that ends at step 1200 would do it; check the schedule first.\n\n"
    "If the schedule is flat there, look at the data order: a shard of very long documents "
    "starting at that step would change the loss scale.",
    "Done.",
)


def turns(family: str, n: int, system: bool = True) -> list[dict]:
    """A deterministic conversation of `n` user/assistant turns in `family`'s format (string
    contents, no tools), after a system message when `system`; texts of varied length and script."""
    if family not in FAMILIES:
        raise KeyError(f"unknown family {family!r}; known: {sorted(FAMILIES)}")
    messages: list[dict] = (
        [{"role": "system", "content": "You are a helpful assistant."}] if system else []
    )
    for i in range(n):
        messages.append({"role": "user", "content": f"[{i}] {_QUESTIONS[i % len(_QUESTIONS)]}"})
        messages.append({"role": "assistant", "content": _ANSWERS[(i * 3) % len(_ANSWERS)]})
    return messages
