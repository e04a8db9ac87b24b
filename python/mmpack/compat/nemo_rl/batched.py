"""Faster versions of NeMo-RL's hot ``BatchedDataDict`` methods, with the same results.

Opt-in: ``mmpack.compat.nemo_rl.install(accelerate=True)`` sets them on
``nemo_rl.distributed.batched_data_dict.BatchedDataDict`` (``uninstall()`` restores NeMo-RL's).
Each one keeps NeMo-RL's signature, result (values, types, key order, sharing between rows) and
errors; only the time changes:

* ``repeat_interleave``: GRPO's G-expansion deep-copies every prompt row G times. The copies are
  made by ``mmpack.compat.nemo_rl.deepcopy.deepcopy`` (``copy.deepcopy``'s result, with plain
  CPU tensors cloned instead of going through ``Tensor.__deepcopy__``), with NeMo-RL's own sharing
  of immutable media (``_prepare_multimodal_sharing``).
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from mmpack.compat.nemo_rl.deepcopy import deepcopy

__all__ = ["BATCHED_DATA_DICT_MODULE", "accelerated_methods"]

BATCHED_DATA_DICT_MODULE = "nemo_rl.distributed.batched_data_dict"


def accelerated_methods() -> dict[str, Any]:
    """The methods to set on NeMo-RL's ``BatchedDataDict``, by name."""
    return {"repeat_interleave": repeat_interleave}


def _nemo_rl() -> Any:
    return importlib.import_module(BATCHED_DATA_DICT_MODULE)


def repeat_interleave(self: Any, num_repeats: int, *, share_immutable_media: bool = False) -> Any:
    """NeMo-RL's ``BatchedDataDict.repeat_interleave``: every row ``num_repeats`` times in place
    order; tensors with ``Tensor.repeat_interleave``, other values by deep copies (sharing only
    the explicit multimodal leaves with ``share_immutable_media``)."""
    module = _nemo_rl()
    packed_cls = module.PackedTensor
    media_keys = module.NATIVE_MULTIMODAL_KEYS
    prepare = module._prepare_multimodal_sharing
    repeated = type(self)()
    for key, value in self.data.items():
        if torch.is_tensor(value):
            repeated[key] = value.repeat_interleave(num_repeats, dim=0)
        elif isinstance(value, packed_cls):
            raise NotImplementedError("PackedTensor does not currently support repeat_interleave")
        else:
            rows: list[Any] = []
            for item in value:
                shared = (
                    prepare(item, media_context=key in media_keys) if share_immutable_media else {}
                )
                rows.extend(deepcopy(item, dict(shared)) for _ in range(num_repeats))
            repeated[key] = rows
    return repeated
