//! Modified first-fit decreasing exactly as NeMo-RL implements it (see the spec, §4.2), in
//! `O(n log n)`: every "first item in the current list that fits" becomes a binary search on
//! a static sorted array plus a skip-dead-entries union-find, and phase 5's sorted list of
//! bins (pop the least filled, re-insert with `bisect_right`) becomes a heap keyed by
//! `(fill, insertion counter)`.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use super::Bins;

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

pub(crate) fn mffd(lens: &[i64], capacity: i64) -> Bins {
    let c = i128::from(capacity);
    let size = |i: u32| lens[i as usize];
    let (mut large, mut medium, mut small, mut tiny) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for (i, &s) in lens.iter().enumerate() {
        let s128 = i128::from(s);
        let i = i as u32;
        if 2 * s128 > c {
            large.push(i);
        } else if 3 * s128 > c {
            medium.push(i);
        } else if 6 * s128 > c {
            small.push(i);
        } else {
            tiny.push(i);
        }
    }
    // Stable sorts: ties keep input order.
    large.sort_by_key(|&i| Reverse(size(i)));
    medium.sort_by_key(|&i| Reverse(size(i)));
    small.sort_by_key(|&i| size(i));
    tiny.sort_by_key(|&i| size(i));

    let nl = large.len();
    let mut sums: Vec<i64> = large.iter().map(|&i| size(i)).collect();
    let mut has_medium = vec![false; nl];
    // Placement log (bin, item); bins 0..nl are the phase-1 bins.
    let mut log: Vec<(u32, u32)> = Vec::with_capacity(lens.len());
    for (b, &i) in large.iter().enumerate() {
        log.push((b as u32, i));
    }
    let mut dead = vec![false; lens.len()];

    // Phase 2: forward, the first (largest) medium that fits, at most one per bin.
    let mut med_alive = Alive::new(medium.len());
    for b in 0..nl {
        let rem = capacity - sums[b];
        let p = medium.partition_point(|&i| size(i) > rem);
        let q = med_alive.find(p);
        if let Some(&it) = medium.get(q) {
            med_alive.kill_forward(q);
            dead[it as usize] = true;
            sums[b] += size(it);
            has_medium[b] = true;
            log.push((b as u32, it));
        }
    }

    // Phase 3: backward, pairs of smalls into bins without a medium.
    let mut s_fwd = Alive::new(small.len());
    let mut s_back = AliveBack::new(small.len());
    let mut small_left = small.len();
    for b in (0..nl).rev() {
        if has_medium[b] || small_left < 2 {
            continue;
        }
        let rem = capacity - sums[b];
        let f = s_fwd.find(0);
        let g = s_fwd.find(f + 1);
        let (fi, gi) = (small[f], small[g]);
        if size(fi) + size(gi) > rem {
            continue;
        }
        s_fwd.kill_forward(f);
        s_back.kill(f);
        let r2 = rem - size(fi);
        // Largest alive position whose size fits r2 (exists: g fits).
        let p = small.partition_point(|&i| size(i) <= r2);
        let Some(j) = p.checked_sub(1).and_then(|p| s_back.find(p)) else {
            continue;
        };
        s_fwd.kill_forward(j);
        s_back.kill(j);
        let ji = small[j];
        small_left -= 2;
        dead[fi as usize] = true;
        dead[ji as usize] = true;
        sums[b] += size(fi) + size(ji);
        log.push((b as u32, fi));
        log.push((b as u32, ji));
    }

    // Phase 4: remaining medium + small + tiny, by size descending (ties: input order);
    // each phase-1 bin repeatedly takes the first (largest) item that fits.
    let mut rest: Vec<u32> = medium
        .iter()
        .chain(small.iter())
        .chain(tiny.iter())
        .copied()
        .filter(|&i| !dead[i as usize])
        .collect();
    rest.sort_by_key(|&i| (Reverse(size(i)), i));
    let mut r_alive = Alive::new(rest.len());
    for (b, sum) in sums.iter_mut().enumerate() {
        loop {
            let rem = capacity - *sum;
            let p = rest.partition_point(|&i| size(i) > rem);
            let q = r_alive.find(p);
            let Some(&it) = rest.get(q) else { break };
            r_alive.kill_forward(q);
            dead[it as usize] = true;
            *sum += size(it);
            log.push((b as u32, it));
        }
    }

    // Phase 5: leftovers (same order) into the least-filled bin if it fits, else a new bin;
    // bins kept sorted by (fill, insertion counter), starting from one empty bin.
    let mut heap: BinaryHeap<Reverse<(i64, u64, u32)>> = BinaryHeap::new();
    let mut counter: u64 = 0;
    let mut next_bin = nl as u32;
    heap.push(Reverse((0, counter, next_bin)));
    next_bin += 1;
    let mut used: Vec<bool> = vec![false];
    for &it in &rest {
        if dead[it as usize] {
            continue;
        }
        let s = size(it);
        let (fill, bin) = match heap.peek() {
            Some(&Reverse((fill, _, bin))) if s <= capacity - fill => {
                heap.pop();
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
        counter += 1;
        heap.push(Reverse((fill + s, counter, bin)));
        log.push((bin, it));
    }
    // Output order: phase-1 bins, then phase-5 bins by (fill, counter), empty ones dropped.
    let mut tail: Vec<(i64, u64, u32)> = heap.into_iter().map(|Reverse(k)| k).collect();
    tail.sort_unstable();
    let total = next_bin as usize;
    let mut rank = vec![0u32; total];
    for (b, r) in rank.iter_mut().enumerate().take(nl) {
        *r = b as u32;
    }
    let mut k = nl as u32;
    for &(_, _, bin) in &tail {
        if used[(bin as usize) - nl] {
            rank[bin as usize] = k;
            k += 1;
        }
    }
    Bins::from_log(k as usize, &log, Some(&rank))
}
