"""mmpack._coerce: the shared argument checks, their error classes and wording. The packing,
masks and batch suites cover the helpers through their callers; these tests pin the rules
every caller relies on."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from mmpack import _coerce
from mmpack.errors import (
    BatchOptionError,
    IndexOverflowError,
    ItemTooLargeError,
    LayoutError,
    LossMaskError,
    PackingArgumentError,
    PackingDtypeError,
)

# ----------------------------------------------------------------------------- scalars


def test_packing_int_wording_and_range() -> None:
    assert _coerce.packing_int(np.int32(7), "capacity", 1) == 7
    assert type(_coerce.packing_int(np.int64(7), "capacity", 1)) is int
    with pytest.raises(PackingArgumentError, match=r"capacity: must be an integer, got True"):
        _coerce.packing_int(True, "capacity", 1)
    with pytest.raises(PackingArgumentError, match=r"capacity: must be >= 1, got 0"):
        _coerce.packing_int(0, "capacity", 1)
    with pytest.raises(
        PackingArgumentError, match=r"seed: must be <= 2\*\*63 - 1, got 9223372036854775808"
    ):
        _coerce.packing_int(2**63, "seed", _coerce.I64_MIN)
    assert _coerce.optional_packing_int(None, "min_bins", 0) is None
    # an __index__ object that is no int is refused, as a tensor scalar is
    with pytest.raises(PackingArgumentError, match="must be an integer"):
        _coerce.packing_int(torch.tensor(3), "capacity", 1)


def test_option_int_wording_and_range() -> None:
    assert _coerce.option_int(-100, "ignore_index", error=BatchOptionError) == -100
    with pytest.raises(TypeError, match="cp_size must be an int, got float"):
        _coerce.option_int(2.0, "cp_size", error=BatchOptionError, minimum=1)
    with pytest.raises(TypeError, match="cp_size must be an int, got Tensor"):
        _coerce.option_int(torch.tensor(2), "cp_size", error=BatchOptionError, minimum=1)
    with pytest.raises(
        BatchOptionError, match=r"invalid cp_size: must be >= 1 and <= 2\*\*63 - 1, got 0"
    ):
        _coerce.option_int(0, "cp_size", error=BatchOptionError, minimum=1)


@pytest.mark.parametrize("value", [2**63, _coerce.I64_MIN - 1, 10**30])
def test_count_int_full_range_says_int64(value: int) -> None:
    with pytest.raises(LayoutError, match=f"num_rows must fit in int64, got {value}"):
        _coerce.count_int(value, "num_rows", error=LayoutError)


def test_count_int_accepts_index_objects_and_refuses_the_rest() -> None:
    assert _coerce.count_int(torch.tensor(4), "repeats", error=LayoutError) == 4
    assert _coerce.count_int(_coerce.I64_MIN, "repeats", error=LayoutError) == _coerce.I64_MIN
    for bad, shown in ((True, "bool"), (1.0, "float"), ("3", "str")):
        with pytest.raises(TypeError, match=f"repeats must be an int, got {shown}"):
            _coerce.count_int(bad, "repeats", error=LayoutError)
    with pytest.raises(LossMaskError, match=r"num_tokens of sample 'q' must be >= 0 and <= 2"):
        _coerce.token_count(-1, "q")


# ----------------------------------------------------------------------------- arrays


def test_lengths_array_private_copy_and_errors() -> None:
    arr = np.arange(1, 5, dtype=np.int64)
    out = _coerce.lengths_array(arr, "lengths")
    assert not np.shares_memory(out, arr) and out.tolist() == arr.tolist()
    assert _coerce.lengths_array([], "lengths").dtype == np.int64
    with pytest.raises(PackingDtypeError, match="lengths must be integers, got bools"):
        _coerce.lengths_array(np.array([True]), "lengths")
    with pytest.raises(PackingDtypeError, match=r"media must be 1-D, got an array of shape"):
        _coerce.lengths_array(np.zeros((1, 2), np.int64), "media")
    with pytest.raises(ItemTooLargeError, match="item 1 has media 18446744073709551615"):
        _coerce.lengths_array(np.array([1, 2**64 - 1], np.uint64), "media")
    with pytest.raises(ItemTooLargeError, match="item 0 has length 9223372036854775808"):
        _coerce.lengths_array(np.array([2**63], np.uint64), "lengths")


def test_int64_array_names_the_sample() -> None:
    arr = np.arange(3, dtype=np.int64)
    assert _coerce.int64_array(arr, "token_ids", "s") is arr
    assert _coerce.int64_array(torch.arange(3), "token_ids").tolist() == [0, 1, 2]
    with pytest.raises(IndexOverflowError, match="token_ids of sample 's' holds a value beyond"):
        _coerce.int64_array([2**63], "token_ids", "s")
    with pytest.raises(TypeError, match="token_ids of sample <unnamed> must be integers"):
        _coerce.int64_array([1.5], "token_ids")
    with pytest.raises(TypeError, match="token_ids of sample 's' is a meta tensor"):
        _coerce.int64_array(torch.ones(2, device="meta"), "token_ids", "s")


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ([1, 2], [1, 2]),
        ([], []),
        (np.array([True, False]), [1, 0]),
        (torch.tensor([3, 4]), [3, 4]),
        (np.arange(6)[::2], [0, 2, 4]),
    ],
    ids=repr,
)
def test_index_array_values(value: Any, expected: list[int]) -> None:
    out = _coerce.index_array(value, "indices")
    assert isinstance(out, np.ndarray) and out.dtype == np.int64 and out.flags.c_contiguous
    assert out.tolist() == expected


def test_index_array_returns_python_ints_beyond_int64() -> None:
    assert _coerce.index_array([2**64, 1], "_row_offsets") == [2**64, 1]
    assert _coerce.index_array(np.array([2**63], np.uint64), "indices") == [2**63]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("ab", "indices must be a sequence of int, got str"),
        (5, "indices must be a sequence of int, got int"),
        (np.zeros((2, 2), np.int64), "indices must be a flat sequence of int, got 2 dimensions"),
        ([1.5], "indices must be a sequence of int, got elements of dtype float64"),
        ([1, None], "indices must be a sequence of int, got elements of dtype object"),
        (torch.ones(2, device="meta"), "indices must hold data, got a tensor on the meta device"),
    ],
    ids=repr,
)
def test_index_array_errors(value: Any, message: str) -> None:
    with pytest.raises(TypeError, match=message):
        _coerce.index_array(value, "indices")


# ----------------------------------------------------------------------------- masks, flags


def test_mask_array_reads_bools_as_bytes_and_refuses_other_dtypes() -> None:
    assert _coerce.mask_array(np.array([True, False])).dtype == np.uint8
    assert _coerce.mask_array(np.array([1, 0], np.int16)).dtype == np.int64
    assert _coerce.mask_array(torch.tensor([1.0, 0.0], dtype=torch.bfloat16)).dtype == np.float64
    with pytest.raises(LossMaskError, match="loss mask of sample 'm' has shape"):
        _coerce.mask_array(np.ones((1, 2)), "m")
    with pytest.raises(TypeError, match="loss mask of sample 'm' has dtype <U1"):
        _coerce.mask_array(np.array(["1"]), "m")


def test_flag_array() -> None:
    assert _coerce.flag_array([1, 0, True], "trainable flags").tolist() == [True, False, True]
    assert _coerce.flag_array([], "trainable flags").dtype == np.bool_
    for bad in ([2], [0.5], ["1"]):
        with pytest.raises(LossMaskError, match="trainable flags of sample 'f' must be booleans"):
            _coerce.flag_array(bad, "trainable flags", "f")


def test_role_list() -> None:
    assert _coerce.role_list(("user", "assistant"), "train_roles") == ["user", "assistant"]
    with pytest.raises(TypeError, match="train_roles must be a sequence of role names"):
        _coerce.role_list("assistant", "train_roles")
    with pytest.raises(TypeError, match="message_roles of sample 'r' must contain strings"):
        _coerce.role_list(["user", 3], "message_roles", "r")


# ----------------------------------------------------------------------------- dims


@pytest.mark.parametrize("rank", [1, 2, 4])
def test_pack_dim_counts_negative_dims_from_the_end(rank: int) -> None:
    for dim in range(-rank, rank):
        assert _coerce.pack_dim(dim, rank) == dim % rank
    for dim in (rank, -rank - 1, 2**63):
        assert _coerce.pack_dim(dim, rank) is None
    assert _coerce.pack_dim(np.int64(-1), rank) == rank - 1


@pytest.mark.parametrize("dim", [None, "0", 1.0])
def test_pack_dim_refuses_non_integers(dim: Any) -> None:
    assert _coerce.pack_dim(dim, 3) is None


def test_pack_dim_of_a_scalar_is_none() -> None:
    assert _coerce.pack_dim(0, 0) is None
    assert _coerce.pack_dim(-1, 0) is None
