"""Counters shared by the loader's worker processes: samples seen, skipped (per reason),
failed (per exception type), packed, media decoded. Energon forks its workers
(``multiprocessing_context="fork"``), so `multiprocessing` arrays created with the task encoder,
before the loader starts, are shared by every worker and read by the main process.

Skip reasons are a fixed set; failure reasons are exception type names, known only when they
happen, so they live in a fixed table of ``FAILURE_SLOTS`` (name, count) slots claimed on first
use, under the counters' lock. Past ``FAILURE_SLOTS - 1`` distinct types the rest are counted
under ``"<other>"``, so the total stays exact.

Each data-parallel rank has its own encoder and counters; `LoaderStats.global_snapshot` sums
them over the ranks of ``torch.distributed`` (`combine_snapshots` sums snapshots given by hand),
so "samples in = packed + skipped + failed" can be checked for the whole job.

The counters are statistics of one loader run, not training state, so they are not part of a
loader checkpoint. "Samples in = packed + skipped + failed" holds for a run that drains its
buffers (an epoch, the demo). A run restored from a checkpoint starts from zero and re-reads the
samples that were buffered, not yet packed, at the save; it counts them as seen (they are packed
in this run), so adding the counts of the saved and the restored run counts those samples twice.
Saving the counters in the checkpoint would not remove that double count, only move it.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

__all__ = ["FAILURE_SLOTS", "SKIP_REASONS", "LoaderStats", "combine_snapshots"]

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
_OTHER = (
    "seen",
    "encoded",
    "packed",
    "packs",
    "decoded",
    "empty_pack",
    "padded",
    "select_ns",  # time inside the packer (select_samples_to_pack)
    "build_ns",  # time inside the batch builder (pack_samples / padding)
)
_FIELDS = (*_OTHER, *(f"skipped:{r}" for r in SKIP_REASONS))
_INDEX = {name: i for i, name in enumerate(_FIELDS)}

#: Distinct failure reasons (exception type names) counted apart, the last one "<other>".
FAILURE_SLOTS = 32
_NAME_BYTES = 64  # per slot; longer type names are cut (they stay distinct in practice)
_OTHER_FAILURE = "<other>"


class LoaderStats:
    """Process-shared counters of one task encoder."""

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("fork")
        self._values = ctx.Array("q", len(_FIELDS) + FAILURE_SLOTS, lock=True)
        # failure slot names, guarded by the lock of `_values` (which holds their counts)
        self._failure_names = ctx.RawArray("c", FAILURE_SLOTS * _NAME_BYTES)
        self.failures: list[str] = []  # per-process detail (sample keys): complete with 0 workers

    def add(self, name: str, amount: int = 1) -> None:
        index = _INDEX[name]
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

    def fail(self, reason: str, amount: int = 1) -> None:
        """Counts ``amount`` failed samples under ``reason`` (an exception type name)."""
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
        """Counts now: ``seen``, ``encoded``, ``packed`` (samples delivered in packs), ``packs``,
        ``decoded``, ``skipped`` (dict reason -> count), ``skipped_total``,
        ``failed_by_reason`` (dict exception type name -> count, in order of first failure)
        and ``failed`` (their sum)."""
        with self._values.get_lock():
            values = [int(v) for v in self._values[:]]
            names = self._failure_names.raw
        out: dict[str, Any] = {name: values[_INDEX[name]] for name in _OTHER}
        out["skipped"] = {r: values[_INDEX[f"skipped:{r}"]] for r in SKIP_REASONS}
        out["skipped_total"] = sum(out["skipped"].values())
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

    def error_handler(
        self, inner: Callable[[Exception, Any, Any], None] | None = None
    ) -> Callable[[Exception, Any, Any], None]:
        """An Energon ``global_error_handler`` that counts failed samples by exception type (a
        failed pack or batch counts all its members), logs one line, then calls `inner` (e.g.
        Energon's ``log_exception`` or ``reraise_exception``) if given."""

        def handler(err: Exception, sample: Any, sources: Any = None) -> None:
            n = _count_samples(sample)
            self.fail(type(err).__name__, n)
            key = _describe(sample)
            self.failures.append(f"{key}: {type(err).__name__}: {err}")
            logger.warning(
                "sample %s failed (%d sample(s) dropped): %s: %s", key, n, type(err).__name__, err
            )
            if inner is not None:
                inner(err, sample, sources)

        return handler


def combine_snapshots(snapshots: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """The sum of `LoaderStats.snapshot` results (of several ranks): counts add, per-reason
    skips and failures add by reason (failure reasons in order of first appearance)."""
    out: dict[str, Any] = {name: 0 for name in _OTHER}
    out["skipped"] = dict.fromkeys(SKIP_REASONS, 0)
    failed: dict[str, int] = {}
    for snap in snapshots:
        for name in _OTHER:
            out[name] += int(snap.get(name, 0))
        for reason, n in snap.get("skipped", {}).items():
            out["skipped"][reason] = out["skipped"].get(reason, 0) + int(n)
        for reason, n in snap.get("failed_by_reason", {}).items():
            failed[reason] = failed.get(reason, 0) + int(n)
    out["skipped_total"] = sum(out["skipped"].values())
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
