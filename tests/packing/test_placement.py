"""mmpack.packing.placement: ``place`` / ``placement_of`` against the plain-Python oracle
(tests/reference/placement.py) on random small inputs (costs, unique segments per rank, groups,
lower bound, balanced counts, baselines, bins), the guarantees of the candidate choice, the
GRPO G-expansion shape, one test per typed error, garbage input (typed errors only, never a
panic) and the edge cases."""

from __future__ import annotations

import itertools
import math
import random
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from mmpack import errors
from mmpack.packing import pack
from mmpack.packing.placement import PlacementCost, RankPlacement, place, placement_of
from reference import placement as ref

REL = 1e-9

# ----------------------------------------------------------------------------- strategies

COSTS = {
    "default": PlacementCost(),
    "vision_heavy": PlacementCost(token=1.0, attention=1e-4, patch=2.0, patch_attention=1e-3),
    "llm_only": PlacementCost(patch=0.0),
    "vision_only": PlacementCost(token=0.0, attention=0.0, patch=1.0),
}

# integer costs: every sum is exact, so comparisons against the tolerance are exact too
INT_COSTS = [
    PlacementCost(token=1.0, attention=0.0, patch=1.0, patch_attention=0.0),
    PlacementCost(token=1.0, attention=1.0, patch=3.0, patch_attention=0.0),
    PlacementCost(token=2.0, attention=0.0, patch=0.0, patch_attention=1.0),
    PlacementCost(token=0.0, attention=1.0, patch=1.0, patch_attention=1.0),
]


@st.composite
def row_segments(draw: st.DrawFn, n: int) -> tuple[list[list[int]], int]:
    """Per-row segment ids in one of several sharing shapes, and how many ids exist."""
    shape = draw(st.sampled_from(["none", "random", "chains", "prompts", "one", "mixed"]))
    if shape == "none" or n == 0:
        return [[] for _ in range(n)], draw(st.integers(0, 3))
    if shape == "one":  # every row shares one segment (one row may also have none)
        segs = [[0] for _ in range(n)]
        if draw(st.booleans()):
            segs[draw(st.integers(0, n - 1))] = []
        return segs, 1 + draw(st.integers(0, 2))
    if shape == "chains":  # row i uses ids i and i+1 sometimes: partial sharing along a chain
        segs = []
        for i in range(n):
            row = [i] if draw(st.booleans()) else []
            if draw(st.booleans()):
                row.append(i + 1)
            segs.append(row)
        return segs, n + 1
    if shape == "prompts":  # G rows per prompt share the prompt's 1-2 segments
        g = draw(st.integers(1, 8))
        segs = []
        for i in range(n):
            p = i // g
            row = [2 * p] + ([2 * p + 1] if draw(st.booleans()) else [])
            segs.append(row)
        return segs, 2 * (n // g + 1)
    pool = draw(st.integers(1, max(1, n) + 2))
    segs = [
        draw(st.lists(st.integers(0, pool - 1), max_size=4 if shape == "random" else 2))
        for _ in range(n)
    ]
    if shape == "mixed":  # a few rows with many ids, repeats included
        for _ in range(draw(st.integers(0, 3))):
            segs[draw(st.integers(0, n - 1))] += draw(
                st.lists(st.integers(0, pool - 1), min_size=2, max_size=6)
            )
    return segs, pool + draw(st.integers(0, 2))


@st.composite
def placement_cases(
    draw: st.DrawFn, *, max_rows: int = 60, integer_costs: bool = False, bins: bool | None = None
) -> dict:
    """A random placement problem: rows, segments, patches, cost, ranks, options, maybe bins."""
    n = draw(st.integers(0, max_rows))
    lengths = draw(
        st.lists(
            st.one_of(st.just(0), st.integers(1, 40), st.integers(1, 3000)), min_size=n, max_size=n
        )
    )
    segs, num_segments = draw(row_segments(n))
    patches = draw(
        st.lists(
            st.one_of(st.just(0), st.integers(1, 64), st.integers(1, 4000)),
            min_size=num_segments,
            max_size=num_segments,
        )
    )
    cost = (
        draw(st.sampled_from(INT_COSTS))
        if integer_costs
        else draw(st.sampled_from(list(COSTS.values()) + INT_COSTS))
    )
    case: dict = {
        "lengths": lengths,
        "num_ranks": draw(st.integers(1, 9)),
        "segments": segs,
        "patches": patches,
        "cost": cost,
        "tolerance": draw(st.sampled_from([0.0, 0.01, 0.05, 0.2, 1.0])),
        "balance_counts": draw(st.booleans()),
        "flat": draw(st.booleans()),
        "bins": None,
    }
    use_bins = draw(st.booleans()) if bins is None else bins
    if use_bins and n:
        if draw(st.booleans()):
            cap = draw(st.integers(1, 6000))
            packed = pack([max(x, 1) for x in lengths], cap, on_oversize="skip")
            case["bins"] = packed
        else:  # a random partition of a random subset of the rows, as CSR
            rows = draw(st.permutations(list(range(n))))
            rows = rows[: draw(st.integers(0, n))]
            cuts = sorted(draw(st.lists(st.integers(0, len(rows)), max_size=8)))
            offsets = [0, *cuts, len(rows)]
            case["bins"] = (offsets, list(rows))
    return case


def kwargs_of(case: dict) -> dict:
    """``place``/``placement_of`` keyword arguments for a case (list-of-lists or flat CSR)."""
    kw: dict = {"patches": case["patches"], "cost": case["cost"], "bins": case["bins"]}
    if case["flat"]:
        counts = [len(s) for s in case["segments"]]
        kw["segment_offsets"] = [0, *np.cumsum(counts).tolist()] if counts else [0]
        kw["segments"] = [i for s in case["segments"] for i in s]
    else:
        kw["segments"] = case["segments"]
    return kw


def run(case: dict, **extra: object) -> RankPlacement:
    return place(
        case["lengths"],
        case["num_ranks"],
        tolerance=case["tolerance"],
        balance_counts=case["balance_counts"],
        **kwargs_of(case),
        **extra,
    )


def bins_rows(bins: object) -> list[list[int]]:
    if bins is None:
        return []
    if hasattr(bins, "bins"):
        return bins.bins()
    offsets, rows = bins
    return [list(rows[a:b]) for a, b in itertools.pairwise(offsets)]


def oracle_items(case: dict) -> tuple[list[float], list[list[int]], list[float]]:
    """The oracle's items: rows, or the case's bins (summed cost, union of segments)."""
    c = case["cost"]
    costs = ref.row_costs(case["lengths"], c.token, c.attention)
    seg_costs = ref.segment_costs_of(case["patches"], c.patch, c.patch_attention)
    segs = case["segments"]
    if case["bins"] is not None:
        costs, segs = ref.bin_items(bins_rows(case["bins"]), costs, segs)
    return costs, segs, seg_costs


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=REL, abs_tol=0.0)


