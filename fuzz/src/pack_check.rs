//! Every packing algorithm with every constraint: each item lands in exactly one bin or is
//! reported as oversize, budgets and the item cap hold, bin-count adjustment hits its target,
//! errors happen exactly when an option or item is invalid; then rank assignment and the
//! public `adjust_bin_count` on the result, and the shuffle permutation.
use mmpack_core::packing::{
    adjust_bin_count, assign_to_ranks, pack, shuffle_permutation, Algorithm, OnOversize,
    PackOptions, Packing, RankCost,
};
use mmpack_core::CoreError;

use crate::bytes::Bytes;

#[derive(Debug)]
struct Case {
    lens: Vec<i64>,
    media: Option<Vec<i64>>,
    media_capacity: Option<i64>,
    capacity: i64,
    algorithm: Algorithm,
    max_items: Option<usize>,
    min_bins: Option<usize>,
    multiple: Option<usize>,
    on_oversize: OnOversize,
    order: Option<Vec<i64>>,
    allow_zero: bool,
    search_budget: usize,
}

impl Case {
    fn opts(&self) -> PackOptions<'_> {
        let mut o = PackOptions::new(self.capacity, self.algorithm);
        o.max_items_per_bin = self.max_items;
        o.media_capacity = self.media_capacity;
        o.min_bins = self.min_bins;
        o.bins_multiple_of = self.multiple;
        o.on_oversize = self.on_oversize;
        o.order = self.order.as_deref();
        o.allow_zero = self.allow_zero;
        o.search_budget = self.search_budget;
        o
    }

    fn run(&self) -> Result<Packing, CoreError> {
        pack(&self.lens, self.media.as_deref(), &self.opts())
    }
}

fn gen(b: &mut Bytes<'_>) -> Case {
    let algorithm = Algorithm::ALL[b.below(6)];
    let cap_tag = b.u8();
    let capacity = match cap_tag % 8 {
        0 => b.wild(-2, 300),
        1 => b.range(1, 4),
        2 => i64::from(b.u32() >> (b.u8() % 32)),
        _ => b.range(1, 64),
    };
    let many = b.flag();
    let n = b.below(if many { 200 } else { 24 });
    let big = capacity.clamp(1, 1 << 20);
    let lens: Vec<i64> = (0..n)
        .map(|_| match b.u8() % 16 {
            0 => b.wild(-2, big + 2),
            1 => capacity,
            2 => capacity.saturating_add(1),
            _ => b.range(1, big.min(255)),
        })
        .collect();
    let media_mode = b.u8();
    let (media, media_capacity) = match media_mode % 6 {
        0 | 1 => {
            let m = (0..n).map(|_| b.wild(-1, 5)).collect();
            (Some(m), Some(b.wild(-1, 8)))
        }
        2 if media_mode & 0x40 != 0 => {
            let len = b.below(n + 2);
            (Some((0..len).map(|_| b.range(0, 3)).collect()), Some(3))
        }
        2 if media_mode & 0x80 != 0 => (Some(vec![0; n]), None),
        3 if media_mode & 0x80 != 0 => (None, Some(4)),
        _ => (None, None),
    };
    let opt_usize = |b: &mut Bytes<'_>, hi: usize| -> Option<usize> {
        let t = b.u8();
        match t % 4 {
            0 => Some(b.below(hi + 1)),
            1 if t & 0x80 != 0 => Some(usize::MAX - b.below(3)),
            _ => None,
        }
    };
    let max_items = opt_usize(b, 5);
    let min_bins = opt_usize(b, 30);
    let multiple = opt_usize(b, 6);
    let on_oversize = [OnOversize::Error, OnOversize::Skip, OnOversize::Truncate][b.below(3)];
    let order = match b.u8() % 8 {
        0 => None,
        1 => Some((0..b.below(n + 2)).map(|_| b.wild(-1, n as i64)).collect()),
        _ => {
            // A permutation from a Fisher-Yates walk driven by the input.
            let mut p: Vec<i64> = (0..n as i64).collect();
            for i in (1..n).rev() {
                let j = b.below(i + 1);
                p.swap(i, j);
            }
            Some(p)
        }
    };
    let allow_zero = b.u8() % 4 == 0;
    let search_budget = [0, 1, 4, 256][b.below(4)];
    Case {
        lens,
        media,
        media_capacity,
        capacity,
        algorithm,
        max_items,
        min_bins,
        multiple,
        on_oversize,
        order,
        allow_zero,
        search_budget,
    }
}

