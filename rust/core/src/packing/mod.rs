//! Bin packing: NeMo-RL's algorithms with identical output in `O(n log n)`, best-fit
//! decreasing in `O(n + C)`-ish time, a bounded minimum-bin-slack improvement, bin-count
//! adjustment and data-parallel rank assignment.
//!
//! Everything here takes plain slices and returns flat CSR arrays (`bin_offsets`,
//! `item_indices`); no `Vec<Vec<_>>` is built on the hot paths.

mod adjust;
mod bestfit;
mod bitset;
mod firstfit;
mod mbs;
mod mffd;
mod placement;
mod pyrandom;
mod ranks;
mod repair;

use crate::error::{CoreError, CoreResult};

pub use adjust::adjust_bin_count;
pub use placement::{
    place, placement_costs, segment_groups, Placement, PlacementCosts, PlacementInput,
    PlacementKind, PlacementOptions,
};
pub use pyrandom::shuffle_permutation;
pub use ranks::{assign_to_ranks, RankAssignment, RankCost};

/// A packing algorithm.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Algorithm {
    /// Next-fit in input order (NeMo-RL `concatenative`).
    Concatenative,
    /// First fit over items sorted by `(length, index)` descending (NeMo-RL).
    FirstFitDecreasing,
    /// First fit in a caller-given order (NeMo-RL shuffles with Python's `random`).
    FirstFitShuffle,
    /// Johnson & Garey's modified first-fit decreasing as NeMo-RL implements it.
    ModifiedFirstFitDecreasing,
    /// Best fit over items sorted by length descending (ties: input order).
    BestFitDecreasing,
    /// Minimum bin slack with a bounded search per bin, never worse than best fit.
    MinimumBinSlack,
}

impl Algorithm {
    pub const ALL: [Self; 6] = [
        Self::Concatenative,
        Self::FirstFitDecreasing,
        Self::FirstFitShuffle,
        Self::ModifiedFirstFitDecreasing,
        Self::BestFitDecreasing,
        Self::MinimumBinSlack,
    ];

    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::Concatenative => "concatenative",
            Self::FirstFitDecreasing => "first_fit_decreasing",
            Self::FirstFitShuffle => "first_fit_shuffle",
            Self::ModifiedFirstFitDecreasing => "modified_first_fit_decreasing",
            Self::BestFitDecreasing => "best_fit_decreasing",
            Self::MinimumBinSlack => "minimum_bin_slack",
        }
    }

    /// Looks an algorithm up by its name.
    ///
    /// # Errors
    /// `PackingArgument` naming the known algorithms.
    pub fn from_name(name: &str) -> CoreResult<Self> {
        Self::ALL
            .into_iter()
            .find(|a| a.name() == name)
            .ok_or_else(|| CoreError::PackingArgument {
                name: "algorithm",
                detail: format!(
                    "unknown algorithm {name:?}; known: {}",
                    Self::ALL.map(Self::name).join(", ")
                ),
            })
    }

    fn supports_media(self) -> bool {
        !matches!(
            self,
            Self::ModifiedFirstFitDecreasing | Self::MinimumBinSlack
        )
    }

    fn supports_max_items(self) -> bool {
        !matches!(self, Self::ModifiedFirstFitDecreasing)
    }
}

/// What to do with an item over a bin budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnOversize {
    /// Raise `ItemTooLarge` naming the first such item (input order).
    Error,
    /// Leave it out of every bin and list it in `Packing::oversize`.
    Skip,
    /// Pack it as if its length were the capacity (the caller truncates it) and list it in
    /// `Packing::oversize`. A media count over the media budget is still an error.
    Truncate,
}

impl OnOversize {
    /// # Errors
    /// `PackingArgument` for an unknown policy.
    pub fn from_name(name: &str) -> CoreResult<Self> {
        match name {
            "error" => Ok(Self::Error),
            "skip" => Ok(Self::Skip),
            "truncate" => Ok(Self::Truncate),
            _ => Err(CoreError::PackingArgument {
                name: "on_oversize",
                detail: format!("unknown policy {name:?}; known: error, skip, truncate"),
            }),
        }
    }
}

/// Default number of search nodes per bin for `MinimumBinSlack`.
pub const DEFAULT_SEARCH_BUDGET: usize = 256;

