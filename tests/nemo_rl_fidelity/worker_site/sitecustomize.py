"""Put mmpack's PackedTensor into NeMo-RL in every Python process started with this directory
on PYTHONPATH, which is how ``mmpack_plugin`` reaches Ray's worker processes: tests run actors
whose code builds PackedTensors, and those must be mmpack's too for the comparison to hold.

Nothing is imported at startup (Ray's own helper processes run this too): a finder waits for
``nemo_rl.data.multimodal_utils`` to be imported and calls ``mmpack.compat.nemo_rl.install()``
right after the module has run, before anything can import the class from it. A failure to
install raises in that import, so it shows in the test that needed the module.
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


class _InstallAfterExec(importlib.abc.Loader):
    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self._loader.exec_module(module)
        from mmpack.compat import nemo_rl

        mode = nemo_rl.install()
        if mode != "patched":
            raise ImportError(f"mmpack.compat.nemo_rl.install() returned {mode!r}, not 'patched'")

    def __getattr__(self, name: str) -> Any:
        # get_source, get_filename, ...: what inspect and tracebacks ask the loader for
        return getattr(self._loader, name)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != _TARGET:
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


if _TARGET not in sys.modules:
    sys.meta_path.insert(0, _Finder())
_run_shadowed_sitecustomize()
