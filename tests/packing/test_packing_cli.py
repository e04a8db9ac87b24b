"""``mmpack pack-stats`` on small files of every format, and a smoke run of the packing
benchmark (no timing assertion)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from mmpack import errors
from mmpack.cli import main
from mmpack.packing import pack
from mmpack.packing import stats_cli as pack_stats
from mmpack.packing.stats_cli import read_lengths

ROOT = Path(__file__).resolve().parents[2]
LENGTHS = np.array([300, 900, 100, 700, 500, 512, 1024, 16, 64, 999] * 20, dtype=np.int64)


def _write(tmp_path: Path, fmt: str) -> Path:
    path = tmp_path / f"lengths.{fmt}"
    if fmt == "npy":
        np.save(path, LENGTHS)
    elif fmt == "txt":
        path.write_text("\n".join(str(x) for x in LENGTHS) + "\n")
    elif fmt == "jsonl":
        path.write_text(
            "\n".join(json.dumps({"id": i, "num_tokens": int(x)}) for i, x in enumerate(LENGTHS))
        )
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(
            pa.table({"text_id": np.arange(len(LENGTHS)), "n_tokens": LENGTHS}),
            path,
            row_group_size=50,
        )
    return path


@pytest.mark.parametrize("fmt", ["npy", "txt", "jsonl", "parquet"])
def test_pack_stats_reads_every_format(
    tmp_path: Path, fmt: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write(tmp_path, fmt)
    assert pack_stats.read_lengths(str(path)).tolist() == LENGTHS.tolist()
    plot = tmp_path / "fill.png"
    rc = main(
        [
            "pack-stats",
            str(path),
            "--capacity",
            "1024",
            "--algorithm",
            "first_fit_decreasing",
            "--plot",
            str(plot),
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out
    expected = pack(LENGTHS, 1024, algorithm="first_fit_decreasing")
    assert f"lower bound ceil(sum/capacity): {expected.lower_bound} bins" in out
    assert "first_fit_decreasing" in out and "best_fit_decreasing" in out
    assert f"| {expected.num_bins:>9} |" in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_pack_stats_column_and_progress(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps({"a": int(x), "b": 1}) for x in LENGTHS))
    monkeypatch.setattr(pack_stats, "PROGRESS_BYTES", 0)  # force the progress bar
    assert main(["pack-stats", str(path), "--capacity", "1024", "--column", "a"]) == 0
    captured = capsys.readouterr()
    assert "reading rows.jsonl" in captured.err
    assert main(["pack-stats", str(path), "--capacity", "1024"]) == 2
    assert "--column" in capsys.readouterr().err


def test_pack_stats_reports_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "l.txt"
    path.write_text("5\n2000\n7\n")
    assert main(["pack-stats", str(path), "--capacity", "1024"]) == 2
    assert "ItemTooLargeError: item 1 has length 2000" in capsys.readouterr().err
    assert main(["pack-stats", str(path), "--capacity", "1024", "--on-oversize", "skip"]) == 0
    assert "oversize items (skip): 1" in capsys.readouterr().out
    bad = tmp_path / "l.csv"
    bad.write_text("1\n")
    assert main(["pack-stats", str(bad), "--capacity", "10"]) == 2
    assert "unknown file type" in capsys.readouterr().err
    path.write_text("5\nx\n")
    assert main(["pack-stats", str(path), "--capacity", "10"]) == 2
    assert "line 2 is not an integer" in capsys.readouterr().err


def test_bench_packing_quick_smoke(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benches" / "bench_packing.py"), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "| mmpack pack(best_fit_decreasing) numpy in, CSR out |" in proc.stdout
    report = json.loads(out.read_text())
    rows = report["sft"]["2000/4096"]
    refs = [r for r in rows if r["what"].startswith("reference")]
    assert len(refs) == 4 and all("identical output: True" in r["note"] for r in refs)


def test_jsonl_column_is_chosen_once(tmp_path: Path) -> None:
    # A later line without the first line's column is an error, never another column packed.
    path = tmp_path / "mixed.jsonl"
    path.write_text('{"length": 5, "id": 1}\n{"id": 2}\n')
    with pytest.raises(errors.PackingArgumentError, match="line 2 has no column 'length'"):
        read_lengths(str(path))


@pytest.mark.parametrize(
    ("name", "text"),
    [("big.txt", "5\n99999999999999999999\n"), ("big.jsonl", "12345678901234567890123\n")],
)
def test_length_beyond_int64_names_the_line(tmp_path: Path, name: str, text: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(errors.PackingArgumentError, match="beyond int64"):
        read_lengths(str(path))


def test_two_dimensional_npy_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "two_d.npy"
    np.save(path, np.array([[1, 2], [3, 4]]))
    with pytest.raises(errors.PackingArgumentError, match="1-D"):
        read_lengths(str(path))


def test_unwritable_plot_path_is_a_clean_error(tmp_path: Path, capsys: Any) -> None:
    path = tmp_path / "l.txt"
    path.write_text("5\n7\n")
    assert (
        main(
            ["pack-stats", str(path), "--capacity", "10", "--plot", str(tmp_path / "no" / "x.png")]
        )
        == 2
    )
    assert "--plot" in capsys.readouterr().err
