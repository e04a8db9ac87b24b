"""Group-aware placement inside NeMo-RL's ``shard_by_batch_size`` (``install(accelerate=True)``).

NeMo-RL spreads a GRPO batch (B prompts x G generations) over the data-parallel ranks without
regard to which rows share media: every rank receives rows of nearly every prompt, so every rank
pulls, materializes and encodes almost the whole batch's media. With ``placement="groups"``
(the default under ``accelerate=True``) the rows that share a media segment (by provenance,
across every PackedTensor value of the batch) are placed with ``mmpack.packing.place``: each
rank's cost is its rows' tokens (linear and quadratic) plus its unique segments' patches, and
the worst rank's cost is minimised with groups whole where balance allows. With sequence
packing the bins come from ``mmpack.packing.pack_groups`` (same algorithm, same bin count as
NeMo-RL's packer, a group's rows in as few bins as capacity allows).

NeMo-RL's own placement is always a candidate: per global batch, each candidate is priced by
what each rank really runs (under dynamic batching, the micro-batches every rank runs, padded to
the longest row at each position over all ranks, plus the rank's unique media), and the one
with the fewest encodes among those within the tolerance of the cheapest worst rank is used.

What stays NeMo-RL's: every row stays in its global batch (the chunk of ``batch_size`` rows:
its optimizer step); each rank gets the same number of rows (dynamic batching) or bins
(sequence packing) per global batch; the micro-batch metadata is built by NeMo-RL's rules; the
returned indices say where each row went, so ``reorder_data`` puts results back. The loss
summed over ranks is unchanged. A global batch in which no two rows share a segment is
sharded exactly as NeMo-RL shards it, as is everything with ``placement="nemo_rl"``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from mmpack.compat.nemo_rl.micro_batches import dynamic_micro_batches
from mmpack.errors import BinCountError, PackingArgumentError
from mmpack.packing.group_packing import pack_groups
from mmpack.packing.placement import PlacementCost, place, placement_of

__all__ = ["PLACEMENTS", "PlacementSettings", "RowMedia", "settings"]

PLACEMENTS = ("groups", "nemo_rl")

IntArray = NDArray[np.int64]

#: Elements of one vision patch in NeMo-RL's flattened ``pixel_values`` (Qwen2-VL: 3 channels
#: x 2 frames x 14 x 14): a segment's patches are its elements over this.
PATCH_ELEMENTS = 1176


@dataclass
class PlacementSettings:
    mode: str = "groups"
    cost: PlacementCost = PlacementCost()  # noqa: RUF009 (frozen, shared safely)
    tolerance: float = 0.05


_SETTINGS = PlacementSettings()


def settings() -> PlacementSettings:
    """The placement ``shard_by_batch_size`` uses (set by ``install``)."""
    return _SETTINGS


def configure(mode: str, cost: PlacementCost | None) -> None:
    """Sets the placement mode and cost model (``install``'s ``placement`` arguments)."""
    if mode not in PLACEMENTS:
        raise PackingArgumentError(
            f"invalid packing argument placement: {mode!r}; known: {', '.join(PLACEMENTS)}"
        )
    if cost is not None and not isinstance(cost, PlacementCost):
        raise PackingArgumentError(
            f"invalid packing argument placement_cost: must be a PlacementCost, got {cost!r}"
        )
    _SETTINGS.mode = mode
    _SETTINGS.cost = cost or PlacementCost()


@dataclass(frozen=True)
class RowMedia:
    """Every row's media segments over all PackedTensor values of a batch, as CSR over dense
    segment ids (equal provenance: one id), with each segment's patch count."""

    offsets: IntArray
    ids: IntArray
    patches: IntArray

    @classmethod
    def of(cls, data: Mapping[str, Any], packed_cls: Any, num_rows: int) -> RowMedia | None:
        """The batch's row media, or ``None`` when no segment is shared by two rows."""
        rows_parts: list[IntArray] = []
        keys_parts: list[np.ndarray] = []
        numel_parts: list[IntArray] = []
        minted = 0
        for key in sorted(data):
            value: Any = data[key]
            if not isinstance(value, packed_cls):
                continue
            offsets, indices = value.csr()
            identities = value.segment_identities()
            numels = value.segment_numels()
            if identities is None:
                # no provenance: every segment is its own (no sharing can be known)
                identities = _minted(minted, len(numels))
                minted += len(numels)
            counts = np.diff(offsets)
            rows_parts.append(np.repeat(np.arange(num_rows, dtype=np.int64), counts))
            keys_parts.append(identities[indices])
            numel_parts.append(numels[indices])
        if not rows_parts:
            return None
        rows = np.concatenate(rows_parts)
        keys = np.concatenate(keys_parts)
        numels = np.concatenate(numel_parts)
        if len(keys) == 0:
            return None
        unique, first, dense = np.unique(keys, return_index=True, return_inverse=True)
        dense = dense.reshape(-1).astype(np.int64)
        if len(unique) == len(keys):
            return None  # no segment is referenced twice
        order = np.argsort(rows, kind="stable")
        offsets = np.zeros(num_rows + 1, dtype=np.int64)
        np.cumsum(np.bincount(rows, minlength=num_rows), out=offsets[1:])
        patches = -(-numels[first] // PATCH_ELEMENTS)
        return cls(offsets, dense[order], patches.astype(np.int64))

    def chunk(self, start: int, end: int) -> tuple[IntArray, IntArray]:
        """CSR offsets and ids of rows ``[start, end)``."""
        offsets = self.offsets[start : end + 1]
        return offsets - offsets[0], self.ids[offsets[0] : offsets[-1]]

    def shared_within(self, start: int, end: int) -> bool:
        """Whether two rows of ``[start, end)`` share a segment."""
        _, ids = self.chunk(start, end)
        rows = np.repeat(np.arange(end - start), np.diff(self.offsets[start : end + 1]))
        pairs = np.unique(np.stack([ids, rows]), axis=1)
        return len(np.unique(pairs[0])) < pairs.shape[1]


def _minted(start: int, n: int) -> np.ndarray:
    """``n`` distinct 16-byte keys that no provenance id equals (all-ones high half)."""
    raw = np.zeros((n, 2), dtype="<u8")
    raw[:, 0] = np.iinfo(np.uint64).max
    raw[:, 1] = np.arange(start, start + n, dtype=np.uint64)
    return raw.view(np.dtype((np.void, 16))).reshape(-1)


def packing_shards(
    media: RowMedia,
    start: int,
    padded: list[int],
    shards: int,
    args: Mapping[str, Any],
    nemo_bins: list[list[list[int]]],
) -> list[list[list[int]]]:
    """Per shard, its bins (chunk-relative rows) for one global batch of sequence packing;
    ``nemo_bins`` is NeMo-RL's (its packer's bins dealt round robin).

    Candidates: rows placed first and each rank's rows packed on their own (groups never cross
    ranks), where every rank then needs NeMo-RL's number of micro-batches; NeMo-RL's bin count
    packed with ``pack_groups`` and the bins placed; NeMo-RL's own. ``_choose`` picks."""
    offsets, ids = media.chunk(start, start + len(padded))
    lengths = np.asarray(padded, dtype=np.int64)
    chosen = _SETTINGS
    bins = pack_groups(
        lengths,
        args["max_tokens_per_microbatch"],
        segments=ids,
        segment_offsets=offsets,
        algorithm=args["algorithm"],
        min_bins=shards,
        bins_multiple_of=shards,
    )
    placed = place(
        lengths,
        shards,
        segments=ids,
        segment_offsets=offsets,
        patches=media.patches,
        bins=bins,
        cost=chosen.cost,
        tolerance=chosen.tolerance,
    )
    all_bins = bins.bins()
    candidates = [nemo_bins, [[all_bins[b] for b in rank] for rank in placed.ranks()]]
    by_rows = _rows_first(lengths, offsets, ids, media.patches, shards, args, bins.num_bins)
    if by_rows is not None:
        candidates.append(by_rows)
    costs = []
    for candidate in candidates:
        ranks = _rank_of_rows([[r for b in rank for r in b] for rank in candidate], len(padded))
        priced = placement_of(
            ranks,
            lengths,
            shards,
            segments=ids,
            segment_offsets=offsets,
            patches=media.patches,
            cost=chosen.cost,
        )
        costs.append((priced.worst, priced.encodes))
    return candidates[_choose(costs)]


def dynamic_order(
    media: RowMedia,
    start: int,
    lengths: list[Any],
    shards: int,
    nemo_order: list[int],
    micro: tuple[int, int, int],
) -> list[int]:
    """Chunk-relative rows in shard order (each shard's rows ascending by length, as NeMo-RL
    orders them) for one global batch of dynamic batching; ``nemo_order`` is NeMo-RL's and
    ``micro`` NeMo-RL's micro-batch arguments (cap, round, padded width).

    Under dynamic batching every shard runs the same micro-batches, each padded to the longest
    row at its positions over all shards: a rank's cost is those padded tokens plus its
    unique media, and ``_choose`` picks between NeMo-RL's order and the grouped one by it."""
    n = len(lengths)
    offsets, ids = media.chunk(start, start + n)
    size = n // shards
    baseline = np.empty(n, dtype=np.int64)
    for s in range(shards):
        baseline[nemo_order[s * size : (s + 1) * size]] = s
    chosen = _SETTINGS
    placed = place(
        np.asarray([int(x) for x in lengths], dtype=np.int64),
        shards,
        segments=ids,
        segment_offsets=offsets,
        patches=media.patches,
        cost=chosen.cost,
        tolerance=chosen.tolerance,
        baseline=baseline,
    )
    grouped: list[int] = []
    for rank in placed.ranks():
        grouped.extend(sorted(rank, key=lengths.__getitem__))  # stable: ties by row
    candidates = [nemo_order, grouped]
    costs = []
    for order in candidates:
        per_shard = [[lengths[i] for i in order[s * size : (s + 1) * size]] for s in range(shards)]
        found = dynamic_micro_batches(per_shard, *micro)
        if found is None:
            return nemo_order  # NeMo-RL refuses these lengths with its own message
        spans, padded = found
        tokens = sum(
            chosen.cost.rows(np.asarray([length], dtype=np.int64))[0] * (b - a)
            for (a, b), length in zip(spans, padded, strict=True)
        )
        ranks = np.empty(n, dtype=np.int64)
        for s in range(shards):
            ranks[order[s * size : (s + 1) * size]] = s
        vision = placement_of(
            ranks,
            np.zeros(n, dtype=np.int64),
            shards,
            segments=ids,
            segment_offsets=offsets,
            patches=media.patches,
            cost=chosen.cost,
        )
        costs.append((float(tokens) + vision.worst, vision.encodes))
    return candidates[_choose(costs)]


def _choose(costs: list[tuple[float, int]]) -> int:
    """Which candidate to use, from each one's (worst rank cost, encodes); the first is
    NeMo-RL's. Among those whose worst rank is within the tolerance of the cheapest worst rank,
    the fewest encodes, then the cheaper worst rank, then the earlier candidate."""
    best = min(worst for worst, _ in costs)
    within = best * (1 + _SETTINGS.tolerance)
    eligible = [i for i, (worst, _) in enumerate(costs) if worst <= within]
    return min(eligible, key=lambda i: (costs[i][1], costs[i][0], i))


def _rows_first(
    lengths: IntArray,
    offsets: IntArray,
    ids: IntArray,
    patches: IntArray,
    shards: int,
    args: Mapping[str, Any],
    num_bins: int,
) -> list[list[list[int]]] | None:
    """Rows placed on ranks by cost (counts free), then each rank's rows packed into
    ``num_bins / shards`` bins; ``None`` where a rank cannot make exactly that many."""
    chosen = _SETTINGS
    placed = place(
        lengths,
        shards,
        segments=ids,
        segment_offsets=offsets,
        patches=patches,
        cost=chosen.cost,
        tolerance=chosen.tolerance,
        balance_counts=False,
    )
    per_rank = num_bins // shards
    out = []
    for rows in placed.ranks():
        if len(rows) < per_rank:
            return None
        rank_rows = np.asarray(rows, dtype=np.int64)
        sub_offsets, sub_ids = _rows_csr(offsets, ids, rank_rows)
        try:
            packed = pack_groups(
                lengths[rank_rows],
                args["max_tokens_per_microbatch"],
                segments=sub_ids,
                segment_offsets=sub_offsets,
                algorithm=args["algorithm"],
                min_bins=per_rank,
            )
        except BinCountError:
            return None
        if packed.num_bins != per_rank:
            return None
        out.append([[rows[i] for i in b] for b in packed.bins()])
    return out


def _rows_csr(offsets: IntArray, ids: IntArray, rows: IntArray) -> tuple[IntArray, IntArray]:
    """The CSR segments of ``rows`` (in that order)."""
    counts = (offsets[1:] - offsets[:-1])[rows]
    sub_offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(counts, out=sub_offsets[1:])
    take = np.repeat(offsets[:-1][rows] - sub_offsets[:-1], counts)
    return sub_offsets, ids[np.arange(int(sub_offsets[-1]), dtype=np.int64) + take]


def _rank_of_rows(shards: list[list[int]], n: int) -> IntArray:
    ranks = np.empty(n, dtype=np.int64)
    for r, rows in enumerate(shards):
        ranks[rows] = r
    return ranks
