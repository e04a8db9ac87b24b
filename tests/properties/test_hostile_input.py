"""Hostile input through the public Python API, including escapes from the restricted unpickler.

Every case must end in a typed ``mmpack.errors`` exception or one of the builtin types that
NeMo-RL compatibility documents (``TypeError`` / ``ValueError`` / ``IndexError`` /
``AssertionError``), or in a correct result: never a ``PanicException`` (``conftest.py`` fails
on those), a crash, a hang, another exception type, or a silently wrong result. Inputs that are
valid but unusual (non-contiguous, read-only, big-endian, narrow dtypes) must give exactly the
result of the plain contiguous ``int64`` copy.
"""

from __future__ import annotations

import collections
import copyreg
import functools
import io
import itertools
import math
import os
import pickle
import subprocess
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mmpack
import numpy as np
import pytest
import torch
import torch._utils
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from mmpack import PackedTensor, packing
from mmpack.batch import EncodedSample, masks, pack_samples
from mmpack.compat import nemo_rl
from mmpack.compat.nemo_rl import packing as nemo_rl_packing
from mmpack.errors import MmpackError, UnsafePickleError
from mmpack.packed import payload

#: what hostile input may raise: mmpack's typed errors (all ValueError) and the builtin types
#: NeMo-RL-compatible paths document
ALLOWED = (MmpackError, TypeError, ValueError, IndexError, AssertionError)
#: what `mmpack.compat.nemo_rl.loads` may raise on a corrupt or hostile pickle
LOADS_ALLOWED = (pickle.UnpicklingError, *ALLOWED)

I64_MAX = 2**63 - 1
HUGE_INTS = [2**63, -(2**63) - 1, 2**64, -(2**64), 10**30]
JUNK = [math.nan, math.inf, -math.inf, 1.5, "3", b"3", None, object(), [1], 3 + 0j]


def outcome(fn: Callable[[], Any]) -> tuple[Any, BaseException | None]:
    """``(result, None)`` or ``(None, exc)`` for an allowed exception; anything else propagates."""
    try:
        return fn(), None
    except ALLOWED as exc:
        assert str(exc), f"{type(exc).__name__} without a message"
        return None, exc


def must_raise(fn: Callable[[], Any], allowed: tuple[type[BaseException], ...] = ALLOWED) -> None:
    try:
        result = fn()
    except allowed as exc:
        assert str(exc), f"{type(exc).__name__} without a message"
        return
    pytest.fail(f"accepted hostile input and returned {result!r}")


def _pt() -> PackedTensor:
    a = torch.arange(6.0).reshape(2, 3)
    b = torch.ones(1, 3)
    return PackedTensor(
        [a, b, None],
        0,
        _row_offsets=[0, 2, 3, 3],
        _segment_indices=[0, 1, 0],
        _segment_provenance=[b"a" * 16, b"b" * 16, b"c" * 16],
    )