def assert_close_lists(got: object, want: list[float]) -> None:
    got_list = np.asarray(got, dtype=np.float64).tolist()
    assert len(got_list) == len(want)
    assert all(close(g, w) for g, w in zip(got_list, want, strict=True)), (got_list, want)


def check_structure(p: RankPlacement, num_items: int, num_ranks: int) -> None:
    """Every item once on a rank in range; ranks()/rank_offsets/item_indices agree."""
    ranks = p.item_ranks.tolist()
    assert len(ranks) == num_items
    assert all(0 <= r < num_ranks for r in ranks)
    assert p.num_ranks == num_ranks
    want = [[i for i in range(num_items) if ranks[i] == r] for r in range(num_ranks)]
    assert p.ranks() == want
    assert p.rank_items.tolist() == [len(w) for w in want]
    assert p.rank_offsets.tolist() == [0, *np.cumsum([len(w) for w in want]).tolist()]
    assert sorted(p.item_indices.tolist()) == list(range(num_items))
    for r in range(num_ranks):
        a, b = p.rank_offsets[r], p.rank_offsets[r + 1]
        assert p.item_indices[a:b].tolist() == want[r]


def check_against_oracle(p: RankPlacement, case: dict) -> None:
    """Costs, unique segments, encodes, groups, split groups and bound equal the oracle's."""
    costs, segs, seg_costs = oracle_items(case)
    r = case["num_ranks"]
    ranks = p.item_ranks.tolist()
    want_costs, want_segs, want_items = ref.rank_costs(ranks, costs, segs, seg_costs, r)
    assert_close_lists(p.rank_costs, want_costs)
    assert p.rank_segments.tolist() == want_segs
    assert p.rank_items.tolist() == want_items
    assert p.encodes == sum(want_segs)
    assert p.unique_segments == len({s for row in segs for s in row})
    groups = ref.groups(segs)
    assert p.item_groups.tolist() == groups
    assert p.split_groups == ref.split_groups(ranks, groups)
    assert close(p.lower_bound, ref.lower_bound(costs, segs, seg_costs, r))
    assert close(p.worst, max(want_costs, default=0.0))


def counts_within_one(p: RankPlacement, num_items: int) -> None:
    counts = p.rank_items.tolist()
    assert max(counts) - min(counts) <= 1, counts
    if num_items % len(counts) == 0:
        assert len(set(counts)) == 1, counts


def num_items_of(case: dict) -> int:
    return len(bins_rows(case["bins"])) if case["bins"] is not None else len(case["lengths"])


# ----------------------------------------------------------------------------- properties


@given(placement_cases())
def test_every_item_is_placed_once_and_the_views_agree(case: dict) -> None:
    p = run(case)
    check_structure(p, num_items_of(case), case["num_ranks"])
    assert p.kind in ("groups", "split")


@given(placement_cases())
def test_costs_segments_groups_and_bound_equal_the_oracle(case: dict) -> None:
    check_against_oracle(run(case), case)


