"""Loader helpers around Energon's loader and its checkpoints.

- `make_worker_config`: a `WorkerConfig` whose error handler counts failed samples in the
  encoder's `LoaderStats`. A plain ``WorkerConfig`` (as Megatron-LM builds its own) is wired the
  same way while the encoder builds its datasets (`counting_failures`), so failures are counted
  whatever config the loader gets.
- `save_loader_state`: ``loader.save_state_rank()``, which also returns between
  ``iter(loader)`` and the first batch (Energon's waits forever there for workers that do not
  run yet).
- `restore_loader_state`: ``loader.restore_state_rank(state)`` with a clear error when the
  worker count differs (Energon only asserts), ``None`` (the state of a loader saved before its
  first batch) passed through as Energon takes it, and the caller's state left as it was
  (Energon edits the state it restores).
- `restore_batch`: ``loader.restore_sample(key)`` for a packing encoder with
  ``postencode_sample`` (mmpack's), whose keys Energon's own call cannot read.
- `mute_restores`: nothing is counted while Energon re-creates samples of a checkpoint.

Energon's own traps met through mmpack, and what holds here:

- ``save_state_rank()`` of a loader with workers, called after ``iter(loader)`` but before the
  first batch, waits forever: ``iter`` marks the workers started, but they start with the
  first ``next``, so no worker answers the save. `save_loader_state` returns the state there.
- ``save_state_rank()`` after the loader's epoch ended (``StopIteration``) returns the state of
  the epoch's end; restored, the loader starts the next epoch. A state saved in the epoch's
  last batches with ``repeat=False`` restores sources that had read their share as the start
  of a new epoch: the epoch is delivered again (left to Energon, see `restore_loader_state`).
- ``loader.restore_sample(key)`` asserts in Energon's ``PackingDataset`` whenever the encoder
  has a ``postencode_sample``: use `restore_batch`.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any

from megatron.energon import WorkerConfig

from mmpack.energon.stats import LoaderStats, counting_handler
from mmpack.errors import EnergonConfigError, EnergonDataError

__all__ = [
    "checked_on_restore",
    "counting_failures",
    "loader_state_workers",
    "make_worker_config",
    "mute_restores",
    "refused_on_restore",
    "restore_batch",
    "restore_loader_state",
    "save_loader_state",
]


def make_worker_config(
    encoder: Any,
    *,
    num_workers: int,
    rank: int = 0,
    world_size: int = 1,
    seed_offset: int = 0,
    inner_handler: Callable[[Exception, Any, Any], None] | None = None,
) -> WorkerConfig:
    """A `WorkerConfig` whose error handler counts failed samples in ``encoder.stats`` (and logs
    one line each) before calling `inner_handler` (e.g. Energon's ``log_exception`` for full
    tracebacks, or ``reraise_exception`` to fail fast while developing). A plain
    ``WorkerConfig`` works too: the encoder wires its handler the same way while it builds its
    datasets (`counting_failures`)."""
    return WorkerConfig(
        rank=rank,
        world_size=world_size,
        num_workers=num_workers,
        seed_offset=seed_offset,
        global_error_handler=encoder.stats.error_handler(inner_handler),
    )


@contextlib.contextmanager
def counting_failures(worker_config: WorkerConfig, stats: LoaderStats) -> Iterator[None]:
    """In the ``with`` body, ``worker_config.global_error_handler`` counts failed samples in
    `stats` before it does what it did. Energon's wrappers take the handler when they are built,
    so the datasets built in the body count their failures in `stats`; afterwards the config
    has its own handler back (it is changed in place: Energon compares loader and dataset
    configs by identity), so datasets built later with it, by another encoder, do not count in
    `stats`."""
    handler = worker_config.global_error_handler
    worker_config.global_error_handler = counting_handler(stats, handler)
    try:
        yield
    finally:
        worker_config.global_error_handler = handler


def mute_restores(dataset: Any, stats: LoaderStats) -> None:
    """Count nothing while any dataset of the tree under `dataset` re-creates a sample from its
    restore key: Energon does that to refill the buffers of a restored checkpoint, and for
    ``loader.restore_sample``; those samples' fates were counted when they were first read.
    Wraps each dataset's ``restore_sample`` (on the instance)."""
    for ds in _datasets(dataset):
        restore = ds.restore_sample
        if getattr(restore, "__mmpack_muted__", None) is stats:
            continue

        def restore_sample(restore_key: Any, _restore: Any = restore) -> Any:
            with stats.restoring():
                return _restore(restore_key)

        restore_sample.__mmpack_muted__ = stats  # type: ignore[attr-defined]
        ds.restore_sample = restore_sample


def _datasets(dataset: Any) -> Iterator[Any]:
    """`dataset` and every dataset it wraps (Energon's ``BaseWrapperDataset.datasets``)."""
    todo = [dataset]
    seen: set[int] = set()
    while todo:
        ds = todo.pop()
        if id(ds) in seen:
            continue
        seen.add(id(ds))
        yield ds
        todo.extend(getattr(ds, "datasets", ()) or ())


def loader_state_workers(state: Any) -> int:
    """The ``num_workers`` a loader state (``save_state_rank()``) was saved with."""
    from megatron.energon.savable_loader import SavableDatasetCheckpoint

    worker_states = list(getattr(state, "worker_states", []))
    if worker_states and all(isinstance(s, SavableDatasetCheckpoint) for s in worker_states):
        return len(worker_states)
    return 0


