//! Modified first-fit decreasing exactly as NeMo-RL implements it (see the spec, §4.2), in
//! `O(n log n)`: every "first item in the current list that fits" becomes a binary search on
//! a static sorted array plus a skip-dead-entries union-find, and phase 5's sorted list of
//! bins (pop the least filled, re-insert with `bisect_right`) becomes a heap keyed by
//! `(fill, insertion counter)`.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use super::bitset::Bitset;
use super::{capacity_indexable, Bins};

/// "Next alive position at or after `i`" (or before, for `Backward`) with path halving.
struct Alive {
    link: Vec<u32>,
}

impl Alive {
    /// Positions `0..n`; position `n` (forward) is the always-alive sentinel.
    fn new(n: usize) -> Self {
        Self {
            link: (0..=n as u32).collect(),
        }
    }

    fn find(&mut self, mut i: usize) -> usize {
        while self.link[i] as usize != i {
            let up = self.link[i] as usize;
            self.link[i] = self.link[up];
            i = up;
        }
        i
    }

    fn kill_forward(&mut self, i: usize) {
        self.link[i] = (i + 1) as u32;
    }
}

/// Mirror of `Alive` for "previous alive at or before `i`": position `i` is stored at
/// `i + 1`, with 0 as the sentinel ("none").
struct AliveBack {
    inner: Alive,
}

impl AliveBack {
    fn new(n: usize) -> Self {
        Self {
            inner: Alive::new(n),
        }
    }

    /// Previous alive position `<= i`, or `None`.
    fn find(&mut self, i: usize) -> Option<usize> {
        let k = self.inner.find(i + 1);
        k.checked_sub(1)
    }

    fn kill(&mut self, i: usize) {
        self.inner.link[i + 1] = i as u32;
    }
}

/// Items by `(size, index)` ascending: counting sort when the capacity allows it.
fn ascending(lens: &[i64], capacity: i64) -> Vec<u32> {
    let n = lens.len();
    if capacity_indexable(capacity, n) {
        let c = capacity as usize;
        let mut start = vec![0usize; c + 2];
        for &l in lens {
            start[l as usize + 1] += 1;
        }
        for k in 1..start.len() {
            start[k] += start[k - 1];
        }
        let mut out = vec![0u32; n];
        for (i, &l) in lens.iter().enumerate() {
            let slot = &mut start[l as usize];
            out[*slot] = i as u32;
            *slot += 1;
        }
        out
    } else {
        let mut out: Vec<u32> = (0..n as u32).collect();
        out.sort_unstable_by_key(|&i| (lens[i as usize], i));
        out
    }
}

/// An ascending `(size, index)` run re-ordered by size descending, ties by index ascending
/// (what a stable descending sort of input-ordered items gives); sizes travel along.
fn descending_stable(asc: &[u32], sizes: &[i64]) -> (Vec<u32>, Vec<i64>) {
    let mut out = Vec::with_capacity(asc.len());
    let mut out_sizes = Vec::with_capacity(asc.len());
    let mut end = asc.len();
    while end > 0 {
        let s = sizes[end - 1];
        let mut start = end - 1;
        while start > 0 && sizes[start - 1] == s {
            start -= 1;
        }
        out.extend_from_slice(&asc[start..end]);
        out_sizes.extend_from_slice(&sizes[start..end]);
        end = start;
    }
    (out, out_sizes)
}

