//! Byte-level gather of segments into one output buffer (parallel memcpy).
//!
//! The materialization of a `PackedTensor` is a concatenation of its logical segments, where many
//! logical segments repeat the same physical one. Here the physical segments are plain byte
//! slices (`sources`), `order` lists which source lands at each logical slot, and the output is
//! one preallocated byte buffer. Everything is safe Rust: the output is carved into disjoint
//! `&mut` pieces with `split_at_mut`, each filled with `copy_from_slice`, in parallel with rayon
//! when the copy is large enough to pay for it.
//!
//! Packing along a non-leading dimension (`dim_to_pack > 0`) is the same gather repeated per
//! index of the leading dimensions: every source holds `outer` equal blocks, and the output is,
//! for each outer index `o` in order, block `o` of every source in `order`.
//!
//! [`gather_ranges_into`] is the same gather over byte ranges of one source buffer, for many
//! small segments that the caller first compacted into one buffer (one view instead of many).
//!
//! The parallel copy runs on this module's own rayon pool, never rayon's global one, and the
//! pool belongs to the process that built it. A process forked from one that already copied in
//! parallel (DataLoader and Energon workers on Linux) inherits the pool's memory but none of its
//! threads, so work handed to it would wait forever: the child notices its new pid and builds a
//! pool of its own. The pool's lock is only ever tried, never waited on (a lock held by a thread
//! of the parent at the fork stays held in the child forever); without it the copy runs on the
//! calling thread, with the same result.
use std::sync::{Arc, Mutex, TryLockError};

use crate::error::{CoreError, CoreResult};
use rayon::prelude::*;
use rayon::{ThreadPool, ThreadPoolBuilder};

/// Below this many output bytes the copy runs on the calling thread (rayon's fork/join costs
/// more than it saves).
const PARALLEL_MIN_BYTES: usize = 1 << 20;
/// Copies larger than this are split so that one huge segment still spreads over the threads.
const MAX_PIECE_BYTES: usize = 1 << 20;
/// Aim for at least this many bytes per rayon leaf task.
const MIN_LEAF_BYTES: usize = 1 << 16;

/// The gather's thread pool and the pid of the process that built it.
static POOL: Mutex<Option<(u32, Arc<ThreadPool>)>> = Mutex::new(None);

