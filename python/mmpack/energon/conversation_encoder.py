"""`ConversationEncoder`: how a cooked `Conversation` becomes an `EncodedConversation` (tokens,
mask inputs validated, trainable tokens counted, media still lazy).

Two implementations, one chosen when the task encoder is built (`build_conversation_encoder`)
and never re-decided per sample: `ChatTemplateEncoder` (the tokenizer's own chat template,
through mmpack's patchifier or a model's Hugging Face processor) and `MarkupEncoder` (mmpack's
turn markup, for tokenizers built for it); ``conversation_format`` in the config picks one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from mmpack.energon.chat_template import ChatTemplateEncoder, markup_media
from mmpack.energon.config import PackingEncoderConfig
from mmpack.energon.markup import MarkupEncoder, special_token_ids
from mmpack.energon.media import MediaSettings
from mmpack.energon.processors import ModelProcessor
from mmpack.energon.samples import Conversation, EncodedConversation
from mmpack.energon.validation import resolve_conversation_format

__all__ = ["BUILTIN_ENCODERS", "ConversationEncoder", "build_conversation_encoder"]


class ConversationEncoder(Protocol):
    """Encodes one conversation; the result's mask inputs are validated and its trainable
    tokens counted (`EncodedConversation.validated_from`)."""

    #: the ``conversation_format`` it implements: ``"chat_template"`` or ``"markup"``
    format: str

    def encode(self, conversation: Conversation) -> EncodedConversation: ...


#: The encoders whose output is validated where it is made (`EncodedConversation.validated_from`)
#: and never edited after; any other encoder's output is validated again by the task encoder.
BUILTIN_ENCODERS: tuple[type, ...] = (ChatTemplateEncoder, MarkupEncoder)


def build_conversation_encoder(
    config: PackingEncoderConfig,
    tokenizer: Any,
    *,
    model_processor: ModelProcessor | None,
    media_settings: MediaSettings,
    tokenize: Callable[[list[str]], list[list[int]]],
) -> ConversationEncoder | None:
    """The encoder for ``config.conversation_format`` (``"auto"``: the chat template when the
    tokenizer has one, else the markup); None without a tokenizer (a subclass then overrides
    ``encode_conversation``). Raises `EnergonConfigError` when the tokenizer cannot encode
    conversations that way (`resolve_conversation_format`)."""
    if tokenizer is None:
        return None
    chosen = resolve_conversation_format(
        config.conversation_format,
        tokenizer,
        config.modalities,
        model_processor=model_processor is not None,
        processor=None if model_processor is None else model_processor.processor,
    )
    if chosen == "markup":
        return MarkupEncoder(
            token_ids=special_token_ids(tokenizer, config.modalities),
            tokenize=tokenize,
            media_settings=media_settings,
            train_roles=config.train_roles,
            loss_mask_mode=config.loss_mask_mode,
        )
    media = (
        model_processor.template_media(config.modalities)
        if model_processor is not None
        else markup_media(tokenizer, media_settings, config.modalities)
    )
    return ChatTemplateEncoder(
        tokenizer=tokenizer,
        media=media,
        train_roles=config.train_roles,
        loss_mask_mode=config.loss_mask_mode,
        processor=None if model_processor is None else model_processor.processor,
    )