def _sample(**kw: Any) -> EncodedSample:
    base: dict[str, Any] = {"token_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}
    base.update(kw)
    return EncodedSample("s0", **base)


# ------------------------------------------------------------------------------------------
# scalar arguments: every call site gets overflowing integers, out-of-domain integers and junk

# name -> (call taking the value, integers of the domain's wrong side that must raise)
SCALAR_SITES: dict[str, tuple[Callable[[Any], Any], list[int]]] = {
    "pack.capacity": (lambda v: packing.pack([1, 2], v), [0, -1]),
    "pack.max_items_per_bin": (lambda v: packing.pack([1, 2], 4, max_items_per_bin=v), [0, -1]),
    "pack.min_bins": (lambda v: packing.pack([1, 2], 4, min_bins=v), [-1, 3]),
    "pack.bins_multiple_of": (lambda v: packing.pack([1, 2], 4, bins_multiple_of=v), [0, -1]),
    "pack.media_capacity": (
        lambda v: packing.pack([1, 2], 4, media=[1, 1], media_capacity=v),
        [-1, 0],
    ),
    "pack.search_budget": (lambda v: packing.pack([1, 2], 4, search_budget=v), [-1]),
    "assign_to_ranks.num_ranks": (
        lambda v: packing.assign_to_ranks(packing.pack([1, 2, 3], 4), v),
        [0, -1],
    ),
    "get_packer.bin_capacity": (
        lambda v: nemo_rl_packing.get_packer("FIRST_FIT_DECREASING", v).pack([1, 2]),
        [0, -1],
    ),
    "get_packer.min_bin_count": (
        lambda v: nemo_rl_packing.get_packer("FIRST_FIT_DECREASING", 4, min_bin_count=v).pack(
            [1, 2]
        ),
        [-1, 3],
    ),
    "get_packer.bin_count_multiple": (
        lambda v: nemo_rl_packing.get_packer("FIRST_FIT_DECREASING", 4, bin_count_multiple=v).pack(
            [1]
        ),
        [0, -1],
    ),
    "PackedTensor.repeat_interleave": (lambda v: _pt().repeat_interleave(v), [-1]),
    "PackedTensor.shard": (lambda v: _pt().shard(v), [0, -1, 2]),
    "PackedTensor.empty_rows_like": (lambda v: PackedTensor.empty_rows_like(_pt(), v), [-1]),
    "PackedTensor.slice": (lambda v: _pt().slice([v]), [3, -4]),
    "masks.validate.num_tokens": (lambda v: masks.validate(np.ones(3, np.int8), v), [-1, 2, 4]),
    "masks.from_roles.num_tokens": (
        lambda v: masks.from_roles([2, 1], ["user", "assistant"], num_tokens=v),
        [-1, 2],
    ),
    "masks.from_fragments.num_tokens": (
        lambda v: masks.from_fragments([2, 1], [False, True], num_tokens=v),
        [-1, 4],
    ),
    "pack_samples.pad_to_multiple_of": (
        lambda v: pack_samples([_sample()], loss_mask_mode="precomputed", pad_to_multiple_of=v),
        [0, -1],
    ),
    "pack_samples.cp_size": (
        lambda v: pack_samples([_sample()], loss_mask_mode="precomputed", cp_size=v),
        [0, -1],
    ),
    "pack_samples.pad_token_id": (
        lambda v: pack_samples([_sample()], loss_mask_mode="precomputed", pad_token_id=v),
        [],
    ),
    "pack_samples.ignore_index": (
        lambda v: pack_samples([_sample()], loss_mask_mode="precomputed", ignore_index=v),
        [],
    ),
}


#: arguments whose default is None
OPTIONAL_SITES = {
    "pack.max_items_per_bin",
    "pack.min_bins",
    "pack.bins_multiple_of",
    "get_packer.min_bin_count",
    "get_packer.bin_count_multiple",
    "masks.from_roles.num_tokens",
    "masks.from_fragments.num_tokens",
}


def _stable_id(value: Any) -> str:
    """A test id that is the same in every process (a bare object's repr holds its address,
    and pytest-xdist's workers must collect the same ids)."""
    return f"{type(value).__name__}()" if type(value).__repr__ is object.__repr__ else repr(value)


@pytest.mark.parametrize("site", sorted(SCALAR_SITES))
@pytest.mark.parametrize("value", HUGE_INTS, ids=repr)
def test_overflowing_integer_arguments_raise_typed_errors(site: str, value: int) -> None:
    call, _ = SCALAR_SITES[site]
    must_raise(lambda: call(value))


@pytest.mark.parametrize("site", sorted(SCALAR_SITES))
@pytest.mark.parametrize("value", JUNK, ids=_stable_id)
def test_non_integer_arguments_raise_typed_errors(site: str, value: Any) -> None:
    call, _ = SCALAR_SITES[site]
    if value is None and site in OPTIONAL_SITES:  # None is these arguments' default
        call(value)
        return
    must_raise(lambda: call(value))


@pytest.mark.parametrize("site", sorted(SCALAR_SITES))
def test_out_of_domain_integer_arguments_raise_typed_errors(site: str) -> None:
    call, bad = SCALAR_SITES[site]
    for value in bad:
        must_raise(lambda v=value: call(v))


@pytest.mark.parametrize("site", sorted(SCALAR_SITES))
@pytest.mark.parametrize("value", [I64_MAX, 2**62, -(2**63)], ids=repr)
def test_extreme_int64_arguments_never_crash(site: str, value: int) -> None:
    """In range of int64 but absurd: a typed error or a result, never a panic or an abort."""
    call, _ = SCALAR_SITES[site]
    outcome(lambda: call(value))


# ------------------------------------------------------------------------------------------
# packing: arrays


def _check_packing(p: packing.Packing, lengths: list[int], capacity: int) -> None:
    """Every item exactly once (packed or listed as oversize), no bin over capacity."""
    items = np.asarray(p.item_indices).tolist()
    over = np.asarray(p.oversize).tolist()
    assert sorted(items + ([] if p.on_oversize == "truncate" else over)) == list(
        range(len(lengths))
    ) or sorted(items) == list(range(len(lengths)))
    offsets = np.asarray(p.bin_offsets).tolist()
    for a, b in itertools.pairwise(offsets):
        load = sum(min(lengths[i], capacity) for i in items[a:b])
        assert load <= capacity


@given(
    lengths=st.lists(st.integers(-(2**65), 2**65), max_size=20),
    capacity=st.integers(-(2**65), 2**65),
    algorithm=st.sampled_from(
        ["best_fit_decreasing", "first_fit_decreasing", "first_fit_shuffle", "concatenative"]
    ),
    on_oversize=st.sampled_from(["error", "skip", "truncate"]),
)
def test_pack_hostile_lengths(
    lengths: list[int], capacity: int, algorithm: str, on_oversize: str
) -> None:
    result, exc = outcome(
        lambda: packing.pack(lengths, capacity, algorithm=algorithm, on_oversize=on_oversize)
    )
    if exc is None:
        assert 1 <= capacity <= I64_MAX
        assert all(0 < x <= I64_MAX for x in lengths)
        _check_packing(result, lengths, capacity)


@given(
    lengths=st.lists(st.integers(1, 2**62), min_size=1, max_size=12),
    capacity=st.integers(1, I64_MAX),
)
def test_pack_near_int64_sums_do_not_overflow(lengths: list[int], capacity: int) -> None:
    """Loads that would overflow int64 when summed: a typed error or a valid packing."""
    result, exc = outcome(lambda: packing.pack(lengths, capacity, on_oversize="skip"))
    if exc is None:
        _check_packing(result, lengths, capacity)


def _variants(base: np.ndarray) -> dict[str, Any]:
    """Unusual but valid array forms of ``base`` (int64, 1-D)."""
    wide = np.repeat(base, 2)
    ro = base.copy()
    ro.flags.writeable = False
    out: dict[str, Any] = {
        "non_contiguous": wide[::2],
        "read_only": ro,
        "big_endian": base.astype(">i8"),
        "int32": base.astype(np.int32),
        "uint16": base.astype(np.uint16),
        "torch": torch.from_numpy(base.copy()),
        "torch_non_contiguous": torch.from_numpy(wide.copy())[::2],
        "list": base.tolist(),
        "tuple": tuple(base.tolist()),
        "reversed_view": base[::-1][::-1],
    }
    return out


@pytest.mark.parametrize("form", sorted(_variants(np.arange(1, 4))))
def test_pack_unusual_arrays_equal_the_plain_result(form: str) -> None:
    base = np.array([5, 3, 8, 1, 7, 2], dtype=np.int64)
    want = packing.pack(base, 10).bins()
    got = packing.pack(_variants(base)[form], 10).bins()
    assert got == want


@pytest.mark.parametrize(
    "lengths",
    [
        "abc",
        b"abc",
        None,
        5,
        {1: 2},
        [[1, 2], [3, 4]],
        np.zeros((2, 2), np.int64),
        np.array([1.0, 2.0]),
        np.array([1.0, math.nan]),
        np.array([math.inf]),
        np.array([True, False]),
        np.array(["1", "2"]),
        np.array([1, None], dtype=object),
        np.array([2**63], dtype=np.uint64),
        np.array([1 + 2j]),
        torch.ones(2),
        torch.ones(2, dtype=torch.int64, device="meta"),
        np.zeros(0, dtype=np.int64),
        [],
        np.array([0]),
        np.array([-5]),
    ],
    ids=lambda v: type(v).__name__ + ":" + repr(v)[:30],
)
def test_pack_rejects_hostile_lengths(lengths: Any) -> None:
    result, exc = outcome(lambda: packing.pack(lengths, 10))
    if exc is None:  # only an empty input may pack (into no bins)
        assert result.num_bins == 0
        assert len(np.asarray(result.item_indices)) == 0


@pytest.mark.parametrize(
    "media",
    [[1], [1, 2, 3], [-1, 1], np.array([1.5, 1.0]), "ab", [2**63, 1], np.zeros((2, 1), np.int64)],
    ids=repr,
)
def test_pack_rejects_mismatched_or_bad_media(media: Any) -> None:
    must_raise(lambda: packing.pack([1, 2], 10, media=media, media_capacity=5))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"algorithm": "nope"},
        {"algorithm": None},
        {"algorithm": 3},
        {"on_oversize": "drop"},
        {"on_oversize": None},
        {"media": [1, 1]},  # media without a media capacity
        {"media_capacity": 3},  # a media capacity without media
    ],
    ids=repr,
)
def test_pack_rejects_bad_options(kwargs: dict[str, Any]) -> None:
    result, exc = outcome(lambda: packing.pack([1, 2], 10, **kwargs))
    if exc is None:  # a media capacity without media may be ignored; nothing else may pass
        assert set(kwargs) == {"media_capacity"}
        _check_packing(result, [1, 2], 10)


