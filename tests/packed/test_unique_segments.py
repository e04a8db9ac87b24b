"""``PackedTensor.unique_segments()`` against the plain-Python reference
(``tests/reference/unique_segments.py``): random values (legacy lists with ``None`` media, CSR
rows with and without provenance, provenance shared by several physical segments, padding,
every packed dimension, many tiny segments) go through random ``repeat_interleave``, ``slice``
(negative and repeated rows), ``concat`` of slices (re-interning), ``shard`` and pickle round
trips, mirrored on a plain model of the value (physical segments, rows, provenance keys). After
every step the unique segments, their index, offsets and identities, ``logical()``,
``item_index()`` and ``segment(u)`` must be the reference's, and ``logical()`` must be
``as_tensor()``. Values read in place from Ray's object store give the same, and writing into
``values`` never reaches the value."""

from __future__ import annotations

import copy
import itertools
import pickle
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from mmpack.errors import UnadaptedModelError
from mmpack.packed import PackedTensor
from mmpack.packed.unique import UniqueSegments
from reference.unique_segments import Expected
from reference.unique_segments import unique_segments as reference

_fresh = itertools.count()


@dataclass
class Plain:
    """The plain model of a value: physical segments, rows (``None``: legacy, row ``r`` is
    ``segs[r]``) and per-segment provenance keys (``None``: none)."""

    segs: list[torch.Tensor | None]
    rows: list[list[int]] | None
    prov: list[Hashable] | None
    dim: int
    pad: bool

    @property
    def plain_legacy(self) -> bool:
        return self.rows is None and self.prov is None

    def eff_rows(self) -> list[list[int]]:
        return [[i] for i in range(len(self.segs))] if self.rows is None else self.rows

    def minted(self) -> list[Hashable]:
        return [("minted", next(_fresh)) for _ in self.segs] if self.prov is None else self.prov

    def expected(self) -> Expected | None:
        return reference(self.segs, self.rows, self.prov, self.dim, self.pad)


def repeat_interleave(p: Plain, k: int) -> Plain:
    rows = [row for row in p.eff_rows() for _ in range(k)]
    return Plain(p.segs, rows, p.minted(), p.dim, p.pad)


def take(p: Plain, idx: list[int]) -> Plain:
    if p.plain_legacy:  # Python list semantics
        return Plain([p.segs[i] for i in idx], None, None, p.dim, p.pad)
    rows = p.eff_rows()
    return Plain(p.segs, [rows[i] for i in idx], p.prov, p.dim, p.pad)


def concat(parts: list[Plain]) -> Plain:
    first = parts[0]
    if all(p.plain_legacy for p in parts):
        return Plain([s for p in parts for s in p.segs], None, None, first.dim, first.pad)
    segs: list[torch.Tensor | None] = []
    prov: list[Hashable] = []
    rows: list[list[int]] = []
    for p in parts:
        base = len(segs)
        segs += p.segs
        prov += p.minted()
        rows += [[base + i for i in row] for row in p.eff_rows()]
    return Plain(segs, rows, prov, first.dim, first.pad)


def shard(p: Plain, k: int) -> list[Plain]:
    n = len(p.eff_rows())
    size = n // k
    return [take(p, list(range(s * size, (s + 1) * size))) for s in range(k)]


# --------------------------------------------------------------------------------- values

_serial = itertools.count(1)


@dataclass(frozen=True)
class Spec:
    """What values that may be concatenated share: rank, packed dimension, padding, dtype and
    the sizes of the other dimensions (without padding)."""

    rank: int
    dim: int
    pad: bool
    dtype: torch.dtype
    base: tuple[int, ...]


@st.composite
def spec_st(draw: st.DrawFn) -> Spec:
    rank = draw(st.integers(1, 3))
    return Spec(
        rank,
        draw(st.integers(-rank, rank - 1)),
        rank > 1 and draw(st.booleans()),
        draw(st.sampled_from([torch.float32, torch.float64, torch.int64])),
        tuple(draw(st.integers(1, 3)) for _ in range(rank)),
    )


