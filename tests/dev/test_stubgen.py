"""``mmpack_dev.stubgen``: the checked-in generated sections match the native error table, and
the generator replaces exactly the text between its markers."""

from __future__ import annotations

from pathlib import Path

import mmpack
import pytest
from mmpack import _native
from mmpack_dev import stubgen

PACKAGE = Path(mmpack.__file__).parent


@pytest.mark.parametrize("name", ["errors.py", "_native.pyi"])
def test_checked_in_files_are_what_the_generator_writes(name: str) -> None:
    path = PACKAGE / name
    want = stubgen.targets(PACKAGE, _native.ERROR_TABLE)[path]
    assert path.read_text() == want, f"{name} is stale: run `make stubs`"


def test_check_mode_reports_nothing_and_writes_nothing() -> None:
    before = {p: p.read_text() for p in (PACKAGE / "errors.py", PACKAGE / "_native.pyi")}
    assert stubgen.main(["--check"]) == 0
    assert {p: p.read_text() for p in before} == before


TABLE = [
    ("AError", ("ValueError",), "one", "Base of one."),
    ("BError", ("AError", "pickle.PicklingError"), "one", "B " * 60),
    ("CError", ("AError",), "two", "C."),
]


def test_sections_group_by_area_in_table_order() -> None:
    errors_section = stubgen.render_errors_section(TABLE)
    assert errors_section.index("# --- one ---") < errors_section.index("    BError as BError,")
    assert errors_section.index("    BError as BError,") < errors_section.index("# --- two ---")
    assert errors_section.endswith("    CError as CError,\n)")
    # the import re-exports; ``__all__`` is not generated (it also names the Python table)
    assert "__all__" not in errors_section
    stub = stubgen.render_stub_section(TABLE)
    assert "class BError(AError, pickle.PicklingError):" in stub
    assert all(len(line) <= 100 for line in stub.split("\n"))
    # the long docstring is wrapped, not cut
    body = stub.split("class BError")[1].split("class CError")[0]
    assert body.count("B") == 60


def test_replace_section_keeps_the_frame_and_needs_both_markers() -> None:
    text = f"head\n{stubgen.BEGIN}\nold\n{stubgen.END}\ntail\n"
    assert (
        stubgen.replace_section(text, "new") == f"head\n{stubgen.BEGIN}\nnew\n{stubgen.END}\ntail\n"
    )
    with pytest.raises(ValueError, match="needs exactly one"):
        stubgen.replace_section("head\n" + stubgen.BEGIN + "\n", "new")
    with pytest.raises(ValueError, match="comes before"):
        stubgen.replace_section(f"{stubgen.END}\n{stubgen.BEGIN}\n", "new")


def test_a_docstring_that_cannot_be_written_is_refused() -> None:
    with pytest.raises(ValueError, match="triple quotes"):
        stubgen.render_stub_section([("XError", ("ValueError",), "x", 'say """hi"""')])
