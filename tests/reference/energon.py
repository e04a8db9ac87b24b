"""The Energon packing task encoder on the plain-Python references: NeMo-RL's packing
algorithms (`reference.packing`), the torch batch builder (`reference.batch`) and the plain
`PackedTensor` (`reference.packed_tensor`), behind `PackingTaskEncoder`'s hooks.

The oracle of the loader tests and the other side of ``mmpack_dev demo sft --compare-with
reference.energon:ReferencePackingTaskEncoder`` (``make demo`` passes it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
from mmpack.energon import EncodedConversation, PackingTaskEncoder
from mmpack.errors import EnergonConfigError
from mmpack.packing import algorithm_name

from reference import batch as ref_batch
from reference.packed_tensor import PackedTensor as RefPackedTensor
from reference.packing import PackingAlgorithm, get_packer

__all__ = ["ReferencePackingTaskEncoder", "reference_pack"]


@dataclasses.dataclass
class ReferencePacking:
    bin_offsets: np.ndarray
    item_indices: np.ndarray


def reference_pack(
    lengths: Any,
    capacity: int,
    *,
    algorithm: str,
    max_items_per_bin: int | None = None,
    media: Any = None,
    media_capacity: int | None = None,
    seed: int = 0,
) -> ReferencePacking:
    """The reference packer (NeMo-RL's algorithms) behind `mmpack.packing.pack`'s signature."""
    supported = [a.value for a in PackingAlgorithm]
    name = algorithm_name(algorithm)  # an unknown name raises as in mmpack.packing.pack
    if name not in supported:
        raise EnergonConfigError(
            f"the reference packer runs only NeMo-RL's packing algorithms "
            f"({', '.join(supported)}); algorithm {algorithm!r} needs mmpack's packer"
        )
    if max_items_per_bin is not None or media is not None or media_capacity is not None:
        raise EnergonConfigError(
            "the reference packer (NeMo-RL's algorithms) has no max_items_per_bin or "
            "media_capacity; use mmpack's packer for those"
        )
    bins = get_packer(name, capacity).pack([int(x) for x in lengths])
    offsets = np.cumsum([0, *(len(b) for b in bins)], dtype=np.int64)
    items = np.array([i for b in bins for i in b], dtype=np.int64)
    return ReferencePacking(offsets, items)


class ReferencePackingTaskEncoder(PackingTaskEncoder):
    """`PackingTaskEncoder` with the reference packer, batch builder and `PackedTensor`."""

    packed_tensor_type = RefPackedTensor
    packer_name = "the reference packer"

    def plan_packs(self, lengths: np.ndarray, media: np.ndarray | None, *, seed: int) -> Any:
        cfg = self.config
        return reference_pack(
            lengths,
            cfg.capacity,
            algorithm=cfg.algorithm,
            max_items_per_bin=cfg.max_items_per_bin,
            media=media,
            media_capacity=cfg.media_capacity,
            seed=seed,
        )

    def build_pack(self, samples: Sequence[EncodedConversation]) -> Any:
        return ref_batch.pack_samples(
            [self.to_encoded_sample(s) for s in samples], **self.pack_options()
        )
