"""NeMo-RL's packing API (``nemo_rl.data.packing``) on mmpack's core: ``get_packer``,
``SequencePacker`` and its four subclasses, ``PackingAlgorithm`` and ``PackingMetrics``.

``get_packer(...)`` is a drop-in for ``nemo_rl.data.packing.get_packer``: same algorithm names,
same ``list[list[int]]`` output (exactly NeMo-RL's bins and bin order), same errors and metrics,
computed in ``O(n log n)`` by the Rust core. ``SequencePacker.pack_flat`` returns the flat
:class:`mmpack.packing.Packing` instead of per-bin lists.
"""

from __future__ import annotations

import enum
import math
import statistics
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

from mmpack import _native
from mmpack._coerce import I64_MIN, lengths_array, packing_int
from mmpack.errors import InvalidLengthError, ItemTooLargeError, PackingArgumentError
from mmpack.packing.pyrandom import shuffle_order
from mmpack.packing.result import Packing

__all__ = [
    "ConcatenativePacker",
    "FirstFitDecreasingPacker",
    "FirstFitShufflePacker",
    "ModifiedFirstFitDecreasingPacker",
    "PackingAlgorithm",
    "PackingMetrics",
    "SequencePacker",
    "get_packer",
]


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
    integer below ``minimum``; ``packing_int``'s for a non-integer or one beyond ``int64``."""
    checked = packing_int(value, name, I64_MIN)
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
        arr = lengths_array(sequence_lengths, "sequence_lengths")
        # checked here, not at construction: NeMo-RL reads the attribute when it packs
        cap = _facade_int("bin_capacity", self.bin_capacity, 1, "positive")
        alg = self.algorithm
        mffd = alg is PackingAlgorithm.MODIFIED_FIRST_FIT_DECREASING
        order = None
        if alg is PackingAlgorithm.FIRST_FIT_SHUFFLE:
            order = shuffle_order(len(arr), None)  # NeMo-RL shuffles the global state
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
            item_lengths=arr,
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
