//! Next fit (`concatenative`) and first fit in a given order, with a segment tree over
//! bins (creation order) holding the largest remaining capacity, so each placement is
//! `O(log bins)` instead of NeMo-RL's linear scan. The bins and their order are exactly
//! those of the linear scan: the query returns the leftmost bin that fits, and a run of
//! equal lengths is placed a bin-share at a time (the copies sequential first fit would put
//! into the same bin): one tree operation per (run, bin) pair instead of one per item.

use super::{capacity_indexable, Bins, Problem};

/// Next fit in input order: a new bin starts when the item does not fit the current one
/// (or the current one holds `max_items`). Empty bins are never emitted.
pub(crate) fn concatenative(p: &Problem<'_>) -> Bins {
    let n = p.lens.len();
    let mut offsets = Vec::with_capacity(n / 2 + 2);
    let mut loads = Vec::with_capacity(n / 2 + 1);
    offsets.push(0usize);
    let mut load: i64 = 0;
    let mut mload: i64 = 0;
    let mut count: usize = 0;
    for (i, &l) in p.lens.iter().enumerate() {
        let m = p.media.map_or(0, |md| md[i]);
        // checked, not saturating: a sum saturated at i64::MAX would "fit" a budget of i64::MAX
        let fits = load.checked_add(l).is_some_and(|s| s <= p.capacity)
            && mload.checked_add(m).is_some_and(|s| s <= p.media_capacity)
            && count < p.max_items;
        if !fits && count > 0 {
            offsets.push(i);
            loads.push(load);
            load = 0;
            mload = 0;
            count = 0;
        }
        load += l;
        mload += m;
        count += 1;
    }
    if count > 0 {
        offsets.push(n);
        loads.push(load);
    }
    Bins {
        offsets,
        items: (0..n as u32).collect(),
        loads: Some(loads),
    }
}

/// Items sorted by length descending; ties by index descending (`ties_high_first`, NeMo-RL's
/// `sort(reverse=True)` on `(length, index)`) or ascending.
pub(crate) fn decreasing_order(lens: &[i64], capacity: i64, ties_high_first: bool) -> Vec<u32> {
    let n = lens.len();
    if capacity_indexable(capacity, n) {
        // Counting sort: O(n + C).
        let c = capacity as usize;
        let mut start = vec![0u32; c + 2];
        for &l in lens {
            start[c - l as usize + 1] += 1;
        }
        for k in 1..start.len() {
            start[k] += start[k - 1];
        }
        let mut order = vec![0u32; n];
        let mut place = |i: usize| {
            let slot = &mut start[c - lens[i] as usize];
            order[*slot as usize] = i as u32;
            *slot += 1;
        };
        if ties_high_first {
            (0..n).rev().for_each(&mut place);
        } else {
            (0..n).for_each(&mut place);
        }
        order
    } else {
        let mut order: Vec<u32> = (0..n as u32).collect();
        if ties_high_first {
            order.sort_unstable_by_key(|&i| std::cmp::Reverse((lens[i as usize], i)));
        } else {
            order.sort_unstable_by_key(|&i| (std::cmp::Reverse(lens[i as usize]), i));
        }
        order
    }
}

/// Max segment tree over bins; leaves hold the remaining capacity (or `CLOSED`).
struct MaxTree {
    size: usize,
    tok: Vec<i64>,
    med: Vec<i64>,
}

const CLOSED: i64 = i64::MIN;

impl MaxTree {
    fn new(with_media: bool) -> Self {
        let size = 64;
        Self {
            size,
            tok: vec![CLOSED; 2 * size],
            med: if with_media {
                vec![CLOSED; 2 * size]
            } else {
                Vec::new()
            },
        }
    }

    fn grow(&mut self) {
        let old = self.size;
        let size = old * 2;
        let rebuild = |v: &Vec<i64>| -> Vec<i64> {
            if v.is_empty() {
                return Vec::new();
            }
            let mut t = vec![CLOSED; 2 * size];
            t[size..size + old].copy_from_slice(&v[old..2 * old]);
            for k in (1..size).rev() {
                t[k] = t[2 * k].max(t[2 * k + 1]);
            }
            t
        };
        self.tok = rebuild(&self.tok);
        self.med = rebuild(&self.med);
        self.size = size;
    }

