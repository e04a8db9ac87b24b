"""Hypothesis: every string operation `TracedStr` overrides returns the text the plain `str`
operation returns, and its marks label exactly the characters that came from labelled
characters of the input (with the labels those characters had); a position mark inside the
kept text stays at its position. The oracle is Python's own `str`: each output character's
source index is computed from the plain result. Equality, hashing and ``str()`` behave as for
`str`, and an operation that is not overridden never returns a new `TracedStr` (so never one
with stale marks)."""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from mmpack.batch.traced_text import Mark, TracedStr, traced_join

# letters, separators that overlap themselves ("aa"), and whitespace that str.split(None)
# splits on beyond ASCII (ideographic space, the information separators, NEL)
ALPHABET = "ab, \t\n\u3000\x1c\x85"
SEPARATORS = st.one_of(
    st.none(),
    st.sampled_from([",", " ", "a", "aa", "ab", "\n", ", "]),
    st.text(ALPHABET, min_size=1, max_size=3),
)
LABELS = st.sampled_from(["A", "B", "C", ("value", 1, ("content",))])


@st.composite
def traced(draw: st.DrawFn, max_size: int = 12) -> TracedStr:
    """A random text with random marks: overlapping, nested, repeated labels, zero-width."""
    text = draw(st.text(ALPHABET, max_size=max_size))
    bounds = st.tuples(st.integers(0, len(text)), st.integers(0, len(text))).map(sorted)
    spans = draw(st.lists(st.tuples(bounds, LABELS), max_size=4))
    return TracedStr(text, [(s, e, label) for (s, e), label in spans])


def marks_of(value: str) -> tuple[Mark, ...]:
    return value.marks if type(value) is TracedStr else ()


def labels_at(marks: Sequence[Mark], i: int) -> frozenset[Any]:
    return frozenset(label for s, e, label in marks if s <= i < e)


def char_labels(value: str) -> list[frozenset[Any]]:
    """The label set of each character of `value`."""
    marks = marks_of(value)
    return [labels_at(marks, i) for i in range(len(value))]


def positions(value: str) -> list[tuple[int, Any]]:
    """The zero-width marks of `value` as ``(position, label)``."""
    return [(s, label) for s, e, label in marks_of(value) if s == e]


def assert_marks(
    result: str,
    expected: Sequence[frozenset[Any]],
    *,
    kept_positions: Sequence[tuple[int, Any]] = (),
    inputs: Sequence[str] = (),
) -> None:
    """`result`'s marks are in range, label character ``j`` with exactly ``expected[j]``, keep
    every ``(position, label)`` in `kept_positions` and invent no label absent from `inputs`."""
    assert type(result) in (str, TracedStr)
    marks = marks_of(result)
    for s, e, _ in marks:
        assert 0 <= s <= e <= len(result)
    assert [labels_at(marks, j) for j in range(len(result))] == list(expected)
    assert set(kept_positions) <= set(positions(result))
    known = {label for value in inputs for _, _, label in marks_of(value)}
    assert {label for _, _, label in marks} <= known


def assert_cut(result: str, source: TracedStr, start: int, stop: int) -> None:
    """`result` is ``source[start:stop]`` with its marks (positions inside kept, inclusive)."""
    assert result == str.__getitem__(source, slice(start, stop))
    assert_marks(
        result,
        char_labels(source)[start:stop],
        kept_positions=[(p - start, label) for p, label in positions(source) if start <= p <= stop],
        inputs=[source],
    )


def assert_pieces(
    pieces: list[str], source: TracedStr, starts: Sequence[int], plain: list[str]
) -> None:
    assert pieces == plain
    assert all(type(p) in (str, TracedStr) for p in pieces)
    for piece, start in zip(pieces, starts, strict=True):
        assert_cut(piece, source, start, start + len(piece))


