"""Helpers for testing task encoders without a running loader, and for comparing packed batches.

Hooks decorated with ``@stateless(restore_seeds=True)`` only run inside an active Energon
`WorkerConfig`; `active_worker` activates one (e.g. from a test fixture), so those hooks run in
any CI job, not only in a live loader worker."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from typing import Any

from megatron.energon import WorkerConfig

__all__ = [
    "PACK_FIELDS",
    "active_worker",
    "batch_digest",
    "batch_view",
    "media_rows",
    "pack_digest",
    "pack_view",
]

#: The tensor fields of a THD pack, by name.
PACK_FIELDS = (
    "input_ids",
    "labels",
    "loss_mask",
    "token_mask",
    "position_ids",
    "cu_seqlens",
    "cu_seqlens_padded",
)


@contextlib.contextmanager
def active_worker(
    worker_config: WorkerConfig | None = None, *, sample_index: int = 0
) -> Iterator[WorkerConfig]:
    """Activate a `WorkerConfig` as Energon does inside a loader worker, so hooks that read
    ``current_sample_index`` or seed from the worker (``restore_seeds=True``) can be called
    directly."""
    config = worker_config or WorkerConfig(rank=0, world_size=1, num_workers=0)
    config.worker_activate(sample_index)
    try:
        yield config
    finally:
        config.worker_deactivate()


def media_rows(value: Any) -> list[list[Any]]:
    """The media tensors of each row of a `PackedTensor` (one row per sample of a pack), in
    the order the row references them (a deduplicated item appears once per reference)."""
    offsets = list(value._row_offsets or [])
    indices = list(value._segment_indices or [])
    tensors = list(value.tensors)
    return [[tensors[i] for i in indices[a:b]] for a, b in itertools.pairwise(offsets)]


def _tensor_list(value: Any) -> Any:
    return value.tolist() if hasattr(value, "tolist") else value


def pack_digest(pack: Any) -> tuple[Any, ...]:
    """Everything the trainer sees in one `PackedBatch`, as plain Python values (for equality)."""
    media = []
    for key in sorted(pack.media):
        value = pack.media[key]
        tensors = [None if t is None else _tensor_list(t) for t in value.tensors]
        media.append(
            (
                key,
                tensors,
                list(value._row_offsets or []),
                list(value._segment_indices or []),
                [bytes(p) for p in (value._segment_provenance or [])],
            )
        )
    from mmpack.batch.fields import THD_FIELDS

    return (
        tuple(pack.sample_ids),
        *(_tensor_list(getattr(pack, f.name)) for f in THD_FIELDS),
        tuple(media),
    )


def _tensor_view(t: Any) -> Any:
    return None if t is None else (str(t.dtype), tuple(t.shape), t.tolist())


def pack_view(pack: Any) -> tuple[Any, ...]:
    """What the trainer sees in one pack, as plain Python values, for comparing packs built by
    different implementations (mmpack's `PackedBatch`, the reference's): the sample ids, each
    tensor field (dtype, shape, values), ``max_seqlen`` and, per media key, the physical
    segments, the rows' segment indices and the materialized tensor. Provenance is left out:
    each implementation mints its own; what it must agree on is which segments are shared."""
    media = []
    for key in sorted(pack.media):
        value = pack.media[key]
        media.append(
            (
                key,
                [_tensor_view(t) for t in value.tensors],
                None if value._row_offsets is None else list(value._row_offsets),
                None if value._segment_indices is None else list(value._segment_indices),
                _tensor_view(value.as_tensor()),
            )
        )
    fields = tuple((name, _tensor_view(getattr(pack, name))) for name in PACK_FIELDS)
    return (tuple(pack.sample_ids), fields, int(pack.max_seqlen), tuple(media))


def batch_view(batch: Any) -> tuple[Any, ...]:
    """`pack_view` of every pack of a batch of packs, with its sample keys and counts."""
    return (
        tuple(batch.sample_keys),
        int(batch.num_tokens),
        int(batch.token_slots),
        tuple(pack_view(p) for p in batch.packs),
    )


def batch_digest(batch: Any) -> tuple[Any, ...]:
    """`pack_digest` of every pack of an `SftBatch` (or its padded rows' tensors)."""
    if batch.packs is not None:
        return tuple(pack_digest(p) for p in batch.packs)
    padded = batch.padded
    return tuple((name, _tensor_list(getattr(padded, name))) for name in padded._TENSOR_FIELDS)
