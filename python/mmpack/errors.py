"""Every error mmpack raises on bad input.

All are subclasses of ``MmpackError`` (a ``ValueError``), grouped by area so that one
``except`` catches a whole area::

    MmpackError
    ├── IndexOverflowError            a length, count or offset does not fit
    ├── PackedTensorError             PackedTensor layout, provenance, shards, segments
    ├── PackingError                  sequence packing (lengths, budgets, bin counts, arguments)
    ├── BatchError                    packed batches (samples, loss masks, turns, media, options)
    ├── EnergonDataError              the Megatron-Energon integration (config, samples)
    └── PickleSecurityError           the safe NeMo-RL pickle loader (unsafe or corrupt input)

Where NeMo-RL raises a builtin type mmpack raises it too, or a class that is also that builtin
(documented on each class and at the raising site). The native classes come from one table in
``rust/py/src/errors.rs`` (``mmpack._native.ERROR_NAMES`` lists them); the others are defined
here. Each area keeps its names in its own section.
"""

import pickle

from mmpack._native import (
    # --- shared ---
    IndexOverflowError,
    MmpackError,
    # --- PackedTensor ---
    LayoutError,
    PackedTensorError,
    ProvenanceError,
    ShardError,
    # --- packing ---
    BinCountError,
    InvalidLengthError,
    ItemTooLargeError,
    PackingArgumentError,
    PackingError,
    # --- batch ---
    BatchError,
    BatchLayoutError,
    BatchOptionError,
    EmptySampleError,
    InvalidTokenError,
    LossMaskError,
    MessageSpanError,
    MissingFieldError,
    TurnStructureError,
)

# --- packing (pure Python) ---


class PackingDtypeError(PackingError, TypeError):
    """Lengths (or media counts) given to ``mmpack.packing`` are not integers: floats, bools,
    strings or objects. Both a ``ValueError`` and a ``TypeError``."""


# --- end packing ---

# --- PackedTensor (pure Python) ---


class OutBufferError(PackedTensorError, TypeError):
    """The ``out=`` buffer given to ``PackedTensor.as_tensor`` does not fit the result: wrong
    shape, dtype or device, not contiguous, or overlapping the segments being gathered. Both a
    ``ValueError`` and a ``TypeError``."""


class PinMemoryUnavailableError(PackedTensorError, RuntimeError):
    """``pin_memory=True`` was asked for but this torch build has no accelerator to pin host
    memory for (page-locked memory needs CUDA)."""


class LayoutMismatchError(LayoutError, pickle.PicklingError):
    """A ``PackedTensor`` is pickled while its ``tensors`` list no longer fits its row layout
    (a segment appended to or removed from ``tensors`` of a deduplicated value, or a segment
    index past the end of the list): its pickle would not load. The message names the value
    and both counts. Also a ``pickle.PicklingError``."""


class SegmentMismatchError(PackedTensorError, RuntimeError):
    """The segments of a ``PackedTensor`` cannot be concatenated by ``as_tensor``: they live on
    different devices (or on ``meta`` while data is needed), have different ranks, or differ in
    a dimension other than ``dim_to_pack`` without ``pad_to_max_shape``. The message names the
    devices or shapes. Also a ``RuntimeError``, which NeMo-RL (``torch.cat``) raises there."""


# --- batch (pure Python) ---


class ChatTemplateError(BatchError):
    """A chat template cannot give token ids and a loss mask: the tokenizer has no template,
    the conversation is empty, or the template is not prefix-stable (per-message boundaries
    are unknown)."""


class BatchMediaError(BatchError):
    """The media of one key cannot be merged across the samples of a pack (for example
    different ``dim_to_pack``); the message names the key and the samples."""


# --- end batch ---

# --- energon (pure Python) ---


class EnergonDataError(MmpackError):
    """Base class of the Megatron-Energon integration's errors: encoder configuration,
    modalities, sample formats and skipped samples."""


