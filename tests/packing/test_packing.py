"""mmpack.packing: concrete cases (NeMo-RL spec §4.4 / §6.3), the public API and one test per
error. NeMo-RL's packer API: test_packing_nemo_rl.py; rank assignment: test_packing_ranks.py."""

from __future__ import annotations

import gc
import random

import numpy as np
import pytest
from mmpack import errors
from mmpack.compat.nemo_rl.packing import get_packer
from mmpack.packing import ALGORITHMS, pack
from reference import packing as ref
from support.packing import MAXED, MEDIUM, MIXED, SAME, SMALL, check_invariants

SPEC_CASES = [
    ("concatenative", SMALL, 100, [[0, 1, 2, 3], [4], [5], [6], [7], [8]]),
    ("concatenative", SAME, 100, [[0, 1, 2], [3, 4]]),
    ("concatenative", MIXED, 100, [[0, 1], [2], [3, 4], [5, 6], [7, 8], [9]]),
    ("concatenative", [4, 1, 3, 2, 1, 3, 4, 5], 5, [[0, 1], [2, 3], [4, 5], [6], [7]]),
    ("concatenative", [4, 1, 3, 2, 1, 3, 4, 5], 8, [[0, 1, 2], [3, 4, 5], [6], [7]]),
    ("first_fit_decreasing", SMALL, 100, [[8, 0], [7, 1], [6, 2], [5, 3], [4]]),
    ("first_fit_decreasing", SAME, 100, [[4, 3, 2], [1, 0]]),
    ("first_fit_decreasing", MAXED, 100, [[2], [1], [0]]),
    ("first_fit_decreasing", MIXED, 100, [[2], [9, 0], [4, 3], [6, 5], [8, 7], [1]]),
    ("modified_first_fit_decreasing", SMALL, 100, [[8, 0], [7, 1], [6, 2], [5, 3], [4]]),
    ("modified_first_fit_decreasing", SAME, 100, [[3, 4], [0, 1, 2]]),
    ("modified_first_fit_decreasing", MAXED, 100, [[0], [1], [2]]),
    (
        "modified_first_fit_decreasing",
        MEDIUM,
        100,
        [[7], [16], [6, 8], [15], [5, 0], [14, 9], [4, 1], [13, 10], [3, 2], [12, 11]],
    ),
]


@pytest.mark.parametrize(("algorithm", "lengths", "capacity", "expected"), SPEC_CASES)
def test_spec_concrete_outputs(
    algorithm: str, lengths: list[int], capacity: int, expected: list[list[int]]
) -> None:
    assert get_packer(algorithm, capacity).pack(lengths) == expected
    assert pack(lengths, capacity, algorithm=algorithm).bins() == expected
    assert ref.get_packer(algorithm, capacity).pack(lengths) == expected


@pytest.mark.parametrize(
    ("algorithm", "expected"),
    [
        ("concatenative", [[0, 1], [4], [5], [6], [7], [8], [3], [2]]),
        ("first_fit_decreasing", [[8, 0], [7], [6], [5], [4], [3], [2], [1]]),
    ],
)
def test_spec_min_bin_count_examples(algorithm: str, expected: list[list[int]]) -> None:
    assert get_packer(algorithm, 100, min_bin_count=8).pack(SMALL) == expected
    assert pack(SMALL, 100, algorithm=algorithm, min_bins=8).bins() == expected


def test_pack_first_fit_shuffle_seed_is_random_random_seed() -> None:
    lengths = [random.Random(5).randint(1, 100) for _ in range(200)]
    state = random.getstate()
    a = pack(lengths, 100, algorithm="first_fit_shuffle", seed=11)
    assert random.getstate() == state, "pack(seed=...) never touches the global state"
    random.seed(11)
    expected = ref.get_packer("first_fit_shuffle", 100).pack(lengths)
    assert a.bins() == expected
    b = pack(lengths, 100, algorithm="first_fit_shuffle", seed=12)
    assert a.bins() != b.bins()


