"""Module paths of earlier releases, kept importable with a ``DeprecationWarning`` naming the new
one. One table: an old path imports as the very module object of its new path (so ``isinstance``,
monkeypatching and pickles see one module). Development code that left the package (the demo,
the synthetic dataset writer, the Energon test helpers) fails with a message that says where it
went."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType

__all__ = ["MOVED", "MOVED_NAMES", "REMOVED", "install_finder", "moved_name"]

#: old module path -> new module path
MOVED: dict[str, str] = {
    "mmpack.masks": "mmpack.batch.masks",
    "mmpack.padded_batch": "mmpack.batch.padded",
    "mmpack.ranks": "mmpack.packing.ranks",
    "mmpack.pack_stats": "mmpack.packing.stats_cli",
    "mmpack.payload": "mmpack.packed.payload",
    "mmpack.compat.safe_unpickle": "mmpack.safe_load",
    "mmpack.compat.nemo_rl_packing": "mmpack.compat.nemo_rl.packing",
    "mmpack.compat.nemo_rl_batched": "mmpack.compat.nemo_rl.batched",
    "mmpack.energon.conversation": "mmpack.energon.markup",
}

#: module -> {name: the module that holds it now}: names that moved out of a module that stays.
#: The module's ``__getattr__`` calls :func:`moved_name`, so a wing never imports the
#: integration that took its names (the import below is by name, from this root module).
MOVED_NAMES: dict[str, dict[str, str]] = {
    "mmpack.packing": dict.fromkeys(
        (
            "ConcatenativePacker",
            "FirstFitDecreasingPacker",
            "FirstFitShufflePacker",
            "ModifiedFirstFitDecreasingPacker",
            "PackingAlgorithm",
            "PackingMetrics",
            "SequencePacker",
            "get_packer",
        ),
        "mmpack.compat.nemo_rl.packing",
    ),
}

#: old module path -> where it went (not part of the installed package any more)
REMOVED: dict[str, str] = {
    "mmpack.demos": "the development package mmpack_dev.demos (`make demo`)",
    "mmpack.energon.synthetic": "the development package mmpack_dev.synthetic",
    "mmpack.energon.testing": "the development package mmpack_dev.energon_testing",
}


def moved_name(module: str, name: str) -> object:
    """``module.name`` for a name that moved (with a ``DeprecationWarning`` naming its new
    module); ``AttributeError`` for any other name."""
    new = MOVED_NAMES.get(module, {}).get(name)
    if new is None:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    warnings.warn(
        f"{module}.{name} moved to {new}.{name}; import it from there (the old path will be "
        "removed in the next release)",
        DeprecationWarning,
        stacklevel=3,
    )
    value = getattr(importlib.import_module(new), name)
    # bound on the old module: warned once (``from m import n`` looks the name up twice)
    setattr(sys.modules[module], name, value)
    return value


class _Alias(importlib.abc.Loader):
    def __init__(self, new: str) -> None:
        self.new = new
        self.spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(
            f"{spec.name} moved to {self.new}; import it from there (the old path will be "
            "removed in the next release)",
            DeprecationWarning,
            stacklevel=2,
        )
        module = importlib.import_module(self.new)
        self.spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the new module is already imported. The import machinery has just set
        its ``__spec__`` to the alias's; give it back its own (``importlib.reload`` and
        ``importlib.resources`` read it)."""
        module.__spec__ = self.spec


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        new = MOVED.get(fullname)
        if new is not None:
            return importlib.util.spec_from_loader(fullname, _Alias(new))
        gone = REMOVED.get(fullname)
        if gone is not None:
            raise ModuleNotFoundError(
                f"{fullname} is not part of the mmpack package any more: it moved to {gone}, "
                "which lives in mmpack's source tree (dev/), not in the wheel",
                name=fullname,
            )
        return None


def install_finder() -> None:
    """Serve the old paths (once per process; after the regular finders)."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedFinder())
