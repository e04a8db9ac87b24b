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

``assign_to_ranks`` / ``RankAssignment`` (bins over data-parallel ranks) live in
``mmpack.ranks`` and are re-exported here. NeMo-RL's packer API (``get_packer``,
``SequencePacker``, ``PackingAlgorithm``, ``PackingMetrics``) lives in
``mmpack.compat.nemo_rl_packing``.
"""

from __future__ import annotations

import enum
import random
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from mmpack import _native
from mmpack._coerce import I64_MIN, lengths_array, optional_packing_int, packing_int
from mmpack.errors import PackingArgumentError
from mmpack.ranks import RankAssignment, assign_to_ranks

__all__ = [
    "ALGORITHMS",
    "Packing",
    "RankAssignment",
    "assign_to_ranks",
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

IntArray = NDArray[np.int64]


# ----------------------------------------------------------------------------- inputs


def _algorithm_name(algorithm: Any) -> str:
    """The canonical name of ``algorithm``: a name of ``ALGORITHMS`` or an alias, any case, or
    a member of ``mmpack.compat.nemo_rl_packing.PackingAlgorithm``."""
    if isinstance(algorithm, str):
        key = algorithm.lower()
        key = _ALIASES.get(key, key)
        if key in ALGORITHMS:
            return key
    elif isinstance(algorithm, enum.Enum):
        # imported here: the NeMo-RL facade builds on this module
        from mmpack.compat.nemo_rl_packing import PackingAlgorithm

        if isinstance(algorithm, PackingAlgorithm):
            return algorithm.value
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
    cap = packing_int(capacity, "capacity", 1)
    max_items = optional_packing_int(max_items_per_bin, "max_items_per_bin", 1)
    min_b = optional_packing_int(min_bins, "min_bins", 0)
    multiple = optional_packing_int(bins_multiple_of, "bins_multiple_of", 1)
    budget = packing_int(search_budget, "search_budget", 0)
    if on_oversize not in _ON_OVERSIZE:
        raise PackingArgumentError(
            f"invalid packing argument on_oversize: {on_oversize!r}; "
            f"known: {', '.join(_ON_OVERSIZE)}"
        )
    arr = lengths_array(lengths, "lengths")
    med = None if media is None else lengths_array(media, "media")
    med_cap = optional_packing_int(media_capacity, "media_capacity", 0)
    order = None
    if name == "first_fit_shuffle":
        seed_value = packing_int(seed, "seed", I64_MIN)
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


# ----------------------------------------------------------------------------- moved names

_MOVED_TO_COMPAT = frozenset(
    (
        "ConcatenativePacker",
        "FirstFitDecreasingPacker",
        "FirstFitShufflePacker",
        "ModifiedFirstFitDecreasingPacker",
        "PackingAlgorithm",
        "PackingMetrics",
        "SequencePacker",
        "get_packer",
    )
)


def __getattr__(name: str) -> Any:
    """NeMo-RL's packer API, moved to ``mmpack.compat.nemo_rl_packing``: still reachable here
    for one release, with a ``DeprecationWarning`` naming the new path."""
    if name in _MOVED_TO_COMPAT:
        warnings.warn(
            f"mmpack.packing.{name} moved to mmpack.compat.nemo_rl_packing.{name}; import it "
            "from there (the old path will be removed in the next release)",
            DeprecationWarning,
            stacklevel=2,
        )
        from mmpack.compat import nemo_rl_packing

        return getattr(nemo_rl_packing, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
