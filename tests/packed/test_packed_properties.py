"""Property tests: random sequences of PackedTensor operations give the same results in
``mmpack.PackedTensor`` and in the plain-Python reference (``tests/reference``).

A hypothesis state machine keeps a pool of (reference, mmpack) pairs built the same way and applies
random operations to both: construction (legacy lists with ``None`` entries and mixed dtypes,
shapes and ranks; single tensors; CSR with valid or broken offsets and possibly duplicated
provenance), ``enable_deduplication``, ``slice`` (lists or tensors, negative and out-of-range
indices, empty selections), ``concat``, ``merge_segments``, ``flattened_concat``,
``repeat_interleave``, ``shard``, ``to_dtype``, ``deepcopy``, pickle round trips and
``empty_rows_like``. After every step the pair must agree on: the exception type (mmpack's may be
a subclass of the reference's), length, dedup state, CSR lists, physical tensors (values, dtypes,
shapes, ``None`` positions), per-row segment counts, ``csr()``, byte counts, the materialized
tensor (or its exception type), and provenance up to one consistent renaming (a bijection between
the two implementations' ids, kept across the whole run, so re-interning decisions must match).
"""

from __future__ import annotations

import copy
import pickle
from typing import Any

import hypothesis.strategies as st
import torch
from hypothesis import settings
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    multiple,
    rule,
)
from reference.packed_tensor import PackedTensor as Ref

DTYPES = [torch.float32, torch.bfloat16, torch.float64, torch.int64, torch.int32]
CAST_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64]
SHARED_PROVENANCE = [bytes([i]) * 16 for i in range(4)]


def _mm() -> Any:
    from mmpack import PackedTensor

    return PackedTensor


_counter = [0]


@st.composite
def tensors_st(draw: st.DrawFn) -> torch.Tensor | None:
    if draw(st.integers(0, 5)) == 0:
        return None
    rows = draw(st.integers(0, 3))
    width = draw(st.sampled_from([2, 2, 2, 3]))
    rank3 = draw(st.integers(0, 7)) == 0
    dtype = draw(st.sampled_from(DTYPES))
    shape = (rows, width, 2) if rank3 else (rows, width)
    numel = rows * width * (2 if rank3 else 1)
    _counter[0] += 1
    base = torch.arange(numel, dtype=torch.float64) + 10 * _counter[0]
    return base.reshape(shape).to(dtype)


class Outcome:
    """The result of running one operation on one implementation."""

    def __init__(self, fn: Any) -> None:
        self.value: Any = None
        self.error: BaseException | None = None
        try:
            self.value = fn()
        except Exception as exc:
            self.error = exc


def agree(ref: Outcome, mm: Outcome, what: str) -> bool:
    """True when both succeeded; raise AssertionError if the outcomes differ in kind."""
    if ref.error is not None or mm.error is not None:
        assert ref.error is not None and mm.error is not None, (
            f"{what}: reference {ref.error!r} vs mmpack {mm.error!r}"
        )
        assert isinstance(mm.error, type(ref.error)), (
            f"{what}: reference raised {type(ref.error).__name__}({ref.error}), "
            f"mmpack raised {type(mm.error).__name__}({mm.error})"
        )
        return False
    return True