@pytest.mark.parametrize("packer_arg", ["nope", None, 3, object()], ids=_stable_id)
def test_get_packer_rejects_unknown_algorithms(packer_arg: Any) -> None:
    must_raise(lambda: nemo_rl_packing.get_packer(packer_arg, 10))


@pytest.mark.parametrize(
    "seqs",
    [[-1], [11], [1.5], ["a"], [None], [2**63], [math.nan]],
    ids=repr,
)
def test_sequence_packer_rejects_bad_lengths(seqs: list[Any]) -> None:
    must_raise(lambda: nemo_rl_packing.get_packer("FIRST_FIT_DECREASING", 10).pack(seqs))


def test_assign_to_ranks_rejects_non_packings() -> None:
    for bad in (None, [1, 2], "packing", object()):
        must_raise(lambda b=bad: packing.assign_to_ranks(b, 2))
    must_raise(lambda: packing.assign_to_ranks(packing.pack([1, 2], 4), 2, cost="nope"))


# ------------------------------------------------------------------------------------------
# PackedTensor


@pytest.mark.parametrize(
    "tensors",
    [None, "abc", 5, (torch.ones(1),), {0: torch.ones(1)}, []],
    ids=repr,
)
def test_packed_tensor_rejects_bad_tensors(tensors: Any) -> None:
    must_raise(lambda: PackedTensor(tensors, 0))


@given(
    n_tensors=st.integers(0, 4),
    offsets=st.lists(st.integers(-(2**65), 2**65) | st.integers(-3, 6), max_size=6),
    indices=st.lists(st.integers(-(2**65), 2**65) | st.integers(-3, 6), max_size=6),
)
def test_packed_tensor_hostile_csr(n_tensors: int, offsets: list[int], indices: list[int]) -> None:
    tensors: list[Any] = [torch.full((1, 2), float(i)) for i in range(n_tensors)]
    pt, exc = outcome(
        lambda: PackedTensor(tensors, 0, _row_offsets=offsets, _segment_indices=indices)
    )
    if exc is not None:
        return
    # accepted: it must be exactly NeMo-RL's valid layout
    assert offsets and offsets[0] == 0 and offsets[-1] == len(indices)
    assert all(a <= b for a, b in itertools.pairwise(offsets))
    assert all(0 <= i < n_tensors for i in indices)
    assert len(pt) == len(offsets) - 1
    assert pt.logical_segment_counts_by_row() == [b - a for a, b in itertools.pairwise(offsets)]


@pytest.mark.parametrize(
    "form",
    ["non_contiguous", "read_only", "big_endian", "int32", "uint16", "torch", "tuple"],
)
def test_packed_tensor_unusual_csr_arrays_equal_the_plain_result(form: str) -> None:
    offsets = np.array([0, 2, 3, 3], dtype=np.int64)
    indices = np.array([0, 1, 0], dtype=np.int64)
    tensors = [torch.arange(6.0).reshape(2, 3), torch.ones(1, 3)]
    want = PackedTensor(tensors, 0, _row_offsets=offsets, _segment_indices=indices)
    got = PackedTensor(
        tensors, 0, _row_offsets=_variants(offsets)[form], _segment_indices=_variants(indices)[form]
    )
    assert got._row_offsets == want._row_offsets
    assert got._segment_indices == want._segment_indices
    assert torch.equal(got.as_tensor(), want.as_tensor())
    sl = np.array([2, 0, 1], dtype=np.int64)
    assert torch.equal(got.slice(_variants(sl)[form]).as_tensor(), want.slice(sl).as_tensor())


