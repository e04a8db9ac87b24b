"""Generated conversations through the chat-template encoder on Qwen2-VL's real tokenizer,
against the consumer: unicode, CJK, emoji, digits, runs of whitespace and newlines, text holding
special-token strings and media markers, empty and very long parts, several turns and roles.

* With a template that marks generation blocks, the trained tokens are
  ``apply_chat_template(..., return_assistant_tokens_mask=True)``'s, in both mask modes.
* In precomputed mode each fragment's flag covers the tokens of its text (offsets from the
  tokenizer itself, on a rendering the test builds by hand), and a token that straddles two
  fragments, or a fragment and the markup, is trained iff every character it covers is.
* With the model's processor, a placeholder string in the text is refused naming the sample,
  and with images the trained tokens are still the template's assistant mask (each image's
  expansion standing for its one placeholder token).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mmpack.batch import masks
from mmpack.energon import PackingEncoderConfig, PackingTaskEncoder
from mmpack.energon.media import MediaHandle
from mmpack.energon.samples import Conversation, Part, Turn
from mmpack.errors import SampleFormatError
from mmpack_dev.qwen_vocab import QWEN2_VL_GENERATION_TEMPLATE, qwen2_vl_tokenizer
from mmpack_dev.synthetic import png_bytes
from support.conversations import cooked_conversation

# small budgets: each example renders and tokenizes a few times with the real vocabulary
FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

SPECIAL_STRINGS = [
    "<|im_end|>",
    "<|im_start|>",
    "<|endoftext|>",
    "<|vision_start|>",
    "<|image_pad|>",
    "<image>",
    "<video>",
    "\ue000",  # private-use characters (what the part locator marks texts with)
    "\ue001",
]
PIECES = st.one_of(
    st.text(st.characters(exclude_categories=("Cs",)), max_size=8),
    st.sampled_from(
        [
            "世界",
            "你好，",
            "🙂",
            "👩‍👩‍👧",
            "0123",
            " 42",
            "  ",
            "\n",
            "\n\n\n",
            " \t ",
            "\r\n",
            "assistant\n",
            "user",
            "system",
            "a",
            "'s",
            "Hello",
            " world",
        ]
    ),
    st.sampled_from(SPECIAL_STRINGS),
)
LONG = st.builds(
    lambda unit, n: unit * n,
    st.sampled_from(["ab ", "数字 12 ", "\n", "🙂"]),
    st.integers(50, 400),
)
TEXTS = st.one_of(st.just(""), st.lists(PIECES, max_size=6).map("".join), LONG)
ROLES = st.sampled_from(["system", "user", "assistant"])


@st.composite
def conversations(draw: Any, *, flags: bool) -> Conversation:
    turns = []
    for _ in range(draw(st.integers(1, 5))):
        role = draw(ROLES)
        parts = tuple(
            Part(
                text=draw(TEXTS),
                trainable=draw(st.sampled_from([None, True, False])) if flags else None,
            )
            for _ in range(draw(st.integers(1, 3)))
        )
        turns.append(Turn(role, parts))
    return cooked_conversation(
        "generated",
        turns,
    )


def messages_of(conversation: Conversation) -> list[dict[str, str]]:
    return [
        {"role": t.role, "content": "".join(p.text or "" for p in t.parts)}
        for t in conversation.turns
    ]


@pytest.fixture(scope="module")
def generation_encoders(qwen_generation_tokenizer: Any) -> dict[Any, PackingTaskEncoder]:
    return {
        mode: PackingTaskEncoder(
            PackingEncoderConfig(modalities=[], loss_mask_mode=mode),
            tokenizer=qwen_generation_tokenizer,
        )
        for mode in (None, "precomputed")
    }


@pytest.fixture(scope="module")
def precomputed(qwen_tokenizer: Any) -> PackingTaskEncoder:
    return PackingTaskEncoder(
        PackingEncoderConfig(modalities=[], loss_mask_mode="precomputed"),
        tokenizer=qwen_tokenizer,
    )


@FAST
@given(conv=conversations(flags=False))
def test_trained_tokens_are_the_templates_assistant_mask(
    generation_encoders: dict[Any, PackingTaskEncoder], conv: Conversation
) -> None:
    tokenizer = generation_encoders[None].tokenizer
    theirs = tokenizer.apply_chat_template(
        messages_of(conv), tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    for mode, enc in generation_encoders.items():
        encoded = enc.encode_conversation(conv)
        assert encoded.token_ids.tolist() == list(theirs["input_ids"])
        if mode is None:
            mask = masks.from_roles(encoded.message_lengths, encoded.message_roles, ("assistant",))
        else:
            mask = np.asarray(encoded.loss_mask, dtype=np.bool_)
        assert mask.astype(int).tolist() == list(theirs["assistant_masks"]), mode
        assert encoded.trainable_tokens == int(mask.sum())


def rendered_by_hand(
    conversation: Conversation,
) -> tuple[str, list[bool | None], list[int], list[tuple[int, int, bool]]]:
    """Qwen2-VL's released template for string contents, written out: the rendering, one
    flag per character by the documented rule (a text's own flag; the end of its turn its
    message's; the injected system prompt and the role headers no message's: None), the
    message owning each character (-1: none), and each non-empty text part's span and flag."""
    out = ""
    flags: list[bool | None] = []
    owner: list[int] = []
    parts: list[tuple[int, int, bool]] = []
    for m, turn in enumerate(conversation.turns):
        by_role = turn.role == "assistant"
        given_flags = [p.trainable for p in turn.parts if p.trainable is not None]
        marker = any(given_flags) if given_flags else by_role
        head = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        head = head if m == 0 and turn.role != "system" else ""
        head += f"<|im_start|>{turn.role}\n"
        out += head
        flags += [None] * len(head)
        owner += [-1] * len(head)
        for part in turn.parts:
            flag = by_role if part.trainable is None else part.trainable
            if part.text:
                parts.append((len(out), len(out) + len(part.text), flag))
            out += part.text or ""
            flags += [flag] * len(part.text or "")
            owner += [m] * len(part.text or "")
        tail = "<|im_end|>\n"
        out += tail
        flags += [marker] * len(tail)
        owner += [m] * len(tail)
    return out, flags, owner, parts


