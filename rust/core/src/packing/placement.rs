//! Placing items (rows, or packed micro-batches) on data-parallel ranks by what each rank
//! computes: the items' own cost (the LLM's tokens, linear and quadratic) plus the cost of
//! every *unique* media segment on the rank, charged once per rank however many of its items
//! use it.
//!
//! Items that share a segment form a group (connected components over shared segments: the G
//! rows of one GRPO prompt). The placement minimises the worst rank's cost:
//! longest-processing-time first over whole groups, and, where that leaves the worst rank more
//! than `tolerance` above the lower bound, over groups split at a target (each split encodes
//! the group's segments once more, on the other rank). The candidate with the fewest
//! duplicate encodes among those within the tolerance wins, else the one with the lowest
//! worst rank; a caller's baseline placement (NeMo-RL's) wins only when it is strictly better.

use std::cmp::{Ordering, Reverse};
use std::collections::{BinaryHeap, HashSet};

use crate::alloc;
use crate::error::{CoreError, CoreResult};

/// Items, their segments and the costs, as plain slices. `item_segments` lists each item's
/// segment ids (dense, `< segment_costs.len()`) as CSR over `item_seg_offsets`; repeats are
/// allowed and counted once.
#[derive(Debug, Clone, Copy)]
pub struct PlacementInput<'a> {
    pub item_costs: &'a [f64],
    pub item_seg_offsets: &'a [i64],
    pub item_segments: &'a [i64],
    pub segment_costs: &'a [f64],
}

/// How to place.
#[derive(Debug, Clone, Copy)]
pub struct PlacementOptions<'a> {
    pub num_ranks: usize,
    /// How far above the lower bound the worst rank may be while groups stay whole.
    pub tolerance: f64,
    /// Item counts per rank differ by at most one (none when the ranks divide the items).
    pub balance_counts: bool,
    /// A placement to beat (rank per item); returned when strictly better.
    pub baseline: Option<&'a [i64]>,
}

/// What a placement costs each rank.
#[derive(Debug, Clone, PartialEq)]
pub struct PlacementCosts {
    /// Items' cost plus unique segments' cost, per rank.
    pub rank_costs: Vec<f64>,
    /// Unique segments per rank.
    pub rank_segments: Vec<i64>,
    /// Items per rank.
    pub rank_items: Vec<i64>,
}

impl PlacementCosts {
    #[must_use]
    pub fn worst(&self) -> f64 {
        self.rank_costs.iter().copied().fold(0.0, f64::max)
    }

    #[must_use]
    pub fn encodes(&self) -> i64 {
        self.rank_segments.iter().sum()
    }
}

/// Which candidate a placement is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlacementKind {
    /// Whole groups (split only where a rank's item count forces it).
    Groups,
    /// Groups split at a target cost.
    Split,
    /// The caller's baseline.
    Baseline,
    /// A placement the caller gave (`placement_costs`).
    Given,
}

impl PlacementKind {
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::Groups => "groups",
            Self::Split => "split",
            Self::Baseline => "baseline",
            Self::Given => "given",
        }
    }
}

/// A placement: the rank of every item, its costs, the groups and the lower bound.
#[derive(Debug, Clone, PartialEq)]
pub struct Placement {
    pub item_ranks: Vec<i64>,
    pub costs: PlacementCosts,
    /// Group id per item (groups numbered by their first item).
    pub item_groups: Vec<i64>,
    /// Groups whose items landed on more than one rank.
    pub split_groups: usize,
    /// `max(total cost with each segment once / ranks, the costliest item with its segments)`.
    pub lower_bound: f64,
    pub kind: PlacementKind,
}

fn arg(name: &'static str, detail: String) -> CoreError {
    CoreError::PackingArgument { name, detail }
}

/// Items' segment lists, checked, as ranges into `item_segments` converted to `usize`.
struct Items {
    costs: Vec<f64>,
    offsets: Vec<usize>,
    segments: Vec<usize>,
    segment_costs: Vec<f64>,
}

