"""Conversations encoded with the tokenizer's own chat template, on Qwen2-VL's real tokenizer
(Qwen2's byte-level BPE, the released special ids and chat template): tokens as
``apply_chat_template`` gives them, trainable spans from the template's generation markers or
from the rendered message boundaries, in both mask modes; per-fragment flags located in the
text (never in a role header), one rule for a token that straddles two fragments, media
placeholders written in the text refused, and the templates mmpack refuses (at construction, or
naming the sample)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from mmpack.batch import masks, pack_samples
from mmpack.energon import PackingEncoderConfig, PackingTaskEncoder
from mmpack.energon.chat_template import TEMPLATE_MARKUP_ROLE
from mmpack.energon.media import MediaHandle
from mmpack.energon.samples import Conversation, Part, Turn
from mmpack.errors import EnergonConfigError, SampleFormatError
from mmpack_dev.qwen_vocab import (
    QWEN2_VL_CHAT_TEMPLATE,
    QWEN2_VL_GENERATION_TEMPLATE,
    qwen2_vl_tokenizer,
)
from mmpack_dev.synthetic import build_tokenizer, png_bytes
from support.conversations import cooked_conversation

COUNTS_MESSAGES = "{{ messages | length }} {% for m in messages %}{{ m['content'] }} {% endfor %}"
UPPERCASE = "{% for m in messages %}<|im_start|>{{ m['content'] | upper }}<|im_end|>{% endfor %}"


def conversation(*turns: tuple[str, tuple[Part, ...]], key: str = "c0") -> Conversation:
    return cooked_conversation(
        key,
        [Turn(role, parts) for role, parts in turns],
    )


def text(value: str, trainable: bool | None = None) -> Part:
    return Part(text=value, trainable=trainable)


DIALOGUE = conversation(
    ("system", (text("Be brief."),)),
    ("user", (text("What is 2 + 2?"),)),
    ("assistant", (text("4"),)),
    ("user", (text("Thanks! 🙂"),)),
    ("assistant", (text("You're welcome."),)),
)
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "Thanks! 🙂"},
    {"role": "assistant", "content": "You're welcome."},
]


def encoder(tokenizer: Any, **config: Any) -> PackingTaskEncoder:
    cfg = PackingEncoderConfig(modalities=[], **config)
    return PackingTaskEncoder(cfg, tokenizer=tokenizer)


def mask_of(enc: PackingTaskEncoder, encoded: Any) -> np.ndarray:
    """The loss mask the pack builder uses for `encoded` (its labels' gate)."""
    if encoded.loss_mask is not None:
        return np.asarray(encoded.loss_mask, dtype=np.bool_)
    return masks.from_roles(encoded.message_lengths, encoded.message_roles, enc.config.train_roles)


def trained_text(enc: PackingTaskEncoder, encoded: Any) -> str:
    ids = encoded.token_ids.tolist()
    return str(
        enc.tokenizer.decode([t for t, m in zip(ids, mask_of(enc, encoded), strict=True) if m])
    )


def flagged(enc: PackingTaskEncoder, encoded: Any) -> list[tuple[str, int]]:
    """Each token's text and its loss-mask flag."""
    ids = encoded.token_ids.tolist()
    return [
        (enc.tokenizer.decode([t]), int(m))
        for t, m in zip(ids, mask_of(enc, encoded).tolist(), strict=True)
    ]


@pytest.mark.parametrize("mode", [None, "precomputed"])
@pytest.mark.parametrize("generation", [False, True], ids=["boundaries", "generation"])
def test_tokens_and_mask_are_the_templates_own(
    qwen_tokenizer: Any, qwen_generation_tokenizer: Any, generation: bool, mode: str | None
) -> None:
    tokenizer = qwen_generation_tokenizer if generation else qwen_tokenizer
    enc = encoder(tokenizer, loss_mask_mode=mode)
    assert enc.conversation_format == "chat_template"
    encoded = enc.encode_conversation(DIALOGUE)
    # the tokens apply_chat_template gives, and the mask masks.from_chat_template derives (the
    # template's assistant mask, or per-message boundaries)
    ids, expected = masks.from_chat_template(tokenizer, MESSAGES)
    assert encoded.token_ids.tolist() == ids.tolist()
    assert (
        encoded.token_ids.tolist()
        == tokenizer.apply_chat_template(MESSAGES, tokenize=True)["input_ids"]
    )
    assert mask_of(enc, encoded).tolist() == expected.tolist()
    if generation:
        # the replies and their end markers, not the <|im_start|>assistant headers
        assert trained_text(enc, encoded) == "4<|im_end|>You're welcome.<|im_end|>"
        if mode is None:
            assert TEMPLATE_MARKUP_ROLE in encoded.message_roles
    else:
        # the replies and the end of their turns: no role header
        assert trained_text(enc, encoded) == "4<|im_end|>\nYou're welcome.<|im_end|>\n"


@pytest.mark.parametrize("generation", [False, True], ids=["boundaries", "generation"])
def test_both_mask_modes_give_the_same_labels(
    qwen_tokenizer: Any, qwen_generation_tokenizer: Any, generation: bool
) -> None:
    tokenizer = qwen_generation_tokenizer if generation else qwen_tokenizer
    packs = []
    for mode in (None, "precomputed"):
        enc = encoder(tokenizer, loss_mask_mode=mode)
        encoded = enc.encode_conversation(DIALOGUE)
        packs.append(pack_samples([enc.to_encoded_sample(encoded)], **enc.pack_options()))
    assert packs[0].labels.tolist() == packs[1].labels.tolist()
    assert int((packs[0].labels != -100).sum()) >= 4


def test_fragment_flags_decide_their_own_tokens_in_precomputed_mode(qwen_tokenizer: Any) -> None:
    enc = encoder(qwen_tokenizer, loss_mask_mode="precomputed")
    conv = conversation(
        ("user", (text("What is 2 + 2?", False),)),
        ("assistant", (text("Let me think.", False), text(" It is 4.", True))),
    )
    encoded = enc.encode_conversation(conv)
    # the reasoning prefix is not trained; the end of the turn follows the message (trainable)
    assert trained_text(enc, encoded) == " It is 4.<|im_end|>\n"
    with pytest.raises(SampleFormatError, match="differ from its roles"):
        encoder(qwen_tokenizer).encode_conversation(conv)


def test_a_token_straddling_two_fragments_is_trained_only_when_both_are(
    qwen_tokenizer: Any,
) -> None:
    """The fragments are rendered back to back, so one BPE token can hold the end of one and
    the start of the next (``" secretly"``: the space ends a trainable fragment). Such a token
    is trained iff every character it covers is: text marked not trainable never reaches the
    loss."""
    enc = encoder(qwen_tokenizer, loss_mask_mode="precomputed")
    conv = conversation(
        ("user", (text("hi"),)),
        ("assistant", (text("I say ", True), text("secret", False), text("ly yes", True))),
    )
    got = flagged(enc, enc.encode_conversation(conv))
    header = max(i for i, (token, _) in enumerate(got) if token == "assistant")
    reply = got[header + 2 : -2]
    # " secretly" holds the space of the first fragment and the start of the third
    assert reply == [("I", 1), (" say", 1), (" secretly", 0), (" yes", 1)]
    # a header newline merged into a fragment's leading newline straddles markup and text
    conv = conversation(("user", (text("hi"),)), ("assistant", (text("\nyes", False),)))
    got = flagged(enc, enc.encode_conversation(conv))
    assert got[-5:] == [("assistant", 0), ("\n\n", 0), ("yes", 0), ("<|im_end|>", 0), ("\n", 0)]


def test_a_fragment_is_never_matched_in_the_role_header(qwen_tokenizer: Any) -> None:
    """A fragment whose text also occurs in the template's markup (``"assistant\\n"`` in
    ``<|im_start|>assistant\\n``, ``"a"``, a newline) is located where the template put the
    text, not at the first match in the message's rendering."""
    enc = encoder(qwen_tokenizer, loss_mask_mode="precomputed")
    conv = conversation(
        ("user", (text("hi"),)),
        ("assistant", (text("assistant\n", False), text("ok", True))),
    )
    got = flagged(enc, enc.encode_conversation(conv))
    assert got[-8:-1] == [
        ("<|im_start|>", 0),
        ("assistant", 0),
        ("\n", 0),
        ("assistant", 0),
        ("\n", 0),
        ("ok", 1),
        ("<|im_end|>", 1),
    ]
    conv = conversation(
        ("user", (text("hi"),)), ("assistant", (text("a", False), text("ok", True)))
    )
    got = flagged(enc, enc.encode_conversation(conv))
    assert got[-5:-2] == [("\n", 0), ("a", 0), ("ok", 1)]


def test_text_of_every_private_use_character_is_encoded(qwen_tokenizer: Any) -> None:
    # nothing is written into the rendering to locate texts: any character is plain text
    areas = ((0xE000, 0xF900), (0xF0000, 0xFFFFE), (0x100000, 0x10FFFE))
    every_private_use = "".join(chr(c) for lo, hi in areas for c in range(lo, hi))
    enc = encoder(qwen_tokenizer, loss_mask_mode="precomputed")
    conv = conversation(("user", (text(every_private_use),)), ("assistant", (text("ok"),)))
    encoded = enc.encode_conversation(conv)
    messages = [
        {"role": "user", "content": every_private_use},
        {"role": "assistant", "content": "ok"},
    ]
    assert encoded.token_ids.tolist() == qwen_tokenizer.apply_chat_template(messages)["input_ids"]
    assert trained_text(enc, encoded) == "ok<|im_end|>\n"


def image(key: str, size: tuple[int, int]) -> MediaHandle:
    return MediaHandle(
        kind="image",
        key=key,
        sample_key="c0",
        source=("test", key),
        data=png_bytes(*size, seed=1),
        meta={},
    )


@pytest.fixture(scope="module")
def qwen_images(qwen_processor: Any) -> PackingTaskEncoder:
    return PackingTaskEncoder(PackingEncoderConfig(modalities=["image"]), processor=qwen_processor)


@pytest.mark.parametrize("mode", [None, "precomputed"])
def test_media_placeholders_expand_to_the_processors_count(
    qwen_processor: Any, mode: str | None
) -> None:
    enc = PackingTaskEncoder(
        PackingEncoderConfig(modalities=["image"], loss_mask_mode=mode), processor=qwen_processor
    )
    conv = conversation(
        ("user", (Part(media=image("a.png", (84, 56))), text("What is <image> here?"))),
        ("assistant", (text("A cat."),)),
    )
    encoded = enc.encode_conversation(conv)
    pad = qwen_processor.image_token_id
    # media units are the vision tower's patches: 2 x 2 of them merge into each token
    assert encoded.media_tokens == [6] and encoded.media_units == 24
    assert int((encoded.token_ids == pad).sum()) == 6
    assert sum(encoded.message_lengths.tolist()) == encoded.num_tokens
    # "<image>" is no token of Qwen2-VL: it stays text, as the model's processor keeps it
    decoded = qwen_processor.tokenizer.decode(encoded.token_ids.tolist())
    assert "<|vision_start|>" + "<|image_pad|>" * 6 + "<|vision_end|>What is <image> here?" in (
        decoded
    )
    assert trained_text(enc, encoded) == "A cat.<|im_end|>\n"


@pytest.mark.parametrize(
    "written",
    ["look: <|image_pad|>", "<|video_pad|> is unconfigured", "two <|image_pad|><|image_pad|>"],
)
def test_a_placeholder_written_in_the_text_is_refused_naming_the_sample(
    qwen_images: PackingTaskEncoder, qwen_processor: Any, written: str
) -> None:
    """The model's processor reads its placeholder tokens wherever they are (Qwen2-VL's
    refuses such a prompt: more ``<|image_pad|>`` than images), so a message text holding one,
    of any kind the processor handles, is refused by name instead of becoming media with no
    pixels."""
    with pytest.raises(ValueError, match="tokens in the text"):
        qwen_processor(text=["look: <|image_pad|>"])
    with_image = conversation(
        ("user", (Part(media=image("a.png", (56, 56))), text(written))),
        ("assistant", (text("ok"),)),
        key="sneaky",
    )
    with pytest.raises(SampleFormatError, match=r"'sneaky'.*holds the media placeholder"):
        qwen_images.encode_conversation(with_image)
    text_only = conversation(("user", (text(written),)), ("assistant", (text("ok"),)), key="t")
    with pytest.raises(SampleFormatError, match=r"'t'.*<\|(image|video)_pad\|>"):
        qwen_images.encode_conversation(text_only)


def test_a_media_token_in_the_markup_text_is_refused() -> None:
    enc = PackingTaskEncoder(
        PackingEncoderConfig(), tokenizer=build_tokenizer(), processor={"patch_size": 16}
    )
    assert enc.conversation_format == "markup"
    sneaky = conversation(("user", (text("what is <image> this"),)), ("assistant", (text("x"),)))
    with pytest.raises(SampleFormatError, match=r"'c0'.*holds the media token '<image>'"):
        enc.encode_conversation(sneaky)


@pytest.mark.parametrize(
    ("template", "message"),
    [(UPPERCASE, "does not render message 1's values")],
)
def test_templates_that_cannot_be_mapped_back_are_refused_at_construction(
    template: str, message: str
) -> None:
    with pytest.raises(EnergonConfigError, match=message):
        encoder(qwen2_vl_tokenizer(template), loss_mask_mode="precomputed")


def test_a_template_that_counts_the_messages_is_encoded(qwen_tokenizer: Any) -> None:
    # its output for the first message changes as messages are added: prefix renders could
    # not tell the messages apart, one render of the whole conversation can
    enc = encoder(qwen2_vl_tokenizer(COUNTS_MESSAGES), loss_mask_mode="precomputed")
    encoded = enc.encode_conversation(DIALOGUE)
    tok = enc.tokenizer
    assert encoded.token_ids.tolist() == tok.apply_chat_template(MESSAGES)["input_ids"]
    # " You" holds the user turn's closing space and the reply's first letters: a token
    # trains only when every character it covers does
    assert trained_text(enc, encoded) == "4're welcome. "


def test_a_trimming_template_maps_its_parts_back(qwen_tokenizer: Any) -> None:
    # a template that trims each message's content (as Llama 3's does)
    trims = qwen_tokenizer.chat_template.replace(
        "{{ message['content'] }}<|im_end|>", "{{ message['content'] | trim }}<|im_end|>"
    )
    enc = encoder(qwen2_vl_tokenizer(trims), loss_mask_mode="precomputed")
    conv = conversation(
        ("user", (text("  hi  "),)),
        ("assistant", (text("  think", False), text(" then 4  ", True))),
    )
    assert trained_text(enc, enc.encode_conversation(conv)) == " then 4<|im_end|>\n"


def test_the_markup_is_only_for_tokenizers_built_for_it() -> None:
    # the synthetic tokenizer has no template but every markup token: the markup
    synthetic = PackingTaskEncoder(
        PackingEncoderConfig(), tokenizer=build_tokenizer(), processor={"patch_size": 16}
    )
    assert synthetic.conversation_format == "markup"
    # a tokenizer with neither is refused, naming both ways out
    with pytest.raises(EnergonConfigError, match="no chat template") as info:
        encoder(qwen2_vl_tokenizer(chat_template=None))  # type: ignore[arg-type]
    assert "conversation_format: markup" in str(info.value)
    with pytest.raises(EnergonConfigError, match="has no chat template"):
        PackingTaskEncoder(
            PackingEncoderConfig(conversation_format="chat_template"),
            tokenizer=build_tokenizer(),
            processor={"patch_size": 16},
        )
    # a template wins over the markup unless the markup is chosen explicitly
    tok = build_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}<|end|>{% endfor %}"
    cfg = PackingEncoderConfig(conversation_format="markup")
    chosen = PackingTaskEncoder(cfg, tokenizer=tok, processor={"patch_size": 16})
    assert chosen.conversation_format == "markup"
    with pytest.raises(EnergonConfigError, match="conversation_format must be one of"):
        PackingEncoderConfig(conversation_format="jinja")


