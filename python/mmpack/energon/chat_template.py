"""`ChatTemplateEncoder`: the conversation encoder of the model's own chat template (the
processor's ``chat_template`` when it has one, else the tokenizer's).

A cooked `Conversation` becomes Hugging Face messages (text parts as ``{"type": "text"}``
items, media parts as ``{"type": "image" | "video" | "audio"}`` items; with a model's
processor every content is such a list, otherwise a turn without media has a plain string
``content``; a turn's other fields, such as ``tool_calls`` and ``reasoning_content``, are the
message's other keys), rendered once, whole, by `mmpack.batch.templates.render` (the text of
``apply_chat_template(..., tokenize=False)``) and tokenized as ``apply_chat_template(...,
tokenize=True)`` does. Each media item's placeholder token (the one the template renders for
it, e.g. Qwen2-VL's ``<|image_pad|>``) is then replaced by its expansion: what the model's
processor puts there for that item, with the token count from the processor's own arithmetic
on the item's size (read from metadata or the file header; nothing is decoded here).

What trains (`mmpack.batch.rendered_tokens`; no prefix is ever rendered, so a template that
renders history differently from the last turn, groups tool results or moves the system
prompt into the first user turn is read as it is):

* When the template marks assistant output with ``{% generation %}``, block tokens are those of
  ``return_assistant_tokens_mask``, and assistant messages train only through blocks (their
  headers outside a block never train).
* Otherwise, and for the other messages, the roles rule: a message owns what its values
  rendered (text, tool calls, reasoning) and the rest of its turn from its first value on (its
  end-of-turn token); role headers and injected text (a default system prompt) belong to no
  message and never train. A message to be trained whose text the template transforms beyond
  tracing (``| upper``) raises `ChatTemplateError`, instead of silently training nothing.
* In ``"precomputed"`` mode a text part's ``trainable`` flag decides its own characters, the
  other characters a message owns its marker flag (trainable if any of its parts is, else by
  role), a media placeholder the role's unless the message flags its parts; inside a
  generation block, text no message owns follows the block's turn. **A token is trainable iff
  every character it covers (its offsets) is**: a byte-level BPE token that straddles two
  parts, or a part and the markup, is trained only when both sides are, so text marked not
  trainable never reaches the loss.
* Media placeholder tokens in the rendering must be exactly the template's, one per media part,
  in the part's message's turn: a text that holds one (``<|image_pad|>`` written in a message,
  for any kind the model's processor reads, configured or not) raises `SampleFormatError`
  naming the sample, as the model's own processor refuses such a prompt. Strings that are not
  placeholder tokens of the model (``<image>`` for Qwen2-VL) stay text.

In roles mode (``loss_mask_mode=None``) the result is spans of tokens with the role that
decides them: a message's role, or `TEMPLATE_MARKUP_ROLE` (never trained) for tokens no
message owns and an assistant message's tokens outside its generation blocks.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from mmpack.batch import templates
from mmpack.batch.rendered_tokens import (
    GENERATION_ROLE,
    RenderedTokens,
    token_offsets,
    untruncated_encode,
)
from mmpack.batch.traced_text import TracedStr, traced_join
from mmpack.energon.markup import MEDIA_TOKENS
from mmpack.energon.media import MediaHandle, MediaSettings
from mmpack.energon.samples import Conversation, EncodedConversation
from mmpack.errors import ChatTemplateError, EnergonConfigError, SampleFormatError

__all__ = [
    "TEMPLATE_MARKUP_ROLE",
    "ChatTemplateEncoder",
    "TemplateMedia",
    "hf_messages",
    "markup_media",
]

#: Role of the spans of a message that lie outside its generation block (roles mode).
TEMPLATE_MARKUP_ROLE = "<template-markup>"


@dataclasses.dataclass(frozen=True)
class TemplateMedia:
    """How media placeholders expand.

    ``placeholder_ids``: media kind -> id of the token the template renders once per item of
    that kind. ``count``: tokens an item takes, before decoding. ``expansion``: the token ids
    that replace the placeholder for an item of `kind` taking `n` tokens. ``units``: the media
    units (``media_capacity``'s rows of the vision / audio tower) of an item taking `n` tokens
    (None: not counted, 0). ``list_content``: every message's content is a list of typed items
    (multimodal templates), not a string. ``other_placeholder_ids``: placeholders of kinds the
    model reads but the run does not configure; like the configured ones, refused in message
    text."""

    placeholder_ids: Mapping[str, int]
    count: Callable[[MediaHandle], int]
    expansion: Callable[[str, int], list[int]]
    list_content: bool = False
    units: Callable[[MediaHandle, int], int] | None = None
    other_placeholder_ids: Mapping[str, int] = dataclasses.field(default_factory=dict)


def markup_media(
    tokenizer: Any, settings: MediaSettings, modalities: Sequence[str]
) -> TemplateMedia:
    """Placeholders for mmpack's own patchifier: the template renders the markup's media token
    (``<image>``, ``<audio>``) once per item, which expands to one copy per patch / frame."""
    vocab = tokenizer.get_vocab()
    ids: dict[str, int] = {}
    for kind in modalities:
        token = MEDIA_TOKENS.get(kind)
        if token is None or token not in vocab:
            raise EnergonConfigError(
                f"the tokenizer has no {kind} placeholder token {token!r} for mmpack's own media "
                "processing; pass the model's Hugging Face processor instead"
            )
        ids[kind] = int(vocab[token])
    others = {k: int(vocab[t]) for k, t in MEDIA_TOKENS.items() if k not in ids and t in vocab}
    return TemplateMedia(
        placeholder_ids=ids,
        count=functools.partial(_patch_count, settings=settings),
        expansion=functools.partial(_repeat_placeholder, ids),
        units=functools.partial(_patch_units, settings=settings),
        other_placeholder_ids=others,
    )


def _patch_count(handle: MediaHandle, *, settings: MediaSettings) -> int:
    return handle.num_tokens(settings)


def _patch_units(handle: MediaHandle, tokens: int, *, settings: MediaSettings) -> int:
    return handle.num_units(settings)


def _repeat_placeholder(ids: Mapping[str, int], kind: str, count: int) -> list[int]:
    return [ids[kind]] * count


def hf_messages(
    conversation: Conversation, *, list_content: bool = False, traced: bool = False
) -> list[dict[str, Any]]:
    """The conversation as Hugging Face chat messages (see the module docstring); with
    `list_content` every message's content is a list of items (what multimodal templates
    expect), else a turn without media has a plain string. A turn's other fields (tool calls,
    reasoning, names) are the message's other keys, unchanged. With `traced` each text is a
    `TracedStr` labelled ``("part", index of the part in its turn)``, so one render tells where
    each part's characters went (plain text to anything but `mmpack.batch.templates.render`)."""
    messages: list[dict[str, Any]] = []
    for turn in conversation.turns:
        texts = [
            TracedStr(p.text, ((0, len(p.text), ("part", i)),)) if traced and p.text else p.text
            for i, p in enumerate(turn.parts)
        ]
        message: dict[str, Any] = {"role": turn.role}
        if not list_content and all(p.media is None for p in turn.parts):
            joined = traced_join(t for t in texts if t)
            # an empty reply still marks where its content goes (its turn's end is its own)
            message["content"] = joined or (TracedStr("", ((0, 0, ("empty",)),)) if traced else "")
        else:
            content: list[dict[str, Any]] = []
            for part, text in zip(turn.parts, texts, strict=True):
                if part.media is not None:
                    content.append({"type": part.media.kind})
                elif text:
                    content.append({"type": "text", "text": text})
            message["content"] = content
        for name, value in turn.fields.items():
            message.setdefault(name, value)
        messages.append(message)
    return messages