impl Items {
    fn new(input: &PlacementInput<'_>) -> CoreResult<Self> {
        let n = input.item_costs.len();
        check_costs(input.item_costs, "item_costs")?;
        check_costs(input.segment_costs, "segment_costs")?;
        let s = input.segment_costs.len();
        if input.item_seg_offsets.len() != n + 1 {
            return Err(arg(
                "item_seg_offsets",
                format!(
                    "has {} entries for {n} items (needs {})",
                    input.item_seg_offsets.len(),
                    n + 1
                ),
            ));
        }
        let mut offsets = Vec::with_capacity(n + 1);
        let mut prev = 0usize;
        for (i, &o) in input.item_seg_offsets.iter().enumerate() {
            let o = usize::try_from(o)
                .ok()
                .filter(|&o| o >= prev && o <= input.item_segments.len() && (i > 0 || o == 0))
                .ok_or_else(|| {
                    arg(
                        "item_seg_offsets",
                        format!("entry {i} ({o}) is not a valid CSR offset"),
                    )
                })?;
            offsets.push(o);
            prev = o;
        }
        if prev != input.item_segments.len() {
            return Err(arg(
                "item_seg_offsets",
                format!(
                    "ends at {prev}, not at the {} segments listed",
                    input.item_segments.len()
                ),
            ));
        }
        let segments = input
            .item_segments
            .iter()
            .enumerate()
            .map(|(i, &g)| {
                usize::try_from(g).ok().filter(|&g| g < s).ok_or_else(|| {
                    arg(
                        "item_segments",
                        format!("entry {i} ({g}) names no segment of {s}"),
                    )
                })
            })
            .collect::<CoreResult<Vec<usize>>>()?;
        Ok(Self {
            costs: input.item_costs.to_vec(),
            offsets,
            segments,
            segment_costs: input.segment_costs.to_vec(),
        })
    }

    fn len(&self) -> usize {
        self.costs.len()
    }

    fn segs(&self, item: usize) -> &[usize] {
        &self.segments[self.offsets[item]..self.offsets[item + 1]]
    }
}

fn check_costs(costs: &[f64], name: &'static str) -> CoreResult<()> {
    match costs.iter().position(|c| !(c.is_finite() && *c >= 0.0)) {
        Some(i) => Err(arg(
            name,
            format!("entry {i} is {}: costs must be finite and >= 0", costs[i]),
        )),
        None => Ok(()),
    }
}

/// Marks segments seen in the current pass; `next()` starts a new pass in O(1).
struct Stamps {
    marks: Vec<u32>,
    epoch: u32,
}

impl Stamps {
    fn new(n: usize) -> Self {
        Self {
            marks: vec![0; n],
            epoch: 0,
        }
    }

    fn next(&mut self) {
        if self.epoch == u32::MAX {
            self.marks.fill(0);
            self.epoch = 0;
        }
        self.epoch += 1;
    }

    /// Marks `s`; true when it was not marked in this pass.
    fn first(&mut self, s: usize) -> bool {
        let new = self.marks[s] != self.epoch;
        self.marks[s] = self.epoch;
        new
    }
}

/// Which ranks hold which segments: a segment's first rank inline, any others in a set (only
/// split groups have any).
struct Holdings {
    first: Vec<usize>,
    more: HashSet<(usize, usize)>,
}

impl Holdings {
    fn new(segments: usize) -> Self {
        Self {
            first: vec![usize::MAX; segments],
            more: HashSet::new(),
        }
    }

    fn holds(&self, s: usize, r: usize) -> bool {
        self.first[s] == r || (self.first[s] != usize::MAX && self.more.contains(&(s, r)))
    }

    fn add(&mut self, s: usize, r: usize) {
        if self.first[s] == usize::MAX {
            self.first[s] = r;
        } else if self.first[s] != r {
            self.more.insert((s, r));
        }
    }
}

/// Group id per item: connected components over shared segments, numbered by first item.
fn groups(items: &Items) -> Vec<usize> {
    let n = items.len();
    let mut parent: Vec<usize> = (0..n).collect();
    fn find(parent: &mut [usize], mut x: usize) -> usize {
        while parent[x] != x {
            parent[x] = parent[parent[x]];
            x = parent[x];
        }
        x
    }
    let mut owner = vec![usize::MAX; items.segment_costs.len()];
    for i in 0..n {
        for &s in items.segs(i) {
            if owner[s] == usize::MAX {
                owner[s] = i;
            } else {
                let (a, b) = (find(&mut parent, owner[s]), find(&mut parent, i));
                if a != b {
                    // the smaller item index is the root, so roots are first items
                    let (lo, hi) = if a < b { (a, b) } else { (b, a) };
                    parent[hi] = lo;
                }
            }
        }
    }
    let mut id = vec![usize::MAX; n];
    let mut out = Vec::with_capacity(n);
    let mut next = 0;
    for i in 0..n {
        let root = find(&mut parent, i);
        if id[root] == usize::MAX {
            id[root] = next;
            next += 1;
        }
        out.push(id[root]);
    }
    out
}

