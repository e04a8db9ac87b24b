"""Sample types that flow through the Energon pipeline.

`Conversation` (cooked, media lazy) -> `EncodedConversation` (tokens, mask inputs, media handles;
after `postencode_sample` also the decoded media) -> `SftPack` (one `mmpack.batch.PackedBatch`) ->
`SftBatch` (``batch_size`` packs, or one `mmpack.batch.padded.PaddedBatch` when packing is off).
The batch fields (``labels``, ``loss_mask``, ``token_mask``, ...) are those of the table in the
`mmpack.batch` docstring.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from megatron.energon import Batch, Sample, edataclass

from mmpack.energon.media import MediaHandle

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from mmpack.batch.options import BatchOptionKeywords, BatchOptions

__all__ = ["Conversation", "EncodedConversation", "Part", "SftBatch", "SftPack", "Turn"]


@dataclasses.dataclass(frozen=True)
class Part:
    """One piece of a turn: text (with its optional per-fragment ``trainable`` flag) or media."""

    text: str | None = None
    media: MediaHandle | None = None
    trainable: bool | None = None


@dataclasses.dataclass(frozen=True)
class Turn:
    role: str
    parts: tuple[Part, ...]


@edataclass
class Conversation(Sample):
    """A cooked conversation; media parts are undecoded `MediaHandle`s."""

    source_format: str
    turns: list[Turn]


@edataclass
class EncodedConversation(Sample):
    """Tokens and mask inputs of one conversation; media still lazy until `postencode_sample`."""

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
    #: filled by postencode_sample: {"pixel_values": PackedTensor (one row)}, or None
    decoded_media: dict[str, Any] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@edataclass
class SftPack(Sample):
    """One packed sequence."""

    packed: Any  # mmpack.batch.PackedBatch
    sample_keys: list[str]
    num_tokens: int
    capacity: int


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

    def micro_batch(
        self, options: BatchOptions | None = None, **keywords: Unpack[BatchOptionKeywords]
    ) -> Any:
        """The packs as one THD `PackedBatch` (`mmpack.batch.micro_batch`): pass the encoder's
        ``batch_options`` (or its ``pad_to_multiple_of`` / ``cp_size``) and, for pipeline
        parallelism, the fixed ``pad_to_length`` of every micro-batch."""
        from mmpack.batch import micro_batch

        if self.packs is None:
            raise TypeError("SftBatch.micro_batch() needs packs; this batch holds padded rows")
        return micro_batch(self.packs, options, **keywords)
