"""Sample packing: variable-length samples into fixed-capacity bins, with a Rust core.

``pack(lengths, capacity, ...)`` takes a 1-D integer array (numpy ``int64`` is used without a
copy; other integer dtypes and lists are converted) and returns a flat :class:`Packing`:
``bin_offsets`` / ``item_indices`` as ``int64`` CSR arrays, per-bin loads, efficiency and the
lower bound ``ceil(sum / capacity)``. Every item lands in exactly one bin, or is listed in
``Packing.oversize``; no bin exceeds the token budget, the media budget or the item cap.

Algorithms (``ALGORITHMS``):

- ``concatenative``, ``first_fit_decreasing``, ``first_fit_shuffle``,
  ``modified_first_fit_decreasing``: NeMo-RL's algorithms with exactly its bins and bin order,
  in ``O(n log n)`` instead of ``O(n * bins)``. ``first_fit_shuffle`` shuffles exactly as
  ``random.Random(seed).shuffle`` does.
- ``best_fit_decreasing`` (default): counting sort + bins bucketed by remaining capacity with
  a hierarchical bitset: ``O(n + capacity)``.
- ``minimum_bin_slack``: the improvement algorithm. Builds bins one at a time, each the
  largest remaining item plus the subset of the rest that leaves the least slack, found by a
  depth-first search of at most ``search_budget`` nodes per bin. Candidates are that result,
  its near-perfect prefix followed by best-fit decreasing on the remaining items (four
  tolerances), and plain best-fit decreasing; the fewest bins wins, so it never uses more bins
  than best fit and uses fewer on hard inputs (many items between a quarter and a half of the
  capacity). Time bound: ``O(n log n + bins * search_budget * log D)`` (D distinct lengths);
  about 0.5-1 s per million items at the default budget of 256. Tokens and
  ``max_items_per_bin`` only (no media budget).

``get_packer(...)`` is a drop-in for ``nemo_rl.data.packing.get_packer``: same algorithm names,
same ``list[list[int]]`` output, same errors and metrics.
"""

from __future__ import annotations

import enum
import itertools
import math
import operator
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
from numpy.typing import NDArray

from mmpack import _native
from mmpack.errors import (
    InvalidLengthError,
    ItemTooLargeError,
    PackingArgumentError,
    PackingDtypeError,
)

__all__ = [
    "ALGORITHMS",
    "ConcatenativePacker",
    "FirstFitDecreasingPacker",
    "FirstFitShufflePacker",
    "ModifiedFirstFitDecreasingPacker",
    "Packing",
    "PackingAlgorithm",
    "PackingMetrics",
    "RankAssignment",
    "SequencePacker",
    "assign_to_ranks",
    "get_packer",
    "pack",
]

#: Every algorithm ``pack`` accepts.
ALGORITHMS: tuple[str, ...] = (
    "best_fit_decreasing",
    "first_fit_decreasing",
    "first_fit_shuffle",
    "modified_first_fit_decreasing",
    "concatenative",
    "minimum_bin_slack",
)
_ALIASES = {"bfd": "best_fit_decreasing", "ffd": "first_fit_decreasing", "mbs": "minimum_bin_slack"}
_ON_OVERSIZE = ("error", "skip", "truncate")
_RANK_COSTS = ("tokens", "tokens_squared")

IntArray = NDArray[np.int64]
_I64_MAX = 2**63 - 1


# ----------------------------------------------------------------------------- inputs


