# ruff: noqa: E501
# (the templates keep a Jinja statement to a line)
"""`templates.render` against transformers on Qwen2-VL's real tokenizer, one small template per
Jinja feature chat templates use (macros, set / filter / call blocks, loop peeking, loop
controls, namespaces, nested loops over tool calls and content parts, a reversed pre-scan, ``~``,
``+``, ``| join``, ``| tojson``, ``raise_exception``, ``strftime_now``, special tokens,
whitespace-controlled generation blocks): the text is ``apply_chat_template``'s, the generation
spans are transformers' own, each turn is the span of its message's iteration (located by
rendering the template with sentinel characters at the iteration's edges) and each value span
holds exactly the part of the value the template kept. Renders from 8 threads at once and from
interleaved asyncio tasks equal the single-threaded ones."""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime
import sys
import threading
from collections.abc import Iterator
from typing import Any

import jinja2
import pytest
from mmpack.batch import template_engine, templates
from mmpack.errors import ChatTemplateError
from transformers.utils.chat_template_utils import render_jinja_template

# Sentinels written at an iteration's start, its end and after the loop in the marked copy of a
# template (`@<`, `>@`, `@$` in the sources below; removed in the template rendered).
START, END, AFTER = "\x02", "\x03", "\x04"
MARKERS = {"@<": START, ">@": END, "@$": AFTER}

CHAT: list[dict[str, Any]] = [
    {"role": "system", "content": "  You are terse.\n"},
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "What is in"},
            {"type": "image"},
            {"type": "text", "text": " this picture?"},
        ],
    },
    {
        "role": "assistant",
        "content": "<think>\nA cat?\n</think>\n\nA cat.",
        "tool_calls": [
            {"type": "function", "function": {"name": "lookup", "arguments": {"animal": "cat"}}},
            {"type": "function", "function": {"name": "log", "arguments": {}}},
        ],
    },
    {"role": "tool", "content": '{"legs": 4}'},
    {"role": "user", "content": "And 谢谢 🙂 "},
    {"role": "assistant", "content": "  You're welcome.  ", "reasoning_content": "be nice"},
]

TEXT_OF = r"""{% macro text_of(content) %}
{% if content is string %}{{ content }}{% else %}
{% for part in content %}
{% if part.type == 'text' %}{{ part.text }}{% else %}<|vision_start|><|image_pad|><|vision_end|>{% endif %}
{% endfor %}
{% endif %}
{% endmacro %}
"""

MACRO = (
    TEXT_OF
    + r"""{% for message in messages %}
@<<|im_start|>{{ message.role }}
{{ text_of(message.content) }}<|im_end|>
>@{% endfor %}
@$"""
)

SET_BLOCK = (
    TEXT_OF
    + r"""{% for message in messages %}
{% set header = '<|im_start|>' ~ message.role ~ '\n' %}
{% set body %}
  {{ text_of(message.content) }}
{% if message.reasoning_content is defined %}
  ({{ message.reasoning_content }})
{% endif %}
{% endset %}
@<{{ header }}{{ body | trim }}<|im_end|>
>@{% endfor %}
@$"""
)

FILTER_BLOCK = r"""{% for message in messages %}
@<<|im_start|>{% filter upper %}{{ message.role }}{% endfilter %}
{% filter trim %}
{% if message.content is string %}{{ message.content }}{% else %}[parts]{% endif %}
{% endfilter %}
<|im_end|>
>@{% endfor %}
@$"""

CALL_BLOCK = (
    TEXT_OF
    + r"""{% macro turn(role) %}
<|im_start|>{{ role }}
{{ caller() }}<|im_end|>
{% endmacro %}
{% for message in messages %}
@<{% call turn(message.role) %}{{ text_of(message.content) }}{% endcall %}
>@{% endfor %}
@$"""
)

LOOP_PEEKING = r"""{% for message in messages %}
@<{% if loop.first %}[{{ loop.length }} messages]{% endif %}
{% if loop.previtem is defined and loop.previtem.role == message.role %}+{% else %}<{{ message.role }}>{% endif %}
{% if message.content is string %}{{ message.content }}{% endif %}
{% if loop.nextitem is defined and loop.nextitem.role != message.role %}</{{ message.role }}>{% endif %}
{% if loop.last %}<end>{% endif %}
>@{% endfor %}
@$"""