@pytest.mark.parametrize(
    "bad",
    [
        np.array([0.0, 1.0]),
        np.array([0, math.nan]),
        np.array([[0, 1]]),
        np.array(["0", "1"]),
        np.array([0, 2**64 - 1], dtype=np.uint64),
        torch.tensor([0, 1], device="meta"),
        torch.tensor([0.0, 1.0]),
        "01",
        b"\x00\x01",
        5,
    ],
    ids=lambda v: type(v).__name__ + ":" + repr(v)[:30],
)
def test_packed_tensor_rejects_bad_csr_arrays(bad: Any) -> None:
    t = [torch.ones(1, 2)]
    must_raise(lambda: PackedTensor(t, 0, _row_offsets=bad, _segment_indices=[0]))
    must_raise(lambda: PackedTensor(t, 0, _row_offsets=[0, 1], _segment_indices=bad))


@pytest.mark.parametrize(
    "provenance",
    ["abcd", b"a" * 16, [b"a" * 15], [b"a" * 17], [None], [1], [b"a" * 16, b"b" * 16], 7],
    ids=repr,
)
def test_packed_tensor_rejects_bad_provenance(provenance: Any) -> None:
    t = [torch.ones(1, 2)]
    must_raise(
        lambda: PackedTensor(
            t, 0, _row_offsets=[0, 1], _segment_indices=[0], _segment_provenance=provenance
        )
    )


@given(rows=st.lists(st.integers(-(2**65), 2**65) | st.integers(-5, 5), max_size=8))
def test_slice_hostile_rows(rows: list[int]) -> None:
    pt = _pt()  # 3 rows
    got, exc = outcome(lambda: pt.slice(rows))
    if exc is not None:
        assert isinstance(exc, (IndexError, MmpackError, TypeError)), exc
        assert any(not -3 <= r < 3 for r in rows)
        return
    assert all(-3 <= r < 3 for r in rows)
    want = [pt.slice([r % 3]).as_tensor() for r in rows]
    want_t = [w for w in want if w is not None]
    result = got.as_tensor()
    if want_t:
        assert torch.equal(result, torch.cat(want_t))
    else:
        assert result is None


@pytest.mark.parametrize(
    "rows",
    [
        np.array([0.0]),
        np.array([[0]]),
        torch.tensor([0], device="meta"),
        "0",
        None,
        5,
        [None],
    ],
    ids=lambda v: type(v).__name__ + ":" + repr(v)[:30],
)
def test_slice_rejects_bad_row_selections(rows: Any) -> None:
    must_raise(lambda: _pt().slice(rows))


@pytest.mark.parametrize(
    "values",
    [[], None, "x", [None], [1, 2], [_pt(), None], [_pt(), "x"], _pt()],
    ids=lambda v: repr(v)[:40],
)
@pytest.mark.parametrize("op", ["concat", "merge_segments", "flattened_concat"])
def test_concat_rejects_bad_inputs(values: Any, op: str) -> None:
    _, exc = outcome(lambda: getattr(PackedTensor, op)(values))
    if exc is None:  # only an empty list may give a (empty) value
        assert values == []


def test_concat_rejects_mismatched_dim_to_pack() -> None:
    a = PackedTensor([torch.ones(1, 2)], 0)
    b = PackedTensor([torch.ones(1, 2)], 1)
    must_raise(lambda: PackedTensor.concat([a, b]))


def test_tensors_on_different_devices_raise_typed_errors() -> None:
    """A value whose segments live on ``cpu`` and ``meta``: materializing it is a typed error."""
    mixed = PackedTensor([torch.ones(1, 2), torch.ones(1, 2, device="meta")], 0)
    must_raise(mixed.as_tensor)
    cpu = PackedTensor([torch.ones(1, 2)], 0)
    meta = PackedTensor([torch.ones(1, 2, device="meta")], 0)
    joined, exc = outcome(lambda: PackedTensor.concat([cpu, meta]))
    if exc is None:
        assert len(joined) == 2
        must_raise(joined.as_tensor)


@pytest.mark.parametrize("pad", [False, True])
def test_segments_of_mismatched_shapes_raise_typed_errors(pad: bool) -> None:
    """Segments that cannot be concatenated along ``dim_to_pack`` (other dims differ, or the
    ranks differ): a typed error, not torch's ``RuntimeError`` from ``torch.cat``."""
    for tensors in (
        [torch.ones(1, 2), torch.ones(1, 3)],
        [torch.ones(1, 2), torch.ones(2)],
        [torch.ones(1, 2), torch.ones(1, 2, dtype=torch.int64)],
    ):
        value = PackedTensor(tensors, 0, pad_to_max_shape=pad)
        result, exc = outcome(value.as_tensor)
        if exc is None:  # only padding or type promotion may make it fit
            assert result is not None and result.shape[0] == 2


def test_meta_tensors_keep_their_layout() -> None:
    """Row mapping operations never touch tensor data, so meta segments are fine there."""
    pt = PackedTensor(
        [torch.ones(2, 3, device="meta"), torch.ones(1, 3, device="meta")],
        0,
        _row_offsets=[0, 1, 3],
        _segment_indices=[0, 1, 0],
    )
    rep = pt.repeat_interleave(3)
    assert len(rep) == 6
    assert rep.logical_segment_counts_by_row() == [1, 1, 1, 2, 2, 2]
    assert [len(s) for s in rep.shard(3)] == [2, 2, 2]
    out = pt.as_tensor()
    assert out is not None and out.device.type == "meta" and tuple(out.shape) == (5, 3)


