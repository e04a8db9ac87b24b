//! Repair pass for minimum bin slack: dissolve every bin left with slack and pack the
//! pooled items again. A greedy one-bin-at-a-time search fills bins perfectly while the
//! remaining items are varied, then wastes space where they run out of small items (at each
//! `C / k` boundary, and at the end); the items of those bins, pooled, come from different
//! phases and pack much more tightly together. A round is kept only when it saves bins, so
//! the result never gets worse; rounds stop at the first one that saves none (or that fills
//! no bin, as the next pool would be the same).
//!
//! Cost per round: one `solve` on the pool (at most every item) plus `O(n)` to rebuild the
//! bins; the pool shrinks each kept round.

use super::{Bins, Problem};

/// At most this many kept rounds (in practice one to three save bins).
const MAX_ROUNDS: usize = 8;

/// Dissolves the bins of `bins` whose load is under the capacity and packs their items with
/// `solve`, while that saves bins. Full bins keep their order and come first.
pub(crate) fn repair(
    p: &Problem<'_>,
    mut bins: Bins,
    solve: impl Fn(&Problem<'_>) -> Bins,
) -> Bins {
    for _ in 0..MAX_ROUNDS {
        let nb = bins.num_bins();
        let loads: Vec<i64> = match bins.loads.take() {
            Some(l) if l.len() == nb => l,
            _ => bins
                .offsets
                .windows(2)
                .map(|w| {
                    bins.items[w[0]..w[1]]
                        .iter()
                        .map(|&i| p.lens[i as usize])
                        .sum()
                })
                .collect(),
        };
        let open = loads.iter().filter(|&&l| l < p.capacity).count();
        // Nothing to pool, or the pool is every item: the same multiset packs the same way.
        if open == 0 || open == nb {
            bins.loads = Some(loads);
            return bins;
        }
        let mut pool: Vec<u32> = Vec::new();
        for (b, w) in bins.offsets.windows(2).enumerate() {
            if loads[b] < p.capacity {
                pool.extend_from_slice(&bins.items[w[0]..w[1]]);
            }
        }
        let lens: Vec<i64> = pool.iter().map(|&i| p.lens[i as usize]).collect();
        let sub = Problem {
            lens: &lens,
            media: None,
            capacity: p.capacity,
            media_capacity: p.media_capacity,
            max_items: p.max_items,
        };
        let packed = solve(&sub);
        if packed.num_bins() >= open {
            bins.loads = Some(loads);
            return bins;
        }
        let mut offsets = Vec::with_capacity(nb - open + packed.num_bins() + 1);
        let mut items = Vec::with_capacity(bins.items.len());
        let mut new_loads = Vec::with_capacity(offsets.capacity());
        offsets.push(0);
        for (b, w) in bins.offsets.windows(2).enumerate() {
            if loads[b] >= p.capacity {
                items.extend_from_slice(&bins.items[w[0]..w[1]]);
                offsets.push(items.len());
                new_loads.push(loads[b]);
            }
        }
        let mut filled = 0usize;
        for w in packed.offsets.windows(2) {
            let mut load = 0;
            for &j in &packed.items[w[0]..w[1]] {
                items.push(pool[j as usize]);
                load += lens[j as usize];
            }
            offsets.push(items.len());
            new_loads.push(load);
            filled += usize::from(load >= p.capacity);
        }
        bins = Bins {
            offsets,
            items,
            loads: Some(new_loads),
        };
        // No new bin is full: the next pool would be this one again.
        if filled == 0 {
            break;
        }
    }
    bins
}

#[cfg(test)]
mod tests {
    use super::repair;
    use crate::packing::{mbs_candidates, Bins, Problem, DEFAULT_SEARCH_BUDGET};

    /// The benchmark's hard set in miniature: lognormal lengths, median `0.3 * C`, sigma
    /// 0.5, clipped to `[16, C]`.
    fn hard_lengths(n: usize, capacity: i64, seed: u64) -> Vec<i64> {
        let mut x = seed;
        let mut uniform = move || {
            x = x
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            ((x >> 11) as f64 + 0.5) / (1u64 << 53) as f64
        };
        (0..n)
            .map(|_| {
                let (u, v) = (uniform(), uniform());
                let z = (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos();
                let l = (0.3 * capacity as f64 * (0.5 * z).exp()).round() as i64;
                l.clamp(16, capacity)
            })
            .collect()
    }

    fn check(bins: &Bins, p: &Problem<'_>) {
        let mut seen = vec![0u32; p.lens.len()];
        let loads = bins.loads.as_deref();
        for (b, w) in bins.offsets.windows(2).enumerate() {
            let items = &bins.items[w[0]..w[1]];
            assert!(!items.is_empty() && items.len() <= p.max_items);
            let load: i64 = items.iter().map(|&i| p.lens[i as usize]).sum();
            assert!(load <= p.capacity);
            if let Some(l) = loads {
                assert_eq!(l[b], load);
            }
            for &i in items {
                seen[i as usize] += 1;
            }
        }
        assert!(seen.iter().all(|&s| s == 1));
    }

    #[test]
    fn repair_saves_bins_on_hard_lengths() {
        let capacity = 4096;
        for (n, max_items) in [(20_000, usize::MAX), (5_000, 3)] {
            let lens = hard_lengths(n, capacity, 4321);
            let p = Problem {
                lens: &lens,
                media: None,
                capacity,
                media_capacity: 0,
                max_items,
            };
            let before = mbs_candidates(&p, DEFAULT_SEARCH_BUDGET);
            check(&before, &p);
            let count = before.num_bins();
            let after = repair(&p, before, |sub| mbs_candidates(sub, DEFAULT_SEARCH_BUDGET));
            check(&after, &p);
            assert!(after.num_bins() <= count);
            if max_items == usize::MAX {
                assert!(after.num_bins() < count, "{} !< {count}", after.num_bins());
            }
        }
    }

    #[test]
    fn repair_keeps_full_and_all_open_packings() {
        // Every bin full: nothing to pool.
        let lens = [5i64, 5, 10, 3, 7];
        let p = Problem {
            lens: &lens,
            media: None,
            capacity: 10,
            media_capacity: 0,
            max_items: usize::MAX,
        };
        let bins = repair(&p, mbs_candidates(&p, 16), |sub| mbs_candidates(sub, 16));
        check(&bins, &p);
        assert_eq!(bins.num_bins(), 3);
        // Every bin open (items over half the capacity): left as is.
        let lens = [6i64, 7, 8, 6];
        let p = Problem { lens: &lens, ..p };
        let bins = repair(&p, mbs_candidates(&p, 16), |sub| mbs_candidates(sub, 16));
        check(&bins, &p);
        assert_eq!(bins.num_bins(), 4);
    }
}