# ----------------------------------------------------------------------------- pack()


def test_pack_flat_result() -> None:
    lengths = np.array([3, 7, 2, 8, 5, 5], dtype=np.int64)
    p = pack(lengths, 10)
    assert p.algorithm == "best_fit_decreasing"
    assert p.num_bins == 3 == p.lower_bound
    assert p.efficiency == 1.0
    assert p.bins() == [[3, 2], [1, 0], [4, 5]]
    assert p.bin(1).tolist() == [1, 0]
    assert p.bin_loads.tolist() == [10, 10, 10]
    assert p.oversize.tolist() == [] and p.bin_media is None
    assert "num_bins=3" in repr(p)
    check_invariants(p, lengths.tolist(), 10)


def test_bins_leaves_the_garbage_collector_as_it_was() -> None:
    # csr_to_lists pauses the cyclic GC while it builds the lists, then restores its state
    p = pack(np.arange(1, 2001, dtype=np.int64), 4000, algorithm="concatenative")
    expected = [p.bin(b).tolist() for b in range(p.num_bins)]
    was_enabled = gc.isenabled()
    try:
        for enabled in (True, False):
            (gc.enable if enabled else gc.disable)()
            assert p.bins() == expected
            assert gc.isenabled() == enabled
    finally:
        (gc.enable if was_enabled else gc.disable)()


def test_pack_keeps_a_private_copy_and_converts_other_ints() -> None:
    lengths = np.array([5, 6, 7], dtype=np.int64)
    kept = pack(lengths, 10).item_lengths
    assert kept is not lengths and not np.shares_memory(kept, lengths)
    assert kept.tolist() == [5, 6, 7]
    for dtype in (np.int8, np.uint16, np.int32, np.uint64):
        assert pack(lengths.astype(dtype), 10).bins() == pack(lengths, 10).bins()
    assert pack([5, 6, 7], 10).bins() == pack(lengths, 10).bins()
    assert pack(lengths[::-1], 10).bins() == pack([7, 6, 5], 10).bins()


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_every_algorithm_on_empty_input(algorithm: str) -> None:
    p = pack([], 10, algorithm=algorithm)
    assert p.num_bins == 0 and p.bins() == [] and p.efficiency == 0.0 and p.lower_bound == 0


@pytest.mark.parametrize(
    "algorithm",
    ["best_fit_decreasing", "first_fit_decreasing", "first_fit_shuffle", "concatenative"],
)
def test_media_budget_and_max_items(algorithm: str) -> None:
    rnd = random.Random(0)
    lengths = [rnd.randint(1, 100) for _ in range(300)]
    media = [rnd.choice([0, 0, 1, 2, 4]) for _ in range(300)]
    p = pack(lengths, 100, algorithm=algorithm, media=media, media_capacity=4, max_items_per_bin=3)
    check_invariants(p, lengths, 100, media=media, media_capacity=4, max_items=3)


def test_minimum_bin_slack_beats_best_fit_on_a_hard_input() -> None:
    rng = np.random.default_rng(3)
    lengths = np.clip(np.rint(rng.lognormal(np.log(0.3 * 1000), 0.5, 3000)), 16, 1000)
    lengths = lengths.astype(np.int64)
    bfd = pack(lengths, 1000)
    mbs = pack(lengths, 1000, algorithm="minimum_bin_slack")
    assert mbs.num_bins < bfd.num_bins
    check_invariants(mbs, lengths.tolist(), 1000)
    assert pack(lengths, 1000, algorithm="mbs").bins() == mbs.bins()


