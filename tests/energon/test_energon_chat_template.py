"""Conversations encoded with the tokenizer's own chat template: tokens as
``apply_chat_template`` gives them, trainable spans from the template's generation markers or
from the rendered message boundaries, in both mask modes, and the templates mmpack refuses
(at construction, or naming the sample)."""

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
from mmpack_dev.synthetic import build_tokenizer
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

WORDS = ["<unk>", "<pad>", "<s>", "</s>", "<user>", "<asst>", "<sys>", "<img>"]
WORDS += "what is two plus four thanks yes be brief think first then answer".split()

PLAIN = (
    "{% for m in messages %}<{{ 'asst' if m['role'] == 'assistant' else m['role'][:4] }}> "
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<img> {% else %}{{ c['text'] }}{% endif %}{% endfor %}"
    "{% endif %} </s> {% endfor %}"
)
GENERATION = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}<asst> {% generation %}"
    "{{ m['content'] }} </s>{% endgeneration %} {% else %}<{{ m['role'][:4] }}> "
    "{{ m['content'] }} </s> {% endif %}{% endfor %}"
)
NOT_PREFIX_STABLE = "{{ messages | length }} {% for m in messages %}{{ m['content'] }} {% endfor %}"
UPPERCASE = "{% for m in messages %}<{{ m['role'][:4] }}> {{ m['content'] | upper }} {% endfor %}"


def tokenizer_with(template: str | None) -> PreTrainedTokenizerFast:
    vocab = {w: i for i, w in enumerate(WORDS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        unk_token="<unk>",
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        additional_special_tokens=["<user>", "<asst>", "<sys>", "<img>"],
    )
    if template is not None:
        tok.chat_template = template
    return tok


def conversation(*turns: tuple[str, tuple[Part, ...]], key: str = "c0") -> Conversation:
    return Conversation(
        __key__=key,
        __restore_key__=(),
        __subflavors__=None,
        __sources__=(),
        source_format="test",
        turns=[Turn(role, parts) for role, parts in turns],
    )


def text(value: str, trainable: bool | None = None) -> Part:
    return Part(text=value, trainable=trainable)


DIALOGUE = conversation(
    ("system", (text("be brief"),)),
    ("user", (text("what is two plus two"),)),
    ("assistant", (text("four"),)),
    ("user", (text("thanks"),)),
    ("assistant", (text("yes"),)),
)
MESSAGES = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "what is two plus two"},
    {"role": "assistant", "content": "four"},
    {"role": "user", "content": "thanks"},
    {"role": "assistant", "content": "yes"},
]


def encoder(template: str | None, **config: Any) -> PackingTaskEncoder:
    cfg = PackingEncoderConfig(modalities=[], **config)
    return PackingTaskEncoder(cfg, tokenizer=tokenizer_with(template))


def mask_of(enc: PackingTaskEncoder, encoded: Any) -> np.ndarray:
    """The loss mask the pack builder uses for `encoded` (its labels' gate)."""
    if encoded.loss_mask is not None:
        return np.asarray(encoded.loss_mask, dtype=np.bool_)
    return masks.from_roles(encoded.message_lengths, encoded.message_roles, enc.config.train_roles)


@pytest.mark.parametrize("mode", [None, "precomputed"])
@pytest.mark.parametrize("template", [PLAIN, GENERATION], ids=["boundaries", "generation"])
def test_tokens_and_mask_are_the_templates_own(template: str, mode: str | None) -> None:
    enc = encoder(template, loss_mask_mode=mode)
    assert enc.conversation_format == "chat_template"
    encoded = enc.encode_conversation(DIALOGUE)
    tokenizer = enc.tokenizer
    # the tokens apply_chat_template gives, and the mask masks.from_chat_template derives (the
    # template's assistant mask, or per-message boundaries)
    ids, expected = masks.from_chat_template(tokenizer, MESSAGES)
    assert encoded.token_ids.tolist() == ids.tolist()
    assert (
        encoded.token_ids.tolist()
        == tokenizer.apply_chat_template(MESSAGES, tokenize=True)["input_ids"]
    )
    got = mask_of(enc, encoded)
    assert got.tolist() == expected.tolist()
    trained = [WORDS[t] for t, m in zip(ids.tolist(), got.tolist(), strict=True) if m]
    if template is GENERATION:
        assert trained == ["four", "</s>", "yes", "</s>"]  # not the <asst> header
        if mode is None:
            assert TEMPLATE_MARKUP_ROLE in encoded.message_roles
    else:
        assert trained == ["<asst>", "four", "</s>", "<asst>", "yes", "</s>"]