@given(placement_cases())
def test_balance_counts_keeps_counts_within_one(case: dict) -> None:
    case["balance_counts"] = True
    counts_within_one(run(case), num_items_of(case))


@given(placement_cases())
def test_worst_rank_is_never_below_the_lower_bound(case: dict) -> None:
    p = run(case)
    assert p.worst >= p.lower_bound * (1 - 1e-12)
    assert p.imbalance >= 1.0 - 1e-12


@given(placement_cases())
def test_placement_of_the_result_reproduces_its_costs(case: dict) -> None:
    p = run(case)
    q = placement_of(p.item_ranks, case["lengths"], case["num_ranks"], **kwargs_of(case))
    assert q.kind == "given"
    assert q.item_ranks.tolist() == p.item_ranks.tolist()
    assert q.rank_costs.tolist() == p.rank_costs.tolist()
    assert q.rank_segments.tolist() == p.rank_segments.tolist()
    assert q.rank_items.tolist() == p.rank_items.tolist()
    assert q.item_groups.tolist() == p.item_groups.tolist()
    assert q.split_groups == p.split_groups
    assert q.unique_segments == p.unique_segments
    check_structure(q, num_items_of(case), case["num_ranks"])


@given(placement_cases(), st.integers(0, 2**32))
def test_placement_of_any_placement_equals_the_oracle(case: dict, seed: int) -> None:
    n = num_items_of(case)
    rnd = random.Random(seed)
    given_ranks = [rnd.randrange(case["num_ranks"]) for _ in range(n)]
    q = placement_of(given_ranks, case["lengths"], case["num_ranks"], **kwargs_of(case))
    assert q.item_ranks.tolist() == given_ranks
    check_structure(q, n, case["num_ranks"])
    check_against_oracle(q, case)


@given(placement_cases())
def test_same_input_gives_the_same_output(case: dict) -> None:
    a, b = run(case), run(case)
    for name in (
        "item_ranks",
        "rank_offsets",
        "item_indices",
        "rank_costs",
        "rank_segments",
        "rank_items",
        "item_groups",
    ):
        assert getattr(a, name).tolist() == getattr(b, name).tolist(), name
    assert (a.split_groups, a.lower_bound, a.kind, a.unique_segments) == (
        b.split_groups,
        b.lower_bound,
        b.kind,
        b.unique_segments,
    )


def balanced_random(n: int, num_ranks: int, rnd: random.Random) -> list[int]:
    ranks = ref.contiguous(n, num_ranks)
    rnd.shuffle(ranks)
    return ranks


@given(
    placement_cases(),
    st.sampled_from(["round_robin", "contiguous", "shuffled"]),
    st.integers(0, 2**32),
)
def test_a_balanced_baseline_wins_only_when_strictly_better(
    case: dict, shape: str, seed: int
) -> None:
    """With a baseline the result is the baseline when its worst rank is strictly lower than
    the placement made without it, else that placement unchanged; never worse."""
    n, r = num_items_of(case), case["num_ranks"]
    base = {
        "round_robin": ref.round_robin(n, r),
        "contiguous": ref.contiguous(n, r),
        "shuffled": balanced_random(n, r, random.Random(seed)),
    }[shape]
    alone = run(case)
    p = run(case, baseline=base)
    costs, segs, seg_costs = oracle_items(case)
    base_worst = max(ref.rank_costs(base, costs, segs, seg_costs, r)[0], default=0.0)
    assert p.worst <= base_worst * (1 + REL)
    if p.kind == "baseline":
        assert p.item_ranks.tolist() == base
        assert p.worst < alone.worst
    else:
        assert p.item_ranks.tolist() == alone.item_ranks.tolist()
        assert p.kind == alone.kind
    check_against_oracle(p, case)
    if case["balance_counts"]:
        counts_within_one(p, n)


@given(placement_cases(), st.integers(0, 2**32))
def test_never_worse_than_a_random_baseline(case: dict, seed: int) -> None:
    n, r = num_items_of(case), case["num_ranks"]
    rnd = random.Random(seed)
    base = [rnd.randrange(r) for _ in range(n)]
    counts = [base.count(k) for k in range(r)]
    if case.get("balance_counts", True) and max(counts, default=0) - min(counts, default=0) > 1:
        with pytest.raises(errors.PackingArgumentError, match="baseline"):
            run(case, baseline=base)
        return
    p = run(case, baseline=base)
    costs, segs, seg_costs = oracle_items(case)
    base_worst = max(ref.rank_costs(base, costs, segs, seg_costs, r)[0], default=0.0)
    assert p.worst <= base_worst * (1 + REL)
    check_structure(p, n, r)
    check_against_oracle(p, case)


