"""``install()`` / ``uninstall()``: make NeMo-RL's ``PackedTensor`` be mmpack's, in a running
process (see ``mmpack.compat.nemo_rl`` for what each mode does)."""

from __future__ import annotations

import importlib
import sys
import threading
import types
from typing import Any

from mmpack.packing.placement import PlacementCost
from mmpack.safe_load.loader import NEMO_RL_MODULE

__all__ = [
    "NEMO_RL_CLASS_PATH",
    "accelerated",
    "install",
    "installed",
    "uninstall",
]

NEMO_RL_CLASS_PATH = f"{NEMO_RL_MODULE}.PackedTensor"


# install() and uninstall() patch and restore in steps: two threads must not interleave them
_LOCK = threading.Lock()


class _InstallState:
    mode: str | None = None
    store_was_on: bool = False
    accelerated: bool = False
    unique_method: bool = False
    # (module or class, attribute name, previous value)
    patched: list[tuple[types.ModuleType | type, str, Any]] = []  # noqa: RUF012
    shim_modules: list[str] = []  # noqa: RUF012
    # (replacement, original, module prefix): a module under the prefix that imported the
    # replacement by name after install() gets the original back at uninstall() too
    rebinds: list[tuple[Any, Any, str]] = []  # noqa: RUF012


def installed() -> str | None:
    """``"patched"`` or ``"shim"`` while ``install()`` is in effect, else ``None``."""
    return _InstallState.mode


def accelerated() -> bool:
    """Whether ``install(accelerate=True)`` replaced NeMo-RL's ``BatchedDataDict`` methods and
    its message-log flatten."""
    return _InstallState.accelerated


def install(
    *,
    accelerate: bool = False,
    placement: str = "groups",
    placement_cost: PlacementCost | None = None,
    unique_media: bool | None = None,
) -> str:
    """Make NeMo-RL use ``mmpack.PackedTensor``; return ``"patched"`` or ``"shim"``.

    It also turns on the object-store path (``mmpack.packed.ray_store``): a value Ray
    serializes puts each unique media segment into the object store once and carries
    references; the receiver reads them in place. Plain pickles are unchanged.

    ``accelerate=True`` also sets mmpack's versions of NeMo-RL's hot ``BatchedDataDict`` methods
    (``mmpack.compat.nemo_rl.batched``), a tensor reduction for Ray, which sends plain tensors
    as out-of-band bytes (``mmpack.compat.nemo_rl.ray_tensors``; every receiving process needs
    mmpack), and ``batched_message_log_to_flat_message``
    (``mmpack.compat.nemo_rl.flat_messages``, rebound in every module that imported it by
    name); it needs NeMo-RL's ``batched_data_dict`` and ``llm_message_utils`` modules to import,
    and raises ``ImportError`` naming the one that did not.

    ``placement`` (with ``accelerate=True``): how ``shard_by_batch_size`` with sequence packing
    or dynamic batching places rows on the data-parallel ranks. ``"groups"`` (the default) keeps
    the rows that share media (a GRPO prompt's G rows) on one rank where balance allows, by
    ``placement_cost`` (``mmpack.packing.PlacementCost``: tokens, attention, vision patches):
    each row stays in its global batch and the loss summed over ranks is unchanged, but rows
    move between ranks and micro-batches (``mmpack.compat.nemo_rl.placement``). ``"nemo_rl"``
    keeps NeMo-RL's placement exactly.

    ``unique_media=True``: ``BatchedDataDict.get_multimodal_dict(as_tensors=True)`` gives each
    packed key as ``UniqueSegments`` (each unique segment once, and the index of its
    occurrences) instead of every row's own copy, for a model adapted by
    ``mmpack.vision.encode_once`` (``mmpack.compat.nemo_rl.unique_media``); a call may choose
    with ``unique=``. ``accelerate=True`` sets the method too, off by default.

    Idempotent: a second call returns the mode of the first without doing anything, except that
    ``accelerate=True`` adds the methods if the first call did not, and it sets the placement
    and ``unique_media`` arguments it is given. Thread-safe.
    """
    from mmpack.compat.nemo_rl import unique_media as unique
    from mmpack.compat.nemo_rl.placement import configure

    with _LOCK:
        if accelerate:
            configure(placement, placement_cost)  # checks them before anything changes
        if unique_media:
            _batched_data_dict_module()  # a failure changes nothing
        if unique_media is not None:
            unique.configure(unique_media)
        mode = _install(accelerate)
        if (accelerate or unique_media) and not _InstallState.unique_method:
            _install_unique_method(required=bool(unique_media))
        return mode


def _install_unique_method(*, required: bool) -> None:
    from mmpack.compat.nemo_rl.unique_media import unique_get_multimodal_dict

    batched, _ = _batched_data_dict_module()
    cls = batched.BatchedDataDict
    original = cls.__dict__.get("get_multimodal_dict")
    if original is None:  # a NeMo-RL from before multimodal batches
        if required:
            raise ImportError("NeMo-RL's BatchedDataDict has no get_multimodal_dict to extend")
        return
    _set(cls, "get_multimodal_dict", unique_get_multimodal_dict(original))
    _InstallState.unique_method = True