def test_on_oversize_skip_and_truncate() -> None:
    lengths = [5, 20, 7, 11, 3]
    skipped = pack(lengths, 10, on_oversize="skip")
    assert skipped.oversize.tolist() == [1, 3]
    check_invariants(skipped, lengths, 10, on_oversize="skip")
    truncated = pack(lengths, 10, on_oversize="truncate")
    assert truncated.oversize.tolist() == [1, 3]
    check_invariants(truncated, lengths, 10, on_oversize="truncate")
    media = [0, 0, 5, 0, 0]
    skipped = pack(lengths, 10, media=media, media_capacity=4, on_oversize="skip")
    assert skipped.oversize.tolist() == [1, 2, 3]
    with pytest.raises(errors.ItemTooLargeError, match="item 2 has media 5"):
        pack(lengths, 10, media=media, media_capacity=4, on_oversize="truncate")


def test_min_bins_and_multiple_in_pack() -> None:
    p = pack([5, 5, 5, 5], 10, min_bins=3)
    assert p.num_bins == 3
    p = pack([5, 5, 5, 5, 5], 10, bins_multiple_of=4)
    assert p.num_bins == 4
    check_invariants(p, [5] * 5, 10)


def test_pack_is_deterministic() -> None:
    rnd = random.Random(9)
    lengths = [rnd.randint(1, 500) for _ in range(2000)]
    for algorithm in ALGORITHMS:
        a = pack(lengths, 1000, algorithm=algorithm, seed=3)
        b = pack(np.array(lengths), 1000, algorithm=algorithm, seed=3)
        assert a.bins() == b.bins()


# ----------------------------------------------------------------------------- errors


def test_error_item_too_large_names_index_and_length() -> None:
    with pytest.raises(errors.ItemTooLargeError, match=r"item 2 has length 11.*capacity 10"):
        pack([1, 2, 11, 12], 10)
    assert issubclass(errors.ItemTooLargeError, errors.MmpackError)
    assert issubclass(errors.ItemTooLargeError, ValueError)


@pytest.mark.parametrize("bad", [0, -3])
def test_error_invalid_length(bad: int) -> None:
    with pytest.raises(errors.InvalidLengthError, match=f"item 1 has length {bad}"):
        pack([1, bad, 2], 10)


def test_error_negative_media() -> None:
    with pytest.raises(errors.InvalidLengthError, match="item 0 has media -1"):
        pack([1, 2], 10, media=[-1, 0], media_capacity=3)


