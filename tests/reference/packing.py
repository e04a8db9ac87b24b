"""Plain-Python reference of NeMo-RL's sequence packers (``nemo_rl/data/packing``), written
from the behaviour spec: the same bins, bin order, errors and metrics, with the same
quadratic costs. It is the oracle for mmpack's property tests and the baseline of
``benches/bench_packing.py``; mmpack's fast paths never import it.

Quirks kept on purpose (spec §4, §7.14-15): first-fit-decreasing breaks length ties by the
higher index first; first-fit-shuffle uses the *global* ``random`` state; MFFD rejects
zero lengths and its phase 5 is worst-fit with bins in ascending-fill order; the bin-count
adjustment moves the last item of the largest bins (ties: higher bin index).
"""

from __future__ import annotations

import enum
import math
import random
import statistics
from bisect import bisect_right


class PackingAlgorithm(enum.Enum):
    CONCATENATIVE = "concatenative"
    FIRST_FIT_DECREASING = "first_fit_decreasing"
    FIRST_FIT_SHUFFLE = "first_fit_shuffle"
    MODIFIED_FIRST_FIT_DECREASING = "modified_first_fit_decreasing"


def _too_long(length, capacity):
    return ValueError(f"Sequence length {length} exceeds bin capacity {capacity}")


class SequencePacker:
    """Base class: validation of the constraints, bin-count adjustment, metrics."""

    def __init__(
        self, bin_capacity, collect_metrics=False, min_bin_count=None, bin_count_multiple=None
    ):
        self.bin_capacity = bin_capacity
        self.collect_metrics = collect_metrics
        self.min_bin_count = min_bin_count
        self.bin_count_multiple = bin_count_multiple
        self.metrics = None
        if min_bin_count is not None and min_bin_count < 0:
            raise ValueError("min_bin_count must be nonnegative")
        if bin_count_multiple is not None and bin_count_multiple < 1:
            raise ValueError("bin_count_multiple must be positive")
        if collect_metrics:
            self.metrics = PackingMetrics()

    def _pack_implementation(self, sequence_lengths):
        raise NotImplementedError

    def _adjust_bin_count(self, bins):
        current = len(bins)
        target = current
        if self.min_bin_count is not None:
            target = max(target, self.min_bin_count)
        if self.bin_count_multiple is not None and target % self.bin_count_multiple:
            target += self.bin_count_multiple - target % self.bin_count_multiple
        if target == current:
            return bins
        total = sum(len(b) for b in bins)
        if total < target:
            raise ValueError(
                f"Cannot create {target} bins with only {total} sequences. "
                "Each bin must contain at least one sequence. "
                "Either reduce min_bin_count/bin_count_multiple or provide more sequences."
            )
        out = [list(b) for b in bins] + [[] for _ in range(target - current)]
        donors = sorted(((len(b), i) for i, b in enumerate(bins)), reverse=True)
        d = 0
        for new in range(current, target):
            while d < len(donors):
                src = donors[d][1]
                if len(out[src]) > 1:
                    out[new].append(out[src].pop())
                    break
                d += 1
        return out

    def pack(self, sequence_lengths):
        bins = self._adjust_bin_count(self._pack_implementation(sequence_lengths))
        if self.collect_metrics and self.metrics:
            self.metrics.update(sequence_lengths, bins, self.bin_capacity)
        return bins

    def reset_metrics(self):
        if self.metrics:
            self.metrics.reset()

    def compute_metrics(self, sequence_lengths, bins):
        m = self.metrics if self.metrics else PackingMetrics()
        return m.calculate_stats_only(sequence_lengths, bins, self.bin_capacity)

    def get_aggregated_metrics(self):
        return self.metrics.get_aggregated_stats() if self.metrics else {}


class ConcatenativePacker(SequencePacker):
    max_sequences_per_bin = -1

    def _pack_implementation(self, sequence_lengths):
        for length in sequence_lengths:
            if length > self.bin_capacity:
                raise _too_long(length, self.bin_capacity)
        bins, current, load = [], [], 0
        for i, length in enumerate(sequence_lengths):
            full = self.max_sequences_per_bin != -1 and len(current) >= self.max_sequences_per_bin
            if load + length > self.bin_capacity or full:
                if current:
                    bins.append(current)
                current, load = [i], length
            else:
                current.append(i)
                load += length
        if current:
            bins.append(current)
        return bins


