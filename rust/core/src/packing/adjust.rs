//! NeMo-RL's `_adjust_bin_count`: raise the bin count to `min_bins`, then round it up to a
//! multiple of `bins_multiple_of`, by moving single items into new bins. Donor bins are
//! ranked by `(item count, bin index)` descending; each new bin takes the **last** item of
//! the current donor, and a donor keeps giving while it holds more than one item.

use super::Bins;
use crate::error::{CoreError, CoreResult};

/// The bin count NeMo-RL targets for `current` bins.
///
/// # Errors
/// `IndexOverflow` if the rounded count does not fit `usize`.
pub fn target_bin_count(
    current: usize,
    min_bins: Option<usize>,
    multiple: Option<usize>,
) -> CoreResult<usize> {
    let mut target = current.max(min_bins.unwrap_or(0));
    if let Some(m) = multiple.filter(|&m| m > 0) {
        let rem = target % m;
        if rem != 0 {
            target = target
                .checked_add(m - rem)
                .ok_or(CoreError::IndexOverflow {
                    what: "the target bin count",
                })?;
        }
    }
    Ok(target)
}

pub(crate) fn adjust_bins(
    bins: Bins,
    min_bins: Option<usize>,
    multiple: Option<usize>,
) -> CoreResult<Bins> {
    let current = bins.num_bins();
    let target = target_bin_count(current, min_bins, multiple)?;
    if target == current {
        return Ok(bins);
    }
    let total = bins.items.len();
    if total < target {
        return Err(CoreError::BinCount { target, total });
    }
    let mut len: Vec<usize> = bins.offsets.windows(2).map(|w| w[1] - w[0]).collect();
    let mut donors: Vec<usize> = (0..current).collect();
    donors.sort_unstable_by_key(|&b| std::cmp::Reverse((len[b], b)));
    let mut moved: Vec<u32> = Vec::with_capacity(target - current);
    let mut d = 0;
    while moved.len() < target - current {
        let Some(&b) = donors.get(d) else {
            // Unreachable: total >= target guarantees enough donors.
            return Err(CoreError::BinCount { target, total });
        };
        if len[b] > 1 {
            len[b] -= 1;
            moved.push(bins.items[bins.offsets[b] + len[b]]);
        } else {
            d += 1;
        }
    }
    let mut offsets = Vec::with_capacity(target + 1);
    let mut items = Vec::with_capacity(total);
    offsets.push(0);
    for (&start, &l) in bins.offsets.iter().zip(&len) {
        items.extend_from_slice(&bins.items[start..start + l]);
        offsets.push(items.len());
    }
    for it in moved {
        items.push(it);
        offsets.push(items.len());
    }
    Ok(Bins {
        offsets,
        items,
        loads: None,
    })
}

/// `adjust_bin_count` on public CSR arrays (`bin_offsets`, `item_indices`), for callers that
/// packed elsewhere.
///
/// # Errors
/// `PackingArgument` for malformed CSR, `BinCount` when there are fewer items than bins.
pub fn adjust_bin_count(
    bin_offsets: &[i64],
    item_indices: &[i64],
    min_bins: Option<usize>,
    multiple: Option<usize>,
) -> CoreResult<(Vec<i64>, Vec<i64>)> {
    let bad = |detail: String| CoreError::PackingArgument {
        name: "bin_offsets",
        detail,
    };
    if bin_offsets.first().copied().unwrap_or(0) != 0
        || bin_offsets.last().copied().unwrap_or(0) != item_indices.len() as i64
    {
        return Err(bad("must start at 0 and end at len(item_indices)".into()));
    }
    let mut offsets = Vec::with_capacity(bin_offsets.len().max(1));
    for w in bin_offsets.windows(2) {
        if w[1] < w[0] {
            return Err(bad("must be non-decreasing".into()));
        }
    }
    for &o in bin_offsets {
        offsets.push(usize::try_from(o).map_err(|_| bad(format!("negative offset {o}")))?);
    }
    if offsets.is_empty() {
        offsets.push(0);
    }
    let items: Vec<u32> = (0..item_indices.len() as u32).collect();
    let adjusted = adjust_bins(
        Bins {
            offsets,
            items,
            loads: None,
        },
        min_bins,
        multiple,
    )?;
    let out_items = adjusted
        .items
        .iter()
        .map(|&k| item_indices[k as usize])
        .collect();
    Ok((
        adjusted.offsets.iter().map(|&o| o as i64).collect(),
        out_items,
    ))
}