/// Options of [`pack`].
#[derive(Debug, Clone)]
pub struct PackOptions<'a> {
    pub capacity: i64,
    pub algorithm: Algorithm,
    pub max_items_per_bin: Option<usize>,
    pub media_capacity: Option<i64>,
    pub min_bins: Option<usize>,
    pub bins_multiple_of: Option<usize>,
    pub on_oversize: OnOversize,
    /// For `FirstFitShuffle`: the order to place items in, a permutation of `0..n`.
    pub order: Option<&'a [i64]>,
    /// Accept zero lengths (NeMo-RL's algorithms other than MFFD do). Off for the public API.
    pub allow_zero: bool,
    /// Search nodes per bin for `MinimumBinSlack`.
    pub search_budget: usize,
}

impl PackOptions<'_> {
    #[must_use]
    pub fn new(capacity: i64, algorithm: Algorithm) -> Self {
        Self {
            capacity,
            algorithm,
            max_items_per_bin: None,
            media_capacity: None,
            min_bins: None,
            bins_multiple_of: None,
            on_oversize: OnOversize::Error,
            order: None,
            allow_zero: false,
            search_budget: DEFAULT_SEARCH_BUDGET,
        }
    }
}

/// Bins as CSR: bin `b` holds `item_indices[bin_offsets[b]..bin_offsets[b + 1]]`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Packing {
    pub bin_offsets: Vec<i64>,
    pub item_indices: Vec<i64>,
    /// Sum of (effective) lengths per bin.
    pub bin_loads: Vec<i64>,
    /// Sum of media per bin (empty without media).
    pub bin_media: Vec<i64>,
    /// Items over a budget, in input order (skipped or truncated per `on_oversize`).
    pub oversize: Vec<i64>,
    /// Sum of the packed (effective) lengths.
    pub total_length: i64,
}

impl Packing {
    #[must_use]
    pub fn num_bins(&self) -> usize {
        self.bin_offsets.len().saturating_sub(1)
    }
}

/// Bins of a dense sub-problem: items are `0..m` positions into the lengths given to the
/// algorithm. Offsets are `usize`, items `u32`.
#[derive(Debug, Clone, Default)]
pub(crate) struct Bins {
    pub offsets: Vec<usize>,
    pub items: Vec<u32>,
    /// Per-bin sums of lengths when the algorithm tracked them (saves a pass in `finish`).
    pub loads: Option<Vec<i64>>,
}

impl Bins {
    /// Builds CSR bins from a placement log: `(bin, item)` in placement order; bins are
    /// renumbered through `rank` (`rank[bin]` is the output position of `bin`).
    pub(crate) fn from_log(num_bins: usize, log: &[(u32, u32)], rank: Option<&[u32]>) -> Self {
        let mut counts = vec![0usize; num_bins + 1];
        for &(bin, _) in log {
            let b = rank.map_or(bin, |r| r[bin as usize]) as usize;
            counts[b + 1] += 1;
        }
        for b in 0..num_bins {
            counts[b + 1] += counts[b];
        }
        let offsets = counts.clone();
        let mut fill = counts;
        let mut items = vec![0u32; log.len()];
        for &(bin, item) in log {
            let b = rank.map_or(bin, |r| r[bin as usize]) as usize;
            items[fill[b]] = item;
            fill[b] += 1;
        }
        Self {
            offsets,
            items,
            loads: None,
        }
    }

    pub(crate) fn num_bins(&self) -> usize {
        self.offsets.len().saturating_sub(1)
    }
}

/// Dense problem handed to the algorithms: lengths in `1..=capacity` (0 allowed only
/// for the NeMo-RL compatible first-fit algorithms), optional media.
pub(crate) struct Problem<'a> {
    pub lens: &'a [i64],
    pub media: Option<&'a [i64]>,
    pub capacity: i64,
    pub media_capacity: i64,
    pub max_items: usize,
}

fn arg_err(name: &'static str, detail: String) -> CoreError {
    CoreError::PackingArgument { name, detail }
}

/// Capacities above this use comparison sorts and ordered maps instead of arrays indexed
/// by capacity.
pub(crate) fn capacity_indexable(capacity: i64, n: usize) -> bool {
    usize::try_from(capacity).is_ok_and(|c| c <= n.saturating_mul(4).saturating_add(1 << 16))
}

