"""Features of unique segments kept between the no-grad passes of one step (logprobs, reference),
within a byte budget.

Entries are keyed by what decides a feature: the segment's provenance id, its per-segment
metadata, and the feature call's options. The whole cache is dropped as soon as the model's
weights may have changed (an optimizer step, a reference model's weights loaded in place, a
dtype or device move, a write no version counter sees: see ``weights_stamp``), the model
switches between train and eval mode, or autocast changes: a cached feature is only served for
the weights it was computed with.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Any

import torch

__all__ = ["FeatureCache", "weights_stamp"]


def weights_stamp(model: torch.nn.Module) -> tuple[Any, ...]:
    """What must not change while cached features are served: every module's train/eval mode
    (a tower switched on its own counts), the autocast state and dtype of each device type, every
    parameter's and buffer's identity, storage, dtype and in-place version, and a fingerprint of
    their contents (see ``_fingerprint``).

    The fingerprint catches writes that no version counter sees: through ``param.data``, or into
    the local shard of a DTensor parameter (a reference model's weights copied in place, as
    NeMo-RL swaps them under FSDP2), including writes that keep every norm (a sign flip, a
    transpose, rows swapped). It reads every weight twice (a few milliseconds a GB on a current
    GPU), only in no-grad passes with a cache."""
    tensors = [*model.parameters(), *model.buffers()]
    local = [_local(t) for t in tensors]
    autocast = tuple(
        (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")
    )
    return (
        tuple(m.training for m in model.modules()),
        autocast,
        tuple(
            (id(t), t.dtype, u.data_ptr(), t._version, u._version)
            for t, u in zip(tensors, local, strict=True)
        ),
        _fingerprint(local),
    )


def _local(t: torch.Tensor) -> torch.Tensor:
    """A parameter's own data: a DTensor's local shard, else the tensor."""
    inner = getattr(t, "_local_tensor", None)
    return (inner if isinstance(inner, torch.Tensor) else t).detach()


#: dtypes read as they are; others (integers, booleans, float8) are read through a copy
_NATIVE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _readable(t: torch.Tensor) -> torch.Tensor:
    if t.dtype in _NATIVE:
        return t
    if t.is_complex():
        return torch.view_as_real(t)
    return t.float() if t.is_floating_point() else t.double()


def _fingerprint(tensors: list[torch.Tensor]) -> tuple[float, ...]:
    """Per tensor, two numbers in float64: its L1 norm, linear in a small update with effectively
    random signs (its weights' own), so an update changes it unless it is below float64
    rounding; and a weighted sum of its entries (``_projection``), which moves under writes
    that keep the L1 norm (a sign flip, entries or rows permuted, a transpose)."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel():
            by_device.setdefault(t.device, []).append(_readable(t))
    out: list[float] = []
    with torch.no_grad():
        for group in by_device.values():
            norms = torch._foreach_norm(group, 1, dtype=torch.float64)
            sums = [_projection(t) for t in group]
            out.extend(torch.stack([*norms, *sums]).cpu().tolist())  # one transfer a device
    return tuple(out)


def _projection(t: torch.Tensor) -> torch.Tensor:
    """``a @ T @ b`` for ``T``, the tensor as a matrix of its last dimension, and fixed
    pseudo-random positive weights ``a`` and ``b``: it reads the tensor once, and any change
    that is not below rounding (including one that only moves entries, or flips their signs)
    moves it."""
    last = t.shape[-1] if t.dim() else 1
    rows = t.reshape(-1, last)
    per_row = torch.mv(rows, _weights(last, t.dtype, t.device))
    return torch.dot(per_row.double(), _weights(rows.shape[0], torch.float64, t.device))


_WEIGHTS: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}


def _weights(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``n`` fixed weights in ``[0.5, 1.5)`` (the same for every call), kept per size."""
    key = (n, dtype, device)
    found = _WEIGHTS.get(key)
    if found is None:
        generator = torch.Generator().manual_seed(0x5EED + n)
        found = torch.rand(n, generator=generator, dtype=torch.float64).add_(0.5)
        found = _WEIGHTS[key] = found.to(device=device, dtype=dtype)
    return found


class FeatureCache:
    """Per unique segment, its feature tensors (one per image or video), least recently used
    evicted first, within ``max_bytes`` of feature data held; ``max_bytes == 0`` keeps
    nothing."""

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
        """Keep ``features`` under ``key`` (evicting the least recently used), unless they alone
        exceed the budget or ``key`` is kept already. The cache keeps its own compact copies: a
        feature the model gave as a view of its whole batch's output would otherwise hold that
        whole output beyond the budget, and the caller may write into what it was given."""
        size = sum(t.numel() * t.element_size() for t in features)
        if size > self.max_bytes or key in self._entries:
            return
        features = tuple(t.detach().clone(memory_format=torch.contiguous_format) for t in features)
        while self._bytes + size > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self._bytes -= sum(t.numel() * t.element_size() for t in evicted)
        self._entries[key] = features
        self._bytes += size
