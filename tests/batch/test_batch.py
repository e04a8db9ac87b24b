"""mmpack.batch.pack_samples: the worked example, THD layout, labels and the two masks, padding
/ CP, every error, device moves, media merging and Megatron's PackedSeqParams."""

from __future__ import annotations

import sys
import uuid
from typing import Any

import numpy as np
import pytest
import torch
from mmpack import PackedTensor
from mmpack.batch import EncodedSample, PackedBatch, pack_samples
from mmpack.errors import (
    BatchMediaError,
    BatchOptionError,
    EmptySampleError,
    IndexOverflowError,
    InvalidTokenError,
    LossMaskError,
    MessageSpanError,
    MissingFieldError,
    MmpackError,
)
from reference import batch as ref_batch
from reference import errors as ref_errors
from reference.packed_tensor import PackedTensor as RefPackedTensor

# The worked example of the mmpack.batch docstring: 2 turns, 1 image, 7 tokens, 3 of them the
# assistant's answer. <user> <image> what ? | <asst> cat </s>
IMAGE_TOKEN = 90
TOKENS = np.array([10, IMAGE_TOKEN, 11, 12, 20, 21, 22], dtype=np.int64)


def _image() -> PackedTensor:
    return PackedTensor(torch.ones(4, 3), dim_to_pack=0).enable_deduplication()


def test_worked_example_both_modes_agree() -> None:
    image = _image()
    derived = EncodedSample(
        "conv0",
        TOKENS,
        message_lengths=[4, 3],
        message_roles=["user", "assistant"],
        media={"pixel_values": image},
    )
    precomputed = EncodedSample(
        "conv0",
        torch.from_numpy(TOKENS),
        loss_mask=torch.tensor([0, 0, 0, 0, 1, 1, 1]),
        media={"pixel_values": image},
    )
    a = pack_samples([derived])
    b = pack_samples([precomputed], loss_mask_mode="precomputed")
    for batch in (a, b):
        assert batch.input_ids.tolist() == TOKENS.tolist()
        assert batch.token_mask.tolist() == [0, 0, 0, 0, 1, 1, 1]
        assert batch.labels.tolist() == [-100, -100, -100, 20, 21, 22, -100]
        # aligned with labels: the predictions of tokens 4, 5 and 6, made at 3, 4 and 5
        assert batch.loss_mask.tolist() == [0, 0, 0, 1, 1, 1, 0]
        assert batch.position_ids.tolist() == list(range(7))
        assert batch.cu_seqlens.tolist() == [0, 7]
        assert batch.cu_seqlens.dtype == torch.int32
        assert batch.max_seqlen == 7
        assert batch.sample_ids == ["conv0"]
        merged = batch.media["pixel_values"]
        assert len(merged) == 1
        assert torch.equal(merged.as_tensor(), torch.ones(4, 3))
    for name in PackedBatch._TENSOR_FIELDS:
        assert torch.equal(getattr(a, name), getattr(b, name))


def _three_samples() -> list[EncodedSample]:
    return [
        EncodedSample(
            "a",
            [1, 2, 3],
            loss_mask=[1, 1, 1],
            message_lengths=[1, 2],
            message_roles=["user", "assistant"],
        ),
        EncodedSample(
            "b",
            np.arange(4, 9, dtype=np.int32),
            loss_mask=np.array([0, 1, 0, 1, 1]),
            message_lengths=[2, 3],
            message_roles=["assistant", "user"],
        ),
        EncodedSample(
            "c",
            torch.tensor([9]),
            loss_mask=torch.tensor([True]),
            message_lengths=[1],
            message_roles=["assistant"],
        ),
    ]


def test_layout_labels_and_positions_with_padding() -> None:
    b = pack_samples(
        _three_samples(),
        loss_mask_mode="precomputed",
        pad_to_multiple_of=4,
        pad_token_id=7,
        ignore_index=-1,
    )
    assert b.cu_seqlens.tolist() == [0, 3, 8, 9]
    assert b.cu_seqlens_padded.tolist() == [0, 4, 12, 16]
    assert b.input_ids.tolist() == [1, 2, 3, 7, 4, 5, 6, 7, 8, 7, 7, 7, 9, 7, 7, 7]
    assert b.token_mask.tolist() == [1, 1, 1, 0, 0, 1, 0, 1, 1, 0, 0, 0, 1, 0, 0, 0]
    # labels[p] = input_ids[p+1] when p+1 is in the same sample and token_mask[p+1] == 1
    assert b.labels.tolist() == [2, 3, -1, -1, 5, -1, 7, 8, -1, -1, -1, -1, -1, -1, -1, -1]
    assert b.loss_mask.tolist() == (b.labels != -1).tolist()
    # sample "c" is one trainable token: no prediction inside its sample reaches it
    assert int(b.loss_mask.sum()) == 5 and int(b.token_mask.sum()) == 7
    assert b.pad_token_id == 7 and b.ignore_index == -1
    assert b.position_ids.tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]
    assert b.max_seqlen == 8
    assert len(b) == 3
    assert b.input_ids.dtype == torch.int64
    assert b.loss_mask.dtype == torch.bool and b.token_mask.dtype == torch.bool