@pytest.mark.parametrize("dim", [5, -5, 2**63, None, "0", 1.0])
def test_bad_dim_to_pack_raises_on_use(dim: Any) -> None:
    pt = PackedTensor([torch.ones(1, 2), torch.ones(1, 2)], dim)
    must_raise(pt.as_tensor)


def test_zero_length_segments_and_empty_rows() -> None:
    pt = PackedTensor(
        [torch.ones(0, 3), torch.ones(2, 3)], 0, _row_offsets=[0, 0, 2, 2], _segment_indices=[0, 1]
    )
    out = pt.as_tensor()
    assert out is not None and tuple(out.shape) == (2, 3)
    assert pt.logical_segment_counts_by_row() == [0, 2, 0]
    assert len(pt.repeat_interleave(0)) == 0
    empty = PackedTensor.empty_rows_like(pt, 0)
    assert len(empty) == 0
    assert empty.as_tensor() is None


# ------------------------------------------------------------------------------------------
# masks


_mask_arrays = hnp.arrays(
    dtype=st.sampled_from(
        [
            np.bool_,
            np.int8,
            np.uint8,
            np.int32,
            np.int64,
            np.uint64,
            np.float16,
            np.float32,
            np.float64,
        ]
    ),
    shape=hnp.array_shapes(min_dims=0, max_dims=2, min_side=0, max_side=6),
)


@given(mask=_mask_arrays, num_tokens=st.integers(-(2**65), 2**65) | st.integers(0, 8))
def test_validate_hostile_masks(mask: np.ndarray, num_tokens: int) -> None:
    _, exc = outcome(lambda: masks.validate(mask, num_tokens))
    ok = mask.ndim == 1 and mask.size == num_tokens and bool(np.isin(mask, (0, 1)).all())
    assert (exc is None) == ok, (mask, num_tokens, exc)


@pytest.mark.parametrize(
    "form", ["non_contiguous", "read_only", "big_endian", "int32", "uint16", "torch", "list"]
)
def test_validate_unusual_arrays_equal_the_plain_result(form: str) -> None:
    good = np.array([0, 1, 1, 0], dtype=np.int64)
    bad = np.array([0, 1, 2, 0], dtype=np.int64)
    masks.validate(_variants(good)[form], 4)
    must_raise(lambda: masks.validate(_variants(bad)[form], 4))


@pytest.mark.parametrize(
    "mask",
    [
        None,
        "0101",
        b"\x00\x01",
        [0, None],
        ["0", "1"],
        np.array([0, math.nan, 1]),
        np.array([0, math.inf, 1]),
        np.array([1 + 0j, 0, 1]),
        np.array([0, 1, 1], dtype=object),
        torch.tensor([0, 1, 1], device="meta"),
    ],
    ids=lambda v: type(v).__name__ + ":" + repr(v)[:30],
)
def test_validate_rejects_hostile_masks(mask: Any) -> None:
    must_raise(lambda: masks.validate(mask, 3))


@given(
    lengths=st.lists(st.integers(-(2**65), 2**65) | st.integers(-2, 5), max_size=5),
    roles=st.lists(st.sampled_from(["user", "assistant", "system", ""]), max_size=5),
    num_tokens=st.none() | st.integers(-(2**65), 2**65) | st.integers(0, 10),
)
def test_from_roles_hostile(lengths: list[int], roles: list[str], num_tokens: int | None) -> None:
    mask, exc = outcome(lambda: masks.from_roles(lengths, roles, num_tokens=num_tokens))
    if exc is not None:
        return
    assert len(lengths) == len(roles) and all(0 <= x <= I64_MAX for x in lengths)
    want = [r == "assistant" for r, n in zip(roles, lengths, strict=True) for _ in range(n)]
    assert np.asarray(mask).astype(bool).tolist() == want
    if num_tokens is not None:
        assert num_tokens == sum(lengths)


@given(
    lengths=st.lists(st.integers(-(2**65), 2**65) | st.integers(-2, 5), max_size=5),
    flags=st.lists(st.integers(-1, 2), max_size=5),
)
def test_from_fragments_hostile(lengths: list[int], flags: list[int]) -> None:
    mask, exc = outcome(lambda: masks.from_fragments(lengths, flags))
    if exc is not None:
        return
    assert len(lengths) == len(flags) and all(f in (0, 1) for f in flags)
    want = [bool(f) for f, n in zip(flags, lengths, strict=True) for _ in range(n)]
    assert np.asarray(mask).astype(bool).tolist() == want