@pytest.mark.parametrize("tokenizer_template", [QWEN2_VL_CHAT_TEMPLATE, None])
def test_the_processors_template_is_the_one_used(tokenizer_template: str | None) -> None:
    """Transformers documents a multimodal model's template on its processor: when the
    processor has one, it renders (here the generation-marked copy, so the assistant headers
    are never trained), whatever the tokenizer holds."""
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    tok = qwen2_vl_tokenizer(tokenizer_template)  # type: ignore[arg-type]
    size = {"shortest_edge": 56 * 56, "longest_edge": 112 * 112}
    processor = Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(size=size),
        tokenizer=tok,
        video_processor=Qwen2VLVideoProcessor(size=size),
        chat_template=QWEN2_VL_GENERATION_TEMPLATE,
    )
    enc = PackingTaskEncoder(PackingEncoderConfig(modalities=["image"]), processor=processor)
    assert enc.conversation_encoder.uses_generation_blocks
    conv = conversation(
        ("user", (Part(media=image("a.png", (56, 56))), text("What is it?"))),
        ("assistant", (text("A cat."),)),
    )
    encoded = enc.encode_conversation(conv)
    theirs = processor.apply_chat_template(
        [
            {
                "role": "user",
                "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}],
            },
            {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]},
        ],
        tokenize=False,
    )
    assert "<|im_start|>assistant\nA cat.<|im_end|>" in theirs
    assert trained_text(enc, encoded) == "A cat.<|im_end|>"


@pytest.mark.parametrize("mode", [None, "precomputed"])
def test_an_injected_default_system_prompt_is_never_trained(
    qwen_tokenizer: Any, mode: str | None
) -> None:
    """Qwen2-VL's released template writes a default system prompt inside the first message's
    turn when the conversation has none: with an assistant message first, that prompt is text
    of the assistant's turn, yet no message's words."""
    enc = encoder(qwen_tokenizer, loss_mask_mode=mode)
    conv = conversation(("assistant", (text("Hello, how can I help?"),)), ("user", (text("hi"),)))
    encoded = enc.encode_conversation(conv)
    rendered = qwen_tokenizer.decode(encoded.token_ids.tolist())
    assert rendered.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")
    assert trained_text(enc, encoded) == "Hello, how can I help?<|im_end|>\n"
