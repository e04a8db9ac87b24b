"""What happens to bad samples and failing hooks, so that a broken dataset stops the job with a
clear error instead of training on nothing or looping forever.

* Policy skips: a sample that is well-formed but useless or too big raises Energon's
  ``SkipSample`` and is counted per reason. `check_conversation` runs before the sample is
  encoded (so it reads no media, not even a header): no turns, ends on a user turn.
  `check_sample` runs once on the encoded sample and reads what the encoder counted: nothing
  trainable, longer than the capacity once padded as the packs are, more media than the media
  capacity. Malformed samples raise typed errors (`SampleFormatError`; `LossMaskError` from
  the encoder), which Energon's failure tolerance handles.
* Undeclared modalities (`check_conversation`): media of a kind the config does not declare in
  ``modalities`` stops the job at the first such sample (`UndeclaredModalityError`, raised as
  Energon's ``FatalSampleError``), naming the kind and the setting to change; with
  ``on_undeclared_media: skip`` such samples are skipped and counted instead. (Otherwise every
  such sample would fail on its own, and a job mixing them with good samples would never stop.)
* Consecutive skips (`ConsecutiveSkipGuard`): Energon never counts ``SkipSample`` and waits
  forever when every sample is skipped, so ``max_consecutive_skips`` skips in a row (per worker)
  stop the job with a `FatalSampleError` that says why.
* Finite failure tolerance (`check_hooks`, `stateless_with_tolerance`): Energon reads a tolerance
  of 0 as "never stop", and re-runs some hooks when it restores a checkpoint (those must be
  ``@stateless``); both are checked when the task encoder is built, not after a resume.
* Seeds (`seeded`, and `stateless_with_tolerance` with ``restore_seeds=True``): randomness in a
  hook is seeded from the loader's own state, never from what ran before in the process.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from megatron.energon import SkipSample, WorkerConfig, stateless
from megatron.energon.errors import FatalSampleError
from megatron.energon.rng import SystemRng
from megatron.energon.task_encoder.base import get_failure_tolerance, get_stateless

from mmpack.energon.config import KNOWN_MODALITIES, PackingEncoderConfig
from mmpack.energon.samples import Conversation, EncodedConversation
from mmpack.energon.stats import LoaderStats
from mmpack.errors import (
    EnergonConfigError,
    SampleFormatError,
    TooManySkippedError,
    UndeclaredModalityError,
)

__all__ = [
    "OTHER_HOOKS",
    "RESTORED_HOOKS",
    "ConsecutiveSkipGuard",
    "check_conversation",
    "check_hooks",
    "check_sample",
    "seeded",
    "stateless_with_tolerance",
]

F = TypeVar("F", bound=Callable[..., Any])

#: ``skip(sample, reason, detail)``: count a policy skip and return the ``SkipSample`` to raise
SkipFn = Callable[[Any, str, str], SkipSample]


#: Hooks Energon re-runs when it restores a checkpoint (must be @stateless, finite tolerance).
RESTORED_HOOKS = (
    "cook_crude_sample",
    "preencode_sample",
    "postencode_sample",
    "pack_selected_samples",
    "batch",
)
#: Hooks that only need a finite failure tolerance.
OTHER_HOOKS = ("select_samples_to_pack", "encode_batch")


def seeded(fn: F) -> F:
    """``@stateless(restore_seeds=True)`` whose seed depends only on the loader's state.

    Energon's wrapper seeds torch, numpy and ``random`` from (worker seed,
    ``current_sample_index``) around each call, but reads the worker seed once, at the first
    call of the decorated function in the process, and keeps it for every later call, whatever
    loader, worker, rank or ``seed_offset`` makes it (forked workers inherit it). So one batch
    taken earlier in the process (a dry run, a validation loader with 0 workers) changes what
    every later loader's workers draw, and a run restored in a fresh process does not continue
    as the uninterrupted one. This wrapper reads the active worker config's seed at every call:
    the same seeds as Energon's in a process where nothing ran before, and no others. Generator
    hooks are seeded as Energon seeds them (the hook's own random state is kept between its
    items, the caller's restored around each).
    """
    if inspect.isgeneratorfunction(fn):

        @functools.wraps(fn)
        def seeded_generator(self: Any, *args: Any, **kwargs: Any) -> Iterator[Any]:
            outer = SystemRng.save_state()
            SystemRng.seed_args(_worker_seed(), self.current_sample_index)
            inner = None
            it = iter(fn(self, *args, **kwargs))
            while True:
                if inner is not None:
                    SystemRng.restore_state(inner)
                try:
                    item = next(it)
                    inner = SystemRng.save_state()
                except StopIteration:
                    return
                finally:
                    SystemRng.restore_state(outer)
                yield item
                outer = SystemRng.save_state()

        seeded_generator.__stateless__ = True  # type: ignore[attr-defined]
        return seeded_generator  # type: ignore[return-value]

    @functools.wraps(fn)
    def seeded_call(self: Any, *args: Any, **kwargs: Any) -> Any:
        outer = SystemRng.save_state()
        SystemRng.seed_args(_worker_seed(), self.current_sample_index)
        try:
            return fn(self, *args, **kwargs)
        finally:
            SystemRng.restore_state(outer)

    seeded_call.__stateless__ = True  # type: ignore[attr-defined]
    return seeded_call  # type: ignore[return-value]


def _worker_seed() -> int:
    """The seed of the worker running now (from its rank, worker id and ``seed_offset``; the
    worker that made a sample while Energon restores it)."""
    config = WorkerConfig.active_worker_config
    if config is None:
        raise EnergonConfigError(
            "a seeded hook ran outside an active Energon worker (no WorkerConfig is active): "
            "call it from a loader, or activate one (WorkerConfig.worker_activate)"
        )
    return config.worker_seed()


def stateless_with_tolerance(
    *, restore_seeds: bool = False, failure_tolerance: int | None = None
) -> Callable[[F], F]:
    """``@stateless(restore_seeds=..., failure_tolerance=...)`` that keeps the tolerance, and
    with ``restore_seeds`` seeds as `seeded` does (from the loader's state only).

    Energon 7.4's ``stateless`` returns its ``restore_seeds`` wrapper before it records
    ``failure_tolerance``, so ``@stateless(restore_seeds=True, failure_tolerance=N)`` silently
    uses the class default instead of N. This applies the tolerance to the inner function first
    (``functools.wraps`` copies the attribute onto the seeding wrapper).
    """
    if failure_tolerance is not None and (
        isinstance(failure_tolerance, bool)
        or not isinstance(failure_tolerance, int)
        or failure_tolerance < 1
    ):
        raise EnergonConfigError(
            f"failure_tolerance must be a positive integer (0 means 'never stop' in Energon), "
            f"got {failure_tolerance!r}"
        )

    def decorate(fn: F) -> F:
        inner = (
            stateless(fn, failure_tolerance=failure_tolerance)
            if failure_tolerance
            else stateless(fn)
        )
        if restore_seeds:
            return seeded(inner)
        return inner

    return decorate


def check_hooks(
    encoder: Any,
    *,
    restored_hooks: Iterable[str],
    other_hooks: Iterable[str],
    default_tolerance: int,
) -> None:
    """Raise `EnergonConfigError` when one of `restored_hooks` (hooks Energon re-runs on restore)
    is not ``@stateless``, or any hook has a failure tolerance that Energon reads as 'never
    stop'. Energon itself checks statelessness only when restoring, and never the tolerance."""
    restored = tuple(restored_hooks)
    problems = []
    for name in (*restored, *other_hooks):
        hook = getattr(encoder, name)
        if name in restored and not get_stateless(hook):
            problems.append(
                f"{name} is not @stateless (Energon re-runs it on restore; use "
                "@stateless, or mmpack.energon.policy.seeded if it uses randomness)"
            )
        if _seeded_by_energon(hook):
            problems.append(
                f"{name} is seeded by Energon's @stateless(restore_seeds=True), which keeps the "
                "worker seed of its first call in the process: a loader that ran before (a dry "
                "run, a validation loader) changes what it draws, and a run restored in a fresh "
                "process does not continue as the uninterrupted one; use "
                "mmpack.energon.policy.seeded (or stateless_with_tolerance(restore_seeds=True))"
            )
        tolerance = get_failure_tolerance(hook, default_tolerance)
        if tolerance <= 0:
            problems.append(
                f"{name} has failure_tolerance={tolerance}, which Energon reads as 'never stop'"
            )
    if problems:
        raise EnergonConfigError(f"{type(encoder).__name__}: " + "; ".join(problems))


def _seeded_by_energon(hook: Any) -> bool:
    """Whether `hook` (or a function it wraps) is Energon's ``restore_seeds`` wrapper, known by
    the seed it caches in its closure."""
    fn = getattr(hook, "__func__", hook)
    for _ in range(16):  # a wrapper chain, not a cycle
        code = getattr(fn, "__code__", None)
        if code is not None and "worker_seed" in code.co_freevars:
            return True
        fn = getattr(fn, "__wrapped__", None)
        if fn is None:
            return False
    return False


class ConsecutiveSkipGuard:
    """Counts policy skips (in `stats`, per reason) and stops the job after `limit` skips in a
    row. Per worker process: each worker has its own copy, and the count is not checkpointed
    (it only decides when to stop, never what is produced)."""

    def __init__(self, stats: LoaderStats, limit: int) -> None:
        self.stats = stats
        self.limit = limit
        # policy skips since the last sample that passed, per reason
        self.in_a_row: dict[str, int] = {}

    def skip(self, sample: Any, reason: str, detail: str) -> SkipSample:
        """Count one skip; return the ``SkipSample`` to raise, or raise `FatalSampleError`
        (from a `TooManySkippedError`) when this skip reaches the limit."""
        self.stats.skip(reason)
        self.in_a_row[reason] = self.in_a_row.get(reason, 0) + 1
        consecutive = sum(self.in_a_row.values())
        if consecutive >= self.limit:
            by_reason = ", ".join(f"{k}: {v}" for k, v in sorted(self.in_a_row.items()))
            err = TooManySkippedError(
                f"{consecutive} consecutive samples were skipped by policy "
                f"({by_reason}; last: {getattr(sample, '__key__', '?')}: {detail}). Energon waits "
                "forever when every sample is skipped, so the job stops here: check the data or "
                f"raise max_consecutive_skips (now {self.limit})"
            )
            raise FatalSampleError(str(err)) from err
        return SkipSample(f"{reason}: {detail}")

    def passed(self) -> None:
        """A sample passed the policy: the run of skips is over."""
        self.in_a_row.clear()


def check_conversation(
    config: PackingEncoderConfig, conversation: Conversation, skip: SkipFn
) -> None:
    """Checks of a cooked conversation, before it is encoded (nothing of its media is read):
    media of an undeclared kind stops the job (or ``skip(...)`` under
    ``on_undeclared_media="skip"``); no turns or a last turn that is not trained on raise
    ``skip(...)``."""
    for turn in conversation.turns:
        for part in turn.parts:
            if part.media is not None and part.media.kind not in config.modalities:
                _undeclared(config, conversation, part.media.kind, part.media.key, skip)
    roles = [t.role for t in conversation.turns if t.role != "system"]
    if not roles:
        raise skip(conversation, "no_turns", "the conversation has no user/assistant turns")
    if roles[-1] not in config.train_roles:
        raise skip(
            conversation,
            "ends_on_user_turn",
            f"the conversation ends on a {roles[-1]!r} turn, with no answer to train on",
        )


def _undeclared(
    config: PackingEncoderConfig, conversation: Conversation, kind: str, key: str, skip: SkipFn
) -> None:
    declared = list(config.modalities)
    if config.on_undeclared_media == "skip":
        raise skip(
            conversation,
            "undeclared_modality",
            f"{kind} media {key!r}, but modalities is {declared}",
        )
    where = f"sample {conversation.__key__!r} holds {kind} media {key!r}"
    skip_hint = "or set on_undeclared_media: skip to skip and count such samples"
    if kind in KNOWN_MODALITIES:
        message = (
            f"{where}, but the encoder's config declares modalities {declared}: add {kind!r} "
            f"to modalities (with the processor's {kind} settings) to train on it, {skip_hint}"
        )
    else:
        message = (
            f"{where}, a kind mmpack does not support (modalities can be "
            f"{', '.join(KNOWN_MODALITIES)}): fix the kind in the data, {skip_hint}"
        )
    err = UndeclaredModalityError(message)
    # a system exception for Energon: the job stops here instead of failing such samples one
    # by one (which never stops while good samples come in between)
    raise FatalSampleError(str(err)) from err


def check_sample(
    config: PackingEncoderConfig,
    conversation: Conversation,
    encoded: EncodedConversation,
    skip: SkipFn,
    *,
    pack_length: int | None = None,
) -> None:
    """Raise ``skip(...)`` for an encoded sample that is bad by policy, or `SampleFormatError`
    for one that is too big under ``on_oversize="error"``. Reads what the conversation encoder
    counted (`EncodedConversation.trainable_tokens`; its mask inputs were validated there);
    `check_conversation` has already checked the conversation's structure. A sample is too
    long when its `pack_length` (the positions it takes in a pack, padding included; default
    its tokens padded by the config's batch options) exceeds ``capacity``."""
    key = conversation.__key__
    if encoded.trainable_tokens is None:
        raise SampleFormatError(
            f"sample {key!r} has no trainable-token count: it was not made by "
            "EncodedConversation.validated_from, so its mask inputs were never validated"
        )
    if encoded.trainable_tokens == 0:
        raise skip(conversation, "empty_trainable_mask", "no token is trainable")
    if pack_length is None:
        pack_length = config.batch_options().padded_length(encoded.num_tokens)
    if pack_length > config.capacity:
        detail = f"{encoded.num_tokens} tokens"
        if pack_length != encoded.num_tokens:
            detail += (
                f", padded to {pack_length} (pad_to_multiple_of={config.pad_to_multiple_of}, "
                f"cp_size={config.cp_size})"
            )
        detail += f" > capacity {config.capacity}"
        if config.on_oversize == "error":
            raise SampleFormatError(f"sample {key!r} is too long: {detail} (on_oversize='error')")
        raise skip(conversation, "oversize", detail)
    media_capacity = config.media_capacity
    if media_capacity is not None and encoded.media_units > media_capacity:
        detail = f"{encoded.media_units} media units > media_capacity {media_capacity}"
        if config.on_oversize == "error":
            raise SampleFormatError(f"sample {key!r} has too much media: {detail}")
        raise skip(conversation, "media_over_budget", detail)
