"""Smoke run of ``benches/bench_vision.py --quick`` (no timing assertion): both paths run, each in
its own forked process, the bench's own checks pass (logits, loss and gradients agree), the tower
encodes every copy on the logical path and each unique image once on the unique one, and the
table and JSON report are written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benches" / "bench_vision.py"


def test_bench_vision_quick(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(BENCH), "--quick"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "# bench_vision: " in done.stdout
    assert "| tower | rows | pass | encodes logical / unique |" in done.stdout
    # G = 4: one prompt x 4 rows (1 unique image), 2 prompts x 2 rows (2 unique images)
    for rows, unique in (("1 x 4", 1), ("2 x 2", 2)):
        for name in ("forward", "forward + backward"):
            assert f"| tiny | {rows} | {name} | 4 / {unique} |" in done.stdout
    report = json.loads((tmp_path / "bench-results" / "bench_vision.json").read_text())
    assert report["quick"] is True
    assert [(r["rows"], r["pass"], tuple(r["encodes"])) for r in report["rows"]] == [
        ("1 x 4", "forward", (4, 1)),
        ("1 x 4", "forward + backward", (4, 1)),
        ("2 x 2", "forward", (4, 2)),
        ("2 x 2", "forward + backward", (4, 2)),
    ]
    assert all(r["logit_diff"] <= 1e-4 for r in report["rows"])
    assert all(min(r["call_s"]) > 0 and min(r["peak_mib"]) >= 0 for r in report["rows"])
