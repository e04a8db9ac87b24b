"""mmpack.packing.ranks (re-exported by mmpack.packing): bins over data-parallel ranks."""

from __future__ import annotations

import random

import pytest
from mmpack import errors, packing
from mmpack.packing import pack, ranks
from mmpack.packing.ranks import assign_to_ranks


def test_packing_re_exports_the_rank_api() -> None:
    assert packing.assign_to_ranks is ranks.assign_to_ranks
    assert packing.RankAssignment is ranks.RankAssignment


def test_assign_to_ranks_balances_and_orders() -> None:
    rnd = random.Random(1)
    lengths = [rnd.randint(1, 1000) for _ in range(5000)]
    p = pack(lengths, 1000, bins_multiple_of=8)
    for cost in ("tokens", "tokens_squared"):
        a = assign_to_ranks(p, 8, cost=cost)
        ranks = a.ranks()
        assert a.num_ranks == 8
        assert sorted(b for r in ranks for b in r) == list(range(p.num_bins))
        assert len({len(r) for r in ranks}) == 1, "equal bin counts when divisible"
        for r, bins in enumerate(ranks):
            costs = [a.bin_costs[b] for b in bins]
            assert costs == sorted(costs, reverse=True)
            assert sum(costs) == a.rank_costs[r]
        assert 1.0 <= a.imbalance < 1.01
    squared = assign_to_ranks(p, 8, cost="tokens_squared")
    b0 = p.bin(0).tolist()
    assert squared.bin_costs[0] == sum(lengths[i] ** 2 for i in b0)


def test_assign_to_ranks_uneven_and_errors() -> None:
    p = pack([5, 5, 5], 5)
    a = assign_to_ranks(p, 2)
    assert sorted(len(r) for r in a.ranks()) == [1, 2]
    assert a.imbalance == pytest.approx(10 / 7.5)
    assert assign_to_ranks(pack([], 5), 3).imbalance == 1.0
    with pytest.raises(errors.PackingArgumentError, match="num_ranks"):
        assign_to_ranks(p, 0)
    with pytest.raises(errors.PackingArgumentError, match="cost"):
        assign_to_ranks(p, 2, cost="flops")
    truncated = pack([5, 50], 10, on_oversize="truncate")
    assert assign_to_ranks(truncated, 1).rank_costs.tolist() == [15]
    with pytest.raises(TypeError, match="needs a Packing"):
        assign_to_ranks(None, 2)  # type: ignore[arg-type]


def test_assign_to_ranks_more_ranks_than_bins() -> None:
    """Empty ranks are fine; a rank count whose arrays cannot exist is a typed error."""
    p = pack([5, 3, 2], 5)  # bins [5], [3, 2]
    a = assign_to_ranks(p, 5)
    assert a.ranks() == [[0], [1], [], [], []]
    assert a.rank_costs.tolist() == [5, 5, 0, 0, 0]
    for huge in (2**62, 2**63 - 1):  # in int64, but the per-rank arrays overflow memory
        with pytest.raises(errors.PackingArgumentError, match=r"num_ranks.*do not fit in memory"):
            assign_to_ranks(p, huge)
    with pytest.raises(errors.PackingArgumentError, match=r"num_ranks: must be <= 2\*\*63 - 1"):
        assign_to_ranks(p, 2**63)
