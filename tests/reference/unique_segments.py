"""Plain-Python reference for ``PackedTensor.unique_segments()``: what a value's unique media,
index and offsets must be, computed from its physical segments, its rows and its provenance
without any mmpack code.

A segment is identified by its provenance key (any hashable: equal keys are the same segment);
a segment without one (``provenance`` is ``None``, or its entry is ``None``) is its own. Unique
segments are numbered in the order of their first use, walking the rows in order and each row's
segments in order, skipping ``None`` media. ``logical`` is every occurrence concatenated along
``dim_to_pack`` (zero-padded to the largest size of each other dimension with
``pad_to_max_shape``), which is what ``as_tensor()`` must return.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["Expected", "unique_segments"]


@dataclass
class Expected:
    """The reference result: ``keys`` per unique segment (first-use order), ``index`` per
    logical occurrence, ``offsets`` of the unique segments along the packed dimension,
    ``values`` the unique segments concatenated once and ``logical`` every occurrence."""

    keys: list[Hashable]
    index: list[int]
    offsets: list[int]
    segments: list[torch.Tensor]
    values: torch.Tensor
    logical: torch.Tensor
    dim: int

    @property
    def num_unique(self) -> int:
        return len(self.keys)


def _pad_all(items: list[torch.Tensor], dim: int) -> list[torch.Tensor]:
    rank = items[0].dim()
    sizes = [max(t.shape[d] for t in items) for d in range(rank)]
    out = []
    for t in items:
        pad: list[int] = []
        for d in reversed(range(rank)):
            pad += [0, 0 if d == dim else sizes[d] - t.shape[d]]
        out.append(F.pad(t, pad))
    return out


def unique_segments(
    segments: Sequence[torch.Tensor | None],
    rows: Sequence[Sequence[int]] | None,
    provenance: Sequence[Hashable | None] | None,
    dim_to_pack: int,
    pad_to_max_shape: bool = False,
) -> Expected | None:
    """The reference of ``unique_segments()`` for physical ``segments``, ``rows`` (each row's
    physical segment indices; ``None``: row ``r`` is ``segments[r]``) and per-segment
    ``provenance`` keys. ``None`` when no row uses any media."""
    if rows is None:
        rows = [[i] for i in range(len(segments))]
    used = [i for row in rows for i in row if segments[i] is not None]
    if not used:
        return None
    rank = segments[used[0]].dim()  # type: ignore[union-attr]
    dim = dim_to_pack + rank if dim_to_pack < 0 else dim_to_pack

    def key(i: int) -> Hashable:
        own = None if provenance is None else provenance[i]
        return ("physical", i) if own is None else ("provenance", own)

    keys: list[Hashable] = []
    first: list[int] = []
    position: dict[Hashable, int] = {}
    index: list[int] = []
    for i in used:
        k = key(i)
        if k not in position:
            position[k] = len(keys)
            keys.append(k)
            first.append(i)
        index.append(position[k])

    physical = {i: segments[i] for i in used}
    if pad_to_max_shape:
        order = list(physical)
        padded = _pad_all([physical[i] for i in order], dim)  # type: ignore[misc]
        physical = dict(zip(order, padded, strict=True))
    unique = [physical[i] for i in first]
    offsets = [0]
    for seg in unique:
        offsets.append(offsets[-1] + seg.shape[dim])  # type: ignore[union-attr]
    logical = torch.cat([physical[i] for i in used], dim=dim)  # type: ignore[misc]
    values = torch.cat(unique, dim=dim)  # type: ignore[arg-type]
    return Expected(keys, index, offsets, unique, values, logical, dim)  # type: ignore[arg-type]
