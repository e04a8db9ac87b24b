"""mmpack.batch.masks: derivation, validation (every rule and error), turn spans, and agreement with
the plain-torch reference."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from mmpack.batch import masks
from mmpack.errors import (
    IndexOverflowError,
    LossMaskError,
    MessageSpanError,
    MmpackError,
    TurnStructureError,
)
from reference import errors as ref_errors
from reference import masks as ref


def test_from_roles_assistant_only() -> None:
    m = masks.from_roles([2, 3, 1, 2], ["system", "user", "assistant", "user"])
    assert m.dtype == np.bool_
    assert m.tolist() == [0, 0, 0, 0, 0, 1, 0, 0]


def test_from_roles_configurable_and_case_sensitive() -> None:
    m = masks.from_roles([1, 1, 1], ["system", "user", "assistant"], ("assistant", "system"))
    assert m.tolist() == [1, 0, 1]
    assert masks.from_roles([2], ["Assistant"]).tolist() == [0, 0]


def test_from_fragments() -> None:
    assert masks.from_fragments([2, 0, 3], [True, True, False]).tolist() == [1, 1, 0, 0, 0]
    assert masks.from_fragments(np.array([1, 2]), np.array([0, 1])).tolist() == [0, 1, 1]
    assert masks.from_fragments([], []).tolist() == []
    odd = np.array([1, 2], dtype=np.uint8).view(np.bool_)  # a "bool" holding the byte 2
    with pytest.raises(LossMaskError, match="must be booleans or 0/1"):
        masks.from_fragments([1, 1], odd)


def test_mismatched_message_lengths_vs_token_count() -> None:
    with pytest.raises(MessageSpanError, match=r"sample 'c7'.*sum to 5 but the sample has 6"):
        masks.from_roles([2, 3], ["user", "assistant"], num_tokens=6, sample_id="c7")
    assert issubclass(MessageSpanError, LossMaskError)


def test_lengths_vs_roles_count_and_negative_length() -> None:
    with pytest.raises(MessageSpanError, match="2 message lengths but 1 roles"):
        masks.from_roles([2, 3], ["user"])
    with pytest.raises(MessageSpanError, match="fragment 1 has negative length -3"):
        masks.from_fragments([2, -3], [True, False], sample_id=4)
    with pytest.raises(LossMaskError, match="booleans or 0/1"):
        masks.from_fragments([1], [2])


def test_spans_past_int32_tokens_are_refused_without_allocating() -> None:
    """Megatron's cu_seqlens are int32, so a longer sample is an error, not a 2**40-byte mask."""
    with pytest.raises(MessageSpanError, match=r"sample 'big'.*past 2\*\*31 - 1"):
        masks.from_roles([2**31, 1], ["user", "assistant"], sample_id="big")
    with pytest.raises(MessageSpanError, match="past 2"):
        masks.from_fragments([2**40], [True])


def test_train_roles_must_not_be_a_bare_string() -> None:
    with pytest.raises(TypeError, match="single string"):
        masks.from_roles([1], ["assistant"], "assistant")


MASK_KINDS = {
    "int64": lambda v: np.array(v, dtype=np.int64),
    "bool": lambda v: np.array(v, dtype=np.bool_),
    "uint8": lambda v: np.array(v, dtype=np.uint8),
    "int16": lambda v: np.array(v, dtype=np.int16),
    "float32": lambda v: np.array(v, dtype=np.float32),
    "torch-int64": lambda v: torch.tensor(v),
    "torch-bfloat16": lambda v: torch.tensor(v, dtype=torch.bfloat16),
    "list": list,
    # a non-contiguous view: every other value of [v0, 9, v1, 9, v2, 9]
    "strided": lambda v: np.array([x for t in v for x in (t, 9)], dtype=np.int64)[::2],
}


@pytest.mark.parametrize("kind", sorted(MASK_KINDS))
def test_validate_accepts_binary_masks(kind: str) -> None:
    make = MASK_KINDS[kind]
    assert masks.validate(make([0, 1, 1]), 3, sample_id="ok", require_trainable=True) is None
    # the values are read, whatever holds them: all zeros leaves nothing to train on
    with pytest.raises(LossMaskError, match="sample 'ok' has no trainable token"):
        masks.validate(make([0, 0, 0]), 3, sample_id="ok", require_trainable=True)