    fn set(&mut self, bin: usize, tok: i64, med: i64) {
        let mut k = self.size + bin;
        self.tok[k] = tok;
        if self.med.is_empty() {
            // Stop as soon as a node's maximum is unchanged: its ancestors are too.
            while k > 1 {
                k /= 2;
                let m = self.tok[2 * k].max(self.tok[2 * k + 1]);
                if self.tok[k] == m {
                    break;
                }
                self.tok[k] = m;
            }
            return;
        }
        self.med[k] = med;
        while k > 1 {
            k /= 2;
            let t = self.tok[2 * k].max(self.tok[2 * k + 1]);
            let m = self.med[2 * k].max(self.med[2 * k + 1]);
            if self.tok[k] == t && self.med[k] == m {
                break;
            }
            self.tok[k] = t;
            self.med[k] = m;
        }
    }

    /// Leftmost bin with remaining `>= l` (tokens only).
    fn leftmost(&self, l: i64) -> Option<usize> {
        if self.tok[1] < l {
            return None;
        }
        let mut k = 1;
        while k < self.size {
            k = if self.tok[2 * k] >= l {
                2 * k
            } else {
                2 * k + 1
            };
        }
        Some(k - self.size)
    }

    /// Leftmost bin with remaining tokens `>= l` and remaining media `>= m`. Subtrees whose
    /// maxima fail either budget are pruned; a subtree can pass both maxima without holding
    /// a bin that fits both, so this may visit more than one path.
    fn leftmost2(&self, l: i64, m: i64) -> Option<usize> {
        let mut stack = vec![1usize];
        while let Some(k) = stack.pop() {
            if self.tok[k] < l || self.med[k] < m {
                continue;
            }
            if k >= self.size {
                return Some(k - self.size);
            }
            stack.push(2 * k + 1);
            stack.push(2 * k);
        }
        None
    }
}

/// First fit in `order`: each item goes to the first bin (creation order) that fits every
/// budget, else to a new bin.
pub(crate) fn first_fit(p: &Problem<'_>, order: &[u32]) -> Bins {
    let with_media = p.media.is_some();
    let mut tree = MaxTree::new(with_media);
    let mut counts: Vec<usize> = Vec::new();
    let mut tok_rem: Vec<i64> = Vec::new();
    let mut med_rem: Vec<i64> = Vec::new();
    let mut log: Vec<(u32, u32)> = Vec::with_capacity(order.len());
    // Lengths in placement order, gathered in one independent-load loop (the placement loop
    // is a chain of dependent tree operations; a random read there stalls it).
    let ord_lens: Vec<i64> = order.iter().map(|&i| p.lens[i as usize]).collect();
    let mut k = 0;
    let mut run_end = 0;
    while k < order.len() {
        let i = order[k] as usize;
        let l = ord_lens[k];
        let m = p.media.map_or(0, |md| md[i]);
        // A run of equal lengths (no media budget): sequential first fit puts consecutive
        // copies into the same bin while they fit (every earlier bin is too full), so the
        // whole share goes in with one tree update.
        if k >= run_end {
            run_end = k + 1;
            if !with_media {
                while run_end < order.len() && ord_lens[run_end] == l {
                    run_end += 1;
                }
            }
        }
        let run = run_end - k;
        let found = if with_media {
            tree.leftmost2(l, m)
        } else {
            tree.leftmost(l)
        };
        let bin = match found {
            Some(b) => b,
            None => {
                let b = counts.len();
                if b >= tree.size {
                    tree.grow();
                }
                counts.push(0);
                tok_rem.push(p.capacity);
                med_rem.push(p.media_capacity);
                b
            }
        };
        let by_room = if l > 0 {
            usize::try_from(tok_rem[bin] / l).unwrap_or(usize::MAX)
        } else {
            usize::MAX
        };
        let take = run.min(by_room).min(p.max_items - counts[bin]).max(1);
        for &it in &order[k..k + take] {
            log.push((bin as u32, it));
        }
        counts[bin] += take;
        tok_rem[bin] -= l * take as i64;
        med_rem[bin] -= m * take as i64;
        if counts[bin] >= p.max_items {
            tree.set(bin, CLOSED, CLOSED);
        } else {
            tree.set(bin, tok_rem[bin], med_rem[bin]);
        }
        k += take;
    }
    Bins::from_log(counts.len(), &log, None)
}
