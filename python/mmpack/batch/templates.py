"""A chat template: its text, whether it marks assistant output with ``{% generation %}``
blocks, and `render`: the whole conversation rendered once, with what each character came from.

`render` compiles the template as transformers does for ``apply_chat_template`` (a sandboxed
Jinja environment, ``trim_blocks`` and ``lstrip_blocks``, loop controls, its ``tojson``,
``raise_exception``, ``strftime_now`` and ``namespace``) and feeds it the messages as
transformers normalizes them (keys whose value is None dropped, reasoning under all three of its
names), so the text is the one ``apply_chat_template(..., tokenize=False)`` returns. During that
one render it records, without a second render or any prefix render:

* the ``{% generation %}`` blocks' character spans (what transformers records for
  ``return_assistant_tokens_mask``);
* the characters each message value produced (a text, a tool call, a reasoning trace), through
  whatever cutting and joining the template does (`mmpack.batch.traced_text`);
* each message's turn: the span of the last iteration of a template loop over the messages
  that had the message as its item (a template that scans the messages before rendering them
  records empty turns that the rendering loop then replaces).

Cost is linear in the conversation: one render, a pass over its output.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import re
from collections.abc import Hashable, Mapping, Sequence
from typing import Any, cast

from mmpack.batch.traced_text import TracedStr
from mmpack.errors import ChatTemplateError

__all__ = [
    "GENERATION_TAG",
    "Rendering",
    "ValueSpan",
    "has_generation_markers",
    "render",
    "template_text",
    "template_variables",
]

#: ``{% generation %}`` in a Jinja chat template, with Jinja's optional whitespace control
#: (``-``) or its override (``+``) on either side, as Jinja itself parses the tag
GENERATION_TAG = re.compile(r"\{%[-+]?\s*generation\s*[-+]?%\}")
_COMMENT = re.compile(r"\{#.*?#\}", re.S)
#: the names a message's reasoning is read under (transformers fills all of them)
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


def template_text(tokenizer: Any, processor: Any = None) -> str | None:
    """The chat template in use: the processor's when it has one (how transformers documents
    multimodal templates), else the tokenizer's (the default one of named templates), or None."""
    for owner in (processor, tokenizer):
        template = getattr(owner, "chat_template", None) if owner is not None else None
        if isinstance(template, dict):
            template = template.get("default")
        if isinstance(template, str) and template:
            return template
    return None


def has_generation_markers(template: str | None) -> bool:
    """Whether `template` marks assistant output with ``{% generation %}`` (outside its
    ``{# comments #}``)."""
    return template is not None and bool(GENERATION_TAG.search(_COMMENT.sub("", template)))


def template_variables(tokenizer: Any, tools: Any = None) -> dict[str, Any]:
    """What ``apply_chat_template(messages, tools=tools)`` hands a template besides the
    messages: the tokenizer's special tokens (``bos_token``, ``eos_token``, ...), the tool
    schemas, no documents, no generation prompt."""
    special = getattr(tokenizer, "special_tokens_map", None) or {}
    variables = {str(k): _plain(v) for k, v in dict(special).items()}
    variables.update(tools=_plain(tools), documents=None, add_generation_prompt=False)
    return variables


@dataclasses.dataclass(frozen=True)
class ValueSpan:
    """Characters ``[start, end)`` of the rendering that message `message`'s value produced;
    `label` is the value's label (its key path in the message, or the label of a caller's
    `TracedStr` mark). Empty when the value rendered empty (its position is still known)."""

    start: int
    end: int
    message: int
    label: Any


@dataclasses.dataclass(frozen=True)
class Rendering:
    """One render of a conversation (see the module docstring)."""

    text: str
    #: ``(start, end)`` of each ``{% generation %}`` block, in the order they closed
    generation: tuple[tuple[int, int], ...]
    values: tuple[ValueSpan, ...]
    #: per message, ``(start, end)`` of its turn; ``(-1, -1)`` when no loop reached it
    turns: tuple[tuple[int, int], ...]