def test_validate_wrong_length_names_sample_and_rule() -> None:
    with pytest.raises(LossMaskError, match=r"sample 's1' has 4 values but .* 5 tokens") as e:
        masks.validate(np.ones(4, dtype=np.int64), 5, sample_id="s1")
    assert "mask length equals token count" in str(e.value)
    assert isinstance(e.value, ValueError)
    assert isinstance(e.value, MmpackError)


@pytest.mark.parametrize(
    ("mask", "value", "position"),
    [
        (np.array([0, 1, 2, 1], dtype=np.int64), "2", 2),
        (np.array([0, -1, 0, 0], dtype=np.int8), "-1", 1),
        (np.array([1, 1, 1, 3], dtype=np.uint8), "3", 3),
        (np.array([0.0, 0.5, 1.0, 1.0]), "0.5", 1),
        (torch.tensor([0, 1, 1, 256], dtype=torch.int32), "256", 3),
        (np.array([1, 0, 0, 70000], dtype=np.uint32), "70000", 3),
        # a bool array can hold other bytes (through a view): read as bytes, not as True
        (np.array([0, 1, 2, 1], dtype=np.uint8).view(np.bool_), "2", 2),
        (torch.tensor([0, 1, 1, 7], dtype=torch.uint8).view(torch.bool), "7", 3),
    ],
)
def test_validate_values_outside_binary(mask: object, value: str, position: int) -> None:
    with pytest.raises(LossMaskError, match="values are only 0 and 1") as e:
        masks.validate(mask, 4, sample_id="bad")
    assert f"value {value} at position {position}" in str(e.value)
    assert "sample 'bad'" in str(e.value)


def test_validate_first_bad_position_in_a_long_mask() -> None:
    m = np.zeros(100_000, dtype=np.int64)
    m[77_777] = 5
    m[90_000] = 7
    with pytest.raises(LossMaskError, match="value 5 at position 77777"):
        masks.validate(m, 100_000)


def test_validate_require_trainable() -> None:
    masks.validate(np.zeros(3, dtype=np.int64), 3)
    with pytest.raises(LossMaskError, match="no trainable token"):
        masks.validate(np.zeros(3, dtype=np.int64), 3, require_trainable=True, sample_id=0)
    with pytest.raises(LossMaskError, match="no trainable token"):
        masks.validate(np.zeros(3, dtype=bool), 3, require_trainable=True)


def test_negative_token_count_is_a_typed_error() -> None:
    with pytest.raises(LossMaskError, match="num_tokens of sample 'q' must be >= 0"):
        masks.validate([1], -1, sample_id="q")
    with pytest.raises(LossMaskError, match="must be >= 0"):
        masks.from_roles([1], ["user"], num_tokens=-2)


@pytest.mark.parametrize("bad", ["3", b"3", 3.0, 3.9, float("inf"), True])
def test_token_count_must_be_an_int(bad: object) -> None:
    """Nothing is parsed or truncated: "3" or 3.9 is not a count of 3."""
    with pytest.raises(TypeError, match="num_tokens of sample 'q' must be an int"):
        masks.validate([1, 0, 1], bad, sample_id="q")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="num_tokens"):
        masks.from_fragments([3], [True], num_tokens=bad)  # type: ignore[arg-type]
    assert masks.from_roles([3], ["user"], num_tokens=np.int32(3)).tolist() == [0, 0, 0]
    with pytest.raises(TypeError, match="got NoneType"):  # required by validate
        masks.validate([1], None)  # type: ignore[arg-type]


def test_counts_and_lengths_beyond_int64_are_typed_errors() -> None:
    with pytest.raises(LossMaskError, match=r"<= 2\*\*63 - 1, got 18446744073709551616"):
        masks.validate([1], 2**64, sample_id="q")
    # never wrapped into a negative (or small) value: uint64 arrays and huge Python ints
    for lengths in (np.array([2**64 - 1], np.uint64), [2**63, 1], [2**64, 1], [-(2**63) - 1]):
        with pytest.raises(IndexOverflowError, match="message_lengths of sample 'q' holds a"):
            masks.from_roles(lengths, ["user"] * len(lengths), sample_id="q")
    with pytest.raises(TypeError, match="must be integers, got dtype float64"):
        masks.from_roles([1.0, 2.0], ["user", "user"])