pub(crate) fn mffd(lens: &[i64], capacity: i64) -> Bins {
    let c = i128::from(capacity);
    let asc = ascending(lens, capacity);
    // Sizes in that order, gathered once so later passes read them sequentially.
    let asc_sizes: Vec<i64> = asc.iter().map(|&i| lens[i as usize]).collect();
    // Class boundaries in the ascending order: tiny | small | medium | large.
    let small_at = asc_sizes.partition_point(|&s| 6 * i128::from(s) <= c);
    let medium_at = asc_sizes.partition_point(|&s| 3 * i128::from(s) <= c);
    let large_at = asc_sizes.partition_point(|&s| 2 * i128::from(s) <= c);
    let (large, large_sizes) = descending_stable(&asc[large_at..], &asc_sizes[large_at..]);
    let (medium, medium_sizes) =
        descending_stable(&asc[medium_at..large_at], &asc_sizes[medium_at..large_at]);
    let small: &[u32] = &asc[small_at..medium_at];
    let small_sizes: &[i64] = &asc_sizes[small_at..medium_at];

    let mut bins = LargeBins::new(&large, large_sizes, lens.len(), capacity);
    bins.place_mediums(&medium, &medium_sizes);
    bins.place_small_pairs(small, small_sizes);
    let (rest, rest_sizes) = bins.remaining(&asc[..large_at], &asc_sizes[..large_at]);
    let rest_taken = bins.fill_from_rest(&rest, &rest_sizes);
    bins.place_leftovers(&rest, &rest_sizes, &rest_taken)
}

/// The phase-1 bins (one large item each) as phases 2-4 fill them, and the placement log
/// (bin, item) that becomes the CSR output; bins `0..nl` are the phase-1 bins.
struct LargeBins {
    capacity: i64,
    sums: Vec<i64>,
    has_medium: Vec<bool>,
    log: Vec<(u32, u32)>,
    /// Items placed by phases 2 and 3 (phase 4 reads what is left).
    dead: Vec<bool>,
}

impl LargeBins {
    /// Phase 1: one bin per large item, largest first.
    fn new(large: &[u32], large_sizes: Vec<i64>, n: usize, capacity: i64) -> Self {
        let mut log: Vec<(u32, u32)> = Vec::with_capacity(n);
        for (b, &i) in large.iter().enumerate() {
            log.push((b as u32, i));
        }
        Self {
            capacity,
            has_medium: vec![false; large.len()],
            sums: large_sizes,
            log,
            dead: vec![false; n],
        }
    }

    /// Phase 2: forward, the first (largest) medium that fits, at most one per bin.
    fn place_mediums(&mut self, medium: &[u32], medium_sizes: &[i64]) {
        let mut med_alive = Alive::new(medium.len());
        for b in 0..self.sums.len() {
            let rem = self.capacity - self.sums[b];
            let p = medium_sizes.partition_point(|&x| x > rem);
            let q = med_alive.find(p);
            if let Some(&it) = medium.get(q) {
                med_alive.kill_forward(q);
                self.dead[it as usize] = true;
                self.sums[b] += medium_sizes[q];
                self.has_medium[b] = true;
                self.log.push((b as u32, it));
            }
        }
    }

    /// Phase 3: backward, pairs of smalls into bins without a medium.
    fn place_small_pairs(&mut self, small: &[u32], small_sizes: &[i64]) {
        let mut s_fwd = Alive::new(small.len());
        let mut s_back = AliveBack::new(small.len());
        let mut small_left = small.len();
        for b in (0..self.sums.len()).rev() {
            if self.has_medium[b] || small_left < 2 {
                continue;
            }
            let rem = self.capacity - self.sums[b];
            let f = s_fwd.find(0);
            let g = s_fwd.find(f + 1);
            let (fi, fs) = (small[f], small_sizes[f]);
            if fs + small_sizes[g] > rem {
                continue;
            }
            s_fwd.kill_forward(f);
            s_back.kill(f);
            let r2 = rem - fs;
            // Largest alive position whose size fits r2 (exists: g fits).
            let p = small_sizes.partition_point(|&x| x <= r2);
            let Some(j) = p.checked_sub(1).and_then(|p| s_back.find(p)) else {
                continue;
            };
            s_fwd.kill_forward(j);
            s_back.kill(j);
            let ji = small[j];
            small_left -= 2;
            self.dead[fi as usize] = true;
            self.dead[ji as usize] = true;
            self.sums[b] += fs + small_sizes[j];
            self.log.push((b as u32, fi));
            self.log.push((b as u32, ji));
        }
    }