LOOP_CONTROLS = r"""{% for message in messages %}
@<{% if message.role == 'system' %}{{ message.content | trim }}{% continue %}{% endif %}
[{{ message.role }}]
{% if message.role == 'tool' %}{{ message.content }}{% break %}{% endif %}
{% if message.content is string %}{{ message.content }}{% endif %}
/
>@{% endfor %}
@$"""

TOOL_CALLS = r"""{% set ns = namespace(calls=0, images=0) %}
{% for message in messages %}
@<<|im_start|>{{ message.role }}
{% if message.role == 'assistant' %}
{% generation %}
{{ message.content }}
{% for call in message.tool_calls | default([]) %}
{% set ns.calls = ns.calls + 1 %}

<tool_call>{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson(indent=2) }}}</tool_call>
{% endfor %}
<|im_end|>
{% endgeneration %}
{% elif message.content is string %}{{ message.content }}<|im_end|>
{% else %}
{% for part in message.content %}
{% if part.type == 'image' %}{% set ns.images = ns.images + 1 %}<image {{ ns.images }}>{% else %}{{ part.text }}{% endif %}
{% endfor %}
<|im_end|>
{% endif %}

>@{% endfor %}
@${{ ns.calls }} calls, {{ ns.images }} images"""

PRE_SCAN = r"""{%- set ns = namespace(last_query=messages | length - 1, found=false) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages | length - 1) - loop.index0 %}
    {%- if not ns.found and message.role == 'user' %}
        {%- set ns.found = true %}
        {%- set ns.last_query = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
@<<|im_start|>{{ message.role }}
{% if message.role == 'assistant' %}
{%- set content = message.content %}
{%- set reasoning = message.reasoning_content | default('') %}
{%- if '</think>' in content %}
{%- set reasoning = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
{%- set content = content.split('</think>')[-1].lstrip('\n') %}
{%- endif %}
{% generation %}
{%- if loop.index0 > ns.last_query %}
{{ '<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
{%- else %}
{{ content }}
{%- endif %}<|im_end|>
{% endgeneration %}
{% elif message.content is string %}
{{ message.content }}<|im_end|>
{% else %}
{{ message.content | selectattr('type', 'equalto', 'text') | map(attribute='text') | join(' ') }}<|im_end|>
{% endif %}
>@{% endfor %}
@$"""

CONCATENATION = r"""{% for message in messages %}
@<{% if message.content is string %}
{{ '<|im_start|>' ~ message.role ~ '\n' ~ message.content ~ '<|im_end|>\n' }}
{% else %}
{{ '<|im_start|>' + message.role + '\n' + message.content | map(attribute='text') | select('defined') | join('|') + '<|im_end|>\n' }}
{% endif %}
>@{% endfor %}
@$"""

SPECIAL_TOKENS = r"""{{ bos_token }}{% if bos_token is defined %}[bos]{% endif %}
{% for message in messages %}
@<{{ message.role }}: {% if message.content is string %}{{ message.content }}{% endif %}{{ eos_token }}
>@{% endfor %}
@${% if eos_token is defined %}[eos {{ eos_token | length }}]{% endif %}"""

GENERATION_WHITESPACE = r"""{%- for message in messages -%}
@<
    {%- if message.role == 'assistant' -%}
        <|im_start|>assistant
        {%- generation -%}
            {{- message.content | trim -}}
            {{ eos_token }}
        {%- endgeneration -%}
        {{- '\n' -}}
    {%- else -%}
        <|im_start|>{{ message.role }}
        {{- '\n' -}}
        {%- if message.content is string -%}
            {{ message.content }}
        {%- else -%}
            {%- for part in message.content -%}{{ part.text | default('') }}{%- endfor -%}
        {%- endif -%}
        {{ eos_token ~ '\n' }}
    {%- endif -%}
>@
{%- endfor -%}
@$"""

C, T = ("content",), lambda i: ("content", i, "text")
ITEM = ("item",)

