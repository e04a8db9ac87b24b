//! Distributing bins over data-parallel ranks: longest-processing-time first (bins by cost
//! descending, each to the least-loaded rank), with each rank taking at most
//! `ceil(bins / ranks)` bins so bin counts differ by at most one (equal when the bin count
//! is a multiple of the rank count). Each rank's bins come out largest cost first.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use crate::alloc;
use crate::error::{CoreError, CoreResult};

/// What a bin costs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RankCost {
    /// Sum of lengths.
    Tokens,
    /// Sum of squared lengths (attention cost).
    TokensSquared,
}

impl RankCost {
    /// # Errors
    /// `PackingArgument` for an unknown name.
    pub fn from_name(name: &str) -> CoreResult<Self> {
        match name {
            "tokens" => Ok(Self::Tokens),
            "tokens_squared" => Ok(Self::TokensSquared),
            _ => Err(CoreError::PackingArgument {
                name: "cost",
                detail: format!("unknown cost {name:?}; known: tokens, tokens_squared"),
            }),
        }
    }
}

/// Ranks as CSR over bin indices, plus per-rank and per-bin costs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankAssignment {
    pub rank_offsets: Vec<i64>,
    pub bin_indices: Vec<i64>,
    pub rank_costs: Vec<i64>,
    pub bin_costs: Vec<i64>,
}

/// Assigns the bins of a packing (`bin_offsets` over `item_indices`, lengths indexed by item)
/// to `num_ranks` ranks.
///
/// # Errors
/// `PackingArgument` for `num_ranks == 0`, a `num_ranks` whose per-rank arrays cannot be
/// allocated, or malformed CSR / item indices; `IndexOverflow` when a cost overflows `i64`.
pub fn assign_to_ranks(
    bin_offsets: &[i64],
    item_indices: &[i64],
    lengths: &[i64],
    num_ranks: usize,
    cost: RankCost,
) -> CoreResult<RankAssignment> {
    if num_ranks == 0 {
        return Err(arg("num_ranks", "must be a positive integer, got 0".into()));
    }
    let bin_costs = bin_costs(bin_offsets, item_indices, lengths, cost)?;
    let nb = bin_costs.len();
    let (mut rank_offsets, mut rank_costs) = rank_arrays(num_ranks)?;
    let per_rank = distribute(&bin_costs, num_ranks, &mut rank_costs)?;
    let mut bin_indices = Vec::with_capacity(nb);
    rank_offsets.push(0);
    for bins in per_rank {
        bin_indices.extend(bins);
        rank_offsets.push(bin_indices.len() as i64);
    }
    rank_offsets.resize(num_ranks + 1, nb as i64);
    rank_costs.resize(num_ranks, 0);
    Ok(RankAssignment {
        rank_offsets,
        bin_indices,
        rank_costs,
        bin_costs,
    })
}

fn arg(name: &'static str, detail: String) -> CoreError {
    CoreError::PackingArgument { name, detail }
}

fn cost_overflow() -> CoreError {
    CoreError::IndexOverflow { what: "bin costs" }
}

/// The cost of every bin, checking the CSR ranges and item indices on the way (they come
/// from the caller, not from `pack`).
fn bin_costs(
    bin_offsets: &[i64],
    item_indices: &[i64],
    lengths: &[i64],
    cost: RankCost,
) -> CoreResult<Vec<i64>> {
    let nb = bin_offsets.len().saturating_sub(1);
    let mut bin_costs = Vec::with_capacity(nb);
    for w in bin_offsets.windows(2) {
        let (a, b) = (usize::try_from(w[0]), usize::try_from(w[1]));
        let slice = match (a, b) {
            (Ok(a), Ok(b)) if a <= b => item_indices.get(a..b),
            _ => None,
        }
        .ok_or_else(|| arg("bin_offsets", format!("bad bin range {}..{}", w[0], w[1])))?;
        let mut total: i64 = 0;
        for &it in slice {
            let l = usize::try_from(it)
                .ok()
                .and_then(|u| lengths.get(u))
                .copied()
                .ok_or_else(|| arg("item_indices", format!("item {it} is out of range")))?;
            let c = match cost {
                RankCost::Tokens => l,
                RankCost::TokensSquared => l.checked_mul(l).ok_or_else(cost_overflow)?,
            };
            total = total.checked_add(c).ok_or_else(cost_overflow)?;
        }
        bin_costs.push(total);
    }
    Ok(bin_costs)
}

