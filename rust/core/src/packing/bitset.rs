//! A hierarchical bitset over `0..universe`: insert, remove, successor and predecessor
//! queries in `O(log_64 universe)` word operations. It replaces a segment tree over bin
//! remaining capacities (best fit) and over item sizes (minimum bin slack).

/// Bits per word.
const W: usize = 64;

pub(crate) struct Bitset {
    /// `levels[0]` holds one bit per element; `levels[k + 1]` one bit per non-zero word of
    /// `levels[k]`. The last level is a single word.
    levels: Vec<Vec<u64>>,
}

impl Bitset {
    pub(crate) fn new(universe: usize) -> Self {
        let mut levels = Vec::new();
        let mut n = universe.max(1);
        loop {
            let words = n.div_ceil(W);
            levels.push(vec![0u64; words]);
            if words == 1 {
                break;
            }
            n = words;
        }
        Self { levels }
    }

    pub(crate) fn insert(&mut self, x: usize) {
        let mut pos = x;
        for level in &mut self.levels {
            let Some(word) = level.get_mut(pos / W) else {
                return;
            };
            let was_empty = *word == 0;
            *word |= 1u64 << (pos % W);
            if !was_empty {
                return;
            }
            pos /= W;
        }
    }

    pub(crate) fn remove(&mut self, x: usize) {
        let mut pos = x;
        for level in &mut self.levels {
            let Some(word) = level.get_mut(pos / W) else {
                return;
            };
            *word &= !(1u64 << (pos % W));
            if *word != 0 {
                return;
            }
            pos /= W;
        }
    }

    /// Smallest element `>= x`.
    pub(crate) fn successor(&self, x: usize) -> Option<usize> {
        let mut lvl = 0;
        let mut pos = x;
        loop {
            let level = self.levels.get(lvl)?;
            let word = *level.get(pos / W)?;
            let masked = word & (u64::MAX << (pos % W));
            if masked != 0 {
                pos = (pos / W) * W + masked.trailing_zeros() as usize;
                break;
            }
            pos = pos / W + 1;
            lvl += 1;
        }
        while lvl > 0 {
            lvl -= 1;
            let word = *self.levels.get(lvl)?.get(pos)?;
            pos = pos * W + word.trailing_zeros() as usize;
        }
        Some(pos)
    }

    /// Largest element `<= x`.
    pub(crate) fn predecessor(&self, x: usize) -> Option<usize> {
        let mut lvl = 0;
        let mut pos = x;
        loop {
            let level = self.levels.get(lvl)?;
            let w = pos / W;
            let (w, masked) = match level.get(w) {
                Some(&word) => (w, word & (u64::MAX >> (W - 1 - pos % W))),
                // Past the end: everything in the last word counts.
                None => {
                    let last = level.len().checked_sub(1)?;
                    (last, *level.get(last)?)
                }
            };
            if masked != 0 {
                pos = w * W + (W - 1 - masked.leading_zeros() as usize);
                break;
            }
            pos = w.checked_sub(1)?;
            lvl += 1;
        }
        while lvl > 0 {
            lvl -= 1;
            let word = *self.levels.get(lvl)?.get(pos)?;
            pos = pos * W + (W - 1 - word.leading_zeros() as usize);
        }
        Some(pos)
    }
}

#[cfg(test)]
mod tests {
    use super::Bitset;
    use std::collections::BTreeSet;

    #[test]
    fn matches_btreeset() {
        for universe in [1usize, 5, 64, 65, 4097, 300_000] {
            let mut b = Bitset::new(universe);
            let mut s = BTreeSet::new();
            let mut x: u64 = 12345;
            for _ in 0..5000 {
                x = x
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                let v = usize::try_from(x >> 33).unwrap_or(0) % universe;
                if x % 3 == 0 {
                    b.remove(v);
                    s.remove(&v);
                } else {
                    b.insert(v);
                    s.insert(v);
                }
                let q = usize::try_from(x >> 40).unwrap_or(0) % (universe + 3);
                assert_eq!(b.successor(q), s.range(q..).next().copied());
                assert_eq!(b.predecessor(q), s.range(..=q).next_back().copied());
            }
        }
    }
}
