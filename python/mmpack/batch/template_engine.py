"""The Jinja side of `mmpack.batch.templates.render`: a chat template compiled as transformers
compiles it for ``apply_chat_template``, with three additions that leave the rendering
unchanged: ``{% generation %}`` blocks mark their text, ``~``, ``| join`` and output buffers keep
the marks of traced values (`mmpack.batch.traced_text`), and every loop iteration whose item is
one of the rendered messages marks where it starts and ends."""

from __future__ import annotations

import functools
import json
from contextvars import ContextVar
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.utils
from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.filters import make_attrgetter
from jinja2.sandbox import ImmutableSandboxedEnvironment

from mmpack.batch.traced_text import TracedStr, traced_join
from mmpack.errors import ChatTemplateError

__all__ = ["STATE", "RenderState", "compiled"]

_GENERATION = ("generation",)


#: the messages of the render running in this context: id of the traced dict -> index
class RenderState:
    """What the render running in this context knows: the rendered messages (id -> index),
    the lists and dicts inside them (id -> their message's index), and how many generation
    blocks ran."""

    __slots__ = ("blocks", "items", "messages")

    def __init__(self, messages: dict[int, int], items: dict[int, int]) -> None:
        self.messages = messages
        self.items = items
        self.blocks = 0


STATE: ContextVar[RenderState | None] = ContextVar("mmpack_template_render", default=None)
_ITERATION_START = "mmpack_iteration_start"
_ITERATION_END = "mmpack_iteration_end"


def _iteration_mark(edge: str, item: Any) -> str:
    """An empty string marking where a loop iteration over a message (a turn) or over one of
    a message's own items (a tool call, a content item) starts or ends; "" for other items."""
    state = STATE.get()
    if state is None:
        return ""
    key = id(item)
    m = state.messages.get(key)
    if m is not None:
        return TracedStr("", ((0, 0, ("turn-" + edge, m)),))
    m = state.items.get(key)
    if m is not None:
        return TracedStr("", ((0, 0, ("item-" + edge, m)),))
    return ""


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: the block's text, marked."""

    tags = {"generation"}  # noqa: RUF012 (Jinja's own class attribute)

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

    def _mark(self, caller: Any) -> str:
        state = STATE.get()
        if state is not None:
            state.blocks += 1
        text = caller()
        marks = text.marks if isinstance(text, TracedStr) else ()
        return TracedStr(text, [*marks, (0, len(text), _GENERATION)])


class _TracingCodeGenerator(CodeGenerator):
    """Jinja's code generator with ``~`` joining through `traced_join` (marks kept)."""

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        self.write("environment.traced_join((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _Namespace(jinja2.utils.Namespace):
    """Jinja's ``namespace`` refusing underscore names, as transformers' sandbox does."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"a chat template may not store the underscore name {name!r} on a namespace"
            )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: Any = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # transformers' tojson: no HTML escaping, json.dumps' options
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@jinja2.pass_environment
def _join(environment: Any, value: Any, d: str = "", attribute: Any = None) -> str:
    # Jinja's ``join`` filter with the marks of traced items kept
    if attribute is not None:
        value = map(make_attrgetter(environment, attribute), value)
    pieces: list[Any] = []
    for i, item in enumerate(value):
        if i:
            pieces.append(d)
        pieces.append(item)
    return traced_join(pieces)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_Generation, jinja2.ext.loopcontrols],
    )
    env.code_generator_class = _TracingCodeGenerator
    env.concat = traced_join  # type: ignore[method-assign]  # output buffers keep marks
    env.traced_join = traced_join  # type: ignore[attr-defined]
    env.filters["tojson"] = _tojson
    env.filters["join"] = _join
    # filters, not globals: Jinja calls a filter directly, a global through the sandbox
    env.filters[_ITERATION_START] = functools.partial(_iteration_mark, "start")
    env.filters[_ITERATION_END] = functools.partial(_iteration_mark, "end")
    env.globals.update(
        raise_exception=_raise_exception, strftime_now=_strftime_now, namespace=_Namespace
    )
    return env


@functools.lru_cache(maxsize=32)
def compiled(template: str, iterations: bool = True) -> jinja2.Template:
    """`template` compiled, with `iterations` a mark at the start and end of every loop
    iteration, a ``{% break %}`` or ``{% continue %}`` included (the marks are empty strings:
    the rendering is unchanged)."""
    env = _environment()
    try:
        tree = env.parse(template)
        if iterations:
            _mark_iterations(tree, None, env)
        code = env.compile(tree)
    except jinja2.exceptions.TemplateError as err:
        raise ChatTemplateError(
            f"the chat template does not compile ({type(err).__name__}: {err})"
        ) from err
    return env.template_class.from_code(env, code, env.make_globals(None))


def _mark_output(item: nodes.Name, edge: str, lineno: int, env: Any) -> nodes.Output:
    mark = nodes.Filter(nodes.Name(item.name, "load"), edge, [], [], None, None)
    output = nodes.Output([mark])
    output.set_lineno(lineno).set_environment(env)
    return output


def _mark_iterations(node: nodes.Node, item: nodes.Name | None, env: Any) -> None:
    """Mark each loop body's start and end, and each ``break`` / ``continue`` (which leave
    it early) with the end of the innermost loop's iteration."""
    for field, value in node.iter_fields():
        if isinstance(value, nodes.Node):
            _mark_iterations(value, item, env)
        if not isinstance(value, list):
            continue
        if isinstance(node, nodes.For) and field == "body":
            inner = node.target if isinstance(node.target, nodes.Name) else None
            for child in value:
                if isinstance(child, nodes.Node):
                    _mark_iterations(child, inner, env)
            _mark_leaves(value, inner, env)
            if inner is not None:
                value.insert(0, _mark_output(inner, _ITERATION_START, node.lineno, env))
                value.append(_mark_output(inner, _ITERATION_END, node.lineno, env))
            continue
        for child in value:
            if isinstance(child, nodes.Node):
                _mark_iterations(child, item, env)
        _mark_leaves(value, item, env)


def _mark_leaves(body: list[Any], item: nodes.Name | None, env: Any) -> None:
    if item is None:
        return
    at = 0
    while at < len(body):
        child = body[at]
        if isinstance(child, (nodes.Break, nodes.Continue)):
            body.insert(at, _mark_output(item, _ITERATION_END, child.lineno, env))
            at += 1
        at += 1