def _fast_backend(tokenizer: Any) -> Any:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise EnergonConfigError(
            f"encoding with the chat template needs a fast tokenizer (token offsets); "
            f"{type(tokenizer).__name__} has no backend_tokenizer"
        )
    return backend


class ChatTemplateEncoder:
    """Encodes conversations with the tokenizer's chat template (module docstring; a
    `ConversationEncoder`). Whether the template marks generation blocks is read once, here.

    Args:
        tokenizer: a Hugging Face fast tokenizer with a chat template.
        processor: the model's Hugging Face processor, whose ``chat_template`` (when set)
            is used instead of the tokenizer's.
        media: how media placeholders expand (`markup_media`, or a model processor's
            ``template_media``).
        train_roles, loss_mask_mode: as in `PackingEncoderConfig`.
    """

    #: the ``conversation_format`` this encoder implements
    format = "chat_template"

    def __init__(
        self,
        *,
        tokenizer: Any,
        media: TemplateMedia,
        train_roles: Sequence[str],
        loss_mask_mode: str | None,
        processor: Any = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.processor = processor
        self.media = media
        self.train_roles = tuple(train_roles)
        self.loss_mask_mode = loss_mask_mode
        #: the template this encoder was built for (the processor's, else the tokenizer's):
        #: its masking rule is read from it once
        template = templates.template_text(tokenizer, processor)
        if template is None:
            raise EnergonConfigError(
                f"the tokenizer {type(tokenizer).__name__} has no chat template (set "
                "tokenizer.chat_template)"
            )
        self.template: str = template
        self.backend = _fast_backend(tokenizer)
        self._placeholder_ids = {**media.other_placeholder_ids, **media.placeholder_ids}
        #: the template marks assistant output with ``{% generation %}``
        self.uses_generation_blocks = templates.has_generation_markers(self.template)

    def encode(self, conversation: Conversation) -> EncodedConversation:
        """Tokens, message spans (roles mode) or loss mask (``"precomputed"``) and media of one
        conversation rendered once by the chat template, validated
        (`EncodedConversation.validated_from`). Raises `ChatTemplateError` when the template
        fails on it, `SampleFormatError` for sample problems (a part's flags contradicting its
        role in roles mode, a media placeholder token written in the text, placeholders that
        do not match the media)."""
        media = self.media
        train_roles = self.train_roles
        key = str(conversation.__key__)
        current = templates.template_text(self.tokenizer, self.processor)
        if current is not self.template and current != self.template:
            # rendering would follow the new template and masking the old one's rule
            raise ChatTemplateError(
                f"sample {key!r}: the chat template changed after the task encoder was built; "
                "build a new encoder for the new template"
            )
        turns = conversation.turns
        if not turns:
            raise SampleFormatError(f"sample {key!r} has no turns")
        roles = [t.role for t in turns]
        precomputed = self.loss_mask_mode == "precomputed"
        # fragment flags decide characters of their own only in precomputed mode
        flags = precomputed and any(p.trainable is not None for t in turns for p in t.parts)
        traced = flags or RenderedTokens.needs_values(
            roles, train_roles, self.uses_generation_blocks
        )
        messages = hf_messages(conversation, list_content=media.list_content, traced=traced)
        rendering = templates.render(
            self.template,
            messages,
            # read now: a special token set after construction renders as transformers does
            variables=templates.template_variables(self.tokenizer, tools=conversation.tools),
            sample_id=key,
            trace_values=traced,
            # turns place media placeholders, and name the message a stray one is in
            trace_turns=traced or bool(self._placeholder_ids),
        )
        full = rendering.text
        try:
            encoding = untruncated_encode(self.backend, full)
        except Exception as err:  # the tokenizer refuses the text (a lone surrogate)
            raise SampleFormatError(
                f"sample {key!r}: the tokenizer cannot encode the rendering "
                f"({type(err).__name__}: {err})"
            ) from err
        ids = np.asarray(encoding.ids, dtype=np.int64)
        offsets = token_offsets(encoding)
        tokens = RenderedTokens(rendering, offsets, len(turns), roles)
        labels = tokens.role_labels(roles, self.uses_generation_blocks)

        if not precomputed:
            _check_flags_match_roles(conversation, train_roles)
        if traced:  # else generation blocks decide everything that trains
            self._check_placed(conversation, tokens, flags)
        # a media item's placeholder is looked for in its message's turn
        placeholders = _match_placeholders(conversation, ids, tokens, media, full, offsets)
        trainable = None
        if flags:
            trainable = self._precomputed_mask(conversation, tokens, labels, placeholders)
        elif precomputed:
            # no fragment flags: the roles rule, as in roles mode
            trains = np.asarray(
                [GENERATION_ROLE in train_roles, False, *(r in train_roles for r in roles)],
                dtype=np.bool_,
            )
            trainable = trains[labels + 2]
        return _expand(
            conversation,
            ids,
            trainable,
            labels,
            placeholders,
            media,
            train_roles=train_roles,
        )

    def _check_placed(
        self, conversation: Conversation, tokens: RenderedTokens, flags: bool
    ) -> None:
        """Refuse what would otherwise train silently wrong: a message the roles rule
        decides (no generation blocks for it) that is to be trained but cannot be placed
        (`RenderedTokens.check_placed`), and in precomputed mode a flagged text part the
        rendering lost track of (its flag could not be honoured)."""
        key = conversation.__key__
        turns = conversation.turns
        roles = [t.role for t in turns]
        only_blocks = tokens.generation_messages(roles, self.uses_generation_blocks)
        to_train = [
            not only_blocks[m]
            and (
                any(p.trainable for p in t.parts)
                or (t.role in self.train_roles and not any(p.trainable is False for p in t.parts))
            )
            for m, t in enumerate(turns)
        ]
        with_values = [
            any(p.text for p in t.parts if p.media is None) or bool(t.fields) for t in turns
        ]
        tokens.check_placed(to_train, with_values, where=f"sample {key!r}: ")
        if not flags:
            return
        located = {
            (v.message, v.label[1])
            for v in tokens.rendering.values
            if isinstance(v.label, tuple) and v.label[:1] == ("part",)
        }
        for m, turn in enumerate(turns):
            for i, part in enumerate(turn.parts):
                if part.text and part.trainable is not None and (m, i) not in located:
                    raise ChatTemplateError(
                        f"sample {key!r}: the chat template does not render the text of "
                        f"message {m}, part {i} as given, nor cut or joined from it, so its "
                        f"trainable={part.trainable} flag cannot be honoured"
                    )

    def _precomputed_mask(
        self,
        conversation: Conversation,
        tokens: RenderedTokens,
        labels: np.ndarray,
        placeholders: list[tuple[int, MediaHandle]],
    ) -> np.ndarray:
        """``"precomputed"`` mode: one flag per character of the rendering, a token trained
        iff every character it covers is. A text part's characters take its own flag; the
        other characters a message owns (its end marker, tool calls) its marker flag (trainable
        if any of its parts is, else by role); a media placeholder the role's unless the
        message flags its parts; characters no message owns none, except inside a generation
        block, where the block decides (its message's marker flag where it lies in a turn)."""
        rendering = tokens.rendering
        offsets = tokens.offsets
        turns = conversation.turns
        by_role = np.asarray([t.role in self.train_roles for t in turns], dtype=np.bool_)
        flagged = [
            [p.trainable for p in t.parts if p.media is None and p.trainable is not None]
            for t in turns
        ]
        marker_of = np.asarray(
            [any(f) if f else by_role[m] for m, f in enumerate(flagged)], dtype=np.bool_
        )
        owner, turn = tokens.char_owner, tokens.char_turn
        fixed = np.zeros(len(rendering.text), dtype=np.bool_)  # a flag of its own
        fixed_flag = np.zeros(len(rendering.text), dtype=np.bool_)
        # a media item's whole iteration (its <|vision_start|> and <|vision_end|> with its
        # placeholder) takes the placeholder's flag
        media_flag = {
            int(offsets[t, 0]): bool(
                by_role[int(tokens.turn[t])] and not flagged[int(tokens.turn[t])]
            )
            for t, _ in placeholders
        }
        for value in rendering.values:
            if value.label == ("item",):
                held = [f for at, f in media_flag.items() if value.start <= at < value.end]
                if len(held) == 1:
                    fixed[value.start : value.end] = True
                    fixed_flag[value.start : value.end] = held[0]
        for value in rendering.values:
            label = value.label
            if isinstance(label, tuple) and len(label) == 2 and label[0] == "part":
                part = turns[value.message].parts[label[1]]
                if not flagged[value.message]:
                    continue  # a message without flags: its role (or a block) decides
                fixed[value.start : value.end] = True
                fixed_flag[value.start : value.end] = (
                    by_role[value.message] if part.trainable is None else part.trainable
                )
        for t, _ in placeholders:
            m = int(tokens.turn[t])
            # media is not trained where the message marks its text per fragment
            fixed[offsets[t, 0] : offsets[t, 1]] = True
            fixed_flag[offsets[t, 0] : offsets[t, 1]] = by_role[m] and not flagged[m]
        # a character no message owns leaves the decision to the token's owner (labels)
        owned = np.where(owner >= 0, marker_of[owner.clip(0)], True)
        # inside a block, the block decides for a message without flags of its own (a tool
        # result the assistant's block holds); text no message owns (a header the block holds)
        # follows the turn it lies in, and text outside every turn the block alone
        explicit = np.asarray([bool(f) for f in flagged], dtype=np.bool_)
        owned_in_block = np.where(explicit[owner.clip(0)], owned, True)
        in_turn = np.where((turn >= 0) & explicit[turn.clip(0)], marker_of[turn.clip(0)], True)
        char_flag = np.where(fixed, fixed_flag, owned)
        block_flag = np.where(fixed, fixed_flag, np.where(owner >= 0, owned_in_block, in_turn))
        covered = _all_set(char_flag, offsets)
        in_block = _all_set(block_flag, offsets)
        # a token with no text (none in a byte-level BPE) follows its owner's marker
        empty = offsets[:, 1] <= offsets[:, 0]
        owner_marker = np.where(tokens.owner >= 0, marker_of[tokens.owner.clip(0)], False)
        covered = np.where(empty, owner_marker, covered)
        if self.uses_generation_blocks:
            return np.where(tokens.in_generation, in_block, covered & (labels >= 0))
        return covered & (labels >= 0)


def _all_set(char_flag: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Per token: every character it covers is flagged."""
    unset = np.concatenate([[0], np.cumsum(~char_flag)])
    return unset[offsets[:, 1]] - unset[offsets[:, 0]] == 0


def _match_placeholders(
    conversation: Conversation,
    ids: np.ndarray,
    tokens: RenderedTokens,
    media: TemplateMedia,
    full: str,
    offsets: np.ndarray,
) -> list[tuple[int, MediaHandle]]:
    """The placeholder token of each media part: the k-th part of a kind in a message takes
    the k-th placeholder token of that kind the template rendered in the message. A media
    placeholder token the parts do not account for was written in the text: the model's
    processor would read it as media there is none of, so the sample is refused."""
    key = conversation.__key__
    model_ids = {int(v): k for k, v in media.other_placeholder_ids.items()}
    model_ids.update({int(v): k for k, v in media.placeholder_ids.items()})
    if not model_ids and all(p.media is None for t in conversation.turns for p in t.parts):
        return []  # no media, and no token the model reads as media
    message_of = tokens.turn
    is_placeholder = np.isin(ids, np.fromiter(model_ids, dtype=np.int64, count=len(model_ids)))
    # placeholder tokens by message (-1: outside every turn) and kind, in order
    by_message: dict[int, dict[str, collections.deque[int]]] = {}
    for t in np.flatnonzero(is_placeholder).tolist():
        kinds = by_message.setdefault(int(message_of[t]), {})
        kinds.setdefault(model_ids[int(ids[t])], collections.deque()).append(t)
    found: list[tuple[int, MediaHandle]] = []
    for m, turn in enumerate(conversation.turns):
        by_kind = by_message.pop(m, {})
        for part in turn.parts:
            if part.media is None:
                continue
            kind = part.media.kind
            if kind not in media.placeholder_ids:
                raise SampleFormatError(
                    f"sample {key!r}: {kind} media {part.media.key!r} has no placeholder token "
                    "configured"
                )
            rendered = by_kind.get(kind)
            if not rendered:
                raise ChatTemplateError(
                    f"sample {key!r}: message {m}: the chat template rendered no {kind} "
                    f"placeholder for media {part.media.key!r}"
                )
            found.append((rendered.popleft(), part.media))
        extra = [t for left in by_kind.values() for t in left]
        if extra:
            t = min(extra)
            token = full[offsets[t, 0] : offsets[t, 1]]
            raise SampleFormatError(
                f"sample {key!r}: the text of message {m} ({turn.role}) holds the media "
                f"placeholder {token!r} ({model_ids[int(ids[t])]}), which the model's processor "
                f"reads as media, but no media item of the sample fills it ({len(extra)} such "
                "token(s)); remove it from the text or give the media as a media part"
            )
    outside = [t for kinds in by_message.values() for left in kinds.values() for t in left]
    if outside:
        t = min(outside)
        raise SampleFormatError(
            f"sample {key!r}: the rendering holds the media placeholder "
            f"{full[offsets[t, 0] : offsets[t, 1]]!r} outside every message's turn, which the "
            "model's processor reads as media no item of the sample fills"
        )
    return found


def _check_flags_match_roles(conversation: Conversation, train_roles: Sequence[str]) -> None:
    for turn in conversation.turns:
        by_role = turn.role in train_roles
        if any(p.trainable is not None and p.trainable != by_role for p in turn.parts):
            raise SampleFormatError(
                f"sample {conversation.__key__!r} marks trainable spans per fragment that "
                "differ from its roles; loss_mask_mode=None would train on the wrong tokens. "
                "Use loss_mask_mode='precomputed' for this format"
            )


def _expand(
    conversation: Conversation,
    ids: np.ndarray,
    trainable: np.ndarray | None,
    labels: np.ndarray,
    placeholders: list[tuple[int, MediaHandle]],
    media: TemplateMedia,
    *,
    train_roles: Sequence[str],
) -> EncodedConversation:
    """Replace each placeholder token by its expansion, carrying the placeholder's flag and
    label along, and build the `EncodedConversation`: spans of consecutive tokens with one
    label (a message's role, the generation role, or `TEMPLATE_MARKUP_ROLE`), and in
    ``"precomputed"`` mode (`trainable` given) the loss mask."""
    if not placeholders:
        return _encoded(conversation, ids, trainable, labels, [], [], 0, train_roles=train_roles)
    pieces_ids: list[np.ndarray] = []
    pieces_index: list[np.ndarray] = []  # for each output token: the input token it came from
    handles: list[MediaHandle] = []
    counts: list[int] = []
    units = 0
    prev = 0
    src = np.asarray(ids, dtype=np.int64)
    for t, handle in sorted(placeholders, key=lambda p: p[0]):
        count = int(media.count(handle))
        expansion = np.asarray(media.expansion(handle.kind, count), dtype=np.int64)
        pieces_ids += [src[prev:t], expansion]
        pieces_index += [
            np.arange(prev, t, dtype=np.int64),
            np.full(len(expansion), t, dtype=np.int64),
        ]
        handles.append(handle)
        counts.append(count)
        if media.units is not None:
            units += int(media.units(handle, count))
        prev = t + 1
    pieces_ids.append(src[prev:])
    pieces_index.append(np.arange(prev, len(ids), dtype=np.int64))
    origin = np.concatenate(pieces_index)
    return _encoded(
        conversation,
        np.concatenate(pieces_ids),
        None if trainable is None else trainable[origin],
        labels[origin],
        handles,
        counts,
        units,
        train_roles=train_roles,
    )


def _encoded(
    conversation: Conversation,
    tokens: np.ndarray,
    trainable: np.ndarray | None,
    label: np.ndarray,
    handles: list[MediaHandle],
    counts: list[int],
    units: int,
    *,
    train_roles: Sequence[str],
) -> EncodedConversation:
    """The `EncodedConversation` of the expanded tokens with their flags and labels."""
    change = np.flatnonzero(np.diff(label)) + 1
    starts = np.concatenate([[0], change]) if len(tokens) else np.zeros(0, dtype=np.int64)
    ends = np.concatenate([change, [len(tokens)]]) if len(tokens) else starts
    turns = conversation.turns
    named = {-1: TEMPLATE_MARKUP_ROLE, -2: GENERATION_ROLE}
    roles = [named[int(label[s])] if label[s] < 0 else turns[int(label[s])].role for s in starts]
    return EncodedConversation.validated_from(
        conversation,
        train_roles=train_roles,
        token_ids=tokens,
        loss_mask=None if trainable is None else trainable.view(np.int8),
        message_lengths=(ends - starts).astype(np.int64),
        message_roles=roles,
        media=handles,
        media_units=units,
        media_tokens=counts,
    )
