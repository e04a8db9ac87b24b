"""Counters shared by the loader's worker processes: samples seen, skipped (per reason),
failed, packed, media decoded. Energon forks its workers (``multiprocessing_context="fork"``), so
a `multiprocessing` array created with the task encoder, before the loader starts, is shared by
every worker and read by the main process.

The counters are statistics of one loader run, not training state, so they are not part of a
loader checkpoint. "Samples in = packed + skipped + failed" holds for a run that drains its
buffers (an epoch, the demo). A run restored from a checkpoint starts from zero and re-reads the
samples that were buffered, not yet packed, at the save; it counts them as seen (they are packed
in this run), so adding the counts of the saved and the restored run counts those samples twice.
Saving the counters in the checkpoint would not remove that double count, only move it.
"""

from __future__ import annotations

import logging
import multiprocessing
from collections.abc import Callable
from typing import Any

__all__ = ["SKIP_REASONS", "LoaderStats"]

logger = logging.getLogger("mmpack.energon")

#: Policy reasons a sample is skipped for (each counted).
SKIP_REASONS = (
    "ends_on_user_turn",
    "empty_trainable_mask",
    "no_turns",
    "oversize",
    "media_over_budget",
)
_OTHER = (
    "seen",
    "encoded",
    "failed",
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


class LoaderStats:
    """Process-shared counters of one task encoder."""

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("fork")
        self._values = ctx.Array("q", len(_FIELDS), lock=True)
        self.failures: list[str] = []  # per-process, main-process (0 workers) detail

    def add(self, name: str, amount: int = 1) -> None:
        index = _INDEX[name]
        with self._values.get_lock():
            self._values[index] += amount

    def skip(self, reason: str) -> None:
        self.add(f"skipped:{reason}")

    def reset(self) -> None:
        with self._values.get_lock():
            for i in range(len(_FIELDS)):
                self._values[i] = 0
        self.failures.clear()

    def snapshot(self) -> dict[str, Any]:
        """Counts now: ``seen``, ``encoded``, ``packed`` (samples delivered in packs), ``packs``,
        ``failed``, ``decoded``, ``skipped`` (dict reason -> count) and ``skipped_total``."""
        with self._values.get_lock():
            values = [int(v) for v in self._values[:]]
        out: dict[str, Any] = {name: values[_INDEX[name]] for name in _OTHER}
        out["skipped"] = {r: values[_INDEX[f"skipped:{r}"]] for r in SKIP_REASONS}
        out["skipped_total"] = sum(out["skipped"].values())
        return out

    def error_handler(
        self, inner: Callable[[Exception, Any, Any], None] | None = None
    ) -> Callable[[Exception, Any, Any], None]:
        """An Energon ``global_error_handler`` that counts failed samples (a failed pack or batch
        counts all its members), logs one line, then calls `inner` (e.g. Energon's
        ``log_exception`` or ``reraise_exception``) if given."""

        def handler(err: Exception, sample: Any, sources: Any = None) -> None:
            n = _count_samples(sample)
            self.add("failed", n)
            key = _describe(sample)
            self.failures.append(f"{key}: {type(err).__name__}: {err}")
            logger.warning(
                "sample %s failed (%d sample(s) dropped): %s: %s", key, n, type(err).__name__, err
            )
            if inner is not None:
                inner(err, sample, sources)

        return handler


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
