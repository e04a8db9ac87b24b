"""Rank assignment: the bins of a :class:`~mmpack.packing.Packing` spread over data-parallel
ranks with balanced cost, computed in the Rust core.

``assign_to_ranks(packing, num_ranks)`` returns a flat :class:`RankAssignment` (CSR arrays of
bin indices per rank). Both names are re-exported from ``mmpack.packing``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from mmpack import _native
from mmpack._coerce import packing_int
from mmpack.errors import PackingArgumentError
from mmpack.packing.result import Packing

__all__ = ["RankAssignment", "assign_to_ranks"]

_RANK_COSTS: tuple[str, ...] = ("tokens", "tokens_squared")

IntArray = NDArray[np.int64]


@dataclass(frozen=True, eq=False)
class RankAssignment:
    """Bins per data-parallel rank as CSR: rank ``r`` gets bins
    ``bin_indices[rank_offsets[r]:rank_offsets[r+1]]``, largest cost first."""

    rank_offsets: IntArray
    bin_indices: IntArray
    #: Total cost per rank.
    rank_costs: IntArray
    #: Cost per bin (tokens, or squared tokens).
    bin_costs: IntArray
    cost: str

    @property
    def num_ranks(self) -> int:
        return len(self.rank_offsets) - 1

    @property
    def imbalance(self) -> float:
        """``max / mean`` of the rank costs (1.0 is perfect balance; 1.0 when all are 0)."""
        mean = float(self.rank_costs.mean()) if len(self.rank_costs) else 0.0
        return float(self.rank_costs.max()) / mean if mean > 0 else 1.0

    def ranks(self) -> list[list[int]]:
        """Bin indices per rank as lists."""
        bins = self.bin_indices.tolist()
        offsets = self.rank_offsets.tolist()
        return [bins[a:b] for a, b in itertools.pairwise(offsets)]


def assign_to_ranks(packing: Packing, num_ranks: int, *, cost: str = "tokens") -> RankAssignment:
    """Distributes the bins of ``packing`` over ``num_ranks`` data-parallel ranks, balancing
    ``cost`` (``"tokens"``: sum of lengths; ``"tokens_squared"``: sum of squared lengths, which
    tracks attention cost). Greedy longest-processing-time: bins by cost descending, each to
    the least-loaded rank that has fewer than ``ceil(num_bins / num_ranks)`` bins, so bin
    counts differ by at most one (none when ``num_bins`` is a multiple of ``num_ranks``; use
    ``pack(..., bins_multiple_of=num_ranks)``). Each rank's bins come out largest first."""
    if not isinstance(packing, Packing):
        raise TypeError(
            f"assign_to_ranks needs a Packing (from mmpack.packing.pack or "
            f"SequencePacker.pack_flat), got {type(packing).__name__}"
        )
    ranks = packing_int(num_ranks, "num_ranks", 1)
    if cost not in _RANK_COSTS:
        raise PackingArgumentError(
            f"invalid packing argument cost: {cost!r}; known: {', '.join(_RANK_COSTS)}"
        )
    lengths = packing.item_lengths
    if lengths is None:
        raise PackingArgumentError("invalid packing argument packing: has no lengths attached")
    if packing.on_oversize == "truncate" and len(packing.oversize):
        lengths = np.minimum(lengths, packing.capacity)
    out = _native.assign_to_ranks(packing.bin_offsets, packing.item_indices, lengths, ranks, cost)
    return RankAssignment(out.rank_offsets, out.bin_indices, out.rank_costs, out.bin_costs, cost)
