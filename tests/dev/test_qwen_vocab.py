"""The offline Qwen2-VL tokenizer is Qwen2's real byte-level BPE: known encodings, the special
tokens at the released ids, the chat template, and independent copies."""

from __future__ import annotations

from mmpack_dev.qwen_vocab import (
    FIRST_SPECIAL_ID,
    QWEN2_VL_GENERATION_TEMPLATE,
    QWEN2_VL_SPECIAL_TOKENS,
    qwen2_vl_tokenizer,
)


def test_real_bpe_encodings_and_special_ids() -> None:
    tok = qwen2_vl_tokenizer()
    # Qwen2's released tokenizer encodes these so (byte-level merges, one digit per token)
    assert tok("Hello world").input_ids == [9707, 1879]
    assert tok(" 123").input_ids == [220, 16, 17, 18]
    assert tok.decode(tok("héllo 🙂 世界\n\n  x").input_ids) == "héllo 🙂 世界\n\n  x"
    ids = tok.convert_tokens_to_ids(list(QWEN2_VL_SPECIAL_TOKENS))
    assert ids == list(range(FIRST_SPECIAL_ID, FIRST_SPECIAL_ID + len(QWEN2_VL_SPECIAL_TOKENS)))
    assert tok("<|image_pad|>x").input_ids[0] == 151655
    assert (tok.pad_token_id, tok.eos_token_id) == (151643, 151645)


def test_generation_template_renders_the_released_text_and_marks_the_replies() -> None:
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo there"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a"},
    ]
    plain = qwen2_vl_tokenizer()
    marked = qwen2_vl_tokenizer(QWEN2_VL_GENERATION_TEMPLATE)
    assert marked.apply_chat_template(messages, tokenize=False) == plain.apply_chat_template(
        messages, tokenize=False
    )
    out = marked.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    trained = [t for t, m in zip(out["input_ids"], out["assistant_masks"], strict=True) if m]
    assert marked.decode(trained) == "yo there<|im_end|>a<|im_end|>"


def test_each_tokenizer_is_independent() -> None:
    first, second = qwen2_vl_tokenizer(), qwen2_vl_tokenizer()
    first.padding_side = "left"
    first.add_tokens(["<extra-token>"])
    assert second.padding_side == "right" and len(second) == len(first) - 1
