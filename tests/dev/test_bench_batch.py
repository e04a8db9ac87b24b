"""Smoke run of benches/bench_batch.py --quick (no timing assertion)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benches" / "bench_batch.py"


def test_bench_batch_quick(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(BENCH), "--quick"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "| pack_samples" in done.stdout
    assert "| pad_samples" in done.stdout and "| micro_batch" in done.stdout
    assert "| masks.validate" in done.stdout
    result = json.loads((tmp_path / "bench-results" / "bench_batch.json").read_text())
    assert result["quick"] is True
    assert len(result["rows"]) == 7
    assert all(row["mmpack_ms"] > 0 and row["reference_ms"] > 0 for row in result["rows"])