@st.composite
def value_st(
    draw: st.DrawFn, spec: Spec, *, tiny: bool = False, many: bool = False
) -> tuple[PackedTensor, Plain]:
    """A random value of ``spec`` and its plain model: legacy (``None`` media allowed), legacy
    with provenance, or CSR rows over physical segments (with or without provenance;
    provenance shared by several physical segments, which then hold equal data)."""
    rank, dim, pad = spec.rank, spec.dim, spec.pad
    pack = dim + rank if dim < 0 else dim
    n = draw(st.integers(64, 160)) if many else draw(st.integers(1, 24 if tiny else 6))
    kind = draw(st.sampled_from(["legacy", "legacy_dedup", "csr", "csr_dedup"]))
    # provenance ids of this value only (another value's segments are other segments)
    pool = [next(_serial).to_bytes(16) for _ in range(n // 2 + 1 if many else 4)]
    pool = pool if many else pool[: draw(st.integers(1, 4))]
    segs: list[torch.Tensor | None] = []
    prov: list[bytes] = []
    by_id: dict[bytes, torch.Tensor | None] = {}
    for _ in range(n):
        pid = draw(st.sampled_from(pool)) if kind == "csr_dedup" else next(_serial).to_bytes(16)
        if pid in by_id:  # same provenance: the same segment (equal data, its own object)
            seg = by_id[pid]
            segs.append(None if seg is None else seg.clone())
        elif draw(st.integers(0, 4)) == 0:
            segs.append(None)
        else:
            shape = [draw(st.integers(1, 3)) if pad else s for s in spec.base]
            shape[pack] = draw(st.integers(0, 1 if tiny or many else 3))
            numel = int(np.prod(shape))
            start = next(_serial) * 1000
            segs.append(torch.arange(start, start + numel).reshape(shape).to(spec.dtype))
        by_id.setdefault(pid, segs[-1])
        prov.append(pid)
    if kind in ("legacy", "legacy_dedup"):
        value = PackedTensor(list(segs), dim, pad_to_max_shape=pad)
        if kind == "legacy":
            return value, Plain(segs, None, None, dim, pad)
        value.enable_deduplication()
        ids = [bytes(i) for i in value.segment_identities()]  # type: ignore[union-attr]
        return value, Plain(segs, None, list(ids), dim, pad)
    n_rows = draw(st.integers(0, 8 if tiny or many else 5))
    width = 40 if many else 6 if tiny else 3
    rows = [draw(st.lists(st.integers(0, n - 1), max_size=width)) for _ in range(n_rows)]
    if many:  # every physical segment referenced: the gather sees them all
        rows.append(list(range(n)))
    offsets = [0, *itertools.accumulate(len(r) for r in rows)]
    keep = prov if kind == "csr_dedup" else None
    value = PackedTensor(
        list(segs),
        dim,
        pad_to_max_shape=pad,
        _row_offsets=offsets,
        _segment_indices=[i for r in rows for i in r],
        _segment_provenance=None if keep is None else list(keep),
    )
    return value, Plain(segs, rows, None if keep is None else list(keep), dim, pad)


def values_st(*, tiny: bool = False, many: bool = False) -> st.SearchStrategy[Any]:
    return spec_st().flatmap(lambda spec: value_st(spec, tiny=tiny, many=many))


def check(value: PackedTensor, plain: Plain, **kwargs: Any) -> UniqueSegments | None:
    """``value.unique_segments()`` is the reference's for ``plain``, and ``logical()`` is
    ``as_tensor()``."""
    want = plain.expected()
    got = value.unique_segments(**kwargs)
    if want is None:
        assert got is None
        out = value.as_tensor()
        assert out is None or out.numel() == 0
        return None
    assert got is not None
    assert torch.equal(value.as_tensor(), want.logical)  # the reference agrees with as_tensor
    assert got.dim_to_pack == want.dim
    assert got.index.dtype == torch.int64 and got.index.tolist() == want.index
    assert got.offsets.dtype == np.int64 and got.offsets.tolist() == want.offsets
    assert got.num_unique == want.num_unique == len(set(want.keys))
    assert got.num_logical == len(want.index)
    assert got.values.dtype == want.values.dtype and torch.equal(got.values, want.values)
    logical = got.logical()
    assert logical.dtype == want.logical.dtype and torch.equal(logical, want.logical)
    item = got.item_index()
    assert item.dtype == torch.int64
    assert torch.equal(got.values.index_select(got.dim_to_pack, item), want.logical)
    for u, seg in enumerate(want.segments):
        assert torch.equal(got.segment(u), seg)
    # identities: the provenance bytes where the reference knows them, else one per segment
    if value.deduplication_enabled:
        assert all(isinstance(i, bytes) and len(i) == 16 for i in got.identities)
        assert len(set(got.identities)) == got.num_unique
        known = [k[1] for k in want.keys if isinstance(k[1], bytes)]
        if len(known) == len(want.keys):
            assert list(got.identities) == known
    else:
        assert got.identities == (None,) * got.num_unique
    return got


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("repeat"), st.integers(0, 3)),
        st.tuples(st.just("slice"), st.lists(st.integers(-8, 8), max_size=6)),
        st.tuples(st.just("concat"), st.lists(st.integers(-8, 8), max_size=4)),
        st.tuples(st.just("shard"), st.integers(1, 3)),
        st.tuples(st.just("pickle"), st.none()),
        st.tuples(st.just("deepcopy"), st.none()),
    ),
    max_size=4,
)


