"""The interpreter-start hook behind ``MMPACK_INSTALL=1``.

The wheel installs ``mmpack_startup.pth`` and this module at the root of site-packages; Python
runs the ``.pth`` line at every interpreter start, and it imports this module only when
``MMPACK_INSTALL`` is set and not one of ``0``, ``false``, ``no``, ``off`` (any case). Passed on
through Ray's ``runtime_env`` (``{"env_vars": {"MMPACK_INSTALL": "1"}}``), the variable reaches
every worker process Ray starts, before any of NeMo-RL's code runs there.

The module lives outside the ``mmpack`` package and imports only ``sys``: the variable reaches
every interpreter the environment starts, most of which never load NeMo-RL, so importing mmpack
(or torch, or NeMo-RL, which could also be found before the worker's ``sys.path`` is complete)
here would slow every start down. It only waits: when ``nemo_rl.data.multimodal_utils`` is
imported, ``mmpack.compat.nemo_rl.install()`` runs right after the module's own code, before
the importer sees it. A mere lookup (``importlib.util.find_spec``) leaves it waiting. The
object-store path (``mmpack.packed.ray_store``) reads the same variable when it is first
imported.
"""

from __future__ import annotations

import sys

# not ``typing``: importing it would take most of the hook's start-up time
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

__all__ = ["TARGET", "arm"]

#: The module whose import triggers ``install()``.
TARGET = "nemo_rl.data.multimodal_utils"


def _install() -> None:
    from mmpack.compat.nemo_rl import install

    install()


class _InstallAfter:
    """Runs the real loader, then ``install()``; anything else is the real loader's."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.loader.exec_module(module)
        _disarm()  # the class is patched for the process: once
        _install()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


class _Finder:
    """Finds nothing itself: wraps the loader the other finders give for :data:`TARGET`. It
    stays armed until the module is executed, not merely looked up."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != TARGET:
            return None
        # the other finders, in order, as the import system asks them (asking it again would
        # come back here)
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            if finder is self or isinstance(finder, _Finder) or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and not isinstance(spec.loader, _InstallAfter):
                    spec.loader = _InstallAfter(spec.loader)
                return spec
        return None


def _disarm() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _Finder)]


def arm() -> None:
    """``install()`` now if NeMo-RL's module is loaded, else right after it is."""
    if TARGET in sys.modules:
        _install()
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


arm()