def save_loader_state(loader: Any) -> Any:
    """``loader.save_state_rank()`` (an Energon ``SavableDataLoader``), at any point of the
    loader's life.

    Between ``iter(loader)`` and the first batch, Energon sends the save to worker processes
    that are not running yet (they start with the first ``next``) and waits for their answer
    forever. Nothing was read then: the state is the one Energon gives before ``iter`` (``None``
    at the start, the restored state after `restore_loader_state`)."""
    if (
        int(getattr(loader, "num_workers", 0)) > 0
        and getattr(loader, "_has_workers", False)
        and getattr(loader, "_iterator", None) is None
    ):
        from megatron.energon.savable_loader import SavableDataLoaderState

        # Energon's own branch for "workers configured, not started yet"
        worker_states = loader.dataset.get_initial_checkpoint()
        if worker_states is None:
            return None
        return SavableDataLoaderState(
            worker_states=worker_states,
            next_worker_id=loader._next_worker_id,
            micro_batch_size=loader._get_batch_size(),
        )
    return loader.save_state_rank()


def restore_loader_state(loader: Any, state: Any) -> None:
    """``loader.restore_state_rank(state)`` after checking the worker count matches (Energon
    cannot re-split a checkpoint over a different number of workers and only asserts).

    ``None`` is what a loader with workers saves before its first batch (a checkpoint at step
    0): passed to Energon, which starts from the beginning.

    Energon saves no "finished" mark for a data source (``repeat=False``): a state saved while
    an epoch's last batches were still to come, after a source had read its whole share,
    restores that source as the start of a new epoch, so the restored loader delivers the
    epoch again. That is left to Energon (the state alone does not tell every such case from a
    correct one): save with ``repeat=True``, or after the epoch's ``StopIteration``.

    Energon takes the state's buffers over and edits them as it iterates; it gets a copy, so
    `state` can be restored again."""
    # Energon's own flags: workers started, or batches delivered (each iter() without workers)
    if getattr(loader, "_has_workers", False) or getattr(loader, "_sample_idx", 0) > 0:
        # Energon asserts with workers running, and without workers restores under the live
        # iterator, which then yields neither stream's batches
        raise EnergonConfigError(
            "restore_loader_state needs a loader that has not been iterated yet: build a new "
            "loader (get_savable_loader) and restore the checkpoint into it before iter()"
        )
    if state is None:
        loader.restore_state_rank(None)
        return
    saved = loader_state_workers(state)
    current = int(loader.num_workers)
    if saved != current:
        raise EnergonConfigError(
            f"the loader checkpoint was saved with num_workers={saved}, but this loader has "
            f"num_workers={current}; Energon checkpoints hold one state per worker and can only "
            f"be restored with the same worker count (use num_workers={saved})"
        )
    saved_batch = getattr(state, "micro_batch_size", None)
    batch = loader._get_batch_size() if hasattr(loader, "_get_batch_size") else None
    if current == 0 and None not in (saved_batch, batch) and saved_batch != batch:
        raise EnergonConfigError(  # Energon only asserts
            f"the loader checkpoint was saved with batch_size={saved_batch}, but this loader has "
            f"batch_size={batch}; without workers Energon restores only the same batch size "
            f"(use batch_size={saved_batch})"
        )
    loader.restore_state_rank(copy.deepcopy(state))


def restore_batch(loader: Any, restore_key: Any) -> Any:
    """``loader.restore_sample(restore_key)``: the batch a loader delivered, built again from its
    ``__restore_key__`` (nothing is counted in the encoder's stats).

    Energon's ``PackingDataset.restore_sample`` reads the key of each member of a pack as if it
    were prefixed twice when the encoder has a ``postencode_sample`` (mmpack's has), and
    asserts; the key is given to it in the form it reads, and the batch gets its own key back."""
    try:
        return loader.restore_sample(restore_key)
    except AssertionError:
        readable = _twice_prefixed_members(restore_key)
        if readable == restore_key:
            raise
    batch = loader.restore_sample(readable)
    batch.__restore_key__ = restore_key
    return batch


def _twice_prefixed_members(key: Any) -> Any:
    """`key` with the key of each member of a pack (``("PackingDataset", i, *rest)`` inside a
    ``("PackingDataset", pack_index, *members)``) written ``("PackingDataset", i,
    "PackingDataset", i, *rest)``."""
    if not isinstance(key, tuple):
        return key
    is_pack = bool(key) and key[0] == "PackingDataset"
    out = []
    for item in key:
        if is_pack and isinstance(item, tuple) and item[:1] == ("PackingDataset",):
            out.append((*item[:2], *item))
        else:
            out.append(_twice_prefixed_members(item))
    return tuple(out)


def refused_on_restore(sample: Any, reason: str, detail: str, *, capacity: int) -> Exception:
    """The error for a sample Energon re-creates from a loader checkpoint that this encoder's
    policy refuses: it passed the policy of the encoder that saved the checkpoint, so that
    encoder's config differs."""
    return EnergonConfigError(
        f"sample {getattr(sample, '__key__', '?')!r} of the loader checkpoint being "
        f"restored is refused by this encoder ({reason}: {detail}), but was accepted by "
        "the encoder that saved the checkpoint: restore with the config it was saved "
        f"with (capacity={capacity} here; capacity, padding and the policy "
        "settings must match)"
    )


@contextlib.contextmanager
def checked_on_restore(stats: LoaderStats, sample: Any, *, capacity: int) -> Iterator[None]:
    """A data error raised while Energon re-creates `sample` from a loader checkpoint as the
    config mismatch it is (`refused_on_restore`): the sample passed the encoder that saved the
    checkpoint (another loss-mask mode, template or policy)."""
    try:
        yield
    except EnergonDataError as err:
        if not stats.is_restoring:
            raise
        raise refused_on_restore(sample, type(err).__name__, str(err), capacity=capacity) from err
