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
  tolerances), and plain best-fit decreasing; the fewest bins wins. A repair pass then pools
  the items of every bin left with slack and packs them again the same way, keeping the result
  only if it saves bins (repeated while it does). So it never uses more bins than best fit, and
  uses fewer on hard inputs (many items between a quarter and a half of the capacity: about
  0.07 % over the lower bound where best fit is 0.6 % over). Time bound:
  ``O(n log n + bins * search_budget * log D)`` (D distinct lengths) times a small constant
  for the repair rounds; about 0.5-1 s per million items at the default budget of 256. Tokens
  and ``max_items_per_bin`` only (no media budget).

Placement (``place``): rows, or packed bins, on data-parallel ranks by what each rank really
computes (the LLM's tokens, linear and quadratic, plus the vision tower's work on each *unique*
media segment on the rank, once), with the rows that share media (a GRPO group) kept on one
rank where balance allows; ``pack_groups`` keeps a group's rows in one bin where capacity
allows.

Rooms: ``pack`` (``pack`` and the algorithm names), ``result`` (``Packing``), ``ranks``
(``assign_to_ranks`` / ``RankAssignment``: bins over data-parallel ranks by tokens),
``placement`` (``place`` / ``placement_of`` / ``PlacementCost`` / ``RankPlacement``),
``group_packing`` (``pack_groups``), ``pyrandom`` (Python's shuffle, emulated), ``stats_cli``
(``mmpack pack-stats``). NeMo-RL's packer API (``get_packer``,
``SequencePacker``, ``PackingAlgorithm``, ``PackingMetrics``) is an integration and lives in
``mmpack.compat.nemo_rl.packing``.
"""

from typing import Any

from mmpack import _moved
from mmpack.packing.group_packing import pack_groups
from mmpack.packing.pack import ALGORITHMS, algorithm_name, pack
from mmpack.packing.placement import PlacementCost, RankPlacement, place, placement_of
from mmpack.packing.ranks import RankAssignment, assign_to_ranks
from mmpack.packing.result import Packing

__all__ = [
    "ALGORITHMS",
    "Packing",
    "PlacementCost",
    "RankAssignment",
    "RankPlacement",
    "algorithm_name",
    "assign_to_ranks",
    "pack",
    "pack_groups",
    "place",
    "placement_of",
]


def __getattr__(name: str) -> Any:
    """NeMo-RL's packer API, which moved to ``mmpack.compat.nemo_rl.packing``."""
    return _moved.moved_name(__name__, name)
