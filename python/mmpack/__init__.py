"""mmpack: deduplicated multimodal media and packed token sequences, with a Rust core.

Submodules: ``mmpack.packing``, ``mmpack.masks``, ``mmpack.batch``, ``mmpack.padded_batch``,
``mmpack.payload``, ``mmpack.energon``, ``mmpack.compat.nemo_rl``. ``PackedTensor`` needs torch
and is imported on first use, so packing and masks work with numpy alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mmpack._native import __version__

if TYPE_CHECKING:
    from mmpack.packed import PackedTensor

__all__ = ["PackedTensor", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "PackedTensor":
        from mmpack import _pickle_operation

        # not ``from mmpack.packed import``: only a pickler's own lookup may reach the module
        return _pickle_operation.packed_class()
    raise AttributeError(f"module 'mmpack' has no attribute {name!r}")