def test_derived_mode_uses_roles_and_train_roles() -> None:
    b = pack_samples(_three_samples())
    assert b.token_mask.tolist() == [0, 1, 1, 1, 1, 0, 0, 0, 1]
    assert b.loss_mask.tolist() == [1, 1, 0, 1, 0, 0, 0, 0, 0]
    b2 = pack_samples(_three_samples(), train_roles=("user",))
    assert b2.token_mask.tolist() == [1, 0, 0, 0, 0, 1, 1, 1, 0]
    assert b2.loss_mask.tolist() == [0, 0, 0, 0, 1, 1, 1, 0, 0]


@pytest.mark.parametrize(("cp", "pad", "multiple"), [(2, 1, 4), (2, 6, 12), (4, 8, 8), (3, 4, 12)])
def test_context_parallel_padding(cp: int, pad: int, multiple: int) -> None:
    b = pack_samples(
        _three_samples(), loss_mask_mode="precomputed", cp_size=cp, pad_to_multiple_of=pad
    )
    padded = torch.diff(b.cu_seqlens_padded)
    assert bool((padded % multiple == 0).all())
    assert bool((padded % (2 * cp) == 0).all())
    assert b.input_ids.numel() == int(b.cu_seqlens_padded[-1])


def test_empty_list_is_a_typed_error() -> None:
    with pytest.raises(EmptySampleError, match="at least one sample"):
        pack_samples([])
    with pytest.raises(ref_errors.EmptySampleError):
        ref_batch.pack_samples([])


@pytest.mark.parametrize("mode", [None, "precomputed"])
def test_empty_sample_names_it(mode: str | None) -> None:
    samples = [
        EncodedSample(
            "fine", [1, 2], loss_mask=[0, 1], message_lengths=[2], message_roles=["assistant"]
        ),
        EncodedSample(
            "hollow",
            np.zeros(0, dtype=np.int64),
            loss_mask=[],
            message_lengths=[],
            message_roles=[],
        ),
    ]
    with pytest.raises(EmptySampleError, match="sample 'hollow' has no tokens"):
        pack_samples(samples, loss_mask_mode=mode)


def test_precomputed_mode_needs_a_mask() -> None:
    s = EncodedSample("m1", [1, 2, 3], message_lengths=[3], message_roles=["assistant"])
    with pytest.raises(MissingFieldError, match=r"sample 'm1' has no loss_mask.*'precomputed'"):
        pack_samples([s], loss_mask_mode="precomputed")


@pytest.mark.parametrize("missing", ["message_lengths", "message_roles"])
def test_derived_mode_needs_lengths_and_roles(missing: str) -> None:
    fields = {"message_lengths": [3], "message_roles": ["assistant"]}
    fields[missing] = None
    s = EncodedSample(("shard", 3), [1, 2, 3], loss_mask=[1, 1, 1], **fields)  # type: ignore[arg-type]
    with pytest.raises(MissingFieldError, match=rf"sample \('shard', 3\) has no {missing}"):
        pack_samples([s])


def test_wrong_mask_length_and_values() -> None:
    s = EncodedSample("w", [1, 2, 3], loss_mask=[1, 1])
    with pytest.raises(LossMaskError, match="sample 'w' has 2 values but the sample has 3"):
        pack_samples([s], loss_mask_mode="precomputed")
    s = EncodedSample("v", [1, 2, 3], loss_mask=np.array([0, 2, 1]))
    with pytest.raises(LossMaskError, match="sample 'v' has value 2 at position 1"):
        pack_samples([s], loss_mask_mode="precomputed")
    # a torch bool tensor holding the byte 2 (a view) must not reach the packed mask as it is
    odd = torch.tensor([0, 2, 1], dtype=torch.uint8).view(torch.bool)
    s = EncodedSample("b", [1, 2, 3], loss_mask=odd)
    with pytest.raises(LossMaskError, match="sample 'b' has value 2 at position 1"):
        pack_samples([s], loss_mask_mode="precomputed")


