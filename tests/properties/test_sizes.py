"""Sizes a reader can hold: no package file over 600 lines, no Python class over 300 lines, no
Rust function over 100 lines (from its ``fn`` line to its closing brace)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import mmpack
import pytest

PACKAGE = Path(mmpack.__file__).resolve().parent
ROOT = PACKAGE.parents[1]
RUST = [ROOT / "rust" / "core" / "src", ROOT / "rust" / "py" / "src"]
MAX_FILE_LINES = 600
MAX_CLASS_LINES = 300
MAX_RUST_FN_LINES = 100

_FN = re.compile(
    r"\s*(pub(\([^)]*\))?\s+)?(const\s+)?(unsafe\s+)?(async\s+)?(extern\s+\"C\"\s+)?fn\s+(\w+)"
)
_CHAR = re.compile(r"'(\\.[^']*|[^\\'])'")


def rust_functions(text: str) -> list[tuple[str, int, int]]:
    """``(name, first line, lines)`` of every function with a body in Rust source ``text``:
    braces are matched outside comments, strings, raw strings and char literals."""
    lines = text.split("\n")
    out = []
    for first, line in enumerate(lines):
        m = _FN.match(line)
        if m is None or line.strip().startswith("//"):
            continue
        rest = "\n".join(lines[first:])
        depth, started, at, row = 0, False, 0, first
        while at < len(rest):
            c = rest[at]
            if rest.startswith("//", at):
                at = rest.find("\n", at)
                at = len(rest) if at < 0 else at
                continue
            if rest.startswith('r#"', at):
                end = rest.find('"#', at + 3)
                row += rest.count("\n", at, end)
                at = end + 2
                continue
            if c == '"':
                k = at + 1
                while rest[k] != '"':
                    k += 2 if rest[k] == "\\" else 1
                row += rest.count("\n", at, k)
                at = k + 1
                continue
            if c == "'" and (char := _CHAR.match(rest, at)) is not None:
                at = char.end()
                continue
            if c == "\n":
                row += 1
            elif c == ";" and not started:
                break  # a declaration without a body
            elif c == "{":
                depth, started = depth + 1, True
            elif c == "}":
                depth -= 1
                if started and depth == 0:
                    out.append((m.group(7), first + 1, row - first + 1))
                    break
            at += 1
    return out


def test_the_rust_measure_counts_bodies() -> None:
    src = "fn a() {\n    let s = \"}\";\n    // }\n    let c = '}';\n}\nfn b(x: &'a u8);\n"
    assert rust_functions(src) == [("a", 1, 5)]


def test_no_package_file_is_over_the_limit() -> None:
    long = {
        str(p.relative_to(PACKAGE)): n
        for p in sorted(PACKAGE.rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES
    }
    assert long == {}


def test_no_class_is_over_the_limit() -> None:
    long = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > MAX_CLASS_LINES:
                    long[f"{path.relative_to(PACKAGE)}:{node.name}"] = n
    assert long == {}


@pytest.mark.parametrize("src", RUST, ids=lambda p: p.parent.name)
def test_no_rust_function_is_over_the_limit(src: Path) -> None:
    files = sorted(src.rglob("*.rs"))
    assert files, src
    long = {
        f"{path.relative_to(ROOT)}:{line} {name}": n
        for path in files
        for name, line, n in rust_functions(path.read_text())
        if n > MAX_RUST_FN_LINES
    }
    assert long == {}