/// How many items each rank may still take.
struct Counts {
    counts: Vec<usize>,
    base: usize,
    extra: usize,
    at_cap: usize,
    balanced: bool,
}

impl Counts {
    fn new(items: usize, ranks: usize, balanced: bool) -> Self {
        Self {
            counts: vec![0; ranks],
            base: items / ranks,
            extra: items % ranks,
            at_cap: 0,
            balanced,
        }
    }

    fn room(&self, r: usize) -> usize {
        if !self.balanced {
            return usize::MAX;
        }
        let cap = if self.extra > 0 && self.at_cap < self.extra {
            self.base + 1
        } else {
            self.base
        };
        cap.saturating_sub(self.counts[r])
    }

    fn add(&mut self, r: usize, k: usize) {
        let before = self.counts[r];
        self.counts[r] += k;
        if self.extra > 0 && before <= self.base && self.counts[r] > self.base {
            self.at_cap += 1;
        }
    }
}

/// A cost in a heap: floats ordered totally.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Cost(f64);

impl Eq for Cost {}

impl PartialOrd for Cost {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Cost {
    fn cmp(&self, other: &Self) -> Ordering {
        self.0.total_cmp(&other.0)
    }
}

/// How many items of `piece` (from its start) go to rank `r` and the rank's load after: the
/// longest prefix within `target` and `room`, at least one item; the whole piece where only
/// its first item fits and the room takes it (the least-loaded rank is over the target
/// already, and splitting would only add encodes).
#[allow(clippy::too_many_arguments)]
fn prefix_on(
    items: &Items,
    piece: &[usize],
    r: usize,
    load: f64,
    room: usize,
    target: f64,
    holdings: &Holdings,
    stamps: &mut Stamps,
) -> (usize, f64) {
    let start = load;
    let add_all = |upto: usize, stop_at: f64, stamps: &mut Stamps| {
        stamps.next();
        let mut load = start;
        let mut end = 0;
        while end < upto {
            let i = piece[end];
            let mut add = items.costs[i];
            for &s in items.segs(i) {
                if stamps.first(s) && !holdings.holds(s, r) {
                    add += items.segment_costs[s];
                }
            }
            if end > 0 && load + add > stop_at {
                break;
            }
            load += add;
            end += 1;
        }
        (end, load)
    };
    let (end, load) = add_all(piece.len().min(room), target, stamps);
    if end == 1 && piece.len() <= room && piece.len() > 1 {
        return add_all(piece.len(), f64::INFINITY, stamps);
    }
    (end, load)
}

/// Longest-processing-time first over pieces of groups (`members[a..b]`, a group's costliest
/// items first), each to the least-loaded rank with room. A piece that would take that rank above
/// `target`, or past its item count, is split: the longest prefix that fits stays, the rest
/// goes back to the queue as a new piece (its segments charged again).
fn greedy(
    items: &Items,
    members: &[usize],
    pieces: &[(usize, usize)],
    ranks: usize,
    target: f64,
    balanced: bool,
) -> Vec<usize> {
    let n = items.len();
    let mut rank_of = vec![usize::MAX; n];
    let mut loads = vec![0.0f64; ranks];
    let mut counts = Counts::new(n, ranks, balanced);
    let mut holdings = Holdings::new(items.segment_costs.len());
    let mut stamps = Stamps::new(items.segment_costs.len());
    let piece_cost = |a: usize, b: usize, stamps: &mut Stamps| -> f64 {
        stamps.next();
        let mut c = 0.0;
        for &i in &members[a..b] {
            c += items.costs[i];
            for &s in items.segs(i) {
                if stamps.first(s) {
                    c += items.segment_costs[s];
                }
            }
        }
        c
    };
    // The pieces in order of cost, costliest first: sorted once; the rests of split pieces
    // (few) wait in a heap and are merged in as the order comes to them.
    let mut sorted: Vec<(Cost, Reverse<usize>, usize)> = pieces
        .iter()
        .map(|&(a, b)| (Cost(piece_cost(a, b, &mut stamps)), Reverse(a), b))
        .collect();
    sorted.sort_unstable_by(|x, y| y.cmp(x));
    let mut sorted = sorted.into_iter().peekable();
    let mut queue: BinaryHeap<(Cost, Reverse<usize>, usize)> = BinaryHeap::new();
    let mut idle: BinaryHeap<Reverse<(Cost, usize)>> =
        (0..ranks).map(|r| Reverse((Cost(0.0), r))).collect();
    loop {
        let next = match (sorted.peek(), queue.peek()) {
            (Some(x), Some(y)) if y > x => queue.pop(),
            (Some(_), _) => sorted.next(),
            (None, _) => queue.pop(),
        };
        let Some((_, Reverse(a), b)) = next else {
            break;
        };
        // The least-loaded rank with room (entries whose load changed since are stale).
        let mut pick = None;
        while let Some(Reverse((Cost(load), r))) = idle.pop() {
            if load.to_bits() == loads[r].to_bits() && counts.room(r) > 0 {
                pick = Some(r);
                break;
            }
        }
        // Room always remains while items do (the rooms sum to the items left).
        let Some(mut r) = pick else { break };
        if counts.room(r) < b - a {
            // Too few item slots left there for the whole piece: the least-loaded rank that
            // has them, if any, before splitting.
            let whole = (0..ranks)
                .filter(|&q| counts.room(q) >= b - a)
                .min_by(|&x, &y| loads[x].total_cmp(&loads[y]).then(x.cmp(&y)));
            if let Some(q) = whole {
                idle.push(Reverse((Cost(loads[r]), r)));
                r = q;
            }
        }
        let (end, load) = prefix_on(
            items,
            &members[a..b],
            r,
            loads[r],
            counts.room(r),
            target,
            &holdings,
            &mut stamps,
        );
        let end = a + end;
        for &i in &members[a..end] {
            rank_of[i] = r;
            for &s in items.segs(i) {
                holdings.add(s, r);
            }
        }
        loads[r] = load;
        counts.add(r, end - a);
        idle.push(Reverse((Cost(load), r)));
        if end < b {
            queue.push((Cost(piece_cost(end, b, &mut stamps)), Reverse(end), b));
        }
    }
    rank_of
}

/// What `item_ranks` costs each rank, with the groups and the lower bound, as a placement of
/// kind `Given`.
///
/// # Errors
/// `PackingArgument` for malformed input or a rank out of range.
pub fn placement_costs(
    input: &PlacementInput<'_>,
    item_ranks: &[i64],
    num_ranks: usize,
) -> CoreResult<Placement> {
    probe_ranks(num_ranks)?;
    let items = Items::new(input)?;
    let ranks = checked_ranks(item_ranks, items.len(), num_ranks, "item_ranks")?;
    let item_groups = groups(&items);
    let num_groups = item_groups.iter().map(|&g| g + 1).max().unwrap_or(0);
    Ok(Placement {
        item_ranks: item_ranks.to_vec(),
        costs: costs_of(&items, &ranks, num_ranks),
        split_groups: count_split(&item_groups, &ranks, num_groups),
        item_groups: item_groups.iter().map(|&g| g as i64).collect(),
        lower_bound: lower_bound(&items, num_ranks),
        kind: PlacementKind::Given,
    })
}

fn checked_ranks(
    item_ranks: &[i64],
    n: usize,
    num_ranks: usize,
    name: &'static str,
) -> CoreResult<Vec<usize>> {
    if item_ranks.len() != n {
        return Err(arg(
            name,
            format!("has {} entries for {n} items", item_ranks.len()),
        ));
    }
    item_ranks
        .iter()
        .enumerate()
        .map(|(i, &r)| {
            usize::try_from(r)
                .ok()
                .filter(|&r| r < num_ranks)
                .ok_or_else(|| {
                    arg(
                        name,
                        format!("entry {i} ({r}) is not a rank of {num_ranks}"),
                    )
                })
        })
        .collect()
}

fn costs_of(items: &Items, ranks: &[usize], num_ranks: usize) -> PlacementCosts {
    let mut rank_costs = vec![0.0f64; num_ranks];
    let mut rank_segments = vec![0i64; num_ranks];
    let mut rank_items = vec![0i64; num_ranks];
    let mut holdings = Holdings::new(items.segment_costs.len());
    for (i, &r) in ranks.iter().enumerate() {
        rank_costs[r] += items.costs[i];
        rank_items[r] += 1;
        for &s in items.segs(i) {
            if !holdings.holds(s, r) {
                holdings.add(s, r);
                rank_costs[r] += items.segment_costs[s];
                rank_segments[r] += 1;
            }
        }
    }
    PlacementCosts {
        rank_costs,
        rank_segments,
        rank_items,
    }
}

/// Every group's items (`members[a..b]` for each piece `(a, b)`, one piece a group), each
/// group's costliest items first: a split takes them, the rest fills in (LPT within it).
fn group_pieces(
    items: &Items,
    item_groups: &[usize],
    num_groups: usize,
) -> (Vec<usize>, Vec<(usize, usize)>) {
    let mut starts = vec![0usize; num_groups + 1];
    for &g in item_groups {
        starts[g + 1] += 1;
    }
    for g in 0..num_groups {
        starts[g + 1] += starts[g];
    }
    let mut fill = starts.clone();
    let mut members = vec![0usize; item_groups.len()];
    for (i, &g) in item_groups.iter().enumerate() {
        members[fill[g]] = i;
        fill[g] += 1;
    }
    let pieces: Vec<(usize, usize)> = starts.windows(2).map(|w| (w[0], w[1])).collect();
    for &(a, b) in &pieces {
        if b - a > 1 {
            members[a..b]
                .sort_by(|&x, &y| items.costs[y].total_cmp(&items.costs[x]).then(x.cmp(&y)));
        }
    }
    (members, pieces)
}

/// The candidate to use: the fewest encodes among those within `within`; otherwise the lowest
/// worst rank.
fn pick(candidates: &[(PlacementKind, PlacementCosts, Vec<usize>)], within: f64) -> usize {
    candidates
        .iter()
        .enumerate()
        .min_by(|(_, x), (_, y)| {
            let (wx, wy) = (x.1.worst(), y.1.worst());
            match (wx <= within, wy <= within) {
                (true, true) => x.1.encodes().cmp(&y.1.encodes()).then(wx.total_cmp(&wy)),
                (true, false) => Ordering::Less,
                (false, true) => Ordering::Greater,
                (false, false) => wx.total_cmp(&wy).then(x.1.encodes().cmp(&y.1.encodes())),
            }
        })
        .map_or(0, |(i, _)| i)
}

/// The items, and the baseline as ranks, after every check of the arguments.
fn checked(
    input: &PlacementInput<'_>,
    opts: &PlacementOptions<'_>,
) -> CoreResult<(Items, Option<Vec<usize>>)> {
    let ranks = opts.num_ranks;
    if ranks == 0 {
        return Err(arg("num_ranks", "must be a positive integer, got 0".into()));
    }
    if !(opts.tolerance.is_finite() && opts.tolerance >= 0.0) {
        return Err(arg(
            "tolerance",
            format!("must be finite and >= 0, got {}", opts.tolerance),
        ));
    }
    probe_ranks(ranks)?;
    let items = Items::new(input)?;
    let baseline = match opts.baseline {
        Some(b) => {
            let base = checked_ranks(b, items.len(), ranks, "baseline")?;
            if opts.balance_counts {
                check_balanced(&base, ranks)?;
            }
            Some(base)
        }
        None => None,
    };
    Ok((items, baseline))
}

/// Places the items on `opts.num_ranks` ranks (see the module docs).
///
/// # Errors
/// `PackingArgument` for malformed input, `num_ranks == 0`, a negative or non-finite
/// tolerance or cost, or a baseline of the wrong length or with a rank out of range.
pub fn place(input: &PlacementInput<'_>, opts: &PlacementOptions<'_>) -> CoreResult<Placement> {
    let ranks = opts.num_ranks;
    let (items, baseline) = checked(input, opts)?;
    let n = items.len();
    let item_groups = groups(&items);
    let lower_bound = lower_bound(&items, ranks);

    let num_groups = item_groups.iter().map(|&g| g + 1).max().unwrap_or(0);
    let (members, pieces) = group_pieces(&items, &item_groups, num_groups);

    let within = lower_bound * (1.0 + opts.tolerance);
    let mut whole = greedy(
        &items,
        &members,
        &pieces,
        ranks,
        f64::INFINITY,
        opts.balance_counts,
    );
    if costs_of(&items, &whole, ranks).worst() > within {
        improve_by_swaps(
            &items,
            &item_groups,
            num_groups,
            &mut whole,
            ranks,
            opts.balance_counts,
        );
    }
    let mut candidates = vec![(
        PlacementKind::Groups,
        costs_of(&items, &whole, ranks),
        whole,
    )];
    if candidates[0].1.worst() > within {
        let looser = 0.5 * (within + candidates[0].1.worst());
        for target in [within, looser] {
            let split = greedy(
                &items,
                &members,
                &pieces,
                ranks,
                target,
                opts.balance_counts,
            );
            candidates.push((PlacementKind::Split, costs_of(&items, &split, ranks), split));
        }
        // Every item on its own (LPT over items): where groups are few and large (one image
        // for the whole batch), spreading them costs no more encodes than splitting does.
        let singles: Vec<(usize, usize)> = (0..n).map(|k| (k, k + 1)).collect();
        let spread = greedy(
            &items,
            &members,
            &singles,
            ranks,
            f64::INFINITY,
            opts.balance_counts,
        );
        candidates.push((
            PlacementKind::Split,
            costs_of(&items, &spread, ranks),
            spread,
        ));
    }
    let best = pick(&candidates, within);
    let (mut kind, mut costs, mut chosen) = candidates.swap_remove(best);
    if let Some(base) = baseline {
        let base_costs = costs_of(&items, &base, ranks);
        if base_costs.worst() < costs.worst() {
            (kind, costs, chosen) = (PlacementKind::Baseline, base_costs, base);
        }
    }
    let split_groups = count_split(&item_groups, &chosen, num_groups);
    Ok(Placement {
        item_ranks: chosen.iter().map(|&r| r as i64).collect(),
        costs,
        item_groups: item_groups.iter().map(|&g| g as i64).collect(),
        split_groups,
        lower_bound,
        kind,
    })
}

/// Lowers the worst rank of a whole-group placement by moving groups off it, or, where item
/// counts must stay as they are, by swapping a group of it for a cheaper group of the same
/// item count on another rank: each step takes the move or swap that leaves the pair of ranks
/// with the lowest maximum, and it stops when no step lowers the worst rank. Placements with a
/// split group are left alone (their costs are not sums of group costs).
fn improve_by_swaps(
    items: &Items,
    item_groups: &[usize],
    num_groups: usize,
    rank_of: &mut [usize],
    ranks: usize,
    balanced: bool,
) {
    let mut group_rank = vec![usize::MAX; num_groups];
    let mut size = vec![0usize; num_groups];
    for (i, &g) in item_groups.iter().enumerate() {
        if group_rank[g] != usize::MAX && group_rank[g] != rank_of[i] {
            return;
        }
        group_rank[g] = rank_of[i];
        size[g] += 1;
    }
    // A group's cost: its items and its segments once (groups share no segment).
    let mut cost = vec![0.0f64; num_groups];
    let mut stamps = Stamps::new(items.segment_costs.len());
    stamps.next();
    for (i, &g) in item_groups.iter().enumerate() {
        cost[g] += items.costs[i];
        for &s in items.segs(i) {
            if stamps.first(s) {
                cost[g] += items.segment_costs[s];
            }
        }
    }
    let mut loads = vec![0.0f64; ranks];
    let mut on: Vec<Vec<usize>> = vec![Vec::new(); ranks];
    for g in 0..num_groups {
        loads[group_rank[g]] += cost[g];
        on[group_rank[g]].push(g);
    }
    let by_size_cost = |a: &usize, b: &usize, cost: &[f64]| {
        size[*a]
            .cmp(&size[*b])
            .then(cost[*a].total_cmp(&cost[*b]))
            .then(a.cmp(b))
    };
    for list in &mut on {
        list.sort_by(|a, b| by_size_cost(a, b, &cost));
    }
    // Each step strictly lowers the pair it touches; the cap bounds pathological inputs.
    for _ in 0..(64 * ranks + 4 * num_groups) {
        let w = (0..ranks)
            .max_by(|&x, &y| loads[x].total_cmp(&loads[y]).then(y.cmp(&x)))
            .unwrap_or(0);
        let lw = loads[w];
        let best = best_step(w, &loads, &on, &cost, &size, balanced);
        let Some((m, a, b, q)) = best else { break };
        if m >= lw {
            break;
        }
        loads[w] -= cost[a];
        loads[q] += cost[a];
        on[w].retain(|&g| g != a);
        on[q].push(a);
        group_rank[a] = q;
        if b != usize::MAX {
            loads[q] -= cost[b];
            loads[w] += cost[b];
            on[q].retain(|&g| g != b);
            on[w].push(b);
            group_rank[b] = w;
        }
        on[w].sort_by(|x, y| by_size_cost(x, y, &cost));
        on[q].sort_by(|x, y| by_size_cost(x, y, &cost));
    }
    for (i, &g) in item_groups.iter().enumerate() {
        rank_of[i] = group_rank[g];
    }
}

/// The move or swap off rank `w` that leaves its pair of ranks with the lowest maximum:
/// `(that maximum, group off w, group back or MAX, other rank)`, if one lowers `w`.
fn best_step(
    w: usize,
    loads: &[f64],
    on: &[Vec<usize>],
    cost: &[f64],
    size: &[usize],
    balanced: bool,
) -> Option<(f64, usize, usize, usize)> {
    let lw = loads[w];
    let mut best: Option<(f64, usize, usize, usize)> = None;
    for q in (0..loads.len()).filter(|&q| q != w) {
        let lq = loads[q];
        for &a in &on[w] {
            if !balanced && lq + cost[a] < lw {
                let m = (lw - cost[a]).max(lq + cost[a]);
                if best.is_none_or(|b| m < b.0) {
                    best = Some((m, a, usize::MAX, q));
                }
            }
            // The best partner: same size, cost nearest cost[a] - (lw - lq) / 2.
            let want = cost[a] - 0.5 * (lw - lq);
            let list = &on[q];
            let lo = list.partition_point(|&b| size[b] < size[a]);
            let hi = list.partition_point(|&b| size[b] <= size[a]);
            let at = lo + list[lo..hi].partition_point(|&b| cost[b] < want);
            for k in [at.wrapping_sub(1), at] {
                if k < lo || k >= hi {
                    continue;
                }
                let b = list[k];
                let delta = cost[a] - cost[b];
                if delta <= 0.0 {
                    continue;
                }
                let m = (lw - delta).max(lq + delta);
                if m < lw && best.is_none_or(|x| m < x.0) {
                    best = Some((m, a, b, q));
                }
            }
        }
    }
    best
}

/// Per-rank arrays are sized by an argument: refuse a count whose arrays cannot exist.
fn probe_ranks(ranks: usize) -> CoreResult<()> {
    alloc::probe(ranks.checked_mul(64), || {
        arg(
            "num_ranks",
            format!("{ranks} ranks: the per-rank arrays do not fit in memory"),
        )
    })
}

/// With balanced counts, a baseline must keep them too (else it is no candidate).
fn check_balanced(ranks: &[usize], num_ranks: usize) -> CoreResult<()> {
    let mut counts = vec![0usize; num_ranks];
    for &r in ranks {
        counts[r] += 1;
    }
    let (base, extra) = (ranks.len() / num_ranks, ranks.len() % num_ranks);
    let above = counts.iter().filter(|&&c| c == base + 1).count();
    if counts.iter().any(|&c| c != base && c != base + 1) || above != extra {
        return Err(arg(
            "baseline",
            format!(
                "its item counts per rank {counts:?} are not balanced (each {base}, or {} on \
                 {extra} ranks), as balance_counts asks",
                base + 1
            ),
        ));
    }
    Ok(())
}

fn lower_bound(items: &Items, ranks: usize) -> f64 {
    let mut stamps = Stamps::new(items.segment_costs.len());
    stamps.next();
    let mut total = 0.0;
    let mut largest = 0.0f64;
    let mut own = Stamps::new(items.segment_costs.len());
    for i in 0..items.len() {
        total += items.costs[i];
        own.next();
        let mut alone = items.costs[i];
        for &s in items.segs(i) {
            if stamps.first(s) {
                total += items.segment_costs[s];
            }
            if own.first(s) {
                alone += items.segment_costs[s];
            }
        }
        largest = largest.max(alone);
    }
    (total / ranks as f64).max(largest)
}

fn count_split(item_groups: &[usize], ranks: &[usize], num_groups: usize) -> usize {
    let mut first = vec![usize::MAX; num_groups];
    let mut split = vec![false; num_groups];
    for (&g, &r) in item_groups.iter().zip(ranks) {
        if first[g] == usize::MAX {
            first[g] = r;
        } else if first[g] != r {
            split[g] = true;
        }
    }
    split.iter().filter(|&&s| s).count()
}

/// Group id per item (connected components over shared segments, numbered by first item).
///
/// # Errors
/// `PackingArgument` for malformed CSR or a segment id out of range.
pub fn segment_groups(
    item_seg_offsets: &[i64],
    item_segments: &[i64],
    num_segments: usize,
) -> CoreResult<Vec<i64>> {
    let n = item_seg_offsets.len().saturating_sub(1);
    let zeros = vec![0.0; n];
    let seg_zeros = vec![0.0; num_segments];
    let items = Items::new(&PlacementInput {
        item_costs: &zeros,
        item_seg_offsets,
        item_segments,
        segment_costs: &seg_zeros,
    })?;
    Ok(groups(&items).into_iter().map(|g| g as i64).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input<'a>(
        costs: &'a [f64],
        offsets: &'a [i64],
        segs: &'a [i64],
        seg_costs: &'a [f64],
    ) -> PlacementInput<'a> {
        PlacementInput {
            item_costs: costs,
            item_seg_offsets: offsets,
            item_segments: segs,
            segment_costs: seg_costs,
        }
    }