@pytest.mark.parametrize(
    "lengths", [[1.0, 2.0], [1.5], np.array([True, False]), ["a"], np.ones((2, 2), np.int64)]
)
def test_error_non_integer_lengths(lengths: object) -> None:
    with pytest.raises(errors.PackingDtypeError) as info:
        pack(lengths, 10)  # type: ignore[arg-type]
    assert isinstance(info.value, TypeError) and isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"capacity": 0}, "capacity: must be >= 1"),
        ({"capacity": 2.5}, "capacity: must be an integer"),
        ({"capacity": True}, "capacity: must be an integer"),
        ({"capacity": 2**63}, r"capacity: must be <= 2\*\*63 - 1, got 9223372036854775808"),
        ({"max_items_per_bin": 2**64}, r"max_items_per_bin: must be <= 2\*\*63 - 1"),
        ({"algorithm": "nope"}, "unknown algorithm 'nope'"),
        ({"max_items_per_bin": 0}, "max_items_per_bin: must be >= 1"),
        ({"min_bins": -1}, "min_bins: must be >= 0"),
        ({"bins_multiple_of": 0}, "bins_multiple_of: must be >= 1"),
        ({"on_oversize": "drop"}, "on_oversize: 'drop'"),
        ({"media": [1, 1, 1]}, "media_capacity: is required"),
        ({"media_capacity": 3}, "media: is required"),
        ({"media": [1], "media_capacity": 3}, "media: has 1 entries but lengths has 3"),
        (
            {"algorithm": "modified_first_fit_decreasing", "max_items_per_bin": 2},
            "does not support max_items_per_bin",
        ),
        (
            {"algorithm": "minimum_bin_slack", "media": [0, 0, 0], "media_capacity": 1},
            "does not support a media budget",
        ),
    ],
)
def test_error_bad_arguments(kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = {"capacity": 10, **kwargs}
    capacity = args.pop("capacity")
    with pytest.raises(errors.PackingArgumentError, match=match):
        pack([1, 2, 3], capacity, **args)  # type: ignore[arg-type]


def test_error_bin_count() -> None:
    with pytest.raises(errors.BinCountError, match="Cannot create 4 bins with only 3 sequences"):
        pack([1, 2, 3], 10, min_bins=4)


def test_error_native_arguments_are_typed() -> None:
    from mmpack import _native

    lengths = np.array([1, 2, 3], dtype=np.int64)
    with pytest.raises(errors.PackingArgumentError, match="order"):
        _native.pack(lengths, 10, "first_fit_shuffle", order=np.array([0, 0, 1]))
    with pytest.raises(errors.PackingArgumentError, match="order"):
        _native.pack(lengths, 10, "first_fit_shuffle")
    with pytest.raises(errors.PackingArgumentError, match="capacity"):
        _native.pack(lengths, 0, "concatenative")
    with pytest.raises(errors.PackingArgumentError, match="random_state"):
        _native.shuffle_permutation(np.zeros(3, np.uint32), 0, 5)
    with pytest.raises(errors.PackingArgumentError, match="num_ranks"):
        _native.assign_to_ranks(np.array([0, 3]), lengths, lengths, 0, "tokens")
    with pytest.raises(errors.PackingArgumentError, match="item 7 is out of range"):
        _native.assign_to_ranks(np.array([0, 1]), np.array([7]), lengths, 1, "tokens")


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_huge_capacity_and_lengths_do_not_overflow(algorithm: str) -> None:
    capacity = 2**62
    lengths = [2**60 + 1, 2**61, 3, 2**62 - 5, 2**59]
    p = pack(lengths, capacity, algorithm=algorithm)
    check_invariants(p, lengths, capacity)
    with pytest.raises(errors.IndexOverflowError, match="bin loads"):
        pack([2**62] * 3, 2**62, algorithm=algorithm)  # the total overflows int64


def test_csr_to_lists_rejects_bad_offsets() -> None:
    from mmpack import _native

    items = np.arange(3, dtype=np.int64)
    assert _native.csr_to_lists(np.array([0, 2, 3]), items) == [[0, 1], [2]]
    with pytest.raises(errors.PackingArgumentError, match=r"bad bin range 2\.\.1"):
        _native.csr_to_lists(np.array([0, 2, 1]), items)
    with pytest.raises(errors.PackingArgumentError, match=r"bad bin range 0\.\.9"):
        _native.csr_to_lists(np.array([0, 9]), items)


def test_bools_inside_a_list_are_not_lengths() -> None:
    with pytest.raises(errors.PackingDtypeError, match="bools"):
        pack([True, 2], 10)


def test_lengths_rewritten_by_another_thread_during_pack_are_never_read() -> None:
    # The core packs with the GIL released: it must work on its own copy of the lengths, so a
    # thread rewriting the caller's array cannot turn checked values into unchecked ones.
    import threading
    from concurrent.futures import ThreadPoolExecutor

    arr = np.full(2_000_000, 3, dtype=np.int64)
    stop = threading.Event()

    def scribble() -> int:
        rounds = 0
        while not stop.is_set():
            arr[:] = 10**12
            arr[:] = 3
            rounds += 1
        return rounds

    pool = ThreadPoolExecutor(1)
    scribbler = pool.submit(scribble)
    try:
        for algorithm in ("best_fit_decreasing", "first_fit_decreasing"):
            arr[:] = 3
            try:
                p = pack(arr, 100, algorithm=algorithm, on_oversize="skip")
            except errors.MmpackError:
                continue  # a consistent snapshot with oversize items is a fine outcome
            # a snapshot taken while every length read 10**12 skips them all: no bins at all
            assert p.bin_loads.size == 0 or int(p.bin_loads.max()) <= 100
    finally:
        stop.set()
        pool.shutdown()
    scribbler.result(timeout=0)  # the scribbler's own error, if it had one, fails the test
