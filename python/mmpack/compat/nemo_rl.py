"""Drop mmpack's ``PackedTensor`` into NeMo-RL, and read NeMo-RL's pickles safely.

``install()`` makes ``nemo_rl.data.multimodal_utils.PackedTensor`` be ``mmpack.PackedTensor``:

* if ``nemo_rl`` is importable, the attribute is patched on ``nemo_rl.data.multimodal_utils``
  and in every already-imported module that did ``from nemo_rl.data.multimodal_utils import
  PackedTensor`` (any module attribute that *is* NeMo-RL's class is rebound), so existing code,
  ``isinstance`` checks and later imports all get mmpack's class, and pickles naming
  ``nemo_rl.data.multimodal_utils.PackedTensor`` load as mmpack objects;
* if it is not, a small shim package ``nemo_rl`` / ``nemo_rl.data`` /
  ``nemo_rl.data.multimodal_utils`` is registered in ``sys.modules`` (only the missing levels),
  exposing mmpack's class, so that the import line and ``pickle.load`` of NeMo-RL payloads work.

``install()`` returns which of the two it did (``"patched"`` or ``"shim"``); ``uninstall()``
undoes it. ``install(accelerate=True)`` (NeMo-RL installed, off by default) also replaces NeMo-RL's
hot ``BatchedDataDict`` methods with faster ones that give the same results (see
``mmpack.compat.nemo_rl_batched``); ``accelerated()`` tells whether they are in place.

``loads(data)`` / ``load(file)`` read pickles written by NeMo-RL (``pickle``, ``cloudpickle`` or
``torch.save``) into mmpack objects, without ``nemo_rl`` installed and without ``install()``,
through a restricted unpickler that admits only what a PackedTensor payload needs (see
``mmpack.compat.safe_unpickle``): any other global raises
:class:`mmpack.errors.UnsafePickleError`, undecodable bytes raise
:class:`mmpack.errors.CorruptPickleError`, and a payload that needs more memory than
``max_bytes=`` (default 32 times its size plus 64 MiB) raises
:class:`mmpack.errors.PickleTooLargeError`.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

from mmpack.compat import NEMO_RL_MODULE
from mmpack.compat.safe_unpickle import load, loads

__all__ = [
    "NEMO_RL_CLASS_PATH",
    "accelerated",
    "install",
    "installed",
    "load",
    "loads",
    "uninstall",
]

NEMO_RL_CLASS_PATH = f"{NEMO_RL_MODULE}.PackedTensor"


class _InstallState:
    mode: str | None = None
    accelerated: bool = False
    # (module or class, attribute name, previous value)
    patched: list[tuple[types.ModuleType | type, str, Any]] = []  # noqa: RUF012
    shim_modules: list[str] = []  # noqa: RUF012


def installed() -> str | None:
    """``"patched"`` or ``"shim"`` while ``install()`` is in effect, else ``None``."""
    return _InstallState.mode


def accelerated() -> bool:
    """Whether ``install(accelerate=True)`` replaced NeMo-RL's ``BatchedDataDict`` methods."""
    return _InstallState.accelerated


def install(*, accelerate: bool = False) -> str:
    """Make NeMo-RL use ``mmpack.PackedTensor``; return ``"patched"`` or ``"shim"``.

    ``accelerate=True`` also sets mmpack's versions of NeMo-RL's hot ``BatchedDataDict`` methods
    (``mmpack.compat.nemo_rl_batched``); it needs NeMo-RL's ``batched_data_dict`` module to
    import, and raises ``ImportError`` naming it otherwise.

    Idempotent: a second call returns the mode of the first without doing anything, except that
    ``accelerate=True`` adds the methods if the first call did not.
    """
    # Import NeMo-RL's module before changing anything, so that a failure changes nothing.
    batched = _batched_data_dict_module() if accelerate and not _InstallState.accelerated else None
    if _InstallState.mode is None:
        _install_class()
    if batched is not None:
        from mmpack.compat.nemo_rl_batched import accelerated_methods

        for name, method in accelerated_methods().items():
            _set(batched.BatchedDataDict, name, method)
        _InstallState.accelerated = True
    assert _InstallState.mode is not None
    return _InstallState.mode


def _batched_data_dict_module() -> types.ModuleType:
    from mmpack.compat.nemo_rl_batched import BATCHED_DATA_DICT_MODULE

    if _InstallState.mode == "shim":
        raise ImportError(
            f"install(accelerate=True) needs NeMo-RL, and {NEMO_RL_MODULE} is mmpack's shim"
        )
    try:
        return importlib.import_module(BATCHED_DATA_DICT_MODULE)
    except ImportError as exc:
        raise ImportError(
            f"install(accelerate=True) needs NeMo-RL's {BATCHED_DATA_DICT_MODULE}, which did "
            f"not import: {exc}"
        ) from exc


def _install_class() -> None:
    from mmpack.packed import PackedTensor as ours

    try:
        module = importlib.import_module(NEMO_RL_MODULE)
    except ImportError:
        module = None
    if module is not None:
        original = getattr(module, "PackedTensor", None)
        _set(module, "PackedTensor", ours)
        if original is not None and original is not ours:
            for other in list(sys.modules.values()):
                if not isinstance(other, types.ModuleType) or other is module:
                    continue
                namespace = getattr(other, "__dict__", None)
                if not isinstance(namespace, dict):
                    continue
                for name, value in list(namespace.items()):
                    if value is original:
                        _set(other, name, ours)
        _InstallState.mode = "patched"
        return

    parts = NEMO_RL_MODULE.split(".")
    for depth in range(1, len(parts) + 1):
        name = ".".join(parts[:depth])
        if name in sys.modules:
            continue
        shim = types.ModuleType(name, "mmpack shim standing in for NeMo-RL (mmpack.compat.nemo_rl)")
        if depth < len(parts):
            shim.__path__ = []
        sys.modules[name] = shim
        _InstallState.shim_modules.append(name)
        if depth > 1:
            _set(sys.modules[".".join(parts[: depth - 1])], parts[depth - 1], shim)
    _set(sys.modules[NEMO_RL_MODULE], "PackedTensor", ours)
    _InstallState.mode = "shim"


_MISSING = object()


def _set(owner: types.ModuleType | type, name: str, value: Any) -> None:
    """Set ``owner.name`` (a module's or a class's own attribute), remembering what it was."""
    _InstallState.patched.append((owner, name, owner.__dict__.get(name, _MISSING)))
    setattr(owner, name, value)


def uninstall() -> None:
    """Undo ``install()``: restore every patched attribute and drop the shim modules."""
    for owner, name, previous in reversed(_InstallState.patched):
        if previous is _MISSING:
            if name in owner.__dict__:
                delattr(owner, name)
        else:
            setattr(owner, name, previous)
    for name in reversed(_InstallState.shim_modules):
        sys.modules.pop(name, None)
    _InstallState.patched = []
    _InstallState.shim_modules = []
    _InstallState.mode = None
    _InstallState.accelerated = False