# (template with markers, rendering.values as (message, label, text), in order)
CASES: dict[str, tuple[str, list[tuple[int, tuple[Any, ...], str]]]] = {
    "macro": (
        MACRO,
        [
            (0, C, "  You are terse.\n"),
            (1, T(0), "What is in"),
            (1, ITEM, "What is in"),
            (1, ITEM, "<|vision_start|><|image_pad|><|vision_end|>"),
            (1, T(2), " this picture?"),
            (1, ITEM, " this picture?"),
            (2, C, "<think>\nA cat?\n</think>\n\nA cat."),
            (3, C, '{"legs": 4}'),
            (4, C, "And 谢谢 🙂 "),
            (5, C, "  You're welcome.  "),
        ],
    ),
    "set-block": (
        SET_BLOCK,
        [
            (0, C, "You are terse."),
            (1, T(0), "What is in"),
            (1, ITEM, "What is in"),
            (1, ITEM, "<|vision_start|><|image_pad|><|vision_end|>"),
            (1, T(2), " this picture?"),
            (1, ITEM, " this picture?"),
            (2, C, "<think>\nA cat?\n</think>\n\nA cat."),
            (3, C, '{"legs": 4}'),
            (4, C, "And 谢谢 🙂"),
            (5, C, "You're welcome.  "),
            (5, ("reasoning_content",), "be nice"),
        ],
    ),
    "filter-block": (
        FILTER_BLOCK,
        [
            (0, C, "You are terse."),
            (2, C, "<think>\nA cat?\n</think>\n\nA cat."),
            (3, C, '{"legs": 4}'),
            (4, C, "And 谢谢 🙂"),
            (5, C, "You're welcome."),
        ],
    ),
    "call-block": (
        CALL_BLOCK,
        [
            (0, C, "  You are terse.\n"),
            (1, T(0), "What is in"),
            (1, ITEM, "What is in"),
            (1, ITEM, "<|vision_start|><|image_pad|><|vision_end|>"),
            (1, T(2), " this picture?"),
            (1, ITEM, " this picture?"),
            (2, C, "<think>\nA cat?\n</think>\n\nA cat."),
            (3, C, '{"legs": 4}'),
            (4, C, "And 谢谢 🙂 "),
            (5, C, "  You're welcome.  "),
        ],
    ),
    "loop-peeking": (
        LOOP_PEEKING,
        [
            (0, C, "  You are terse.\n"),
            (2, C, "<think>\nA cat?\n</think>\n\nA cat."),
            (3, C, '{"legs": 4}'),
            (4, C, "And 谢谢 🙂 "),
            (5, C, "  You're welcome.  "),
        ],
    ),
    "loop-controls": (
        LOOP_CONTROLS,
        [
            (0, C, "You are terse."),
            (2, C, "<think>\nA cat?\n</think>\n\nA cat."),
            (3, C, '{"legs": 4}'),
        ],
    ),
    "tool-calls": (
        TOOL_CALLS,
        [
            (0, C, "  You are terse.\n"),
            (1, T(0), "What is in"),
            (1, ITEM, "What is in"),
            (1, ITEM, "<image 1>"),
            (1, T(2), " this picture?"),
            (1, ITEM, " this picture?"),
            (2, C, "<think>\nA cat?\n</think>\n\nA cat."),
            (
                2,
                ITEM,
                '\n<tool_call>{"name": "lookup", "arguments": {\n  "animal": "cat"\n}}</tool_call>\n',
            ),
            (2, ("tool_calls", 0, "function", "name"), "lookup"),
            (2, ITEM, '\n<tool_call>{"name": "log", "arguments": {}}</tool_call>\n'),
            (2, ("tool_calls", 1, "function", "name"), "log"),
            (3, C, '{"legs": 4}'),
            (4, C, "And 谢谢 🙂 "),
            (5, C, "  You're welcome.  "),
        ],
    ),
    "pre-scan": (
        PRE_SCAN,
        [
            (0, C, "  You are terse.\n"),
            (1, T(0), "What is in"),
            (1, T(2), " this picture?"),
            (2, C, "A cat."),
            (3, C, '{"legs": 4}'),
            (4, C, "And 谢谢 🙂 "),
            (5, ("reasoning_content",), "be nice"),
            (5, C, "  You're welcome.  "),
        ],
    ),
    "concatenation": (
        CONCATENATION,
        [
            (0, C, "  You are terse.\n"),
            (1, T(0), "What is in"),
            (1, T(2), " this picture?"),
            (2, C, "<think>\nA cat?\n</think>\n\nA cat."),
            (3, C, '{"legs": 4}'),
            (4, C, "And 谢谢 🙂 "),
            (5, C, "  You're welcome.  "),
        ],
    ),
    "special-tokens": (
        SPECIAL_TOKENS,
        [
            (0, C, "  You are terse.\n"),
            (2, C, "<think>\nA cat?\n</think>\n\nA cat."),
            (3, C, '{"legs": 4}'),
            (4, C, "And 谢谢 🙂 "),
            (5, C, "  You're welcome.  "),
        ],
    ),
    "generation-whitespace": (
        GENERATION_WHITESPACE,
        [
            (0, C, "  You are terse.\n"),
            (1, T(0), "What is in"),
            (1, ITEM, "What is in"),
            (1, T(2), " this picture?"),
            (1, ITEM, " this picture?"),
            (2, C, "<think>\nA cat?\n</think>\n\nA cat."),
            (3, C, '{"legs": 4}'),
            (4, C, "And 谢谢 🙂 "),
            (5, C, "You're welcome."),
        ],
    ),
}


