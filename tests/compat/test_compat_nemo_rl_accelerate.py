"""``install(accelerate=True)``: mmpack's ``BatchedDataDict.repeat_interleave`` on NeMo-RL's class.

NeMo-RL needs a newer Python than this suite runs on, so each test registers a small stand-in
for ``nemo_rl.data.multimodal_utils`` and ``nemo_rl.distributed.batched_data_dict`` with what the
accelerated method reads (``PackedTensor``, ``NATIVE_MULTIMODAL_KEYS``,
``_prepare_multimodal_sharing``, a ``UserDict``-based ``BatchedDataDict``) and compares it with
the plain ``copy.deepcopy`` version written here. NeMo-RL's own tests run against the real module
with ``tests/nemo_rl_fidelity/run_fidelity.py``.
"""

from __future__ import annotations

import copy
import sys
import types
from collections import UserDict
from collections.abc import Iterator
from typing import Any

import mmpack
import pytest
import torch
from mmpack.compat import nemo_rl as compat


class NemoPackedTensor:
    """Stands for NeMo-RL's class until ``install()`` replaces it."""


MEDIA_KEYS = frozenset({"vllm_content", "vllm_images"})


def prepare_sharing(item: Any, *, media_context: bool = False) -> dict[int, Any]:
    """NeMo-RL's rule: PackedTensors get provenance, leaves under media keys are shared."""
    shared: dict[int, Any] = {}

    def visit(value: Any, in_media: bool) -> None:
        if isinstance(value, mmpack.PackedTensor):
            value.enable_deduplication()
        elif isinstance(value, dict):
            for key, child in value.items():
                visit(child, in_media or key in MEDIA_KEYS)
        elif isinstance(value, (list, tuple)):
            for child in value:
                visit(child, in_media)
        elif in_media:
            shared[id(value)] = value

    visit(item, media_context)
    return shared


class BatchedDataDict(UserDict):  # type: ignore[type-arg]
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.micro_batch_indices = None

    def repeat_interleave(self, num_repeats: int, *, share_immutable_media: bool = False) -> Any:
        """The reference: every row deep-copied with ``copy.deepcopy``."""
        out = type(self)()
        for key, value in self.data.items():
            if torch.is_tensor(value):
                out[key] = value.repeat_interleave(num_repeats, dim=0)
            elif isinstance(value, mmpack.PackedTensor):
                raise NotImplementedError(
                    "PackedTensor does not currently support repeat_interleave"
                )
            else:
                rows = []
                for item in value:
                    shared = (
                        prepare_sharing(item, media_context=key in MEDIA_KEYS)
                        if share_immutable_media
                        else {}
                    )
                    rows.extend(copy.deepcopy(item, dict(shared)) for _ in range(num_repeats))
                out[key] = rows
        return out


@pytest.fixture
def nemo() -> Iterator[types.ModuleType]:
    names = ["nemo_rl", "nemo_rl.data", "nemo_rl.data.multimodal_utils", "nemo_rl.distributed"]
    names.append("nemo_rl.distributed.batched_data_dict")
    saved = {name: sys.modules.get(name) for name in names}
    modules = {name: types.ModuleType(name) for name in names}
    for name in names[:2] + names[3:4]:
        modules[name].__path__ = []  # type: ignore[attr-defined]
    modules["nemo_rl.data.multimodal_utils"].PackedTensor = NemoPackedTensor  # type: ignore[attr-defined]
    batched = modules["nemo_rl.distributed.batched_data_dict"]
    batched.PackedTensor = NemoPackedTensor  # type: ignore[attr-defined]
    batched.NATIVE_MULTIMODAL_KEYS = MEDIA_KEYS  # type: ignore[attr-defined]
    batched._prepare_multimodal_sharing = prepare_sharing  # type: ignore[attr-defined]
    BatchedDataDict.repeat_interleave = BatchedDataDict.__dict__["repeat_interleave"]
    batched.BatchedDataDict = BatchedDataDict  # type: ignore[attr-defined]
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


def grpo_batch() -> BatchedDataDict:
    image = object()
    rows = []
    for i in range(3):
        base = torch.arange(10 + i)
        pixels = mmpack.PackedTensor(torch.randn(4 + i, 3), dim_to_pack=0)
        rows.append(
            [
                {"role": "system", "token_ids": base[:4]},  # a view: shares storage with the next
                {"role": "user", "token_ids": base, "pixel_values": pixels, "meta": ("t", i)},
            ]
        )
    return BatchedDataDict(
        {
            "message_log": rows,
            "loss_multiplier": torch.ones(3),
            "vllm_images": [[image, torch.zeros(2)] for _ in range(3)],
            "extra_env_info": [{"answer": str(i), "tags": ["a"]} for i in range(3)],
        }
    )


