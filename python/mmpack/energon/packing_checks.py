"""The checks that keep the packing setup whole: no pack exceeds ``capacity``, every sample lands
in exactly one pack, and the batch options fit the tokenizer.

At construction (a bad setup never reaches a worker): the packer accepts the config's packing
options (`probe_packer`), the batch builder accepts its batch options (`probe_batch_options`),
``capacity`` is a multiple of the padding multiple and fits int32 ``cu_seqlens``
(`check_capacity`), and ``ignore_index`` is no token id (`check_ignore_index`).

While packing (a task encoder whose hooks disagree, e.g. a subclass): a sample past
``capacity`` that reached the packer (`check_buffer_lengths`) and a pack built past it
(`check_pack_length`) stop the job with a ``FatalSampleError``, since every buffer would fail the
same way; a packer that drops or repeats a sample fails its buffer (`packs_of`). A pack past
``capacity`` whose members were restored from a loader checkpoint was planned when it was saved:
the error names the checkpoint (saved with a larger capacity or other padding), not the hooks.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
from megatron.energon.errors import FatalSampleError

from mmpack.batch import EncodedSample, pack_samples
from mmpack.batch.fields import THD_MAX_LENGTH
from mmpack.batch.options import BatchOptions
from mmpack.energon.config import PackingEncoderConfig
from mmpack.energon.samples import EncodedConversation
from mmpack.errors import BatchOptionError, EnergonConfigError, IndexOverflowError

__all__ = [
    "check_buffer_lengths",
    "check_capacity",
    "check_ignore_index",
    "check_pack_length",
    "packs_of",
    "probe_batch_options",
    "probe_packer",
]

T = TypeVar("T")


def probe_packer(plan_packs: Callable[..., Any], packer_name: str, media: bool) -> None:
    """Plan one tiny buffer with `plan_packs` (with media units when `media`): raises
    `EnergonConfigError` naming `packer_name` if the packing options are invalid."""
    try:
        plan_packs(
            np.array([1], dtype=np.int64),
            np.array([0], dtype=np.int64) if media else None,
            seed=0,
        )
    except EnergonConfigError:
        raise
    except Exception as err:
        raise EnergonConfigError(
            f"packing options rejected by {packer_name}: {type(err).__name__}: {err}"
        ) from err


def probe_batch_options(config: PackingEncoderConfig) -> BatchOptions:
    """The config's batch options, made once; raises `EnergonConfigError` if they are invalid
    (a negative ``pad_token_id``, an ``ignore_index`` equal to it): one padding token through
    the batch builder."""
    probe = EncodedSample("probe", [config.pad_token_id], loss_mask=[1])
    try:
        options = config.batch_options()
        pack_samples([probe], options.replace(loss_mask_mode="precomputed"))
    except (BatchOptionError, IndexOverflowError) as err:  # overflow: padding past int32
        raise EnergonConfigError(f"batch options rejected by pack_samples: {err}") from err
    return options


def check_capacity(config: PackingEncoderConfig, options: BatchOptions) -> None:
    """Refuse a ``capacity`` that no pack can have: every sample is padded to the padding
    multiple, so a pack's length is a multiple of it, and so must the fixed length of a
    micro-batch be (``pad_to_length=capacity * batch_size``), which ``cu_seqlens`` (int32)
    must hold."""
    capacity = config.capacity
    batch_size = config.batch_size
    if capacity * batch_size > THD_MAX_LENGTH:
        raise EnergonConfigError(
            f"capacity * batch_size = {capacity} * {batch_size} = {capacity * batch_size} "
            f"positions: a micro-batch (pad_to_length=capacity * batch_size) holds at most "
            f"2**31 - 1 = {THD_MAX_LENGTH} (cu_seqlens are int32)"
        )
    multiple = options.padding_multiple
    if capacity % multiple:
        below = capacity - capacity % multiple
        above = below + multiple
        hint = f"{below} or {above}" if below else str(above)
        raise EnergonConfigError(
            f"capacity={capacity} is not a multiple of {multiple}, the padding multiple of "
            f"pad_to_multiple_of={config.pad_to_multiple_of} and "
            f"cp_size={config.cp_size}: every sample is padded to a multiple of "
            f"{multiple}, so a pack's length is one; use {hint}"
        )


def check_ignore_index(ignore_index: int, tokenizer: Any) -> None:
    """Refuse an ``ignore_index`` that is a token id of `tokenizer`: labels of that token would
    be ignored by the loss (caught here, not only by the batch that first holds it)."""
    if tokenizer is None:
        return
    vocab_size = len(tokenizer)
    if 0 <= ignore_index < vocab_size:
        raise EnergonConfigError(
            f"ignore_index={ignore_index} is a valid token id of the tokenizer "
            f"(vocabulary size {vocab_size}), so labels of that token would be ignored by "
            "the loss; use a negative value such as -100"
        )


def check_buffer_lengths(
    samples: Sequence[EncodedConversation], lengths: np.ndarray, capacity: int
) -> None:
    """Stop the job on a sample longer than `capacity` in the packing buffer: the oversize
    check of ``check_policy`` was bypassed (an override that does not call
    ``super().check_policy``), and the packer would fail the whole buffer, good samples with
    it, every time such a sample comes. Fatal: no buffer would be safe."""
    over = np.flatnonzero(lengths > capacity)
    if not over.size:
        return
    i = int(over[0])
    err = EnergonConfigError(
        f"sample {samples[i].__key__!r} reached packing with pack_length "
        f"{int(lengths[i])} > capacity {capacity}: check_policy must refuse "
        f"such samples (an override must call super().check_policy)"
    )
    raise FatalSampleError(str(err)) from err


def packs_of(samples: Sequence[T], packing: Any) -> list[list[T]]:
    """The members of each pack of `packing` (``bin_offsets``, ``item_indices``); raises
    ``RuntimeError`` unless every sample is in exactly one pack."""
    offsets = np.asarray(packing.bin_offsets).tolist()
    items = np.asarray(packing.item_indices).tolist()
    if len(items) != len(samples) or sorted(items) != list(range(len(samples))):
        raise RuntimeError(
            f"packer returned {len(items)} placements for {len(samples)} samples; every "
            "sample must be in exactly one pack"
        )
    return [[samples[i] for i in items[a:b]] for a, b in itertools.pairwise(offsets)]


def check_pack_length(
    encoder: Any,
    packed: Any,
    samples: Sequence[EncodedConversation],
    *,
    restored: Sequence[str] = (),
) -> None:
    """Stop the job on a pack longer than the task `encoder`'s capacity: its ``pack_length``,
    ``plan_packs`` and ``build_pack`` disagree (a subclass), and
    ``micro_batch(pad_to_length=capacity * batch_size)`` would fail on it. Fatal: every buffer
    would fail the same way. When members of the pack (`restored`, their keys) were restored
    from a loader checkpoint, the pack was planned by the run that saved it: the error names the
    checkpoint."""
    capacity, pack_length = encoder.config.capacity, encoder.pack_length
    length = len(packed.input_ids)
    if length <= capacity:
        return
    keys = [s.__key__ for s in samples]
    planned = sum(pack_length(s) for s in samples)
    if restored:
        err = EnergonConfigError(
            f"a pack of {length} positions (samples {keys}, {planned} planned here) is over "
            f"capacity {capacity}: its samples {list(restored)} were restored from the loader "
            "checkpoint, in a pack planned when the checkpoint was saved, so the checkpoint "
            f"was saved with a larger capacity (or other padding) than {capacity}: restore it "
            "with the capacity and padding it was saved with"
        )
        raise FatalSampleError(str(err)) from err
    err = EnergonConfigError(
        f"{type(encoder).__name__} built a pack of {length} positions from samples "
        f"{keys} (planned: {planned}), over capacity {capacity}: pack_length must be the "
        f"positions build_pack gives each sample (padding included), and plan_packs must "
        f"keep each pack's pack_length total within the capacity"
    )
    raise FatalSampleError(str(err)) from err
