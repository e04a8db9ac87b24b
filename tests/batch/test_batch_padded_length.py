"""``BatchOptions.padded_length``: the positions a sample takes in a batch, exactly as the native
builders pad it (``pad_samples``' rows, ``pack_samples``' ``cu_seqlens_padded``), so lengths
planned with it fit a fixed ``pad_to_length`` in a pack and in a micro-batch."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from mmpack.batch import BatchOptions, EncodedSample, micro_batch, pack_samples
from mmpack.batch.padded import pad_samples
from mmpack.errors import BatchOptionError, InvalidLengthError


def _samples(lengths: list[int]) -> list[EncodedSample]:
    return [
        EncodedSample(f"s{i}", np.arange(1, n + 1), loss_mask=np.ones(n, np.int8))
        for i, n in enumerate(lengths)
    ]


@given(
    lengths=st.lists(st.integers(1, 70), min_size=1, max_size=8),
    pad=st.integers(1, 12),
    cp=st.integers(1, 5),
)
def test_padded_length_is_what_the_builders_pad_to(lengths: list[int], pad: int, cp: int) -> None:
    options = BatchOptions(loss_mask_mode="precomputed", pad_to_multiple_of=pad, cp_size=cp)
    multiple = options.padding_multiple
    assert multiple % pad == 0 and (cp == 1 or multiple % (2 * cp) == 0)
    samples = _samples(lengths)
    pack = pack_samples(samples, options)
    widths = np.diff(pack.cu_seqlens_padded.numpy()).tolist()
    assert widths == [options.padded_length(n) for n in lengths]
    rows = pad_samples(samples, options)
    assert rows.input_ids.shape[1] == max(options.padded_length(n) for n in lengths)
    # the planned total is a valid fixed length, and one multiple less does not hold the pack
    total = sum(widths)
    assert pack_samples(samples, options.replace(pad_to_length=total)).input_ids.shape == (total,)
    if total > multiple:
        with pytest.raises(BatchOptionError, match="more than pad_to_length"):
            pack_samples(samples, options.replace(pad_to_length=total - multiple))
    step = micro_batch([pack, pack], options.replace(pad_to_length=2 * total))
    assert step.input_ids.shape == (2 * total,)


def test_the_padding_multiple_is_the_native_one() -> None:
    # the core accepts exactly the multiples of its padding multiple as pad_to_length
    for pad, cp in [(1, 1), (8, 1), (1, 2), (6, 2), (8, 2), (5, 3), (12, 4)]:
        multiple = BatchOptions(pad_to_multiple_of=pad, cp_size=cp).padding_multiple
        accepted = []
        for length in range(1, 2 * multiple + 1):
            try:
                BatchOptions(pad_to_multiple_of=pad, cp_size=cp, pad_to_length=length)
            except BatchOptionError:
                continue
            accepted.append(length)
        assert accepted == [multiple, 2 * multiple]


@pytest.mark.parametrize(
    ("length", "error"),
    [(-1, InvalidLengthError), (1.5, TypeError), (True, TypeError), ("8", TypeError)],
)
def test_a_bad_length_is_a_typed_error(length: Any, error: type[Exception]) -> None:
    with pytest.raises(error, match="length"):
        BatchOptions(pad_to_multiple_of=8).padded_length(length)
    assert BatchOptions(pad_to_multiple_of=8).padded_length(np.int64(9)) == 16