class EnergonConfigError(EnergonDataError):
    """A `PackingEncoderConfig` (or a loader option) is invalid: an unknown or retired field, a
    value out of range (a failure tolerance of 0), or a checkpoint that does not fit the loader."""


class ModalityConfigError(EnergonDataError):
    """A configured modality is not fully supported by the processor / feature-extractor
    settings; the message names every missing setting. Raised at construction, before any
    sample is read."""


class SampleFormatError(EnergonDataError):
    """A raw sample cannot be cooked or encoded (malformed JSON, a media placeholder without a
    manifest entry, a missing media key); the message names the sample."""


class MediaTokenCountError(EnergonDataError):
    """A decoded media item takes a different number of tokens than the sample was encoded
    with (its manifest or fragment metadata declares a wrong size or duration). The message
    names the sample, the item and both counts; the sample is counted as failed, never packed
    with its media shifted against its placeholder tokens."""


class UndeclaredModalityError(EnergonDataError):
    """A sample holds media of a kind the encoder's config does not declare in ``modalities``.
    The message names the kind and the setting to change (``modalities``, or
    ``on_undeclared_media: skip`` to skip and count such samples instead)."""


class TooManySkippedError(EnergonDataError):
    """Too many consecutive samples were skipped by policy. Energon waits forever when every
    sample is skipped, so the encoder stops the job instead; the message gives counts per reason."""


# --- end energon ---

# --- compat (pure Python) ---


class PickleSecurityError(MmpackError, pickle.UnpicklingError):
    """Base class of the refusals of ``mmpack.compat.nemo_rl.loads`` / ``load``: a pickle that
    is unsafe or not readable. Also a ``pickle.UnpicklingError``, so code that catches that
    keeps working."""


class UnsafePickleError(PickleSecurityError):
    """A pickle handed to ``mmpack.compat.nemo_rl.loads`` / ``load`` references a global that a
    PackedTensor payload never needs (for example ``os.system``); the message names it."""


class CorruptPickleError(PickleSecurityError):
    """``mmpack.compat.nemo_rl.loads`` / ``load`` got bytes that are not a readable pickle or
    ``torch.save`` archive (truncated, bit-flipped, inconsistent length fields or tensor
    records); the original error is chained as ``__cause__``."""


class PickleTooLargeError(PickleSecurityError):
    """``mmpack.compat.nemo_rl.loads`` / ``load`` would need more memory than a payload of that
    size may cost: by default 32 times its size plus 64 MiB, or the caller's ``max_bytes=``.
    Refused before the memory is allocated; the message gives the payload's size and the
    bound."""


# --- end compat ---

__all__ = [
    # --- shared ---
    "IndexOverflowError",
    "MmpackError",
    # --- PackedTensor ---
    "LayoutError",
    "LayoutMismatchError",
    "OutBufferError",
    "PackedTensorError",
    "PinMemoryUnavailableError",
    "ProvenanceError",
    "SegmentMismatchError",
    "ShardError",
    # --- packing ---
    "BinCountError",
    "InvalidLengthError",
    "ItemTooLargeError",
    "PackingArgumentError",
    "PackingDtypeError",
    "PackingError",
    # --- batch ---
    "BatchError",
    "BatchLayoutError",
    "BatchMediaError",
    "BatchOptionError",
    "ChatTemplateError",
    "EmptySampleError",
    "InvalidTokenError",
    "LossMaskError",
    "MessageSpanError",
    "MissingFieldError",
    "TurnStructureError",
    # --- energon (pure Python) ---
    "EnergonConfigError",
    "EnergonDataError",
    "MediaTokenCountError",
    "ModalityConfigError",
    "SampleFormatError",
    "TooManySkippedError",
    "UndeclaredModalityError",
    # --- compat (pure Python) ---
    "CorruptPickleError",
    "PickleSecurityError",
    "PickleTooLargeError",
    "UnsafePickleError",
]