def test_mismatched_message_lengths_vs_token_count() -> None:
    s = EncodedSample("mm", [1, 2, 3], message_lengths=[1, 1], message_roles=["user", "assistant"])
    with pytest.raises(MessageSpanError, match=r"sample 'mm'.*sum to 2 but the sample has 3"):
        pack_samples([s])
    s = EncodedSample("mr", [1, 2, 3], message_lengths=[1, 2], message_roles=["user"])
    with pytest.raises(MessageSpanError, match="2 message lengths but 1 roles"):
        pack_samples([s])


def test_negative_token_and_bad_options() -> None:
    with pytest.raises(InvalidTokenError, match="sample 'n' has negative token id -100 at"):
        pack_samples(
            [EncodedSample("n", [1, -100], loss_mask=[1, 1])], loss_mask_mode="precomputed"
        )
    good = [EncodedSample("g", [1], loss_mask=[1])]
    with pytest.raises(BatchOptionError, match="loss_mask_mode"):
        pack_samples(good, loss_mask_mode="roles")
    with pytest.raises(BatchOptionError, match="pad_to_multiple_of"):
        pack_samples(good, loss_mask_mode="precomputed", pad_to_multiple_of=0)
    with pytest.raises(BatchOptionError, match="cp_size"):
        pack_samples(good, loss_mask_mode="precomputed", cp_size=0)
    with pytest.raises(TypeError, match="must be integers"):
        pack_samples(
            [EncodedSample("f", [1.5, 2.0], loss_mask=[1, 1])], loss_mask_mode="precomputed"
        )
    with pytest.raises(TypeError, match="1-D"):
        pack_samples(
            [EncodedSample("2d", [[1, 2]], loss_mask=[1, 1])], loss_mask_mode="precomputed"
        )
    assert issubclass(BatchOptionError, MmpackError)


def test_options_and_fields_beyond_int64_are_typed_errors() -> None:
    good = [EncodedSample("g", [1], loss_mask=[1])]
    for name in ("pad_token_id", "ignore_index", "pad_to_multiple_of", "cp_size"):
        for huge in (2**63, -(2**63) - 1):
            with pytest.raises(BatchOptionError, match=f"invalid {name}: .*<= 2\\*\\*63 - 1"):
                pack_samples(good, loss_mask_mode="precomputed", **{name: huge})
    # a message length beyond int64 is named, not an OverflowError from the native call
    s = EncodedSample("m", [1, 2], message_lengths=[2**64, 1], message_roles=["user", "user"])
    with pytest.raises(IndexOverflowError, match="message_lengths of sample 'm' holds a value"):
        pack_samples([s])
    big = EncodedSample("t", np.array([2**63], np.uint64), loss_mask=[1])
    with pytest.raises(IndexOverflowError, match="token_ids of sample 't'"):
        pack_samples([big], loss_mask_mode="precomputed")


def test_items_that_are_not_samples_and_meta_tensors_are_type_errors() -> None:
    good = EncodedSample("g", [1], loss_mask=[1])
    for bad in (None, {"token_ids": [1]}, "s"):
        with pytest.raises(TypeError, match=r"samples\[1\] is a \w+, not an EncodedSample"):
            pack_samples([good, bad], loss_mask_mode="precomputed")  # type: ignore[list-item]
    meta = torch.ones(2, dtype=torch.int64, device="meta")
    with pytest.raises(TypeError, match="token_ids of sample 'm' is a meta tensor"):
        pack_samples([EncodedSample("m", meta, loss_mask=[1, 1])], loss_mask_mode="precomputed")
    with pytest.raises(TypeError, match="loss mask of sample 'm' is a meta tensor"):
        pack_samples([EncodedSample("m", [1, 2], loss_mask=meta)], loss_mask_mode="precomputed")
    for roles in ("assistant", ["assistant", 1]):  # never stringified into a role name
        with pytest.raises(TypeError, match="train_roles must"):
            pack_samples([good], loss_mask_mode="precomputed", train_roles=roles)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="message_lengths of sample 'm' is a meta tensor"):
        pack_samples([EncodedSample("m", [1, 2], message_lengths=meta, message_roles=["user"] * 2)])


