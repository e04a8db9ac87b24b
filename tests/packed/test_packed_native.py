"""Unit tests of mmpack's own PackedTensor: the extras beyond NeMo-RL (``repeat_interleave``,
``shard``, ``csr``, byte counts), the compact pickle format, deepcopy sharing, provenance
minting, constructor validation (exception types and messages) and bad input that must raise a
typed error instead of panicking. NeMo-RL's behaviour itself is pinned by
``test_packed_spec.py`` and ``test_packed_properties.py``."""

from __future__ import annotations

import copy
import io
import os
import pickle
import uuid
import warnings
from types import SimpleNamespace
from typing import Any

import cloudpickle
import numpy as np
import pytest
import torch
from mmpack import PackedTensor as P
from mmpack.errors import (
    IndexOverflowError,
    LayoutError,
    MmpackError,
    ProvenanceError,
    ShardError,
)


def t(*values: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.tensor([list(values)], dtype=dtype)


def logical(p: P) -> list[Any]:
    return list(p.iter_logical_segments())


def dedup(*items: Any) -> P:
    return P(list(items), 0).enable_deduplication()


# ------------------------------------------------------------------------- repeat_interleave


def test_repeat_interleave_legacy_shares_segments_and_mints_provenance() -> None:
    a, b = t(1), t(2)
    src = P([a, None, b], 0)
    rep = src.repeat_interleave(3)
    assert len(rep) == 9 and rep.deduplication_enabled
    assert rep.logical_segment_counts_by_row() == [1, 1, 1, 0, 0, 0, 1, 1, 1]
    assert [x is y for x, y in zip(logical(rep), [a] * 3 + [None] * 3 + [b] * 3, strict=True)] == [
        True
    ] * 9
    assert rep.tensors[0] is a and rep.tensors[2] is b and len(rep.tensors) == 3
    prov = rep._segment_provenance
    assert prov is not None and len(set(prov)) == 3
    # The source is not mutated.
    assert not src.deduplication_enabled and src._row_offsets is None
    assert torch.equal(rep.as_tensor(), torch.cat([a, a, a, b, b, b]))


def test_repeat_interleave_keeps_provenance_and_compacts() -> None:
    a, b, unused = t(1), t(2), t(3)
    src = P(
        [unused, b, a],
        0,
        _row_offsets=[0, 2, 3],
        _segment_indices=[2, 1, 2],
        _segment_provenance=[bytes([9]) * 16, bytes([2]) * 16, bytes([1]) * 16],
    )
    rep = src.repeat_interleave(2)
    assert rep.tensors == [a, b]  # referenced only, first-reference order
    assert rep._segment_provenance == [bytes([1]) * 16, bytes([2]) * 16]
    assert rep._row_offsets == [0, 2, 4, 5, 6]
    assert rep._segment_indices == [0, 1, 0, 1, 0, 0]


def test_repeat_interleave_merges_duplicate_provenance() -> None:
    x, y = t(1), t(1)
    same = bytes([7]) * 16
    src = P(
        [x, y], 0, _row_offsets=[0, 1, 2], _segment_indices=[0, 1], _segment_provenance=[same, same]
    )
    rep = src.repeat_interleave(1)
    assert rep.tensors == [x] and rep._segment_indices == [0, 0]


def test_repeat_interleave_zero_and_bad_counts() -> None:
    src = dedup(t(1), t(2))
    empty = src.repeat_interleave(0)
    assert len(empty) == 0 and empty.deduplication_enabled and empty.tensors == []
    assert empty.as_tensor() is None
    with pytest.raises(LayoutError, match="repeats must be a non-negative integer, got -1"):
        src.repeat_interleave(-1)
    with pytest.raises(TypeError, match="repeats must be an int"):
        src.repeat_interleave(True)
    with pytest.raises(TypeError, match="repeats must be an int"):
        src.repeat_interleave(2.0)  # type: ignore[arg-type]
    assert len(src.repeat_interleave(np.int64(2))) == 4  # type: ignore[arg-type]


def test_repeat_interleave_huge_count_is_a_typed_error() -> None:
    src = dedup(t(1))
    with pytest.raises(IndexOverflowError):
        src.repeat_interleave(2**62)
    with pytest.raises(IndexOverflowError):
        dedup(t(1), t(2), t(3)).repeat_interleave(2**62)
    with pytest.raises((OverflowError, MmpackError)):
        src.repeat_interleave(2**70)


def test_repeat_then_concat_matches_deepcopy_expansion() -> None:
    seeds = [dedup(t(1)), P.merge_segments([dedup(t(2)), dedup(t(3))])]
    batch = P.concat(seeds)
    fast = batch.repeat_interleave(4)
    slow = P.concat([copy.deepcopy(s) for s in seeds for _ in range(4)])
    assert fast._row_offsets == slow._row_offsets
    assert fast._segment_indices == slow._segment_indices
    assert fast._segment_provenance == slow._segment_provenance
    assert [x is y for x, y in zip(fast.tensors, slow.tensors, strict=True)] == [True] * 3


# ------------------------------------------------------------------------------------ shard


def test_shard_contiguous_compacted() -> None:
    a, b, c = t(1), t(2), t(3)
    v = P.concat([dedup(a), dedup(b), dedup(c)]).repeat_interleave(2)  # a a b b c c
    shards = v.shard(3)
    assert [len(s) for s in shards] == [2, 2, 2]
    assert [s.tensors for s in shards] == [[a], [b], [c]]
    prov = v._segment_provenance
    assert prov is not None
    assert [s._segment_provenance for s in shards] == [[prov[0]], [prov[1]], [prov[2]]]
    assert all(s._segment_indices == [0, 0] for s in shards)
    two = v.shard(2)
    assert [s.tensors for s in two] == [[a, b], [b, c]]
    assert [s._segment_indices for s in two] == [[0, 0, 1], [0, 1, 1]]
    assert torch.equal(torch.cat([s.as_tensor() for s in two]), v.as_tensor())


def test_shard_not_divisible_names_rows_and_shards() -> None:
    v = dedup(*[t(i) for i in range(7)])
    with pytest.raises(ShardError, match=r"7 rows into 3 equal shards") as info:
        v.shard(3)
    assert isinstance(info.value, ValueError)
    with pytest.raises(ShardError, match=r"7 rows into 2 equal shards"):
        P([t(i) for i in range(7)], 0).shard(2)  # legacy path, same message
    for bad in (0, -2):
        with pytest.raises(ShardError, match="num_shards must be a positive integer"):
            v.shard(bad)
        with pytest.raises(ShardError, match="num_shards must be a positive integer"):
            P([t(1)], 0).shard(bad)
    with pytest.raises(TypeError):
        v.shard(1.5)  # type: ignore[arg-type]


def test_shard_legacy_stays_legacy_and_empty_values() -> None:
    a, b = t(1), t(2)
    shards = P([a, None, b, None], 0).shard(2)
    assert [s.tensors for s in shards] == [[a, None], [b, None]]
    assert all(s._row_offsets is None and not s.deduplication_enabled for s in shards)
    empty = P.empty_rows_like(dedup(a), 0)
    parts = empty.shard(4)
    assert [len(p) for p in parts] == [0, 0, 0, 0]
    assert all(p.deduplication_enabled for p in parts)


# -------------------------------------------------------------------------------------- csr


def test_csr_arrays_are_read_only_int64() -> None:
    legacy = P([t(1), None], 0)
    off, idx = legacy.csr()
    assert off.tolist() == [0, 1, 2] and idx.tolist() == [0, 1]
    v = P.concat([dedup(t(1)), dedup(t(2))]).repeat_interleave(2)
    off, idx = v.csr()
    assert off.dtype == np.int64 and idx.dtype == np.int64
    assert off.tolist() == v._row_offsets and idx.tolist() == v._segment_indices
    for arr in (off, idx):
        assert not arr.flags.writeable
        with pytest.raises(ValueError):
            arr[0] = 5
    assert v.csr()[0].tolist() == [0, 1, 2, 3, 4]  # a fresh copy each call
    ld = dedup(t(1), t(2), t(3))
    assert ld.csr()[1].tolist() == [0, 1, 2]


# ----------------------------------------------------------------------------------- nbytes


def test_physical_and_logical_nbytes() -> None:
    a = torch.zeros(2, 3)  # 24 bytes
    b = torch.zeros(1, 3, dtype=torch.float64)  # 24 bytes
    v = P.concat([dedup(a), dedup(b), P.empty_rows_like(dedup(a), 1)]).repeat_interleave(3)
    assert v.physical_nbytes() == 48
    assert v.logical_nbytes() == 3 * 48
    legacy = P([a, None, b], 0)
    assert legacy.physical_nbytes() == legacy.logical_nbytes() == 48
    # Unreferenced physical segments count physically, never logically.
    sliced_src = P([a, b], 0, _row_offsets=[0, 1], _segment_indices=[1])
    assert sliced_src.physical_nbytes() == 48 and sliced_src.logical_nbytes() == 24


def test_logical_nbytes_counts_padding() -> None:
    small = torch.ones(1, 2, 2)
    wide = torch.ones(1, 4, 1)
    v = P.concat([dedup(small), dedup(wide)])
    v.pad_to_max_shape = True
    out = v.as_tensor()
    assert out is not None and out.shape == (2, 4, 2)
    assert v.logical_nbytes() == out.numel() * out.element_size()
    rep = v.repeat_interleave(3)
    out = rep.as_tensor()
    assert out is not None and rep.logical_nbytes() == out.numel() * out.element_size()
    # Padding impossible (mixed ranks): as_tensor raises, the byte count stays unpadded.
    bad = P([torch.ones(1, 2), torch.ones(1, 2, 2)], 0, pad_to_max_shape=True)
    with pytest.raises(ValueError, match="same rank"):
        bad.as_tensor()
    assert bad.logical_nbytes() == 8 + 16


# ----------------------------------------------------------------------------------- pickle


def _quiet_loads(data: bytes, **kw: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return pickle.loads(data, **kw)


def _big_value() -> tuple[P, dict[str, Any]]:
    base = torch.arange(100.0).reshape(10, 10)
    parts: dict[str, Any] = {
        "a": torch.randn(2, 3),
        "bf16": torch.randn(3, 2).to(torch.bfloat16),
        "int": torch.tensor([[1, 2], [3, 4]]),
        "tr": torch.tensor([[1.0, 2.0], [3.0, 4.0]]).t(),  # non-contiguous
        "view_rows": base[2:4],
        "view_col": base[:, 1],
        "scalar": torch.tensor(5),
        "empty": torch.zeros(0, 3),
        "bool": torch.tensor([True, False]),
        "f64": torch.ones(2, dtype=torch.float64),
    }
    items: list[Any] = [parts["a"], None, *parts.values(), parts["a"]]  # 'a' shared thrice
    return P(items, 0).enable_deduplication(), parts


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_pickle_roundtrip(protocol: int) -> None:
    v, _ = _big_value()
    got = _quiet_loads(pickle.dumps(v, protocol=protocol))
    assert isinstance(got, P) and got.deduplication_enabled
    assert got._segment_provenance == v._segment_provenance
    assert got.tensors[1] is None
    assert got.tensors[0] is got.tensors[2] is got.tensors[-1]
    for x, y in zip(v.tensors, got.tensors, strict=True):
        if x is None:
            continue
        assert y.dtype == x.dtype and y.shape == x.shape and torch.equal(x, y)
        assert not y.requires_grad
    # Restored segments are views of one compact buffer per dtype, not of the 100-float base.
    col = got.tensors[7]
    assert col.shape == (10,) and col.untyped_storage().nbytes() < 100 * 4
    got.tensors[0].add_(1)  # writable, no warning


def test_pickle_out_of_band_and_read_only_buffers() -> None:
    v, _ = _big_value()
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(v, protocol=5, buffer_callback=buffers.append)
    assert buffers  # the segment bytes went out of band
    got = _quiet_loads(data, buffers=buffers)
    assert torch.equal(got.tensors[0], v.tensors[0])
    read_only = [memoryview(bytes(b.raw())) for b in buffers]
    got = _quiet_loads(data, buffers=read_only)
    assert torch.equal(got.tensors[3], v.tensors[3])


def test_pickle_csr_value_with_fallback_entries() -> None:
    grad = torch.ones(2, requires_grad=True)
    entries: list[Any] = [torch.full((1, 2), float(i)) for i in range(9)] + [grad, "text"]
    v = P(entries, 0, _row_offsets=[0, 2, 5], _segment_indices=[0, 9, 3, 10, 3])
    got = _quiet_loads(pickle.dumps(v, protocol=5))
    assert got._row_offsets == [0, 2, 5] and got._segment_indices == [0, 9, 3, 10, 3]
    assert not got.deduplication_enabled
    assert got.tensors[9].requires_grad and got.tensors[10] == "text"
    assert all(torch.equal(a, b) for a, b in zip(v.tensors[:9], got.tensors[:9], strict=True))


def test_pickle_cloudpickle_and_torch_save() -> None:
    v, _ = _big_value()
    v = v.repeat_interleave(2)
    for got in (
        cloudpickle.loads(cloudpickle.dumps(v)),
        _torch_roundtrip(v),
    ):
        assert got._segment_provenance == v._segment_provenance
        assert got._row_offsets == v._row_offsets
        for x, y in zip(v.tensors, got.tensors, strict=True):
            assert (x is None and y is None) or torch.equal(x, y)


def _torch_roundtrip(v: P) -> P:
    buf = io.BytesIO()
    torch.save({"v": v}, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)["v"]


def test_pickle_keeps_identity_between_small_and_flattened_values() -> None:
    imgs = [torch.randn(64, 64) for _ in range(6)]
    per_sample = [dedup(img) for img in imgs]
    flat = P.concat([copy.deepcopy(p) for p in per_sample for _ in range(4)])
    batch = {"message_log": per_sample, "pixel_values": flat, "again": flat.shard(2)}
    plain = pickle.dumps([dedup(img) for img in imgs], protocol=5)
    data = pickle.dumps(batch, protocol=5)
    assert len(data) < 1.3 * len(plain)  # every image written once
    got = _quiet_loads(data)
    for i, p in enumerate(got["message_log"]):
        assert p.tensors[0] is got["pixel_values"].tensors[i]
    shard_tensors = got["again"][0].tensors + got["again"][1].tensors
    assert all(any(x is y for y in got["pixel_values"].tensors) for x in shard_tensors)
    # A later, separate pickle is self-contained.
    alone = _quiet_loads(pickle.dumps(flat.shard(3)[2], protocol=5))
    assert len(alone.tensors) == 2 and torch.equal(alone.tensors[0], imgs[4])


def test_pickle_small_values_keep_cross_value_sharing() -> None:
    shared = torch.randn(2, 2)
    seed = dedup(shared)
    copies = [copy.deepcopy(seed) for _ in range(4)]
    got = _quiet_loads(pickle.dumps(copies, protocol=5))
    assert all(g.tensors[0] is got[0].tensors[0] for g in got)
    merged = P.concat(got)
    assert len(merged.tensors) == 1 and len(merged) == 4


def test_pickle_small_view_of_big_storage_is_compact() -> None:
    big = torch.zeros(100_000)
    v = dedup(big[:4])
    data = pickle.dumps(v, protocol=5)
    assert len(data) < 10_000
    got = _quiet_loads(data)
    assert torch.equal(got.tensors[0], big[:4])


class Sub(P):
    """A subclass, pickled by reference."""


def test_pickle_keeps_extra_attributes_and_subclass() -> None:
    v = Sub([t(1)] * 9, 0)
    v.note = "kept"  # type: ignore[attr-defined]
    got = _quiet_loads(pickle.dumps(v, protocol=5))
    assert type(got) is Sub and got.note == "kept" and got._row_offsets is None
    assert all(x is got.tensors[0] for x in got.tensors)  # one object, nine slots


def test_unpickle_rejects_corrupt_layout() -> None:
    v = P.concat([dedup(t(1)), dedup(t(2))])
    _, _args, state = v.__reduce_ex__(5)
    offsets, indices, blob = state["layout"]
    state["layout"] = (offsets, np.asarray([0, 7], dtype="<i8").tobytes(), blob)
    obj = P.__new__(P)
    with pytest.raises(LayoutError, match="out-of-range physical segment"):
        obj.__setstate__(state)
    state["layout"] = (offsets, indices, blob[:-3])
    with pytest.raises(ProvenanceError):
        P.__new__(P).__setstate__(state)


def _mmpack_state(v: P) -> dict[str, Any]:
    _, _args, state = v.__reduce_ex__(2)
    return dict(state)


def _corrupt_states() -> dict[str, Any]:
    base = _mmpack_state(P([t(1, 2), t(3, 4)], 0, _row_offsets=[0, 2], _segment_indices=[0, 1]))
    fmt, codes, pos, groups, others = base["segments"]
    group_state = groups[0].__reduce_ex__(2)[2]
    gfmt, dtypes, ranks, dims, buffers = group_state["group"]
    key = "__mmpack_packed_tensor__"
    i64 = lambda *v: np.asarray(v, dtype="<i8").tobytes()  # noqa: E731
    return {
        "a list": [1, 2],
        "missing key": {k: v for k, v in base.items() if k != "dim_to_pack"},
        "renamed state key": {("x" + k if k == key else k): v for k, v in base.items()},
        "bad dim_to_pack": {**base, "dim_to_pack": "0"},
        "bad pad_to_max_shape": {**base, "pad_to_max_shape": None},
        "segment codes": {**base, "segments": (fmt, i64(-7, 0), pos, groups, others)},
        "segment tables of different lengths": {
            **base,
            "segments": (fmt, codes, i64(0), groups, others),
        },
        "segment position": {**base, "segments": (fmt, codes, i64(0, 5), groups, others)},
        "extra overriding a field": {**base, "extra": {"tensors": "abc"}},
        "group shapes": {key: 1, "group": (gfmt, dtypes, ranks, i64(1, 3, 1, 2), buffers)},
        "group ranks": {key: 1, "group": (gfmt, dtypes, i64(-1, 5), dims, buffers)},
        "group dtype slot": {key: 1, "group": (gfmt, i64(0, 3), ranks, dims, buffers)},
        "nemo: no tensors": {"dim_to_pack": 0, "pad_to_max_shape": False},
        "nemo: tensors a str": {"tensors": "abc", "dim_to_pack": 0, "pad_to_max_shape": False},
        "nemo: foreign _layout": {
            "tensors": [t(1)],
            "dim_to_pack": 0,
            "pad_to_max_shape": False,
            "_layout": "x",
        },
    }


@pytest.mark.parametrize("name", sorted(_corrupt_states()))
def test_unpickle_rejects_corrupt_states_with_layout_error(name: str) -> None:
    """mmpack's restore code raises ``LayoutError`` for every inconsistent state it is given
    (never KeyError / RuntimeError, never an object without ``tensors``)."""
    state = _corrupt_states()[name]
    with pytest.raises(LayoutError, match="corrupt PackedTensor pickle"):
        P.__new__(P).__setstate__(state)


def test_unpickle_of_the_uncorrupted_state_still_works() -> None:
    v = P([t(1, 2), t(3, 4)], 0, _row_offsets=[0, 2], _segment_indices=[0, 1])
    obj = P.__new__(P)
    obj.__setstate__(_mmpack_state(v))
    assert torch.equal(obj.as_tensor(), v.as_tensor())  # type: ignore[arg-type]


# --------------------------------------------------------------------------------- deepcopy


def test_deepcopy_dedup_shares_tensors_and_handle() -> None:
    a, b = t(1), t(2)
    v = P.concat([dedup(a), dedup(b)])
    memo: dict[int, Any] = {}
    c = copy.deepcopy(v, memo)
    assert memo[id(v)] is c
    assert c.tensors is not v.tensors and c.tensors[0] is a and c.tensors[1] is b
    assert c._layout is v._layout  # the immutable native handle is shared
    assert c._segment_provenance == v._segment_provenance
    c.tensors.append(t(3))  # the lists are independent
    assert len(v.tensors) == 2
    assert v in memo[id(memo)]  # copy.deepcopy's keep-alive list still holds the original
    pair = copy.deepcopy([v, v])
    assert pair[0] is pair[1] and pair[0] is not v


def test_deepcopy_without_provenance_copies_tensors() -> None:
    a = t(1)
    for v in (
        P([a, None], 0),
        P.empty_rows_like(P([a], 0), 0),
        P([a], 0, _row_offsets=[0, 1], _segment_indices=[0]),
    ):
        c = copy.deepcopy(v)
        assert not c.deduplication_enabled
        assert all(x is not a for x in c.tensors)
        assert c._row_offsets == v._row_offsets


def test_copy_is_shallow() -> None:
    v = dedup(t(1))
    c = copy.copy(v)
    assert c.tensors is v.tensors and c._segment_provenance == v._segment_provenance


# ------------------------------------------------------------------------------- provenance


def test_minted_provenance_is_uuid4_and_unique() -> None:
    ids: set[bytes] = set()
    for _ in range(50):
        prov = dedup(*[t(i) for i in range(20)])._segment_provenance
        assert prov is not None
        for p in prov:
            assert uuid.UUID(bytes=p).version == 4
        ids.update(prov)
    assert len(ids) == 1000


def test_to_dtype_remints_only_on_real_cast() -> None:
    v = P.concat([dedup(t(1)), dedup(torch.tensor([[1]]))])
    same = v.to_dtype(torch.float32)
    assert same._layout is v._layout and same._segment_provenance == v._segment_provenance
    cast = v.to_dtype(torch.bfloat16)
    old, new = v._segment_provenance, cast._segment_provenance
    assert old is not None and new is not None and not set(old) & set(new)
    assert cast.tensors[1] is v.tensors[1]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_forked_child_mints_other_ids() -> None:
    parent = dedup(t(1))._segment_provenance
    assert parent is not None
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: mint, report, exit without running pytest's teardown
        code = 1
        try:
            from mmpack._native import PackedLayout

            os.write(w, b"".join(PackedLayout.mint(64)))
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    child = b""
    while chunk := os.read(r, 4096):
        child += chunk
    os.close(r)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"the child ended with {status}"
    mine = b"".join(P([t(0)] * 64, 0).enable_deduplication()._segment_provenance or [])
    child_ids = {child[i : i + 16] for i in range(0, len(child), 16)}
    mine_ids = {mine[i : i + 16] for i in range(0, len(mine), 16)}
    assert len(child_ids) == 64 and not child_ids & mine_ids


# ----------------------------------------------------------------------- constructor errors


@pytest.mark.parametrize(
    ("offsets", "indices", "n", "phrase"),
    [
        ([], [], 1, "_row_offsets must start with 0"),
        ([1, 1], [0], 1, "_row_offsets must start with 0"),
        ([0, 2, 1], [0], 1, "_row_offsets must be non-decreasing"),
        ([0, 2], [0], 1, "_row_offsets must end at the number of logical segment references"),
        ([0, 1], [1], 1, "_segment_indices cannot reference an out-of-range physical segment"),
        ([0, 1], [-1], 1, "_segment_indices cannot reference an out-of-range physical segment"),
        ([0, 1], [2**70], 1, "_segment_indices cannot reference an out-of-range physical segment"),
        ([0, 2**70], [0], 1, "_row_offsets must end at the number of logical segment references"),
        ([0, -(2**70), 0], [], 1, "_row_offsets must be non-decreasing"),
        ([0, 1], [2**63 - 1], 1, "_segment_indices cannot reference an out-of-range"),
    ],
)
def test_layout_errors(offsets: list[int], indices: list[int], n: int, phrase: str) -> None:
    with pytest.raises(LayoutError, match=phrase) as info:
        P([t(0)] * n, 0, _row_offsets=offsets, _segment_indices=indices)
    assert isinstance(info.value, ValueError) and isinstance(info.value, MmpackError)


def test_provenance_errors() -> None:
    with pytest.raises(LayoutError, match="one entry per physical segment"):
        P([t(1), t(2)], 0, _segment_provenance=[b"x" * 16])
    with pytest.raises(ProvenanceError, match="16 bytes"):
        P([t(1)], 0, _segment_provenance=[b"short"])
    with pytest.raises(TypeError, match="must be bytes"):
        P([t(1)], 0, _segment_provenance=["not bytes"])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="list of bytes"):
        P([t(1)], 0, _segment_provenance=b"x" * 16)  # type: ignore[arg-type]
    # Length is checked before the entries (NeMo-RL's order).
    with pytest.raises(LayoutError, match="one entry per physical segment"):
        P([t(1)], 0, _segment_provenance=[1, 2])  # type: ignore[list-item]


def test_both_or_neither_and_accepted_index_types() -> None:
    with pytest.raises(LayoutError, match="must either both be set or both be None"):
        P([t(1)], 0, _row_offsets=[0, 1])
    a = t(1)
    for offsets, indices in (
        ((0, 1), (0,)),
        (np.array([0, 1], dtype=np.int32), np.array([0], dtype=np.uint8)),
        (torch.tensor([0, 1]), torch.tensor([0])),
    ):
        v = P([a], 0, _row_offsets=offsets, _segment_indices=indices)  # type: ignore[arg-type]
        assert v._row_offsets == [0, 1] and v._segment_indices == [0]


@pytest.mark.parametrize("bad", [5, "01", [0.0, 1.0], [[0, 1]], [0, None], {"a": 1}, [0, "1"]])
def test_wrong_offset_types_raise_type_error(bad: Any) -> None:
    with pytest.raises(TypeError):
        P([t(1)], 0, _row_offsets=bad, _segment_indices=[0])


def test_slice_bad_indices_never_panic() -> None:
    v = dedup(t(1), t(2))
    for row, shown in ((2, 2), (-3, -1), (2**63 - 1, 2**63 - 1), (-(2**63), -(2**63) + 2)):
        with pytest.raises(IndexError, match=f"PackedTensor row index {shown} is out of range"):
            v.slice([row])
    with pytest.raises(IndexError, match=f"row index {2**70} is out of range"):
        v.slice([0, 2**70])
    with pytest.raises(TypeError):
        v.slice([0.5])  # type: ignore[list-item]
    with pytest.raises(TypeError):
        v.slice(torch.tensor([0.0]))
    assert v.slice(torch.tensor([1, 0])).tensors == v.tensors[::-1]
    assert v.slice(np.array([True, False])).tensors == [v.tensors[1], v.tensors[0]]  # type: ignore[arg-type]
    assert len(v.slice([])) == 0


def test_count_arguments_beyond_int64_raise_typed_errors() -> None:
    v = dedup(t(1), t(2))
    legacy = P([t(1)], 0)
    for value in (2**63, -(2**63) - 1, 10**30):
        with pytest.raises(IndexOverflowError, match="repeats must fit in int64"):
            v.repeat_interleave(value)
        with pytest.raises(ShardError, match="num_shards must fit in int64"):
            v.shard(value)
        with pytest.raises(ShardError, match="num_shards must fit in int64"):
            legacy.shard(value)
        with pytest.raises(LayoutError, match="num_rows must fit in int64"):
            P.empty_rows_like(v, value)
    with pytest.raises(TypeError, match="num_rows must be an int, got float"):
        P.empty_rows_like(v, 1.5)  # type: ignore[arg-type]
    # in int64 but beyond memory: refused before anything is built
    for other in (v, legacy):
        with pytest.raises(IndexOverflowError, match="cannot be allocated"):
            P.empty_rows_like(other, 2**62)


def test_meta_tensors_as_row_selections_raise_type_error() -> None:
    meta = torch.tensor([0], device="meta")
    for v in (dedup(t(1)), P([t(1)], 0)):
        with pytest.raises(TypeError, match="indices must hold data, got a tensor on the meta"):
            v.slice(meta)
    with pytest.raises(TypeError, match="_row_offsets must hold data"):
        P([t(1)], 0, _row_offsets=torch.tensor([0, 1], device="meta"), _segment_indices=[0])


@pytest.mark.parametrize("op", ["concat", "merge_segments", "flattened_concat"])
def test_concat_of_non_packed_items_raises_type_error_naming_the_item(op: str) -> None:
    v = dedup(t(1))
    for bad, tp in ((None, "NoneType"), ("x", "str"), (3, "int")):
        with pytest.raises(
            TypeError,
            match=rf"PackedTensor\.{op}: from_packed_tensors\[1\] must be a PackedTensor, got {tp}",
        ):
            getattr(P, op)([v, bad])
    with pytest.raises(
        TypeError, match=r"from_packed_tensors\[0\] must be a PackedTensor, got str"
    ):
        getattr(P, op)("ab")


# --------------------------------------------------------------------- setters and raw state


def test_setters_revalidate() -> None:
    a, b = t(1), t(2)
    v = P([a, b], 0, _row_offsets=[0, 2], _segment_indices=[0, 1])
    v._segment_indices = [1, 1]
    assert v._segment_indices == [1, 1] and len(v) == 1
    v._row_offsets = [0, 1, 2]
    assert len(v) == 2
    with pytest.raises(LayoutError, match="must end at the number"):
        v._row_offsets = [0, 1]
    assert v._row_offsets == [0, 1, 2]  # unchanged after the failed assignment
    v._segment_provenance = [b"a" * 16, b"b" * 16]
    assert v.deduplication_enabled
    with pytest.raises(LayoutError, match="one entry per physical segment"):
        v._segment_provenance = [b"a" * 16]
    v._segment_provenance = None
    assert not v.deduplication_enabled and v._row_offsets == [0, 1, 2]
    v._row_offsets = None  # drops the mapping: back to the legacy layout
    assert v._row_offsets is None and v._segment_indices is None and len(v) == 2


def test_raw_nemo_state_in_dict_is_adopted() -> None:
    a = t(1)
    obj = P.__new__(P)
    obj.__dict__ = {
        "tensors": [a],
        "dim_to_pack": 0,
        "pad_to_max_shape": False,
        "_row_offsets": [0, 1, 1],
        "_segment_indices": [0],
        "_segment_provenance": [b"p" * 16],
    }
    assert len(obj) == 2 and obj.deduplication_enabled
    merged = P.concat([obj, dedup(t(2))])
    assert merged._segment_provenance is not None and merged._segment_provenance[0] == b"p" * 16


def test_concat_reads_foreign_packed_tensor_like_values() -> None:
    a = t(1)
    foreign = SimpleNamespace(
        tensors=[a],
        dim_to_pack=0,
        pad_to_max_shape=False,
        _row_offsets=None,
        _segment_indices=None,
        _segment_provenance=[b"f" * 16],
    )
    out = P.concat([foreign, copy.deepcopy(P([a], 0).enable_deduplication())])  # type: ignore[list-item]
    assert len(out) == 2 and len(out.tensors) == 2
    out2 = P.concat([foreign, foreign])  # type: ignore[list-item]
    assert len(out2.tensors) == 1  # same provenance: merged


def test_concat_accepts_any_iterable_and_checks_tensors_length() -> None:
    a, b = dedup(t(1)), dedup(t(2))
    out = P.concat(iter([a, b]))  # type: ignore[arg-type]
    assert len(out) == 2
    broken = dedup(t(1), t(2))
    broken.tensors.pop()  # provenance no longer matches the list
    with pytest.raises(LayoutError, match="one entry per physical segment"):
        P.concat([broken])
