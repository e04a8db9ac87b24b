"""mmpack.compat.nemo_rl.packing: NeMo-RL's packer API (get_packer, SequencePacker,
PackingAlgorithm, PackingMetrics) against the NeMo-RL spec and the reference, and the
deprecated old path mmpack.packing.<name>."""

from __future__ import annotations

import random

import pytest
from mmpack import _moved, errors, packing
from mmpack.compat.nemo_rl import packing as nemo_rl_packing
from mmpack.compat.nemo_rl.packing import (
    PackingAlgorithm,
    PackingMetrics,
    SequencePacker,
    get_packer,
)
from reference import packing as ref
from support.packing import MEDIUM, SAME, SMALL


@pytest.fixture(autouse=True)
def _forget_old_names() -> None:
    """An old name is bound on ``mmpack.packing`` once it warned; each test starts without."""
    for name in _moved.MOVED_NAMES["mmpack.packing"]:
        vars(packing).pop(name, None)


@pytest.mark.parametrize("name", sorted(nemo_rl_packing.__all__))
def test_old_path_warns_and_returns_the_same_object(name: str) -> None:
    with pytest.warns(
        DeprecationWarning,
        match=rf"mmpack\.packing\.{name} moved to mmpack\.compat\.nemo_rl\.packing",
    ):
        old = getattr(packing, name)
    assert old is getattr(nemo_rl_packing, name)


def test_every_public_facade_name_has_an_old_path() -> None:
    moved = _moved.MOVED_NAMES["mmpack.packing"]
    assert set(nemo_rl_packing.__all__) == set(moved)
    assert set(moved.values()) == {nemo_rl_packing.__name__}
    assert not set(nemo_rl_packing.__all__) & set(packing.__all__)


def test_old_path_from_import_warns_once_and_unknown_names_still_fail() -> None:
    with pytest.warns(DeprecationWarning, match="get_packer") as caught:
        from mmpack.packing import get_packer as old_get_packer
    assert len(caught) == 1 and caught[0].filename == __file__  # the user's line, once
    assert old_get_packer("concatenative", 10).pack([4, 5, 6]) == [[0, 1], [2]]
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        packing.nope  # noqa: B018


def test_pack_accepts_the_facade_enum() -> None:
    for algorithm in PackingAlgorithm:
        assert packing.pack([3, 4], 10, algorithm=algorithm).algorithm == algorithm.value


def test_spec_mffd_with_constraints_and_shard_loads() -> None:
    lengths = [46, 24, 55, 88, 11, 14, 73, 17]
    packer = get_packer("modified_first_fit_decreasing", 100, None, 2, 2)
    bins = packer.pack(lengths)
    assert bins == [[3, 4], [6, 5], [2, 7, 1], [0]]
    loads = [sum(lengths[i] for i in b) for b in bins]
    assert loads[:2] == [99, 87] and loads[2:] == [96, 46]


@pytest.mark.parametrize("algorithm", list(PackingAlgorithm))
def test_spec_empty_and_single(algorithm: PackingAlgorithm) -> None:
    assert get_packer(algorithm, 100).pack([]) == []
    assert get_packer(algorithm, 100).pack([50]) == [[0]]
    assert get_packer(algorithm, 100, bin_count_multiple=4).pack([]) == []


@pytest.mark.parametrize("algorithm", list(PackingAlgorithm))
def test_spec_too_long_for_every_algorithm(algorithm: PackingAlgorithm) -> None:
    with pytest.raises(ValueError, match="Sequence length 150 exceeds bin capacity 100"):
        get_packer(algorithm, 100).pack([50, 150, 70])


def test_spec_first_fit_decreasing_reports_the_largest() -> None:
    with pytest.raises(errors.ItemTooLargeError, match="Sequence length 300 exceeds"):
        get_packer("first_fit_decreasing", 100).pack([150, 300, 200])
    with pytest.raises(errors.ItemTooLargeError, match="Sequence length 150 exceeds"):
        get_packer("concatenative", 100).pack([150, 300, 200])


@pytest.mark.parametrize("algorithm", list(PackingAlgorithm))
def test_spec_random_inputs_and_constraints_match_reference(
    algorithm: PackingAlgorithm,
) -> None:
    rnd = random.Random(42)
    for n in (100, 100, 100):
        lengths = [rnd.randint(10, 90) for _ in range(n)]
        natural = len(ref.get_packer(algorithm.name, 100).pack(lengths))
        for kwargs in (
            {},
            {"min_bin_count": natural},
            {"min_bin_count": natural + 2},
            {"bin_count_multiple": 4},
            {"min_bin_count": natural + 1, "bin_count_multiple": 3},
        ):
            random.seed(7)
            ours = get_packer(algorithm, 100, **kwargs).pack(lengths)
            random.seed(7)
            theirs = ref.get_packer(algorithm.name, 100, **kwargs).pack(lengths)
            assert ours == theirs
            assert all(ours)


