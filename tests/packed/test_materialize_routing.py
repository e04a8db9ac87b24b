"""``mmpack.PackedTensor.as_tensor`` / ``.to`` and ``PackedBatch.to`` run on the native
materialization path (``mmpack.packed.gather``) and the unique-segment device feed
(``mmpack.packed.transfer``)."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from mmpack import _native
from mmpack.batch import EncodedSample, pack_samples
from mmpack.errors import OutBufferError, PinMemoryUnavailableError
from mmpack.packed import PackedTensor
from mmpack.packed import gather as _gather
from mmpack.packed import transfer as _transfer
from reference.packed_tensor import PackedTensor as RefPT


def _counting(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = _native.gather_into

    def counting(*args: Any, **kwargs: Any) -> None:
        calls.append(1)
        real(*args, **kwargs)

    monkeypatch.setattr(_native, "gather_into", counting)
    return calls


def _g16() -> tuple[PackedTensor, RefPT]:
    gen = torch.Generator().manual_seed(0)
    images = [torch.randn(3 + i, 6, generator=gen).to(torch.bfloat16) for i in range(3)]
    base = PackedTensor(
        list(images), 0, _row_offsets=[0, 1, 1, 3], _segment_indices=[0, 1, 2]
    ).enable_deduplication()
    value = base.repeat_interleave(16)
    offsets, indices = value.csr()
    ref = RefPT(
        list(value.tensors),
        0,
        _row_offsets=offsets.tolist(),
        _segment_indices=indices.tolist(),
    )
    return value, ref


def test_as_tensor_uses_the_native_gather(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_gather, "SMALL_OUTPUT_BYTES", 0)
    value, ref = _g16()
    calls = _counting(monkeypatch)
    got = value.as_tensor()
    expected = ref.as_tensor()
    assert calls and got is not None and expected is not None
    assert got.dtype == torch.bfloat16 and torch.equal(got, expected)


def test_as_tensor_out_and_pin_memory() -> None:
    value, ref = _g16()
    expected = ref.as_tensor()
    assert expected is not None
    out = torch.empty_like(expected)
    assert value.as_tensor(out=out) is out
    assert torch.equal(out, expected)
    with pytest.raises(OutBufferError, match="shape"):
        value.as_tensor(out=torch.empty(1, 6, dtype=torch.bfloat16))
    if torch.cuda.is_available():
        pinned = value.as_tensor(pin_memory=True)
        assert pinned is not None and pinned.is_pinned()
    else:
        with pytest.raises(PinMemoryUnavailableError):
            value.as_tensor(pin_memory=True)


def test_as_tensor_device_moves_in_place_and_keeps_nemo_semantics() -> None:
    value, ref = _g16()
    tensors = value.tensors
    got = value.as_tensor("meta")
    assert value.tensors is tensors
    assert all(t.device.type == "meta" for t in tensors)
    expected = ref.as_tensor()
    assert got is not None and expected is not None
    assert got.device.type == "meta" and got.shape == expected.shape
    # legacy layout, None rows, negative dim with padding, nothing left
    legacy = PackedTensor([torch.ones(2, 3), None, torch.zeros(2, 1)], -1, pad_to_max_shape=True)
    legacy_ref = RefPT([torch.ones(2, 3), None, torch.zeros(2, 1)], -1, pad_to_max_shape=True)
    assert torch.equal(legacy.as_tensor(), legacy_ref.as_tensor())
    assert PackedTensor([None, None], 0).as_tensor() is None
    with pytest.raises(ValueError, match="same rank"):
        PackedTensor([torch.ones(2), torch.ones(2, 2)], 0, pad_to_max_shape=True).as_tensor()


def test_to_moves_each_unique_segment_once_and_keeps_provenance() -> None:
    shared = torch.ones(4)
    value2 = PackedTensor([shared, None, shared], 0).enable_deduplication()
    prov = value2._segment_provenance
    old_list = value2.tensors
    counters = _transfer.transfer_counters()
    before = counters.total_bytes
    assert value2.to("meta") is value2
    assert value2.tensors is not old_list  # NeMo-RL: `to` replaces the list
    assert value2.tensors[0] is value2.tensors[2] and value2.tensors[1] is None
    assert value2.tensors[0].device.type == "meta"
    assert value2._segment_provenance == prov
    assert counters.total_bytes - before == shared.nbytes


def test_packed_batch_to_moves_media_through_the_device_feed() -> None:
    image = torch.randn(4, 6)
    seed = PackedTensor([image], 0).enable_deduplication()
    samples = [
        EncodedSample(
            sample_id=i,
            token_ids=np.arange(5),
            loss_mask=np.ones(5, dtype=np.int64),
            media={"pixel_values": copy.deepcopy(seed)},
        )
        for i in range(3)
    ]
    batch = pack_samples(samples, loss_mask_mode="precomputed")
    pixels = batch.media["pixel_values"]
    assert len(pixels.tensors) == 1  # three samples, one physical image
    token_bytes = sum(getattr(batch, name).nbytes for name in batch._TENSOR_FIELDS)
    counters = _transfer.transfer_counters()
    before = counters.total_bytes
    assert batch.to("meta") is batch
    assert batch.input_ids.device.type == "meta"
    moved = batch.media["pixel_values"]
    assert moved.tensors[0].device.type == "meta"
    # the image crossed once; the token tensors cross through the same feed
    assert counters.total_bytes - before == image.nbytes + token_bytes
    assert moved.as_tensor().shape == (12, 6)


def test_nested_tensors_take_the_torch_path() -> None:
    """A strided nested tensor has no flat byte view: it is never staged or gathered natively
    (the device feed would fail on it), and ``as_tensor`` gives ``torch.cat``'s result."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "nested tensors are a prototype"
        nested = torch.nested.nested_tensor([torch.ones(2, 3), torch.zeros(3, 3)])
    assert not _transfer.is_plain_cpu(nested)
    value = PackedTensor([nested, nested], 0)
    got = value.as_tensor()
    expected = torch.cat([nested, nested])
    assert got is not None and got.is_nested
    assert [t.tolist() for t in got.unbind()] == [t.tolist() for t in expected.unbind()]