def _as_int64(values: Any, name: str) -> IntArray:
    """A 1-D ``int64`` array: numpy ``int64`` passes through without a copy (made contiguous
    if needed); other integer dtypes and sequences are converted; floats, bools, strings and
    objects raise ``PackingDtypeError``."""
    if isinstance(values, np.ndarray):
        arr = values
    else:
        try:
            arr = np.asarray(values)
        except (OverflowError, ValueError, TypeError) as exc:
            raise PackingDtypeError(f"{name} must be a 1-D sequence of integers: {exc}") from None
        if arr.size == 0 and arr.dtype.kind == "f":  # [] -> float64
            arr = arr.astype(np.int64)
    if arr.ndim != 1:
        raise PackingDtypeError(f"{name} must be 1-D, got an array of shape {arr.shape}")
    kind = arr.dtype.kind
    if kind not in "iu":
        what = {"b": "bools", "f": "floats", "c": "complex numbers"}.get(kind, str(arr.dtype))
        raise PackingDtypeError(
            f"{name} must be integers, got {what} (dtype {arr.dtype}); convert explicitly, "
            "e.g. np.asarray(x).astype(np.int64), after checking the values are whole"
        )
    if arr.dtype == np.uint64 and arr.size and int(arr.max()) > _I64_MAX:
        bad = int(np.argmax(arr > _I64_MAX))
        raise ItemTooLargeError(f"item {bad} has {name[:-1]} {int(arr[bad])}, beyond int64")
    return np.ascontiguousarray(arr, dtype=np.int64)


def _int_arg(name: str, value: Any, minimum: int) -> int:
    """``value`` as an ``int`` in ``[minimum, 2**63 - 1]`` (the core's ``int64``), else
    ``PackingArgumentError`` naming the argument."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise PackingArgumentError(
            f"invalid packing argument {name}: must be an integer, got {value!r}"
        )
    value = operator.index(value)
    if value < minimum:
        raise PackingArgumentError(
            f"invalid packing argument {name}: must be >= {minimum}, got {value}"
        )
    if value > _I64_MAX:
        raise PackingArgumentError(
            f"invalid packing argument {name}: must be <= 2**63 - 1, got {value}"
        )
    return value


def _opt_int_arg(name: str, value: Any, minimum: int) -> int | None:
    return None if value is None else _int_arg(name, value, minimum)


def _algorithm_name(algorithm: Any) -> str:
    if isinstance(algorithm, PackingAlgorithm):
        return algorithm.value
    if isinstance(algorithm, str):
        key = algorithm.lower()
        key = _ALIASES.get(key, key)
        if key in ALGORITHMS:
            return key
    raise PackingArgumentError(
        f"invalid packing argument algorithm: unknown algorithm {algorithm!r}; "
        f"known: {', '.join(ALGORITHMS)}"
    )


def _shuffle_order(n: int, rng: random.Random | None) -> IntArray:
    """``random.shuffle(list(range(n)))`` done in Rust from ``rng``'s state (the global
    ``random`` module when ``rng`` is None), advancing that state exactly as Python would."""
    source: Any = random if rng is None else rng
    version, words, gauss = source.getstate()
    state = np.array(words[:624], dtype=np.uint32)
    shuffled = _native.shuffle_permutation(state, int(words[624]), n)
    source.setstate((version, (*shuffled.state.tolist(), shuffled.pos), gauss))
    return shuffled.permutation


# ----------------------------------------------------------------------------- results


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
    _lengths: IntArray | None = None

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


def pack(
    lengths: Sequence[int] | NDArray[np.integer[Any]],
    capacity: int,
    *,
    algorithm: str = "best_fit_decreasing",
    max_items_per_bin: int | None = None,
    media: Sequence[int] | NDArray[np.integer[Any]] | None = None,
    media_capacity: int | None = None,
    min_bins: int | None = None,
    bins_multiple_of: int | None = None,
    seed: int = 0,
    on_oversize: str = "error",
    search_budget: int = 256,
) -> Packing:
    """Packs items of the given ``lengths`` into bins of ``capacity`` tokens.

    ``media`` / ``media_capacity`` add a second budget (image tiles, audio frames) that every
    bin also respects; ``max_items_per_bin`` caps the item count. ``min_bins`` /
    ``bins_multiple_of`` then raise the bin count NeMo-RL's way (moving single items into new
    bins). ``seed`` drives ``first_fit_shuffle`` only. ``on_oversize``: ``"error"`` raises
    ``ItemTooLargeError`` naming the first item over a budget; ``"skip"`` leaves such items out
    and lists them in ``Packing.oversize``; ``"truncate"`` packs an over-long item as if it had
    ``capacity`` tokens (the caller truncates it) and lists it too (media cannot be truncated:
    an item over the media budget is still an error).

    Raises ``InvalidLengthError`` (zero/negative length, negative media),
    ``ItemTooLargeError``, ``PackingArgumentError``, ``BinCountError`` (more bins asked than
    items) and ``PackingDtypeError`` (non-integer input). Deterministic for equal inputs.
    """
    name = _algorithm_name(algorithm)
    cap = _int_arg("capacity", capacity, 1)
    max_items = _opt_int_arg("max_items_per_bin", max_items_per_bin, 1)
    min_b = _opt_int_arg("min_bins", min_bins, 0)
    multiple = _opt_int_arg("bins_multiple_of", bins_multiple_of, 1)
    budget = _int_arg("search_budget", search_budget, 0)
    if on_oversize not in _ON_OVERSIZE:
        raise PackingArgumentError(
            f"invalid packing argument on_oversize: {on_oversize!r}; "
            f"known: {', '.join(_ON_OVERSIZE)}"
        )
    arr = _as_int64(lengths, "lengths")
    med = None if media is None else _as_int64(media, "media")
    med_cap = _opt_int_arg("media_capacity", media_capacity, 0)
    order = None
    if name == "first_fit_shuffle":
        seed_value = _int_arg("seed", seed, -(2**63))
        order = _shuffle_order(len(arr), random.Random(seed_value))
    out = _native.pack(
        arr,
        cap,
        name,
        media=med,
        media_capacity=med_cap,
        max_items_per_bin=max_items,
        min_bins=min_b,
        bins_multiple_of=multiple,
        on_oversize=on_oversize,
        order=order,
        search_budget=budget,
    )
    return Packing(
        bin_offsets=out.bin_offsets,
        item_indices=out.item_indices,
        bin_loads=out.bin_loads,
        oversize=out.oversize,
        capacity=cap,
        algorithm=name,
        total_length=out.total_length,
        bin_media=out.bin_media,
        media_capacity=med_cap,
        on_oversize=on_oversize,
        _lengths=arr,
    )


# ----------------------------------------------------------------------------- ranks


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
    ranks = _int_arg("num_ranks", num_ranks, 1)
    if cost not in _RANK_COSTS:
        raise PackingArgumentError(
            f"invalid packing argument cost: {cost!r}; known: {', '.join(_RANK_COSTS)}"
        )
    lengths = packing._lengths
    if lengths is None:
        raise PackingArgumentError("invalid packing argument packing: has no lengths attached")
    if packing.on_oversize == "truncate" and len(packing.oversize):
        lengths = np.minimum(lengths, packing.capacity)
    out = _native.assign_to_ranks(packing.bin_offsets, packing.item_indices, lengths, ranks, cost)
    return RankAssignment(out.rank_offsets, out.bin_indices, out.rank_costs, out.bin_costs, cost)


# ----------------------------------------------------------------------------- NeMo-RL facade


class PackingAlgorithm(enum.Enum):
    """NeMo-RL's algorithm enum (same names and values)."""

    CONCATENATIVE = "concatenative"
    FIRST_FIT_DECREASING = "first_fit_decreasing"
    FIRST_FIT_SHUFFLE = "first_fit_shuffle"
    MODIFIED_FIRST_FIT_DECREASING = "modified_first_fit_decreasing"