def test_spec_insufficient_sequences() -> None:
    with pytest.raises(errors.BinCountError, match="Cannot create 3 bins with only 2 sequences"):
        get_packer("first_fit_decreasing", 100, min_bin_count=3).pack([50, 50])
    with pytest.raises(ValueError, match="Cannot create 4 bins with only 2 sequences"):
        get_packer("concatenative", 100, bin_count_multiple=4).pack([50, 50])
    with pytest.raises(errors.BinCountError, match="Cannot create 1 bins with only 0 sequences"):
        get_packer("concatenative", 100, min_bin_count=1).pack([])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"min_bin_count": -1}, "min_bin_count must be nonnegative"),
        ({"bin_count_multiple": 0}, "bin_count_multiple must be positive"),
        ({"bin_count_multiple": -5}, "bin_count_multiple must be positive"),
    ],
)
def test_spec_constraint_errors(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(errors.PackingArgumentError, match=message):
        get_packer("first_fit_decreasing", 100, **kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [{"min_bin_count": 2**64}, {"min_bin_count": "3"}, {"bin_count_multiple": 2**63}],
    ids=repr,
)
def test_spec_constraint_types_and_int64(kwargs: dict[str, object]) -> None:
    name = next(iter(kwargs))
    with pytest.raises(errors.PackingArgumentError, match=f"invalid packing argument {name}"):
        get_packer("first_fit_decreasing", 100, **kwargs)  # type: ignore[arg-type]


def test_bin_capacity_is_checked_when_packing() -> None:
    for bad, message in ((0, "bin_capacity must be positive"), (2**63, "<= 2"), (1.5, "integer")):
        packer = get_packer("first_fit_decreasing", bad)  # type: ignore[arg-type]
        with pytest.raises(errors.PackingArgumentError, match=message):
            packer.pack([1])


def test_get_packer_names_and_errors() -> None:
    for algorithm in PackingAlgorithm:
        packer = get_packer(algorithm, 100)
        assert isinstance(packer, SequencePacker)
        assert type(get_packer(algorithm.name.lower(), 100)) is type(packer)
        assert type(get_packer(ref.PackingAlgorithm[algorithm.name], 100)) is type(packer)
    with pytest.raises(ValueError, match=r"Unknown packing algorithm: nope\. Available"):
        get_packer("nope", 100)
    with pytest.raises(errors.PackingArgumentError, match="Unknown packing algorithm"):
        get_packer(object(), 100)  # type: ignore[arg-type]
    packer = get_packer("concatenative", 7, True, 2, 3)
    assert (packer.bin_capacity, packer.collect_metrics) == (7, True)
    assert (packer.min_bin_count, packer.bin_count_multiple) == (2, 3)


def test_first_fit_shuffle_uses_and_advances_the_global_random_state() -> None:
    lengths = [random.Random(3).randint(1, 100) for _ in range(300)]
    random.seed(42)
    ours = get_packer("first_fit_shuffle", 100).pack(lengths)
    after_ours = random.random()
    random.seed(42)
    theirs = ref.get_packer("first_fit_shuffle", 100).pack(lengths)
    after_theirs = random.random()
    assert ours == theirs
    assert after_ours == after_theirs


def test_facade_metrics_match_reference() -> None:
    ours = get_packer("modified_first_fit_decreasing", 100, collect_metrics=True)
    theirs = ref.get_packer("modified_first_fit_decreasing", 100, collect_metrics=True)
    for lengths in (MEDIUM, SMALL, SAME):
        assert ours.pack(lengths) == theirs.pack(lengths)
    assert ours.get_aggregated_metrics() == theirs.get_aggregated_metrics()
    bins = ours.pack(MEDIUM)
    stats = ours.compute_metrics(MEDIUM, bins)
    assert stats == theirs.compute_metrics(MEDIUM, bins)
    assert stats["num_bins"] == 10 and stats["total_sequence_length"] == 975
    assert stats["average_utilization"] == 0.975 and stats["bin_efficiency"] == 1.0
    assert abs(stats["bin_balance"] - 0.95016) < 1e-5
    ours.reset_metrics()
    assert ours.get_aggregated_metrics() == {}
    assert get_packer("concatenative", 100).get_aggregated_metrics() == {}
    assert PackingMetrics().calculate_stats_only([], [], 100)["num_bins"] == 0


def test_print_metrics(capsys: pytest.CaptureFixture[str]) -> None:
    get_packer("concatenative", 100).print_metrics()
    assert "not enabled" in capsys.readouterr().out
    packer = get_packer("concatenative", 100, collect_metrics=True)
    packer.print_metrics()
    assert "No metrics collected yet." in capsys.readouterr().out
    packer.pack(SMALL)
    packer.print_metrics()
    assert "Total bins used: 6" in capsys.readouterr().out


def test_facade_zero_lengths_like_nemo_rl() -> None:
    lengths = [0, 5, 0, 10, 0]
    for name in ("concatenative", "first_fit_decreasing", "first_fit_shuffle"):
        random.seed(1)
        ours = get_packer(name, 10).pack(lengths)
        random.seed(1)
        assert ours == ref.get_packer(name, 10).pack(lengths)
    with pytest.raises(ValueError, match="sequence lengths must be positive"):
        get_packer("modified_first_fit_decreasing", 10).pack(lengths)