def separated_starts(plain: list[str], sep: str) -> list[int]:
    """Where each piece of ``text.split(sep)`` / ``rsplit`` starts: the pieces and separators
    tile the text."""
    starts, at = [], 0
    for piece in plain:
        starts.append(at)
        at += len(piece) + len(sep)
    return starts


def whitespace_starts(text: str, plain: list[str]) -> list[int]:
    """Where each piece of ``text.split()`` / ``rsplit()`` starts: only whitespace lies between
    pieces, and a piece starts with a non-space unless it is a remainder starting the text."""
    starts, at = [], 0
    for piece in plain:
        at = text.index(piece, at)
        starts.append(at)
        at += len(piece)
    return starts


# --- concatenation ------------------------------------------------------------------------------


@given(traced(), st.one_of(traced(), st.text(ALPHABET, max_size=6)))
def test_add_both_ways_moves_the_marks(left: TracedStr, right: str) -> None:
    for a, b in ((left, right), (right, left)):
        result = a + b
        assert result == str(a) + str(b) and str.__add__(str(a), str(b)) == result
        assert_marks(
            result,
            char_labels(a) + char_labels(b),
            kept_positions=[*positions(a), *[(p + len(a), lab) for p, lab in positions(b)]],
            inputs=[a, b],
        )


def test_add_with_a_plain_string_is_traced_either_way_round() -> None:
    t = TracedStr("x", [(0, 1, "A")])
    assert marks_of(t + "yz") == ((0, 1, "A"),)
    assert marks_of("yz" + t) == ((2, 3, "A"),)  # TracedStr.__radd__ runs before str.__add__
    assert type("" + TracedStr("", [(0, 0, "P")])) is TracedStr
    with pytest.raises(TypeError):
        t + 1
    with pytest.raises(TypeError):
        1 + t


@given(
    st.lists(
        st.one_of(traced(6), st.text(ALPHABET, max_size=4), st.integers(-99, 99), st.none()),
        max_size=6,
    )
)
def test_traced_join_concatenates_every_piece_through_str(pieces: list[Any]) -> None:
    result = traced_join(pieces)
    assert result == "".join(str(p) for p in pieces)
    expected: list[frozenset[Any]] = []
    kept: list[tuple[int, Any]] = []
    for piece in pieces:
        text = piece if isinstance(piece, str) else str(piece)
        kept += [(p + len(expected), label) for p, label in positions(text)]
        expected += char_labels(text)
    assert_marks(
        result, expected, kept_positions=kept, inputs=[p for p in pieces if isinstance(p, str)]
    )
    if not any(marks_of(p) for p in pieces if isinstance(p, str)):
        assert type(result) is str  # nothing traced: a plain str


# --- cutting ------------------------------------------------------------------------------------


@given(
    traced(),
    st.one_of(st.none(), st.integers(-15, 15)),
    st.one_of(st.none(), st.integers(-15, 15)),
    st.one_of(st.none(), st.integers(-4, 4).filter(bool)),
)
def test_slicing_keeps_the_marks_of_the_kept_characters(
    t: TracedStr, start: int | None, stop: int | None, step: int | None
) -> None:
    result = t[start:stop:step]
    plain = str(t)[start:stop:step]
    assert result == plain
    source = range(len(t))[start:stop:step]
    if (step or 1) == 1:
        assert_cut(result, t, source.start, max(source.start, source.stop))
    else:
        # a strided cut is not traced: plain text, unattributed rather than misattributed
        assert type(result) is str


@given(traced(), st.integers(-15, 15))
def test_indexing_returns_a_plain_character(t: TracedStr, i: int) -> None:
    if -len(t) <= i < len(t):
        assert t[i] == str(t)[i] and type(t[i]) is str
    else:
        with pytest.raises(IndexError):
            t[i]


