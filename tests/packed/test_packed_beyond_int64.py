"""Row mappings holding values beyond int64: the core validates order-keeping int64 stand-ins,
so the error is the one NeMo-RL raises first (``LayoutError``, a ``ValueError``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from mmpack import PackedTensor as P
from mmpack.errors import LayoutError

BIG = 2**70
I64_MAX, I64_MIN = str(2**63 - 1), str(-(2**63))


@pytest.mark.parametrize(
    ("offsets", "indices", "phrase"),
    [
        ([BIG, 1], [0], r"must start with 0 \("),
        (
            [0, BIG],
            [0],
            rf"must end at the number of logical segment references \(last offset {I64_MAX},",
        ),
        ([0, -BIG, 0], [], rf"must be non-decreasing \(offset 1 is {I64_MIN} after 0\)"),
        # two values beyond int64 in decreasing order: still a decrease, not an end error
        ([0, BIG, 2**64], [0], r"must be non-decreasing \(offset 2 is"),
        ([0, 2**63 - 1, 2**64, 2**63], [0], r"must be non-decreasing \(offset 3 is"),
        ([0, 0, -(2**64), -BIG], [], r"must be non-decreasing \(offset 2 is"),
        ([0, 1], [BIG], rf"out-of-range physical segment \(reference 0 is {I64_MAX},"),
        ([0, 2], [0, -BIG], rf"out-of-range physical segment \(reference 1 is {I64_MIN},"),
        (np.array([0, 2**64 - 1], dtype=np.uint64), [0], "must end at the number"),
        ([0, 1], np.array([2**64 - 1], dtype=np.uint64), "out-of-range physical segment"),
    ],
)
def test_values_beyond_int64_raise_the_first_nemo_rl_error(
    offsets: object, indices: object, phrase: str
) -> None:
    with pytest.raises(LayoutError, match=phrase) as info:
        P([torch.ones(1)], 0, _row_offsets=offsets, _segment_indices=indices)  # type: ignore[arg-type]
    assert isinstance(info.value, ValueError)
    assert str(info.value).endswith("(values beyond int64 are shown as int64 stand-ins)")


def test_assigning_values_beyond_int64_is_refused_and_keeps_the_value() -> None:
    v = P([torch.ones(1)], 0, _row_offsets=[0, 1], _segment_indices=[0])
    with pytest.raises(LayoutError, match="out-of-range physical segment"):
        v._segment_indices = [BIG]
    assert v._segment_indices == [0]