def test_an_unbalanced_baseline_is_refused_under_balance_counts() -> None:
    """balance_counts promises counts within one: a baseline that breaks them is no candidate
    (it would win here: 10+10+10 | 100 beats every balanced placement), and is refused."""
    flat = PlacementCost(attention=0.0)
    with pytest.raises(errors.PackingArgumentError, match="baseline"):
        place([10, 10, 10, 100], 2, baseline=[0, 0, 0, 1], tolerance=0.0, cost=flat)
    p = place(
        [10, 10, 10, 100],
        2,
        baseline=[0, 0, 0, 1],
        tolerance=0.0,
        cost=flat,
        balance_counts=False,
    )
    assert p.worst == 100 and p.rank_items.tolist() in ([3, 1], [1, 3])


@given(placement_cases(integer_costs=True))
def test_whole_groups_kept_when_the_whole_group_lpt_is_within_tolerance(case: dict) -> None:
    """Without balance_counts, LPT over whole groups gives the same rank loads whatever its
    tie-breaking (each group adds its own cost: groups share no segment), so with exact costs:
    the result is never worse than the oracle's whole-group LPT, and where that is within
    tolerance of the bound the whole-group candidate wins (no split, one encode a segment,
    LPT's rank loads)."""
    case["balance_counts"] = False
    costs, segs, seg_costs = oracle_items(case)
    r = case["num_ranks"]
    whole = ref.whole_group_lpt(costs, segs, seg_costs, r, balance_counts=False)
    assert whole is not None
    whole_costs = ref.rank_costs(whole, costs, segs, seg_costs, r)[0]
    whole_worst = max(whole_costs, default=0.0)
    lb = ref.lower_bound(costs, segs, seg_costs, r)
    p = run(case)
    assert p.worst <= whole_worst
    within = lb * (1 + case["tolerance"])
    if whole_worst <= within:
        assert p.kind == "groups"
        assert p.split_groups == 0
        assert p.encodes == p.unique_segments
        assert sorted(p.rank_costs.tolist()) == sorted(whole_costs)
    if p.kind == "groups":
        # whole groups: LPT's, or better where swaps of groups between ranks lowered the worst
        assert p.split_groups == 0
        assert p.encodes == p.unique_segments
    if p.kind == "split":  # splitting only where whole groups were not within tolerance
        assert whole_worst > within


@given(placement_cases(integer_costs=True))
def test_balanced_whole_groups_kept_when_the_reference_lpt_keeps_them(case: dict) -> None:
    """With balance_counts, where the reference LPT (costliest group first to the least-loaded
    rank with room, ties to the first group and the lower rank) keeps every group whole within
    the counts and within tolerance, so does place: same placement, no split."""
    case["balance_counts"] = True
    costs, segs, seg_costs = oracle_items(case)
    r = case["num_ranks"]
    whole = ref.whole_group_lpt(costs, segs, seg_costs, r, balance_counts=True)
    assume(whole is not None)
    whole_costs = ref.rank_costs(whole, costs, segs, seg_costs, r)[0]
    lb = ref.lower_bound(costs, segs, seg_costs, r)
    p = run(case)
    assert p.worst <= max(whole_costs, default=0.0)
    if max(whole_costs, default=0.0) <= lb * (1 + case["tolerance"]):
        assert p.kind == "groups"
        assert p.split_groups == 0
        assert p.encodes == p.unique_segments
        assert p.item_ranks.tolist() == whole


@given(placement_cases())
def test_groups_that_cannot_stay_whole_under_balanced_counts_are_split(case: dict) -> None:
    case["balance_counts"] = True
    _, segs, _ = oracle_items(case)
    groups = ref.groups(segs)
    sizes = [groups.count(g) for g in sorted(set(groups))]
    p = run(case)
    if not ref.whole_group_feasible(sizes, case["num_ranks"]):
        assert p.split_groups >= 1
    if p.split_groups == 0:
        assert ref.whole_group_feasible(sizes, case["num_ranks"])


@given(placement_cases())
def test_a_generous_tolerance_keeps_every_group_whole(case: dict) -> None:
    case["balance_counts"] = False
    case["tolerance"] = 1e9
    p = run(case)
    assert p.kind == "groups"
    assert p.split_groups == 0
    assert p.encodes == p.unique_segments


@given(placement_cases())
def test_whole_group_candidate_never_splits_without_balance_counts(case: dict) -> None:
    case["balance_counts"] = False
    p = run(case)
    if p.kind == "groups":
        assert p.split_groups == 0
        assert p.encodes == p.unique_segments
    assert p.encodes >= p.unique_segments


