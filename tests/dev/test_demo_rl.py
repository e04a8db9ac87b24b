"""``mmpack_dev demo rl`` at a small size: runs through the CLI, prints the side-by-side tables, and
mmpack's outputs agree with the plain-Python reference's (passed in with ``--compare-with``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mmpack_dev.__main__ import run as cli_main
from mmpack_dev.demos import rl


def test_demo_rl_small(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "rl.json"
    argv = ["demo", "rl", "--prompts", "24", "--group", "4", "--dp", "8", "--repeats", "1"]
    argv += ["--compare-with", "reference.packed_tensor:PackedTensor"]
    assert cli_main([*argv, "--dim", "8", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| step | reference ms | mmpack ms | speedup |" in text
    assert "outputs agree: yes" in text
    report = json.loads(out.read_text())
    assert report["agree"] is True
    ref, mm = report["reference"], report["mmpack"]
    assert ref["rows"] == mm["rows"] == 96
    assert ref["physical_segments"] == mm["physical_segments"]
    assert ref["logical_bytes"] == mm["logical_bytes"] > mm["physical_bytes"] > 0
    assert set(mm["seconds"]) == set(rl.STEPS)


def test_demo_rl_rejects_bad_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    assert rl.main(["--prompts", "3", "--group", "1", "--dp", "2"]) == 2
    assert "do not split" in capsys.readouterr().err
    assert rl.main(["--group", "0"]) == 2


def test_demo_rl_runs_alone_without_a_comparison(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "rl.json"
    argv = ["--prompts", "8", "--group", "2", "--dp", "4", "--repeats", "1", "--dim", "8"]
    assert rl.main([*argv, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| step | mmpack ms |" in text and "reference" not in text
    report = json.loads(out.read_text())
    assert report["agree"] is None and "reference" not in report
    assert report["mmpack"]["rows"] == 16


def test_demo_rl_compared_class_must_import(capsys: pytest.CaptureFixture[str]) -> None:
    assert rl.main(["--compare-with", "no_such_module:PackedTensor"]) == 2
    assert "--compare-with no_such_module:PackedTensor: cannot import" in capsys.readouterr().err
    assert rl.main(["--compare-with", "reference.packed_tensor:concat"]) == 2
    assert "has no attribute 'concat'" in capsys.readouterr().err
    assert rl.main(["--compare-with", "reference.packing:get_packer"]) == 2
    assert "expected a PackedTensor class" in capsys.readouterr().err


def test_the_dev_command_says_what_it_runs(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["--help"]) == 0
    text = capsys.readouterr().out
    assert "demo sft" in text and "demo rl" in text
    assert cli_main(["nope"]) == 2