/// Packs `lengths` (and `media`, a second budget) into bins.
///
/// # Errors
/// `PackingArgument` for bad options, `InvalidItem` for a zero/negative length or negative
/// media, `ItemTooLarge` for an item over a budget under `OnOversize::Error`, `BinCount`
/// when `min_bins` / `bins_multiple_of` need more bins than items, `IndexOverflow` when
/// sums overflow `i64`.
pub fn pack(lengths: &[i64], media: Option<&[i64]>, opts: &PackOptions<'_>) -> CoreResult<Packing> {
    let n = lengths.len();
    let capacity = opts.capacity;
    check_sizes(n, opts)?;
    let media_capacity = media_budget(n, media, opts.media_capacity)?;
    check_algorithm(n, media, opts)?;
    let oversize = scan_items(lengths, media, media_capacity, opts)?;

    // Dense sub-problem: drop skipped items, clip truncated ones.
    let sub = SubProblem::new(lengths, media, &oversize, opts);
    let lens: &[i64] = if oversize.is_empty() {
        lengths
    } else {
        &sub.lens
    };
    let med: Option<&[i64]> = match (&sub.media, &sub.map) {
        (Some(sm), _) => Some(sm),
        (None, Some(_)) => None,
        (None, None) => media,
    };
    let sub_order = shuffle_order(opts, sub.map.as_deref(), n);

    let problem = Problem {
        lens,
        media: med,
        capacity,
        media_capacity,
        max_items: opts.max_items_per_bin.unwrap_or(usize::MAX),
    };
    let bins = run_algorithm(&problem, sub_order, opts);
    let bins = adjust::adjust_bins(bins, opts.min_bins, opts.bins_multiple_of)?;
    finish(bins, lens, med, sub.map.as_deref(), oversize)
}

/// The scalar options every algorithm needs: a positive capacity, an item count that fits the
/// `u32` item ids, and positive `max_items_per_bin` / `bins_multiple_of`.
fn check_sizes(n: usize, opts: &PackOptions<'_>) -> CoreResult<()> {
    let capacity = opts.capacity;
    if capacity < 1 {
        return Err(arg_err(
            "capacity",
            format!("must be a positive integer, got {capacity}"),
        ));
    }
    if u32::try_from(n).is_err() {
        return Err(arg_err(
            "lengths",
            format!("at most {} items per call, got {n}", u32::MAX),
        ));
    }
    if opts.max_items_per_bin == Some(0) {
        return Err(arg_err(
            "max_items_per_bin",
            "must be a positive integer, got 0".into(),
        ));
    }
    if opts.bins_multiple_of == Some(0) {
        return Err(arg_err(
            "bins_multiple_of",
            "must be a positive integer, got 0".into(),
        ));
    }
    Ok(())
}

/// The media budget: `media` and `media_capacity` come together (one count per item, a
/// non-negative budget) or not at all (budget 0, never read).
fn media_budget(n: usize, media: Option<&[i64]>, media_capacity: Option<i64>) -> CoreResult<i64> {
    match (media, media_capacity) {
        (Some(m), Some(mc)) => {
            if m.len() != n {
                return Err(arg_err(
                    "media",
                    format!(
                        "has {} entries but lengths has {n}; give one per item",
                        m.len()
                    ),
                ));
            }
            if mc < 0 {
                return Err(arg_err("media_capacity", format!("must be >= 0, got {mc}")));
            }
            Ok(mc)
        }
        (Some(_), None) => Err(arg_err(
            "media_capacity",
            "is required when media is given".into(),
        )),
        (None, Some(_)) => Err(arg_err(
            "media",
            "is required when media_capacity is given".into(),
        )),
        (None, None) => Ok(0),
    }
}

/// Options the chosen algorithm cannot honour are refused rather than ignored.
fn check_algorithm(n: usize, media: Option<&[i64]>, opts: &PackOptions<'_>) -> CoreResult<()> {
    let alg = opts.algorithm;
    if media.is_some() && !alg.supports_media() {
        return Err(arg_err(
            "media",
            format!("algorithm {} does not support a media budget", alg.name()),
        ));
    }
    if opts.max_items_per_bin.is_some() && !alg.supports_max_items() {
        return Err(arg_err(
            "max_items_per_bin",
            format!(
                "algorithm {} does not support max_items_per_bin",
                alg.name()
            ),
        ));
    }
    if opts.allow_zero && alg == Algorithm::ModifiedFirstFitDecreasing {
        return Err(arg_err(
            "allow_zero",
            "modified_first_fit_decreasing needs positive lengths".into(),
        ));
    }
    if alg == Algorithm::FirstFitShuffle {
        check_permutation(opts.order, n)?;
    }
    Ok(())
}

