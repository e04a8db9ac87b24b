"""Smoke run of ``benches/bench_vision.py --quick``: both paths run, their logits and loss agree
(the bench asserts it), the tower encodes every copy on the logical path and each unique image
once on the unique one, and the JSON report is written (no timing assertion)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benches" / "bench_vision.py"


def test_bench_vision_quick(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = importlib.util.spec_from_file_location("bench_vision", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_vision", module)
    spec.loader.exec_module(module)
    out = tmp_path / "bench_vision.json"
    assert module.main(["--quick", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    # G = 4: one prompt x 4 rows, and 2 prompts x 2 rows; each pass forward and forward + backward
    assert [(r["rows"], r["pass"]) for r in rows] == [
        ("1 x 4", "forward"),
        ("1 x 4", "forward + backward"),
        ("2 x 2", "forward"),
        ("2 x 2", "forward + backward"),
    ]
    assert [tuple(r["encodes"]) for r in rows] == [(4, 1), (4, 1), (4, 2), (4, 2)]
    assert all(r["logit_diff"] <= 1e-4 for r in rows)
    table = capsys.readouterr().out
    assert "| tower | rows | pass | encodes logical / unique |" in table
