//! Minimum bin slack (Gupta & Ho; Fleszar & Hindi's MBS'), bounded: bins are built one at
//! a time; each takes the largest remaining item, then a depth-first search over the
//! remaining sizes (largest first, sizes non-increasing along a path) looks for the subset
//! that leaves the least slack, stopping at zero slack or after `budget` search nodes. A node
//! with room for one more item only takes the largest that fits (no branching).
//!
//! Cost: `O(n log n)` to group sizes, plus at most `budget` nodes per bin, each an
//! `O(log_64 D)` bitset query and a table lookup (an `O(log D)` search when the capacity is
//! too large to index; D distinct sizes): `O(n log n + bins * budget * log D)`. `pack`
//! also tries the search's near-perfect prefix followed by best-fit decreasing on the rest
//! ([`with_tail`]) and plain best-fit decreasing, keeps the fewest bins, so the result is never
//! worse than best fit, and then repairs it (`super::repair`: the bins left with slack are
//! pooled and packed again while that saves bins).

use super::bitset::Bitset;
use super::{capacity_indexable, Bins, Problem};

struct Search<'a> {
    sizes: &'a [i64],
    /// `fits[r]`: how many distinct sizes are `<= r`, for `r` in `0..=capacity` when the
    /// capacity is small enough to index (else empty: binary search).
    fits: Vec<u32>,
    cnt: Vec<u32>,
    bits: Bitset,
    budget: usize,
    chosen: Vec<usize>,
    best: Vec<usize>,
    best_rem: i64,
}

impl Search<'_> {
    /// Largest rank `<= max_rank` whose size fits `rem` and which has items left.
    fn candidate(&self, max_rank: usize, rem: i64) -> Option<usize> {
        let count = match usize::try_from(rem).ok().and_then(|r| self.fits.get(r)) {
            Some(&c) => c as usize,
            None => self.sizes.partition_point(|&s| s <= rem),
        };
        let fit = count.checked_sub(1)?;
        self.bits.predecessor(fit.min(max_rank))
    }

    fn take(&mut self, r: usize) {
        self.cnt[r] -= 1;
        if self.cnt[r] == 0 {
            self.bits.remove(r);
        }
    }

    fn give_back(&mut self, r: usize) {
        if self.cnt[r] == 0 {
            self.bits.insert(r);
        }
        self.cnt[r] += 1;
    }

    fn dfs(&mut self, max_rank: usize, rem: i64, depth_left: usize) {
        if rem < self.best_rem {
            self.best_rem = rem;
            self.best.clone_from(&self.chosen);
        }
        if rem == 0 || depth_left == 0 {
            return;
        }
        let mut next = self.candidate(max_rank, rem);
        // Room for one more item at most: the largest that fits is the best leaf.
        let smallest = self.bits.successor(0).map_or(i64::MAX, |r| self.sizes[r]);
        if rem < smallest.saturating_mul(2) || depth_left == 1 {
            if let Some(r) = next {
                let left = rem - self.sizes[r];
                if left < self.best_rem {
                    self.best_rem = left;
                    self.best.clone_from(&self.chosen);
                    self.best.push(r);
                }
            }
            return;
        }
        while let Some(r) = next {
            if self.budget == 0 || self.best_rem == 0 {
                return;
            }
            self.budget -= 1;
            self.take(r);
            self.chosen.push(r);
            self.dfs(r, rem - self.sizes[r], depth_left - 1);
            self.chosen.pop();
            self.give_back(r);
            next = r.checked_sub(1).and_then(|h| self.bits.predecessor(h));
        }
    }
}

