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
  and end marker outside the block are never trained. An assistant message with no tokens in a
  block (an empty reply in a block around the text only, a turn the template does not mark)
  trains nothing, as the template's own mask; other roles without blocks follow `train_roles`.
* In ``"precomputed"`` mode a text part's ``trainable`` flag (fragments format) decides its
  own tokens. Each part is located by rendering the conversation once more with every text
  replaced by a unique sentinel (so a text is never matched inside a role header or a system
  prompt); a template that does not render a part's text verbatim (or trimmed at the ends)
  raises `ChatTemplateError`. Every character of the rendering gets a flag: a text part's
  characters its own, the other characters of a message (header, end marker, the template's
  own text) the message's marker flag (trainable if any of its parts is, else by role), a media
  placeholder by role unless the message flags its parts. **A token is trainable iff every
  character it covers (its offsets) is**: a byte-level BPE token that straddles two parts, or a
  part and the markup, is trained only when both sides are, so text marked not trainable never
  reaches the loss (the price: such a boundary token of a trainable part is not trained either).
* Media placeholder tokens in the rendering must be exactly the template's, one per media part:
  a text that holds one (``<|image_pad|>`` written in a message, for any kind the model's
  processor reads, configured or not) raises `SampleFormatError` naming the sample, as the
  model's own processor refuses such a prompt. Strings that are not placeholder tokens of the
  model (``<image>`` for Qwen2-VL) stay text.

In roles mode (``loss_mask_mode=None``) the result is per-message lengths and roles; the tokens
of a message outside its generation block are a span of role `TEMPLATE_MARKUP_ROLE`, which is
never trained.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import re
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
#: The private-use areas, as ranges of the first character of a marker pair (c, c + 1)
_PRIVATE_USE = ((0xE000, 0xF8FF), (0xF0000, 0xFFFFD), (0x100000, 0x10FFFD))

#: The role whose output ``{% generation %}`` blocks mark: with them, such a message trains only
#: the tokens inside its blocks, none when it has none.
GENERATION_ROLE = "assistant"


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
    conversation: Conversation,
    *,
    list_content: bool = False,
    text_of: Callable[[int, int, str], str] | None = None,
) -> list[dict[str, Any]]:
    """The conversation as Hugging Face chat messages (see the module docstring); with
    `list_content` every message's content is a list of items (what multimodal templates
    expect), else a turn without media has a plain string. `text_of(turn, part, text)`, if
    given, replaces each non-empty text part's text."""
    messages: list[dict[str, Any]] = []
    for m, turn in enumerate(conversation.turns):
        texts = [
            p.text if text_of is None or not p.text else text_of(m, i, p.text)
            for i, p in enumerate(turn.parts)
        ]
        if not list_content and all(p.media is None for p in turn.parts):
            messages.append({"role": turn.role, "content": "".join(t or "" for t in texts)})
            continue
        content: list[dict[str, Any]] = []
        for part, text in zip(turn.parts, texts, strict=True):
            if part.media is not None:
                content.append({"type": part.media.kind})
            elif text:
                content.append({"type": "text", "text": text})
        messages.append({"role": turn.role, "content": content})
    return messages


def _text_spans(
    tokenizer: Any,
    conversation: Conversation,
    list_content: bool,
    full: str,
    bounds: list[int],
) -> list[dict[int, tuple[int, int]]]:
    """Where each text part lies in the rendering `full`: per message, part index ->
    ``(start, end)`` character offsets. Found by rendering the conversation once more with
    each text replaced by a unique sentinel, so a text is never matched in the template's own
    markup (a role header, a system prompt): the sentinels' places, with the texts put back,
    must give `full` exactly (texts rendered verbatim, or trimmed at the ends of a message's
    content or of a part, as templates that ``| trim`` do); else `ChatTemplateError`."""
    key = conversation.__key__
    turns = conversation.turns
    texts = [
        (m, p, part.text)
        for m, turn in enumerate(turns)
        for p, part in enumerate(turn.parts)
        if part.media is None and part.text
    ]
    spans: list[dict[int, tuple[int, int]]] = [{} for _ in turns]
    if not texts:
        return spans
    # two private-use characters that occur nowhere in the rendering (so in no text): the
    # first plane's, then the supplementary planes' (one set of the rendering's characters)
    used = set(full)
    code = next(
        (
            c
            for c in itertools.chain(*(range(lo, hi, 2) for lo, hi in _PRIVATE_USE))
            if chr(c) not in used and chr(c + 1) not in used
        ),
        None,
    )
    if code is None:
        raise ChatTemplateError(
            f"sample {key!r}: the text uses every private-use character, so its parts cannot "
            "be marked to be located in the rendering"
        )
    opener, closer = chr(code), chr(code + 1)
    index = {(m, p): i for i, (m, p, _) in enumerate(texts)}
    messages = hf_messages(
        conversation,
        list_content=list_content,
        text_of=lambda m, p, _text: f"{opener}{index[(m, p)]}{closer}",
    )
    try:
        marked = tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception as err:
        raise ChatTemplateError(
            f"sample {key!r}: the chat template failed to render ({type(err).__name__}: {err})"
        ) from err
    pieces = re.split(f"{opener}([0-9]+){closer}", str(marked))
    if [int(i) for i in pieces[1::2]] != list(range(len(texts))):
        raise ChatTemplateError(
            f"sample {key!r}: the chat template does not render each text part once, in order, "
            "so its tokens cannot be located"
        )
    markup = pieces[0::2]
    for rendered in (
        [t for _, _, t in texts],
        [t.strip() for _, _, t in texts],
        _trimmed_contents(texts),
    ):
        if "".join(x for pair in zip(markup, [*rendered, ""], strict=True) for x in pair) != full:
            continue
        pos = 0
        for (m, p, _), before, text in zip(texts, markup, rendered, strict=False):
            pos += len(before)
            if not bounds[m] <= pos <= pos + len(text) <= bounds[m + 1]:
                break
            if text:
                spans[m][p] = (pos, pos + len(text))
            pos += len(text)
        else:
            return spans
        spans = [{} for _ in turns]
    raise ChatTemplateError(
        f"sample {key!r}: the chat template does not render the part's text verbatim (nor "
        "trimmed), so its tokens cannot be located"
    )


