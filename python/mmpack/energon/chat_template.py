"""`ChatTemplateEncoder`: the conversation encoder of the tokenizer's own chat template
(``apply_chat_template``).

A cooked `Conversation` becomes Hugging Face messages (text parts as ``{"type": "text"}``
items, media parts as ``{"type": "image" | "video" | "audio"}`` items; with a model's
processor every content is such a list, otherwise a turn without media has a plain string
``content``), rendered by the tokenizer's template and tokenized as
``apply_chat_template(..., tokenize=True)`` does. Each media item's placeholder token (the one
the template renders for it, e.g. Qwen2-VL's ``<|image_pad|>``) is then replaced by its
expansion: what the model's processor puts there for that item, with the token count from the
processor's own arithmetic on the item's size (read from metadata or the file header; nothing
is decoded here).

Trainable spans, checked against the rendering:

* Message boundaries come from rendering each prefix ``messages[:k]``: every prefix must be a
  prefix of the next rendering (else `ChatTemplateError`), and no token may straddle a boundary.
  Everything a message's rendering adds (its header and end marker included) is that message's.
* When the template marks assistant output with ``{% generation %}``, a message with tokens
  inside a generation block trains only those (``return_assistant_tokens_mask``); its header
  and end marker outside the block are never trained.
* In ``"precomputed"`` mode a text part's ``trainable`` flag (fragments format) decides its
  own tokens, located in the rendering (a template that does not render a part's text verbatim
  raises `ChatTemplateError`); markup tokens follow the message as in the default markup.

In roles mode (``loss_mask_mode=None``) the result is per-message lengths and roles; the tokens
of a message outside its generation block are a span of role `TEMPLATE_MARKUP_ROLE`, which is
never trained.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from mmpack.batch import templates
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
    (multimodal templates), not a string."""

    placeholder_ids: Mapping[str, int]
    count: Callable[[MediaHandle], int]
    expansion: Callable[[str, int], list[int]]
    list_content: bool = False
    units: Callable[[MediaHandle, int], int] | None = None


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
    return TemplateMedia(
        placeholder_ids=ids,
        count=functools.partial(_patch_count, settings=settings),
        expansion=functools.partial(_repeat_placeholder, ids),
        units=functools.partial(_patch_units, settings=settings),
    )


def _patch_count(handle: MediaHandle, *, settings: MediaSettings) -> int:
    return handle.num_tokens(settings)


def _patch_units(handle: MediaHandle, tokens: int, *, settings: MediaSettings) -> int:
    return handle.num_units(settings)


def _repeat_placeholder(ids: Mapping[str, int], kind: str, count: int) -> list[int]:
    return [ids[kind]] * count


def hf_messages(conversation: Conversation, *, list_content: bool = False) -> list[dict[str, Any]]:
    """The conversation as Hugging Face chat messages (see the module docstring); with
    `list_content` every message's content is a list of items (what multimodal templates
    expect), else a turn without media has a plain string."""
    messages: list[dict[str, Any]] = []
    for turn in conversation.turns:
        if not list_content and all(p.media is None for p in turn.parts):
            messages.append(
                {"role": turn.role, "content": "".join(p.text or "" for p in turn.parts)}
            )
            continue
        content: list[dict[str, Any]] = []
        for part in turn.parts:
            if part.media is not None:
                content.append({"type": part.media.kind})
            elif part.text:
                content.append({"type": "text", "text": part.text})
        messages.append({"role": turn.role, "content": content})
    return messages


def _fast_backend(tokenizer: Any) -> Any:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise EnergonConfigError(
            f"encoding with the chat template needs a fast tokenizer (token offsets); "
            f"{type(tokenizer).__name__} has no backend_tokenizer"
        )
    return backend


def _message_bounds(renderings: list[str], key: str) -> list[int]:
    """Character offsets where each message's rendering starts (and the total length), from
    the renderings of each message prefix."""
    bounds = [0]
    prev = ""
    for k, text in enumerate(renderings, start=1):
        if not text.startswith(prev):
            raise ChatTemplateError(
                f"sample {key!r}: the chat template is not prefix-stable: the rendering of "
                f"messages[:{k - 1}] is not a prefix of that of messages[:{k}], so message "
                "boundaries are unknown"
            )
        bounds.append(len(text))
        prev = text
    return bounds


