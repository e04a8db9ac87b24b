"""Hypothesis: mmpack's NeMo-RL algorithms equal the plain-Python reference (bins, order,
errors, random state, bin-count adjustment), and every algorithm's output satisfies the
invariants (each item once or reported, budgets held, item cap, oversize policy)."""

from __future__ import annotations

import random

import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from mmpack import errors
from mmpack.compat.nemo_rl import packing as nemo_rl_packing
from mmpack.compat.nemo_rl.packing import PackingAlgorithm, get_packer
from mmpack.packing import ALGORITHMS, pack
from reference import packing as ref
from support.packing import check_invariants


def _run(
    module: object, algorithm: str, capacity: int, lengths: list[int], kwargs: dict, seed: int
) -> tuple[object, float]:
    random.seed(seed)
    try:
        out: object = module.get_packer(algorithm, capacity, **kwargs).pack(lengths)  # type: ignore[attr-defined]
    except ValueError as exc:
        out = ("error", str(exc))
    return out, random.random()


@st.composite
def nemo_cases(draw: st.DrawFn) -> tuple[str, int, list[int], dict, int]:
    algorithm = draw(st.sampled_from([a.name for a in PackingAlgorithm]))
    capacity = draw(st.integers(1, 120))
    mffd = algorithm == "MODIFIED_FIRST_FIT_DECREASING"
    low = draw(st.sampled_from([1, 1, 1, 0])) if not mffd else 1
    high = capacity + draw(st.sampled_from([0, 0, 0, 0, 5]))
    lengths = draw(st.lists(st.integers(low, high), max_size=60))
    kwargs = {}
    if draw(st.booleans()):
        kwargs["min_bin_count"] = draw(st.integers(0, len(lengths) + 3))
    if draw(st.booleans()):
        kwargs["bin_count_multiple"] = draw(st.integers(1, 6))
    return algorithm, capacity, lengths, kwargs, draw(st.integers(0, 2**32))


@given(nemo_cases())
def test_nemo_algorithms_equal_reference(case: tuple[str, int, list[int], dict, int]) -> None:
    algorithm, capacity, lengths, kwargs, seed = case
    ours = _run(nemo_rl_packing, algorithm, capacity, lengths, kwargs, seed)
    theirs = _run(ref, algorithm, capacity, lengths, kwargs, seed)
    assert ours == theirs


@given(
    st.sampled_from(list(PackingAlgorithm)),
    st.lists(st.integers(1, 1000), min_size=1, max_size=400),
    st.integers(0, 2**32),
)
def test_nemo_algorithms_equal_reference_on_larger_inputs(
    algorithm: PackingAlgorithm, lengths: list[int], seed: int
) -> None:
    random.seed(seed)
    ours = get_packer(algorithm, 1000).pack(lengths)
    random.seed(seed)
    assert ours == ref.get_packer(algorithm.name, 1000).pack(lengths)


@st.composite
def pack_cases(draw: st.DrawFn) -> dict:
    algorithm = draw(st.sampled_from(ALGORITHMS))
    capacity = draw(st.integers(1, 200))
    on_oversize = draw(st.sampled_from(["skip", "truncate"]))
    n = draw(st.integers(0, 80))
    lengths = draw(st.lists(st.integers(1, capacity + 20), min_size=n, max_size=n))
    case: dict = {
        "lengths": lengths,
        "capacity": capacity,
        "algorithm": algorithm,
        "on_oversize": on_oversize,
        "seed": draw(st.integers(0, 1000)),
    }
    if algorithm != "modified_first_fit_decreasing" and draw(st.booleans()):
        case["max_items_per_bin"] = draw(st.integers(1, 5))
    if algorithm not in ("modified_first_fit_decreasing", "minimum_bin_slack") and draw(
        st.booleans()
    ):
        media_capacity = draw(st.integers(0, 6))
        high = media_capacity if on_oversize == "truncate" else media_capacity + 2
        case["media_capacity"] = media_capacity
        case["media"] = draw(st.lists(st.integers(0, high), min_size=n, max_size=n))
    if draw(st.booleans()):
        case["bins_multiple_of"] = draw(st.integers(1, 4))
    return case


@given(pack_cases())
def test_every_algorithm_keeps_the_invariants(case: dict) -> None:
    lengths = case.pop("lengths")
    capacity = case.pop("capacity")
    try:
        p = pack(np.array(lengths, dtype=np.int64), capacity, **case)
    except errors.BinCountError:
        multiple = case.pop("bins_multiple_of")
        natural = pack(lengths, capacity, **case)
        target = -(-natural.num_bins // multiple) * multiple
        assert len(natural.item_indices) < target
        return
    check_invariants(
        p,
        lengths,
        capacity,
        media=case.get("media"),
        media_capacity=case.get("media_capacity"),
        max_items=case.get("max_items_per_bin"),
        on_oversize=case["on_oversize"],
    )
    if case.get("bins_multiple_of"):
        assert p.num_bins % case["bins_multiple_of"] == 0


@given(st.lists(st.integers(1, 300), max_size=300), st.integers(1, 300))
def test_improvement_never_worse_than_best_fit(lengths: list[int], capacity: int) -> None:
    lengths = [min(x, capacity) for x in lengths]
    bfd = pack(lengths, capacity)
    mbs = pack(lengths, capacity, algorithm="minimum_bin_slack")
    assert mbs.num_bins <= bfd.num_bins
    check_invariants(mbs, lengths, capacity)


@given(st.lists(st.integers(-5, 30), min_size=1, max_size=40), st.integers(1, 20))
def test_errors_name_the_first_bad_item(lengths: list[int], capacity: int) -> None:
    bad = next(
        (i for i, x in enumerate(lengths) if x <= 0 or x > capacity),
        None,
    )
    for algorithm in ALGORITHMS:
        if bad is None:
            check_invariants(pack(lengths, capacity, algorithm=algorithm), lengths, capacity)
            continue
        expected = errors.InvalidLengthError if lengths[bad] <= 0 else errors.ItemTooLargeError
        try:
            pack(lengths, capacity, algorithm=algorithm)
        except expected as exc:
            assert f"item {bad} has length {lengths[bad]}" in str(exc)
        else:
            raise AssertionError("no error")


@given(
    st.sampled_from(list(PackingAlgorithm)),
    st.integers(100_000, 10**12),
    st.lists(st.floats(0.01, 1.0), max_size=80),
    st.integers(0, 2**32),
)
def test_large_capacities_use_the_sorted_fallbacks_and_equal_reference(
    algorithm: PackingAlgorithm, capacity: int, fractions: list[float], seed: int
) -> None:
    lengths = [max(1, int(f * capacity)) for f in fractions]
    random.seed(seed)
    ours = get_packer(algorithm, capacity).pack(lengths)
    random.seed(seed)
    assert ours == ref.get_packer(algorithm.name, capacity).pack(lengths)
    for name in ALGORITHMS:
        check_invariants(pack(lengths, capacity, algorithm=name), lengths, capacity)