class PackingMetrics:
    """NeMo-RL's ``PackingMetrics``: per-call statistics and aggregates over calls."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.total_sequences = 0
        self.total_bins = 0
        self.total_sequence_length = 0
        self.total_bin_capacity = 0
        self.total_waste = 0
        self.bin_utilizations: list[float] = []
        self.bin_counts: list[int] = []
        self.packing_times: list[float] = []
        self.min_utilization = 1.0
        self.max_utilization = 0.0
        self.min_waste_ratio = 1.0
        self.max_waste_ratio = 0.0

    @staticmethod
    def _stats(
        num_sequences: int, total: int, loads: Sequence[int], bin_capacity: int
    ) -> dict[str, Any]:
        num_bins = len(loads)
        if num_bins == 0:
            return {
                "num_sequences": 0,
                "num_bins": 0,
                "total_sequence_length": 0,
                "total_bin_capacity": 0,
                "total_waste": 0,
                "average_utilization": 0.0,
                "waste_ratio": 0.0,
                "bin_balance": 0.0,
                "theoretical_min_bins": 0,
                "bin_efficiency": 0.0,
            }
        capacity = num_bins * bin_capacity
        waste = capacity - total
        utilization = total / capacity
        if num_bins > 1:
            per_bin = [load / bin_capacity for load in loads]
            balance = 1.0 - statistics.stdev(per_bin) / utilization
        else:
            balance = 1.0
        theoretical = math.ceil(total / bin_capacity)
        return {
            "num_sequences": num_sequences,
            "num_bins": num_bins,
            "total_sequence_length": total,
            "total_bin_capacity": capacity,
            "total_waste": waste,
            "average_utilization": utilization,
            "waste_ratio": waste / capacity,
            "bin_balance": balance,
            "theoretical_min_bins": theoretical,
            "bin_efficiency": theoretical / num_bins,
        }

    def calculate_stats_only(
        self, sequence_lengths: Sequence[int], bins: Sequence[Sequence[int]], bin_capacity: int
    ) -> dict[str, Any]:
        loads = [sum(sequence_lengths[i] for i in b) for b in bins]
        return self._stats(len(sequence_lengths), sum(sequence_lengths), loads, bin_capacity)

    def _record(self, stats: dict[str, Any], packing_time: float | None) -> None:
        self.total_sequences += stats["_n"]
        self.total_bins += stats["num_bins"]
        self.total_sequence_length += stats["_total"]
        self.total_bin_capacity += stats["_capacity"]
        self.total_waste += stats["total_waste"]
        self.bin_utilizations.append(stats["average_utilization"])
        self.bin_counts.append(stats["num_bins"])
        if packing_time is not None:
            self.packing_times.append(packing_time)
        self.min_utilization = min(self.min_utilization, stats["average_utilization"])
        self.max_utilization = max(self.max_utilization, stats["average_utilization"])
        self.min_waste_ratio = min(self.min_waste_ratio, stats["waste_ratio"])
        self.max_waste_ratio = max(self.max_waste_ratio, stats["waste_ratio"])

    def _update_from_loads(
        self,
        num_sequences: int,
        total: int,
        loads: Sequence[int],
        bin_capacity: int,
        packing_time: float | None = None,
    ) -> dict[str, Any]:
        stats = self._stats(num_sequences, total, loads, bin_capacity)
        extra = {"_n": num_sequences, "_total": total, "_capacity": len(loads) * bin_capacity}
        self._record({**stats, **extra}, packing_time)
        return stats

    def update(
        self,
        sequence_lengths: Sequence[int],
        bins: Sequence[Sequence[int]],
        bin_capacity: int,
        packing_time: float | None = None,
    ) -> dict[str, Any]:
        loads = [sum(sequence_lengths[i] for i in b) for b in bins]
        return self._update_from_loads(
            len(sequence_lengths), sum(sequence_lengths), loads, bin_capacity, packing_time
        )

    def get_aggregated_stats(self) -> dict[str, Any]:
        if not self.bin_utilizations:
            return {}
        cap = self.total_bin_capacity
        bins = self.total_bins
        stats: dict[str, Any] = {
            "total_sequences": self.total_sequences,
            "total_bins": bins,
            "average_utilization": self.total_sequence_length / cap if cap > 0 else 0.0,
            "min_utilization": self.min_utilization,
            "max_utilization": self.max_utilization,
            "average_waste_ratio": self.total_waste / cap if cap > 0 else 0.0,
            "min_waste_ratio": self.min_waste_ratio,
            "max_waste_ratio": self.max_waste_ratio,
            "average_bin_count": sum(self.bin_counts) / len(self.bin_counts),
            "bin_efficiency": (
                math.ceil(self.total_sequence_length / (cap / bins)) / bins if bins > 0 else 0.0
            ),
        }
        if self.packing_times:
            stats["average_packing_time"] = sum(self.packing_times) / len(self.packing_times)
        return stats

    def print_aggregated_stats(self) -> None:
        stats = self.get_aggregated_stats()
        if not stats:
            print("No metrics collected yet.")
            return
        print("\n=== Packing Metrics Summary ===")
        print(f"Total sequences packed: {stats['total_sequences']}")
        print(f"Total bins used: {stats['total_bins']}")
        print(
            f"Average bin utilization: {stats['average_utilization']:.4f} "
            f"(min: {stats['min_utilization']:.4f}, max: {stats['max_utilization']:.4f})"
        )
        print(
            f"Average waste ratio: {stats['average_waste_ratio']:.4f} "
            f"(min: {stats['min_waste_ratio']:.4f}, max: {stats['max_waste_ratio']:.4f})"
        )
        print(f"Bin efficiency (theoretical min bins / actual bins): {stats['bin_efficiency']:.4f}")
        if "average_packing_time" in stats:
            print(f"Average packing time: {stats['average_packing_time']:.6f} seconds")
        print("===============================\n")


def _facade_int(name: str, value: Any, minimum: int, rule: str) -> int:
    """A NeMo-RL facade argument: NeMo-RL's message (``"{name} must be {rule}"``) for an
    integer below ``minimum``; ``_int_arg``'s for a non-integer or one beyond ``int64``."""
    checked = _int_arg(name, value, -(2**63))
    if checked < minimum:
        raise PackingArgumentError(f"{name} must be {rule}")
    return checked