@pytest.mark.parametrize("template", [PLAIN, GENERATION], ids=["boundaries", "generation"])
def test_both_mask_modes_give_the_same_labels(template: str) -> None:
    packs = []
    for mode in (None, "precomputed"):
        enc = encoder(template, loss_mask_mode=mode)
        encoded = enc.encode_conversation(DIALOGUE)
        packs.append(pack_samples([enc.to_encoded_sample(encoded)], **enc.pack_options()))
    assert packs[0].labels.tolist() == packs[1].labels.tolist()
    assert int((packs[0].labels != -100).sum()) >= 2


def test_fragment_flags_decide_their_own_tokens_in_precomputed_mode() -> None:
    enc = encoder(PLAIN, loss_mask_mode="precomputed")
    conv = conversation(
        ("user", (text("what is two", False),)),
        ("assistant", (text("think first ", False), text("then answer four", True))),
    )
    encoded = enc.encode_conversation(conv)
    words = [WORDS[t] for t in encoded.token_ids.tolist()]
    trained = [w for w, m in zip(words, encoded.loss_mask.tolist(), strict=True) if m]
    # the reasoning prefix is not trained; the markup follows the message (trainable)
    assert trained == ["<asst>", "then", "answer", "four", "</s>"]
    with pytest.raises(SampleFormatError, match="differ from its roles"):
        encoder(PLAIN).encode_conversation(conv)


def test_media_placeholders_expand_to_their_token_count() -> None:
    tok = tokenizer_with(PLAIN.replace("<img>", "<image>"))
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    cfg = PackingEncoderConfig(modalities=["image"])
    enc = PackingTaskEncoder(cfg, tokenizer=tok, processor={"patch_size": 16})
    image = MediaHandle(
        kind="image",
        key="a.png",
        sample_key="c0",
        source=("test", "a.png"),
        data=b"",
        meta={"width": 64, "height": 32},
    )
    conv = conversation(
        ("user", (Part(media=image), text("what is two"))),
        ("assistant", (text("four"),)),
    )
    encoded = enc.encode_conversation(conv)
    image_id = tok.convert_tokens_to_ids("<image>")
    assert encoded.media_tokens == [8] and encoded.media_units == 8
    assert int((encoded.token_ids == image_id).sum()) == 8
    assert sum(encoded.message_lengths.tolist()) == encoded.num_tokens
    # a placeholder written in the text has no media item to fill it
    sneaky = conversation(
        ("user", (text("what is <image> two"),)),
        ("assistant", (text("four"),)),
    )
    with pytest.raises(SampleFormatError, match="placeholder token"):
        enc.encode_conversation(sneaky)


@pytest.mark.parametrize(
    ("template", "message"),
    [
        (NOT_PREFIX_STABLE, "not prefix-stable"),
        (UPPERCASE, "does not render the part's text verbatim"),
    ],
)
def test_templates_that_cannot_be_mapped_back_are_refused_at_construction(
    template: str, message: str
) -> None:
    with pytest.raises(EnergonConfigError, match=message):
        encoder(template, loss_mask_mode="precomputed")


def test_the_markup_is_only_for_tokenizers_built_for_it() -> None:
    # the synthetic tokenizer has no template but every markup token: the markup
    synthetic = PackingTaskEncoder(
        PackingEncoderConfig(), tokenizer=build_tokenizer(), processor={"patch_size": 16}
    )
    assert synthetic.conversation_format == "markup"
    # a tokenizer with neither is refused, naming both ways out
    with pytest.raises(EnergonConfigError, match="no chat template") as info:
        encoder(None)
    assert "conversation_format: markup" in str(info.value)
    with pytest.raises(EnergonConfigError, match="has no chat template"):
        PackingTaskEncoder(
            PackingEncoderConfig(conversation_format="chat_template"),
            tokenizer=build_tokenizer(),
            processor={"patch_size": 16},
        )
    # a template wins over the markup unless the markup is chosen explicitly
    tok = build_tokenizer()
    tok.chat_template = PLAIN
    cfg = PackingEncoderConfig(conversation_format="markup")
    chosen = PackingTaskEncoder(cfg, tokenizer=tok, processor={"patch_size": 16})
    assert chosen.conversation_format == "markup"
    with pytest.raises(EnergonConfigError, match="conversation_format must be one of"):
        PackingEncoderConfig(conversation_format="jinja")