@given(
    st.integers(1, 8),
    st.integers(1, 6),
    st.integers(1, 16),
    st.integers(1, 2),
    st.booleans(),
    st.integers(0, 2**32),
)
def test_g_expansion_keeps_each_prompt_on_one_rank(
    ranks: int, per_rank: int, g: int, images: int, balance: bool, seed: int
) -> None:
    """P prompts x G rows sharing the prompt's images, P a multiple of the ranks, similar
    lengths: no prompt split, one encode per image, near-perfect balance."""
    rnd = random.Random(seed)
    prompts = ranks * per_rank
    lengths = [rnd.randint(1000, 1010) for _ in range(prompts * g)]
    segments = [[images * (i // g) + k for k in range(images)] for i in range(prompts * g)]
    patches = [rnd.randint(500, 505) for _ in range(prompts * images)]
    p = place(lengths, ranks, segments=segments, patches=patches, balance_counts=balance)
    assert p.split_groups == 0
    assert p.encodes == prompts * images == p.unique_segments
    assert p.kind == "groups"
    assert p.imbalance <= 1.05
    assert p.rank_items.tolist() == [per_rank * g] * ranks
    assert p.item_groups.tolist() == [i // g for i in range(prompts * g)]


@given(placement_cases(bins=True), st.booleans())
def test_bins_are_placed_whole_and_cost_their_rows(case: dict, as_tuple: bool) -> None:
    """With bins the items are bins: every bin on one rank, costs over bins (a bin's segments
    the union of its rows'), and the CSR tuple form equal to the Packing form."""
    assume(case["bins"] is not None)
    if as_tuple and hasattr(case["bins"], "bin_offsets"):
        packed = case["bins"]
        case_tuple = dict(case, bins=(packed.bin_offsets.tolist(), packed.item_indices.tolist()))
        assert run(case_tuple).item_ranks.tolist() == run(case).item_ranks.tolist()
    p = run(case)
    bins = bins_rows(case["bins"])
    check_structure(p, len(bins), case["num_ranks"])
    check_against_oracle(p, case)
    if case["balance_counts"]:
        counts_within_one(p, len(bins))


# ----------------------------------------------------------------------------- concrete cases


def test_zero_rows() -> None:
    p = place([], 3)
    assert p.item_ranks.tolist() == []
    assert p.rank_costs.tolist() == [0.0, 0.0, 0.0]
    assert p.ranks() == [[], [], []]
    assert (p.worst, p.imbalance, p.encodes, p.split_groups, p.lower_bound) == (0.0, 1.0, 0, 0, 0.0)
    q = place([], 2, segments=[], patches=[5, 6])
    assert q.unique_segments == 0
    assert placement_of([], [], 2).rank_costs.tolist() == [0.0, 0.0]


def test_more_ranks_than_rows() -> None:
    p = place([5, 7, 3], 8, segments=[[0], [0], []], patches=[4])
    counts = p.rank_items.tolist()
    assert sorted(counts) == [0] * 5 + [1] * 3, "balanced: one row a rank at most"
    assert p.split_groups == 1  # the shared image is encoded on both ranks
    assert p.encodes == 2
    q = place([5, 7, 3], 8, segments=[[0], [0], []], patches=[4], balance_counts=False)
    check_structure(q, 3, 8)
    assert q.worst >= q.lower_bound


def test_one_giant_group_is_split_and_every_row_placed() -> None:
    """One group costing far more than the per-rank budget: split over the ranks."""
    n = 40
    segs = [[0, 1 + i % 3] for i in range(n)]
    p = place([1000] * n, 4, segments=segs, patches=[10, 5, 5, 5], balance_counts=False)
    check_structure(p, n, 4)
    assert p.kind == "split"
    assert p.split_groups == 1
    assert p.worst <= p.lower_bound * 1.05
    assert p.encodes > p.unique_segments


def test_all_rows_sharing_one_segment() -> None:
    p = place(
        [100] * 8, 2, segments=[[0]] * 8, patches=[50], cost=PlacementCost(attention=0.0, patch=1.0)
    )
    assert p.rank_costs.tolist() == [450.0, 450.0]
    assert p.encodes == 2 and p.unique_segments == 1 and p.split_groups == 1
    assert p.lower_bound == 425.0


def test_one_rank_holds_everything() -> None:
    segs = [[0], [0, 1], [], [2]]
    p = place(
        [3, 4, 5, 6],
        1,
        segments=segs,
        patches=[10, 20, 30],
        cost=PlacementCost(attention=0.0, patch=1.0),
    )
    assert p.item_ranks.tolist() == [0, 0, 0, 0]
    assert p.rank_costs.tolist() == [18.0 + 60.0]
    assert p.lower_bound == 78.0
    assert (p.split_groups, p.encodes, p.kind, p.imbalance) == (0, 3, "groups", 1.0)


def test_a_row_listing_a_segment_twice_is_charged_once() -> None:
    p = place(
        [1, 1],
        1,
        segments=[[0, 0, 0], [0]],
        patches=[7],
        cost=PlacementCost(attention=0.0, patch=1.0),
    )
    assert p.rank_costs.tolist() == [9.0]
    assert p.lower_bound == 9.0


def test_placement_of_reports_the_lower_bound() -> None:
    q = placement_of([0, 1, 1], [3, 4, 5], 2, cost=PlacementCost(attention=0.0))
    assert q.kind == "given"
    assert q.lower_bound == 6.0


def test_patches_may_be_given_empty_without_segments() -> None:
    assert place([1, 2], 2, patches=[]).encodes == 0


# ----------------------------------------------------------------------------- typed errors


def _raises(cls: type[Exception], name: str, fn, *args, **kwargs) -> None:
    with pytest.raises(cls) as info:
        fn(*args, **kwargs)
    assert name in str(info.value), str(info.value)


def test_negative_length_is_invalid_length_error() -> None:
    _raises(errors.InvalidLengthError, "lengths", place, [3, -1], 2)


def test_negative_patch_count_is_invalid_length_error() -> None:
    _raises(errors.InvalidLengthError, "patches", place, [3], 1, segments=[[0]], patches=[-2])


def test_float_lengths_are_packing_dtype_error() -> None:
    _raises(errors.PackingDtypeError, "lengths", place, [1.5, 2.0], 2)
    _raises(errors.PackingDtypeError, "lengths", place, np.array([1.0]), 1)


@pytest.mark.parametrize("bad", [[[5]], [[-1]], [[0, 1]]])
def test_segment_id_out_of_range(bad: list[list[int]]) -> None:
    _raises(errors.PackingArgumentError, "segments", place, [3], 1, segments=bad, patches=[4])


def test_segment_id_out_of_range_flat() -> None:
    _raises(
        errors.PackingArgumentError,
        "segments",
        place,
        [3, 4],
        1,
        segments=[0, 3],
        segment_offsets=[0, 1, 2],
        patches=[4],
    )


def test_patches_missing_with_segments() -> None:
    _raises(errors.PackingArgumentError, "patches", place, [3], 1, segments=[[0]])


def test_patches_or_offsets_without_segments() -> None:
    _raises(errors.PackingArgumentError, "segments", place, [3], 1, patches=[4])
    _raises(errors.PackingArgumentError, "segments", place, [3], 1, segment_offsets=[0, 0])


def test_segments_of_wrong_row_count() -> None:
    _raises(errors.PackingArgumentError, "segments", place, [3, 4], 1, segments=[[0]], patches=[1])


def test_segment_offsets_of_wrong_length() -> None:
    _raises(
        errors.PackingArgumentError,
        "segment_offsets",
        place,
        [3, 4],
        1,
        segments=[0],
        segment_offsets=[0, 1],
        patches=[4],
    )


@pytest.mark.parametrize(
    "offsets",
    [[0, 2, 1], [1, 1, 2], [-1, 0, 1], [0, 1, 3], [0, 1, 1]],
    ids=["non_monotone", "not_from_zero", "negative", "past_the_end", "short_of_the_end"],
)
@pytest.mark.parametrize("with_bins", [False, True])
def test_segment_offsets_not_csr(offsets: list[int], with_bins: bool) -> None:
    bins = ([0, 2], [0, 1]) if with_bins else None
    _raises(
        errors.PackingArgumentError,
        "segment_offsets",
        place,
        [3, 4],
        1,
        segments=[0, 0],
        segment_offsets=offsets,
        patches=[4],
        bins=bins,
    )


def test_segment_ids_of_rows_outside_the_bins_are_still_checked() -> None:
    """Rows a packing left out (skipped as oversize) still have their ids checked."""
    _raises(
        errors.PackingArgumentError,
        "segments",
        place,
        [3, 4],
        1,
        segments=[[0], [5]],
        patches=[4],
        bins=([0, 1], [0]),
    )


@pytest.mark.parametrize(
    ("baseline", "cls"),
    [
        ([0], errors.PackingArgumentError),
        ([0, 0, 0], errors.PackingArgumentError),
        ([0, 2], errors.PackingArgumentError),
        ([0, -1], errors.PackingArgumentError),
        ([0.0, 1.0], errors.PackingDtypeError),
    ],
    ids=["short", "long", "rank_too_big", "negative", "floats"],
)
def test_bad_baseline(baseline: list, cls: type[Exception]) -> None:
    _raises(cls, "baseline", place, [3, 4], 2, baseline=baseline)


@pytest.mark.parametrize("ranks", [0, -1, True, 2.0, "2", None])
def test_bad_num_ranks(ranks: object) -> None:
    _raises(errors.PackingArgumentError, "num_ranks", place, [3], ranks)
    _raises(errors.PackingArgumentError, "num_ranks", placement_of, [0], [3], ranks)


@pytest.mark.parametrize("tol", [-0.1, float("nan"), float("inf"), True, "0.1", None])
def test_bad_tolerance(tol: object) -> None:
    _raises(errors.PackingArgumentError, "tolerance", place, [3], 1, tolerance=tol)


@pytest.mark.parametrize("field", ["token", "attention", "patch", "patch_attention"])
@pytest.mark.parametrize("value", [float("nan"), -1.0, float("inf"), True, "1", None])
def test_bad_placement_cost(field: str, value: object) -> None:
    _raises(errors.PackingArgumentError, field, PlacementCost, **{field: value})


def test_cost_must_be_a_placement_cost() -> None:
    _raises(errors.PackingArgumentError, "cost", place, [3], 1, cost={"token": 1.0})


@pytest.mark.parametrize(
    "bins",
    [
        ([0, 2], [0, 0]),
        ([0, 1, 2], [1, 1]),
        ([0, 1], [2]),
        ([0, 1], [-1]),
        ([0, 2, 1], [0, 1]),
        ([1, 2], [0, 1]),
        ([0, 1], [0, 1]),
        ([], []),
    ],
    ids=[
        "row_twice",
        "row_in_two_bins",
        "row_out_of_range",
        "negative_row",
        "offsets_non_monotone",
        "offsets_not_from_zero",
        "offsets_short",
        "no_offsets",
    ],
)
def test_bad_bins(bins: tuple) -> None:
    _raises(errors.PackingArgumentError, "bins", place, [3, 4], 1, bins=bins)


def test_bad_item_ranks_for_placement_of() -> None:
    for given_ranks in ([0], [0, 2], [0, -1]):
        _raises(errors.PackingArgumentError, "item_ranks", placement_of, given_ranks, [3, 4], 2)
    _raises(errors.PackingDtypeError, "item_ranks", placement_of, [0.0, 1.0], [3, 4], 2)


def test_huge_num_ranks_is_a_typed_error() -> None:
    _raises(errors.PackingArgumentError, "num_ranks", place, [3], 2**61)
    _raises(errors.PackingArgumentError, "num_ranks", placement_of, [0], [3], 2**61)


def test_huge_num_ranks_never_aborts_the_process() -> None:
    """A rank count whose per-rank arrays cannot be allocated is a typed error, not an abort
    (run in a child: an allocation failure in the core kills the interpreter)."""
    code = (
        "from mmpack import errors\n"
        "from mmpack.packing.placement import place, placement_of\n"
        "for fn, args in ((place, ([3], 2**40)), (placement_of, ([0], [3], 2**40))):\n"
        "    try:\n"
        "        fn(*args)\n"
        "    except errors.PackingArgumentError as exc:\n"
        "        assert 'num_ranks' in str(exc), exc\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


# ----------------------------------------------------------------------------- garbage


GARBAGE_SCALAR = st.one_of(
    st.integers(-5, 12),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.none(),
    st.text(max_size=3),
)
GARBAGE_ARRAY = st.one_of(
    st.none(),
    GARBAGE_SCALAR,
    st.lists(st.integers(-3, 12), max_size=8),
    st.lists(st.lists(st.integers(-3, 12), max_size=3), max_size=8),
    st.lists(GARBAGE_SCALAR, max_size=5),
    st.lists(st.one_of(st.lists(st.integers(-3, 12), max_size=3), GARBAGE_SCALAR), max_size=5),
    st.lists(st.integers(-3, 12), max_size=8).map(lambda x: np.asarray(x, dtype=np.int64)),
    st.lists(st.integers(0, 12), max_size=8).map(lambda x: np.asarray(x, dtype=np.uint64)),
)


@st.composite
def garbage_cases(draw: st.DrawFn) -> dict:
    n = draw(st.integers(0, 6))
    valid_lengths = st.lists(st.integers(-2, 50), min_size=n, max_size=n)
    lengths = draw(st.one_of(valid_lengths, valid_lengths, valid_lengths, GARBAGE_ARRAY))
    kw: dict = {}
    for name in ("segments", "segment_offsets", "patches", "baseline"):
        if draw(st.booleans()):
            kw[name] = draw(GARBAGE_ARRAY)
    if "segments" in kw and draw(st.booleans()):
        kw["patches"] = draw(st.lists(st.integers(0, 9), max_size=12))
    if draw(st.booleans()):
        kw["bins"] = draw(
            st.one_of(
                st.tuples(GARBAGE_ARRAY, GARBAGE_ARRAY),
                GARBAGE_SCALAR,
                st.tuples(GARBAGE_ARRAY),
                st.tuples(GARBAGE_ARRAY, GARBAGE_ARRAY, GARBAGE_ARRAY),
            )
        )
    if draw(st.booleans()):
        kw["tolerance"] = draw(GARBAGE_SCALAR)
    if draw(st.booleans()):
        kw["balance_counts"] = draw(st.booleans())
    ranks = draw(
        st.one_of(st.integers(1, 10), st.integers(1, 10), st.integers(-1, 10), GARBAGE_SCALAR)
    )
    return {"lengths": lengths, "num_ranks": ranks, "kw": kw}


@given(garbage_cases())
def test_garbage_input_gives_only_typed_errors(case: dict) -> None:
    """Random types and shapes for every argument: a result or an mmpack error."""
    kw = case["kw"]
    try:
        place(case["lengths"], case["num_ranks"], **kw)
    except errors.MmpackError:
        pass
    given_kw = {k: v for k, v in kw.items() if k not in ("baseline", "tolerance", "balance_counts")}
    try:
        placement_of(kw.get("baseline", []), case["lengths"], case["num_ranks"], **given_kw)
    except errors.MmpackError:
        pass


@pytest.mark.parametrize(
    "kw",
    [
        {"segments": 5, "patches": [1]},
        {"segments": [[0], 5], "patches": [1]},
        {"segments": [None, [0]], "patches": [1]},
        {"segments": np.array([0, 0]), "patches": [1]},
        {"patches": 5},
        {"segments": [[0], [0]], "patches": [1], "bins": 5},
        {"segments": [[0], [0]], "patches": [1], "bins": ([0, 2],)},
        {"segments": [[0], [0]], "patches": [1], "bins": None, "baseline": 0},
    ],
    ids=[
        "segments_scalar",
        "segments_row_scalar",
        "segments_row_none",
        "flat_without_offsets",
        "patches_scalar",
        "bins_scalar",
        "bins_one_array",
        "baseline_scalar",
    ],
)
def test_wrongly_typed_arguments_are_typed_errors(kw: dict) -> None:
    with pytest.raises(errors.MmpackError):
        place([3, 4], 2, **kw)


@st.composite
def near_csr(draw: st.DrawFn) -> tuple[list[int], list[int], list[int], list[int], tuple | None]:
    """Valid CSR segments and bins, then maybe one entry changed."""
    n = draw(st.integers(0, 6))
    lengths = draw(st.lists(st.integers(0, 50), min_size=n, max_size=n))
    counts = draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    offsets = [0, *np.cumsum(counts).tolist()] if n else [0]
    patches = draw(st.lists(st.integers(0, 50), min_size=1, max_size=5))
    segments = draw(
        st.lists(st.integers(0, len(patches) - 1), min_size=offsets[-1], max_size=offsets[-1])
    )
    bins = None
    if draw(st.booleans()) and n:
        rows = draw(st.permutations(list(range(n))))[: draw(st.integers(0, n))]
        cuts = sorted(draw(st.lists(st.integers(0, len(rows)), max_size=3)))
        bins = ([0, *cuts, len(rows)], list(rows))
    for _ in range(draw(st.integers(0, 2)) if bins is None else draw(st.integers(1, 2))):
        target = draw(
            st.sampled_from(["offsets", "segments", "patches"] + (["bins"] if bins else []))
        )
        arr = {"offsets": offsets, "segments": segments, "patches": patches}.get(
            target, bins[draw(st.integers(0, 1))] if bins else offsets
        )
        if arr and draw(st.booleans()):
            arr[draw(st.integers(0, len(arr) - 1))] = draw(st.integers(-3, 12))
        elif draw(st.booleans()):
            arr.append(draw(st.integers(-3, 12)))
        elif arr:
            arr.pop()
    return lengths, segments, offsets, patches, bins


@given(near_csr(), st.integers(1, 4))
def test_malformed_csr_gives_only_typed_errors(case: tuple, ranks: int) -> None:
    """Well-typed but malformed CSR (offsets not monotone or not spanning the ids, ids out of
    range, bins wrong): an mmpack error, or, where accepted, the input was valid."""
    lengths, segments, offsets, patches, bins = case
    try:
        p = place(
            lengths, ranks, segments=segments, segment_offsets=offsets, patches=patches, bins=bins
        )
    except errors.MmpackError:
        return
    assert len(offsets) == len(lengths) + 1
    assert offsets[0] == 0 and offsets[-1] == len(segments)
    assert all(a <= b for a, b in itertools.pairwise(offsets))
    assert all(0 <= s < len(patches) for s in segments)
    assert all(n >= 0 for n in lengths) and all(x >= 0 for x in patches)
    check_structure(p, len(bins_rows(bins)) if bins is not None else len(lengths), ranks)


def test_one_group_for_the_whole_batch_is_spread_like_single_rows() -> None:
    """Every row sharing one image (one prompt larger than a rank, one image for the batch):
    every rank encodes it whatever the placement, so the rows are balanced as single rows."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(100, 4000, 4096)
    shared = place(lengths, 64, segments=[[0]] * 4096, patches=[50])
    alone = place(lengths, 64)
    priced = placement_of(alone.item_ranks, lengths, 64, segments=[[0]] * 4096, patches=[50])
    assert shared.encodes == priced.encodes == 64
    assert shared.worst <= priced.worst * (1 + 1e-9)


def test_numpy_scalars_are_accepted_as_numbers() -> None:
    cost = PlacementCost(token=np.float32(1.0), attention=np.float64(0.0), patch=np.int64(1))
    p = place([3, 4], 2, tolerance=np.float32(0.1), cost=cost)
    assert sorted(p.rank_costs.tolist()) == [3.0, 4.0]


def test_rank_sums_beyond_a_float_are_a_typed_error() -> None:
    """Each row's cost is finite, their sum on a rank is not."""
    huge = PlacementCost(token=1e308, attention=0.0, patch=1e308)
    _raises(errors.PackingArgumentError, "cost", place, [1] * 6, 2, cost=huge)
