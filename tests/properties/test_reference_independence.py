"""The plain-Python references (``tests/reference``) are oracles: they run no product code, so
they can catch the product's mistakes instead of repeating them. No reference module imports
``mmpack`` (nor the development package or the test helpers, which do), at the top or inside a
function, and importing every one of them loads no ``mmpack`` module."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

REFERENCE = Path(__file__).resolve().parents[1] / "reference"
#: top-level packages a reference may not import: the product, and the development package and
#: test helpers that import it
FORBIDDEN = ("mmpack", "mmpack_dev", "support")


def forbidden_imports(source: str, filename: str = "<source>") -> list[str]:
    """``"line: module"`` for each import of a `FORBIDDEN` package in `source` (``import``,
    ``from ... import`` and ``importlib.import_module`` / ``__import__`` of a literal name)."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Call) and node.args:
            func = ast.unparse(node.func)
            arg = node.args[0]
            if func in ("importlib.import_module", "import_module", "__import__") and isinstance(
                arg, ast.Constant
            ):
                names = [str(arg.value)]
        found += [f"{node.lineno}: {n}" for n in names if n.split(".")[0] in FORBIDDEN]
    return found


def test_the_checker_finds_every_form_of_import() -> None:
    source = (
        "import numpy\n"
        "import mmpack\n"
        "from mmpack.errors import LossMaskError\n"
        "def f():\n"
        "    import mmpack_dev.synthetic\n"
        "    importlib.import_module('mmpack.batch')\n"
        "from support import nemo_rl_standins\n"
        "from reference import masks\n"
    )
    assert forbidden_imports(source) == [
        "2: mmpack",
        "3: mmpack.errors",
        "7: support",
        "5: mmpack_dev.synthetic",
        "6: mmpack.batch",
    ]


@pytest.mark.parametrize(
    "path", sorted(REFERENCE.glob("*.py")), ids=lambda p: p.name if isinstance(p, Path) else p
)
def test_no_reference_module_imports_mmpack(path: Path) -> None:
    assert forbidden_imports(path.read_text(), str(path)) == [], path.name


def test_every_reference_module_is_checked() -> None:
    # a reference in a subfolder would escape the glob above
    assert {p.parent for p in REFERENCE.rglob("*.py")} == {REFERENCE}
    assert len(list(REFERENCE.glob("*.py"))) >= 7


def test_importing_the_references_loads_no_mmpack_module() -> None:
    modules = sorted(f"reference.{p.stem}" for p in REFERENCE.glob("*.py") if p.stem != "__init__")
    code = (
        "import importlib, json, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
        f"{list(FORBIDDEN)!r})))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REFERENCE.parent,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.splitlines()[-1]) == []
