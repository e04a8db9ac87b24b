"""The ``MMPACK_INSTALL=1`` start-up hook (``mmpack_startup.pth`` and ``mmpack_startup``), read
from a site directory in a fresh interpreter as an installed wheel is: it imports nothing of
mmpack at start, and ``install()`` runs when NeMo-RL's module is imported, whatever looked the
module up before."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SITE = ROOT / "python"  # holds mmpack_startup.pth, as site-packages does once the wheel is in


@pytest.fixture
def fake_nemo_rl(tmp_path: Path) -> Path:
    """A ``nemo_rl`` with its own PackedTensor class and a module importing it by name."""
    data = tmp_path / "nemo_rl" / "data"
    data.mkdir(parents=True)
    (tmp_path / "nemo_rl" / "__init__.py").write_text("")
    (data / "__init__.py").write_text("")
    (data / "multimodal_utils.py").write_text("class PackedTensor:\n    pass\n")
    (data / "user.py").write_text("from nemo_rl.data.multimodal_utils import PackedTensor\n")
    return tmp_path


def _run(code: str, fake: Path, install: str = "1") -> str:
    probe = "import site, sys; site.addsitedir(sys.argv[1]); del site\n" + textwrap.dedent(code)
    got = subprocess.run(
        [sys.executable, "-c", probe, str(SITE)],
        env=dict(os.environ, MMPACK_INSTALL=install, PYTHONPATH=str(fake)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert got.returncode == 0, got.stderr
    return got.stdout.strip()


def test_the_hook_imports_nothing_of_mmpack_at_start(fake_nemo_rl: Path) -> None:
    out = _run(
        """
        heavy = ("torch", "typing")
        print(sorted(m for m in sys.modules if m.startswith("mmpack") or m in heavy))
        """,
        fake_nemo_rl,
    )
    assert out == "['mmpack_startup']"


def test_a_lookup_before_the_import_still_installs(fake_nemo_rl: Path) -> None:
    out = _run(
        """
        import importlib.util
        # what a library does to see whether NeMo-RL is there, before anything imports it
        assert importlib.util.find_spec("nemo_rl.data.multimodal_utils") is not None
        assert importlib.util.find_spec("nemo_rl.data.multimodal_utils") is not None
        assert "mmpack" not in sys.modules
        import nemo_rl.data.user as user
        import nemo_rl.data.multimodal_utils as mm
        import mmpack
        print(user.PackedTensor is mmpack.PackedTensor, mm.PackedTensor is mmpack.PackedTensor)
        """,
        fake_nemo_rl,
    )
    assert out == "True True"


def test_the_hook_disarms_once_installed_and_stays_off_when_unset(fake_nemo_rl: Path) -> None:
    out = _run(
        """
        import importlib, mmpack_startup
        import nemo_rl.data.multimodal_utils as mm
        armed = [f for f in sys.meta_path if type(f).__module__ == "mmpack_startup"]
        del sys.modules["nemo_rl.data.multimodal_utils"]
        again = importlib.import_module("nemo_rl.data.multimodal_utils")
        import mmpack
        ours = mmpack.PackedTensor
        print(len(armed), mm.PackedTensor is ours, again.PackedTensor is ours)
        """,
        fake_nemo_rl,
    )
    # a second, separate import of the module is NeMo-RL's own (install() patched the first)
    assert out == "0 True False"
    off = _run(
        """
        import nemo_rl.data.multimodal_utils as mm
        print("mmpack_startup" in sys.modules, "mmpack" in sys.modules)
        """,
        fake_nemo_rl,
        install="0",
    )
    assert off == "False False"