def same_tensor(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


class PackedMachine(RuleBasedStateMachine):
    pairs = Bundle("pairs")

    def __init__(self) -> None:
        super().__init__()
        self.MM = _mm()
        self.r2m: dict[bytes, bytes] = {}
        self.m2r: dict[bytes, bytes] = {}
        self.latest: list[tuple[Any, Any]] = []

    # ------------------------------------------------------------------ checking

    def check(self, ref: Any, mm: Any) -> None:
        assert isinstance(ref, Ref) and isinstance(mm, self.MM)
        assert isinstance(mm.tensors, list)
        assert len(ref) == len(mm)
        assert ref.deduplication_enabled == mm.deduplication_enabled
        assert ref.dim_to_pack == mm.dim_to_pack and ref.pad_to_max_shape == mm.pad_to_max_shape
        for name in ("_row_offsets", "_segment_indices"):
            r, m = getattr(ref, name), getattr(mm, name)
            assert (r is None) == (m is None), name
            if r is not None:
                assert list(m) == list(r), name
        assert len(ref.tensors) == len(mm.tensors)
        for i, (a, b) in enumerate(zip(ref.tensors, mm.tensors, strict=True)):
            assert same_tensor(a, b), f"physical segment {i}"
        assert list(mm.logical_segment_counts_by_row()) == ref.logical_segment_counts_by_row()
        assert [
            same_tensor(a, b)
            for a, b in zip(ref.iter_logical_segments(), mm.iter_logical_segments(), strict=True)
        ] == [True] * len(ref.csr()[1])
        rp, mp = ref._segment_provenance, mm._segment_provenance
        assert (rp is None) == (mp is None)
        if rp is not None:
            assert len(rp) == len(mp)
            for a, b in zip(rp, mp, strict=True):
                assert isinstance(b, bytes) and len(b) == 16
                assert self.r2m.setdefault(a, b) == b, "provenance renaming is not consistent"
                assert self.m2r.setdefault(b, a) == a, "provenance renaming is not consistent"
        r_off, r_idx = ref.csr()
        m_off, m_idx = mm.csr()
        assert m_off.tolist() == r_off.tolist() and m_idx.tolist() == r_idx.tolist()
        assert mm.physical_nbytes() == ref.physical_nbytes()
        assert mm.logical_nbytes() == ref.logical_nbytes()
        r_mat, m_mat = Outcome(ref.as_tensor), Outcome(mm.as_tensor)
        if agree(r_mat, m_mat, "as_tensor"):
            assert same_tensor(r_mat.value, m_mat.value)

    def produce(self, ref_fn: Any, mm_fn: Any, what: str) -> Any:
        r, m = Outcome(ref_fn), Outcome(mm_fn)
        if not agree(r, m, what):
            return multiple()
        self.check(r.value, m.value)
        self.latest.append((r.value, m.value))
        return (r.value, m.value)

    @invariant()
    def sources_unchanged(self) -> None:
        # every operation but enable_deduplication leaves its inputs alone; recheck the newest
        for ref, mm in self.latest[-3:]:
            self.check(ref, mm)

    # ------------------------------------------------------------------ construction

    @initialize(target=pairs, data=st.data())
    def seed_legacy(self, data: st.DataObject) -> Any:
        entries = data.draw(st.lists(tensors_st(), min_size=1, max_size=4), label="seed")
        return self.produce(
            lambda: Ref(list(entries), 0), lambda: self.MM(list(entries), 0), "seed"
        )

    @initialize(target=pairs, data=st.data())
    def seed_dedup(self, data: st.DataObject) -> Any:
        entries = data.draw(st.lists(tensors_st(), min_size=1, max_size=4), label="seed")
        return self.produce(
            lambda: Ref(list(entries), 0).enable_deduplication(),
            lambda: self.MM(list(entries), 0).enable_deduplication(),
            "seed dedup",
        )

    @rule(target=pairs, data=st.data())
    def construct_legacy(self, data: st.DataObject) -> Any:
        entries = data.draw(st.lists(tensors_st(), min_size=0, max_size=5), label="entries")
        dim = data.draw(st.sampled_from([0, 0, 0, 1]), label="dim")
        pad = data.draw(st.sampled_from([False, False, True]), label="pad")
        return self.produce(
            lambda: Ref(list(entries), dim, pad_to_max_shape=pad),
            lambda: self.MM(list(entries), dim, pad_to_max_shape=pad),
            "construct",
        )

    @rule(target=pairs, data=st.data())
    def construct_single(self, data: st.DataObject) -> Any:
        t = data.draw(tensors_st().filter(lambda x: x is not None), label="tensor")
        return self.produce(lambda: Ref(t, 0), lambda: self.MM(t, 0), "construct single")

    @rule(target=pairs, data=st.data())
    def construct_csr(self, data: st.DataObject) -> Any:
        entries = data.draw(st.lists(tensors_st(), min_size=0, max_size=4), label="entries")
        n_phys = len(entries)
        if data.draw(st.booleans(), label="valid"):
            counts = data.draw(st.lists(st.integers(0, 3), max_size=4), label="row counts")
            offsets = [0]
            for c in counts:
                offsets.append(offsets[-1] + (c if n_phys else 0))
            indices = data.draw(
                st.lists(
                    st.integers(0, max(n_phys - 1, 0)),
                    min_size=offsets[-1],
                    max_size=offsets[-1],
                ),
                label="indices",
            )
        else:
            offsets = data.draw(st.lists(st.integers(-1, 4), max_size=4), label="offsets")
            indices = data.draw(st.lists(st.integers(-1, n_phys), max_size=4), label="indices")
        provenance = None
        if data.draw(st.booleans(), label="with provenance"):
            provenance = data.draw(
                st.lists(
                    st.sampled_from(SHARED_PROVENANCE),
                    min_size=n_phys,
                    max_size=n_phys + data.draw(st.sampled_from([0, 0, 0, 1])),
                ),
                label="provenance",
            )

        def build(cls: Any) -> Any:
            return cls(
                list(entries),
                0,
                _row_offsets=list(offsets),
                _segment_indices=list(indices),
                _segment_provenance=None if provenance is None else list(provenance),
            )

        return self.produce(lambda: build(Ref), lambda: build(self.MM), "construct csr")

    # ------------------------------------------------------------------ unary operations

    @rule(pair=pairs)
    def enable_deduplication(self, pair: tuple[Any, Any]) -> None:
        ref, mm = pair
        assert ref.enable_deduplication() is ref
        assert mm.enable_deduplication() is mm
        self.check(ref, mm)

    @rule(target=pairs, pair=pairs, data=st.data())
    def slice(self, pair: tuple[Any, Any], data: st.DataObject) -> Any:
        ref, mm = pair
        n = len(ref)
        idx = data.draw(st.lists(st.integers(-n - 2, n + 1), max_size=6), label="indices")
        if data.draw(st.booleans(), label="as tensor"):
            return self.produce(
                lambda: ref.slice(torch.tensor(idx, dtype=torch.long)),
                lambda: mm.slice(torch.tensor(idx, dtype=torch.long)),
                "slice(tensor)",
            )
        return self.produce(lambda: ref.slice(list(idx)), lambda: mm.slice(list(idx)), "slice")

    @rule(target=pairs, pair=pairs, repeats=st.integers(-1, 3))
    def repeat_interleave(self, pair: tuple[Any, Any], repeats: int) -> Any:
        ref, mm = pair
        return self.produce(
            lambda: ref.repeat_interleave(repeats),
            lambda: mm.repeat_interleave(repeats),
            "repeat_interleave",
        )

    @rule(target=pairs, pair=pairs, num_shards=st.integers(0, 4))
    def shard(self, pair: tuple[Any, Any], num_shards: int) -> Any:
        ref, mm = pair
        r, m = Outcome(lambda: ref.shard(num_shards)), Outcome(lambda: mm.shard(num_shards))
        if not agree(r, m, "shard"):
            return multiple()
        assert isinstance(m.value, list) and len(m.value) == len(r.value) == num_shards
        for a, b in zip(r.value, m.value, strict=True):
            self.check(a, b)
        return multiple(*zip(r.value, m.value, strict=True))

    @rule(target=pairs, pair=pairs, dtype=st.sampled_from(CAST_DTYPES))
    def to_dtype(self, pair: tuple[Any, Any], dtype: torch.dtype) -> Any:
        ref, mm = pair
        return self.produce(lambda: ref.to_dtype(dtype), lambda: mm.to_dtype(dtype), "to_dtype")

    @rule(target=pairs, pair=pairs)
    def deepcopy(self, pair: tuple[Any, Any]) -> Any:
        ref, mm = pair
        return self.produce(lambda: copy.deepcopy(ref), lambda: copy.deepcopy(mm), "deepcopy")

    @rule(
        target=pairs,
        items=st.lists(pairs, min_size=1, max_size=3),
        protocol=st.sampled_from([2, 4, 5]),
    )
    def pickle_round_trip(self, items: list[tuple[Any, Any]], protocol: int) -> Any:
        refs = pickle.loads(pickle.dumps([r for r, _ in items], protocol=protocol))
        mms = pickle.loads(pickle.dumps([m for _, m in items], protocol=protocol))
        for ref, mm in zip(refs, mms, strict=True):
            self.check(ref, mm)
        return multiple(*zip(refs, mms, strict=True))

    @rule(target=pairs, pair=pairs, num_rows=st.integers(-1, 3))
    def empty_rows_like(self, pair: tuple[Any, Any], num_rows: int) -> Any:
        ref, mm = pair
        return self.produce(
            lambda: Ref.empty_rows_like(ref, num_rows),
            lambda: self.MM.empty_rows_like(mm, num_rows),
            "empty_rows_like",
        )

    # ------------------------------------------------------------------ n-ary operations

    @rule(
        target=pairs,
        items=st.lists(pairs, max_size=4),
        op=st.sampled_from(["concat", "merge_segments", "flattened_concat"]),
    )
    def combine(self, items: list[tuple[Any, Any]], op: str) -> Any:
        refs = [r for r, _ in items]
        mms = [m for _, m in items]
        return self.produce(lambda: getattr(Ref, op)(refs), lambda: getattr(self.MM, op)(mms), op)


# examples come from the active profile (tests/conftest.py: ci = 120); 25 operations each
PackedMachine.TestCase.settings = settings(stateful_step_count=25)
TestPackedAgainstReference = PackedMachine.TestCase
