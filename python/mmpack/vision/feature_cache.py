"""Features of unique segments kept between the no-grad passes of one step (logprobs, reference),
within a byte budget.

Entries are keyed by what decides a feature: the segment's provenance id, its per-segment
metadata, and the feature call's options. The whole cache is dropped as soon as the model's
weights may have changed (an optimizer step, a reference model's weights loaded in place, a
dtype or device move), the model switches between train and eval mode, or autocast changes: a
cached feature is only ever served for the exact weights it was computed with.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Any

import torch

__all__ = ["FeatureCache", "weights_stamp"]


def weights_stamp(model: torch.nn.Module) -> tuple[Any, ...]:
    """What must not change while cached features are served: every parameter's and buffer's
    identity, storage, dtype and in-place version, every module's train/eval mode (a tower
    switched on its own counts) and the autocast state and dtype of each device type.

    Writes through ``param.data`` (which has a version counter of its own) are not seen."""
    tensors = [*model.parameters(), *model.buffers()]
    autocast = tuple(
        (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")
    )
    return (
        tuple(m.training for m in model.modules()),
        autocast,
        tuple((id(t), t.data_ptr(), t.dtype, t._version) for t in tensors),
    )


class FeatureCache:
    """Per unique segment, its feature tensors (one per image or video), least recently used
    evicted first; ``max_bytes == 0`` keeps nothing."""

    def __init__(self, max_bytes: int) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise TypeError(f"feature_cache_bytes must be an int >= 0, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[Hashable, tuple[torch.Tensor, ...]] = OrderedDict()
        self._bytes = 0
        self._stamp: tuple[Any, ...] | None = None

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self._bytes = 0
        self._stamp = None

    def validate(self, stamp: tuple[Any, ...]) -> None:
        """Drop every entry unless ``stamp`` is the one they were computed under."""
        if stamp != self._stamp:
            self._entries.clear()
            self._bytes = 0
            self._stamp = stamp

    def get(self, key: Hashable) -> tuple[torch.Tensor, ...] | None:
        found = self._entries.get(key)
        if found is not None:
            self._entries.move_to_end(key)
        return found

    def put(self, key: Hashable, features: tuple[torch.Tensor, ...]) -> None:
        size = sum(t.numel() * t.element_size() for t in features)
        if size > self.max_bytes or key in self._entries:
            return
        while self._bytes + size > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self._bytes -= sum(t.numel() * t.element_size() for t in evicted)
        self._entries[key] = features
        self._bytes += size
