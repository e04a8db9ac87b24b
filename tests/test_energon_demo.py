"""Smoke tests of the main job (`mmpack demo`) and its benchmark script (no timing assertions)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.energon")

from mmpack.demos import DEFAULT_PIPELINE
from mmpack.demos import sft as demo

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*pin_memory.*:UserWarning"),
    pytest.mark.timeout(240),
]


def test_demo_default_pipeline_is_sft() -> None:
    assert DEFAULT_PIPELINE == "sft"


def test_demo_runs_and_reports(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "work"
    rc = demo.main(
        ["--samples", "150", "--workers", "0", "--repeats", "1", "--capacity", "1024",
         "--buffer", "16", "--out", str(out), "--json", str(tmp_path / "r.json")]
    )  # fmt: skip
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "-> balanced" in text
    assert "mmpack packs == reference packs, sample for sample: True" in text
    assert (
        "| mmpack packing |" in text
        and "| reference packing |" in text
        and "| no packing |" in text
    )
    png = out / "sft-demo.png"
    assert f"plot: {png}" in text and png.stat().st_size > 10_000
    summary = json.loads((tmp_path / "r.json").read_text())
    assert summary["identical_to_reference"] and summary["accounting_balanced"]
    assert set(summary["pipelines"]) == {"mmpack packing", "reference packing", "no packing"}
    # the dataset is reused when the parameters match
    rc = demo.main(["--samples", "150", "--workers", "0", "--repeats", "1", "--capacity", "1024",
                    "--out", str(out), "--no-reference", "--no-baseline", "--no-plot"])  # fmt: skip
    assert rc == 0


def test_demo_rejects_bad_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert demo.main(["--samples", "3"]) == 2
    assert "--samples >= 10" in capsys.readouterr().err
    assert demo.main(["--algorithm", "nope"]) == 2
    assert "unknown algorithm 'nope'" in capsys.readouterr().err
    # the reference run needs one of NeMo-RL's algorithms: refused before anything runs
    assert demo.main(["--algorithm", "best_fit_decreasing"]) == 2
    assert "pass --no-reference" in capsys.readouterr().err


def test_bench_energon_quick_smoke(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benches" / "bench_energon.py"),
            "--quick",
            "--out",
            str(tmp_path / "b.json"),
        ],
        capture_output=True,
        text=True,
        timeout=200,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert json.loads((tmp_path / "b.json").read_text())["identical_to_reference"] is True
