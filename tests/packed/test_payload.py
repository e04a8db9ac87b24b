"""``mmpack.packed.payload``: physical vs logical bytes from shapes, the exact protocol-5 size, and
the policy-bound bf16 cast before a transfer."""

from __future__ import annotations

import copy
import dataclasses
import pickle
from collections import UserDict
from typing import Any

import numpy as np
import pytest
import torch
from mmpack.packed import PackedTensor as NativePT
from mmpack.packed import payload
from reference.packed_tensor import PackedTensor as RefPT

# mmpack's class and the plain reference (which has NeMo-RL's attributes): measure duck-types
PT_CLASSES: list[Any] = [NativePT, RefPT]


@pytest.fixture(params=PT_CLASSES, ids=lambda c: c.__module__)
def PT(request: pytest.FixtureRequest) -> Any:
    return request.param


def _img(seed: int, rows: int = 4) -> torch.Tensor:
    return torch.randn(rows, 8, generator=torch.Generator().manual_seed(seed))


def test_legacy_clones_count_physically(PT: Any) -> None:
    a = _img(0)
    legacy = PT([a.clone() for _ in range(4)], 0)
    stats = payload.measure({"pixel_values": legacy})
    assert stats.physical_bytes == 4 * a.nbytes == stats.logical_bytes
    assert stats.physical_segments == stats.logical_segments == 4
    assert stats.serialized_bytes is None
    assert stats.saved_bytes == 0 and stats.physical_to_logical == 1.0


def test_dedup_counts_each_physical_once(PT: Any) -> None:
    a = _img(1)
    m = PT([a], 0).enable_deduplication()
    dedup = PT.concat([copy.deepcopy(m) for _ in range(4)])
    stats = payload.measure({"pixel_values": dedup})
    assert stats.physical_bytes == a.nbytes
    assert stats.logical_bytes == 4 * a.nbytes
    assert stats.physical_segments == 1 and stats.logical_segments == 4
    assert stats.saved_bytes == 3 * a.nbytes
    assert stats.physical_to_logical == pytest.approx(0.25)


def test_repeat_interleave_none_rows_and_unreferenced(PT: Any) -> None:
    a, b = _img(2), _img(3, rows=2)
    base = PT([a, None, b], 0).enable_deduplication()
    g16 = base.repeat_interleave(16)
    stats = payload.measure(g16)
    assert stats.physical_bytes == a.nbytes + b.nbytes
    assert stats.physical_segments == 2
    assert stats.logical_segments == 32
    assert stats.logical_bytes == 16 * (a.nbytes + b.nbytes)
    # a physical segment no row references still travels (NeMo-RL counts it too)
    c = _img(4)
    unref = PT([a, c], 0, _row_offsets=[0, 1, 2], _segment_indices=[0, 0])
    s2 = payload.measure(unref)
    assert s2.physical_bytes == a.nbytes + c.nbytes and s2.logical_bytes == 2 * a.nbytes


def test_shared_tensors_and_plain_leaves_across_a_nested_structure(PT: Any) -> None:
    a = _img(5)
    ids = torch.arange(10)
    arr = np.zeros(6, dtype=np.float32)
    shared = PT([a], 0).enable_deduplication()
    other = PT([a, _img(6)], 0)  # the same tensor object as physical segment 0
    obj = {
        "batch": [shared, {"pixel_values": other}],
        "input_ids": ids,
        "again": (ids, arr),
        "meta": {"name": "x", "n": 3, "none": None},
    }
    stats = payload.measure(obj)
    assert stats.physical_bytes == a.nbytes * 2 + ids.nbytes + arr.nbytes
    assert stats.physical_segments == 2 + 1 + 1
    assert stats.logical_bytes == a.nbytes * 3 + 2 * ids.nbytes + arr.nbytes
    assert stats.logical_segments == 3 + 2 + 1


def test_segment_kinds_inside_a_packed_value(PT: Any) -> None:
    """Arrays, tensor subclasses and repeated objects count; other entries are absent."""
    a = _img(7)
    arr = np.ones((2, 3), dtype=np.float64)
    param = torch.nn.Parameter(torch.ones(5), requires_grad=False)
    value = PT(
        [a, arr, param, a, None, "not a segment"],
        0,
        _row_offsets=[0, 2, 6],
        _segment_indices=[0, 1, 2, 3, 4, 5],
    )
    stats = payload.measure([value, a])
    assert stats.physical_bytes == a.nbytes + arr.nbytes + param.nbytes
    assert stats.physical_segments == 3
    assert stats.logical_bytes == 3 * a.nbytes + arr.nbytes + param.nbytes
    assert stats.logical_segments == 5


def test_out_of_range_segment_index_is_a_typed_error() -> None:
    from mmpack.errors import LayoutError

    value = RefPT([_img(8)], 0, _row_offsets=[0, 1], _segment_indices=[0])
    value._segment_indices = [3]  # corrupted behind the constructor's back
    with pytest.raises(LayoutError, match="out-of-range physical segment"):
        payload.measure(value)