def _too_long(length: int, capacity: int) -> ItemTooLargeError:
    return ItemTooLargeError(f"Sequence length {length} exceeds bin capacity {capacity}")


class SequencePacker:
    """NeMo-RL-compatible packer: ``pack(list[int]) -> list[list[int]]`` with exactly NeMo-RL's
    bins, bin order and error messages (as ``ValueError`` subclasses from ``mmpack.errors``),
    computed by mmpack's ``O(n log n)`` core.

    Conscious differences: negative lengths raise ``InvalidLengthError`` for every algorithm
    (NeMo-RL accepts them outside MFFD); a non-positive ``bin_capacity`` raises
    ``PackingArgumentError("bin_capacity must be positive")`` for every algorithm (NeMo-RL only
    checks it in MFFD); float lengths raise ``PackingDtypeError``.
    """

    algorithm: ClassVar[PackingAlgorithm]

    def __init__(
        self,
        bin_capacity: int,
        collect_metrics: bool = False,
        min_bin_count: int | None = None,
        bin_count_multiple: int | None = None,
    ) -> None:
        self.bin_capacity = bin_capacity
        self.collect_metrics = collect_metrics
        if min_bin_count is not None:
            min_bin_count = _facade_int("min_bin_count", min_bin_count, 0, "nonnegative")
        if bin_count_multiple is not None:
            bin_count_multiple = _facade_int(
                "bin_count_multiple", bin_count_multiple, 1, "positive"
            )
        self.min_bin_count = min_bin_count
        self.bin_count_multiple = bin_count_multiple
        self.metrics: PackingMetrics | None = None
        if collect_metrics:
            self.metrics = PackingMetrics()

    def _pack_flat(self, sequence_lengths: Sequence[int]) -> Packing:
        arr = _as_int64(sequence_lengths, "sequence_lengths")
        # checked here, not at construction: NeMo-RL reads the attribute when it packs
        cap = _facade_int("bin_capacity", self.bin_capacity, 1, "positive")
        alg = self.algorithm
        mffd = alg is PackingAlgorithm.MODIFIED_FIRST_FIT_DECREASING
        order = None
        if alg is PackingAlgorithm.FIRST_FIT_SHUFFLE:
            order = _shuffle_order(len(arr), None)  # NeMo-RL shuffles the global state
        # NeMo-RL's errors and their order; one min and one max pass over valid input
        if len(arr):
            lowest = int(arr.min())
            if mffd and lowest <= 0:
                raise InvalidLengthError("sequence lengths must be positive")
            if lowest < 0:
                bad = int(np.argmax(arr < 0))
                raise InvalidLengthError(
                    f"item {bad} has length {int(arr[bad])}; lengths must be >= 0"
                )
            if int(arr.max()) > cap:
                over = arr > cap
                if alg is PackingAlgorithm.FIRST_FIT_DECREASING:
                    raise _too_long(int(arr.max()), cap)
                if order is not None:
                    first = int(order[np.argmax(over[order])])
                else:
                    first = int(np.argmax(over))
                raise _too_long(int(arr[first]), cap)
        out = _native.pack(
            arr,
            cap,
            alg.value,
            min_bins=self.min_bin_count,
            bins_multiple_of=self.bin_count_multiple,
            order=order,
            allow_zero=not mffd,
        )
        return Packing(
            out.bin_offsets,
            out.item_indices,
            out.bin_loads,
            out.oversize,
            cap,
            alg.value,
            out.total_length,
            _lengths=arr,
        )

    def pack(self, sequence_lengths: Sequence[int]) -> list[list[int]]:
        """Packs and returns bins as lists of indices into ``sequence_lengths``."""
        return self.pack_flat(sequence_lengths).bins()

    def pack_flat(self, sequence_lengths: Sequence[int]) -> Packing:
        """Like ``pack`` but returns the flat :class:`Packing` (no per-bin lists)."""
        packing = self._pack_flat(sequence_lengths)
        if self.collect_metrics and self.metrics:
            self.metrics._update_from_loads(
                len(packing.item_indices),
                packing.total_length,
                packing.bin_loads.tolist(),
                self.bin_capacity,
            )
        return packing

    def reset_metrics(self) -> None:
        if self.metrics:
            self.metrics.reset()

    def compute_metrics(
        self, sequence_lengths: Sequence[int], bins: Sequence[Sequence[int]]
    ) -> dict[str, Any]:
        metrics = self.metrics if self.metrics else PackingMetrics()
        return metrics.calculate_stats_only(sequence_lengths, bins, self.bin_capacity)

    def get_aggregated_metrics(self) -> dict[str, Any]:
        return self.metrics.get_aggregated_stats() if self.metrics else {}

    def print_metrics(self) -> None:
        if not self.metrics:
            print("Metrics collection is not enabled. Initialize with collect_metrics=True.")
            return
        self.metrics.print_aggregated_stats()