/// Minimum-bin-slack bins and the slack each bin was left with.
pub(crate) fn minimum_bin_slack(p: &Problem<'_>, budget: usize) -> (Bins, Vec<i64>) {
    let n = p.lens.len();
    // Distinct sizes ascending; items grouped by size rank, ascending index within a group.
    let mut sizes: Vec<i64> = p.lens.to_vec();
    sizes.sort_unstable();
    sizes.dedup();
    let d = sizes.len();
    let rank_of = |l: i64| sizes.partition_point(|&s| s < l);
    let mut group_start = vec![0usize; d + 1];
    let ranks: Vec<u32> = p.lens.iter().map(|&l| rank_of(l) as u32).collect();
    for &r in &ranks {
        group_start[r as usize + 1] += 1;
    }
    for k in 0..d {
        group_start[k + 1] += group_start[k];
    }
    let mut grouped = vec![0u32; n];
    let mut fill = group_start.clone();
    for (i, &r) in ranks.iter().enumerate() {
        grouped[fill[r as usize]] = i as u32;
        fill[r as usize] += 1;
    }
    let cnt: Vec<u32> = (0..d)
        .map(|r| (group_start[r + 1] - group_start[r]) as u32)
        .collect();
    let mut bits = Bitset::new(d.max(1));
    for (r, &c) in cnt.iter().enumerate() {
        if c > 0 {
            bits.insert(r);
        }
    }
    let mut taken = vec![0usize; d];
    let mut fits = Vec::new();
    if capacity_indexable(p.capacity, n) {
        let c = usize::try_from(p.capacity).unwrap_or(0);
        fits = vec![0u32; c + 1];
        let mut k = 0usize;
        for (r, f) in fits.iter_mut().enumerate() {
            while k < d && sizes[k] <= r as i64 {
                k += 1;
            }
            *f = k as u32;
        }
    }
    let mut s = Search {
        sizes: &sizes,
        fits,
        cnt,
        bits,
        budget: 0,
        chosen: Vec::new(),
        best: Vec::new(),
        best_rem: 0,
    };
    let mut offsets = Vec::with_capacity(n / 2 + 2);
    let mut slacks = Vec::with_capacity(n / 2 + 1);
    let mut items = Vec::with_capacity(n);
    offsets.push(0usize);
    let mut take_item = |r: usize, items: &mut Vec<u32>| {
        items.push(grouped[group_start[r] + taken[r]]);
        taken[r] += 1;
    };
    while let Some(seed) = d.checked_sub(1).and_then(|top| s.bits.predecessor(top)) {
        s.take(seed);
        take_item(seed, &mut items);
        let rem = p.capacity - sizes[seed];
        s.budget = budget;
        s.chosen.clear();
        s.best.clear();
        s.best_rem = rem;
        s.dfs(seed, rem, p.max_items.saturating_sub(1));
        let best = std::mem::take(&mut s.best);
        for &r in &best {
            s.take(r);
            take_item(r, &mut items);
        }
        s.best = best;
        slacks.push(s.best_rem);
        offsets.push(items.len());
    }
    (
        Bins {
            offsets,
            items,
            loads: None,
        },
        slacks,
    )
}

/// The first bin left with more than `tolerance` slack, where [`with_tail`] cuts.
pub(crate) fn tail_cut(slacks: &[i64], tolerance: i64) -> Option<usize> {
    slacks.iter().position(|&s| s > tolerance)
}

/// Keeps the minimum-bin-slack bins before bin `k` and packs the items of the rest with
/// `tail` (best-fit decreasing): the search is good at perfect bins and weak at the end,
/// where best fit does better.
pub(crate) fn with_tail(
    p: &Problem<'_>,
    mbs: &Bins,
    k: usize,
    tail: impl Fn(&Problem<'_>) -> Bins,
) -> Bins {
    let cut = mbs.offsets[k];
    let rest: Vec<u32> = mbs.items[cut..].to_vec();
    let lens: Vec<i64> = rest.iter().map(|&i| p.lens[i as usize]).collect();
    let sub = Problem {
        lens: &lens,
        media: None,
        capacity: p.capacity,
        media_capacity: p.media_capacity,
        max_items: p.max_items,
    };
    let tail_bins = tail(&sub);
    let mut offsets = mbs.offsets[..=k].to_vec();
    let mut items = mbs.items[..cut].to_vec();
    for w in tail_bins.offsets.windows(2) {
        items.extend(
            tail_bins.items[w[0]..w[1]]
                .iter()
                .map(|&j| rest[j as usize]),
        );
        offsets.push(items.len());
    }
    Bins {
        offsets,
        items,
        loads: None,
    }
}