@given(
    tokens=st.lists(st.integers(-(2**65), 2**65) | st.integers(0, 4), max_size=12),
    markers=st.lists(st.integers(-(2**65), 2**65) | st.integers(0, 4), max_size=3),
)
def test_turn_spans_hostile(tokens: list[int], markers: list[int]) -> None:
    spans, exc = outcome(lambda: masks.turn_spans(tokens, markers))
    if exc is not None:
        return
    positions = [i for i, t in enumerate(tokens) if t in set(markers)]
    assert len(positions) % 2 == 0 and positions
    arr = np.asarray(spans)
    assert arr.shape == (len(positions) // 2, 4)
    assert arr[:, 0].tolist() == positions[0::2]
    assert arr[:, 2].tolist() == positions[1::2]


# ------------------------------------------------------------------------------------------
# batch


@given(
    tokens=st.lists(st.integers(-(2**65), 2**65) | st.integers(0, 50), max_size=8),
    mask=st.lists(st.integers(-1, 2), max_size=8),
)
def test_pack_samples_hostile_precomputed(tokens: list[int], mask: list[int]) -> None:
    out, exc = outcome(
        lambda: pack_samples(
            [EncodedSample("s", tokens, loss_mask=mask)], loss_mask_mode="precomputed"
        )
    )
    if exc is not None:
        return
    assert tokens and len(tokens) == len(mask)
    assert all(0 <= t <= I64_MAX for t in tokens) and all(m in (0, 1) for m in mask)
    assert out.input_ids.tolist() == tokens


@pytest.mark.parametrize(
    "samples",
    [
        [],
        None,
        "abc",
        [None],
        [1],
        [{"token_ids": [1]}],
        [EncodedSample("s", None, loss_mask=[1])],
        [EncodedSample("s", [], loss_mask=[])],
        [EncodedSample("s", [1, 2], loss_mask=[1])],
        [EncodedSample("s", [1, 2], loss_mask=None)],
        [EncodedSample("s", [[1, 2]], loss_mask=[[1, 1]])],
        [EncodedSample("s", np.array([1.0, 2.0]), loss_mask=[1, 1])],
        [EncodedSample("s", torch.tensor([1, 2], device="meta"), loss_mask=[1, 1])],
        [EncodedSample("s", [1, 2], loss_mask=torch.tensor([1, 1], device="meta"))],
        [EncodedSample("s", [1, 2], loss_mask=[1, 1], media={"pixel_values": "x"})],  # type: ignore[dict-item]
    ],
    ids=lambda v: repr(v)[:60],
)
def test_pack_samples_rejects_hostile_samples(samples: Any) -> None:
    must_raise(lambda: pack_samples(samples, loss_mask_mode="precomputed"))


@pytest.mark.parametrize(
    "fields",
    [
        {"message_lengths": [1], "message_roles": ["user", "assistant"]},
        {"message_lengths": [1, 1], "message_roles": "ua"},
        {"message_lengths": [1, 5], "message_roles": ["user", "assistant"]},
        {"message_lengths": [-1, 3], "message_roles": ["user", "assistant"]},
        {"message_lengths": [2**64, 1], "message_roles": ["user", "assistant"]},
        {"message_lengths": [1.0, 1.0], "message_roles": ["user", "assistant"]},
        {"message_lengths": [1, 1], "message_roles": [1, 2]},
        {"message_lengths": None, "message_roles": ["user"]},
        {"message_lengths": "12", "message_roles": ["user", "assistant"]},
    ],
    ids=repr,
)
def test_pack_samples_rejects_bad_message_fields(fields: dict[str, Any]) -> None:
    s = EncodedSample("s", [1, 2], **fields)
    must_raise(lambda: pack_samples([s]))


def test_pack_samples_unusual_token_arrays_equal_the_plain_result() -> None:
    base = np.array([4, 5, 6, 7], dtype=np.int64)
    want = pack_samples(
        [_sample(token_ids=base, loss_mask=[0, 1, 1, 1])], loss_mask_mode="precomputed"
    )
    for form, arr in _variants(base).items():
        got = pack_samples(
            [_sample(token_ids=arr, loss_mask=[0, 1, 1, 1])], loss_mask_mode="precomputed"
        )
        assert got.input_ids.tolist() == want.input_ids.tolist(), form
        assert got.loss_mask.tolist() == want.loss_mask.tolist(), form


# ------------------------------------------------------------------------------------------
# payload


def test_payload_walks_hostile_structures() -> None:
    cyclic: list[Any] = [_pt()]
    cyclic.append(cyclic)
    d: dict[str, Any] = {"pixel_values": _pt()}
    d["self"] = d
    for obj in (None, 5, "x", object(), cyclic, d, {1: {2: {3: [_pt(), (_pt(),)]}}}):
        stats, exc = outcome(lambda o=obj: payload.measure(o))
        if exc is None:
            assert stats.physical_bytes >= 0 and stats.logical_bytes >= 0
        moved, exc = outcome(lambda o=obj: payload.prepare_for_transfer(o))
        if exc is None and isinstance(obj, dict) and "pixel_values" in obj:
            assert moved["pixel_values"].tensors[0].dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, "bfloat16", None, 3], ids=repr)
def test_prepare_for_transfer_rejects_non_float_dtypes(dtype: Any) -> None:
    must_raise(lambda: payload.prepare_for_transfer({"pixel_values": _pt()}, dtype=dtype))


def test_prepare_for_transfer_rejects_bad_keys() -> None:
    result, exc = outcome(lambda: payload.prepare_for_transfer({"pixel_values": _pt()}, keys=5))  # type: ignore[arg-type]
    assert exc is not None, result


# ------------------------------------------------------------------------------------------
# corrupted and truncated pickles


def _pickles() -> dict[str, bytes]:
    pt = _pt()
    legacy = PackedTensor([torch.arange(4.0), torch.zeros(2, dtype=torch.int64)], 0)
    rep = pt.repeat_interleave(2)
    value = {"x": pt, "y": [legacy, rep], "z": (pt,)}
    out = {f"protocol{p}": pickle.dumps(value, protocol=p) for p in (2, 4, 5)}
    buf = io.BytesIO()
    torch.save(value, buf)
    out["torch_save"] = buf.getvalue()
    return out


PICKLES = _pickles()


def _exercise(value: Any) -> None:
    """Use a value a corrupt pickle produced: every operation a typed error or a result."""
    todo = [value]
    seen = 0
    while todo and seen < 50:
        v = todo.pop()
        seen += 1
        if isinstance(v, dict):
            todo.extend(v.values())
        elif isinstance(v, (list, tuple)):
            todo.extend(v)
        elif isinstance(v, PackedTensor):
            outcome(lambda v=v: len(v))
            outcome(lambda v=v: v.logical_segment_counts_by_row())
            outcome(lambda v=v: v.as_tensor())
            outcome(lambda v=v: v.slice([0]))
            outcome(lambda v=v: PackedTensor.concat([v, v]))
            outcome(lambda v=v: pickle.loads(pickle.dumps(v)))