    /// The remaining medium + small + tiny items (the ascending run `asc` below the large
    /// class), by size descending (ties: input order), sizes alongside.
    fn remaining(&self, asc: &[u32], asc_sizes: &[i64]) -> (Vec<u32>, Vec<i64>) {
        let (all_rest, all_rest_sizes) = descending_stable(asc, asc_sizes);
        let mut rest: Vec<u32> = Vec::with_capacity(all_rest.len());
        let mut rest_sizes: Vec<i64> = Vec::with_capacity(all_rest.len());
        for (&i, &sz) in all_rest.iter().zip(&all_rest_sizes) {
            if !self.dead[i as usize] {
                rest.push(i);
                rest_sizes.push(sz);
            }
        }
        (rest, rest_sizes)
    }

    /// Phase 4: each phase-1 bin repeatedly takes the first (largest) remaining item that
    /// fits. Returns which positions of `rest` were taken.
    fn fill_from_rest(&mut self, rest: &[u32], rest_sizes: &[i64]) -> Vec<bool> {
        let capacity = self.capacity;
        let mut rest_taken = vec![false; rest.len()];
        let first_le = first_le_table(rest_sizes, capacity, self.dead.len());
        let mut r_alive = Alive::new(rest.len());
        for (b, sum) in self.sums.iter_mut().enumerate() {
            loop {
                let rem = capacity - *sum;
                let p = match &first_le {
                    Some(t) => t[rem as usize] as usize,
                    None => rest_sizes.partition_point(|&x| x > rem),
                };
                let q = r_alive.find(p);
                let Some(&it) = rest.get(q) else {
                    break;
                };
                r_alive.kill_forward(q);
                rest_taken[q] = true;
                *sum += rest_sizes[q];
                self.log.push((b as u32, it));
            }
        }
        rest_taken
    }

    /// Phase 5: leftovers (same order) into the least-filled bin if it fits, else a new bin;
    /// bins kept sorted by (fill, insertion order), starting from one empty bin. Then the
    /// output: phase-1 bins, then phase-5 bins by (fill, insertion), empty ones dropped.
    fn place_leftovers(self, rest: &[u32], rest_sizes: &[i64], rest_taken: &[bool]) -> Bins {
        let Self {
            capacity,
            sums,
            mut log,
            dead,
            ..
        } = self;
        let nl = sums.len();
        let mut queue = FillQueue::new(capacity, dead.len(), nl as u32);
        let mut next_bin = nl as u32;
        queue.push(0, next_bin);
        next_bin += 1;
        let mut used: Vec<bool> = vec![false];
        for ((&it, &s), &taken) in rest.iter().zip(rest_sizes).zip(rest_taken) {
            if taken {
                continue;
            }
            let (fill, bin) = match queue.peek() {
                Some((fill, bin)) if s <= capacity - fill => {
                    queue.pop();
                    (fill, bin)
                }
                _ => {
                    let bin = next_bin;
                    next_bin += 1;
                    used.push(false);
                    (0, bin)
                }
            };
            used[(bin as usize) - nl] = true;
            queue.push(fill + s, bin);
            log.push((bin, it));
        }
        let total = next_bin as usize;
        let mut rank = vec![0u32; total];
        for (b, r) in rank.iter_mut().enumerate().take(nl) {
            *r = b as u32;
        }
        let mut k = nl as u32;
        let mut loads = sums;
        for (bin, fill) in queue.into_sorted() {
            if used[(bin as usize) - nl] {
                rank[bin as usize] = k;
                k += 1;
                loads.push(fill);
            }
        }
        let mut bins = Bins::from_log(k as usize, &log, Some(&rank));
        bins.loads = Some(loads);
        bins
    }
}