/// This process's gather pool, built on first use (and again in a forked child); `None` when
/// the pool is busy being looked up by another thread or cannot be built: copy sequentially.
fn process_pool() -> Option<Arc<ThreadPool>> {
    let pid = std::process::id();
    let mut slot = match POOL.try_lock() {
        Ok(guard) => guard,
        Err(TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
        Err(TryLockError::WouldBlock) => return None,
    };
    if let Some((owner, pool)) = slot.as_ref() {
        if *owner == pid {
            return Some(Arc::clone(pool));
        }
    }
    // A pool inherited through fork: its worker threads do not exist in this process, and
    // dropping it would signal them and wait, so it is leaked (a few hundred bytes per fork).
    if let Some(inherited) = slot.take() {
        std::mem::forget(inherited);
    }
    let pool = ThreadPoolBuilder::new()
        .thread_name(|i| format!("mmpack-gather-{i}"))
        .build()
        .ok()?;
    let pool = Arc::new(pool);
    *slot = Some((pid, Arc::clone(&pool)));
    Some(pool)
}

/// Threads of this process's gather pool (builds it if needed; 1 when there is none): the
/// parallel path is taken for outputs of at least 1 MiB when this is 2 or more.
#[must_use]
pub fn parallel_threads() -> usize {
    process_pool().map_or(1, |pool| pool.current_num_threads())
}

/// Total output bytes of a gather: `sum(len(sources[k]) for k in order)`, checking every index
/// and that every referenced source splits into `outer` equal blocks.
///
/// # Errors
/// `GatherIndex` for an index outside `[0, sources.len())`, `GatherUneven` when a referenced
/// source's length is not a multiple of `outer` (or `outer` is 0 with a non-empty source),
/// `IndexOverflow` when the total does not fit in `usize`.
pub fn gathered_len(source_lens: &[usize], order: &[i64], outer: usize) -> CoreResult<usize> {
    let mut total: usize = 0;
    for (at, &index) in order.iter().enumerate() {
        let k = checked_source(index, at, source_lens.len())?;
        let len = source_lens.get(k).copied().unwrap_or(0);
        check_even(k, len, outer)?;
        total = total.checked_add(len).ok_or(CoreError::IndexOverflow {
            what: "gathered output length",
        })?;
    }
    Ok(total)
}

fn checked_source(index: i64, at: usize, n_sources: usize) -> CoreResult<usize> {
    usize::try_from(index)
        .ok()
        .filter(|&k| k < n_sources)
        .ok_or(CoreError::GatherIndex {
            at,
            index,
            n_sources,
        })
}

fn check_even(source: usize, len: usize, outer: usize) -> CoreResult<()> {
    let even = if outer == 0 {
        len == 0
    } else {
        len % outer == 0
    };
    if even {
        Ok(())
    } else {
        Err(CoreError::GatherUneven { source, len, outer })
    }
}

/// Gather `sources` into `out` following `order` (see the module docs for `outer`).
///
/// `out.len()` must equal [`gathered_len`]. Runs in parallel (rayon) when the output is at least
/// 1 MiB; identical results either way.
///
/// # Errors
/// Those of [`gathered_len`], and `GatherSize` when `out` has the wrong length.
pub fn gather_into(
    out: &mut [u8],
    sources: &[&[u8]],
    order: &[i64],
    outer: usize,
) -> CoreResult<()> {
    let lens: Vec<usize> = sources.iter().map(|s| s.len()).collect();
    let expected = gathered_len(&lens, order, outer)?;
    if expected != out.len() {
        return Err(CoreError::GatherSize {
            expected,
            actual: out.len(),
        });
    }
    if expected == 0 {
        return Ok(());
    }
    let outer = outer.max(1);
    // Every index and every referenced source's split were checked by `gathered_len`.
    let mut blocks: Vec<&[u8]> = Vec::with_capacity(order.len().saturating_mul(outer));
    for o in 0..outer {
        for &index in order {
            let src = usize::try_from(index)
                .ok()
                .and_then(|k| sources.get(k))
                .copied();
            debug_assert!(src.is_some(), "order checked by gathered_len");
            let src = src.unwrap_or_default();
            let block = src.len() / outer;
            // o < outer and block * outer == src.len(): inside the source
            let src_block = src.get(o * block..(o + 1) * block);
            debug_assert!(src_block.is_some(), "source split checked by gathered_len");
            blocks.push(src_block.unwrap_or_default());
        }
    }
    copy_blocks(out, &blocks);
    Ok(())
}

/// Gather byte ranges of one source buffer into `out`: segment `k` is
/// `src[o * src_stride + starts[k] ..][.. lens[k]]` in outer block `o`, and the output is, for
/// each `o` in `0..outer`, segment `order[j]` for every `j` in turn.
///
/// This is [`gather_into`] for segments that were first compacted into one buffer (one native
/// view instead of one per segment, which is what costs when segments are many and small).
///
/// # Errors
/// `GatherSize` when `starts` and `lens` differ in length or `out` has the wrong length,
/// `GatherIndex` for an `order` entry outside `[0, starts.len())`, `GatherRange` for a negative
/// start or length or a range past the end of `src`, `IndexOverflow` on overflow.
pub fn gather_ranges_into(
    out: &mut [u8],
    src: &[u8],
    starts: &[i64],
    lens: &[i64],
    order: &[i64],
    outer: usize,
    src_stride: usize,
) -> CoreResult<()> {
    if starts.len() != lens.len() {
        return Err(CoreError::GatherSize {
            expected: starts.len(),
            actual: lens.len(),
        });
    }
    // Validate every segment's range in the last outer block (the others lie before it).
    let last = outer
        .saturating_sub(1)
        .checked_mul(src_stride)
        .ok_or(CoreError::IndexOverflow {
            what: "gather source offset",
        })?;
    let mut ranges: Vec<(usize, usize)> = Vec::with_capacity(starts.len());
    for (segment, (&start, &len)) in starts.iter().zip(lens).enumerate() {
        let bad = CoreError::GatherRange {
            segment,
            start,
            len,
            src_len: src.len(),
        };
        let (Ok(s), Ok(l)) = (usize::try_from(start), usize::try_from(len)) else {
            return Err(bad);
        };
        let end = s.checked_add(l).ok_or(CoreError::IndexOverflow {
            what: "gather range end",
        })?;
        let end_last = end.checked_add(last).ok_or(CoreError::IndexOverflow {
            what: "gather range end",
        })?;
        if end_last > src.len() {
            return Err(bad);
        }
        ranges.push((s, end));
    }
    let mut per_outer: usize = 0;
    for (at, &index) in order.iter().enumerate() {
        let k = checked_source(index, at, ranges.len())?;
        let (s, e) = ranges.get(k).copied().unwrap_or((0, 0));
        per_outer = per_outer
            .checked_add(e - s)
            .ok_or(CoreError::IndexOverflow {
                what: "gathered output length",
            })?;
    }
    let expected = per_outer
        .checked_mul(outer)
        .ok_or(CoreError::IndexOverflow {
            what: "gathered output length",
        })?;
    if expected != out.len() {
        return Err(CoreError::GatherSize {
            expected,
            actual: out.len(),
        });
    }
    if expected == 0 {
        return Ok(());
    }
    // Every order entry and range was checked above.
    let mut blocks: Vec<&[u8]> = Vec::with_capacity(order.len().saturating_mul(outer));
    let mut base: usize = 0;
    for _ in 0..outer {
        for &index in order {
            let range = usize::try_from(index).ok().and_then(|k| ranges.get(k));
            debug_assert!(range.is_some(), "order checked above");
            let (s, e) = range.copied().unwrap_or((0, 0));
            // base <= last and end + last <= src.len() were checked above
            let block = src.get(base + s..base + e);
            debug_assert!(block.is_some(), "ranges checked above");
            blocks.push(block.unwrap_or_default());
        }
        base = base.saturating_add(src_stride);
    }
    copy_blocks(out, &blocks);
    Ok(())
}

/// Copy `blocks` back to back into `out`, whose length is their total (the callers checked
/// it), in parallel when large.
fn copy_blocks(out: &mut [u8], blocks: &[&[u8]]) {
    let total = out.len();
    debug_assert_eq!(total, blocks.iter().map(|b| b.len()).sum::<usize>());
    let mut pieces: Vec<(&mut [u8], &[u8])> = Vec::with_capacity(blocks.len());
    let mut rest = out;
    for &block in blocks {
        if block.is_empty() || rest.len() < block.len() {
            continue;
        }
        let (dst, tail) = std::mem::take(&mut rest).split_at_mut(block.len());
        rest = tail;
        if block.len() > MAX_PIECE_BYTES {
            pieces.extend(
                dst.chunks_mut(MAX_PIECE_BYTES)
                    .zip(block.chunks(MAX_PIECE_BYTES)),
            );
        } else {
            pieces.push((dst, block));
        }
    }
    let pool = if total < PARALLEL_MIN_BYTES {
        None
    } else {
        process_pool().filter(|pool| pool.current_num_threads() >= 2)
    };
    match pool {
        None => {
            for (dst, src) in pieces {
                dst.copy_from_slice(src);
            }
        }
        Some(pool) => {
            let average = total / pieces.len().max(1);
            let min_len = (MIN_LEAF_BYTES / average.max(1)).max(1);
            pool.install(|| {
                pieces
                    .into_par_iter()
                    .with_min_len(min_len)
                    .for_each(|(dst, src)| dst.copy_from_slice(src));
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reference(sources: &[&[u8]], order: &[i64], outer: usize) -> Vec<u8> {
        let mut out = Vec::new();
        for o in 0..outer {
            for &k in order {
                let src = sources[usize::try_from(k).unwrap_or(0)];
                let block = src.len() / outer;
                out.extend_from_slice(&src[o * block..(o + 1) * block]);
            }
        }
        out
    }

    #[test]
    fn gathers_in_order_with_repeats() -> CoreResult<()> {
        let a = [1u8, 2, 3, 4];
        let b = [5u8, 6];
        let sources: [&[u8]; 2] = [&a, &b];
        let order = [1i64, 0, 1, 1];
        let mut out = vec![0u8; 10];
        gather_into(&mut out, &sources, &order, 1)?;
        assert_eq!(out, vec![5, 6, 1, 2, 3, 4, 5, 6, 5, 6]);
        Ok(())
    }

    #[test]
    fn outer_blocks_interleave() -> CoreResult<()> {
        let a = [1u8, 2, 3, 4];
        let b = [5u8, 6];
        let sources: [&[u8]; 2] = [&a, &b];
        let order = [0i64, 1, 0];
        let mut out = vec![0u8; 10];
        gather_into(&mut out, &sources, &order, 2)?;
        assert_eq!(out, reference(&sources, &order, 2));
        assert_eq!(out, vec![1, 2, 5, 1, 2, 3, 4, 6, 3, 4]);
        Ok(())
    }

    #[test]
    fn large_parallel_gather_matches_reference() -> CoreResult<()> {
        let a: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
        let b: Vec<u8> = (0..1_000_000u32).map(|i| (i % 13) as u8).collect();
        let c: Vec<u8> = Vec::new();
        let sources: [&[u8]; 3] = [&a, &b, &c];
        let order = [0i64, 1, 2, 1, 0, 0];
        let expected = reference(&sources, &order, 2);
        let mut out = vec![0u8; expected.len()];
        gather_into(&mut out, &sources, &order, 2)?;
        assert!(out == expected);
        Ok(())
    }

    #[test]
    fn one_pool_per_process() {
        // Other tests gather at the same time: a lookup that finds the lock busy gives None.
        let lookup = || {
            (0..10_000).find_map(|_| {
                process_pool().or_else(|| {
                    std::thread::yield_now();
                    None
                })
            })
        };
        let first = lookup();
        let again = lookup();
        assert!(matches!((&first, &again), (Some(a), Some(b)) if Arc::ptr_eq(a, b)));
        assert!(parallel_threads() >= 1);
    }

    #[test]
    fn errors_are_typed() {
        let a = [1u8, 2, 3];
        let sources: [&[u8]; 1] = [&a];
        let mut out = vec![0u8; 3];
        assert_eq!(
            gather_into(&mut out, &sources, &[1], 1),
            Err(CoreError::GatherIndex {
                at: 0,
                index: 1,
                n_sources: 1
            })
        );
        assert_eq!(
            gather_into(&mut out, &sources, &[0, -1], 1),
            Err(CoreError::GatherIndex {
                at: 1,
                index: -1,
                n_sources: 1
            })
        );
        assert_eq!(
            gather_into(&mut out, &sources, &[0], 2),
            Err(CoreError::GatherUneven {
                source: 0,
                len: 3,
                outer: 2
            })
        );
        assert_eq!(
            gather_into(&mut out, &sources, &[0, 0], 1),
            Err(CoreError::GatherSize {
                expected: 6,
                actual: 3
            })
        );
        let mut empty: Vec<u8> = Vec::new();
        assert_eq!(gather_into(&mut empty, &sources, &[], 0), Ok(()));
        assert_eq!(
            gather_into(&mut empty, &sources, &[0], 0),
            Err(CoreError::GatherUneven {
                source: 0,
                len: 3,
                outer: 0
            })
        );
    }

    #[test]
    fn ranges_gather_with_outer_blocks() -> CoreResult<()> {
        // two outer rows of a compacted buffer [a0 a0 b0 | a1 a1 b1] (stride 3)
        let src = [1u8, 2, 3, 4, 5, 6];
        let mut out = vec![0u8; 8];
        gather_ranges_into(&mut out, &src, &[0, 2], &[2, 1], &[1, 0, 1], 2, 3)?;
        assert_eq!(out, vec![3, 1, 2, 3, 6, 4, 5, 6]);
        assert_eq!(
            gather_ranges_into(&mut out, &src, &[0, 2], &[2, 2], &[0], 2, 3),
            Err(CoreError::GatherRange {
                segment: 1,
                start: 2,
                len: 2,
                src_len: 6
            })
        );
        assert_eq!(
            gather_ranges_into(&mut out, &src, &[-1], &[1], &[0], 1, 0),
            Err(CoreError::GatherRange {
                segment: 0,
                start: -1,
                len: 1,
                src_len: 6
            })
        );
        assert_eq!(
            gather_ranges_into(&mut out, &src, &[0], &[1, 1], &[0], 1, 0),
            Err(CoreError::GatherSize {
                expected: 1,
                actual: 2
            })
        );
        assert_eq!(
            gather_ranges_into(&mut out, &src, &[0], &[1], &[3], 1, 0),
            Err(CoreError::GatherIndex {
                at: 0,
                index: 3,
                n_sources: 1
            })
        );
        assert_eq!(
            gather_ranges_into(&mut out, &src, &[0], &[1], &[0], 1, 0),
            Err(CoreError::GatherSize {
                expected: 1,
                actual: 8
            })
        );
        Ok(())
    }

    proptest::proptest! {
        #[test]
        fn ranges_equal_per_segment_gather(
            lens in proptest::collection::vec(0usize..40, 1..6),
            outer in 1usize..4,
            picks in proptest::collection::vec(0usize..100, 0..20),
        ) {
            // compact the segments into one buffer: outer rows of [seg0 block | seg1 block | ...]
            let owned: Vec<Vec<u8>> = lens
                .iter()
                .enumerate()
                .map(|(k, &l)| (0..l * outer).map(|b| (b * 5 + k * 17) as u8).collect())
                .collect();
            let stride: usize = lens.iter().sum();
            let mut compact = Vec::new();
            for o in 0..outer {
                for (k, &l) in lens.iter().enumerate() {
                    compact.extend_from_slice(&owned[k][o * l..(o + 1) * l]);
                }
            }
            let starts: Vec<i64> = lens
                .iter()
                .scan(0usize, |acc, &l| { let s = *acc; *acc += l; Some(s as i64) })
                .collect();
            let lens_i: Vec<i64> = lens.iter().map(|&l| l as i64).collect();
            let sources: Vec<&[u8]> = owned.iter().map(Vec::as_slice).collect();
            let order: Vec<i64> = picks.iter().map(|&p| (p % lens.len()) as i64).collect();
            let expected = reference(&sources, &order, outer);
            let mut out = vec![0u8; expected.len()];
            let result = gather_ranges_into(&mut out, &compact, &starts, &lens_i, &order, outer, stride);
            proptest::prop_assert!(result.is_ok());
            proptest::prop_assert!(out == expected);
        }
    }

    proptest::proptest! {
        #[test]
        fn gather_equals_reference(
            lens in proptest::collection::vec(0usize..40, 1..6),
            outer in 1usize..4,
            picks in proptest::collection::vec(0usize..100, 0..20),
        ) {
            let owned: Vec<Vec<u8>> = lens
                .iter()
                .enumerate()
                .map(|(k, &l)| (0..l * outer).map(|b| (b * 7 + k * 31) as u8).collect())
                .collect();
            let sources: Vec<&[u8]> = owned.iter().map(Vec::as_slice).collect();
            let order: Vec<i64> = picks.iter().map(|&p| (p % lens.len()) as i64).collect();
            let expected = reference(&sources, &order, outer);
            let mut out = vec![0u8; expected.len()];
            let result = gather_into(&mut out, &sources, &order, outer);
            proptest::prop_assert!(result.is_ok());
            proptest::prop_assert!(out == expected);
        }
    }
}
