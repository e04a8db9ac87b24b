"""The Energon encoder's batches carry mmpack's batch fields: padded rows (packing off) are
``mmpack.batch.padded.pad_samples`` output, packs join into one THD micro-batch
(``SftBatch.micro_batch``), and batch options that would break the fields stop the encoder at
construction."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from mmpack.batch import BatchOptions, PackedBatch, pack_samples
from mmpack.batch.padded import PaddedBatch, pad_samples
from mmpack.energon import PackingEncoderConfig, PackingTaskEncoder, cook_generic
from mmpack.errors import EnergonConfigError

TURNS = [
    [("user", "kaka"), ("assistant", "lolo")],
    [("system", "mimi"), ("user", "kaka kaka"), ("assistant", "lolo lolo lolo")],
    [("user", "kaka"), ("assistant", "lolo"), ("user", "mimi"), ("assistant", "kaka lolo")],
]


def _encoder(tokenizer: Any, **changes: Any) -> PackingTaskEncoder:
    cfg = PackingEncoderConfig(**{"capacity": 128, **changes})
    return PackingTaskEncoder(cfg, tokenizer=tokenizer, processor={"patch_size": 16})


def _encoded(enc: PackingTaskEncoder) -> list[Any]:
    out = []
    for k, turns in enumerate(TURNS):
        raw = {
            "__key__": f"c{k}",
            "__restore_key__": ("t", f"c{k}"),
            "__shard__": "s",
            "json": json.dumps(
                {"messages": [{"role": r, "content": c} for r, c in turns]}
            ).encode(),
        }
        out.append(enc.postencode_sample(enc.preencode_sample(cook_generic(raw))))
    return out


@pytest.mark.parametrize("mode", [None, "precomputed"])
def test_padded_path_is_pad_samples_with_lengths_for_attention(
    tokenizer: Any, worker: Any, mode: str | None
) -> None:
    end = tokenizer.convert_tokens_to_ids("<|end|>")  # ends every turn; here also the padding
    enc = _encoder(tokenizer, loss_mask_mode=mode, pad_token_id=end, pad_to_multiple_of=8)
    samples = _encoded(enc)
    batch = enc.batch(samples)
    rows = batch.padded
    assert isinstance(rows, PaddedBatch) and batch.packs is None
    want = pad_samples([enc.to_encoded_sample(s) for s in samples], **enc.pack_options())
    for name in PaddedBatch._TENSOR_FIELDS:
        assert torch.equal(getattr(rows, name), getattr(want, name)), name
    assert rows.input_ids.shape[1] % 8 == 0
    assert batch.token_slots == rows.input_ids.numel()
    lengths = [s.num_tokens for s in samples]
    assert rows.lengths.tolist() == lengths
    # the attention mask counts the real end-of-turn tokens, which equal the padding id
    assert rows.attention_mask.sum(1).tolist() == lengths
    assert int((rows.input_ids[rows.attention_mask] == end).sum()) > 0
    assert torch.equal(rows.loss_mask, rows.labels != enc.config.ignore_index)


def test_packs_join_into_one_micro_batch(tokenizer: Any, worker: Any) -> None:
    enc = _encoder(tokenizer, cp_size=2, batch_size=2)
    samples = _encoded(enc)
    packs = [enc.pack_selected_samples(samples[:2]), enc.pack_selected_samples(samples[2:])]
    batch = enc.batch(packs)
    assert batch.padded is None and all(isinstance(p, PackedBatch) for p in batch.packs)
    joined = batch.micro_batch(cp_size=2, pad_to_length=256)
    whole = pack_samples(
        [enc.to_encoded_sample(s) for s in samples], **enc.pack_options(), pad_to_length=256
    )
    for name in PackedBatch._TENSOR_FIELDS:
        assert torch.equal(getattr(joined, name), getattr(whole, name)), name
    assert joined.sample_ids == ["c0", "c1", "c2"]
    with pytest.raises(TypeError, match="needs packs"):
        enc.batch(samples).micro_batch()


def test_the_encoder_makes_its_batch_options_once_from_the_config(
    tokenizer: Any, worker: Any
) -> None:
    changes = {"loss_mask_mode": "precomputed", "pad_to_multiple_of": 4, "cp_size": 2}
    enc = _encoder(tokenizer, **changes, ignore_index=-1, batch_size=2)
    assert enc.batch_options == BatchOptions(**changes, ignore_index=-1)
    assert BatchOptions(**enc.pack_options()) == enc.batch_options
    samples = _encoded(enc)
    packs = [enc.pack_selected_samples(samples[:2]), enc.pack_selected_samples(samples[2:])]
    fixed = enc.batch_options.replace(pad_to_length=256)
    joined = enc.batch(packs).micro_batch(fixed)
    whole = pack_samples([enc.to_encoded_sample(s) for s in samples], fixed)
    for name in PackedBatch._TENSOR_FIELDS:
        assert torch.equal(getattr(joined, name), getattr(whole, name)), name
    assert joined.ignore_index == -1


@pytest.mark.parametrize(
    ("changes", "needle"),
    [({"pad_token_id": -1}, "pad_token_id"), ({"ignore_index": 0}, "ignore_index")],
)
def test_batch_options_that_break_the_fields_stop_the_encoder(
    tokenizer: Any, changes: dict[str, int], needle: str
) -> None:
    with pytest.raises(EnergonConfigError, match=needle):
        _encoder(tokenizer, **changes)
