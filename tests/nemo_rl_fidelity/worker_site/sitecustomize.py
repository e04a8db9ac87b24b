"""Put mmpack's PackedTensor into NeMo-RL in every Python process started with this directory
on PYTHONPATH, which is how ``mmpack_plugin`` reaches Ray's worker processes: tests run actors
whose code builds PackedTensors, and those must be mmpack's too for the comparison to hold.

Nothing is imported at startup (Ray's own helper processes run this too): a finder waits for
``nemo_rl.data.multimodal_utils`` to be imported and calls ``mmpack.compat.nemo_rl.install()``
right after the module has run, before anything can import the class from it. A failure to
install raises in that import, so it shows in the test that needed the module.

With ``MMPACK_NEMO_RL_PLACEMENT`` set (``run_fidelity.py --accelerate --placement P``) the process
also gets ``install(accelerate=True, placement=P)``: NeMo-RL's workers shard batches too
(``shard_by_batch_size(shards=1, ...)`` on a rank's slice), and that run compares a placement,
which must then be the same in every process. ``install(accelerate=True)`` reads attributes of
``nemo_rl.distributed.batched_data_dict`` and ``nemo_rl.data.llm_message_utils``, and
``batched_data_dict`` imports ``multimodal_utils`` at its top, so the acceleration waits until
both modules have run to their end (the second one is imported for it if nothing else does);
calling it from the ``multimodal_utils`` hook would find ``batched_data_dict`` half-initialised.
Without the variable, the plain ``install()``: any mmpack version in the venv works.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
from collections.abc import Sequence
from typing import Any

_TARGET = "nemo_rl.data.multimodal_utils"
# Set by run_fidelity.py --placement (with --accelerate): this process accelerates too.
_PLACEMENT = os.environ.get("MMPACK_NEMO_RL_PLACEMENT") or None
# The modules install(accelerate=True) reads; the acceleration waits for both to have run.
_BATCHED = "nemo_rl.distributed.batched_data_dict"
_MESSAGES = "nemo_rl.data.llm_message_utils"
_TARGETS = frozenset({_TARGET, _BATCHED, _MESSAGES} if _PLACEMENT else {_TARGET})
_EXECUTED: set[str] = set()


class _InstallAfterExec(importlib.abc.Loader):
    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self._loader.exec_module(module)
        _EXECUTED.add(module.__name__)
        if module.__name__ == _TARGET:
            from mmpack.compat import nemo_rl

            mode = nemo_rl.install()
            if mode != "patched":
                raise ImportError(
                    f"mmpack.compat.nemo_rl.install() returned {mode!r}, not 'patched'"
                )
        else:
            _accelerate_when_ready()

    def __getattr__(self, name: str) -> Any:
        # get_source, get_filename, ...: what inspect and tracebacks ask the loader for
        return getattr(self._loader, name)


def _accelerate_when_ready() -> None:
    if _BATCHED not in _EXECUTED:
        return  # the hook after batched_data_dict comes back here
    if _MESSAGES not in _EXECUTED:
        if _MESSAGES not in sys.modules:
            # its hook, once it has run, does the rest
            importlib.import_module(_MESSAGES)
        # otherwise it is importing batched_data_dict: its own hook follows
        return
    from mmpack.compat import nemo_rl

    assert _PLACEMENT is not None  # the only case that watches these modules
    if not nemo_rl.accelerated():
        nemo_rl.install(accelerate=True, placement=_PLACEMENT)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _TARGETS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _InstallAfterExec(spec.loader)
                return spec
        return None


def _run_shadowed_sitecustomize() -> None:
    # Python imports one sitecustomize; this one must not hide the interpreter's own.
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        if os.path.abspath(entry or os.curdir) == here:
            continue
        candidate = os.path.join(entry or os.curdir, "sitecustomize.py")
        if os.path.isfile(candidate):
            spec = importlib.util.spec_from_file_location("_shadowed_sitecustomize", candidate)
            if spec is not None and spec.loader is not None:
                spec.loader.exec_module(importlib.util.module_from_spec(spec))
            return


if not _TARGETS.intersection(sys.modules):
    sys.meta_path.insert(0, _Finder())
_run_shadowed_sitecustomize()
