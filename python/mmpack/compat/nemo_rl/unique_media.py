"""NeMo-RL's ``BatchedDataDict.get_multimodal_dict`` with unique media, opt-in.

``install(unique_media=True)`` sets this version on ``BatchedDataDict``: where NeMo-RL returns
``PackedTensor.as_tensor(device)`` for every packed key (each row's own copy of its media), it
returns ``PackedTensor.unique_segments(device)``, each unique segment once with the index of its
occurrences, for a model adapted by ``mmpack.vision.encode_once`` (NeMo-RL's policy workers
pass the dict to the model as keyword arguments, unchanged). A call can choose for itself with
``unique=True`` / ``unique=False``; ``as_tensors=False`` is NeMo-RL's, always. Everything else
(``pixel_dtype``, the optional plain-tensor keys) is NeMo-RL's own code: this version asks
NeMo-RL for the packed values and only changes how they are materialized, after NeMo-RL's
coupled-key check (the same error and message).

A model that was not adapted and receives unique media fails on its first tensor call with
``mmpack.errors.UnadaptedModelError``, so a forgotten ``encode_once`` never trains on rows
without their images.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

from mmpack.compat.nemo_rl.batched import BATCHED_DATA_DICT_MODULE
from mmpack.packed.value import PackedTensor

__all__ = ["configure", "unique_get_multimodal_dict", "unique_media_default"]


class _Mode:
    default = False


def configure(on: bool) -> None:
    """Whether ``get_multimodal_dict(as_tensors=True)`` gives unique media by default."""
    if not isinstance(on, bool):
        raise TypeError(f"unique_media must be a bool, got {on!r}")
    _Mode.default = on


def unique_media_default() -> bool:
    return _Mode.default


def unique_get_multimodal_dict(original: Any) -> Any:
    """NeMo-RL's method ``original`` with a keyword-only ``unique`` (default: the mode)."""

    @functools.wraps(original)
    def get_multimodal_dict(
        self: Any,
        as_tensors: bool = False,
        device: Any = None,
        *args: Any,
        unique: bool | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        if unique is None:
            unique = _Mode.default
        if not (as_tensors and unique):
            return original(self, as_tensors, device, *args, **kwargs)
        _check_coupled_keys(self.data)
        packed = original(self, False, None, *args, **kwargs)
        return {
            key: value.unique_segments(device) if isinstance(value, PackedTensor) else value
            for key, value in packed.items()
        }

    return get_multimodal_dict


def _check_coupled_keys(data: Any) -> None:
    """NeMo-RL's check of its ``as_tensors=True`` path (same error, same message): a media key
    and its metadata key (``pixel_values`` / ``image_grid_thw`` ...) have the same segment count
    in every row."""
    module = sys.modules.get(BATCHED_DATA_DICT_MODULE)
    for value_key, metadata_key in getattr(module, "_COUPLED_MULTIMODAL_KEYS", ()):
        value, metadata = data.get(value_key), data.get(metadata_key)
        if not (isinstance(value, PackedTensor) and isinstance(metadata, PackedTensor)):
            continue
        value_counts = value.logical_segment_counts_by_row()
        metadata_counts = metadata.logical_segment_counts_by_row()
        if value_counts != metadata_counts:
            raise ValueError(
                "Coupled multimodal keys must have the same ordered per-row segment counts, "
                f"but {value_key!r} has {value_counts} and {metadata_key!r} has "
                f"{metadata_counts}."
            )
