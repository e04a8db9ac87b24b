"""``UniqueSegments``: a value's media with each unique segment once, and the index from every
logical occurrence to its unique segment.

``PackedTensor.as_tensor()`` writes every row's own copy of its segments (the layout every
Hugging Face model reads); :meth:`PackedTensor.unique_segments` gives the same media with each
segment once, so that a model adapted by ``mmpack.vision.encode_once`` encodes each unique image
once and scatters its features to every placeholder. Segments are the same when their
provenance ids are equal (a value's physical segments after G-expansion, slicing, sharding,
pickling or a Ray hop); a segment without provenance is its own.

A ``UniqueSegments`` is not a tensor. A model that was not adapted and receives one (as
``pixel_values`` from the NeMo-RL drop-in's unique mode) fails on its first tensor call with
:class:`~mmpack.errors.UnadaptedModelError`, never runs without its media.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from mmpack._coerce import pack_dim
from mmpack.errors import UnadaptedModelError

__all__ = ["UniqueSegments", "unique_order", "unique_segments"]


@dataclass(frozen=True, eq=False)
class UniqueSegments:
    """Unique segments of a packed value, concatenated once, and how its rows use them.

    * ``values``: the unique segments concatenated along ``dim_to_pack`` in first-use order
      (padded like ``as_tensor`` when ``pad_to_max_shape``);
    * ``offsets``: int64 array of ``len(index_of_unique) + 1`` entries, where unique segment
      ``u`` spans ``values.narrow(dim_to_pack, offsets[u], offsets[u+1] - offsets[u])``;
    * ``index``: int64 tensor (on ``values``' device), the unique segment of every logical
      occurrence in row order, ``None`` entries left out (what ``as_tensor`` concatenates);
    * ``identities``: each unique segment's 16-byte provenance id, ``None`` where it has none;
    * ``dim_to_pack``: the dimension (non-negative) the segments are concatenated along.
    """

    values: torch.Tensor
    offsets: np.ndarray
    index: torch.Tensor
    identities: tuple[bytes | None, ...]
    dim_to_pack: int

    @property
    def num_unique(self) -> int:
        return len(self.identities)

    @property
    def num_logical(self) -> int:
        return int(self.index.numel())

    def segment(self, u: int) -> torch.Tensor:
        """Unique segment ``u`` (a view of ``values``)."""
        start, stop = int(self.offsets[u]), int(self.offsets[u + 1])
        return self.values.narrow(self.dim_to_pack, start, stop - start)

    def item_index(self) -> torch.Tensor:
        """For every entry of the logical concatenation along ``dim_to_pack`` (an image of
        ``image_grid_thw``, a patch of Qwen's ``pixel_values``), its position in ``values``:
        ``values.index_select(dim_to_pack, item_index())`` is ``as_tensor()``."""
        idx = self.index.cpu().numpy()
        starts = self.offsets[:-1][idx]
        lengths = np.diff(self.offsets)[idx]
        total = int(lengths.sum())
        # each occurrence's run start, repeated over its run, plus the position within the run
        run_starts = np.repeat(starts - (np.cumsum(lengths) - lengths), lengths)
        items = run_starts + np.arange(total, dtype=np.int64)
        return torch.from_numpy(items).to(self.values.device)

    def logical(self) -> torch.Tensor:
        """What ``as_tensor()`` returns: every occurrence's own copy (for small metadata such as
        ``image_grid_thw``; media stays unique)."""
        return self.values.index_select(self.dim_to_pack, self.item_index())

    def to(self, *args: Any, **kwargs: Any) -> UniqueSegments:
        """The same segments moved or cast as ``Tensor.to`` takes them (``to(device)``,
        ``to(dtype)``, ``to(device, dtype)``, ``to(tensor)``, keywords ``device``, ``dtype``,
        ``non_blocking``). A dtype casts ``values`` only: ``index`` stays int64, and only moves."""
        device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
        return UniqueSegments(
            self.values.to(device=device, dtype=dtype, non_blocking=non_blocking),
            self.offsets,
            self.index if device is None else self.index.to(device, non_blocking=non_blocking),
            self.identities,
            self.dim_to_pack,
        )

    def __getattr__(self, name: str) -> Any:
        # Reached only for names the class lacks: a model that was not adapted treating this as
        # a tensor (``.type``, ``.dim``, ``.shape``). Dunder lookups (copy, pickle) stay plain.
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        raise UnadaptedModelError(
            f"a model read {name!r} of mmpack's UniqueSegments as if it were a tensor: the model "
            "was not adapted with mmpack.vision.encode_once(model), which turns unique media "
            "into features for every placeholder"
        )

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        # A torch function given this in place of a tensor (``torch.cat([pixel_values])``).
        name = getattr(func, "__name__", repr(func))
        raise UnadaptedModelError(
            f"a model passed mmpack's UniqueSegments to torch's {name!r} as if it were a tensor: "
            "the model was not adapted with mmpack.vision.encode_once(model)"
        )

    def __repr__(self) -> str:
        return (
            f"UniqueSegments({self.num_unique} unique for {self.num_logical} occurrences, "
            f"values {tuple(self.values.shape)} {self.values.dtype}, dim {self.dim_to_pack})"
        )


def unique_order(
    logical: np.ndarray, identities: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray]:
    """``(representatives, index)``: for the physical segment of each logical occurrence
    (``logical``), the first physical segment of each distinct identity in first-use order, and
    each occurrence's position among them. Without ``identities`` every physical segment is its
    own."""
    keys = logical if identities is None else identities[logical]
    if keys.size == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
    # np.unique sorts by key; renumber the groups in the order of their first occurrence
    by_first_use = np.argsort(first, kind="stable")
    rank = np.empty_like(by_first_use)
    rank[by_first_use] = np.arange(by_first_use.size)
    index = rank[inverse.reshape(-1)].astype(np.int64)
    representatives = logical[first[by_first_use]].astype(np.int64)
    return representatives, index


def unique_segments(value: Any, device: Any, gather: Any) -> UniqueSegments | None:
    """``PackedTensor.unique_segments``: the physical segments the rows reference, one per
    distinct identity in first-use order, concatenated by ``gather`` (``as_tensor``'s path,
    ``mmpack.packed.value.materialize``)."""
    lay = value._lay()
    phys = value._phys()
    n = len(phys)
    if lay is not None and lay.is_csr:
        logical = np.asarray(lay.indices(), dtype=np.int64)
    else:
        logical = np.arange(n, dtype=np.int64)
    present = np.fromiter((t is not None for t in phys), dtype=bool, count=n)
    logical = logical[present[logical]] if logical.size else logical
    if logical.size == 0:
        return None
    identities = value.segment_identities()
    representatives, index = unique_order(logical, identities)
    values = gather(value, representatives, device, None, False)
    if values is None:
        return None
    segments = value._phys()  # moved in place by a device gather
    first = segments[int(representatives[0])]
    dim = pack_dim(value.dim_to_pack, len(first.shape))
    if dim is None:  # as_tensor refused it already; kept for the type checker
        raise IndexError(f"dim_to_pack={value.dim_to_pack} is invalid")
    sizes = np.fromiter(
        (segments[int(p)].shape[dim] for p in representatives), np.int64, representatives.size
    )
    offsets = np.zeros(sizes.size + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    ids = (
        tuple([None] * representatives.size)
        if identities is None
        else tuple(bytes(identities[p]) for p in representatives.tolist())
    )
    return UniqueSegments(values, offsets, torch.from_numpy(index).to(values.device), ids, dim)