def _generation_mask(
    tokenizer: Any, messages: list[dict[str, Any]], ids: list[int], key: str
) -> np.ndarray:
    out = tokenizer.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    theirs = out["input_ids"]
    theirs = theirs.tolist() if hasattr(theirs, "tolist") else list(theirs)
    if theirs != ids:
        raise ChatTemplateError(
            f"sample {key!r}: apply_chat_template(tokenize=True) gives other tokens than the "
            "rendering tokenized with offsets"
        )
    return np.asarray(out["assistant_masks"], dtype=np.bool_).reshape(-1)


class ChatTemplateEncoder:
    """Encodes conversations with the tokenizer's chat template (module docstring; a
    `ConversationEncoder`). Whether the template marks generation blocks is read once, here.

    Args:
        tokenizer: a Hugging Face fast tokenizer with a chat template.
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
    ) -> None:
        self.tokenizer = tokenizer
        self.media = media
        self.train_roles = tuple(train_roles)
        self.loss_mask_mode = loss_mask_mode
        #: the template this encoder was built for: its masking rule is read from it once
        self.template = templates.template_text(tokenizer)
        #: the template marks assistant output with ``{% generation %}``
        self.uses_generation_blocks = templates.has_generation_markers(self.template)

    def encode(self, conversation: Conversation) -> EncodedConversation:
        """Tokens, message spans (roles mode) or loss mask (``"precomputed"``) and media of one
        conversation rendered by the chat template, validated
        (`EncodedConversation.validated_from`). Raises `ChatTemplateError` when the rendering
        cannot be mapped back onto the messages and parts, `SampleFormatError` for sample
        problems (a part's flags contradicting its role in roles mode, placeholders that do
        not match the media)."""
        tokenizer = self.tokenizer
        media = self.media
        train_roles = self.train_roles
        key = str(conversation.__key__)
        current = templates.template_text(tokenizer)
        if current is not self.template and current != self.template:
            # rendering would follow the new template and masking the old one's rule
            raise ChatTemplateError(
                f"sample {key!r}: the tokenizer's chat template changed after the task encoder "
                "was built; build a new encoder for the new template"
            )
        turns = conversation.turns
        if not turns:
            raise SampleFormatError(f"sample {key!r} has no turns")
        messages = hf_messages(conversation, list_content=media.list_content)
        renderings = templates.render_prefixes(tokenizer, messages, sample_id=key)
        bounds = _message_bounds(renderings, key)
        full = renderings[-1]
        encoding = _fast_backend(tokenizer).encode(full, add_special_tokens=False)
        ids = list(encoding.ids)
        offsets = list(encoding.offsets)
        n = len(ids)

        message_of = np.empty(n, dtype=np.int64)
        for i, (start, end) in enumerate(offsets):
            m = bisect.bisect_right(bounds, start) - 1
            m = min(max(m, 0), len(turns) - 1)
            if end > bounds[m + 1]:
                raise ChatTemplateError(
                    f"sample {key!r}: token {i} ({full[start:end]!r}) straddles the end of message "
                    f"{m}'s rendering; message boundaries do not fall on token boundaries"
                )
            message_of[i] = m

        in_generation = (
            _generation_mask(tokenizer, messages, ids, key)
            if self.uses_generation_blocks
            else np.zeros(n, dtype=np.bool_)
        )
        if in_generation.shape[0] != n:
            raise ChatTemplateError(
                f"sample {key!r}: the template's assistant mask has {in_generation.shape[0]} "
                f"entries for {n} tokens"
            )

        precomputed = self.loss_mask_mode == "precomputed"
        if not precomputed:
            _check_flags_match_roles(conversation, train_roles)
        placeholder_kind = {int(v): k for k, v in media.placeholder_ids.items()}
        trainable = np.zeros(n, dtype=np.bool_)
        markup_span = np.zeros(n, dtype=np.bool_)  # roles mode: outside the generation block
        placeholders: list[tuple[int, MediaHandle]] = []
        for m, turn in enumerate(turns):
            lo = int(np.searchsorted(message_of, m, side="left"))
            hi = int(np.searchsorted(message_of, m, side="right"))
            by_role = turn.role in train_roles
            flags = [p.trainable for p in turn.parts if p.media is None and p.trainable is not None]
            marker = (any(flags) if flags else by_role) if precomputed else by_role
            uses_generation = bool(in_generation[lo:hi].any())
            token_flag = np.full(hi - lo, marker, dtype=np.bool_)
            if uses_generation:
                token_flag &= in_generation[lo:hi]
                markup_span[lo:hi] = ~in_generation[lo:hi]
            cursor = bounds[m]
            end = bounds[m + 1]
            part_tokens: list[int] = []
            for p_idx, part in enumerate(turn.parts):
                if part.media is not None:
                    want = media.placeholder_ids.get(part.media.kind)
                    if want is None:
                        raise SampleFormatError(
                            f"sample {key!r}: {part.media.kind} media {part.media.key!r} has no "
                            "placeholder token configured"
                        )
                    t = _next_token(ids, offsets, lo, hi, cursor, int(want))
                    if t is None:
                        raise ChatTemplateError(
                            f"sample {key!r}: message {m}: the chat template rendered no "
                            f"{part.media.kind} placeholder for media {part.media.key!r}"
                        )
                    placeholders.append((t, part.media))
                    part_tokens.append(t)
                    cursor = offsets[t][1]
                    if precomputed:
                        token_flag[t - lo] = by_role if not flags else False
                    continue
                if not part.text:
                    continue
                where = full.find(part.text, cursor, end)
                text = part.text
                if where < 0:
                    text = part.text.strip()
                    where = full.find(text, cursor, end) if text else -1
                if where < 0:
                    raise ChatTemplateError(
                        f"sample {key!r}: message {m} part {p_idx}: the chat template does not "
                        "render the part's text verbatim, so its tokens cannot be located"
                    )
                if precomputed:
                    flag = by_role if part.trainable is None else part.trainable
                    for t in range(lo, hi):
                        start = offsets[t][0]
                        if where <= start < where + len(text):
                            token_flag[t - lo] = flag and (in_generation[t] or not uses_generation)
                cursor = where + len(text)
            filled = set(part_tokens)
            extra = [t for t in range(lo, hi) if ids[t] in placeholder_kind and t not in filled]
            if extra:
                raise SampleFormatError(
                    f"sample {key!r}: message {m} holds {len(extra)} media placeholder token(s) "
                    f"({placeholder_kind[ids[extra[0]]]}) that no media item of the sample fills "
                    "(a placeholder written in the text?)"
                )
            trainable[lo:hi] = token_flag
        return _expand(
            conversation,
            ids,
            trainable,
            message_of,
            markup_span,
            placeholders,
            media,
            train_roles=train_roles,
            precomputed=precomputed,
        )


def _next_token(
    ids: list[int], offsets: list[tuple[int, int]], lo: int, hi: int, cursor: int, want: int
) -> int | None:
    for t in range(lo, hi):
        if ids[t] == want and offsets[t][0] >= cursor:
            return t
    return None


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
    ids: list[int],
    trainable: np.ndarray,
    message_of: np.ndarray,
    markup_span: np.ndarray,
    placeholders: list[tuple[int, MediaHandle]],
    media: TemplateMedia,
    *,
    train_roles: Sequence[str],
    precomputed: bool,
) -> EncodedConversation:
    """Replace each placeholder token by its expansion, carrying the placeholder's flag and
    message along, and build the `EncodedConversation`."""
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
    tokens = np.concatenate(pieces_ids) if pieces_ids else src
    origin = np.concatenate(pieces_index)
    flags = trainable[origin]
    loss_mask = None
    message_lengths: np.ndarray
    roles: list[str]
    turns = conversation.turns
    if precomputed:
        loss_mask = flags.view(np.int8)
        message_lengths = np.bincount(message_of[origin], minlength=len(turns)).astype(np.int64)
        roles = [t.role for t in turns]
    else:
        # spans: consecutive tokens of one message and one kind (in / outside the generation
        # block), each with its role
        span_key = message_of[origin] * 2 + markup_span[origin]
        change = np.flatnonzero(np.diff(span_key)) + 1
        starts = np.concatenate([[0], change]) if len(tokens) else np.zeros(0, dtype=np.int64)
        ends = np.concatenate([change, [len(tokens)]]) if len(tokens) else starts
        message_lengths = (ends - starts).astype(np.int64)
        roles = [
            TEMPLATE_MARKUP_ROLE if span_key[s] % 2 else turns[int(span_key[s] // 2)].role
            for s in starts
        ]
    return EncodedConversation.validated_from(
        conversation,
        train_roles=train_roles,
        token_ids=tokens,
        loss_mask=loss_mask,
        message_lengths=message_lengths,
        message_roles=roles,
        media=handles,
        media_units=units,
        media_tokens=counts,
    )