@FAST
@given(conv=conversations(flags=True))
def test_each_fragment_flag_covers_the_tokens_of_its_text(
    precomputed: PackingTaskEncoder, conv: Conversation
) -> None:
    tokenizer = precomputed.tokenizer
    full, char_flag, owner, parts = rendered_by_hand(conv)
    assert tokenizer.apply_chat_template(messages_of(conv), tokenize=False) == full
    own = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    encoded = precomputed.encode_conversation(conv)
    assert encoded.token_ids.tolist() == own["input_ids"]
    got = np.asarray(encoded.loss_mask, dtype=np.bool_).tolist()
    for t, (start, end) in enumerate(own["offset_mapping"]):
        # the one rule: a token of one message (the template's own characters aside) is
        # trained iff every character of it that has a flag is trainable
        messages = set(owner[start:end]) - {-1}
        flagged = [f for f in char_flag[start:end] if f is not None]
        assert got[t] == (len(messages) == 1 and all(flagged)), (t, full[start:end])
        # so a token wholly inside one fragment has that fragment's flag
        for lo, hi, flag in parts:
            if lo <= start and end <= hi:
                assert got[t] == flag


@pytest.fixture(scope="module")
def with_images(qwen_processor: Any) -> PackingTaskEncoder:
    return PackingTaskEncoder(PackingEncoderConfig(modalities=["image"]), processor=qwen_processor)


PNG = png_bytes(56, 84, seed=3)


def image_part(i: int) -> Part:
    return Part(
        media=MediaHandle(
            kind="image",
            key=f"{i}.png",
            sample_key="gen",
            source=("test", f"{i}.png"),
            data=PNG,
            meta={},
        )
    )