def unmarked(source: str) -> str:
    for marker in MARKERS:
        source = source.replace(marker, "")
    return source


def sentinel_marked(source: str) -> str:
    for marker, sentinel in MARKERS.items():
        source = source.replace(marker, "{{ '" + sentinel + "' }}")
    return source


def transformers_text(tokenizer: Any, template: str, messages: list[dict[str, Any]]) -> str:
    text = tokenizer.apply_chat_template(messages, tokenize=False, chat_template=template)
    assert isinstance(text, str)
    return text


def transformers_generation(
    tokenizer: Any, template: str, messages: list[dict[str, Any]]
) -> tuple[tuple[int, int], ...]:
    """The ``{% generation %}`` spans transformers records (messages normalized as
    ``apply_chat_template`` does: keys whose value is None dropped)."""
    plain = [{k: v for k, v in m.items() if v is not None} for m in messages]
    result: Any = render_jinja_template(
        [plain],
        chat_template=template,
        return_assistant_tokens_mask=True,
        **tokenizer.special_tokens_map,
    )
    _, (indices,) = result
    return tuple((s, e) for s, e in indices)


def iteration_spans(
    tokenizer: Any, source: str, messages: list[dict[str, Any]]
) -> tuple[tuple[int, int], ...]:
    """Per message, the span of its iteration of the marked loop, from transformers' rendering
    of the template with sentinels at the markers: from its start sentinel to the next sentinel
    of any kind (its end; or, after ``continue`` / ``break``, the next start or the loop's end);
    ``(-1, -1)`` for a message the loop never reached."""
    text = transformers_text(tokenizer, unmarked(source), messages)
    marked = transformers_text(tokenizer, sentinel_marked(source), messages)
    events: list[tuple[str, int]] = []
    at = 0
    for ch in marked:
        if ch in MARKERS.values():
            events.append((ch, at))
        else:
            at += 1
    # the sentinels change nothing else (whitespace control included)
    assert "".join(ch for ch in marked if ch not in MARKERS.values()) == text
    assert events[-1][0] == AFTER
    spans = [(at, events[k + 1][1]) for k, (ch, at) in enumerate(events) if ch == START]
    assert len(spans) <= len(messages)
    return tuple(spans + [(-1, -1)] * (len(messages) - len(spans)))


@pytest.fixture(scope="module")
def variables(qwen_tokenizer: Any) -> dict[str, Any]:
    return templates.template_variables(qwen_tokenizer)