/// `first_le[v]`: the first position in `rest_sizes` (descending) whose size is `<= v`, when
/// the capacity is small enough to index by (phase 4 then skips the binary search).
fn first_le_table(rest_sizes: &[i64], capacity: i64, n: usize) -> Option<Vec<u32>> {
    capacity_indexable(capacity, n).then(|| {
        let mut table = Vec::with_capacity(capacity as usize + 1);
        let mut p = rest_sizes.len();
        for v in 0..=capacity {
            while p > 0 && rest_sizes[p - 1] <= v {
                p -= 1;
            }
            table.push(p as u32);
        }
        table
    })
}

const NONE: u32 = u32::MAX;

/// Bins ordered by `(fill, insertion order)`, popping the least filled: NeMo-RL's sorted list
/// with `pop(0)` and `bisect_right` insertion. A bucket queue (one FIFO list per fill value and
/// a bitset over non-empty fills) when the capacity is indexable, else a binary heap.
enum FillQueue {
    Buckets {
        head: Vec<u32>,
        tail: Vec<u32>,
        next: Vec<u32>,
        bits: Bitset,
        base: u32,
    },
    Heap {
        heap: BinaryHeap<Reverse<(i64, u64, u32)>>,
        counter: u64,
    },
}

impl FillQueue {
    fn new(capacity: i64, n: usize, base: u32) -> Self {
        if capacity_indexable(capacity, n) {
            let c = capacity as usize;
            Self::Buckets {
                head: vec![NONE; c + 1],
                tail: vec![NONE; c + 1],
                next: Vec::new(),
                bits: Bitset::new(c + 1),
                base,
            }
        } else {
            Self::Heap {
                heap: BinaryHeap::new(),
                counter: 0,
            }
        }
    }

    fn push(&mut self, fill: i64, bin: u32) {
        match self {
            Self::Buckets {
                head,
                tail,
                next,
                bits,
                base,
            } => {
                let f = fill as usize;
                let k = (bin - *base) as usize;
                if next.len() <= k {
                    next.resize(k + 1, NONE);
                }
                next[k] = NONE;
                if head[f] == NONE {
                    head[f] = bin;
                    bits.insert(f);
                } else {
                    next[(tail[f] - *base) as usize] = bin;
                }
                tail[f] = bin;
            }
            Self::Heap { heap, counter } => {
                *counter += 1;
                heap.push(Reverse((fill, *counter, bin)));
            }
        }
    }

    fn peek(&self) -> Option<(i64, u32)> {
        match self {
            Self::Buckets { head, bits, .. } => {
                let f = bits.successor(0)?;
                Some((f as i64, head[f]))
            }
            Self::Heap { heap, .. } => heap.peek().map(|&Reverse((f, _, b))| (f, b)),
        }
    }

    fn pop(&mut self) {
        match self {
            Self::Buckets {
                head,
                next,
                bits,
                base,
                ..
            } => {
                if let Some(f) = bits.successor(0) {
                    let b = head[f];
                    head[f] = next[(b - *base) as usize];
                    if head[f] == NONE {
                        bits.remove(f);
                    }
                }
            }
            Self::Heap { heap, .. } => {
                heap.pop();
            }
        }
    }

    /// `(bin, fill)` in `(fill, insertion order)` order.
    fn into_sorted(self) -> Vec<(u32, i64)> {
        match self {
            Self::Buckets {
                head,
                next,
                bits,
                base,
                ..
            } => {
                let mut out = Vec::new();
                let mut f = bits.successor(0);
                while let Some(fill) = f {
                    let mut b = head[fill];
                    while b != NONE {
                        out.push((b, fill as i64));
                        b = next[(b - base) as usize];
                    }
                    f = bits.successor(fill + 1);
                }
                out
            }
            Self::Heap { heap, .. } => {
                let mut keys: Vec<(i64, u64, u32)> = heap.into_iter().map(|Reverse(k)| k).collect();
                keys.sort_unstable();
                keys.into_iter().map(|k| (k.2, k.0)).collect()
            }
        }
    }
}
