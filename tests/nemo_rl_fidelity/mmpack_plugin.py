"""pytest plugin (load with ``-p mmpack_plugin``) that puts mmpack's PackedTensor into NeMo-RL.

The patch goes in as early as pytest lets a plugin act, before the initial conftests (a NeMo-RL
conftest imports ``nemo_rl`` at its top) and before any test module is imported, so every
``from nemo_rl.data.multimodal_utils import PackedTensor`` binds mmpack's class. The
``worker_site`` directory is put on PYTHONPATH for the processes the tests start (Ray's workers
inherit it), where its ``sitecustomize`` does the same on their first import of NeMo-RL.

``pytest_configure`` checks the result: the run must import the real NeMo-RL, since with a shim
the comparison would not test what it claims, so anything but ``"patched"`` stops the session.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

WORKER_SITE = Path(__file__).resolve().parent / "worker_site"
# Set by run_fidelity.py --accelerate: mmpack's BatchedDataDict methods go in too.
ACCELERATE = os.environ.get("MMPACK_NEMO_RL_ACCELERATE") == "1"
# Set by run_fidelity.py --placement (with --accelerate): where shard_by_batch_size puts rows.
PLACEMENT = os.environ.get("MMPACK_NEMO_RL_PLACEMENT") or None

_MODE = pytest.StashKey[str]()


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config) -> None:
    from mmpack.compat import nemo_rl

    entries = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(WORKER_SITE) not in entries:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(WORKER_SITE), *entries])
    _install(nemo_rl)


def _install(nemo_rl: Any) -> str:
    # Each option only when asked for: the plain calls work with any mmpack version in the venv
    # (``placement=`` is newer than ``accelerate=``).
    if not ACCELERATE:
        return str(nemo_rl.install())
    if PLACEMENT is None:
        return str(nemo_rl.install(accelerate=True))
    return str(nemo_rl.install(accelerate=True, placement=PLACEMENT))


def pytest_configure(config: pytest.Config) -> None:
    import mmpack
    from mmpack.compat import nemo_rl

    # Idempotent: returns the mode of the early install.
    mode = _install(nemo_rl)
    assert mode == "patched", f"mmpack.compat.nemo_rl.install() returned {mode!r}, not 'patched'"
    if ACCELERATE:
        assert nemo_rl.accelerated()

    from nemo_rl.data import multimodal_utils

    assert multimodal_utils.PackedTensor is mmpack.PackedTensor
    config.stash[_MODE] = mode


def pytest_report_header(config: pytest.Config) -> str:
    import mmpack

    version = getattr(mmpack, "__version__", "?")
    return f"mmpack {version} ({mmpack.__file__}): NeMo-RL PackedTensor {config.stash[_MODE]}"