@pytest.mark.parametrize("name", ["strip", "lstrip", "rstrip"])
@given(t=traced(), chars=st.one_of(st.none(), st.text(ALPHABET, max_size=3)))
def test_strip_keeps_the_marks_of_the_kept_characters(
    name: str, t: TracedStr, chars: str | None
) -> None:
    result = getattr(t, name)(chars)
    plain = getattr(str, name)(str(t), chars)
    assert result == plain
    start = 0 if name == "rstrip" else len(t) - len(str.lstrip(t, chars))
    assert_cut(result, t, start, start + len(plain))


def test_a_value_stripped_to_nothing_keeps_its_position() -> None:
    # "x:" then a value of blanks: strip and rstrip keep the value as a position after "x:"
    t = TracedStr("x: \n ", [(2, 5, "A")])
    for result, marks in ((t.strip(), ((2, 2, "A"),)), (t.rstrip(), ((2, 2, "A"),))):
        assert (result, marks_of(result)) == ("x:", marks)
    empty = TracedStr(" \t", [(0, 2, "A")]).strip()
    assert (empty, marks_of(empty)) == ("", ((0, 0, "A"),))


# --- splitting ----------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["split", "rsplit"])
@given(t=traced(), sep=SEPARATORS, maxsplit=st.integers(-2, 4))
def test_split_pieces_keep_the_marks_of_their_characters(
    method: str, t: TracedStr, sep: str | None, maxsplit: int
) -> None:
    plain = getattr(str, method)(str(t), sep, maxsplit)
    pieces = getattr(t, method)(sep, maxsplit)
    starts = separated_starts(plain, sep) if sep is not None else whitespace_starts(t, plain)
    assert_pieces(pieces, t, starts, plain)


@pytest.mark.parametrize("method", ["split", "rsplit"])
@given(t=traced(), sep=SEPARATORS)
def test_split_keyword_and_default_arguments(method: str, t: TracedStr, sep: str | None) -> None:
    plain = getattr(str, method)(str(t), sep=sep)
    starts = separated_starts(plain, sep) if sep is not None else whitespace_starts(t, plain)
    pieces = getattr(t, method)(sep=sep)
    assert_pieces(pieces, t, starts, plain)
    if sep is None:
        assert_pieces(getattr(t, method)(), t, starts, plain)


def test_split_on_an_empty_separator_raises_as_str_does() -> None:
    t = TracedStr("a,b", [(0, 3, "A")])
    for method in (t.split, t.rsplit):
        with pytest.raises(ValueError, match="empty separator"):
            method("")


def test_a_template_split_keeps_the_value_label_on_each_piece() -> None:
    # what Qwen3's template does to an assistant reply with its reasoning inline
    content = TracedStr("<think>\nplan\n</think>\n\nanswer", [(0, 29, "C")])
    reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
    reply = content.split("</think>")[-1].lstrip("\n")
    assert (reasoning, marks_of(reasoning)) == ("plan", ((0, 4, "C"),))
    assert (reply, marks_of(reply)) == ("answer", ((0, 6, "C"),))


# Splits whose bounds differ from the plain left-to-right cut: each piece keeps its marks
EDGE_SPLITS = [
    ("split", "a b  ", None, 1),  # str.split keeps the trailing blanks in the remainder
    ("split", " a ", None, 0),
    ("rsplit", "a b c", None, 1),  # rsplit(None, n) is bounded as an unbounded split
    ("rsplit", "  a b", None, 1),
    ("rsplit", "aaa", "aa", -1),  # rsplit scans from the right: ["a", ""], not ["", "a"]
]


@pytest.mark.parametrize(("method", "text", "sep", "maxsplit"), EDGE_SPLITS)
def test_edge_splits_keep_their_marks(
    method: str, text: str, sep: str | None, maxsplit: int
) -> None:
    t = TracedStr(text, [(0, len(text), "A")])
    pieces = getattr(t, method)(sep, maxsplit)
    assert pieces == getattr(str, method)(text, sep, maxsplit)
    assert all(type(p) is TracedStr for p in pieces)


# --- str behaviour ------------------------------------------------------------------------------