@pytest.mark.parametrize("name", CASES)
def test_render_is_transformers_text_with_each_turn_and_value(
    name: str, qwen_tokenizer: Any, variables: dict[str, Any]
) -> None:
    source, expected_values = CASES[name]
    template = unmarked(source)
    rendering = templates.render(template, CHAT, variables=variables)
    text = rendering.text
    assert text == transformers_text(qwen_tokenizer, template, CHAT)
    assert rendering.turns == iteration_spans(qwen_tokenizer, source, CHAT)
    got = [(v.message, v.label, text[v.start : v.end]) for v in rendering.values]
    assert got == expected_values
    for v in rendering.values:
        start, end = rendering.turns[v.message]
        assert start <= v.start <= v.end <= end  # each value inside its own message's turn
    if templates.has_generation_markers(template):
        assert rendering.generation == transformers_generation(qwen_tokenizer, template, CHAT)
        assert rendering.generation  # the cases that have blocks render some
    else:
        assert rendering.generation == ()


@pytest.mark.parametrize("name", ["tool-calls", "pre-scan", "generation-whitespace"])
def test_generation_blocks_hold_the_assistant_replies(name: str, variables: dict[str, Any]) -> None:
    rendering = templates.render(unmarked(CASES[name][0]), CHAT, variables=variables)
    blocks = [rendering.text[s:e] for s, e in rendering.generation]
    assert len(blocks) == 2
    # the second reply of each template, checked by hand
    assert (
        blocks[1]
        == {
            "tool-calls": "  You're welcome.  \n<|im_end|>\n",
            "pre-scan": "<think>\nbe nice\n</think>\n\n  You're welcome.  <|im_end|>\n",
            "generation-whitespace": "You're welcome.<|im_end|>",
        }[name]
    )
    assert blocks[0].startswith("A cat." if name == "pre-scan" else "<think>\nA cat?")


def test_a_pre_scan_loop_leaves_the_turns_to_the_rendering_loop(
    qwen_tokenizer: Any, variables: dict[str, Any]
) -> None:
    rendering = templates.render(unmarked(PRE_SCAN), CHAT, variables=variables)
    for m, (start, end) in enumerate(rendering.turns):
        assert rendering.text[start:end].startswith(f"<|im_start|>{CHAT[m]['role']}\n")
        assert rendering.text[start:end].endswith("<|im_end|>\n")
    # the scan wrote nothing: the template without it (its result written in) renders the same
    # text with the same turns
    scan_free = PRE_SCAN[PRE_SCAN.index("{%- for message in messages %}") :]
    scan_free = scan_free.replace("loop.index0 > ns.last_query", "loop.index0 > 4")
    without = templates.render(unmarked(scan_free), CHAT, variables=variables)
    assert (without.text, without.turns) == (rendering.text, rendering.turns)


def test_loop_controls_turns(qwen_tokenizer: Any, variables: dict[str, Any]) -> None:
    rendering = templates.render(unmarked(LOOP_CONTROLS), CHAT, variables=variables)
    text = rendering.text
    # continue: the system message's turn is what it wrote before continuing
    assert text[slice(*rendering.turns[0])] == "You are terse."
    assert text[slice(*rendering.turns[3])] == '[tool]\n{"legs": 4}'  # ended by break
    assert rendering.turns[4:] == ((-1, -1), (-1, -1))  # never reached
    assert text.endswith('{"legs": 4}')


def test_a_turn_ended_by_break_stops_where_the_loop_ends(
    qwen_tokenizer: Any, variables: dict[str, Any]
) -> None:
    source = "{% for m in messages %}@<{{ m.content }}{% break %}>@{% endfor %}@$TAIL"
    messages = [{"role": "user", "content": "hi"}, {"role": "user", "content": "there"}]
    rendering = templates.render(unmarked(source), messages, variables=variables)
    assert rendering.text == "hiTAIL"
    assert rendering.turns == iteration_spans(qwen_tokenizer, source, messages)  # ((0, 2), ...)


