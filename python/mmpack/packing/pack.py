"""``pack``: variable-length items into fixed-capacity bins in one native call; the algorithm names
it accepts. See ``mmpack.packing`` for the algorithms."""

from __future__ import annotations

import enum
import random
from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from mmpack import _native
from mmpack._coerce import I64_MIN, lengths_array, optional_packing_int, packing_int
from mmpack.errors import BinCountError, PackingArgumentError
from mmpack.packing.pyrandom import shuffle_order
from mmpack.packing.result import Packing

__all__ = ["ALGORITHMS", "algorithm_name", "pack"]

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


# ----------------------------------------------------------------------------- inputs


def algorithm_name(algorithm: Any) -> str:
    """The canonical name of ``algorithm``: a name of ``ALGORITHMS`` or an alias, any case, or
    an enum member whose value is one of ``ALGORITHMS`` (NeMo-RL's ``PackingAlgorithm``, and
    mmpack's copy in ``mmpack.compat.nemo_rl.packing``)."""
    if isinstance(algorithm, enum.Enum):
        value = algorithm.value
        if isinstance(value, str) and value in ALGORITHMS:
            return value
    elif isinstance(algorithm, str):
        key = algorithm.lower()
        key = _ALIASES.get(key, key)
        if key in ALGORITHMS:
            return key
    raise PackingArgumentError(
        f"invalid packing argument algorithm: unknown algorithm {algorithm!r}; "
        f"known: {', '.join(ALGORITHMS)}"
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

    A length is what the item takes in a bin: for batches padded per sample, its padded
    length (``mmpack.batch.BatchOptions.padded_length``), so that a bin's padded total fits
    ``capacity``.

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
    name = algorithm_name(algorithm)
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
        order = shuffle_order(len(arr), random.Random(seed_value))
    try:
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
    except BinCountError as exc:
        # the core words it for NeMo-RL's facade; name this function's arguments
        raise BinCountError(
            str(exc).replace("min_bin_count/bin_count_multiple", "min_bins/bins_multiple_of")
        ) from None
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
        item_lengths=arr,
    )
