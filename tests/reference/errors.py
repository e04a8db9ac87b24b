"""The errors the plain-Python references raise: their own classes, named as the kinds of failure
the tests compare (a test compares a reference error with mmpack's by class name, never by
class: the references import nothing from mmpack).

Every class is a ``ValueError``, grouped as the failures are::

    ReferenceInputError
    ├── BatchError          batches: samples, loss masks, turns, options, layout
    └── EnergonDataError    the Energon task encoder: settings, samples, media
"""

from __future__ import annotations

__all__ = [
    "BatchError",
    "BatchLayoutError",
    "BatchOptionError",
    "EmptySampleError",
    "EnergonConfigError",
    "EnergonDataError",
    "InvalidTokenError",
    "LossMaskError",
    "MediaTokenCountError",
    "MessageSpanError",
    "MissingFieldError",
    "ReferenceInputError",
    "SampleFormatError",
    "TooManySkippedError",
    "TurnStructureError",
    "UndeclaredModalityError",
]


class ReferenceInputError(ValueError):
    """Any failure of a reference on bad input."""


class BatchError(ReferenceInputError):
    """A batch cannot be built from the samples and options given."""


class LossMaskError(BatchError):
    """A loss mask breaks a rule: its length is the token count, its values are 0 and 1."""


class MessageSpanError(LossMaskError):
    """Message or fragment lengths and flags disagree with each other or with the tokens."""


class TurnStructureError(BatchError):
    """Turn markers are missing or do not come in user/assistant pairs."""


class MissingFieldError(BatchError):
    """A sample lacks a field its loss-mask mode needs."""


class EmptySampleError(BatchError):
    """A sample (or a batch) has no tokens."""


class InvalidTokenError(BatchError):
    """A token id is negative."""


class BatchOptionError(BatchError):
    """A batch-builder option is out of range or contradicts the samples."""


class BatchLayoutError(BatchError):
    """The fields of a batch disagree with each other."""


class EnergonDataError(ReferenceInputError):
    """The Energon task encoder cannot run with these settings or on this sample."""


class EnergonConfigError(EnergonDataError):
    """A setting the reference task encoder does not implement, or an invalid one."""


class SampleFormatError(EnergonDataError):
    """A raw sample cannot be cooked, encoded or decoded."""


class MediaTokenCountError(EnergonDataError):
    """A decoded media item takes another number of tokens than the sample was encoded with."""


class UndeclaredModalityError(EnergonDataError):
    """A sample holds media of a kind the settings do not declare."""


class TooManySkippedError(EnergonDataError):
    """Too many samples in a row were skipped by policy."""
