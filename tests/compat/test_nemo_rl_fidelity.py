"""The NeMo-RL fidelity runner's parts (tests/nemo_rl_fidelity), against a fake NeMo-RL.

The runner itself needs a NeMo-RL checkout and a Python 3.12+ venv; what can go wrong without
one is checked here: the pytest plugin patches before any conftest runs, the worker
``sitecustomize`` patches a fresh process on its first import of NeMo-RL (and only then), and
the junit parsing and the A/B comparison, recheck and allowlist rules.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path
from typing import Any

import pytest

FIDELITY = Path(__file__).resolve().parents[1] / "nemo_rl_fidelity"
PYTHON_SRC = Path(__file__).resolve().parents[2] / "python"


def _runner() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("run_fidelity", FIDELITY / "run_fidelity.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def fake_nemo_rl(tmp_path: Path) -> Path:
    """A ``nemo_rl`` with its own PackedTensor class and a module importing it by name."""
    root = tmp_path / "fake"
    data = root / "nemo_rl" / "data"
    data.mkdir(parents=True)
    (root / "nemo_rl" / "__init__.py").write_text("")
    (data / "__init__.py").write_text("")
    (data / "multimodal_utils.py").write_text("class PackedTensor:\n    pass\n")
    (data / "user.py").write_text("from nemo_rl.data.multimodal_utils import PackedTensor\n")
    return root


def _run(code: str, *path: Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in (*path, PYTHON_SRC))
    return subprocess.run(
        [sys.executable, *code.split("\0")],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )


def test_worker_site_patches_on_first_import_of_nemo_rl(fake_nemo_rl: Path) -> None:
    code = textwrap.dedent(
        """
        import sys
        assert "mmpack" not in sys.modules  # nothing is imported at startup
        import nemo_rl.data.user as user
        import nemo_rl.data.multimodal_utils as mm
        import mmpack
        assert mm.PackedTensor is mmpack.PackedTensor
        assert user.PackedTensor is mmpack.PackedTensor
        print("ok")
        """
    )
    result = _run(f"-c\0{code}", FIDELITY / "worker_site", fake_nemo_rl)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_worker_site_runs_the_sitecustomize_it_shadows(tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text("import builtins\nbuiltins.shadowed_ran = True\n")
    result = _run(
        "-c\0import builtins; print(builtins.shadowed_ran)", FIDELITY / "worker_site", other
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True"


def test_plugin_patches_before_conftests_and_reaches_child_processes(
    tmp_path: Path, fake_nemo_rl: Path
) -> None:
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "pytest.ini").write_text("[pytest]\n")
    (suite / "conftest.py").write_text(
        "from nemo_rl.data.multimodal_utils import PackedTensor as AT_CONFTEST\n"
    )
    (suite / "test_probe.py").write_text(
        textwrap.dedent(
            """
            import os, subprocess, sys
            import mmpack
            from conftest import AT_CONFTEST
            from nemo_rl.data.multimodal_utils import PackedTensor

            def test_probe():
                assert AT_CONFTEST is mmpack.PackedTensor
                assert PackedTensor is mmpack.PackedTensor
                child = "import nemo_rl.data.user as u, mmpack; "
                child += "print(u.PackedTensor is mmpack.PackedTensor)"
                out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True)
                assert out.stdout.strip() == "True", out.stderr
            """
        )
    )
    result = _run(
        "-m\0pytest\0-p\0mmpack_plugin\0-p\0no:cacheprovider\0-q\0test_probe.py",
        FIDELITY,
        fake_nemo_rl,
        cwd=suite,
    )
    assert result.returncode == 0, result.stdout + result.stderr


JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest">
<testcase classname="tests.unit.data.test_x" name="test_ok" time="0.1"/>
<testcase classname="tests.unit.data.test_x.TestGroup" name="test_bad[a-b]" time="0.1">
  <failure message="AssertionError: assert 1 == 2">long traceback</failure></testcase>
<testcase classname="tests.unit.data.test_x" name="test_skip" time="0.0">
  <skipped type="pytest.skip" message="CUDA not available">skip</skipped></testcase>
<testcase classname="" name="tests.unit.data.test_x" time="0.0">
  <skipped message="collection skipped">('/x/tests/unit/data/test_x.py', 29, "Skipped: could \
not import 'megatron.bridge': No module named 'megatron'")</skipped></testcase>
</testsuite></testsuites>
"""


