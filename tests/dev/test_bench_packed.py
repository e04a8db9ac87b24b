"""Smoke run of ``benches/bench_packed.py --quick``: it runs end to end, checks that mmpack and the
reference produce the same structures, and writes its JSON report (no timing assertion)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benches" / "bench_packed.py"


def test_bench_packed_quick(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = importlib.util.spec_from_file_location("bench_packed", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_packed", module)  # dataclasses look the module up
    spec.loader.exec_module(module)
    out = tmp_path / "bench_packed.json"
    assert module.main(["--quick", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    sections = [row["section"] for row in report["rows"]]
    assert sections.count("a") == 2 and sections.count("b") == 5 and sections.count("c") == 1
    for row in report["rows"]:
        assert row["reference_ms"] > 0 and row["mmpack_ms"] > 0
    assert report["machine"]["mmpack"]
    table = capsys.readouterr().out
    assert "| operation | reference ms | mmpack ms | ratio | target | met? |" in table
    assert "pickle round trip" in table
