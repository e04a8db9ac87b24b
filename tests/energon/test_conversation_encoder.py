"""One route per sample through ``preencode_sample``: the conversation encoder is chosen when
the task encoder is built (never per sample), it returns an encoding whose mask inputs are
validated and whose trainable tokens are counted, and the policy reads that count instead of
rebuilding the mask."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from megatron.energon import SkipSample
from mmpack.batch import masks, templates
from mmpack.energon import EncodedConversation, PackingEncoderConfig, PackingTaskEncoder
from mmpack.energon.chat_template import ChatTemplateEncoder
from mmpack.energon.markup import MarkupEncoder
from mmpack.energon.samples import Part, Turn
from mmpack.errors import ChatTemplateError, LossMaskError, SampleFormatError
from mmpack_dev.qwen_vocab import QWEN2_VL_CHAT_TEMPLATE as PLAIN
from mmpack_dev.qwen_vocab import QWEN2_VL_GENERATION_TEMPLATE as GENERATION
from mmpack_dev.qwen_vocab import qwen2_vl_tokenizer
from mmpack_dev.synthetic import build_tokenizer
from support.conversations import cooked_conversation
from test_chat_template import DIALOGUE, MESSAGES, encoder, mask_of, trained_text

MODES = [None, "precomputed"]
REPLIES = "4<|im_end|>You're welcome.<|im_end|>"
WHOLE_REPLIES = "4<|im_end|>\nYou're welcome.<|im_end|>\n"


@pytest.mark.parametrize("mode", MODES)
def test_the_chat_template_strategy_is_fixed_at_construction(
    mode: str | None, qwen_generation_tokenizer: Any
) -> None:
    enc = encoder(qwen2_vl_tokenizer(PLAIN), loss_mask_mode=mode)
    assert isinstance(enc.conversation_encoder, ChatTemplateEncoder)
    assert not enc.conversation_encoder.uses_generation_blocks
    before = enc.encode_conversation(DIALOGUE)
    assert trained_text(enc, before) == WHOLE_REPLIES
    # a template swapped in later would render with the new template and mask by the old
    # one's rule (GENERATION renders the same text but marks generation blocks): refused, by
    # sample, instead of training the assistant headers by the old rule
    enc.tokenizer.chat_template = GENERATION
    with pytest.raises(ChatTemplateError, match=r"'c0'.*chat template changed after"):
        enc.encode_conversation(DIALOGUE)
    enc.tokenizer.chat_template = PLAIN
    assert enc.encode_conversation(DIALOGUE).token_ids.tolist() == before.token_ids.tolist()
    # built with the generation template from the start, the headers are not trained
    fresh = encoder(qwen_generation_tokenizer, loss_mask_mode=mode)
    assert fresh.conversation_encoder.uses_generation_blocks
    assert trained_text(fresh, fresh.encode_conversation(DIALOGUE)) == REPLIES


def test_the_markup_strategy_is_fixed_at_construction() -> None:
    tok = build_tokenizer()
    cfg = PackingEncoderConfig(modalities=[])
    enc = PackingTaskEncoder(cfg, tokenizer=tok)
    assert isinstance(enc.conversation_encoder, MarkupEncoder)
    before = enc.encode_conversation(DIALOGUE)
    # a template appearing later does not switch the encoder ("auto" chose the markup)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}<|end|>{% endfor %}"
    assert enc.conversation_format == "markup"
    after = enc.encode_conversation(DIALOGUE)
    assert after.token_ids.tolist() == before.token_ids.tolist()
    assert after.message_roles == before.message_roles
    # a new encoder over the same tokenizer chooses the template
    assert isinstance(
        PackingTaskEncoder(cfg, tokenizer=tok).conversation_encoder, ChatTemplateEncoder
    )


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("template", ["plain", "gen", "markup"])
def test_the_encoding_carries_its_trainable_token_count(
    template: str, mode: str | None, qwen_tokenizer: Any, qwen_generation_tokenizer: Any
) -> None:
    if template == "markup":
        enc = PackingTaskEncoder(
            PackingEncoderConfig(loss_mask_mode=mode),
            tokenizer=build_tokenizer(),
            processor={"patch_size": 16},
        )
    else:
        tok = qwen_generation_tokenizer if template == "gen" else qwen_tokenizer
        enc = encoder(tok, loss_mask_mode=mode)
    encoded = enc.encode_conversation(DIALOGUE)
    assert encoded.trainable_tokens == int(mask_of(enc, encoded).sum()) > 0


@pytest.mark.parametrize("mode", MODES)
def test_the_policy_reads_the_count_and_never_rebuilds_a_mask(
    mode: str | None, monkeypatch: pytest.MonkeyPatch, qwen_tokenizer: Any
) -> None:
    enc = encoder(qwen_tokenizer, loss_mask_mode=mode)
    encoded = enc.encode_conversation(DIALOGUE)

    def no_mask_work(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the policy built or validated a mask")

    for name in ("from_roles", "from_fragments", "validate", "from_chat_template"):
        monkeypatch.setattr(masks, name, no_mask_work)
    enc.check_policy(DIALOGUE, encoded)  # passes on the count alone
    # the count decides: a mask with trainable tokens under a count of 0 is skipped
    emptied = dataclasses.replace(encoded, trainable_tokens=0)
    with pytest.raises(SkipSample, match="empty_trainable_mask"):
        enc.check_policy(DIALOGUE, emptied)
    assert enc.stats.snapshot()["skipped"]["empty_trainable_mask"] == 1


def test_an_encoding_not_made_by_a_conversation_encoder_is_refused_by_name(
    qwen_tokenizer: Any,
) -> None:
    enc = encoder(qwen_tokenizer, loss_mask_mode="precomputed")
    made = enc.encode_conversation(DIALOGUE)
    uncounted = EncodedConversation.derive_from(
        made,
        token_ids=made.token_ids,
        loss_mask=made.loss_mask,
        message_lengths=made.message_lengths,
        message_roles=made.message_roles,
        media=made.media,
        media_units=made.media_units,
    )
    assert uncounted.trainable_tokens is None
    with pytest.raises(SampleFormatError, match="sample 'c0' has no trainable-token count"):
        enc.check_policy(DIALOGUE, uncounted)
    # revalidated, it is counted (and its mask checked)
    assert (
        uncounted.revalidated(
            enc.config.train_roles, precomputed=enc.config.loss_mask_mode == "precomputed"
        ).trainable_tokens
        == made.trainable_tokens
    )
    broken = dataclasses.replace(made, loss_mask=made.loss_mask[:-1])
    with pytest.raises(LossMaskError, match="'c0'"):
        broken.revalidated(
            enc.config.train_roles, precomputed=enc.config.loss_mask_mode == "precomputed"
        )


def test_an_overriding_encode_conversation_is_validated_and_counted_again(
    monkeypatch: pytest.MonkeyPatch, qwen_tokenizer: Any
) -> None:
    class HalfTrained(PackingTaskEncoder):
        def encode_conversation(self, conversation: Any) -> EncodedConversation:
            encoded = super().encode_conversation(conversation)
            encoded.loss_mask[:] = 0  # edited in place, after the encoder counted
            return encoded

    enc = HalfTrained(
        PackingEncoderConfig(modalities=[], loss_mask_mode="precomputed"),
        tokenizer=qwen_tokenizer,
    )
    with pytest.raises(SkipSample, match="empty_trainable_mask"):
        enc.preencode_sample(DIALOGUE)
    # the default encoder is not validated twice: its count is the one it made
    plain = encoder(qwen_tokenizer, loss_mask_mode="precomputed")

    def twice(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("validated twice")

    monkeypatch.setattr(EncodedConversation, "revalidated", twice)
    whole = len(qwen_tokenizer(WHOLE_REPLIES, add_special_tokens=False).input_ids)
    assert plain.preencode_sample(DIALOGUE).trainable_tokens == whole == 9


def test_one_render_serves_both_chat_template_paths(
    monkeypatch: pytest.MonkeyPatch, qwen_tokenizer: Any
) -> None:
    calls: list[int] = []
    real = templates.render

    def counting(template: str, messages: Any, **kwargs: Any) -> Any:
        calls.append(len(messages))
        return real(template, messages, **kwargs)

    def never(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("rendered through apply_chat_template")

    monkeypatch.setattr(templates, "render", counting)
    enc = encoder(qwen_tokenizer)
    calls.clear()  # the startup probe renders too
    monkeypatch.setattr(enc.tokenizer, "apply_chat_template", never)
    encoded = enc.encode_conversation(DIALOGUE)
    ids, _ = masks.from_chat_template(enc.tokenizer, MESSAGES)
    # each conversation rendered once, whole: no prefix, no second render
    assert calls == [len(MESSAGES), len(MESSAGES)]
    assert encoded.token_ids.tolist() == ids.tolist()


class _Rewrites:
    """A conversation encoder of the user's that edits the built-in one's output."""

    def __init__(self, inner: Any, edit: Any) -> None:
        self.inner, self.edit, self.format = inner, edit, inner.format

    def encode(self, conversation: Any) -> EncodedConversation:
        encoded = self.inner.encode(conversation)
        self.edit(encoded)
        return encoded


def _with_encoder(tokenizer: Any, mode: str | None, edit: Any) -> PackingTaskEncoder:
    enc = encoder(tokenizer, loss_mask_mode=mode)
    # swapped after construction: the route must still validate what this encoder returns
    enc.conversation_encoder = _Rewrites(enc.conversation_encoder, edit)
    return enc


def test_a_swapped_in_conversation_encoder_is_validated_and_counted(qwen_tokenizer: Any) -> None:
    """Any encoder but the built-in ones is checked per sample: an emptied mask is skipped
    (never packed with nothing to train on), and a mask value of 2 fails its own sample with
    a ``LossMaskError`` naming it, not the whole pack it would have been selected into."""

    def empty(encoded: Any) -> None:
        encoded.loss_mask[:] = 0

    def two(encoded: Any) -> None:
        encoded.loss_mask[-1] = 2

    with pytest.raises(SkipSample, match="empty_trainable_mask"):
        _with_encoder(qwen_tokenizer, "precomputed", empty).preencode_sample(DIALOGUE)
    with pytest.raises(LossMaskError, match="'c0'"):
        _with_encoder(qwen_tokenizer, "precomputed", two).preencode_sample(DIALOGUE)


def test_in_roles_mode_the_count_follows_the_roles_the_batch_is_built_from(
    qwen_tokenizer: Any,
) -> None:
    """In roles mode the batch builder ignores a ``loss_mask``: so does the count. An encoder
    that attaches an all-zero mask is neither skipped for it nor trained by it."""
    made = encoder(qwen_tokenizer, loss_mask_mode=None).preencode_sample(DIALOGUE)

    def zero_mask(encoded: Any) -> None:
        encoded.loss_mask = encoded.token_ids * 0

    got = _with_encoder(qwen_tokenizer, None, zero_mask).preencode_sample(DIALOGUE)
    assert got.trainable_tokens == made.trainable_tokens > 0

    class AttachesMask(PackingTaskEncoder):
        def encode_conversation(self, conversation: Any) -> EncodedConversation:
            encoded = super().encode_conversation(conversation)
            zero_mask(encoded)
            return encoded

    overriding = AttachesMask(
        PackingEncoderConfig(modalities=[], loss_mask_mode=None), tokenizer=qwen_tokenizer
    )
    assert overriding.preencode_sample(DIALOGUE).trainable_tokens == made.trainable_tokens


@pytest.mark.parametrize("option", ["pad_to_multiple_of", "cp_size"])
def test_padding_past_int32_is_a_config_error_at_construction(
    option: str, qwen_tokenizer: Any
) -> None:
    from mmpack.errors import EnergonConfigError

    with pytest.raises(EnergonConfigError, match="batch options rejected"):
        encoder(qwen_tokenizer, **{option: 2**40})


@pytest.mark.parametrize("mode", MODES)
def test_the_markup_refuses_a_turn_with_fields_it_cannot_render(mode: str | None) -> None:
    enc = PackingTaskEncoder(
        PackingEncoderConfig(modalities=[], loss_mask_mode=mode), tokenizer=build_tokenizer()
    )
    assert isinstance(enc.conversation_encoder, MarkupEncoder)
    calls = [{"id": "c0", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    conv = cooked_conversation(
        "tools",
        [
            Turn("user", (Part(text="kaka"),)),
            Turn("assistant", (), {"tool_calls": calls}),
            Turn("assistant", (Part(text="lolo"),)),
        ],
    )
    # the markup has no place for tool calls: refused, not trained as an empty reply
    with pytest.raises(
        SampleFormatError, match=r"sample 'tools': turn 1 \(assistant\).*'tool_calls'"
    ):
        enc.encode_conversation(conv)
    plain = cooked_conversation("plain", [Turn("user", (Part(text="kaka"),)), conv.turns[2]])
    assert enc.encode_conversation(plain).num_tokens > 0
