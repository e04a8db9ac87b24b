"""mmpack: deduplicated multimodal media and packed token sequences, with a Rust core.

Wings (one folder each): ``mmpack.packed`` (``PackedTensor``, its pickle format, gather,
transfer, payload sizes), ``mmpack.packing`` (bin packing, rank assignment), ``mmpack.batch``
(encoded samples, THD and padded batches, field rules, loss masks). Integrations:
``mmpack.energon`` (task-encoder hooks), ``mmpack.compat.nemo_rl`` (NeMo-RL). The restricted
loader: ``mmpack.safe_load``. Errors: ``mmpack.errors``. Dependencies point one way: wings never
import an integration. ``PackedTensor`` needs torch and is imported on first use, so packing and
masks work with numpy alone. Module paths of earlier releases still import, with a
``DeprecationWarning`` (``mmpack._moved``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mmpack._moved import install_finder
from mmpack._native import __version__

install_finder()

if TYPE_CHECKING:
    from mmpack.packed.value import PackedTensor

__all__ = ["PackedTensor", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "PackedTensor":
        # from the class's room: a lookup on ``mmpack.packed`` may start a pickling operation
        # (``mmpack.packed.pickling.operation_start``)
        from mmpack.packed.value import PackedTensor

        return PackedTensor
    raise AttributeError(f"module 'mmpack' has no attribute {name!r}")