class _FirstFit(SequencePacker):
    def _order(self, sequence_lengths):
        raise NotImplementedError

    def _pack_implementation(self, sequence_lengths):
        bins, remaining = [], []
        for length, idx in self._order(sequence_lengths):
            if length > self.bin_capacity:
                raise _too_long(length, self.bin_capacity)
            for b, rem in enumerate(remaining):  # the linear scan: O(n * bins)
                if rem >= length:
                    bins[b].append(idx)
                    remaining[b] -= length
                    break
            else:
                bins.append([idx])
                remaining.append(self.bin_capacity - length)
        return bins


class FirstFitDecreasingPacker(_FirstFit):
    def _order(self, sequence_lengths):
        return sorted(((length, i) for i, length in enumerate(sequence_lengths)), reverse=True)


class FirstFitShufflePacker(_FirstFit):
    def _order(self, sequence_lengths):
        pairs = [(length, i) for i, length in enumerate(sequence_lengths)]
        random.shuffle(pairs)  # the global random state, as NeMo-RL does
        return pairs


class ModifiedFirstFitDecreasingPacker(SequencePacker):
    def _pack_implementation(self, sequence_lengths):
        c = self.bin_capacity
        if c <= 0:
            raise ValueError("bin_capacity must be positive")
        if any(length <= 0 for length in sequence_lengths):
            raise ValueError("sequence lengths must be positive")
        for length in sequence_lengths:
            if length > c:
                raise _too_long(length, c)
        large, medium, small, tiny = [], [], [], []
        for i, s in enumerate(sequence_lengths):
            if s > c / 2:
                large.append((i, s))
            elif s > c / 3:
                medium.append((i, s))
            elif s > c / 6:
                small.append((i, s))
            else:
                tiny.append((i, s))
        large.sort(key=lambda x: x[1], reverse=True)
        medium.sort(key=lambda x: x[1], reverse=True)
        small.sort(key=lambda x: x[1])
        tiny.sort(key=lambda x: x[1])

        bins = [[item] for item in large]  # phase 1
        for b in bins:  # phase 2: the largest medium that fits, one per bin
            rem = c - sum(s for _, s in b)
            for k, (_, s) in enumerate(medium):
                if s <= rem:
                    b.append(medium.pop(k))
                    break
        for b in reversed(bins):  # phase 3: two smalls into bins without a medium
            if any(c / 3 < s <= c / 2 for _, s in b) or len(small) < 2:
                continue
            rem = c - sum(s for _, s in b)
            if small[0][1] + small[1][1] > rem:
                continue
            first = small.pop(0)
            for k in range(len(small) - 1, -1, -1):
                if small[k][1] <= rem - first[1]:
                    b.extend([first, small.pop(k)])
                    break
        rest = sorted(medium + small + tiny, key=lambda x: x[1], reverse=True)
        for b in bins:  # phase 4: greedy fill of the phase-1 bins
            while rest:
                rem = c - sum(s for _, s in b)
                if rem < rest[-1][1]:
                    break
                k = next((k for k, (_, s) in enumerate(rest) if s <= rem), None)
                if k is None:
                    break
                b.append(rest.pop(k))
        # phase 5: least-filled bin if it fits, else a new one; bins sorted by fill
        tail, fills = [[]], [0]
        for item in sorted(rest, key=lambda x: x[1], reverse=True):
            if item[1] <= c - fills[0]:
                b, f = tail.pop(0), fills.pop(0)
            else:
                b, f = [], 0
            b.append(item)
            f += item[1]
            k = bisect_right(fills, f)
            tail.insert(k, b)
            fills.insert(k, f)
        return [[i for i, _ in b] for b in bins + tail if b]


_PACKERS = {
    PackingAlgorithm.CONCATENATIVE: ConcatenativePacker,
    PackingAlgorithm.FIRST_FIT_DECREASING: FirstFitDecreasingPacker,
    PackingAlgorithm.FIRST_FIT_SHUFFLE: FirstFitShufflePacker,
    PackingAlgorithm.MODIFIED_FIRST_FIT_DECREASING: ModifiedFirstFitDecreasingPacker,
}