def render(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    variables: Mapping[str, Any],
    sample_id: Hashable | None = None,
    trace_values: bool = True,
    trace_turns: bool = True,
) -> Rendering:
    """Render `messages` with `template` once (module docstring). String values the caller
    passes as `TracedStr` keep their marks' labels; other strings are labelled by their key
    path (``("content",)``, ``("content", 0, "text")``, ``("tool_calls", 0, "function",
    "name")``). Raises `ChatTemplateError` naming the sample when the template does not compile
    or fails (``raise_exception`` included). Without `trace_values` the values are plain
    strings (no `Rendering.values`; faster), for callers that need only blocks and turns;
    without `trace_turns` too, no turn is known (all ``(-1, -1)``)."""
    from mmpack.batch import template_engine  # Jinja is needed only to render

    where = "" if sample_id is None else f"sample {sample_id!r}: "
    compiled = template_engine.compiled(template, trace_values or trace_turns)
    traced = []
    for m, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"{where}message {m} is {type(message).__name__}, not a dict")
        try:
            traced.append(_traced_message(message, m, trace_values))
        except RecursionError as err:
            raise ChatTemplateError(f"{where}message {m} is nested too deeply") from err
    # a message's own items mark where their iterations start only to locate values
    items = (
        {id(c): m for m, message in enumerate(traced) for c in _containers(message)}
        if trace_values
        else {}
    )
    state = template_engine.RenderState({id(message): m for m, message in enumerate(traced)}, items)
    token = template_engine.STATE.set(state)
    try:
        chunks = list(compiled.generate(**{**variables, "messages": traced}))
    except Exception as err:
        raise ChatTemplateError(
            f"{where}the chat template failed to render ({type(err).__name__}: {err})"
        ) from err
    finally:
        template_engine.STATE.reset(token)
    at = list(itertools.accumulate(map(len, chunks), initial=0))
    marks = [
        (at[i] + s, at[i] + e, label)
        for i, kind in enumerate(map(type, chunks))
        if kind is TracedStr
        for s, e, label in cast(TracedStr, chunks[i]).marks
    ]
    rendering = _rendering("".join(chunks), marks, len(traced))
    if len(rendering.generation) < state.blocks:
        # a block's text went through an operation that keeps no marks (a filter block,
        # ``| replace``): its place is unknown, and guessing would mask the wrong tokens
        raise ChatTemplateError(
            f"{where}the chat template passes a {{% generation %}} block's text through an "
            "operation that loses its place in the rendering (a filter such as upper or "
            "replace), so its tokens cannot be located"
        )
    return rendering


def _rendering(text: str, marks: list[tuple[int, int, Any]], n_messages: int) -> Rendering:
    generation: list[tuple[int, int]] = []
    values: list[ValueSpan] = []
    turns = [(-1, -1)] * n_messages
    # per message, the starts of its iterations not yet ended (a loop over the messages
    # nested in another opens a second one)
    open_turn: dict[int, list[int]] = {}
    open_items: dict[int, list[int]] = {}
    for start, end, label in sorted(marks, key=lambda mark: mark[0]):
        kind = label[0]
        if kind == "generation":
            generation.append((start, end))
        elif kind == "value":
            values.append(ValueSpan(start, end, label[1], label[2]))
        elif kind == "turn-start":
            open_turn.setdefault(label[1], []).append(start)
        elif kind == "turn-end" and open_turn.get(label[1]):
            begin = open_turn[label[1]].pop()
            if start > begin or turns[label[1]][0] < 0:
                # a later loop that writes nothing for the message (a scan) keeps its turn
                turns[label[1]] = (begin, start)
        elif kind == "item-start":
            open_items.setdefault(label[1], []).append(start)
        elif kind == "item-end" and open_items.get(label[1]):
            begin = open_items[label[1]].pop()
            if start > begin:
                # an iteration over a message's own item that wrote something (a tool call's
                # opening markup included); a scan that writes nothing marks nothing
                values.append(ValueSpan(begin, start, label[1], ("item",)))
    # a turn never closed (its loop variable rebound) ends where the next one starts
    unended = {m: begins[0] for m, begins in open_turn.items() if begins}
    starts = sorted([s for s, _ in turns if s >= 0] + list(unended.values()))
    for m, start in unended.items():
        later = bisect.bisect_right(starts, start)
        turns[m] = (start, starts[later] if later < len(starts) else len(text))
    generation.sort()
    values.sort(key=lambda v: v.start)
    return Rendering(text, tuple(generation), tuple(values), tuple(turns))


# --- the message values, normalized as transformers does and traced ---------------------------


def _plain(value: Any) -> Any:
    """Template data as transformers hands it over: plain JSON types (a `TracedStr` kept)."""
    if value is None or type(value) in (str, int, float, bool, TracedStr):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):  # a pydantic model (an OpenAI message)
        return _plain(value.model_dump())
    if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0:
        return _plain(value.item())
    return f"<{type(value).__name__}>"


def _traced_message(message: Mapping[str, Any], m: int, trace: bool) -> dict[str, Any]:
    fields = {str(k): _plain(v) for k, v in message.items() if v is not None}
    reasoning = next((fields[k] for k in _REASONING_KEYS if fields.get(k) is not None), None)
    if reasoning is not None:
        fields = {"thinking": reasoning, **fields, "reasoning_content": reasoning}
    if not trace:
        return {k: _untraced(v) for k, v in fields.items()}
    return {k: v if k == "role" else _trace(v, m, (k,)) for k, v in fields.items()}


def _untraced(value: Any) -> Any:
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, dict):
        return {k: _untraced(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_untraced(v) for v in value)
    return value


def _containers(value: Any) -> list[Any]:
    """The lists and dicts inside a message (not the message itself)."""
    out: list[Any] = []
    stack = list(value.values()) if isinstance(value, dict) else []
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            out.append(v)
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            out.append(v)
            stack.extend(v)
    return out


def _trace(value: Any, m: int, path: tuple[Any, ...]) -> Any:
    if isinstance(value, TracedStr):
        return TracedStr(value, [(s, e, ("value", m, label)) for s, e, label in value.marks])
    if isinstance(value, str):
        return TracedStr(value, [(0, len(value), ("value", m, path))])
    if isinstance(value, dict):
        return {k: _trace(v, m, (*path, k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_trace(v, m, (*path, i)) for i, v in enumerate(value))
    return value