def apply(value: PackedTensor, plain: Plain, op: str, arg: Any) -> tuple[PackedTensor, Plain]:
    n = len(value)
    if op == "repeat":
        return value.repeat_interleave(arg), repeat_interleave(plain, arg)
    if op in ("slice", "concat"):
        idx = [i for i in arg if -n <= i < n]
        if plain.plain_legacy and (not idx or (op == "concat" and len(idx) < 2)):
            return value, plain  # NeMo-RL refuses an empty legacy value
        if op == "slice":
            return value.slice(idx), take(plain, idx)
        half = len(idx) // 2
        a, b = idx[:half], idx[half:]
        out = PackedTensor.concat([value.slice(a), value.slice(b), value.slice(a)])
        return out, concat([take(plain, a), take(plain, b), take(plain, a)])
    if op == "shard":
        if n % arg or n == 0:
            return value, plain
        shards, models = value.shard(arg), shard(plain, arg)
        for s, m in zip(shards[1:], models[1:], strict=True):
            check(s, m)
        return shards[0], models[0]
    if op == "pickle":
        return pickle.loads(pickle.dumps(value)), plain
    return copy.deepcopy(value), plain


@settings(max_examples=150, deadline=None)
@given(values_st(), OPS)
def test_matches_reference_through_row_operations(case: Any, ops: list[Any]) -> None:
    value, plain = case
    check(value, plain)
    for op, arg in ops:
        value, plain = apply(value, plain, op, arg)
        check(value, plain)


@settings(max_examples=40, deadline=None)
@given(values_st(tiny=True), st.integers(1, 4))
def test_many_tiny_segments(case: Any, k: int) -> None:
    value, plain = case
    check(value, plain)
    check(value.repeat_interleave(k), repeat_interleave(plain, k))


@settings(max_examples=25, deadline=None)
@given(values_st(many=True), st.integers(1, 3), st.lists(st.integers(-12, 11), max_size=8))
def test_many_segments_take_the_compacting_gather(case: Any, k: int, rows: list[int]) -> None:
    """64 and more referenced segments: the gather compacts them first (with padding)."""
    value, plain = case
    check(value, plain)
    value, plain = value.repeat_interleave(k), repeat_interleave(plain, k)
    check(value, plain)
    for op, arg in (("slice", rows), ("concat", rows), ("pickle", None)):
        value, plain = apply(value, plain, op, arg)
        check(value, plain)


@pytest.mark.parametrize("pad", [False, True])
@pytest.mark.parametrize("segments", [3, 80])
def test_large_values_take_the_native_gather(pad: bool, segments: int) -> None:
    """Past 1 MiB the segments are gathered natively, not by ``torch.cat``."""
    rows = (2 << 20) // (segments * 4 * 64)
    generator = torch.Generator().manual_seed(segments)
    segs: list[torch.Tensor | None] = [
        torch.randn(rows, 64 - (i % 3 if pad else 0), generator=generator) for i in range(segments)
    ]
    value = PackedTensor(list(segs), 0, pad_to_max_shape=pad).enable_deduplication()
    ids = [bytes(i) for i in value.segment_identities()]  # type: ignore[union-attr]
    value, plain = value.repeat_interleave(2), repeat_interleave(Plain(segs, None, ids, 0, pad), 2)
    got = check(value, plain)
    assert got is not None and got.values.nbytes >= 1 << 20 and got.num_unique == segments
    order = [2 * segments - 1, 0, 3, 0]
    check(value.slice(order), take(plain, order))