def get_packer(
    algorithm, bin_capacity, collect_metrics=False, min_bin_count=None, bin_count_multiple=None
):
    names = ", ".join(a.name for a in PackingAlgorithm)
    if isinstance(algorithm, str):
        try:
            algorithm = PackingAlgorithm[algorithm.upper()]
        except KeyError:
            raise ValueError(
                f"Unknown packing algorithm: {algorithm}. Available algorithms: {names}"
            ) from None
    if algorithm not in _PACKERS:
        raise ValueError(f"Unknown packing algorithm: {algorithm}. Available algorithms: {names}")
    return _PACKERS[algorithm](
        bin_capacity,
        collect_metrics=collect_metrics,
        min_bin_count=min_bin_count,
        bin_count_multiple=bin_count_multiple,
    )


class PackingMetrics:
    """Per-call and aggregated packing statistics (spec §4.5)."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.total_sequences = 0
        self.total_bins = 0
        self.total_sequence_length = 0
        self.total_bin_capacity = 0
        self.total_waste = 0
        self.bin_utilizations = []
        self.bin_counts = []
        self.packing_times = []
        self.min_utilization = 1.0
        self.max_utilization = 0.0
        self.min_waste_ratio = 1.0
        self.max_waste_ratio = 0.0

    def calculate_stats_only(self, sequence_lengths, bins, bin_capacity):
        if not bins:
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
        loads = [sum(sequence_lengths[i] for i in b) for b in bins]
        total = sum(sequence_lengths)
        capacity = len(bins) * bin_capacity
        waste = capacity - total
        utilization = total / capacity
        per_bin = [load / bin_capacity for load in loads]
        balance = 1.0 - statistics.stdev(per_bin) / utilization if len(bins) > 1 else 1.0
        theoretical = math.ceil(total / bin_capacity)
        return {
            "num_sequences": len(sequence_lengths),
            "num_bins": len(bins),
            "total_sequence_length": total,
            "total_bin_capacity": capacity,
            "total_waste": waste,
            "average_utilization": utilization,
            "waste_ratio": waste / capacity,
            "bin_balance": balance,
            "theoretical_min_bins": theoretical,
            "bin_efficiency": theoretical / len(bins),
        }

    def update(self, sequence_lengths, bins, bin_capacity, packing_time=None):
        stats = self.calculate_stats_only(sequence_lengths, bins, bin_capacity)
        self.total_sequences += len(sequence_lengths)
        self.total_bins += len(bins)
        self.total_sequence_length += sum(sequence_lengths)
        self.total_bin_capacity += len(bins) * bin_capacity
        self.total_waste += stats["total_waste"]
        self.bin_utilizations.append(stats["average_utilization"])
        self.bin_counts.append(len(bins))
        if packing_time is not None:
            self.packing_times.append(packing_time)
        self.min_utilization = min(self.min_utilization, stats["average_utilization"])
        self.max_utilization = max(self.max_utilization, stats["average_utilization"])
        self.min_waste_ratio = min(self.min_waste_ratio, stats["waste_ratio"])
        self.max_waste_ratio = max(self.max_waste_ratio, stats["waste_ratio"])
        return stats

    def get_aggregated_stats(self):
        if not self.bin_utilizations:
            return {}
        cap = self.total_bin_capacity
        stats = {
            "total_sequences": self.total_sequences,
            "total_bins": self.total_bins,
            "average_utilization": self.total_sequence_length / cap if cap > 0 else 0.0,
            "min_utilization": self.min_utilization,
            "max_utilization": self.max_utilization,
            "average_waste_ratio": self.total_waste / cap if cap > 0 else 0.0,
            "min_waste_ratio": self.min_waste_ratio,
            "max_waste_ratio": self.max_waste_ratio,
            "average_bin_count": sum(self.bin_counts) / len(self.bin_counts),
            "bin_efficiency": (
                math.ceil(self.total_sequence_length / (cap / self.total_bins)) / self.total_bins
                if self.total_bins > 0
                else 0.0
            ),
        }
        if self.packing_times:
            stats["average_packing_time"] = sum(self.packing_times) / len(self.packing_times)
        return stats