def test_generation_inside_a_call_block_spans_the_reply(
    qwen_tokenizer: Any, variables: dict[str, Any]
) -> None:
    """A block inside a macro's caller: its span is where its text landed. (transformers
    counts only what was already yielded, so its own indices here start before the block.)"""
    template = (
        "{% macro turn(role) %}<|im_start|>{{ role }}\n{{ caller() }}<|im_end|>\n{% endmacro %}"
        "{% for m in messages %}{% call turn(m.role) %}{% if m.role == 'assistant' %}"
        "{% generation %}{{ m.content }}{% endgeneration %}{% else %}{{ m.content }}{% endif %}"
        "{% endcall %}{% endfor %}"
    )
    messages = [m for m in CHAT if isinstance(m["content"], str)]
    rendering = templates.render(template, messages, variables=variables)
    assert rendering.text == transformers_text(qwen_tokenizer, template, messages)
    assert [rendering.text[s:e] for s, e in rendering.generation] == [
        m["content"] for m in messages if m["role"] == "assistant"
    ]


def test_generation_inside_a_filter_block_is_refused_not_lost(
    qwen_tokenizer: Any, variables: dict[str, Any]
) -> None:
    template = (
        "{% for m in messages %}{% if m.role == 'assistant' %}{% filter upper %}{% generation %}"
        "{{ m.content }}{% endgeneration %}{% endfilter %}{% else %}{{ m.content }}{% endif %}"
        "{% endfor %}"
    )
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    # the filter keeps no marks: the block's place is unknown, so the render says so instead
    # of returning a rendering without the block (a mask that silently trains nothing)
    assert list(transformers_generation(qwen_tokenizer, template, messages)) == [(2, 4)]
    with pytest.raises(ChatTemplateError, match="generation"):
        templates.render(template, messages, variables=variables)


def test_untraced_renders_have_the_same_text_and_blocks(variables: dict[str, Any]) -> None:
    """Without values traced: the same text, blocks and turns, no value spans; without turns
    either: the same text and blocks, no turn."""
    for source, _ in CASES.values():
        template = unmarked(source)
        traced = templates.render(template, CHAT, variables=variables)
        plain = templates.render(template, CHAT, variables=variables, trace_values=False)
        assert (plain.text, plain.generation, plain.turns) == (
            traced.text,
            traced.generation,
            traced.turns,
        )
        assert plain.values == ()
        bare = templates.render(
            template, CHAT, variables=variables, trace_values=False, trace_turns=False
        )
        assert (bare.text, bare.generation, bare.values) == (traced.text, traced.generation, ())
        assert bare.turns == ((-1, -1),) * len(CHAT)


def test_raise_exception_is_a_chat_template_error_with_the_templates_message(
    qwen_tokenizer: Any, variables: dict[str, Any]
) -> None:
    template = (
        "{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
        "{{ raise_exception('System message at ' ~ loop.index0 ~ ' must come first') }}"
        "{% endif %}{{ m.content }}{% endfor %}"
    )
    messages = [CHAT[4], CHAT[0]]
    with pytest.raises(jinja2.TemplateError, match=r"^System message at 1 must come first$"):
        qwen_tokenizer.apply_chat_template(messages, tokenize=False, chat_template=template)
    with pytest.raises(ChatTemplateError, match="System message at 1 must come first") as err:
        templates.render(template, messages, variables=variables, sample_id="s-7")
    assert "sample 's-7'" in str(err.value)
    assert isinstance(err.value.__cause__, jinja2.TemplateError)
    assert template_engine.STATE.get() is None  # the failed render left no state behind
    # the same template renders a conversation it accepts
    ok = templates.render(template, messages[::-1], variables=variables)
    assert ok.text == transformers_text(qwen_tokenizer, template, messages[::-1])


def test_strftime_now_is_the_local_date(qwen_tokenizer: Any, variables: dict[str, Any]) -> None:
    template = (
        "Today is {{ strftime_now('%d %B %Y') }}.{% for m in messages %} {{ m.role }}{% endfor %}"
    )
    messages = CHAT[:2]
    for _ in range(3):  # a render that straddles midnight is retried
        before = datetime.datetime.now().strftime("%d %B %Y")
        ours = templates.render(template, messages, variables=variables).text
        theirs = transformers_text(qwen_tokenizer, template, messages)
        if before == datetime.datetime.now().strftime("%d %B %Y"):
            break
    assert ours == theirs == f"Today is {before}. system user"