fn supports_media(a: Algorithm) -> bool {
    !matches!(
        a,
        Algorithm::ModifiedFirstFitDecreasing | Algorithm::MinimumBinSlack
    )
}

/// Whether `pack` must refuse the case before packing (a bad option or item), and which items
/// are oversize otherwise.
fn model(c: &Case) -> Result<Vec<i64>, ()> {
    let n = c.lens.len();
    if c.capacity < 1 || c.max_items == Some(0) || c.multiple == Some(0) {
        return Err(());
    }
    match (&c.media, c.media_capacity) {
        (Some(m), Some(mc)) if m.len() == n && mc >= 0 => {}
        (None, None) => {}
        _ => return Err(()),
    }
    if c.media.is_some() && !supports_media(c.algorithm) {
        return Err(());
    }
    let mffd = c.algorithm == Algorithm::ModifiedFirstFitDecreasing;
    if (c.max_items.is_some() || c.allow_zero) && mffd {
        return Err(());
    }
    if c.algorithm == Algorithm::FirstFitShuffle {
        let Some(o) = &c.order else { return Err(()) };
        let mut sorted = o.clone();
        sorted.sort_unstable();
        if sorted != (0..n as i64).collect::<Vec<_>>() {
            return Err(());
        }
    }
    let min_len = i64::from(!c.allow_zero);
    let mut oversize = Vec::new();
    for i in 0..n {
        let l = c.lens[i];
        let m = c.media.as_ref().map_or(0, |m| m[i]);
        let mc = c.media_capacity.unwrap_or(0);
        if l < min_len || m < 0 {
            return Err(());
        }
        let media_over = c.media.is_some() && m > mc;
        if media_over && c.on_oversize != OnOversize::Skip {
            return Err(());
        }
        if l > c.capacity || media_over {
            if c.on_oversize == OnOversize::Error {
                return Err(());
            }
            oversize.push(i as i64);
        }
    }
    Ok(oversize)
}

fn check_packing(c: &Case, p: &Packing, oversize: &[i64]) {
    let n = c.lens.len();
    assert_eq!(p.oversize, oversize);
    let nb = p.num_bins();
    assert_eq!(p.bin_offsets.first().copied(), Some(0));
    assert_eq!(
        p.bin_offsets.last().copied(),
        Some(p.item_indices.len() as i64)
    );
    assert!(
        p.bin_offsets.windows(2).all(|w| w[0] < w[1]),
        "an empty bin or bad offsets"
    );
    assert_eq!(p.bin_loads.len(), nb);
    assert_eq!(p.bin_media.len(), if c.media.is_some() { nb } else { 0 });
    let mut seen = vec![0u32; n];
    let eff = |i: usize| c.lens[i].min(c.capacity);
    let mut total: i128 = 0;
    for b in 0..nb {
        let items = &p.item_indices[p.bin_offsets[b] as usize..p.bin_offsets[b + 1] as usize];
        let mut load: i128 = 0;
        let mut media: i128 = 0;
        for &i in items {
            assert!(i >= 0 && (i as usize) < n, "item index {i} out of range");
            seen[i as usize] += 1;
            load += i128::from(eff(i as usize));
            media += i128::from(c.media.as_ref().map_or(0, |m| m[i as usize]));
        }
        assert_eq!(load, i128::from(p.bin_loads[b]));
        assert!(load <= i128::from(c.capacity), "bin {b} over capacity");
        if let Some(mc) = c.media_capacity {
            assert_eq!(media, i128::from(p.bin_media[b]));
            assert!(media <= i128::from(mc), "bin {b} over the media budget");
        }
        if let Some(k) = c.max_items {
            assert!(items.len() <= k, "bin {b} over max_items_per_bin");
        }
        total += load;
    }
    assert_eq!(total, i128::from(p.total_length));
    for (i, &count) in seen.iter().enumerate() {
        let skipped = c.on_oversize == OnOversize::Skip && oversize.contains(&(i as i64));
        assert_eq!(count, u32::from(!skipped), "item {i} packed {count} times");
    }
    if let Some(m) = c.multiple {
        assert_eq!(nb % m, 0);
    }
    if let Some(m) = c.min_bins {
        assert!(nb >= m);
    }
}

