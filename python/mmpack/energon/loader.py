"""Loader helpers: a `WorkerConfig` wired to the encoder's failure counters, and checkpoint
restore with a clear error when the worker count differs (Energon only asserts)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from megatron.energon import WorkerConfig

from mmpack.errors import EnergonConfigError

__all__ = ["loader_state_workers", "make_worker_config", "restore_loader_state"]


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
    tracebacks, or ``reraise_exception`` to fail fast while developing)."""
    return WorkerConfig(
        rank=rank,
        world_size=world_size,
        num_workers=num_workers,
        seed_offset=seed_offset,
        global_error_handler=encoder.stats.error_handler(inner_handler),
    )


def loader_state_workers(state: Any) -> int:
    """The ``num_workers`` a loader state (``save_state_rank()``) was saved with."""
    from megatron.energon.savable_loader import SavableDatasetCheckpoint

    worker_states = list(getattr(state, "worker_states", []))
    if worker_states and all(isinstance(s, SavableDatasetCheckpoint) for s in worker_states):
        return len(worker_states)
    return 0


def restore_loader_state(loader: Any, state: Any) -> None:
    """``loader.restore_state_rank(state)`` after checking the worker count matches (Energon
    cannot re-split a checkpoint over a different number of workers and only asserts)."""
    saved = loader_state_workers(state)
    current = int(loader.num_workers)
    if saved != current:
        raise EnergonConfigError(
            f"the loader checkpoint was saved with num_workers={saved}, but this loader has "
            f"num_workers={current}; Energon checkpoints hold one state per worker and can only "
            f"be restored with the same worker count (use num_workers={saved})"
        )
    loader.restore_state_rank(state)