def _install(accelerate: bool) -> str:
    # Import NeMo-RL's module before changing anything, so that a failure changes nothing.
    batched = _batched_data_dict_module() if accelerate and not _InstallState.accelerated else None
    if _InstallState.mode is None:
        _install_class()
        from mmpack.packed import ray_store

        # Values Ray serializes put each unique media segment into the object store once.
        _InstallState.store_was_on = ray_store.enabled()
        ray_store.enable(True)
    if batched is not None:
        import torch

        from mmpack.compat.nemo_rl.batched import accelerated_methods
        from mmpack.compat.nemo_rl.flat_messages import accelerated_flatten
        from mmpack.compat.nemo_rl.ray_tensors import accelerated_tensor_reduce

        batched_module, messages_module = batched
        cls = batched_module.BatchedDataDict
        for name, method in accelerated_methods(cls).items():
            _set(cls, name, method)
        torch_reduce = torch.Tensor.__dict__["__reduce_ex__"]
        _set(torch.Tensor, "__reduce_ex__", accelerated_tensor_reduce(torch_reduce))
        name = "batched_message_log_to_flat_message"
        original = getattr(messages_module, name)
        flatten = accelerated_flatten(original)
        _set_everywhere(messages_module, name, original, flatten)
        _InstallState.rebinds.append((flatten, original, ""))
        _InstallState.accelerated = True
    assert _InstallState.mode is not None
    return _InstallState.mode


def _batched_data_dict_module() -> tuple[types.ModuleType, types.ModuleType]:
    """NeMo-RL's ``batched_data_dict`` and ``llm_message_utils`` modules."""
    from mmpack.compat.nemo_rl.batched import BATCHED_DATA_DICT_MODULE
    from mmpack.compat.nemo_rl.flat_messages import LLM_MESSAGE_UTILS_MODULE

    if _InstallState.mode == "shim":
        raise ImportError(
            f"install(accelerate=True) needs NeMo-RL, and {NEMO_RL_MODULE} is mmpack's shim"
        )
    modules = []
    for name in (BATCHED_DATA_DICT_MODULE, LLM_MESSAGE_UTILS_MODULE):
        try:
            modules.append(importlib.import_module(name))
        except ImportError as exc:
            raise ImportError(
                f"install(accelerate=True) needs NeMo-RL's {name}, which did not import: {exc}"
            ) from exc
    return modules[0], modules[1]


def _install_class() -> None:
    from mmpack.packed.value import PackedTensor as ours

    try:
        module = importlib.import_module(NEMO_RL_MODULE)
    except ImportError:
        module = None
    if module is not None:
        original = getattr(module, "PackedTensor", None)
        _set_everywhere(module, "PackedTensor", original, ours)
        if original is not None:
            # only NeMo-RL's own modules: mmpack's, and a user's import of mmpack's, keep it
            _InstallState.rebinds.append((ours, original, "nemo_rl."))
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


def _set_everywhere(module: types.ModuleType, name: str, original: Any, replacement: Any) -> None:
    """Set ``module.name`` to ``replacement``, and rebind every already-imported module's
    attribute that *is* ``original`` (``from module import name`` copies)."""
    _set(module, name, replacement)
    if original is None or original is replacement:
        return
    for other in list(sys.modules.values()):
        if not isinstance(other, types.ModuleType) or other is module:
            continue
        namespace = getattr(other, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for attr, value in list(namespace.items()):
            if value is original:
                _set(other, attr, replacement)


def _rebind_everywhere(replacement: Any, original: Any, prefix: str) -> None:
    """Set the attributes that *are* ``replacement`` back to ``original``, in every imported
    module whose name starts with ``prefix``."""
    for name, module in list(sys.modules.items()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(module, types.ModuleType) or not isinstance(namespace, dict):
            continue
        if not name.startswith(prefix):
            continue
        for attr, value in list(namespace.items()):
            if value is replacement:
                setattr(module, attr, original)


def _set(owner: types.ModuleType | type, name: str, value: Any) -> None:
    """Set ``owner.name`` (a module's or a class's own attribute), remembering what it was."""
    _InstallState.patched.append((owner, name, owner.__dict__.get(name, _MISSING)))
    setattr(owner, name, value)


def uninstall() -> None:
    """Undo ``install()``: restore every patched attribute and drop the shim modules."""
    with _LOCK:
        _uninstall()


def _uninstall() -> None:
    if _InstallState.mode is not None:
        from mmpack.packed import ray_store

        ray_store.enable(_InstallState.store_was_on)
    for owner, name, previous in reversed(_InstallState.patched):
        if previous is _MISSING:
            if name in owner.__dict__:
                delattr(owner, name)
        else:
            setattr(owner, name, previous)
    for replacement, original, prefix in _InstallState.rebinds:
        _rebind_everywhere(replacement, original, prefix)
    for name in reversed(_InstallState.shim_modules):
        sys.modules.pop(name, None)
    _InstallState.rebinds = []
    _InstallState.patched = []
    _InstallState.shim_modules = []
    _InstallState.mode = None
    _InstallState.accelerated = False
    _InstallState.unique_method = False
    from mmpack.compat.nemo_rl import unique_media
    from mmpack.compat.nemo_rl.placement import configure

    configure("groups", None)
    unique_media.configure(False)