def describe(batch: Any) -> Any:
    """Values, types and identity classes (objects and tensor storages) of a batch."""
    ids: dict[int, int] = {}
    storages: dict[int, int] = {}

    def walk(v: Any) -> Any:
        ref = ids.setdefault(id(v), len(ids))
        if isinstance(v, torch.Tensor):
            return (
                "T",
                ref,
                storages.setdefault(v.untyped_storage().data_ptr(), len(storages)),
                v.tolist(),
            )
        if isinstance(v, mmpack.PackedTensor):
            return ("P", ref, [walk(t) for t in v.tensors], v._segment_provenance, len(v))
        if isinstance(v, dict):
            return ("D", ref, [(k, walk(x)) for k, x in v.items()])
        if isinstance(v, (list, tuple)):
            return (type(v).__name__, ref, [walk(x) for x in v])
        return ("A", ref if type(v) is object else None, v if type(v) is not object else None)

    return (
        type(batch).__name__,
        [(k, walk(v)) for k, v in batch.data.items()],
        batch.micro_batch_indices,
    )


@pytest.mark.parametrize("share", [True, False])
def test_accelerated_repeat_interleave_equals_deepcopy_version(
    nemo: types.ModuleType, share: bool
) -> None:
    reference_method = nemo.BatchedDataDict.repeat_interleave
    assert compat.install(accelerate=True) == "patched"
    assert compat.accelerated()
    assert nemo.BatchedDataDict.repeat_interleave is not reference_method
    batch = grpo_batch()
    ours = batch.repeat_interleave(4, share_immutable_media=share)
    theirs = reference_method(batch, 4, share_immutable_media=share)
    # Described with the source batch, so that what is shared with it shows too.
    assert describe(BatchedDataDict({"src": batch.data, "out": ours.data})) == describe(
        BatchedDataDict({"src": batch.data, "out": theirs.data})
    )
    rows = ours["message_log"]
    assert len(rows) == 12
    assert rows[0][1]["token_ids"] is not rows[1][1]["token_ids"]
    rows[0][1]["token_ids"][0] = -1  # copies are independent
    assert rows[1][1]["token_ids"][0] == 0 and batch["message_log"][0][1]["token_ids"][0] == 0
    # The system turn is a view of the user turn's ids in the source, and still is in each copy.
    assert (
        rows[0][0]["token_ids"].untyped_storage().data_ptr()
        == rows[0][1]["token_ids"].untyped_storage().data_ptr()
    )
    shared_media = rows[0][1]["pixel_values"].tensors[0] is rows[1][1]["pixel_values"].tensors[0]
    assert shared_media is share
    assert (ours["vllm_images"][0][0] is batch["vllm_images"][0][0]) is share


def test_packed_tensor_values_are_refused_like_nemo_rl(nemo: types.ModuleType) -> None:
    compat.install(accelerate=True)
    batch = BatchedDataDict({"pixel_values": mmpack.PackedTensor(torch.ones(2, 3), dim_to_pack=0)})
    with pytest.raises(NotImplementedError, match="PackedTensor does not currently support"):
        batch.repeat_interleave(2)


def test_uninstall_restores_nemo_rl_methods(nemo: types.ModuleType) -> None:
    original = nemo.BatchedDataDict.__dict__["repeat_interleave"]
    compat.install()
    assert not compat.accelerated()
    assert nemo.BatchedDataDict.__dict__["repeat_interleave"] is original
    compat.install(accelerate=True)  # a second call adds the methods
    assert nemo.BatchedDataDict.__dict__["repeat_interleave"] is not original
    compat.uninstall()
    assert nemo.BatchedDataDict.__dict__["repeat_interleave"] is original
    assert not compat.accelerated() and compat.installed() is None


def test_accelerate_without_nemo_rl_changes_nothing() -> None:
    saved = {
        name: module for name, module in sys.modules.items() if name.split(".")[0] == "nemo_rl"
    }
    for name in saved:
        del sys.modules[name]
    compat.uninstall()
    try:
        with pytest.raises(ImportError, match=r"nemo_rl\.distributed\.batched_data_dict"):
            compat.install(accelerate=True)
        assert compat.installed() is None and not compat.accelerated()
        assert "nemo_rl.data.multimodal_utils" not in sys.modules
        assert compat.install() == "shim"
        with pytest.raises(ImportError, match="shim"):
            compat.install(accelerate=True)
    finally:
        compat.uninstall()
        sys.modules.update(saved)
