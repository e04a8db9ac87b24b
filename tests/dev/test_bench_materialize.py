"""Smoke runs of the materialization bench and the GPU check script (no timing assertions)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def test_bench_materialize_quick(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benches" / "bench_materialize.py"), "--quick"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "| as_tensor, reused out= |" in proc.stdout
    data = json.loads((tmp_path / "bench-results" / "bench_materialize.json").read_text())
    assert data["quick"] is True
    assert {r["case"].split(" (")[0] for r in data["rows"]} >= {
        "as_tensor, new buffer",
        "payload.measure",
    }


def test_gpu_check_runs(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benches" / "gpu_check.py"),
            "--repeats",
            "1",
            "--prompts",
            "2",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    if torch.cuda.is_available():
        assert "all GPU checks passed" in proc.stdout
    else:
        assert "no CUDA device available" in proc.stdout
