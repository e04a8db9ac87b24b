"""The result of packing: bins as flat CSR arrays over the input's items."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from mmpack import _native

__all__ = ["IntArray", "Packing"]

IntArray = NDArray[np.int64]


@dataclass(frozen=True, eq=False)
class Packing:
    """Bins as flat CSR arrays: bin ``b`` holds ``item_indices[bin_offsets[b]:bin_offsets[b+1]]``
    (indices into the input), in placement order."""

    bin_offsets: IntArray
    item_indices: IntArray
    #: Sum of lengths per bin (oversize items count as ``capacity`` under ``"truncate"``).
    bin_loads: IntArray
    #: Items over a budget, ascending: left out of every bin (``"skip"``) or packed with their
    #: length clipped to ``capacity`` (``"truncate"``).
    oversize: IntArray
    capacity: int
    algorithm: str
    #: Sum of the packed lengths.
    total_length: int
    #: Sum of media per bin, when a media budget was given.
    bin_media: IntArray | None = None
    media_capacity: int | None = None
    on_oversize: str = "error"
    #: The lengths that were packed, one per item (``None`` when not kept).
    item_lengths: IntArray | None = dataclasses.field(default=None, repr=False)

    @property
    def num_bins(self) -> int:
        return len(self.bin_offsets) - 1

    @property
    def efficiency(self) -> float:
        """``total_length / (num_bins * capacity)``; 0.0 with no bins."""
        return self.total_length / (self.num_bins * self.capacity) if self.num_bins else 0.0

    @property
    def lower_bound(self) -> int:
        """``ceil(total_length / capacity)``: no packing uses fewer bins."""
        return -(-self.total_length // self.capacity)

    def bin(self, b: int) -> IntArray:
        """Item indices of bin ``b`` (a view)."""
        return self.item_indices[self.bin_offsets[b] : self.bin_offsets[b + 1]]

    def bins(self) -> list[list[int]]:
        """The bins as a list of lists of item indices (builds Python objects: slow for
        millions of items; prefer the flat arrays)."""
        return _native.csr_to_lists(self.bin_offsets, self.item_indices)

    def __repr__(self) -> str:
        return (
            f"Packing(algorithm={self.algorithm!r}, num_bins={self.num_bins}, "
            f"lower_bound={self.lower_bound}, efficiency={self.efficiency:.4%}, "
            f"items={len(self.item_indices)}, oversize={len(self.oversize)})"
        )
