"""Plain-Python reference of ``mmpack.packing.placement``'s cost model, written from its
description: what a placement costs each rank (a rank's items plus every *unique* segment on
it, charged once), the groups (connected components of items sharing a segment), the lower
bound, whether whole groups can respect balanced item counts at all, and a simple
longest-processing-time placement of whole groups. It is the oracle of
``tests/packing/test_placement.py``; mmpack never imports it.

Items are rows, or the bins of a packing (``bin_items`` turns rows into bins). ``item_segments``
is one list of segment ids per item (repeats allowed, counted once); ``segment_costs`` the cost
of each segment id.
"""

from __future__ import annotations


def row_costs(lengths, token, attention):
    """The LLM cost of each row: ``token * L + attention * L**2``."""
    return [token * float(n) + attention * float(n) * float(n) for n in lengths]


def segment_costs_of(patches, patch, patch_attention):
    """The vision cost of each segment: ``patch * P + patch_attention * P**2``."""
    return [patch * float(p) + patch_attention * float(p) * float(p) for p in patches]


def bin_items(bins, costs, item_segments):
    """Bins (lists of row indices) as items: a bin costs its rows' summed cost, and its
    segments are the union of its rows' segments."""
    out_costs = [sum(costs[i] for i in rows) for rows in bins]
    out_segments = [sorted({s for i in rows for s in item_segments[i]}) for rows in bins]
    return out_costs, out_segments


def rank_costs(item_ranks, item_costs, item_segments, segment_costs, num_ranks):
    """Per rank: (cost, unique segments, items). A segment used by several items of one rank
    is charged, and counted, once on that rank."""
    costs = [0.0] * num_ranks
    held = [set() for _ in range(num_ranks)]
    items = [0] * num_ranks
    for i, r in enumerate(item_ranks):
        costs[r] += item_costs[i]
        items[r] += 1
        held[r].update(item_segments[i])
    for r in range(num_ranks):
        costs[r] += sum(segment_costs[s] for s in held[r])
    return costs, [len(h) for h in held], items


def groups(item_segments):
    """Group id per item: connected components of items sharing a segment id, numbered in
    order of each group's first item."""
    n = len(item_segments)
    by_segment = {}
    for i, segs in enumerate(item_segments):
        for s in segs:
            by_segment.setdefault(s, []).append(i)
    out = [-1] * n
    next_id = 0
    for start in range(n):
        if out[start] != -1:
            continue
        out[start] = next_id
        stack = [start]
        seen_segments = set()
        while stack:
            i = stack.pop()
            for s in item_segments[i]:
                if s in seen_segments:
                    continue
                seen_segments.add(s)
                for j in by_segment[s]:
                    if out[j] == -1:
                        out[j] = next_id
                        stack.append(j)
        next_id += 1
    return out


def split_groups(item_ranks, item_groups):
    """How many groups have items on more than one rank."""
    ranks_of = {}
    for r, g in zip(item_ranks, item_groups, strict=True):
        ranks_of.setdefault(g, set()).add(r)
    return sum(1 for rs in ranks_of.values() if len(rs) > 1)


def lower_bound(item_costs, item_segments, segment_costs, num_ranks):
    """``max(total cost with every used segment once / num_ranks, the costliest item with its
    own segments)``: no placement's worst rank costs less."""
    used = {s for segs in item_segments for s in segs}
    total = sum(item_costs) + sum(segment_costs[s] for s in used)
    largest = max(
        (
            c + sum(segment_costs[s] for s in set(segs))
            for c, segs in zip(item_costs, item_segments, strict=True)
        ),
        default=0.0,
    )
    return max(total / num_ranks, largest)


def count_caps(num_items, num_ranks):
    """Balanced counts: ``extra`` ranks hold ``base + 1`` items, the others ``base``."""
    return divmod(num_items, num_ranks)


def whole_group_feasible(group_sizes, num_ranks, balance_counts=True):
    """Whether whole groups (of these item counts) can be put on the ranks with every rank's
    count within one of the others (``base`` or ``base + 1`` items, exactly ``extra`` ranks at
    ``base + 1``). Always true without ``balance_counts``. Exact search (small inputs)."""
    if not balance_counts:
        return True
    n = sum(group_sizes)
    base, extra = count_caps(n, num_ranks)
    sizes = sorted((s for s in group_sizes if s), reverse=True)
    if any(s > base + (1 if extra else 0) for s in sizes):
        return False
    memo = set()

    def search(k, counts):
        # counts: sorted tuple of per-rank counts so far
        if k == len(sizes):
            return True  # sum fixed and every count capped: all are base or base + 1
        key = (k, counts)
        if key in memo:
            return False
        full = sum(1 for c in counts if c > base)
        tried = set()
        for r, c in enumerate(counts):
            if c in tried:
                continue
            tried.add(c)
            new = c + sizes[k]
            if new > base + 1 or (new > base and c <= base and full >= extra):
                continue
            nxt = tuple(sorted((*counts[:r], new, *counts[r + 1 :])))
            if search(k + 1, nxt):
                return True
        memo.add(key)
        return False

    return search(0, (0,) * num_ranks)


def whole_group_lpt(item_costs, item_segments, segment_costs, num_ranks, balance_counts=True):
    """Longest-processing-time first over whole groups: groups by cost (items plus their
    unique segments), costliest first (ties: the group whose first item comes first), each to
    the least-loaded rank that still has room for an item (ties: the lower rank). Room, with
    ``balance_counts``: ``base + 1`` items while fewer than ``extra`` ranks hold more than
    ``base``, then ``base``.

    Returns the rank of every item, or ``None`` where a group is larger than the room left on
    the rank it goes to (this LPT cannot keep it whole)."""
    n = len(item_costs)
    item_groups = groups(item_segments)
    members = {}
    for i, g in enumerate(item_groups):
        members.setdefault(g, []).append(i)
    cost = {}
    for g, items in members.items():
        segs = {s for i in items for s in item_segments[i]}
        cost[g] = sum(item_costs[i] for i in items) + sum(segment_costs[s] for s in segs)
    order = sorted(members, key=lambda g: (-cost[g], members[g][0]))
    base, extra = count_caps(n, num_ranks)
    loads = [0.0] * num_ranks
    counts = [0] * num_ranks
    out = [-1] * n

    def room(r):
        if not balance_counts:
            return n + 1
        over = sum(1 for c in counts if c > base)
        cap = base + 1 if extra and over < extra else base
        return cap - counts[r]

    for g in order:
        open_ranks = [r for r in range(num_ranks) if room(r) > 0]
        r = min(open_ranks, key=lambda r: (loads[r], r))
        if len(members[g]) > room(r):
            return None
        for i in members[g]:
            out[i] = r
        loads[r] += cost[g]
        counts[r] += len(members[g])
    return out


def round_robin(num_items, num_ranks):
    """NeMo-RL-like strided sharding: item ``i`` on rank ``i % num_ranks``."""
    return [i % num_ranks for i in range(num_items)]


def contiguous(num_items, num_ranks):
    """Contiguous shards of counts within one (the first ``extra`` ranks one item more)."""
    base, extra = count_caps(num_items, num_ranks)
    out = []
    for r in range(num_ranks):
        out.extend([r] * (base + (1 if r < extra else 0)))
    return out