def test_special_tokens_reach_the_template(qwen_tokenizer: Any, variables: dict[str, Any]) -> None:
    # Qwen2-VL has an eos token and no bos token: bos_token renders as nothing in both
    assert variables["eos_token"] == "<|im_end|>" and "bos_token" not in variables
    text = templates.render(unmarked(SPECIAL_TOKENS), CHAT, variables=variables).text
    assert text.startswith("system:   You are terse.\n<|im_end|>")
    assert text.endswith("[eos 10]")


# --- concurrency --------------------------------------------------------------------------------

THREADS = 8


@pytest.fixture
def fast_switching() -> Iterator[None]:
    """Threads switched every microsecond, so that renders overlap inside one another."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(interval)


def conversations(n: int) -> list[list[dict[str, Any]]]:
    """`n` different conversations for the tool-calls template (each its own lengths)."""
    out = []
    for i in range(n):
        chat = [dict(m) for m in CHAT[: 2 + i % (len(CHAT) - 1)]]
        chat[0] = {"role": "system", "content": f"conversation {i}" + " !" * i}
        out.append(chat)
    return out


@pytest.mark.usefixtures("fast_switching")
def test_renders_from_eight_threads_equal_the_single_threaded_ones(
    variables: dict[str, Any],
) -> None:
    template = unmarked(TOOL_CALLS)
    chats = conversations(THREADS)
    expected = [templates.render(template, chat, variables=variables) for chat in chats]
    assert len({r.text for r in expected}) == THREADS
    barrier = threading.Barrier(THREADS)

    def worker(i: int) -> list[templates.Rendering]:
        barrier.wait()
        return [templates.render(template, chats[i], variables=variables) for _ in range(30)]

    with concurrent.futures.ThreadPoolExecutor(THREADS) as pool:
        results = list(pool.map(worker, range(THREADS)))
    for i, renderings in enumerate(results):
        assert all(r == expected[i] for r in renderings)
    assert template_engine.STATE.get() is None


@pytest.mark.usefixtures("fast_switching")
def test_interleaved_renders_in_asyncio_tasks_equal_the_sequential_ones(
    variables: dict[str, Any],
) -> None:
    template = unmarked(TOOL_CALLS)
    chats = conversations(6)
    expected = [templates.render(template, chat, variables=variables) for chat in chats]

    async def in_loop(i: int) -> list[templates.Rendering]:
        out = []
        for _ in range(10):
            out.append(templates.render(template, chats[i], variables=variables))
            await asyncio.sleep(0)  # hand over to the other tasks between renders
        return out

    async def in_thread(i: int) -> list[templates.Rendering]:
        return [
            await asyncio.to_thread(templates.render, template, chats[i], variables=variables)
            for _ in range(10)
        ]

    async def main() -> list[list[templates.Rendering]]:
        tasks = [asyncio.create_task(in_loop(i)) for i in range(3)]
        tasks += [asyncio.create_task(in_thread(i)) for i in range(3, 6)]
        tasks += [asyncio.create_task(in_loop(i)) for i in range(3, 6)]
        return await asyncio.gather(*tasks)

    results = asyncio.run(main())
    for i, renderings in enumerate(results):
        assert all(r == expected[i % 3 if i < 3 else 3 + i % 3] for r in renderings)
    assert template_engine.STATE.get() is None


@pytest.mark.usefixtures("fast_switching")
def test_a_failing_render_in_one_thread_leaves_the_others_right(
    variables: dict[str, Any],
) -> None:
    template = (
        "{% for m in messages %}{% if m.content == 'boom' %}{{ raise_exception('boom') }}"
        "{% endif %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}"
    )
    good = [{"role": "assistant", "content": f"reply {i}"} for i in range(3)]
    expected = templates.render(template, good, variables=variables)
    barrier = threading.Barrier(4)

    def worker(i: int) -> list[Any]:
        barrier.wait()
        out: list[Any] = []
        for _ in range(40):
            if i % 2:
                try:
                    templates.render(
                        template, [*good, {"role": "user", "content": "boom"}], variables=variables
                    )
                except ChatTemplateError as err:
                    out.append(str(err))
            else:
                out.append(templates.render(template, good, variables=variables))
        return out

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(worker, range(4)))
    for i, out in enumerate(results):
        assert len(out) == 40
        assert all(("boom" in r) if i % 2 else (r == expected) for r in out)