@given(traced(), traced())
def test_equal_hashed_and_ordered_as_its_text(a: TracedStr, b: TracedStr) -> None:
    assert isinstance(a, str)
    assert a == str(a) and str(a) == a and hash(a) == hash(str.__str__(a))
    assert (a == b) == (str.__str__(a) == str.__str__(b))
    assert (a < b) == (str.__str__(a) < str.__str__(b))
    table: dict[str, int] = {a: 1}
    assert table.get(str.__str__(a)) == 1 and str.__str__(a) in {a}
    assert len(a) == len(str.__str__(a)) and list(a) == list(str.__str__(a))


def test_str_of_a_traced_string_is_itself_and_marks_are_per_object() -> None:
    t = TracedStr("ab", [(0, 2, "A")])
    assert str(t) is t  # Jinja writes str(value): the marks must survive it
    assert TracedStr("ab", [(0, 1, "B")]) == t and TracedStr("ab").marks == ()
    plain = str.__str__(t)
    assert type(plain) is str and plain == t  # the way out of tracing


NOT_OVERRIDDEN: dict[str, Callable[[str], Any]] = {
    "upper": str.upper,
    "lower": str.lower,
    "title": str.title,
    "capitalize": str.capitalize,
    "casefold": str.casefold,
    "swapcase": str.swapcase,
    "replace": lambda t: t.replace("a", "b"),
    "replace-nothing": lambda t: t.replace("\x00", "y"),
    "center": lambda t: t.center(len(t)),
    "ljust": lambda t: t.ljust(2),
    "zfill": lambda t: t.zfill(1),
    "expandtabs": str.expandtabs,
    "removeprefix": lambda t: t.removeprefix("a"),
    "removesuffix": lambda t: t.removesuffix("b"),
    "translate": lambda t: t.translate({}),
    "times-one": lambda t: t * 1,
    "times-two": lambda t: t * 2,
    "str.join": lambda t: "".join([t]),
    "join-with": lambda t: t.join(["x", "y"]),
    "str.strip": str.strip,
    "str.split": lambda t: str.split(t, ","),
    "splitlines": str.splitlines,
    "partition": lambda t: t.partition(","),
    "rpartition": lambda t: t.rpartition(","),
    "percent-into": lambda t: "<%s>" % t,  # noqa: UP031
    "format-into": lambda t: "<{}>".format(t),  # noqa: UP032
    "f-string-into": lambda t: f"<{t}>",
    # a new text from a traced format: the format's marks would be stale
    "percent-of": lambda t: TracedStr("%s|" + t, marks_of(t)) % "x",
    "format-of": lambda t: TracedStr("{}|" + t, marks_of(t)).format("x"),
    "getitem-step": lambda t: t[::2],
    "index": lambda t: t[0] if t else "",
}


@pytest.mark.parametrize("op", NOT_OVERRIDDEN.values(), ids=NOT_OVERRIDDEN.keys())
@given(t=traced())
def test_an_operation_not_overridden_never_makes_a_new_traced_string(
    op: Callable[[str], Any], t: TracedStr
) -> None:
    result = op(t)
    assert result == op(str.__str__(t))
    for item in result if isinstance(result, (list, tuple)) else [result]:
        # a plain str, or CPython handing back the untouched argument itself (whose marks
        # still describe its text)
        assert type(item) is str or item is t


@pytest.mark.parametrize(
    "op",
    [operator.mod, lambda f, t: f.format(t)],
    ids=["percent", "format"],
)
def test_formatting_a_traced_string_into_more_text_drops_its_marks(
    op: Callable[[str, str], str],
) -> None:
    t = TracedStr("ab", [(0, 2, "A")])
    fmt = "[%s]" if op is operator.mod else "[{}]"
    assert (op(fmt, t), type(op(fmt, t))) == ("[ab]", str)
    # the whole result being the argument: CPython returns the argument, marks and all right
    whole = "%s" if op is operator.mod else "{}"
    assert op(whole, t) is t