def without_placeholders(text: str) -> str:
    while "<|image_pad|>" in text or "<|video_pad|>" in text:
        text = text.replace("<|image_pad|>", "").replace("<|video_pad|>", "")
    return text


@pytest.fixture(scope="module")
def generation_with_images(qwen_processor: Any) -> dict[Any, PackingTaskEncoder]:
    from transformers import Qwen2VLProcessor

    processor = Qwen2VLProcessor(
        image_processor=qwen_processor.image_processor,
        tokenizer=qwen2_vl_tokenizer(QWEN2_VL_GENERATION_TEMPLATE),
        video_processor=qwen_processor.video_processor,
    )
    return {
        mode: PackingTaskEncoder(
            PackingEncoderConfig(modalities=["image"], loss_mask_mode=mode), processor=processor
        )
        for mode in (None, "precomputed")
    }


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    turns=st.lists(
        st.tuples(
            TEXTS.map(without_placeholders), st.integers(0, 2), TEXTS.map(without_placeholders)
        ),
        min_size=1,
        max_size=3,
    )
)
def test_with_images_trained_tokens_are_still_the_templates_assistant_mask(
    generation_with_images: dict[Any, PackingTaskEncoder], turns: list[tuple[str, int, str]]
) -> None:
    parts: list[Turn] = []
    messages: list[dict[str, Any]] = []
    for question, images, answer in turns:
        media = [image_part(i) for i in range(images)]
        parts += [
            Turn("user", (Part(text=question), *media)),
            Turn("assistant", (Part(text=answer),)),
        ]
        content = [{"type": "text", "text": question}] + [{"type": "image"}] * images
        messages += [
            {"role": "user", "content": content},
            {"role": "assistant", "content": [{"type": "text", "text": answer}]},
        ]
    conv = cooked_conversation(
        "gen",
        parts,
    )
    tokenizer = generation_with_images[None].tokenizer
    theirs = tokenizer.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    for mode, enc in generation_with_images.items():
        encoded = enc.encode_conversation(conv)
        if mode is None:
            mask = masks.from_roles(encoded.message_lengths, encoded.message_roles, ("assistant",))
        else:
            mask = np.asarray(encoded.loss_mask, dtype=np.bool_)
        ids = encoded.token_ids.tolist()
        # each image's run of placeholder tokens stands for the template's one
        keep = [t == 0 or not (ids[t] == pad and ids[t - 1] == pad) for t in range(len(ids))]
        assert [i for i, k in zip(ids, keep, strict=True) if k] == list(theirs["input_ids"])
        kept = [int(m) for m, k in zip(mask.tolist(), keep, strict=True) if k]
        assert kept == list(theirs["assistant_masks"]), mode


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(before=TEXTS, after=TEXTS, images=st.integers(0, 2), reply=TEXTS)
def test_a_placeholder_in_the_text_is_refused_and_other_text_stays_text(
    with_images: PackingTaskEncoder, before: str, after: str, images: int, reply: str
) -> None:
    media = [
        Part(
            media=MediaHandle(
                kind="image",
                key=f"{i}.png",
                sample_key="gen",
                source=("test", f"{i}.png"),
                data=PNG,
                meta={},
            )
        )
        for i in range(images)
    ]
    conv = cooked_conversation(
        "gen",
        [
            Turn("user", (Part(text=before), *media, Part(text=after))),
            Turn("assistant", (Part(text=reply),)),
        ],
    )
    written = any(
        p in t for t in (before, after, reply) for p in ("<|image_pad|>", "<|video_pad|>")
    )
    if written:
        with pytest.raises(SampleFormatError, match=r"'gen'.*holds the media placeholder"):
            with_images.encode_conversation(conv)
        return
    encoded = with_images.encode_conversation(conv)
    pad = with_images.model_processor.processor.image_token_id
    assert encoded.media_tokens == [6] * images
    assert int((encoded.token_ids == pad).sum()) == 6 * images
    assert sum(encoded.message_lengths.tolist()) == encoded.num_tokens
