//! Best-fit decreasing. Fast path (no media budget, capacity indexable): counting sort of
//! the lengths, bins bucketed by remaining capacity, and a hierarchical bitset over the
//! non-empty buckets, so "the fullest bin that still fits" is one successor query:
//! `O(n + C)` overall with a small constant. Otherwise ordered sets keyed by remaining
//! capacity: `O(n log n)` without media; with media the bucket scan can visit more than one
//! bucket when the media budget binds.

use std::collections::BTreeSet;

use super::bitset::Bitset;
use super::firstfit::decreasing_order;
use super::{capacity_indexable, Bins, Problem};

const NONE: u32 = u32::MAX;

pub(crate) fn best_fit_decreasing(p: &Problem<'_>) -> Bins {
    if p.media.is_none() && capacity_indexable(p.capacity, p.lens.len()) {
        fast(p)
    } else {
        general(p)
    }
}

fn fast(p: &Problem<'_>) -> Bins {
    let n = p.lens.len();
    let c = p.capacity as usize;
    // Counting sort, length descending, ties by index ascending: items of length l sit at
    // order[start[c - l]..start[c - l + 1]].
    let mut start = vec![0usize; c + 2];
    for &l in p.lens {
        start[c - l as usize + 1] += 1;
    }
    for k in 1..start.len() {
        start[k] += start[k - 1];
    }
    let mut order = vec![0u32; n];
    {
        let mut fill = start.clone();
        for (i, &l) in p.lens.iter().enumerate() {
            let slot = &mut fill[c - l as usize];
            order[*slot] = i as u32;
            *slot += 1;
        }
    }
    // head[r]: a bin with remaining capacity r (stack linked through next_in_bucket).
    let mut head = vec![NONE; c + 1];
    let mut next_in_bucket: Vec<u32> = Vec::with_capacity(n / 2 + 1);
    let mut counts: Vec<u32> = Vec::with_capacity(n / 2 + 1);
    let mut loads: Vec<i64> = Vec::with_capacity(n / 2 + 1);
    let mut bin_seq = vec![0u32; n];
    let mut open = Bitset::new(c + 1);
    let max_items = u32::try_from(p.max_items).unwrap_or(u32::MAX);
    // Zero lengths too (`allow_zero`): they join the fullest open bin like any other item.
    for l in (0..=c).rev() {
        let (a, b) = (start[c - l], start[c - l + 1]);
        for slot in &mut bin_seq[a..b] {
            let (bin, rem) = match open.successor(l) {
                Some(r) => {
                    let bin = head[r];
                    let nxt = next_in_bucket[bin as usize];
                    head[r] = nxt;
                    if nxt == NONE {
                        open.remove(r);
                    }
                    (bin, r - l)
                }
                None => {
                    let bin = counts.len() as u32;
                    counts.push(0);
                    loads.push(0);
                    next_in_bucket.push(NONE);
                    (bin, c - l)
                }
            };
            *slot = bin;
            let cnt = &mut counts[bin as usize];
            *cnt += 1;
            loads[bin as usize] = (c - rem) as i64;
            if rem > 0 && *cnt < max_items {
                let h = head[rem];
                if h == NONE {
                    open.insert(rem);
                }
                next_in_bucket[bin as usize] = h;
                head[rem] = bin;
            }
        }
    }
    // CSR by bin, items in placement order.
    let nb = counts.len();
    let mut offsets = vec![0usize; nb + 1];
    for b in 0..nb {
        offsets[b + 1] = offsets[b] + counts[b] as usize;
    }
    let mut fill = offsets.clone();
    let mut items = vec![0u32; n];
    for (&bin, &it) in bin_seq.iter().zip(&order) {
        let f = &mut fill[bin as usize];
        items[*f] = it;
        *f += 1;
    }
    Bins {
        offsets,
        items,
        loads: Some(loads),
    }
}

fn general(p: &Problem<'_>) -> Bins {
    let order = decreasing_order(p.lens, p.capacity, false);
    // (remaining tokens, remaining media, bin): the smallest remaining token capacity that
    // fits wins; among equal token remainders the smallest media remainder that fits.
    let mut open: BTreeSet<(i64, i64, u32)> = BTreeSet::new();
    let mut counts: Vec<usize> = Vec::new();
    let mut log: Vec<(u32, u32)> = Vec::with_capacity(order.len());
    for &it in &order {
        let i = it as usize;
        let l = p.lens[i];
        let m = p.media.map_or(0, |md| md[i]);
        let found = open
            .range((l, m, 0)..)
            .find(|&&(_, mr, _)| mr >= m)
            .copied();
        let (bin, tr, mr) = match found {
            Some(key) => {
                open.remove(&key);
                (key.2, key.0, key.1)
            }
            None => {
                counts.push(0);
                ((counts.len() - 1) as u32, p.capacity, p.media_capacity)
            }
        };
        counts[bin as usize] += 1;
        let (tr, mr) = (tr - l, mr - m);
        if counts[bin as usize] < p.max_items && (tr > 0 || (p.media.is_some() && mr > 0)) {
            open.insert((tr, mr, bin));
        }
        log.push((bin, it));
    }
    Bins::from_log(counts.len(), &log, None)
}