    fn opts(ranks: usize) -> PlacementOptions<'static> {
        PlacementOptions {
            num_ranks: ranks,
            tolerance: 0.05,
            balance_counts: true,
            baseline: None,
        }
    }

    #[test]
    fn groups_of_rows_sharing_an_image_land_together() {
        // 4 prompts x 2 rows, each prompt one image of cost 10; 2 ranks
        let costs = [1.0; 8];
        let offsets = [0, 1, 2, 3, 4, 5, 6, 7, 8];
        let segs = [0, 0, 1, 1, 2, 2, 3, 3];
        let p = place(&input(&costs, &offsets, &segs, &[10.0; 4]), &opts(2))
            .unwrap_or_else(|e| unreachable!("{e}"));
        assert_eq!(p.split_groups, 0);
        assert_eq!(p.costs.encodes(), 4);
        assert_eq!(p.costs.rank_costs, vec![24.0, 24.0]);
        assert_eq!(p.kind, PlacementKind::Groups);
    }

    #[test]
    fn one_big_group_is_split_for_balance() {
        // one prompt with 8 rows sharing a cheap image: spread, with one duplicate encode
        let costs = [10.0; 8];
        let offsets = [0, 1, 2, 3, 4, 5, 6, 7, 8];
        let segs = [0; 8];
        let p = place(&input(&costs, &offsets, &segs, &[1.0]), &opts(2))
            .unwrap_or_else(|e| unreachable!("{e}"));
        assert_eq!(p.costs.rank_costs, vec![41.0, 41.0]);
        assert_eq!(p.costs.encodes(), 2);
        assert_eq!(p.split_groups, 1);
    }

    #[test]
    fn malformed_input_is_a_typed_error() {
        let bad_seg = place(&input(&[1.0], &[0, 1], &[3], &[1.0]), &opts(1));
        assert!(matches!(
            bad_seg,
            Err(CoreError::PackingArgument {
                name: "item_segments",
                ..
            })
        ));
        let nan = place(&input(&[f64::NAN], &[0, 0], &[], &[]), &opts(1));
        assert!(matches!(
            nan,
            Err(CoreError::PackingArgument {
                name: "item_costs",
                ..
            })
        ));
        let offsets = place(&input(&[1.0, 1.0], &[0, 1], &[0], &[1.0]), &opts(1));
        assert!(matches!(
            offsets,
            Err(CoreError::PackingArgument {
                name: "item_seg_offsets",
                ..
            })
        ));
        let zero = place(&input(&[], &[0], &[], &[]), &opts(0));
        assert!(matches!(
            zero,
            Err(CoreError::PackingArgument {
                name: "num_ranks",
                ..
            })
        ));
    }

    #[test]
    fn a_better_baseline_wins() {
        // LPT and its swaps stop at 16 here; the optimum is 15
        let costs = [5.0, 5.0, 9.0, 6.0, 3.0, 2.0];
        let offsets = [0; 7];
        let worse = [0, 1, 0, 1, 0, 1];
        let o = PlacementOptions {
            num_ranks: 2,
            tolerance: 0.0,
            balance_counts: false,
            baseline: Some(&worse),
        };
        let p =
            place(&input(&costs, &offsets, &[], &[]), &o).unwrap_or_else(|e| unreachable!("{e}"));
        assert_eq!((p.costs.worst(), p.kind), (16.0, PlacementKind::Groups));
        let better = [0, 0, 1, 1, 0, 0];
        let o = PlacementOptions {
            baseline: Some(&better),
            ..o
        };
        let p =
            place(&input(&costs, &offsets, &[], &[]), &o).unwrap_or_else(|e| unreachable!("{e}"));
        assert_eq!((p.costs.worst(), p.kind), (15.0, PlacementKind::Baseline));
    }
}