def test_meta_tensors_are_a_type_error() -> None:
    meta = torch.ones(3, dtype=torch.int64, device="meta")
    with pytest.raises(TypeError, match="loss mask of sample 'q' is a meta tensor"):
        masks.validate(meta, 3, sample_id="q")
    with pytest.raises(TypeError, match="token_ids of sample 'q' is a meta tensor"):
        masks.turn_spans(meta, [1], sample_id="q")


def test_validate_rejects_2d_and_non_numeric() -> None:
    with pytest.raises(LossMaskError, match="1-D"):
        masks.validate(np.ones((2, 2)), 4, sample_id="x")
    with pytest.raises(TypeError, match="dtype"):
        masks.validate(np.array(["a", "b"]), 2)


def test_turn_spans_convention() -> None:
    # BOS, <user> a b, <asst> c, <user> d, <asst> e f
    toks = [0, 50, 1, 2, 51, 3, 50, 4, 51, 5, 6]
    spans = masks.turn_spans(toks, [50, 51], sample_id="t")
    assert spans.dtype == np.int64
    assert spans.tolist() == [[1, 4, 4, 6], [6, 8, 8, 11]]
    # a single marker id for both roles works the same way (alternation by order)
    assert masks.turn_spans(torch.tensor([7, 1, 1, 7]), [7]).tolist() == [[0, 3, 3, 4]]


@pytest.mark.parametrize("toks", [[50, 1, 51, 2, 50, 3], [50, 1], [1, 2, 3], []])
def test_turn_spans_odd_or_missing_markers(toks: list[int]) -> None:
    with pytest.raises(TurnStructureError, match=r"sample 'conv9' has \d+ turn markers") as e:
        masks.turn_spans(toks, [50, 51], sample_id="conv9")
    assert not isinstance(e.value, IndexError)
    with pytest.raises(ref_errors.TurnStructureError):
        ref.turn_spans(toks, [50, 51], sample_id="conv9")


# ---- agreement with the torch reference ----

_roles = st.sampled_from(["system", "user", "assistant", "tool"])


@given(
    st.lists(st.tuples(st.integers(0, 20), _roles), max_size=12),
    st.sets(_roles, min_size=0, max_size=3),
)
def test_from_roles_matches_reference(msgs: list[tuple[int, str]], train: set[str]) -> None:
    lengths = [n for n, _ in msgs]
    roles = [r for _, r in msgs]
    got = masks.from_roles(lengths, roles, sorted(train))
    want = ref.from_roles(lengths, roles, sorted(train))
    assert got.tolist() == want.tolist()


@given(
    st.lists(st.integers(-2, 3), max_size=40),
    st.integers(0, 45),
    st.sampled_from([np.int64, np.int8, np.uint8, np.float32, np.int32]),
    st.booleans(),
)
def test_validate_matches_reference(values: list[int], n: int, dtype: type, require: bool) -> None:
    arr = np.array(values).astype(dtype)
    outcomes = []
    for fn, error in ((masks.validate, LossMaskError), (ref.validate, ref_errors.LossMaskError)):
        try:
            fn(arr, n, sample_id="h", require_trainable=require)
            outcomes.append("ok")
        except error as e:
            rule = str(e).split("(rule: ")[1]
            position = re.search(r"at position (\d+)", str(e))
            outcomes.append(rule + (position.group(1) if position else ""))
    assert outcomes[0] == outcomes[1]


@given(st.lists(st.integers(0, 6), max_size=40), st.sets(st.integers(0, 6), max_size=3))
def test_turn_spans_matches_reference(toks: list[int], markers: set[int]) -> None:
    try:
        want = ref.turn_spans(toks, sorted(markers))
    except ref_errors.TurnStructureError:
        with pytest.raises(TurnStructureError):
            masks.turn_spans(toks, sorted(markers))
        return
    assert masks.turn_spans(toks, sorted(markers)).tolist() == want.tolist()
