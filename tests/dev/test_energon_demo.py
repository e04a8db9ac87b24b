"""Smoke tests of the loader-only comparison (`make demo-toy`) and its benchmark script (no timing
assertions)."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from mmpack.energon import PackingTaskEncoder
from mmpack_dev.demos import sft as demo

ROOT = Path(__file__).resolve().parents[2]
#: the plain-Python reference pipeline, passed in from the test suite as `make demo` does
COMPARE = ["--compare-with", "reference.energon:ReferencePackingTaskEncoder"]

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*pin_memory.*:UserWarning"),
    pytest.mark.timeout(240),
]


class OnePerPackEncoder(PackingTaskEncoder):
    """Puts every sample in a pack of its own: a compared pipeline that differs from mmpack's."""

    def plan_packs(self, lengths: np.ndarray, media: np.ndarray | None, *, seed: int) -> Any:
        n = len(lengths)
        return types.SimpleNamespace(bin_offsets=np.arange(n + 1), item_indices=np.arange(n))


def test_demo_runs_and_reports(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "work"
    rc = demo.main(
        ["--samples", "150", "--workers", "0", "--repeats", "1", "--capacity", "1024",
         "--buffer", "16", "--out", str(out), "--json", str(tmp_path / "r.json"), *COMPARE]
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
    assert summary["identical_to_compared"] and summary["accounting_balanced"]
    assert set(summary["pipelines"]) == {"mmpack packing", "reference packing", "no packing"}
    # the dataset is reused when the parameters match; without --compare-with nothing is compared
    rc = demo.main(["--samples", "150", "--workers", "0", "--repeats", "1", "--capacity", "1024",
                    "--out", str(out), "--no-baseline", "--no-plot",
                    "--json", str(tmp_path / "alone.json")])  # fmt: skip
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "-> balanced" in text and "reference" not in text
    alone = json.loads((tmp_path / "alone.json").read_text())
    assert alone["identical_to_compared"] is None and alone["accounting_balanced"]
    assert set(alone["pipelines"]) == {"mmpack packing"}


def test_demo_finds_a_difference_from_the_compared_pipeline(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # a compared encoder that packs differently must fail the "identical" check
    rc = demo.main(
        ["--samples", "60", "--workers", "0", "--repeats", "1", "--capacity", "1024",
         "--buffer", "16", "--out", str(tmp_path / "work"), "--no-baseline", "--no-plot",
         "--json", str(tmp_path / "r.json"),
         "--compare-with", "test_energon_demo:OnePerPackEncoder"]
    )  # fmt: skip
    text = capsys.readouterr().out
    assert rc == 1, text
    assert "mmpack packs == reference packs, sample for sample: False" in text
    assert json.loads((tmp_path / "r.json").read_text())["identical_to_compared"] is False


def test_demo_rejects_bad_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert demo.main(["--samples", "3"]) == 2
    assert "--samples >= 10" in capsys.readouterr().err
    assert demo.main(["--algorithm", "nope"]) == 2
    assert "unknown algorithm 'nope'" in capsys.readouterr().err
    # the reference run needs one of NeMo-RL's algorithms: refused before anything runs
    assert demo.main(["--algorithm", "best_fit_decreasing", *COMPARE]) == 2
    err = capsys.readouterr().err
    assert "--compare-with reference.energon:ReferencePackingTaskEncoder refuses" in err
    assert "only NeMo-RL's packing algorithms" in err
    # what --compare-with names must import and be a task encoder; errors name the option
    assert demo.main(["--compare-with", "no_such_module:Encoder"]) == 2
    err = capsys.readouterr().err
    assert "--compare-with no_such_module:Encoder: cannot import module 'no_such_module'" in err
    assert demo.main(["--compare-with", "reference.energon:NoSuchEncoder"]) == 2
    assert "has no attribute 'NoSuchEncoder'" in capsys.readouterr().err
    assert demo.main(["--compare-with", "reference.energon"]) == 2
    assert "--compare-with takes MODULE:ATTR" in capsys.readouterr().err
    assert demo.main(["--compare-with", "reference.energon:reference_pack"]) == 2
    assert "expected an Energon TaskEncoder subclass" in capsys.readouterr().err


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
    assert json.loads((tmp_path / "b.json").read_text())["identical_to_compared"] is True
