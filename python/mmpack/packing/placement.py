"""Placement: rows (or packed micro-batches) on data-parallel ranks by what each rank really
computes, with the rows that share media kept together.

A rank's cost is its rows' LLM cost (``token * L + attention * L**2`` per row of ``L`` tokens)
plus the vision cost of every *unique* media segment on it (``patch * P + patch_attention *
P**2`` for a segment of ``P`` patches), charged once per rank however many of its rows use the
segment. Rows that share a segment form a group (the G rows of one GRPO prompt). ``place``
minimises the worst rank's cost: groups stay whole where that keeps the worst rank within
``tolerance`` of the lower bound, and are split, fewest duplicate encodes first, where it does
not; a ``baseline`` placement (NeMo-RL's) is kept when it is strictly better. Inputs are plain
arrays; the work is one native call.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from mmpack import _native
from mmpack._coerce import lengths_array, packing_int
from mmpack.errors import InvalidLengthError, PackingArgumentError, PackingDtypeError
from mmpack.packing.result import Packing

__all__ = ["PlacementCost", "RankPlacement", "RowSegments", "place", "placement_of"]

IntArray = NDArray[np.int64]
FloatArray = NDArray[np.float64]

#: Per-row segment ids: one sequence per row, or (with ``segment_offsets``) a flat array.
RowSegments = Sequence[Sequence[int]] | Sequence[int] | NDArray[np.integer[Any]]


@dataclass(frozen=True)
class PlacementCost:
    """What a rank computes, in units of one token's linear LLM cost.

    Defaults: ``attention = 1 / 24576`` is the quadratic term of verl's 7B calibration
    (``24576 * L + L**2``); ``patch = 0.1`` is a vision tower about a tenth of the LLM's size
    (Qwen2-VL: 675M against 7B parameters), run on every patch before the merge. Set them from
    your models; only their ratios matter.
    """

    token: float = 1.0
    attention: float = 1.0 / 24576
    patch: float = 0.1
    patch_attention: float = 0.0

    def __post_init__(self) -> None:
        for name in ("token", "attention", "patch", "patch_attention"):
            value = getattr(self, name)
            if isinstance(value, (bool, np.bool_)) or not isinstance(
                value, (int, float, np.integer, np.floating)
            ):
                raise PackingArgumentError(
                    f"invalid packing argument {name}: must be a number, got {value!r}"
                )
            if not (np.isfinite(value) and value >= 0):
                raise PackingArgumentError(
                    f"invalid packing argument {name}: must be finite and >= 0, got {value!r}"
                )

    def rows(self, lengths: IntArray) -> FloatArray:
        """The LLM cost of rows of these lengths."""
        x = lengths.astype(np.float64)
        return self.token * x + self.attention * x * x

    def segments(self, patches: IntArray) -> FloatArray:
        """The vision cost of segments of these patch counts."""
        p = patches.astype(np.float64)
        return self.patch * p + self.patch_attention * p * p


@dataclass(frozen=True, eq=False)
class RankPlacement:
    """Items on ranks: rank ``r`` gets items ``item_indices[rank_offsets[r]:rank_offsets[r+1]]``
    (ascending). Items are rows, or the bins of a packing when one was given."""

    item_ranks: IntArray
    rank_offsets: IntArray
    item_indices: IntArray
    #: LLM cost of the rank's rows plus the vision cost of its unique segments.
    rank_costs: FloatArray
    #: Unique segments per rank: the vision tower's encodes there.
    rank_segments: IntArray
    rank_items: IntArray
    #: Group per item (items sharing a segment), numbered by first item.
    item_groups: IntArray
    #: Groups whose items are on more than one rank.
    split_groups: int
    #: No placement's worst rank costs less.
    lower_bound: float
    #: ``"groups"``, ``"split"``, ``"baseline"`` (the baseline was strictly better) or
    #: ``"given"`` (``placement_of``).
    kind: str
    #: Unique segments over all ranks.
    unique_segments: int

    @property
    def num_ranks(self) -> int:
        return len(self.rank_costs)

    @property
    def worst(self) -> float:
        return float(self.rank_costs.max()) if len(self.rank_costs) else 0.0

    @property
    def imbalance(self) -> float:
        """Worst over mean rank cost (1.0 is perfect balance; 1.0 when all are 0)."""
        mean = float(self.rank_costs.mean()) if len(self.rank_costs) else 0.0
        return self.worst / mean if mean > 0 else 1.0

    @property
    def encodes(self) -> int:
        """Vision encodes over all ranks: each rank encodes each of its unique segments."""
        return int(self.rank_segments.sum())

    def ranks(self) -> list[list[int]]:
        """Item indices per rank as lists."""
        items = self.item_indices.tolist()
        offsets = self.rank_offsets.tolist()
        return [items[a:b] for a, b in itertools.pairwise(offsets)]


def place(
    lengths: Sequence[int] | IntArray,
    num_ranks: int,
    *,
    segments: RowSegments | None = None,
    segment_offsets: Sequence[int] | IntArray | None = None,
    patches: Sequence[int] | IntArray | None = None,
    bins: Packing | tuple[Any, Any] | None = None,
    cost: PlacementCost | None = None,
    tolerance: float = 0.05,
    balance_counts: bool = True,
    baseline: Sequence[int] | IntArray | None = None,
) -> RankPlacement:
    """Places rows of ``lengths`` tokens on ``num_ranks`` ranks.

    ``segments`` lists each row's media segment ids (ids index ``patches``, the patch count of
    every segment; a row may list an id more than once): one sequence per row, or a flat array
    with CSR ``segment_offsets`` (``len(lengths) + 1`` entries), the fast form. With ``bins``
    (a :class:`Packing` of the rows, or its CSR ``(bin_offsets, item_indices)``) the items
    placed are the bins, each
    whole: a bin costs its rows' LLM cost, and its segments are its rows' segments.
    ``balance_counts`` keeps the item counts of the ranks within one of each other (equal when
    the ranks divide the items), as NeMo-RL's sharding needs. ``baseline`` (a rank per item) is
    returned when its worst rank is strictly cheaper.

    Raises ``PackingArgumentError`` (bad argument, segment id out of range, baseline rank out
    of range), ``InvalidLengthError`` (negative length or patch count), ``PackingDtypeError``
    (non-integer input).
    """
    ranks = packing_int(num_ranks, "num_ranks", 1)
    tol = _tolerance(tolerance)
    if not isinstance(balance_counts, (bool, np.bool_)):
        raise PackingArgumentError(
            f"invalid packing argument balance_counts: must be a bool, got {balance_counts!r}"
        )
    inputs = _Inputs.build(
        lengths, segments, segment_offsets, patches, bins, cost or PlacementCost()
    )
    base = None
    if baseline is not None:
        base = lengths_array(baseline, "baseline")
    out = _native.place(
        inputs.item_costs,
        inputs.offsets,
        inputs.ids,
        inputs.segment_costs,
        ranks,
        tolerance=tol,
        balance_counts=bool(balance_counts),
        baseline=base,
    )
    return _result(out, inputs)


def placement_of(
    item_ranks: Sequence[int] | IntArray,
    lengths: Sequence[int] | IntArray,
    num_ranks: int,
    *,
    segments: RowSegments | None = None,
    segment_offsets: Sequence[int] | IntArray | None = None,
    patches: Sequence[int] | IntArray | None = None,
    bins: Packing | tuple[Any, Any] | None = None,
    cost: PlacementCost | None = None,
) -> RankPlacement:
    """What a given placement (a rank per item: per row, or per bin with ``bins``) costs each
    rank, with the same inputs as :func:`place`: for comparing placements made elsewhere."""
    ranks = packing_int(num_ranks, "num_ranks", 1)
    inputs = _Inputs.build(
        lengths, segments, segment_offsets, patches, bins, cost or PlacementCost()
    )
    given = lengths_array(item_ranks, "item_ranks")
    out = _native.placement_costs(
        inputs.item_costs, inputs.offsets, inputs.ids, inputs.segment_costs, ranks, given
    )
    return _result(out, inputs)


def _tolerance(value: Any) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(
        value, (int, float, np.integer, np.floating)
    ):
        raise PackingArgumentError(
            f"invalid packing argument tolerance: must be a number, got {value!r}"
        )
    if not (np.isfinite(value) and value >= 0):
        raise PackingArgumentError(
            f"invalid packing argument tolerance: must be finite and >= 0, got {value!r}"
        )
    return float(value)


@dataclass(frozen=True)
class _Inputs:
    item_costs: FloatArray
    offsets: IntArray
    ids: IntArray
    segment_costs: FloatArray

    @classmethod
    def build(
        cls,
        lengths: Any,
        segments: RowSegments | None,
        segment_offsets: Any,
        patches: Any,
        bins: Packing | tuple[Any, Any] | None,
        cost: PlacementCost,
    ) -> _Inputs:
        if not isinstance(cost, PlacementCost):
            raise PackingArgumentError(
                f"invalid packing argument cost: must be a PlacementCost, got {cost!r}"
            )
        rows = lengths_array(lengths, "lengths")
        _non_negative(rows, "lengths", "row")
        n = len(rows)
        if segments is None:
            if segment_offsets is not None or (
                patches is not None and len(lengths_array(patches, "patches"))
            ):
                raise PackingArgumentError(
                    "invalid packing argument segments: patches or segment_offsets given "
                    "without segments"
                )
            offsets = np.zeros(n + 1, dtype=np.int64)
            ids = np.zeros(0, dtype=np.int64)
            patch_counts = np.zeros(0, dtype=np.int64)
        else:
            if patches is None:
                raise PackingArgumentError(
                    "invalid packing argument patches: needed with segments (a patch count "
                    "per segment id)"
                )
            offsets, ids = _row_segments(segments, segment_offsets, n)
            patch_counts = lengths_array(patches, "patches")
            _non_negative(patch_counts, "patches", "segment")
            bad = np.flatnonzero((ids < 0) | (ids >= len(patch_counts)))
            if len(bad):
                i = int(bad[0])
                raise PackingArgumentError(
                    f"invalid packing argument segments: entry {i} ({int(ids[i])}) names no "
                    f"segment of the {len(patch_counts)} with patches"
                )
        with np.errstate(over="ignore", invalid="ignore"):
            row_costs = cost.rows(rows)
            segment_costs = cost.segments(patch_counts)
        _finite(row_costs, "lengths", "row")
        _finite(segment_costs, "patches", "segment")
        if bins is not None:
            row_costs, offsets, ids = _bin_items(bins, n, row_costs, offsets, ids)
            _finite(row_costs, "bins", "bin")
        return cls(row_costs, offsets, ids, segment_costs)


def _finite(costs: FloatArray, name: str, what: str) -> None:
    bad = np.flatnonzero(~np.isfinite(costs))
    if len(bad):
        raise PackingArgumentError(
            f"invalid packing argument {name}: {what} {int(bad[0])} costs more than a float "
            f"holds under this PlacementCost"
        )


def _non_negative(arr: IntArray, name: str, what: str) -> None:
    bad = np.flatnonzero(arr < 0)
    if len(bad):
        i = int(bad[0])
        raise InvalidLengthError(
            f"invalid packing argument {name}: {what} {i} has {int(arr[i])}, must be >= 0"
        )


def _row_segments(segments: Any, segment_offsets: Any, n: int) -> tuple[IntArray, IntArray]:
    if segment_offsets is not None:
        offsets = lengths_array(segment_offsets, "segment_offsets")
        ids = lengths_array(segments, "segments")
        if len(offsets) != n + 1:
            raise PackingArgumentError(
                f"invalid packing argument segment_offsets: {len(offsets)} offsets for {n} "
                f"rows (needs {n + 1})"
            )
        if offsets[0] != 0 or offsets[-1] != len(ids) or np.any(np.diff(offsets) < 0):
            raise PackingArgumentError(
                f"invalid packing argument segment_offsets: not CSR offsets over the "
                f"{len(ids)} segments (they must start at 0, never decrease and end at "
                f"{len(ids)})"
            )
        return offsets, ids
    rows = _sequence(segments, "segments", "one sequence of segment ids per row")
    if len(rows) != n:
        raise PackingArgumentError(
            f"invalid packing argument segments: {len(rows)} rows of segments for {n} rows"
        )
    per_row = [
        _sequence(s, "segments", f"row {i}: a sequence of segment ids") for i, s in enumerate(rows)
    ]
    counts = np.fromiter((len(s) for s in per_row), dtype=np.int64, count=n)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    flat = [i for s in per_row for i in s]
    ids = lengths_array(flat, "segments") if flat else np.zeros(0, dtype=np.int64)
    return offsets, ids


def _sequence(value: Any, name: str, what: str) -> Sequence[Any]:
    """``value`` as a sequence (a list, tuple or 1-D array), else ``PackingDtypeError``."""
    if isinstance(value, np.ndarray) and value.ndim == 1:
        return list(value.tolist())
    if isinstance(value, (list, tuple)):
        return value
    raise PackingDtypeError(f"{name} must be {what}, got {type(value).__name__}")


def _bin_items(
    bins: Packing | tuple[Any, Any],
    n: int,
    row_costs: FloatArray,
    offsets: IntArray,
    ids: IntArray,
) -> tuple[FloatArray, IntArray, IntArray]:
    """Bins as items: each bin's rows' summed cost, and its rows' segments one after another."""
    if isinstance(bins, Packing):
        bin_offsets, rows = bins.bin_offsets, bins.item_indices
    elif not (isinstance(bins, tuple) and len(bins) == 2):
        raise PackingArgumentError(
            f"invalid packing argument bins: must be a Packing or a (bin_offsets, "
            f"item_indices) pair, got {type(bins).__name__}"
        )
    else:
        bin_offsets = lengths_array(bins[0], "bins offsets")
        rows = lengths_array(bins[1], "bins items")
    if len(bin_offsets) == 0 or bin_offsets[0] != 0 or np.any(np.diff(bin_offsets) < 0):
        raise PackingArgumentError("invalid packing argument bins: offsets are not CSR")
    if bin_offsets[-1] != len(rows):
        raise PackingArgumentError(
            f"invalid packing argument bins: offsets end at {int(bin_offsets[-1])}, not at "
            f"the {len(rows)} rows listed"
        )
    if len(rows) and (rows.min() < 0 or rows.max() >= n):
        raise PackingArgumentError(f"invalid packing argument bins: a row index is not in [0, {n})")
    if len(np.unique(rows)) != len(rows):
        raise PackingArgumentError("invalid packing argument bins: a row is in two bins")
    sizes = np.diff(bin_offsets)
    bin_of_row = np.repeat(np.arange(len(sizes)), sizes)
    item_costs = np.bincount(bin_of_row, weights=row_costs[rows], minlength=len(sizes))
    seg_counts = (offsets[1:] - offsets[:-1])[rows]
    bin_seg_offsets = np.zeros(len(sizes) + 1, dtype=np.int64)
    per_bin = np.bincount(bin_of_row, weights=seg_counts, minlength=len(sizes))
    np.cumsum(per_bin.astype(np.int64), out=bin_seg_offsets[1:])
    # every row's ids, rows in bin order
    starts = offsets[:-1][rows]
    take = np.repeat(starts - np.concatenate(([0], np.cumsum(seg_counts)[:-1])), seg_counts)
    flat = ids[np.arange(int(seg_counts.sum()), dtype=np.int64) + take] if len(take) else ids[:0]
    return item_costs.astype(np.float64), bin_seg_offsets, flat


def _result(out: Any, inputs: _Inputs) -> RankPlacement:
    if not np.all(np.isfinite(out.rank_costs)):
        raise PackingArgumentError(
            "invalid packing argument cost: a rank's summed cost is more than a float holds "
            "under this PlacementCost"
        )
    item_ranks = out.item_ranks
    order = np.argsort(item_ranks, kind="stable").astype(np.int64)
    counts = np.asarray(out.rank_items, dtype=np.int64)
    rank_offsets = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=rank_offsets[1:])
    used = np.unique(inputs.ids)
    return RankPlacement(
        item_ranks=item_ranks,
        rank_offsets=rank_offsets,
        item_indices=order,
        rank_costs=out.rank_costs,
        rank_segments=out.rank_segments,
        rank_items=counts,
        item_groups=out.item_groups,
        split_groups=int(out.split_groups),
        lower_bound=float(out.lower_bound),
        kind=str(out.kind),
        unique_segments=len(used),
    )
