"""The NeMo-RL integration: mmpack's ``PackedTensor`` in NeMo-RL, its packer API, and reading
NeMo-RL's pickles safely.

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
hot ``BatchedDataDict`` methods (``repeat_interleave``, ``shard_by_batch_size``, ``from_batches``:
``mmpack.compat.nemo_rl.batched``), torch's pickling of plain tensors while Ray serializes
them (out-of-band bytes: ``mmpack.compat.nemo_rl.ray_tensors``) and
``batched_message_log_to_flat_message`` (``mmpack.compat.nemo_rl.flat_messages``) with faster
ones that give the same results and fall back to NeMo-RL's own outside their fast paths;
``accelerated()`` tells whether they are in place.

``loads(data)`` / ``load(file)`` read pickles written by NeMo-RL (``pickle``, ``cloudpickle`` or
``torch.save``) into mmpack objects, without ``nemo_rl`` installed and without ``install()``,
through a restricted unpickler that admits only what a PackedTensor payload needs (the
restricted loader, ``mmpack.safe_load``, re-exported here): any other global raises
:class:`mmpack.errors.UnsafePickleError`, undecodable bytes raise
:class:`mmpack.errors.CorruptPickleError`, and a payload that needs more memory than
``max_bytes=`` (default 32 times its size plus 64 MiB) raises
:class:`mmpack.errors.PickleTooLargeError`.

Rooms: ``install`` (``install`` / ``uninstall`` / ``installed`` / ``accelerated``), ``packing``
(NeMo-RL's packer API over ``mmpack.packing``), ``batched``, ``ray_tensors``, ``flat_messages``
and ``deepcopy`` (the accelerations).
"""

from mmpack.compat.nemo_rl.install import (
    NEMO_RL_CLASS_PATH,
    accelerated,
    install,
    installed,
    uninstall,
)
from mmpack.safe_load import load, loads

__all__ = [
    "NEMO_RL_CLASS_PATH",
    "accelerated",
    "install",
    "installed",
    "load",
    "loads",
    "uninstall",
]
