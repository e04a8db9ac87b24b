"""Counters shared by the loader's worker processes: samples seen, skipped (per reason),
failed (per exception type), dropped (per reason), packed, media decoded. Energon forks its
workers (``multiprocessing_context="fork"``), so `multiprocessing` arrays created with the task
encoder, before the loader starts, are shared by every worker and read by the main process.

Skip and drop reasons are fixed sets; failure reasons are exception type names, known only when
they happen, so they live in a fixed table of ``FAILURE_SLOTS`` (name, count) slots claimed on
first use, under the counters' lock. Past ``FAILURE_SLOTS - 1`` distinct types the rest are
counted under ``"<other>"``, so the total stays exact.

Each sample is counted once, in the end it meets: ``packed`` when its batch is built (the
trainer gets it), ``skipped`` by policy, ``failed`` when a hook raises on it (a failed pack or
batch counts all its members, and only there), ``dropped`` when the loader throws it away
unbuilt (``batch_drop_last``: a worker's last short batch). So "samples in = packed + skipped +
failed + dropped" holds for a run that drains its buffers (an epoch, the demo); mid-run the
difference is the samples still in flight (in the shuffle and packing buffers, in a batch being
filled).

Each data-parallel rank has its own encoder and counters; `LoaderStats.global_snapshot` sums
them over the ranks of ``torch.distributed`` (`combine_snapshots` sums snapshots given by hand),
so the balance can be checked for the whole job.

The counters are statistics of one loader run, not training state, so they are not part of a
loader checkpoint. Restoring one, Energon redoes work that was counted before the save: it
re-creates the samples the saved buffers held (``restore_sample``) and, with workers, replays
each worker from its last internal checkpoint to the save (``checkpoint_every_sec``), throwing
the replayed batches away. None of that is counted (`LoaderStats.muted`), so a restored run
counts exactly what happens after the save, and the counts of the saved run up to the save plus
those of the restored run are those of the uninterrupted run: nothing is counted twice. (With
workers, the saved run's own counters also hold the batches its workers had prepared ahead of
the trainer, ``prefetch_factor`` per worker, which the restored run prepares again.)
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

__all__ = [
    "DROP_REASONS",
    "FAILURE_DETAILS",
    "FAILURE_SLOTS",
    "SKIP_REASONS",
    "LoaderStats",
    "combine_snapshots",
    "counting_handler",
]

logger = logging.getLogger("mmpack.energon")

#: Policy reasons a sample is skipped for (each counted).
SKIP_REASONS = (
    "ends_on_user_turn",
    "empty_trainable_mask",
    "no_turns",
    "oversize",
    "media_over_budget",
    "undeclared_modality",
)
#: Why the loader throws samples away unbuilt (each counted): ``batch_drop_last`` drops the last
#: short batch of packs (or of samples, without packing) of each worker.
DROP_REASONS = ("batch_drop_last",)
_OTHER = (
    "seen",
    "encoded",
    "packed",  # samples in built batches of packs
    "packs",  # packs in built batches
    "decoded",
    "empty_pack",
    "padded",  # samples in built batches of padded rows (packing off)
    "select_ns",  # time inside the packer (select_samples_to_pack)
    "build_ns",  # time inside the batch builder (pack_samples / padding)
)
_FIELDS = (
    *_OTHER,
    *(f"skipped:{r}" for r in SKIP_REASONS),
    *(f"dropped:{r}" for r in DROP_REASONS),
)
_INDEX = {name: i for i, name in enumerate(_FIELDS)}

#: Distinct failure reasons (exception type names) counted apart, the last one "<other>".
FAILURE_SLOTS = 32
#: Failures kept with their sample key and message in `LoaderStats.failures`, per process.
FAILURE_DETAILS = 1000
_NAME_BYTES = 64  # per slot; longer type names are cut (they stay distinct in practice)
_OTHER_FAILURE = "<other>"


class LoaderStats:
    """Process-shared counters of one task encoder."""

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("fork")
        self._values = ctx.Array("q", len(_FIELDS) + FAILURE_SLOTS, lock=True)
        # failure slot names, guarded by the lock of `_values` (which holds their counts)
        self._failure_names = ctx.RawArray("c", FAILURE_SLOTS * _NAME_BYTES)
        #: per-process detail (sample key, error) of the first `FAILURE_DETAILS` failures: complete
        #: with 0 workers and few failures (the counts are always exact)
        self.failures: list[str] = []
        # per process: the members of batches `batch` built and counted (as packed or padded),
        # so that a subclass's ``batch`` that fails after ``super().batch()`` takes them back
        self._batched: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
        # per process (each worker has its copy): how deep in re-creating restored samples
        self._restoring = 0

    @contextlib.contextmanager
    def restoring(self) -> Iterator[None]:
        """Nothing is counted in the ``with`` body: Energon re-creates samples of a checkpoint
        (or a batch, ``loader.restore_sample``) whose fate was counted when they were read."""
        self._restoring += 1
        try:
            yield
        finally:
            self._restoring -= 1

    @property
    def is_restoring(self) -> bool:
        """Whether this process is re-creating samples of a checkpoint right now."""
        return self._restoring > 0

    def muted(self) -> bool:
        """Whether counts are dropped right now: while Energon re-creates restored samples
        (`restoring`) or replays a worker from its internal checkpoint to the saved position
        (those batches are computed again, then thrown away)."""
        return self._restoring > 0 or _replaying()

    def add(self, name: str, amount: int = 1) -> None:
        index = _INDEX[name]
        if self.muted():
            return
        with self._values.get_lock():
            self._values[index] += amount

    @contextlib.contextmanager
    def timed(self, name: str) -> Iterator[None]:
        """Add the nanoseconds the ``with`` body takes to `name` (when it does not raise)."""
        start = time.perf_counter_ns()
        yield
        self.add(name, time.perf_counter_ns() - start)

    def skip(self, reason: str) -> None:
        self.add(f"skipped:{reason}")

    def drop(self, reason: str, amount: int = 1) -> None:
        """Counts ``amount`` samples the loader threw away unbuilt, under ``reason`` (one of
        `DROP_REASONS`)."""
        self.add(f"dropped:{reason}", amount)

    def fail(self, reason: str, amount: int = 1) -> None:
        """Counts ``amount`` failed samples under ``reason`` (an exception type name)."""
        if self.muted():
            return
        key = reason.encode("utf-8", "replace")[:_NAME_BYTES] or b"?"
        names = self._failure_names
        with self._values.get_lock():
            taken = names.raw
            slot = FAILURE_SLOTS - 1  # "<other>" when every other slot is taken
            for i in range(FAILURE_SLOTS - 1):
                name = _slot_name(taken, i)
                if not name:  # first free slot: claim it
                    names[i * _NAME_BYTES : i * _NAME_BYTES + len(key)] = key
                if not name or name == key:
                    slot = i
                    break
            self._values[len(_FIELDS) + slot] += amount

    def reset(self) -> None:
        with self._values.get_lock():
            for i in range(len(self._values)):
                self._values[i] = 0
            self._failure_names[:] = bytes(len(self._failure_names))
        self.failures.clear()

    def snapshot(self) -> dict[str, Any]:
        """Counts now: ``seen``, ``encoded``, ``packed`` (samples in built batches of packs),
        ``packs``, ``padded`` (samples in built batches of padded rows), ``decoded``,
        ``skipped`` (dict reason -> count), ``skipped_total``, ``dropped`` (dict reason ->
        count, `DROP_REASONS`), ``dropped_total``, ``failed_by_reason`` (dict exception type
        name -> count, in order of first failure) and ``failed`` (their sum)."""
        with self._values.get_lock():
            values = [int(v) for v in self._values[:]]
            names = self._failure_names.raw
        out: dict[str, Any] = {name: values[_INDEX[name]] for name in _OTHER}
        out["skipped"] = {r: values[_INDEX[f"skipped:{r}"]] for r in SKIP_REASONS}
        out["skipped_total"] = sum(out["skipped"].values())
        out["dropped"] = {r: values[_INDEX[f"dropped:{r}"]] for r in DROP_REASONS}
        out["dropped_total"] = sum(out["dropped"].values())
        *counts, other = values[len(_FIELDS) :]
        failed = {
            _slot_name(names, i).decode("utf-8", "replace"): n for i, n in enumerate(counts) if n
        }
        if other:
            failed[_OTHER_FAILURE] = other
        out["failed_by_reason"] = failed
        out["failed"] = sum(failed.values())
        return out

    def global_snapshot(self, group: Any = None) -> dict[str, Any]:
        """`snapshot` summed over every rank of the ``torch.distributed`` process `group`
        (default: the world). A collective: every rank of the group must call it. Without an
        initialized process group, this rank's own snapshot."""
        import torch.distributed as dist

        local = self.snapshot()
        if not (dist.is_available() and dist.is_initialized()):
            return local
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, local, group=group)
        return combine_snapshots(gathered)

    def batched(self, members: Sequence[Any]) -> None:
        """Note the members (packs, or samples without packing) of a batch just built and
        counted."""
        for m in members:
            self._batched[id(m)] = m

    def _built_as(self, sample: Any) -> str | None:
        """The counter a failed object was already counted in: a built batch (an
        ``encode_batch`` that fails after ``batch``), or the members of one (a subclass's
        ``batch`` that fails after ``super().batch()``), count as ``packed`` or ``padded``."""
        from mmpack.energon.samples import SftBatch, SftPack

        if isinstance(sample, SftBatch):
            return "packed" if sample.packs is not None else "padded"
        if (
            isinstance(sample, (list, tuple))
            and sample
            and all(self._batched.get(id(m)) is m for m in sample)
        ):
            for m in sample:
                self._batched.pop(id(m), None)
            return "packed" if isinstance(sample[0], SftPack) else "padded"
        return None

    def error_handler(
        self, inner: Callable[[Exception, Any, Any], None] | None = None
    ) -> Callable[[Exception, Any, Any], None]:
        """An Energon ``global_error_handler`` that counts failed samples by exception type (a
        failed pack or batch counts all its members), logs one line, then calls `inner` (e.g.
        Energon's ``log_exception`` or ``reraise_exception``) if given. A batch that fails
        after it was built (in ``encode_batch``) moves its samples from ``packed`` (or
        ``padded``) to failed. While `muted`, a failure was counted when it first happened:
        it is only logged at debug level."""

        def handler(err: Exception, sample: Any, sources: Any = None) -> None:
            n = _count_samples(sample)
            key = _describe(sample)
            if self.muted():
                logger.debug("sample %s failed again while Energon restores: %s", key, err)
            else:
                self.fail(type(err).__name__, n)
                built = self._built_as(sample)
                if built is not None:
                    self.add(built, -n)
                    if built == "packed":
                        packs = sample.packs if hasattr(sample, "packs") else sample
                        self.add("packs", -len(packs))
                if len(self.failures) < FAILURE_DETAILS:  # a long run must not grow it forever
                    self.failures.append(f"{key}: {type(err).__name__}: {err}")
                logger.warning(
                    "sample %s failed (%d sample(s) dropped): %s: %s",
                    key,
                    n,
                    type(err).__name__,
                    err,
                )
            if inner is not None:
                inner(err, sample, sources)

        # what `counting_handler` reads to wrap a worker config's handler only once
        handler.__mmpack_stats__ = self  # type: ignore[attr-defined]
        handler.__wrapped__ = inner  # type: ignore[attr-defined]
        return handler