fn check_ranks(p: &Packing, lens: &[i64], b: &mut Bytes<'_>) {
    let ranks = b.below(6);
    let cost = if b.flag() {
        RankCost::Tokens
    } else {
        RankCost::TokensSquared
    };
    let r = match assign_to_ranks(&p.bin_offsets, &p.item_indices, lens, ranks, cost) {
        Ok(r) => r,
        Err(CoreError::PackingArgument { name, .. }) => {
            assert!(ranks == 0 && name == "num_ranks");
            return;
        }
        Err(CoreError::IndexOverflow { .. }) => return,
        Err(e) => unreachable!("assign_to_ranks failed: {e}"),
    };
    let nb = p.num_bins();
    assert_eq!(r.rank_offsets.len(), ranks + 1);
    assert_eq!(r.bin_costs.len(), nb);
    let mut seen = vec![false; nb];
    let cap = nb.div_ceil(ranks);
    let mut counts = Vec::with_capacity(ranks);
    for k in 0..ranks {
        let bins = &r.bin_indices[r.rank_offsets[k] as usize..r.rank_offsets[k + 1] as usize];
        assert!(bins.len() <= cap.max(1));
        counts.push(bins.len());
        let mut sum: i128 = 0;
        for w in bins.windows(2) {
            assert!(r.bin_costs[w[0] as usize] >= r.bin_costs[w[1] as usize]);
        }
        for &bin in bins {
            assert!(!seen[bin as usize], "bin {bin} on two ranks");
            seen[bin as usize] = true;
            sum += i128::from(r.bin_costs[bin as usize]);
        }
        assert_eq!(sum, i128::from(r.rank_costs[k]));
    }
    assert!(seen.iter().all(|&s| s), "a bin on no rank");
    // Bin counts differ by at most one (all equal when the ranks divide the bins).
    let (lo, hi) = (counts.iter().min(), counts.iter().max());
    if let (Some(&lo), Some(&hi)) = (lo, hi) {
        assert!(
            hi - lo <= 1,
            "rank bin counts differ by more than one: {counts:?}"
        );
    }
    for bin in 0..nb {
        let items = &p.item_indices[p.bin_offsets[bin] as usize..p.bin_offsets[bin + 1] as usize];
        let want: i128 = items
            .iter()
            .map(|&i| {
                let l = i128::from(lens[i as usize]);
                if cost == RankCost::Tokens {
                    l
                } else {
                    l * l
                }
            })
            .sum();
        assert_eq!(want, i128::from(r.bin_costs[bin]));
    }
}

fn check_adjust(p: &Packing, b: &mut Bytes<'_>) {
    let min_bins = Some(b.below(12));
    let multiple = Some(b.below(4) + 1);
    let nb = p.num_bins();
    let total = p.item_indices.len();
    match adjust_bin_count(&p.bin_offsets, &p.item_indices, min_bins, multiple) {
        Ok((offsets, items)) => {
            let target = target_bin_count(nb, min_bins, multiple);
            assert_eq!(Some(offsets.len() - 1), target);
            assert_eq!(offsets.first().copied(), Some(0));
            assert_eq!(offsets.last().copied(), Some(items.len() as i64));
            assert!(offsets.windows(2).all(|w| w[0] <= w[1]));
            let mut a = items.clone();
            let mut e = p.item_indices.clone();
            a.sort_unstable();
            e.sort_unstable();
            assert_eq!(a, e, "adjust_bin_count lost or duplicated an item");
        }
        Err(CoreError::BinCount { target, total: t }) => assert!(t == total && t < target),
        Err(e) => unreachable!("adjust_bin_count failed on a valid packing: {e}"),
    }
    // Malformed CSR is refused, never a panic.
    let _ = adjust_bin_count(&[0, 3, 1], &[0, 1, 2], min_bins, multiple);
    let _ = adjust_bin_count(&[0, -1, 2], &[0, 1], min_bins, multiple);
}

