"""Every error mmpack raises on bad input. All are ``ValueError`` subclasses of ``MmpackError``,
except where NeMo-RL compatibility demands a builtin type (documented at the raising site).
Each area keeps its names in its own section."""

import pickle

from mmpack._native import (
    # --- shared ---
    IndexOverflowError,
    MmpackError,
    # --- csr / intern ---
    LayoutError,
    ProvenanceError,
    ShardError,
    # --- packing ---
    BinCountError,
    InvalidLengthError,
    ItemTooLargeError,
    PackingArgumentError,
    # --- mask / batch ---
    BatchOptionError,
    EmptySampleError,
    InvalidTokenError,
    LossMaskError,
    MessageSpanError,
    MissingFieldError,
    TurnStructureError,
    # --- gather ---
    GatherIndexError,
    GatherSizeError,
)

# --- packing (pure Python) ---


class PackingDtypeError(MmpackError, TypeError):
    """Lengths (or media counts) given to ``mmpack.packing`` are not integers: floats, bools,
    strings or objects. Both a ``ValueError`` and a ``TypeError``."""


# --- end packing ---

# --- gather (pure Python) ---


class OutBufferError(MmpackError, TypeError):
    """The ``out=`` buffer given to ``PackedTensor.as_tensor`` does not fit the result: wrong
    shape, dtype or device, not contiguous, or overlapping the segments being gathered. Both a
    ``ValueError`` and a ``TypeError``."""


class PinMemoryUnavailableError(MmpackError, RuntimeError):
    """``pin_memory=True`` was asked for but this torch build has no accelerator to pin host
    memory for (page-locked memory needs CUDA)."""


class SegmentMismatchError(MmpackError, RuntimeError):
    """The segments of a ``PackedTensor`` cannot be concatenated by ``as_tensor``: they live on
    different devices (or on ``meta`` while data is needed), have different ranks, or differ in
    a dimension other than ``dim_to_pack`` without ``pad_to_max_shape``. The message names the
    devices or shapes. Also a ``RuntimeError``, which NeMo-RL (``torch.cat``) raises there."""


# --- mask / batch (pure Python) ---


class ChatTemplateError(MmpackError):
    """A chat template cannot give token ids and a loss mask: the tokenizer has no template,
    the conversation is empty, or the template is not prefix-stable (per-message boundaries
    are unknown)."""


class BatchMediaError(MmpackError):
    """The media of one key cannot be merged across the samples of a pack (for example
    different ``dim_to_pack``); the message names the key and the samples."""


# --- end mask / batch ---

# --- energon (pure Python) ---


class EnergonConfigError(MmpackError):
    """A `PackingEncoderConfig` (or a loader option) is invalid: an unknown or retired field, a
    value out of range (a failure tolerance of 0), or a checkpoint that does not fit the loader."""


class ModalityConfigError(MmpackError):
    """A configured modality is not fully supported by the processor / feature-extractor
    settings; the message names every missing setting. Raised at construction, before any
    sample is read."""


class EnergonDataError(MmpackError):
    """Base of the errors about the data an Energon loader reads (a sample, its media, or media
    the config does not cover), as opposed to the loader's own settings; the message names the
    sample."""


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


class TooManySkippedError(MmpackError):
    """Too many consecutive samples were skipped by policy. Energon waits forever when every
    sample is skipped, so the encoder stops the job instead; the message gives counts per reason."""


# --- end energon ---

# --- compat (pure Python) ---


class UnsafePickleError(MmpackError, pickle.UnpicklingError):
    """A pickle handed to ``mmpack.compat.nemo_rl.loads`` / ``load`` references a global that a
    PackedTensor payload never needs (for example ``os.system``); the message names it. Also a
    ``pickle.UnpicklingError``, so code that catches that keeps working."""


class CorruptPickleError(MmpackError, pickle.UnpicklingError):
    """``mmpack.compat.nemo_rl.loads`` / ``load`` got bytes that are not a readable pickle or
    ``torch.save`` archive (truncated, bit-flipped, inconsistent length fields or tensor
    records); the original error is chained as ``__cause__``. Also a
    ``pickle.UnpicklingError``."""


# --- end compat ---

__all__ = [
    # --- shared ---
    "IndexOverflowError",
    "MmpackError",
    # --- csr / intern ---
    "LayoutError",
    "ProvenanceError",
    "ShardError",
    # --- packing ---
    "BinCountError",
    "InvalidLengthError",
    "ItemTooLargeError",
    "PackingArgumentError",
    "PackingDtypeError",
    # --- mask / batch ---
    "BatchMediaError",
    "BatchOptionError",
    "ChatTemplateError",
    "EmptySampleError",
    "InvalidTokenError",
    "LossMaskError",
    "MessageSpanError",
    "MissingFieldError",
    "TurnStructureError",
    # --- gather ---
    "GatherIndexError",
    "GatherSizeError",
    "OutBufferError",
    "PinMemoryUnavailableError",
    "SegmentMismatchError",
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
    "UnsafePickleError",
]
