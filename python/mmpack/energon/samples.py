"""Sample types that flow through the Energon pipeline.

`Conversation` (cooked, media lazy) -> `EncodedConversation` (tokens, mask inputs, media handles;
after `postencode_sample` also the decoded media) -> `SftPack` (one `mmpack.batch.PackedBatch`) ->
`SftBatch` (``batch_size`` packs, or one `mmpack.batch.padded.PaddedBatch` when packing is off).
The batch fields (``labels``, ``loss_mask``, ``token_mask``, ...) are those of the table in the
`mmpack.batch` docstring.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from megatron.energon import Batch, Sample, edataclass

from mmpack.batch import EncodedSample, masks
from mmpack.energon.media import MediaHandle

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from mmpack.batch.options import BatchOptionKeywords, BatchOptions

__all__ = [
    "Conversation",
    "EncodedConversation",
    "Part",
    "SftBatch",
    "SftPack",
    "Turn",
    "TurnFields",
]

#: Keys of a chat message that a turn holds as its `Turn.role` and `Turn.parts`; a field of the
#: same name would replace them in the message the chat template renders.
_MESSAGE_KEYS = ("role", "content")


@dataclasses.dataclass(frozen=True)
class Part:
    """One piece of a turn: text (with its optional per-fragment ``trainable`` flag) or media."""

    text: str | None = None
    media: MediaHandle | None = None
    trainable: bool | None = None


class TurnFields(Mapping[str, Any]):
    """The keys of a turn's message other than its role and content (``tool_calls``,
    ``tool_call_id``, ``name``, ``reasoning_content``, ...), in the message's order, for the chat
    template. Read-only, JSON data only (str, int, float, bool, None, lists, dicts with str
    keys; copied from what it is given), hashable and picklable: a `Turn` is part of an Energon
    sample, which is pickled to the loader's workers. The lists and dicts inside are the
    template's input as they are: read them, do not change them.

    Raises ``TypeError`` for a key that is not a string or a value that is not JSON data, and
    ``ValueError`` for ``role`` or ``content`` (the turn's own role and parts)."""

    __slots__ = ("_data",)

    def __init__(self, items: Mapping[str, Any] | Iterable[tuple[str, Any]] = ()) -> None:
        data: dict[str, Any] = {}
        for key, value in dict(items).items():
            if not isinstance(key, str):
                raise TypeError(f"Turn fields: keys must be strings, got {key!r}")
            if key in _MESSAGE_KEYS:
                raise ValueError(
                    f"Turn fields: {key!r} is the turn's own (its role and parts make the "
                    "message's role and content); a field may not replace it"
                )
            data[key] = _json_copy(value, key)
        self._data = data

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __repr__(self) -> str:
        return f"TurnFields({self._data!r})"

    def __hash__(self) -> int:
        return hash(_hashable(self._data))

    def __reduce__(self) -> tuple[Any, ...]:
        return (TurnFields, (self._data,))


def _json_copy(value: Any, key: str) -> Any:
    """A copy of `value`, which must be JSON data (the type names the field `key` otherwise)."""
    if value is None or isinstance(value, (str, int, float)):
        return value
    if isinstance(value, list):
        return [_json_copy(v, key) for v in value]
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(f"Turn field {key!r}: keys must be strings, got {k!r}")
            out[k] = _json_copy(v, key)
        return out
    raise TypeError(
        f"Turn field {key!r} holds a {type(value).__name__}; fields are JSON data (str, int, "
        "float, bool, None, lists and dicts with string keys)"
    )


def _hashable(value: Any) -> Any:
    # equal JSON data hash equal: a dict's order does not count, as for its equality
    if isinstance(value, list):
        return tuple(_hashable(v) for v in value)
    if isinstance(value, dict):
        return frozenset((k, _hashable(v)) for k, v in value.items())
    return value


_NO_FIELDS = TurnFields()


@dataclasses.dataclass(frozen=True)
class Turn:
    """One message: its role, its parts (text and media, in order) and its other keys."""

    role: str
    parts: tuple[Part, ...]
    #: the message's keys other than role and content, handed to the chat template unchanged
    #: (any mapping given is made a `TurnFields`)
    fields: Mapping[str, Any] = _NO_FIELDS

    def __post_init__(self) -> None:
        if not isinstance(self.fields, TurnFields):
            fields = TurnFields(self.fields) if self.fields else _NO_FIELDS
            object.__setattr__(self, "fields", fields)


@edataclass
class Conversation(Sample):
    """A cooked conversation; media parts are undecoded `MediaHandle`s."""

    source_format: str
    turns: list[Turn]
    #: the tool schemas the conversation was written with (the chat format's top-level
    #: ``tools``), handed to the template as ``apply_chat_template(..., tools=)`` does; None:
    #: none
    tools: list[dict[str, Any]] | None = None


@edataclass
class EncodedConversation(Sample):
    """Tokens and mask inputs of one conversation; media still lazy until `postencode_sample`.

    Made by `validated_from`, which checks the mask inputs and counts the trainable tokens once,
    so the policy reads `trainable_tokens` instead of rebuilding the mask."""

    token_ids: Any  # np.ndarray[int64]
    #: one 0/1 per token, aligned with `token_ids` (the batch's ``token_mask``), or None
    loss_mask: Any  # np.ndarray[int8] or None (roles mode)
    message_lengths: Any  # np.ndarray[int64] or None (precomputed mode)
    message_roles: list[str] | None
    media: list[MediaHandle]
    media_units: int
    #: tokens each item of `media` was encoded with (its placeholder expansion), which the
    #: decoded item must take too; None: recounted from each item's metadata or header
    media_tokens: list[int] | None = None
    #: tokens trained on, counted by `validated_from` from the validated mask (or the roles in
    #: roles mode); None: not made by `validated_from`
    trainable_tokens: int | None = None
    #: filled by postencode_sample: {"pixel_values": PackedTensor (one row)}, or None
    decoded_media: dict[str, Any] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @classmethod
    def validated_from(
        cls,
        source: Sample,
        *,
        train_roles: Sequence[str],
        token_ids: Any,
        loss_mask: Any,
        message_lengths: Any,
        message_roles: list[str] | None,
        media: list[MediaHandle],
        media_units: int,
        media_tokens: list[int] | None = None,
        precomputed: bool | None = None,
    ) -> EncodedConversation:
        """The encoding of `source` (its keys carried over), with its mask inputs validated:
        a precomputed `loss_mask` by `mmpack.batch.masks.validate` (`LossMaskError`), or the
        message spans by `mmpack.batch.masks.from_roles` (`MessageSpanError`); both name the
        sample. Checked per sample here: a bad mask found by the batch builder would fail the
        whole pack the sample was selected into. ``precomputed``: the mask mode the batch will
        be built in (None: the mask if there is one); the count follows what the batch uses."""
        key = source.__key__
        if precomputed is None:
            precomputed = loss_mask is not None
        if precomputed:
            masks.validate(loss_mask, len(token_ids), sample_id=key)
            trainable = int(np.count_nonzero(loss_mask))
        else:
            by_roles = masks.from_roles(
                message_lengths, message_roles or [], train_roles, sample_id=key
            )
            trainable = int(np.count_nonzero(by_roles))
        return cls.derive_from(
            source,
            token_ids=token_ids,
            loss_mask=loss_mask,
            message_lengths=message_lengths,
            message_roles=message_roles,
            media=media,
            media_units=media_units,
            trainable_tokens=trainable,
            media_tokens=media_tokens,
        )

    def revalidated(self, train_roles: Sequence[str], *, precomputed: bool) -> EncodedConversation:
        """This encoding validated and counted again, in the batch's mask mode (after code
        outside the built-in conversation encoders may have edited it)."""
        return EncodedConversation.validated_from(
            self,
            train_roles=train_roles,
            precomputed=precomputed,
            token_ids=self.token_ids,
            loss_mask=self.loss_mask,
            message_lengths=self.message_lengths,
            message_roles=self.message_roles,
            media=self.media,
            media_units=self.media_units,
            media_tokens=self.media_tokens,
        )

    def batch_sample(self, *, precomputed: bool) -> EncodedSample:
        """The `mmpack.batch.EncodedSample` of this (decoded) conversation: with its loss mask
        when `precomputed`, else with its message lengths and roles."""
        return EncodedSample(
            self.__key__,
            self.token_ids,
            loss_mask=self.loss_mask if precomputed else None,
            message_lengths=None if precomputed else self.message_lengths,
            message_roles=None if precomputed else self.message_roles,
            media=self.decoded_media,
        )

    def with_decoded_media(self, decoded: dict[str, Any]) -> EncodedConversation:
        """This encoding with its `decoded_media` (what `postencode_sample` makes)."""
        return EncodedConversation.derive_from(
            self,
            token_ids=self.token_ids,
            loss_mask=self.loss_mask,
            message_lengths=self.message_lengths,
            message_roles=self.message_roles,
            media=self.media,
            media_units=self.media_units,
            trainable_tokens=self.trainable_tokens,
            media_tokens=self.media_tokens,
            decoded_media=decoded,
        )


@edataclass
class SftPack(Sample):
    """One packed sequence: `packed` holds ``num_tokens`` tokens of its samples in at most
    ``capacity`` positions (padding included)."""

    packed: Any  # mmpack.batch.PackedBatch
    sample_keys: list[str]
    num_tokens: int
    capacity: int

    @classmethod
    def of(cls, samples: Sequence[EncodedConversation], packed: Any, capacity: int) -> SftPack:
        """The pack of `samples` (their keys and sources carried), built as `packed`."""
        keys = [s.__key__ for s in samples]
        return cls(
            __key__=",".join(keys),
            __restore_key__=(),
            __sources__=tuple(src for s in samples for src in (s.__sources__ or ())),
            packed=packed,
            sample_keys=keys,
            num_tokens=int(sum(s.num_tokens for s in samples)),
            capacity=capacity,
        )


@edataclass
class SftBatch(Batch):
    """What the trainer receives: `packs` (packing on: ``batch_size`` `PackedBatch` es;
    `micro_batch` joins them into one THD micro-batch) or `padded` rows (packing off: one
    `PaddedBatch`)."""

    sample_keys: list[str]
    num_tokens: int
    token_slots: int
    packs: list[Any] | None = None
    padded: Any = None  # mmpack.batch.padded.PaddedBatch

    @classmethod
    def of_packs(cls, packs: Sequence[SftPack]) -> SftBatch:
        """The batch of `packs` (packing on)."""
        return cls(
            __key__=[p.__key__ for p in packs],
            __restore_key__=(),
            __sources__=tuple(src for p in packs for src in (p.__sources__ or ())),
            sample_keys=[k for p in packs for k in p.sample_keys],
            num_tokens=sum(p.num_tokens for p in packs),
            token_slots=sum(p.capacity for p in packs),
            packs=[p.packed for p in packs],
        )

    @classmethod
    def of_padded(cls, samples: Sequence[EncodedConversation], padded: Any) -> SftBatch:
        """The batch of `samples` built as `padded` rows (packing off)."""
        return cls(
            __key__=[s.__key__ for s in samples],
            __restore_key__=(),
            __sources__=tuple(src for s in samples for src in (s.__sources__ or ())),
            sample_keys=[s.__key__ for s in samples],
            num_tokens=sum(s.num_tokens for s in samples),
            token_slots=int(padded.input_ids.numel()),
            padded=padded,
        )

    def micro_batch(
        self, options: BatchOptions | None = None, **keywords: Unpack[BatchOptionKeywords]
    ) -> Any:
        """The packs as one THD `PackedBatch` (`mmpack.batch.micro_batch`): pass the encoder's
        ``batch_options`` (or its ``pad_to_multiple_of`` / ``cp_size``) and, for pipeline
        parallelism, the fixed ``pad_to_length`` of every micro-batch: ``capacity *
        batch_size`` holds every batch the encoder makes (``encoder.batch_options.replace(
        pad_to_length=capacity * batch_size)``)."""
        from mmpack.batch import micro_batch

        if self.packs is None:
            raise TypeError("SftBatch.micro_batch() needs packs; this batch holds padded rows")
        return micro_batch(self.packs, options, **keywords)