def _trimmed_contents(texts: list[tuple[int, int, str]]) -> list[str]:
    """Each text as it renders when its message's whole content is trimmed: the leading
    whitespace of the message's first texts and the trailing whitespace of its last ones go."""
    out = [t for _, _, t in texts]
    by_message: dict[int, list[int]] = {}
    for i, (m, _, _) in enumerate(texts):
        by_message.setdefault(m, []).append(i)
    for members in by_message.values():
        for i in members:
            out[i] = out[i].lstrip()
            if out[i]:
                break
        for i in reversed(members):
            out[i] = out[i].rstrip()
            if out[i]:
                break
    return out


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
        problems (a part's flags contradicting its role in roles mode, a media placeholder
        token written in the text, placeholders that do not match the media)."""
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
        ids = np.asarray(encoding.ids, dtype=np.int64)
        offsets = np.asarray(encoding.offsets, dtype=np.int64).reshape(-1, 2)
        n = len(ids)

        message_of = np.searchsorted(
            np.asarray(bounds[1:-1], dtype=np.int64), offsets[:, 0], "right"
        )
        ends = np.asarray(bounds[1:], dtype=np.int64)[message_of]
        straddling = np.flatnonzero(offsets[:, 1] > ends)
        if len(straddling):
            i = int(straddling[0])
            start, end = (int(v) for v in offsets[i])
            raise ChatTemplateError(
                f"sample {key!r}: token {i} ({full[start:end]!r}) straddles the end of message "
                f"{int(message_of[i])}'s rendering; message boundaries do not fall on token "
                "boundaries"
            )

        in_generation = (
            _generation_mask(tokenizer, messages, ids.tolist(), key)
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
        placeholders = _match_placeholders(conversation, ids, message_of, media, full, offsets)
        # roles mode: the tokens of a message outside its generation block
        markup_span = np.zeros(n, dtype=np.bool_)
        trainable = np.zeros(n, dtype=np.bool_)
        spans = (
            _text_spans(tokenizer, conversation, media.list_content, full, bounds)
            if precomputed
            else None
        )
        # precomputed mode: one flag per character of the rendering (each text part's own,
        # the message's marker elsewhere); a token is trained iff every character it covers is
        char_flag = np.zeros(len(full), dtype=np.bool_)
        marker_of = np.zeros(len(turns), dtype=np.bool_)
        for m, turn in enumerate(turns):
            lo = int(np.searchsorted(message_of, m, side="left"))
            hi = int(np.searchsorted(message_of, m, side="right"))
            by_role = turn.role in train_roles
            # an assistant reply the template leaves outside its blocks (an empty reply, an
            # earlier turn) is not trained, as in the template's own assistant mask
            if bool(in_generation[lo:hi].any()) or (
                self.uses_generation_blocks and turn.role == GENERATION_ROLE
            ):
                markup_span[lo:hi] = ~in_generation[lo:hi]
            if spans is None:
                trainable[lo:hi] = by_role
                continue
            flags = [p.trainable for p in turn.parts if p.media is None and p.trainable is not None]
            marker_of[m] = any(flags) if flags else by_role
            char_flag[bounds[m] : bounds[m + 1]] = marker_of[m]
            for p_idx, (s_lo, s_hi) in spans[m].items():
                part = turn.parts[p_idx]
                char_flag[s_lo:s_hi] = by_role if part.trainable is None else part.trainable
            for t, _ in placeholders:
                if lo <= t < hi:
                    # media is not trained where the message marks its text per fragment
                    char_flag[offsets[t, 0] : offsets[t, 1]] = by_role and not flags
        if spans is not None:
            untrained = np.concatenate([[0], np.cumsum(~char_flag)])
            covered = untrained[offsets[:, 1]] - untrained[offsets[:, 0]] == 0
            # a token with no text (none in a byte-level BPE) follows its message's marker
            empty = offsets[:, 1] <= offsets[:, 0]
            trainable = np.where(empty, marker_of[message_of], covered)
        # with generation blocks, a message that has some trains only the tokens inside them
        trainable &= ~markup_span
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


def _match_placeholders(
    conversation: Conversation,
    ids: np.ndarray,
    message_of: np.ndarray,
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
    is_placeholder = np.isin(ids, np.fromiter(model_ids, dtype=np.int64, count=len(model_ids)))
    found: list[tuple[int, MediaHandle]] = []
    for m, turn in enumerate(conversation.turns):
        where = np.flatnonzero(is_placeholder & (message_of == m))
        by_kind: dict[str, list[int]] = {}
        for t in where.tolist():
            by_kind.setdefault(model_ids[int(ids[t])], []).append(t)
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
            found.append((rendered.pop(0), part.media))
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