@settings(max_examples=60, deadline=None)
@given(spec_st().flatmap(lambda s: st.lists(value_st(s), min_size=2, max_size=3)), st.data())
def test_concat_of_values_of_every_kind(cases: list[Any], data: st.DataObject) -> None:
    """Legacy values, CSR values with and without provenance, concatenated with slices of each
    other: provenance is kept, minted where missing, and interned across the parts."""
    parts, plains = [], []
    for value, plain in cases:
        parts.append(value)
        plains.append(plain)
        if n := len(value):
            idx = data.draw(st.lists(st.integers(-n, n - 1), min_size=1, max_size=4))
            parts.append(value.slice(idx))
            plains.append(take(plain, idx))
    joined, model = PackedTensor.concat(parts), concat(plains)
    check(joined, model)
    check(joined.repeat_interleave(2), repeat_interleave(model, 2))
    if len(joined):
        order = [-1, 0, len(joined) // 2, 0]
        check(joined.slice(order), take(model, order))


@settings(max_examples=40, deadline=None)
@given(values_st())
def test_to_cpu_and_device_argument(case: Any) -> None:
    value, plain = case
    got = check(value, plain, device="cpu")
    if got is None:
        return
    moved = got.to("cpu")
    assert isinstance(moved, UniqueSegments)
    assert torch.equal(moved.values, got.values) and torch.equal(moved.index, got.index)
    assert moved.offsets.tolist() == got.offsets.tolist()
    assert moved.identities == got.identities and moved.dim_to_pack == got.dim_to_pack
    # a dtype, as Tensor.to takes it, casts the values only: the index stays int64
    for args, kwargs in (((torch.float16,), {}), (("cpu", torch.float64), {"non_blocking": True})):
        cast = got.to(*args, **kwargs)
        want = got.values.to(args[-1])
        assert cast.values.dtype == want.dtype and torch.equal(cast.values, want)
        assert cast.index.dtype == torch.int64 and torch.equal(cast.index, got.index)
        assert torch.equal(cast.logical(), got.logical().to(args[-1]))
    assert got.to(dtype=got.values.dtype).values is got.values


@settings(max_examples=60, deadline=None)
@given(values_st(), st.sampled_from([None, "cpu"]))
def test_values_never_alias_the_value(case: Any, device: str | None) -> None:
    value, _ = case
    before = value.as_tensor()
    got = value.unique_segments(device)
    if got is None or got.values.numel() == 0:
        return
    got.values.add_(1)
    after = value.as_tensor()
    assert torch.equal(after, before)
    again = value.unique_segments()
    assert again is not None and torch.equal(again.logical(), before)


def test_grpo_shape_counts_each_image_once() -> None:
    images = [torch.arange(6.0 * (i + 1)).reshape(-1, 3) + 100 * i for i in range(3)]
    single = [PackedTensor(t, 0).enable_deduplication() for t in images]
    rows = [PackedTensor.merge_segments([single[i], single[(i + 1) % 3]]) for i in range(3)]
    batch = PackedTensor.flattened_concat(rows).repeat_interleave(4)
    got = batch.unique_segments()
    assert got is not None
    assert got.num_unique == 3 and got.num_logical == 24
    assert got.index.tolist() == [0, 1] * 4 + [1, 2] * 4 + [2, 0] * 4
    assert torch.equal(got.logical(), batch.as_tensor())
    assert "3 unique for 24 occurrences" in repr(got)


def test_no_media_gives_none() -> None:
    assert PackedTensor([None, None], 0).unique_segments() is None
    assert PackedTensor([None], 0).enable_deduplication().unique_segments() is None
    empty = PackedTensor.empty_rows_like(PackedTensor([torch.ones(2)], 0), 3)
    assert empty.unique_segments() is None
    some = PackedTensor([None, torch.ones(2)], 0).enable_deduplication()
    assert some.slice([0, 0]).unique_segments() is None
    assert PackedTensor([], 0, _row_offsets=[0], _segment_indices=[]).unique_segments() is None


def test_legacy_without_provenance_keeps_equal_rows_apart() -> None:
    t = torch.arange(4.0).reshape(2, 2)
    value = PackedTensor([t, t, None, t.clone()], 0)
    got = value.unique_segments()
    assert got is not None
    assert got.num_unique == 3 and got.identities == (None, None, None)
    assert got.index.tolist() == [0, 1, 2]
    # a legacy slice with a repeated row: each entry is its own physical segment
    sliced = value.slice([0, 0, -1]).unique_segments()
    assert sliced is not None and sliced.num_unique == 3
    # repeat_interleave mints provenance: the repeats share it
    rep = value.repeat_interleave(3).unique_segments()
    assert rep is not None and rep.num_unique == 3 and rep.num_logical == 9


def test_same_provenance_in_different_physical_segments_is_one() -> None:
    a, b = torch.arange(6.0).reshape(3, 2), torch.arange(10.0, 14.0).reshape(2, 2)
    ida, idb = b"a" * 16, b"b" * 16
    value = PackedTensor(
        [a, b, a.clone()],
        0,
        _row_offsets=[0, 1, 3, 4],
        _segment_indices=[2, 1, 0, 2],
        _segment_provenance=[ida, idb, ida],
    )
    got = value.unique_segments()
    assert got is not None
    assert got.identities == (ida, idb) and got.index.tolist() == [0, 1, 0, 0]
    assert got.offsets.tolist() == [0, 3, 5]
    assert torch.equal(got.segment(1), b) and torch.equal(got.logical(), value.as_tensor())


def test_not_a_tensor_for_an_unadapted_model() -> None:
    got = PackedTensor([torch.ones(2, 3)], 0).enable_deduplication().unique_segments()
    assert got is not None
    for name in ("shape", "dim", "type", "to_dense", "float"):
        with pytest.raises(UnadaptedModelError, match=name):
            getattr(got, name)
    with pytest.raises(UnadaptedModelError):
        torch.cat([got])  # type: ignore[list-item]
    assert isinstance(pickle.loads(pickle.dumps(got)), UniqueSegments)
    assert copy.deepcopy(got).index.tolist() == [0]


def test_negative_dim_and_padding() -> None:
    a = torch.arange(6.0).reshape(1, 2, 3)
    b = torch.arange(100.0, 108.0).reshape(2, 1, 4)
    value = PackedTensor([a, b], -1, pad_to_max_shape=True).repeat_interleave(2)
    plain = Plain([a, b], [[0], [0], [1], [1]], ["a", "b"], -1, True)
    got = check(value, plain)
    assert got is not None and got.dim_to_pack == 2
    assert tuple(got.values.shape) == (2, 2, 7) and got.offsets.tolist() == [0, 3, 7]


# --------------------------------------------------------------------------------- Ray store


@pytest.mark.usefixtures("ray_store_on")
@settings(max_examples=25, deadline=None)
@given(values_st(), st.integers(1, 3))
def test_read_in_place_from_the_ray_store(case: Any, k: int) -> None:
    import ray

    value, plain = case
    value, plain = value.repeat_interleave(k), repeat_interleave(plain, k)
    received = ray.get(ray.put(value))
    before = received.as_tensor()
    got = check(received, plain)
    if got is None:
        return
    if got.values.numel():
        got.values.add_(1)  # a private copy: neither the store nor the value changes
    assert torch.equal(received.as_tensor(), before)
    assert torch.equal(ray.get(ray.put(value)).as_tensor(), before)
    for s, m in zip(received.shard(k), shard(plain, k), strict=True):
        check(s, m)
    moved = ray.get(ray.put(value))  # with a device: private copies first, as as_tensor does
    got = check(moved, plain, device="cpu")
    if got is not None and got.values.numel():
        got.values.add_(1)
        assert torch.equal(moved.as_tensor(), before)


@pytest.mark.usefixtures("ray_store_on", "tiny_segments_in_the_store")
def test_store_views_are_read_in_place_and_never_aliased() -> None:
    import ray

    images = [torch.arange(12.0).reshape(4, 3) + 50 * i for i in range(3)]
    value = PackedTensor.concat(
        [PackedTensor(t, 0).enable_deduplication() for t in images]
    ).repeat_interleave(3)
    received = ray.get(ray.put(value.slice([0, 1, 2])))  # one unique segment
    assert "_store" in received.__dict__
    before = received.as_tensor()
    got = received.unique_segments()
    assert got is not None and got.num_unique == 1 and got.num_logical == 3
    assert "_store" in received.__dict__  # read without private copies
    got.values.fill_(-1)
    assert torch.equal(received.as_tensor(), before)
    assert torch.equal(ray.get(ray.put(value.slice([0, 1, 2]))).as_tensor(), before)
    whole = ray.get(ray.put(value))
    got = whole.unique_segments()
    assert got is not None and got.num_unique == 3
    assert torch.equal(got.logical(), value.as_tensor())
    got.segment(0).fill_(-1)
    assert torch.equal(whole.as_tensor(), value.as_tensor())