/// Empty `rank_offsets` and `rank_costs` with room for `num_ranks` ranks. The per-rank
/// outputs are O(num_ranks), and more ranks than bins is legal (the extra ranks stay empty):
/// allocate them fallibly, so an absurd count is a typed error, not an abort.
fn rank_arrays(num_ranks: usize) -> CoreResult<(Vec<i64>, Vec<i64>)> {
    let too_many = || {
        arg(
            "num_ranks",
            format!("{num_ranks} ranks: the per-rank arrays do not fit in memory"),
        )
    };
    // Both arrays in one request first (see `alloc::probe`).
    alloc::probe(
        num_ranks
            .checked_mul(2)
            .and_then(|n| n.checked_add(1))
            .and_then(alloc::bytes_of::<i64>),
        too_many,
    )?;
    let rank_offsets: Vec<i64> =
        alloc::vec_with_capacity(num_ranks.checked_add(1).ok_or_else(too_many)?, too_many)?;
    let rank_costs: Vec<i64> = alloc::vec_with_capacity(num_ranks, too_many)?;
    Ok((rank_offsets, rank_costs))
}

/// Longest-processing-time first: bins by cost descending (ties: index), each to the
/// least-loaded rank with room. Returns the bins of the first `busy = min(ranks, bins)` ranks
/// and leaves their loads in `rank_costs[..busy]`. Only those ranks can get a bin (with at
/// most one bin per rank, ties on load go to the lowest rank), so only they enter the heap.
fn distribute(
    bin_costs: &[i64],
    num_ranks: usize,
    rank_costs: &mut Vec<i64>,
) -> CoreResult<Vec<Vec<i64>>> {
    let nb = bin_costs.len();
    let mut order: Vec<usize> = (0..nb).collect();
    order.sort_by_key(|&b| (Reverse(bin_costs[b]), b));
    let busy = num_ranks.min(nb);
    let cap = nb.div_ceil(num_ranks).max(1);
    let mut heap: BinaryHeap<Reverse<(i64, usize)>> = (0..busy).map(|r| Reverse((0, r))).collect();
    let mut per_rank: Vec<Vec<i64>> = vec![Vec::new(); busy];
    rank_costs.resize(busy, 0);
    // When the ranks do not divide the bins, only `extra` ranks may take `cap` bins; once they
    // have, the others stop at `base`, so counts differ by at most one.
    let (base, extra) = (nb / num_ranks, nb % num_ranks);
    let mut at_cap = 0usize;
    for b in order {
        let mut next = heap.pop();
        while let Some(Reverse((_, r))) = next {
            if extra == 0 || at_cap < extra || per_rank[r].len() < base {
                break;
            }
            next = heap.pop();
        }
        let Some(Reverse((load, r))) = next else {
            break;
        };
        let load = load.checked_add(bin_costs[b]).ok_or_else(cost_overflow)?;
        per_rank[r].push(b as i64);
        rank_costs[r] = load;
        if extra > 0 && per_rank[r].len() == cap {
            at_cap += 1;
        }
        if per_rank[r].len() < cap {
            heap.push(Reverse((load, r)));
        }
    }
    Ok(per_rank)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn more_ranks_than_bins_leaves_the_extra_ranks_empty() {
        // bins of cost 5, 3, 2: one per rank, largest on rank 0
        let r = assign_to_ranks(&[0, 1, 2, 3], &[0, 1, 2], &[3, 5, 2], 5, RankCost::Tokens);
        let want = RankAssignment {
            rank_offsets: vec![0, 1, 2, 3, 3, 3],
            bin_indices: vec![1, 0, 2],
            rank_costs: vec![5, 3, 2, 0, 0],
            bin_costs: vec![3, 5, 2],
        };
        assert_eq!(r, Ok(want));
    }

    #[test]
    fn rank_counts_beyond_memory_are_a_typed_error() {
        for n in [usize::MAX, usize::MAX / 2, 1 << 62] {
            let r = assign_to_ranks(&[0, 1], &[0], &[3], n, RankCost::Tokens);
            assert!(
                matches!(
                    r,
                    Err(CoreError::PackingArgument {
                        name: "num_ranks",
                        ..
                    })
                ),
                "{r:?}"
            );
        }
    }
}