class ConcatenativePacker(SequencePacker):
    algorithm = PackingAlgorithm.CONCATENATIVE


class FirstFitDecreasingPacker(SequencePacker):
    algorithm = PackingAlgorithm.FIRST_FIT_DECREASING


class FirstFitShufflePacker(SequencePacker):
    algorithm = PackingAlgorithm.FIRST_FIT_SHUFFLE


class ModifiedFirstFitDecreasingPacker(SequencePacker):
    algorithm = PackingAlgorithm.MODIFIED_FIRST_FIT_DECREASING


_PACKERS: dict[PackingAlgorithm, type[SequencePacker]] = {
    PackingAlgorithm.CONCATENATIVE: ConcatenativePacker,
    PackingAlgorithm.FIRST_FIT_DECREASING: FirstFitDecreasingPacker,
    PackingAlgorithm.FIRST_FIT_SHUFFLE: FirstFitShufflePacker,
    PackingAlgorithm.MODIFIED_FIRST_FIT_DECREASING: ModifiedFirstFitDecreasingPacker,
}


def get_packer(
    algorithm: PackingAlgorithm | str,
    bin_capacity: int,
    collect_metrics: bool = False,
    min_bin_count: int | None = None,
    bin_count_multiple: int | None = None,
) -> SequencePacker:
    """NeMo-RL's ``get_packer``: ``algorithm`` is a :class:`PackingAlgorithm` (NeMo-RL's own
    enum members are accepted too, by value) or a case-insensitive enum name."""
    names = ", ".join(a.name for a in PackingAlgorithm)
    resolved: PackingAlgorithm | None = None
    if isinstance(algorithm, PackingAlgorithm):
        resolved = algorithm
    elif isinstance(algorithm, str):
        resolved = PackingAlgorithm.__members__.get(algorithm.upper())
    elif isinstance(algorithm, enum.Enum) and type(algorithm).__name__ == "PackingAlgorithm":
        resolved = next((a for a in PackingAlgorithm if a.value == algorithm.value), None)
    if resolved is None:
        raise PackingArgumentError(
            f"Unknown packing algorithm: {algorithm}. Available algorithms: {names}"
        )
    return _PACKERS[resolved](
        bin_capacity,
        collect_metrics=collect_metrics,
        min_bin_count=min_bin_count,
        bin_count_multiple=bin_count_multiple,
    )