/// Validates every item (the first problem in input order wins) and returns the oversize
/// ones, in input order.
fn scan_items(
    lengths: &[i64],
    media: Option<&[i64]>,
    media_capacity: i64,
    opts: &PackOptions<'_>,
) -> CoreResult<Vec<i64>> {
    let capacity = opts.capacity;
    let min_len = i64::from(!opts.allow_zero);
    let mut oversize: Vec<i64> = Vec::new();
    for (i, &l) in lengths.iter().enumerate() {
        if l < min_len {
            let rule = if opts.allow_zero {
                "lengths must be >= 0"
            } else {
                "lengths must be positive integers"
            };
            return Err(CoreError::InvalidItem {
                index: i,
                what: "length",
                value: l,
                rule,
            });
        }
        let m = media.map_or(0, |m| m[i]);
        if m < 0 {
            return Err(CoreError::InvalidItem {
                index: i,
                what: "media",
                value: m,
                rule: "media counts must be >= 0",
            });
        }
        if media.is_some() && m > media_capacity && opts.on_oversize != OnOversize::Skip {
            return Err(CoreError::ItemTooLarge {
                index: i,
                what: "media",
                size: m,
                capacity: media_capacity,
            });
        }
        if l > capacity || (media.is_some() && m > media_capacity) {
            if opts.on_oversize == OnOversize::Error {
                return Err(CoreError::ItemTooLarge {
                    index: i,
                    what: "length",
                    size: l,
                    capacity,
                });
            }
            oversize.push(i as i64);
        }
    }
    Ok(oversize)
}

/// The owned arrays of the dense sub-problem when some items are oversize: clipped lengths
/// (truncate), or the kept items' lengths and media with `map` from position to input index
/// (skip). All empty / `None` when nothing is oversize (the input is used as is).
struct SubProblem {
    lens: Vec<i64>,
    media: Option<Vec<i64>>,
    map: Option<Vec<u32>>,
}

impl SubProblem {
    fn new(
        lengths: &[i64],
        media: Option<&[i64]>,
        oversize: &[i64],
        opts: &PackOptions<'_>,
    ) -> Self {
        let n = lengths.len();
        if oversize.is_empty() {
            return Self {
                lens: Vec::new(),
                media: None,
                map: None,
            };
        }
        if opts.on_oversize == OnOversize::Truncate {
            return Self {
                lens: lengths.iter().map(|&l| l.min(opts.capacity)).collect(),
                media: None,
                map: None,
            };
        }
        let mut keep = vec![true; n];
        for &i in oversize {
            keep[i as usize] = false;
        }
        let map: Vec<u32> = (0..n as u32).filter(|&i| keep[i as usize]).collect();
        let lens = map.iter().map(|&i| lengths[i as usize]).collect();
        let media = media.map(|m| map.iter().map(|&i| m[i as usize]).collect());
        Self {
            lens,
            media,
            map: Some(map),
        }
    }
}

/// For `FirstFitShuffle`: the caller's order restricted to the kept items, as positions in
/// the dense sub-problem (`map` sends a position to its input index).
fn shuffle_order(opts: &PackOptions<'_>, map: Option<&[u32]>, n: usize) -> Option<Vec<u32>> {
    match (opts.algorithm, opts.order, map) {
        (Algorithm::FirstFitShuffle, Some(order), Some(map)) => {
            let mut pos = vec![u32::MAX; n];
            for (k, &i) in map.iter().enumerate() {
                pos[i as usize] = k as u32;
            }
            Some(
                order
                    .iter()
                    .map(|&i| pos[i as usize])
                    .filter(|&p| p != u32::MAX)
                    .collect(),
            )
        }
        (Algorithm::FirstFitShuffle, Some(order), None) => {
            Some(order.iter().map(|&i| i as u32).collect())
        }
        _ => None,
    }
}

/// Runs the chosen algorithm on the dense sub-problem.
fn run_algorithm(
    problem: &Problem<'_>,
    sub_order: Option<Vec<u32>>,
    opts: &PackOptions<'_>,
) -> Bins {
    let (lens, capacity) = (problem.lens, problem.capacity);
    match opts.algorithm {
        Algorithm::Concatenative => firstfit::concatenative(problem),
        Algorithm::FirstFitDecreasing => {
            let order = firstfit::decreasing_order(lens, capacity, true);
            firstfit::first_fit(problem, &order)
        }
        Algorithm::FirstFitShuffle => {
            let order = sub_order.unwrap_or_default();
            firstfit::first_fit(problem, &order)
        }
        Algorithm::ModifiedFirstFitDecreasing => mffd::mffd(lens, capacity),
        Algorithm::BestFitDecreasing => bestfit::best_fit_decreasing(problem),
        Algorithm::MinimumBinSlack => minimum_bin_slack(problem, opts.search_budget),
    }
}

