"""`MarkupEncoder`: the conversation encoder of mmpack's own turn markup (tokenizers without a
chat template, built for it): how a cooked `Conversation` becomes tokens, message spans and
(in ``"precomputed"`` mode) a loss mask.

Layout per message: ``<|role|>`` + parts + ``<|end|>``; a media part expands to ``num_tokens``
copies of its media token (``<image>``, ``<audio>``); text holding a media token is refused.
Media stays lazy here: only its token count is read. A turn with `Turn.fields` (``tool_calls``,
``name``, ...) is refused: the markup has no place to write them. In ``"precomputed"`` mode a
text fragment is trainable per its own flag (or per role when it has none), media is not, and
the role and end markers follow the message (trainable if any of its fragments is); the mask
itself is built by `mmpack.batch.masks.from_fragments`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from mmpack.batch import masks
from mmpack.energon.media import MediaHandle, MediaSettings
from mmpack.energon.samples import Conversation, EncodedConversation
from mmpack.errors import EnergonConfigError, SampleFormatError

__all__ = [
    "END_TOKEN",
    "MEDIA_TOKENS",
    "ROLE_TOKENS",
    "MarkupEncoder",
    "special_token_ids",
    "tokenize",
]

ROLE_TOKENS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}
END_TOKEN = "<|end|>"
MEDIA_TOKENS = {"image": "<image>", "audio": "<audio>"}


def special_token_ids(tokenizer: Any, modalities: Iterable[str]) -> dict[str, int]:
    """Ids of the markup's special tokens (role markers, end marker, one media token per
    modality, and the media tokens of other kinds the tokenizer has, which text may not
    hold either); raises `EnergonConfigError` naming the ones the tokenizer lacks."""
    needed = [*ROLE_TOKENS.values(), END_TOKEN]
    needed += [MEDIA_TOKENS[m] for m in modalities]
    vocab = tokenizer.get_vocab()
    missing = [t for t in needed if t not in vocab]
    if missing:
        raise EnergonConfigError(
            f"the tokenizer lacks the special tokens {missing} that the default "
            "encode_conversation needs; add them or override encode_conversation"
        )
    needed += [t for t in MEDIA_TOKENS.values() if t in vocab and t not in needed]
    return {t: int(vocab[t]) for t in needed}


def tokenize(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """Token ids of each text, without special tokens (one batched call; a fast tokenizer's
    Rust backend is called directly, skipping the Python wrapper's per-call overhead)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    encode_fast = getattr(backend, "encode_batch_fast", None)
    if encode_fast is not None:
        return [e.ids for e in encode_fast(texts, add_special_tokens=False)]
    return list(tokenizer(texts, add_special_tokens=False)["input_ids"])


class MarkupEncoder:
    """Encodes conversations in the markup of the module docstring (a `ConversationEncoder`).

    Args:
        token_ids: each special token's id (`special_token_ids`).
        tokenize: turns a list of texts into their token ids (without special tokens).
        media_settings: the settings of mmpack's own patchifier (media token counts).
        train_roles, loss_mask_mode: as in `PackingEncoderConfig`.
    """

    #: the ``conversation_format`` this encoder implements
    format = "markup"

    def __init__(
        self,
        *,
        token_ids: Mapping[str, int],
        tokenize: Callable[[list[str]], list[list[int]]],
        media_settings: MediaSettings,
        train_roles: Sequence[str],
        loss_mask_mode: str | None,
    ) -> None:
        self.token_ids = dict(token_ids)
        self.tokenize = tokenize
        self.media_settings = media_settings
        self.train_roles = tuple(train_roles)
        self.loss_mask_mode = loss_mask_mode
        unknown = [r for r in self.train_roles if r not in ROLE_TOKENS]
        if unknown:
            raise EnergonConfigError(
                f"train_roles {unknown}: mmpack's markup has no such role (it has "
                f"{', '.join(ROLE_TOKENS)}); use the tokenizer's chat template for other roles"
            )
        #: media token id -> token: text that tokenizes to one would be read as media
        self.media_ids = {
            self.token_ids[t]: t for t in MEDIA_TOKENS.values() if t in self.token_ids
        }

    def encode(self, conversation: Conversation) -> EncodedConversation:
        """Tokens, per-message lengths/roles and (in ``"precomputed"`` mode) the loss mask of one
        conversation, validated (`EncodedConversation.validated_from`).

        Raises `SampleFormatError` naming the sample for an unknown role, for a turn with
        fields (the markup writes a turn's role and parts only), and, when the mask
        comes from roles (``loss_mask_mode=None``), for per-fragment ``trainable`` flags that
        contradict the roles (the roles would train the wrong tokens).
        """
        token_ids = self.token_ids
        train_roles = self.train_roles
        media_settings = self.media_settings
        for index, turn in enumerate(conversation.turns):
            if turn.fields:
                raise SampleFormatError(
                    f"sample {conversation.__key__!r}: turn {index} ({turn.role}) has "
                    f"{', '.join(repr(k) for k in turn.fields)}, which mmpack's markup cannot "
                    "render (it writes a turn's role and parts only); encode such samples with "
                    "the tokenizer's chat template (conversation_format: chat_template)"
                )
        texts = [p.text for t in conversation.turns for p in t.parts if p.media is None and p.text]
        encoded = self.tokenize(texts) if texts else []
        text_iter = iter(encoded)
        chunks: list[list[int]] = []
        frag_lengths: list[int] = []
        frag_trainable: list[bool] = []
        message_lengths: list[int] = []
        message_roles: list[str] = []
        media: list[MediaHandle] = []
        media_tokens: list[int] = []
        media_units = 0
        for turn in conversation.turns:
            role_token = ROLE_TOKENS.get(turn.role)
            if role_token is None:
                raise SampleFormatError(
                    f"sample {conversation.__key__!r}: unknown role {turn.role!r} "
                    f"(expected one of {sorted(ROLE_TOKENS)})"
                )
            by_role = turn.role in train_roles
            flags = [p.trainable for p in turn.parts if p.media is None and p.trainable is not None]
            marker_trainable = any(flags) if flags else by_role
            start = len(frag_lengths)
            chunks.append([token_ids[role_token]])
            frag_lengths.append(1)
            frag_trainable.append(marker_trainable)
            for part in turn.parts:
                if part.media is not None:
                    n = part.media.num_tokens(media_settings)
                    chunks.append([token_ids[MEDIA_TOKENS[part.media.kind]]] * n)
                    frag_lengths.append(n)
                    frag_trainable.append(by_role if not flags else False)
                    media.append(part.media)
                    media_tokens.append(n)
                    media_units += part.media.num_units(media_settings)
                elif part.text:
                    toks = next(text_iter)
                    if not toks:
                        continue
                    held = [self.media_ids[t] for t in toks if t in self.media_ids]
                    if held:
                        raise SampleFormatError(
                            f"sample {conversation.__key__!r}: the text of a {turn.role!r} turn "
                            f"holds the media token {held[0]!r}, which would be read as media "
                            "that the sample does not have; remove it from the text or give "
                            "the media as a media part"
                        )
                    chunks.append(list(toks))
                    frag_lengths.append(len(toks))
                    frag_trainable.append(by_role if part.trainable is None else part.trainable)
            chunks.append([token_ids[END_TOKEN]])
            frag_lengths.append(1)
            frag_trainable.append(marker_trainable)
            message_lengths.append(sum(frag_lengths[start:]))
            message_roles.append(turn.role)
        tokens = np.fromiter((t for c in chunks for t in c), dtype=np.int64)
        loss_mask = None
        if self.loss_mask_mode == "precomputed":
            mask = masks.from_fragments(
                frag_lengths, frag_trainable, num_tokens=len(tokens), sample_id=conversation.__key__
            )
            # int8 0/1 (a view of the bool mask): a subclass that edits the mask gets a value
            # check from `mmpack.batch.masks.validate`, where a bool array would turn 2 into 1
            loss_mask = mask.view(np.int8)
        else:
            mixed = [
                t
                for t in conversation.turns
                if any(
                    p.trainable is not None and p.trainable != (t.role in train_roles)
                    for p in t.parts
                )
            ]
            if mixed:
                raise SampleFormatError(
                    f"sample {conversation.__key__!r} marks trainable spans per fragment that "
                    "differ from its roles; loss_mask_mode=None would train on the wrong tokens. "
                    "Use loss_mask_mode='precomputed' for this format"
                )
        return EncodedConversation.validated_from(
            conversation,
            train_roles=train_roles,
            token_ids=tokens,
            loss_mask=loss_mask,
            message_lengths=np.array(message_lengths, dtype=np.int64),
            message_roles=message_roles,
            media=media,
            media_units=media_units,
            media_tokens=media_tokens,
        )
