"""Batches whose fields would disagree cannot be built: builder options that would break them
are refused (negative ``pad_token_id``, an ``ignore_index`` that is a token id, bools as
lengths, ``pad_to_length`` that does not fit), hand-built ``PackedBatch`` / ``PaddedBatch``
values are checked field against field, both are frozen, and ``micro_batch`` joins only packs
that fit one micro-batch."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch
from mmpack import PackedTensor
from mmpack.batch import EncodedSample, PackedBatch, micro_batch, pack_samples
from mmpack.batch.padded import pad_samples
from mmpack.errors import BatchLayoutError, BatchMediaError, BatchOptionError, EmptySampleError

BUILDERS = [pack_samples, pad_samples]


def _samples() -> list[EncodedSample]:
    return [
        EncodedSample("a", [5, 6, 7], message_lengths=[1, 2], message_roles=["user", "assistant"]),
        EncodedSample("b", [9, 40], message_lengths=[2], message_roles=["assistant"]),
        EncodedSample("c", [3], message_lengths=[1], message_roles=["assistant"]),
    ]


@pytest.mark.parametrize("build", BUILDERS)
def test_a_negative_pad_token_id_is_refused(build: Any) -> None:
    with pytest.raises(BatchOptionError, match=r"invalid pad_token_id: must be a token id"):
        build(_samples(), pad_token_id=-1)


@pytest.mark.parametrize("build", BUILDERS)
@pytest.mark.parametrize("ignore_index", [0, 3, 9, 40])
def test_an_ignore_index_that_is_a_token_id_is_refused(build: Any, ignore_index: int) -> None:
    # 0..40 are token ids of this batch (40 is the largest, in sample 'b')
    with pytest.raises(
        BatchOptionError, match=r"invalid ignore_index: .* go up to 40, in sample 'b'"
    ):
        build(_samples(), ignore_index=ignore_index)


@pytest.mark.parametrize("build", BUILDERS)
def test_an_ignore_index_past_the_token_ids_is_kept(build: Any) -> None:
    b = build(_samples(), ignore_index=41)
    assert b.ignore_index == 41
    assert torch.equal(b.loss_mask, b.labels != 41)


@pytest.mark.parametrize("build", BUILDERS)
@pytest.mark.parametrize(
    "lengths",
    [
        [True, True],
        [2, True],
        np.array([True, True]),
        torch.tensor([True, True]),
    ],
    ids=["list", "mixed", "numpy", "torch"],
)
def test_bools_as_message_lengths_are_refused(build: Any, lengths: Any) -> None:
    s = EncodedSample("bools", [5, 6], message_lengths=lengths, message_roles=["user", "assistant"])
    with pytest.raises(TypeError, match=r"message_lengths of sample 'bools' must be integers"):
        build([s])


def test_pad_to_length_must_fit() -> None:
    s = _samples()
    b = pack_samples(s, pad_to_length=10)
    assert b.cu_seqlens_padded.tolist() == [0, 3, 5, 10] and b.max_seqlen == 5
    assert b.position_ids[5:].tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(BatchOptionError, match=r"pad_to_length: the pack needs 6 positions"):
        pack_samples(s, pad_to_length=5)
    with pytest.raises(BatchOptionError, match=r"pad_to_length: 10 is not a multiple of 4"):
        pack_samples(s, pad_to_length=10, cp_size=2)
    with pytest.raises(BatchOptionError, match=r"pad_to_length: the longest sample has 3"):
        pad_samples(s, pad_to_length=2)
    for bad in (0, -3):
        with pytest.raises(BatchOptionError, match="pad_to_length"):
            pack_samples(s, pad_to_length=bad)
    with pytest.raises(TypeError, match="pad_to_length must be an int"):
        pack_samples(s, pad_to_length=True)  # type: ignore[arg-type]
    assert pad_samples(s, pad_to_length=8).input_ids.shape == (3, 8)


def test_hand_built_pack_is_checked_field_by_field() -> None:
    good = pack_samples(_samples(), pad_to_multiple_of=4)
    assert dataclasses.replace(good).labels.tolist() == good.labels.tolist()
    explicit = PackedBatch(
        input_ids=torch.tensor([5, 6, 7, 0]),
        labels=torch.tensor([-100, 7, -100, -100]),
        loss_mask=torch.tensor([False, True, False, False]),
        token_mask=torch.tensor([False, False, True, False]),
        position_ids=torch.tensor([0, 1, 2, 3]),
        cu_seqlens=torch.tensor([0, 3], dtype=torch.int32),
        cu_seqlens_padded=torch.tensor([0, 4], dtype=torch.int32),
        max_seqlen=4,
        sample_ids=["x"],
    )
    assert len(explicit) == 1

    def refused(match: str, **changes: Any) -> None:
        with pytest.raises(BatchLayoutError, match=match):
            dataclasses.replace(good, **changes)

    # the input-aligned mask passed as Megatron's loss_mask: the bug this layout prevents
    refused(
        r"loss_mask\[0\] \(sample 0, position 0\) is 0 but labels\[0\] is 6",
        loss_mask=good.token_mask,
    )
    shifted = good.labels.clone()
    shifted[3] = 9  # a label that reaches into the next sample
    refused(r"labels\[3\] \(sample 0, position 3\) is 9, expected -100", labels=shifted)
    flat = torch.arange(good.input_ids.numel())
    refused(r"position_ids\[4\] \(sample 1, position 0\) is 4", position_ids=flat)
    refused("max_seqlen is 3", max_seqlen=3)
    refused(r"invalid PackedBatch\.max_seqlen: must be >= 0", max_seqlen=-1)
    refused("2 sample_ids for 3 samples", sample_ids=["a", "b"])
    past = pack_samples(_samples(), ignore_index=41)
    ids = past.input_ids.clone()
    ids[0] = 41  # an untrained first token: only the ignore_index rule notices
    with pytest.raises(BatchLayoutError, match=r"ignore_index=41 is a token id .* sample 0"):
        dataclasses.replace(past, input_ids=ids)
    refused("not pad_token_id=1", pad_token_id=1)
    refused("cu_seqlens_padded has 3 entries", cu_seqlens_padded=good.cu_seqlens_padded[:3])
    with pytest.raises(TypeError, match=r"PackedBatch\.loss_mask must be a 1-D torch\.bool"):
        dataclasses.replace(good, loss_mask=good.loss_mask.long())
    with pytest.raises(TypeError, match=r"PackedBatch\.labels is on meta"):
        dataclasses.replace(good, labels=good.labels.to("meta"))


def test_hand_built_padded_rows_are_checked() -> None:
    rows = pad_samples(_samples(), pad_token_id=7)  # 7 is a real token of sample 'a' too
    assert dataclasses.replace(rows).lengths.tolist() == [3, 2, 1]
    by_token = rows.input_ids != 7  # the attention mask built from token values
    with pytest.raises(BatchLayoutError, match=r"attention_mask\[0, 2\] is 0, expected 1"):
        dataclasses.replace(rows, attention_mask=by_token)
    with pytest.raises(BatchLayoutError, match=r"loss_mask\[0, 0\] \(row 0, position 0\)"):
        dataclasses.replace(rows, loss_mask=rows.token_mask)
    with pytest.raises(BatchLayoutError, match="lengths and 3 sample_ids"):
        dataclasses.replace(rows, lengths=rows.lengths[:2])
    with pytest.raises(BatchLayoutError, match=r"labels has shape \(3, 2\)"):
        dataclasses.replace(rows, labels=rows.labels[:, :2])
    with pytest.raises(TypeError, match=r"PaddedBatch\.attention_mask must be a 2-D torch\.bool"):
        dataclasses.replace(rows, attention_mask=rows.attention_mask.long())


@pytest.mark.parametrize("batch", [pack_samples(_samples()), pad_samples(_samples())])
def test_batches_are_frozen(batch: Any) -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        batch.loss_mask = batch.token_mask
    moved = batch.to("meta")  # `to` still moves every field together
    assert moved is batch and batch.loss_mask.device.type == "meta"


def test_micro_batch_refuses_packs_that_do_not_fit() -> None:
    s = _samples()
    plain = pack_samples(s[:2])
    cp = pack_samples(s[2:], cp_size=2)
    with pytest.raises(EmptySampleError, match="at least one pack"):
        micro_batch([])
    with pytest.raises(TypeError, match=r"packs\[1\] is a list, not a PackedBatch"):
        micro_batch([plain, [plain]])  # type: ignore[list-item]
    with pytest.raises(BatchLayoutError, match=r"packs\[0\]: sample 0 is padded to 3 positions"):
        micro_batch([plain, cp], cp_size=2)
    other = pack_samples(s[2:], ignore_index=-1)
    with pytest.raises(BatchOptionError, match=r"packs\[1\] has ignore_index=-1"):
        micro_batch([plain, other])
    with pytest.raises(BatchOptionError, match="pad_to_length"):
        micro_batch([plain, plain], pad_to_length=9)
    with pytest.raises(TypeError, match="join packs on the host"):
        micro_batch([pack_samples(s[:1]).to("meta")])
    joined = micro_batch([plain, plain], pad_to_length=16)
    assert joined.cu_seqlens.tolist() == [0, 3, 5, 8, 10]
    assert joined.cu_seqlens_padded.tolist() == [0, 3, 5, 8, 16]
    assert joined.sample_ids == ["a", "b", "a", "b"]


def test_micro_batch_merges_media_across_packs() -> None:
    image = PackedTensor(torch.ones(4, 3), 0).enable_deduplication()
    s = [
        EncodedSample("a", [5, 6], loss_mask=[0, 1], media={"pixel_values": image}),
        EncodedSample("b", [7, 8], loss_mask=[0, 1], media={"pixel_values": image}),
    ]
    packs = [
        pack_samples(s[:1], loss_mask_mode="precomputed"),
        pack_samples(s[1:], loss_mask_mode="precomputed"),
    ]
    joined = micro_batch(packs)
    pv = joined.media["pixel_values"]
    assert len(pv) == 1 and len(pv.tensors) == 1  # one row, the shared image stored once
    assert pv.as_tensor().shape == (8, 3)
    odd = PackedTensor(torch.ones(1, 3), dim_to_pack=1).enable_deduplication()
    bad = pack_samples(
        [EncodedSample("c", [5], loss_mask=[1], media={"pixel_values": odd})],
        loss_mask_mode="precomputed",
    )
    with pytest.raises(BatchMediaError, match=r"'pixel_values' across packs \[0, 1\]"):
        micro_batch([packs[0], bad])
