"""Packing cases and invariants shared by the packing and NeMo-RL packer tests."""

from __future__ import annotations

import numpy as np
from mmpack.packing import Packing

SMALL = [10, 20, 30, 40, 50, 60, 70, 80, 90]
SAME = [30] * 5
MAXED = [100] * 3
MIXED = [10, 50, 100, 20, 80, 30, 70, 40, 60, 90]
MEDIUM = [25, 35, 45, 55, 65, 75, 85, 95, 15, 25, 35, 45, 55, 65, 75, 85, 95]


def check_invariants(
    p: Packing,
    lengths: list[int],
    capacity: int,
    *,
    media: list[int] | None = None,
    media_capacity: int | None = None,
    max_items: int | None = None,
    on_oversize: str = "error",
) -> None:
    """Every item exactly once (or in ``oversize``), every budget held, loads consistent."""
    offsets = p.bin_offsets
    assert offsets.dtype == np.int64 and p.item_indices.dtype == np.int64
    assert offsets[0] == 0 and offsets[-1] == len(p.item_indices)
    assert np.all(np.diff(offsets) >= 1), "no empty bins"
    over = set(p.oversize.tolist())
    expected_over = {
        i
        for i, length in enumerate(lengths)
        if length > capacity or (media is not None and media[i] > (media_capacity or 0))
    }
    assert over == expected_over
    packed = sorted(p.item_indices.tolist())
    if on_oversize == "skip":
        assert packed == sorted(set(range(len(lengths))) - over)
    else:
        assert packed == list(range(len(lengths)))
    eff = [min(length, capacity) for length in lengths]
    for b, items in enumerate(p.bins()):
        load = sum(eff[i] for i in items)
        assert load == p.bin_loads[b] <= capacity
        if media is not None:
            assert p.bin_media is not None
            assert sum(media[i] for i in items) == p.bin_media[b] <= (media_capacity or 0)
        if max_items is not None:
            assert len(items) <= max_items
    assert p.total_length == sum(p.bin_loads.tolist())
    assert p.num_bins >= p.lower_bound


# ----------------------------------------------------------------------------- spec cases
