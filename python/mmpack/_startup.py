"""The interpreter-start hook behind ``MMPACK_INSTALL=1``.

The wheel installs ``mmpack_startup.pth`` into site-packages; Python runs its one line at every
interpreter start, and it imports this module only when ``MMPACK_INSTALL`` is set and not one
of ``0``, ``false``, ``no``, ``off`` (any case). Passed on through Ray's ``runtime_env``
(``{"env_vars": {"MMPACK_INSTALL": "1"}}``), the variable reaches every worker process Ray
starts, before any of NeMo-RL's code runs there.

Importing NeMo-RL (and torch) at interpreter start would slow every process down and could find
NeMo-RL before the worker's ``sys.path`` is complete, so this module only waits: when
``nemo_rl.data.multimodal_utils`` is imported, ``mmpack.compat.nemo_rl.install()`` runs right
after the module's own code, before the importer sees it. The object-store path
(``mmpack.packed.ray_store``) reads the same variable when it is first imported.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Sequence

__all__ = ["TARGET", "arm"]

#: The module whose import triggers ``install()``.
TARGET = "nemo_rl.data.multimodal_utils"


def _install() -> None:
    from mmpack.compat.nemo_rl import install

    install()


class _InstallAfter(importlib.abc.Loader):
    """Runs the real loader, then ``install()``."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self.loader.exec_module(module)
        _install()


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader the other finders give for :data:`TARGET`."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != TARGET:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)  # once: the class is patched for the process
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _InstallAfter(spec.loader)
        return spec


def arm() -> None:
    """``install()`` now if NeMo-RL's module is loaded, else right after it is."""
    if TARGET in sys.modules:
        _install()
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


arm()