def _kinds(bad: list[str]) -> dict[str, int]:
    """How many of each exception type (``"<what>: <Type>: <message>"`` lines)."""
    return dict(collections.Counter(line.split(": ")[1] for line in bad))


def _exercise_into(value: Any, what: str, bad: list[str]) -> None:
    try:
        _exercise(value)
    except Exception as exc:
        bad.append(f"{what}, then using the value: {type(exc).__name__}: {str(exc)[:80]}")


def _mutations(data: bytes, positions: int = 150) -> list[tuple[str, bytes]]:
    step = max(1, len(data) // positions)
    out = []
    for i in range(0, len(data), step):
        out.append((f"truncate@{i}", data[:i]))
        out.append((f"flip@{i}", data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1 :]))
        out.append((f"bit@{i}", data[:i] + bytes([data[i] ^ 0x01]) + data[i + 1 :]))
    return out


#: The installed package's own directory: a frame is mmpack's when its file lies inside it (not
#: when its path merely contains "mmpack", which every frame does in a checkout named so).
PACKAGE_DIR = Path(mmpack.__file__).resolve().parent


def _in_mmpack(exc: BaseException) -> bool:
    tb = exc.__traceback__
    while tb is not None:
        if _is_package_file(tb.tb_frame.f_code.co_filename):
            return True
        tb = tb.tb_next
    return False


@functools.cache
def _is_package_file(filename: str) -> bool:
    return Path(filename).resolve().is_relative_to(PACKAGE_DIR)


def test_frames_are_judged_by_the_package_directory(tmp_path: Path) -> None:
    """A test file, even in a folder named ``mmpack``, is not inside the package."""
    assert _is_package_file(str(PACKAGE_DIR / "packed.py"))
    assert not _is_package_file(__file__)
    assert not _is_package_file(str(tmp_path / "mmpack" / "tests" / "test_x.py"))
    with pytest.raises(MmpackError) as inside:
        PackedTensor([torch.ones(1)], 0, _row_offsets=[0, 2], _segment_indices=[0])
    assert _in_mmpack(inside.value)
    with pytest.raises(ValueError, match="raised here") as outside:
        raise ValueError("raised here")
    assert not _in_mmpack(outside.value)


@pytest.mark.parametrize("name", sorted(PICKLES))
def test_corrupt_pickles_through_nemo_rl_loads(name: str) -> None:
    """``compat.nemo_rl.loads`` is the path for untrusted-ish pickles: every corruption is an
    ``UnpicklingError`` (``UnsafePickleError`` included) or a typed mmpack error."""
    bad = []
    for what, data in _mutations(PICKLES[name]):
        try:
            value = nemo_rl.loads(data)
        except LOADS_ALLOWED:
            continue
        except Exception as exc:
            bad.append(f"{what}: {type(exc).__name__}: {str(exc)[:80]}")
            continue
        _exercise_into(value, what, bad)
    assert not bad, f"{len(bad)} corruptions escaped as untyped errors {_kinds(bad)}: " + "; ".join(
        bad[:8]
    )


@pytest.mark.parametrize("name", ["protocol2", "protocol4", "protocol5"])
def test_corrupt_mmpack_pickles_through_plain_pickle(name: str) -> None:
    """Plain ``pickle.loads`` of a corrupt mmpack pickle: what the pickle machine itself raises
    is Python's business, but an error raised inside mmpack's restore code must be typed."""
    bad = []
    for what, data in _mutations(PICKLES[name]):
        try:
            value = pickle.loads(data)
        except ALLOWED:
            continue
        except Exception as exc:
            if _in_mmpack(exc):
                bad.append(f"{what}: {type(exc).__name__}: {str(exc)[:80]}")
            continue
        _exercise_into(value, what, bad)
    assert not bad, f"{len(bad)} corruptions raised untyped errors in mmpack {_kinds(bad)}: " + (
        "; ".join(bad[:8])
    )


@given(st.binary(max_size=200))
def test_random_bytes_through_nemo_rl_loads(data: bytes) -> None:
    try:
        nemo_rl.loads(data)
    except LOADS_ALLOWED:
        pass


@pytest.mark.parametrize("data", [None, "text", 5, [1, 2]], ids=repr)
def test_nemo_rl_loads_rejects_non_bytes(data: Any) -> None:
    must_raise(lambda: nemo_rl.loads(data), (TypeError, *LOADS_ALLOWED))


# ------------------------------------------------------------------------------------------
# escape attempts through the restricted unpickler


class _Reduce:
    """Pickles as ``func(*args)``."""

    def __init__(self, func: Any, args: tuple[Any, ...]) -> None:
        self.func = func
        self.args = args

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.func, self.args)


def _marker_cmd(marker: Path) -> str:
    return f"touch {marker}"


def _escapes(marker: Path) -> dict[str, Any]:
    cmd = _marker_cmd(marker)
    return {
        "os.system": _Reduce(os.system, (cmd,)),
        "builtins.eval": _Reduce(eval, (f"__import__('os').system({cmd!r})",)),
        "builtins.exec": _Reduce(exec, (f"import os; os.system({cmd!r})",)),
        "builtins.getattr": _Reduce(getattr, (object, "__subclasses__")),
        "subprocess.Popen": _Reduce(subprocess.Popen, (["touch", str(marker)],)),
        "functools.partial": _Reduce(functools.partial(os.system, cmd), ()),
        "copyreg._reconstructor(os)": _Reduce(copyreg._reconstructor, (os.PathLike, object, None)),  # type: ignore[attr-defined]
        "torch.load": _Reduce(torch.load, (str(marker),)),
        "nested in a PackedTensor": _Reduce(
            PackedTensor, ([torch.ones(1)], _Reduce(os.system, (cmd,)))
        ),
        "in a list in a dict": {"a": [1, _Reduce(os.system, (cmd,))]},
    }


