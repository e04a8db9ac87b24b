"""Packing that keeps a group's rows in one bin where capacity allows: a packed micro-batch
holding several rows of one prompt encodes the prompt's media once.

Rows that share a media segment form a group (``mmpack.packing.placement``). ``pack_groups``
first packs the rows with the algorithm asked for, for its bin count ``K`` (which carries the
``min_bins`` / ``bins_multiple_of`` rules); then it refills ``K`` bins group by group, largest
group first, each group's rows (longest first) into the bin with the most room and on into
the next such bin when it is full, so that a group spans as few bins as capacity allows. Where
that does not fit every row into ``K`` bins, the row packing is returned as it is: the number
of micro-batches never grows (``place`` still keeps a group's bins on one rank).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from mmpack import _native
from mmpack._coerce import lengths_array, optional_packing_int
from mmpack.errors import PackingArgumentError
from mmpack.packing.pack import pack
from mmpack.packing.result import Packing

__all__ = ["pack_groups"]

IntArray = NDArray[np.int64]


def pack_groups(
    lengths: Sequence[int] | IntArray,
    capacity: int,
    *,
    segments: Sequence[int] | IntArray,
    segment_offsets: Sequence[int] | IntArray,
    algorithm: Any = "best_fit_decreasing",
    min_bins: int | None = None,
    bins_multiple_of: int | None = None,
) -> Packing:
    """Packs rows of ``lengths`` into bins of ``capacity``, each group's rows in one bin where
    they fit together (see the module docs). ``segments`` / ``segment_offsets``: each row's
    media segment ids as CSR (any integer ids; rows listing a common id are one group).
    ``algorithm``, ``min_bins`` and ``bins_multiple_of`` are ``pack``'s. Every row is in
    exactly one bin; a row longer than ``capacity`` raises ``ItemTooLargeError`` naming it.
    The result's items are rows, as from ``pack``."""
    rows = lengths_array(lengths, "lengths")
    n = len(rows)
    offsets = lengths_array(segment_offsets, "segment_offsets")
    ids = lengths_array(segments, "segments")
    if len(offsets) != n + 1:
        raise PackingArgumentError(
            f"invalid packing argument segment_offsets: {len(offsets)} offsets for {n} rows "
            f"(needs {n + 1})"
        )
    min_b = optional_packing_int(min_bins, "min_bins", 0)
    multiple = optional_packing_int(bins_multiple_of, "bins_multiple_of", 1)
    # The row packing checks every argument and every length first; it is also the fallback.
    by_rows = pack(rows, capacity, algorithm=algorithm, min_bins=min_b, bins_multiple_of=multiple)
    dense = np.unique(ids, return_inverse=True)[1].astype(np.int64).reshape(-1)
    groups = _native.segment_groups(offsets, dense, int(dense.max()) + 1 if len(dense) else 0)
    num_groups = int(groups.max()) + 1 if n else 0
    if num_groups == n:
        return by_rows  # no row shares media with another
    bins = _refill(rows, groups, num_groups, by_rows.num_bins, by_rows.capacity)
    if bins is None:
        return by_rows
    sizes = np.fromiter((len(b) for b in bins), np.int64, len(bins))
    bin_offsets = np.zeros(len(bins) + 1, dtype=np.int64)
    np.cumsum(sizes, out=bin_offsets[1:])
    item_indices = np.fromiter((i for b in bins for i in b), np.int64, n)
    loads = np.fromiter((int(rows[b].sum()) for b in bins), np.int64, len(bins))
    return Packing(
        bin_offsets=bin_offsets,
        item_indices=item_indices,
        bin_loads=loads,
        oversize=by_rows.oversize,
        capacity=by_rows.capacity,
        algorithm=by_rows.algorithm,
        total_length=by_rows.total_length,
        item_lengths=rows,
    )


def _refill(
    rows: IntArray, groups: IntArray, num_groups: int, num_bins: int, capacity: int
) -> list[list[int]] | None:
    """``num_bins`` bins filled group by group (see the module docs), or ``None`` when a row
    does not fit or a bin would stay empty."""
    order = np.lexsort((np.arange(len(rows)), -rows, groups))  # by group, longest row first
    starts = np.searchsorted(groups[order], np.arange(num_groups + 1))
    totals = np.bincount(groups, weights=rows, minlength=num_groups)
    first_row = np.full(num_groups, len(rows), dtype=np.int64)
    np.minimum.at(first_row, groups, np.arange(len(rows)))
    group_order = np.lexsort((first_row, -totals))
    room = [capacity] * num_bins
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    roomiest = [(-capacity, b) for b in range(num_bins)]  # a max-heap of (room, bin)
    lengths = rows.tolist()
    members = order.tolist()
    bounds = starts.tolist()
    for g in group_order.tolist():
        current = -1
        for i in members[bounds[g] : bounds[g + 1]]:
            length = lengths[i]
            if current < 0 or room[current] < length:
                while roomiest and -roomiest[0][0] != room[roomiest[0][1]]:
                    heapq.heappop(roomiest)  # stale: the bin's room changed since
                if not roomiest or -roomiest[0][0] < length:
                    return None
                current = heapq.heappop(roomiest)[1]
            bins[current].append(i)
            room[current] -= length
            heapq.heappush(roomiest, (-room[current], current))
    if any(not b for b in bins):
        return None
    return bins