@pytest.mark.parametrize("cls", [PackedTensor, RefPackedTensor], ids=["mmpack", "reference"])
def test_media_merge_dedups_by_provenance_and_keeps_order(cls: type) -> None:
    shared = cls(torch.ones(4, 3), dim_to_pack=0).enable_deduplication()
    other = cls(torch.zeros(2, 3), dim_to_pack=0).enable_deduplication()
    samples = [
        EncodedSample("s0", [1, 2], loss_mask=[0, 1], media={"pixel_values": shared}),
        EncodedSample("s1", [3, 4], loss_mask=[0, 1]),  # text only
        EncodedSample(
            "s2",
            [5, 6],
            loss_mask=[0, 1],
            media={"pixel_values": cls.merge_segments([shared, other])},
        ),
    ]
    b = pack_samples(samples, loss_mask_mode="precomputed")
    pv = b.media["pixel_values"]
    assert len(pv) == 1  # one logical row for the pack
    assert len(pv.tensors) == 2  # the shared image is stored once
    assert pv.as_tensor().shape == (4 + 4 + 2, 3)
    assert type(pv) is cls
    assert pv._segment_indices == [0, 0, 1]
    assert torch.equal(pv.as_tensor()[:4], torch.ones(4, 3))


def test_media_errors_name_key_and_samples() -> None:
    a = PackedTensor(torch.ones(1, 2), dim_to_pack=0).enable_deduplication()
    b = PackedTensor(torch.ones(1, 2), dim_to_pack=1).enable_deduplication()
    samples = [
        EncodedSample("x", [1], loss_mask=[1], media={"pv": a}),
        EncodedSample("y", [2], loss_mask=[1], media={"pv": b}),
    ]
    with pytest.raises(BatchMediaError, match=r"'pv' across samples \['x', 'y'\]"):
        pack_samples(samples, loss_mask_mode="precomputed")
    raw = [EncodedSample("r", [1], loss_mask=[1], media={"pv": torch.ones(1)})]  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="media key 'pv' of sample 'r'"):
        pack_samples(raw, loss_mask_mode="precomputed")


def test_to_moves_every_tensor_in_place() -> None:
    b = pack_samples(
        [EncodedSample("d", TOKENS, loss_mask=[0, 0, 0, 0, 1, 1, 1], media={"pv": _image()})],
        loss_mask_mode="precomputed",
    )
    moved = b.to("meta")
    assert moved is b
    for name in PackedBatch._TENSOR_FIELDS:
        assert getattr(b, name).device.type == "meta"
    assert all(t.device.type == "meta" for t in b.media["pv"].tensors if t is not None)


def test_to_blocks_unless_the_target_is_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    # a non-blocking copy to the host may be read before it completes: only CUDA gets one
    b = pack_samples(
        [EncodedSample("d", TOKENS, loss_mask=[0, 0, 0, 0, 1, 1, 1], media={"pv": _image()})],
        loss_mask_mode="precomputed",
    )
    flags: list[bool] = []
    real_to = torch.Tensor.to

    def spy(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        flags.append(bool(kwargs.get("non_blocking", False)))
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", spy)
    b.to("cpu", non_blocking=True)
    b.to("meta", non_blocking=True)
    assert len(flags) >= len(PackedBatch._TENSOR_FIELDS)
    assert not any(flags)


# megatron-core warns on import about Transformer Engine / Apex being absent (CPU machine)
@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")
def test_packed_seq_params_builds_megatron_object() -> None:
    b = pack_samples(_three_samples(), loss_mask_mode="precomputed", pad_to_multiple_of=4)
    params = b.packed_seq_params()
    from megatron.core.packed_seq_params import PackedSeqParams

    assert isinstance(params, PackedSeqParams)
    assert params.qkv_format == "thd"
    assert params.cu_seqlens_q is b.cu_seqlens
    assert params.cu_seqlens_kv is b.cu_seqlens
    assert params.cu_seqlens_q_padded is b.cu_seqlens_padded
    assert params.cu_seqlens_kv_padded is b.cu_seqlens_padded
    assert params.max_seqlen_q == params.max_seqlen_kv == 8


def test_packed_seq_params_without_megatron_names_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "megatron.core.packed_seq_params", None)
    b = pack_samples(
        [EncodedSample(uuid.uuid4().hex, [1], loss_mask=[1])], loss_mask_mode="precomputed"
    )
    with pytest.raises(ImportError, match=r"pip install 'mmpack\[megatron\]'"):
        b.packed_seq_params()


def test_concurrent_packs_match_serial() -> None:
    from concurrent.futures import ThreadPoolExecutor

    batches = [_three_samples() for _ in range(8)]
    serial = [pack_samples(b, loss_mask_mode="precomputed", cp_size=2) for b in batches]
    with ThreadPoolExecutor(4) as pool:
        parallel = list(
            pool.map(lambda b: pack_samples(b, loss_mask_mode="precomputed", cp_size=2), batches)
        )
    for a, b in zip(serial, parallel, strict=True):
        assert torch.equal(a.labels, b.labels)
        assert torch.equal(a.cu_seqlens_padded, b.cu_seqlens_padded)