@pytest.mark.parametrize("protocol", [0, 2, 5])
def test_escape_attempts_are_refused_without_running_anything(
    tmp_path: Path, protocol: int
) -> None:
    marker = tmp_path / "pwned"
    for name, obj in _escapes(marker).items():
        data = pickle.dumps(obj, protocol=protocol)
        with pytest.raises(UnsafePickleError):
            nemo_rl.loads(data)
        assert not marker.exists(), f"{name} executed"


def test_torch_load_reentry_through_load_from_bytes_is_restricted(tmp_path: Path) -> None:
    """``torch.storage._load_from_bytes`` is admitted, but reads its bytes with the restricted
    loader itself: an ``os.system`` payload inside is refused, nothing runs."""
    import torch.storage

    marker = tmp_path / "pwned"
    inner = pickle.dumps(_Reduce(os.system, (_marker_cmd(marker),)), protocol=2)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("archive/data.pkl", inner)
        z.writestr("archive/byteorder", "little")
    for payload_bytes in (inner, buf.getvalue()):
        data = pickle.dumps(_Reduce(torch.storage._load_from_bytes, (payload_bytes,)), protocol=2)
        with pytest.raises(pickle.UnpicklingError):
            nemo_rl.loads(data)
        assert not marker.exists()
    # a torch.save archive whose data.pkl tries the same
    with pytest.raises(UnsafePickleError):
        nemo_rl.loads(buf.getvalue())
    assert not marker.exists()


def test_reconstructor_with_admitted_bases_cannot_build_foreign_objects() -> None:
    for base in (set, frozenset, bytearray, complex, collections.OrderedDict):
        data = pickle.dumps(_Reduce(copyreg._reconstructor, (PackedTensor, base, [1])), protocol=2)  # type: ignore[attr-defined]
        try:
            value = nemo_rl.loads(data)
        except (*LOADS_ALLOWED, TypeError, ValueError):
            continue
        assert isinstance(value, PackedTensor)
        _exercise(value)


@pytest.mark.parametrize(
    "state",
    [
        {"__mmpack_packed_tensor__": 1, "segments": "garbage", "layout": None},
        {"__mmpack_packed_tensor__": 1, "group": ("mmpack.group/1", b"\x01", b"", b"", [])},
        {"__mmpack_packed_tensor__": 1, "group": ("mmpack.group/1", b"", b"", b"", [("os", b"")])},
        {"tensors": "abc", "_row_offsets": [0, 5], "_segment_indices": [0]},
        {"tensors": [torch.ones(1)], "_row_offsets": [0, 2**70], "_segment_indices": [0]},
    ],
    ids=repr,
)
def test_forged_packed_tensor_states_raise_typed_errors(state: dict[str, Any]) -> None:
    obj = _Reduce(copyreg._reconstructor, (PackedTensor, object, None))  # type: ignore[attr-defined]

    class Forged:
        def __reduce__(self) -> tuple[Any, ...]:
            return (copyreg._reconstructor, (PackedTensor, object, None), state)  # type: ignore[attr-defined]

    assert obj.args[0] is PackedTensor
    data = pickle.dumps(Forged(), protocol=2)
    try:
        value = nemo_rl.loads(data)
    except (*LOADS_ALLOWED, *ALLOWED):
        return
    _exercise(value)


def _rebuild_pickle(size: tuple[int, ...], stride: tuple[int, ...], offset: int) -> bytes:
    """A ``torch.save``-style archive whose tensor claims ``size``/``stride``/``offset`` over a
    16-byte storage."""

    class Storage:
        pass

    sentinel = Storage()

    class P(pickle.Pickler):
        def persistent_id(self, obj: Any) -> Any:
            if obj is sentinel:
                return ("storage", torch.FloatStorage, "0", "cpu", 4)
            return None

    body = io.BytesIO()
    P(body, protocol=2).dump(
        _Reduce(
            torch._utils._rebuild_tensor_v2,
            (sentinel, offset, size, stride, False, collections.OrderedDict()),
        )
    )
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        z.writestr("archive/data.pkl", body.getvalue())
        z.writestr("archive/byteorder", "little")
        z.writestr("archive/data/0", bytes(16))
    return out.getvalue()


def test_rebuild_tensor_with_a_fitting_size_loads() -> None:
    t = nemo_rl.loads(_rebuild_pickle((4,), (1,), 0))
    assert t.tolist() == [0.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize(
    ("size", "stride", "offset"),
    [
        ((2**40,), (1,), 0),  # a 4 TiB tensor over 16 bytes
        ((2**24,), (1,), 0),  # 64 MiB over 16 bytes: the storage would be grown (heap garbage)
        ((5,), (1,), 0),  # one element past the end
        ((4,), (1,), 2**62),
        ((2**62, 4), (4, 1), 0),
        ((4,), (-1,), 0),
        ((-4,), (1,), 0),
        ((4,), (2**62,), 0),
        ((2,), (1,), -1),
    ],
    ids=repr,
)
def test_rebuild_tensor_with_absurd_sizes_is_refused(
    size: tuple[int, ...], stride: tuple[int, ...], offset: int
) -> None:
    """A tensor record larger than its storage must be refused, not grow the storage (which
    allocates and exposes uninitialized memory) and not escape as a torch ``RuntimeError``."""
    with pytest.raises(LOADS_ALLOWED):
        nemo_rl.loads(_rebuild_pickle(size, stride, offset))