def test_junit_ids_are_pytest_node_ids(tmp_path: Path) -> None:
    xml = tmp_path / "r.xml"
    xml.write_text(JUNIT)
    tests = _runner()._parse_junit(xml, "tests/unit/data/test_x.py")
    assert tests == {
        "tests/unit/data/test_x.py::test_ok": {"outcome": "passed", "message": ""},
        "tests/unit/data/test_x.py::TestGroup::test_bad[a-b]": {
            "outcome": "failed",
            "message": "AssertionError: assert 1 == 2",
        },
        "tests/unit/data/test_x.py::test_skip": {
            "outcome": "skipped",
            "message": "CUDA not available",
        },
        # a module-level skip: the reason comes from the text, and it names no test
        "tests/unit/data/test_x.py::tests.unit.data.test_x": {
            "outcome": "skipped",
            "message": "Skipped: could not import 'megatron.bridge': No module named 'megatron'",
            "collection": True,
        },
    }


def _result(tests: dict[str, str], file: str = "f.py", **kw: Any) -> dict[str, Any]:
    return {
        "targets": kw.get("targets", [file]),
        "rc": 1,
        "timed_out": False,
        "complete": kw.get("complete", True),
        "deselected": 0,
        "seconds": 1.0,
        "tests": {t: {"outcome": o, "message": f"{o} {t}"} for t, o in tests.items()},
    }


def test_compare_counts_only_differences_that_show_again(monkeypatch: pytest.MonkeyPatch) -> None:
    runner = _runner()
    monkeypatch.setattr(runner, "ALLOWLIST", {"f.py::identity": "checks type() is"})
    first = {
        "f.py::same": "passed",
        "f.py::real": "passed",
        "f.py::flaky": "passed",
        "f.py::identity": "passed",
        "f.py::fixed": "failed",
        "f.py::hub": "failed",
    }
    second = {**first, "f.py::real": "failed", "f.py::flaky": "error", "f.py::identity": "failed"}
    second["f.py::fixed"] = "passed"
    runs = {
        "A": {"f.py": _result(first), "g.py": _result({}, "g.py", complete=False)},
        "B": {"f.py": _result(second), "g.py": _result({"g.py::t": "failed"}, "g.py")},
    }
    ids = ["f.py::real", "f.py::flaky"]
    rechecks = {
        "A": {
            "f.py": _result({"f.py::real": "passed", "f.py::flaky": "passed"}, targets=ids),
            "g.py": _result({"g.py::t": "passed"}, "g.py"),
        },
        "B": {
            "f.py": _result({"f.py::real": "failed", "f.py::flaky": "passed"}, targets=ids),
            "g.py": _result({"g.py::t": "passed"}, "g.py"),
        },
    }
    report = runner._compare(runs, rechecks, ["f.py", "g.py"])
    assert [e["test"] for e in report["regressions"]] == ["f.py::real"]
    assert [e["test"] for e in report["not_reproduced"]] == ["f.py::flaky"]
    assert [(e["test"], e["reason"]) for e in report["allowlisted"]] == [
        ("f.py::identity", "checks type() is")
    ]
    assert [e["test"] for e in report["pass_only_in_B"]] == ["f.py::fixed"]
    assert [e["test"] for e in report["not_passing_either_way"]] == ["f.py::hub"]
    # g.py did not complete in A; its whole-file recheck did, both ways, and stands in for it
    assert report["incomplete_files"] == []
    assert report["per_file"]["g.py"]["A"]["passed"] == 1
    assert report["per_file"]["g.py"]["B"]["passed"] == 1


def test_compare_reports_files_that_never_complete() -> None:
    runner = _runner()
    runs = {
        "A": {"g.py": _result({}, "g.py", complete=False)},
        "B": {"g.py": _result({"g.py::t": "passed"}, "g.py")},
    }
    again = {"A": {"g.py": _result({}, "g.py", complete=False)}, "B": {"g.py": runs["B"]["g.py"]}}
    report = runner._compare(runs, again, ["g.py"])
    assert [e["file"] for e in report["incomplete_files"]] == ["g.py"]
    assert report["regressions"] == []
