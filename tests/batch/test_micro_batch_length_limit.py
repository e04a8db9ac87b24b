"""A micro-batch length ``cu_seqlens`` (int32) cannot hold is refused before anything is
allocated (not an abort on a failed allocation of the whole width)."""

from __future__ import annotations

import pytest
from mmpack.batch import EncodedSample, micro_batch, pack_samples
from mmpack.batch.options import BatchOptions
from mmpack.errors import IndexOverflowError


@pytest.mark.parametrize("length", [2**31, 2**32, 2**40])
def test_pad_to_length_past_int32_is_an_index_overflow(length: int) -> None:
    options = BatchOptions(loss_mask_mode="precomputed")
    pack = pack_samples([EncodedSample("a", [1, 2, 3], loss_mask=[1, 1, 1])], options)
    with pytest.raises(IndexOverflowError, match=rf"pad_to_length={length}.*int32"):
        micro_batch([pack], options.replace(pad_to_length=length))


def test_pad_to_length_within_int32_is_accepted() -> None:
    options = BatchOptions(loss_mask_mode="precomputed")
    pack = pack_samples([EncodedSample("a", [1, 2, 3], loss_mask=[1, 1, 1])], options)
    out = micro_batch([pack], options.replace(pad_to_length=64))
    assert out.input_ids.numel() == 64