def test_dataclass_and_mapping_subclass_are_walked() -> None:
    @dataclasses.dataclass
    class Holder:
        media: dict[str, Any]
        tokens: torch.Tensor

    t = torch.ones(3, dtype=torch.int64)
    holder = Holder(media=UserDict({"x": torch.ones(2)}), tokens=t)
    stats = payload.measure(holder)
    assert stats.physical_bytes == 8 + 24 and stats.logical_segments == 2


def test_cycles_terminate() -> None:
    loop: list[Any] = [torch.ones(1)]
    loop.append(loop)
    assert payload.measure(loop).physical_bytes == 4


def test_serialized_is_the_exact_protocol5_size(PT: Any) -> None:
    a = _img(7)
    m = PT([a], 0).enable_deduplication()
    dedup = PT.concat([copy.deepcopy(m) for _ in range(4)])
    legacy = PT([a.clone() for _ in range(4)], 0)
    obj = {"dedup": dedup, "ndarray": np.arange(1000)}
    buffers: list[pickle.PickleBuffer] = []
    frame = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    expected = len(frame) + sum(b.raw().nbytes for b in buffers)
    stats = payload.measure(obj, serialized=True)
    assert stats.serialized_bytes == expected
    assert len(buffers) >= 1  # the ndarray went out of band
    legacy_size = payload.measure({"dedup": legacy}, serialized=True).serialized_bytes
    dedup_size = payload.measure({"dedup": dedup}, serialized=True).serialized_bytes
    assert legacy_size is not None and dedup_size is not None and dedup_size < legacy_size


# ------------------------------------------------------------------------ prepare_for_transfer


def test_prepare_for_transfer_casts_policy_media_once(PT: Any) -> None:
    a = _img(8)
    grid = torch.tensor([[1, 2, 2]])
    m = PT([a], 0).enable_deduplication()
    pixels = PT.concat([copy.deepcopy(m) for _ in range(16)])
    grids = PT([grid], 0).enable_deduplication().repeat_interleave(16)
    plain = torch.randn(2, 3)
    batch = {
        "pixel_values": pixels,
        "image_grid_thw": grids,
        "nested": {
            "pixel_values_videos": plain,
            "pixel_values": [pixels, torch.ones(2, dtype=torch.int32)],
        },
        "other_float": plain,
    }
    before = payload.measure(batch)
    out = payload.prepare_for_transfer(batch)
    # the input is untouched
    assert batch["pixel_values"] is pixels and pixels.tensors[0] is a and a.dtype == torch.float32
    assert batch["nested"]["pixel_values_videos"] is plain
    # media under the keys are bf16, each physical segment cast once
    new_pixels = out["pixel_values"]
    assert new_pixels is not pixels
    assert len(new_pixels.tensors) == 1 and new_pixels.tensors[0].dtype == torch.bfloat16
    assert new_pixels._segment_indices == pixels._segment_indices
    assert new_pixels._segment_provenance != pixels._segment_provenance  # values changed
    assert torch.equal(new_pixels.as_tensor(), pixels.as_tensor().to(torch.bfloat16))
    # the same object reached twice maps to the same cast object
    assert out["nested"]["pixel_values"][0] is new_pixels
    assert out["nested"]["pixel_values"][1].dtype == torch.int32  # integers are never cast
    assert out["nested"]["pixel_values_videos"].dtype == torch.bfloat16
    # other keys are the same objects
    assert out["image_grid_thw"] is grids and out["other_float"] is plain
    after = payload.measure(out)
    # pixels halve; ``plain`` stays (under "other_float") and gains a bf16 copy
    saved = before.physical_bytes - after.physical_bytes
    assert saved == a.nbytes // 2 - plain.nbytes // 2


def test_prepare_for_transfer_keys_dataclass_and_idempotence(PT: Any) -> None:
    @dataclasses.dataclass
    class Batch:
        tokens: torch.Tensor
        media: dict[str, Any]

    pix = PT([_img(9), torch.ones(2, 8, dtype=torch.bfloat16)], 0).enable_deduplication()
    b = Batch(tokens=torch.arange(4), media={"images": pix})
    out = payload.prepare_for_transfer(b, dtype=torch.float16, keys=("images",))
    assert isinstance(out, Batch) and out is not b and out.tokens is b.tokens
    assert [t.dtype for t in out.media["images"].tensors] == [torch.float16, torch.float16]
    assert b.media["images"] is pix
    # nothing to cast: a new wrapper with equal provenance (to_dtype's no-op rule)
    again = payload.prepare_for_transfer(out, dtype=torch.float16, keys=("images",))
    assert again.media["images"]._segment_provenance == out.media["images"]._segment_provenance
    with pytest.raises(TypeError, match="floating"):
        payload.prepare_for_transfer(b, dtype=torch.int64)


def test_the_same_packed_value_reached_twice_is_walked_once(PT: Any) -> None:
    a = _img(10)
    value = PT([a], 0).enable_deduplication().repeat_interleave(4)
    stats = payload.measure({"x": value, "y": [value, value]})
    assert stats.physical_segments == 1 and stats.logical_segments == 4
    assert stats.logical_bytes == 4 * a.nbytes