fn check_shuffle(b: &mut Bytes<'_>) {
    let mut seed = u64::from(b.u32()) | 1;
    let mut state: Vec<u32> = (0..624)
        .map(|_| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed as u32
        })
        .collect();
    if b.u8() == 255 {
        state.truncate(b.below(624));
    }
    let pos = b.below(700);
    let n = b.below(300);
    match shuffle_permutation(&mut state, pos, n) {
        Ok((perm, new_pos)) => {
            assert!(state.len() == 624 && pos <= 624 && new_pos <= 624);
            let mut s = perm.clone();
            s.sort_unstable();
            assert_eq!(s, (0..n as i64).collect::<Vec<_>>());
        }
        Err(_) => assert!(state.len() != 624 || pos > 624),
    }
}

/// The packing fuzz check.
pub fn check(data: &[u8]) {
    let mut b = Bytes::new(data);
    let c = gen(&mut b);
    if std::env::var_os("MMPACK_FUZZ_DEBUG").is_some() {
        eprintln!("{c:?}");
    }
    let res = c.run();
    let model = model(&c);
    let oversize = match (&res, model) {
        (Ok(_), Err(())) => unreachable!("pack accepted a case it must refuse"),
        (Err(_), Err(())) => return,
        (_, Ok(o)) => o,
    };
    // The natural bin count (no adjustment) decides whether min_bins / multiple can be met.
    let natural = Case {
        min_bins: None,
        multiple: None,
        lens: c.lens.clone(),
        media: c.media.clone(),
        order: c.order.clone(),
        ..c
    };
    let nat = natural.run();
    let eff_total: i128 = (0..c.lens.len())
        .filter(|&i| !(c.on_oversize == OnOversize::Skip && oversize.contains(&(i as i64))))
        .map(|i| i128::from(c.lens[i].min(c.capacity)))
        .sum();
    let may_overflow = eff_total > i128::from(i64::MAX);
    let p = match (res, nat) {
        (Ok(p), Ok(nat)) => {
            check_packing(&natural, &nat, &oversize);
            let target = target_bin_count(nat.num_bins(), c.min_bins, c.multiple);
            assert_eq!(
                Some(p.num_bins()),
                target,
                "bin count adjustment missed its target"
            );
            if c.algorithm == Algorithm::Concatenative
                && c.min_bins.is_none()
                && c.multiple.is_none()
            {
                assert!(p.item_indices.windows(2).all(|w| w[0] < w[1]));
            }
            p
        }
        (Err(CoreError::IndexOverflow { .. }), _) | (_, Err(CoreError::IndexOverflow { .. }))
            if may_overflow =>
        {
            return
        }
        (Err(CoreError::IndexOverflow { .. }), Ok(nat))
            if target_bin_count(nat.num_bins(), c.min_bins, c.multiple).is_none() =>
        {
            return
        }
        (Err(CoreError::BinCount { target, total }), Ok(nat)) => {
            assert_eq!(total, nat.item_indices.len());
            assert!(total < target);
            return;
        }
        (r, n) => unreachable!("unexpected pack results {:?} / {:?}", r.err(), n.err()),
    };
    check_packing(&c, &p, &oversize);
    if c.algorithm == Algorithm::MinimumBinSlack && c.min_bins.is_none() && c.multiple.is_none() {
        let bfd = Case {
            algorithm: Algorithm::BestFitDecreasing,
            lens: c.lens.clone(),
            media: c.media.clone(),
            order: None,
            ..natural
        };
        if let Ok(q) = bfd.run() {
            assert!(
                p.num_bins() <= q.num_bins(),
                "minimum_bin_slack worse than best fit"
            );
        }
    }
    let eff: Vec<i64> = c.lens.iter().map(|&l| l.min(c.capacity)).collect();
    check_ranks(&p, &eff, &mut b);
    check_adjust(&p, &mut b);
    check_shuffle(&mut b);
}

/// NeMo-RL's target bin count: at least `min_bins`, rounded up to `multiple`.
fn target_bin_count(
    current: usize,
    min_bins: Option<usize>,
    multiple: Option<usize>,
) -> Option<usize> {
    let t = current.max(min_bins.unwrap_or(0));
    match multiple {
        Some(m) if m > 0 => t.checked_next_multiple_of(m),
        _ => Some(t),
    }
}
