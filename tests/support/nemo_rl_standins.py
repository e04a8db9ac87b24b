"""Stand-ins for NeMo-RL's modules in ``sys.modules`` (NeMo-RL needs a newer Python than this
suite runs on): ``nemo_rl.data.multimodal_utils``, ``nemo_rl.distributed.batched_data_dict`` and
``nemo_rl.data.llm_message_utils``, holding the plain versions of ``support.nemo_rl_reference``,
for the tests of ``install(accelerate=True)``."""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator

from mmpack.compat import nemo_rl as compat
from mmpack.compat.nemo_rl.packing import get_packer

from support.nemo_rl_reference import (
    COUPLED_MULTIMODAL_KEYS,
    MEDIA_KEYS,
    ReferenceBatchedDataDict,
    ReferenceSlicedDataDict,
    prepare_sharing,
    reference_flatten,
)


class NemoPackedTensor:
    """Stands for NeMo-RL's class until ``install()`` replaces it."""


@contextlib.contextmanager
def installed_standins() -> Iterator[types.ModuleType]:
    """The stand-in NeMo-RL modules in ``sys.modules``, nothing installed; undone after."""
    names = ["nemo_rl", "nemo_rl.data", "nemo_rl.data.multimodal_utils", "nemo_rl.distributed"]
    names += ["nemo_rl.distributed.batched_data_dict", "nemo_rl.data.llm_message_utils"]
    saved = {name: sys.modules.get(name) for name in names}
    modules = {name: types.ModuleType(name) for name in names}
    for name in names[:2] + names[3:4]:
        modules[name].__path__ = []  # type: ignore[attr-defined]
    modules["nemo_rl.data.multimodal_utils"].PackedTensor = NemoPackedTensor  # type: ignore[attr-defined]
    batched = modules["nemo_rl.distributed.batched_data_dict"]
    batched.PackedTensor = NemoPackedTensor  # type: ignore[attr-defined]
    batched.NATIVE_MULTIMODAL_KEYS = MEDIA_KEYS  # type: ignore[attr-defined]
    batched._COUPLED_MULTIMODAL_KEYS = COUPLED_MULTIMODAL_KEYS  # type: ignore[attr-defined]
    batched._prepare_multimodal_sharing = prepare_sharing  # type: ignore[attr-defined]
    ReferenceBatchedDataDict.repeat_interleave = ReferenceBatchedDataDict.__dict__[
        "repeat_interleave"
    ]
    batched.BatchedDataDict = ReferenceBatchedDataDict  # type: ignore[attr-defined]
    batched.SlicedDataDict = ReferenceSlicedDataDict  # type: ignore[attr-defined]
    batched.get_packer = get_packer  # type: ignore[attr-defined]
    messages = modules["nemo_rl.data.llm_message_utils"]
    messages.PackedTensor = NemoPackedTensor  # type: ignore[attr-defined]
    messages.BatchedDataDict = ReferenceBatchedDataDict  # type: ignore[attr-defined]
    messages.batched_message_log_to_flat_message = reference_flatten  # type: ignore[attr-defined]
    sys.modules.update(modules)
    compat.uninstall()
    try:
        yield batched
    finally:
        compat.uninstall()
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