def counting_handler(stats: LoaderStats, handler: Callable[..., None] | None) -> Callable[..., Any]:
    """`handler` made to count failures in `stats` first (`LoaderStats.error_handler`): itself
    when it already counts in `stats`; another encoder's counting handler is unwrapped first, so
    that no failure is counted by two encoders."""
    if getattr(handler, "__mmpack_stats__", None) is stats:
        return handler  # type: ignore[return-value]
    while getattr(handler, "__mmpack_stats__", None) is not None:
        handler = handler.__wrapped__  # type: ignore[union-attr]
    return stats.error_handler(handler)


def combine_snapshots(snapshots: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """The sum of `LoaderStats.snapshot` results (of several ranks): counts add, per-reason
    skips, drops and failures add by reason (failure reasons in order of first appearance)."""
    out: dict[str, Any] = {name: 0 for name in _OTHER}
    out["skipped"] = dict.fromkeys(SKIP_REASONS, 0)
    out["dropped"] = dict.fromkeys(DROP_REASONS, 0)
    failed: dict[str, int] = {}
    for snap in snapshots:
        for name in _OTHER:
            out[name] += int(snap.get(name, 0))
        for field in ("skipped", "dropped"):
            for reason, n in snap.get(field, {}).items():
                out[field][reason] = out[field].get(reason, 0) + int(n)
        for reason, n in snap.get("failed_by_reason", {}).items():
            failed[reason] = failed.get(reason, 0) + int(n)
    out["skipped_total"] = sum(out["skipped"].values())
    out["dropped_total"] = sum(out["dropped"].values())
    out["failed_by_reason"] = failed
    out["failed"] = sum(failed.values())
    return out


def _slot_name(names: bytes, slot: int) -> bytes:
    return names[slot * _NAME_BYTES : (slot + 1) * _NAME_BYTES].rstrip(b"\0")


def _count_samples(sample: Any) -> int:
    if isinstance(sample, (list, tuple)):
        return sum(_count_samples(s) for s in sample)
    keys = getattr(sample, "sample_keys", None)
    if isinstance(keys, list):
        return len(keys)
    return 1


def _describe(sample: Any) -> str:
    if isinstance(sample, (list, tuple)):
        return (
            "["
            + ", ".join(_describe(s) for s in sample[:4])
            + (", ..." if len(sample) > 4 else "")
            + "]"
        )
    if isinstance(sample, dict):
        return str(sample.get("__key__", "?"))
    return str(getattr(sample, "__key__", type(sample).__name__))


def _replaying() -> bool:
    """Whether this loader worker is replaying batches Energon throws away: after a checkpoint
    restore, each worker restarts from its last internal checkpoint and computes (then skips)
    the batches it had delivered between that checkpoint and the save. Read from Energon's
    worker wrapper (``SavableDatasetWrapper``), the dataset of this worker process."""
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    if info is None:
        return False
    dataset = info.dataset
    skips = getattr(dataset, "_workers_skip_samples", None)
    worker = getattr(dataset, "_worker_id", None)
    if skips is None or worker is None:
        return False
    return bool(skips[worker] > 0)