/// Minimum bin slack, never worse than best fit. Candidates: best fit, the full search, and
/// the search's near-perfect prefix followed by best fit on the rest; the fewest bins wins
/// (ties: earlier). The winner is then repaired: the items of its bins left with slack are
/// packed again the same way while that saves bins.
fn minimum_bin_slack(problem: &Problem<'_>, search_budget: usize) -> Bins {
    let best = mbs_candidates(problem, search_budget);
    repair::repair(problem, best, |sub| mbs_candidates(sub, search_budget))
}

/// The fewest-bins candidate of [`minimum_bin_slack`], before repair (ties: best fit, then
/// the prefixes by tolerance, then the full search).
fn mbs_candidates(problem: &Problem<'_>, search_budget: usize) -> Bins {
    let capacity = problem.capacity;
    let mut best = bestfit::best_fit_decreasing(problem);
    let (full, slacks) = mbs::minimum_bin_slack(problem, search_budget);
    let mut last_cut = None;
    for tolerance in [0, capacity / 512, capacity / 128, capacity / 32] {
        // A cut at bin 0 is plain best fit; equal cuts give equal candidates.
        let Some(k) = mbs::tail_cut(&slacks, tolerance).filter(|&k| k > 0) else {
            continue;
        };
        if last_cut == Some(k) {
            continue;
        }
        last_cut = Some(k);
        let cand = mbs::with_tail(problem, &full, k, bestfit::best_fit_decreasing);
        if cand.num_bins() < best.num_bins() {
            best = cand;
        }
    }
    if full.num_bins() < best.num_bins() {
        best = full;
    }
    best
}

fn check_permutation(order: Option<&[i64]>, n: usize) -> CoreResult<()> {
    let Some(order) = order else {
        return Err(arg_err(
            "order",
            "first_fit_shuffle needs an order (a permutation)".into(),
        ));
    };
    if order.len() != n {
        return Err(arg_err(
            "order",
            format!(
                "has {} entries but there are {n} items; give a permutation",
                order.len()
            ),
        ));
    }
    let mut seen = vec![false; n];
    for (k, &i) in order.iter().enumerate() {
        let slot = usize::try_from(i).ok().and_then(|u| seen.get_mut(u));
        match slot {
            Some(s) if !*s => *s = true,
            _ => {
                return Err(arg_err(
                    "order",
                    format!(
                        "entry {k} = {i} is out of range or repeated; give a permutation of 0..{n}"
                    ),
                ))
            }
        }
    }
    Ok(())
}

/// Turns dense bins into the public `Packing` (original indices, loads, sums).
fn finish(
    bins: Bins,
    lens: &[i64],
    media: Option<&[i64]>,
    map: Option<&[u32]>,
    oversize: Vec<i64>,
) -> CoreResult<Packing> {
    let nb = bins.num_bins();
    let overflow = || CoreError::IndexOverflow { what: "bin loads" };
    let mut bin_media = Vec::with_capacity(if media.is_some() { nb } else { 0 });
    let bin_loads = match bins.loads {
        Some(loads) if loads.len() == nb => loads,
        _ => {
            let mut loads = Vec::with_capacity(nb);
            for w in bins.offsets.windows(2) {
                let mut load: i64 = 0;
                for &it in bins.items.get(w[0]..w[1]).unwrap_or(&[]) {
                    load = load.checked_add(lens[it as usize]).ok_or_else(overflow)?;
                }
                loads.push(load);
            }
            loads
        }
    };
    if let Some(m) = media {
        for w in bins.offsets.windows(2) {
            let mut ml: i64 = 0;
            for &it in bins.items.get(w[0]..w[1]).unwrap_or(&[]) {
                ml = ml.checked_add(m[it as usize]).ok_or_else(overflow)?;
            }
            bin_media.push(ml);
        }
    }
    let mut total: i64 = 0;
    for &load in &bin_loads {
        total = total.checked_add(load).ok_or_else(overflow)?;
    }
    let item_indices: Vec<i64> = match map {
        Some(map) => bins
            .items
            .iter()
            .map(|&i| i64::from(map[i as usize]))
            .collect(),
        None => bins.items.iter().map(|&i| i64::from(i)).collect(),
    };
    let bin_offsets = bins.offsets.iter().map(|&o| o as i64).collect();
    Ok(Packing {
        bin_offsets,
        item_indices,
        bin_loads,
        bin_media,
        oversize,
        total_length: total,
    })
}
