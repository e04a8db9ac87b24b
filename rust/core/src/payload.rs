//! Payload accounting: physical and logical bytes and segment counts of `PackedTensor` values.
//!
//! A physical segment is one tensor object, named by a key the caller chooses (its identity:
//! Python's `id()`), counted once per payload however many values or references hold it; a
//! logical segment is one reference, counted each time. [`SeenSegments`] carries the keys
//! already counted from one value to the next.
use rustc_hash::FxHashSet;

use crate::error::{CoreError, CoreResult};

/// One present physical segment of a value: its identity and its size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    pub key: usize,
    pub nbytes: u64,
}

/// The keys of the physical segments already counted in one payload.
#[derive(Debug, Clone, Default)]
pub struct SeenSegments {
    keys: FxHashSet<usize>,
}

impl SeenSegments {
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Record `key`; `true` if it was not seen before (the segment counts as physical).
    pub fn insert(&mut self, key: usize) -> bool {
        self.keys.insert(key)
    }

    #[must_use]
    pub fn contains(&self, key: usize) -> bool {
        self.keys.contains(&key)
    }

    #[must_use]
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }
}

/// Bytes and counts of the segments of one value (see [`measure`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SegmentTotals {
    pub physical_bytes: u64,
    pub physical_segments: usize,
    pub logical_bytes: u64,
    pub logical_segments: usize,
}

/// Measure one value: `segments[s]` is physical segment `s` (`None` when absent, which counts
/// neither bytes nor a segment), `indices` the physical segment of each logical one (`None`
/// for the legacy layout: every segment once, in order). A present segment counts as
/// physical only if its key is new to `seen`, which records it.
///
/// # Errors
/// `IndexOverflow` when a byte total overflows, `SegmentIndexOutOfRange` for a reference
/// outside `segments` (the keys of the physical segments are recorded first).
pub fn measure(
    segments: &[Option<Segment>],
    indices: Option<&[i64]>,
    seen: &mut SeenSegments,
) -> CoreResult<SegmentTotals> {
    let (mut physical_bytes, mut physical_segments) = (0u64, 0usize);
    for segment in segments.iter().flatten() {
        if seen.insert(segment.key) {
            physical_bytes =
                physical_bytes
                    .checked_add(segment.nbytes)
                    .ok_or(CoreError::IndexOverflow {
                        what: "the physical byte count",
                    })?;
            physical_segments += 1; // at most one per segment: cannot overflow
        }
    }
    let (logical_bytes, logical_segments) = logical_totals(segments, indices)?;
    Ok(SegmentTotals {
        physical_bytes,
        physical_segments,
        logical_bytes,
        logical_segments,
    })
}

/// Bytes and number of the present logical segments of a value: physical segment `indices[j]`
/// for each logical `j`, or every physical segment once, in order, for the legacy layout
/// (`indices` is `None`). An absent segment (`None`) counts neither bytes nor a segment.
///
/// # Errors
/// `SegmentIndexOutOfRange` if a reference is outside `segments`, `IndexOverflow`.
pub fn logical_totals(
    segments: &[Option<Segment>],
    indices: Option<&[i64]>,
) -> CoreResult<(u64, usize)> {
    let (mut bytes, mut count) = (0u64, 0usize);
    let mut add = |segment: &Option<Segment>| -> CoreResult<()> {
        if let Some(s) = segment {
            bytes = bytes
                .checked_add(s.nbytes)
                .ok_or(CoreError::IndexOverflow {
                    what: "the logical byte count",
                })?;
            count += 1; // at most one per reference: cannot overflow
        }
        Ok(())
    };
    match indices {
        None => segments.iter().try_for_each(&mut add)?,
        Some(indices) => {
            for (at, &src) in indices.iter().enumerate() {
                match usize::try_from(src).ok().and_then(|s| segments.get(s)) {
                    Some(segment) => add(segment)?,
                    None => {
                        return Err(CoreError::SegmentIndexOutOfRange {
                            at,
                            value: src,
                            n_physical: segments.len(),
                        })
                    }
                }
            }
        }
    }
    Ok((bytes, count))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seg(key: usize, nbytes: u64) -> Option<Segment> {
        Some(Segment { key, nbytes })
    }

    #[test]
    fn logical_totals_skip_absent_and_repeat_references() {
        let sizes = [seg(0, 4), None, seg(2, 0), seg(3, 8)];
        assert_eq!(logical_totals(&sizes, None), Ok((12, 3)));
        assert_eq!(logical_totals(&sizes, Some(&[3, 3, 1, 2, 0])), Ok((20, 4)));
        assert_eq!(logical_totals(&sizes, Some(&[])), Ok((0, 0)));
        assert!(matches!(
            logical_totals(&sizes, Some(&[0, 4])),
            Err(CoreError::SegmentIndexOutOfRange {
                at: 1,
                value: 4,
                ..
            })
        ));
        assert!(matches!(
            logical_totals(&sizes, Some(&[-1])),
            Err(CoreError::SegmentIndexOutOfRange { at: 0, .. })
        ));
        assert!(matches!(
            logical_totals(&[seg(0, u64::MAX), seg(1, 1)], None),
            Err(CoreError::IndexOverflow { .. })
        ));
    }

    #[test]
    fn physical_segments_count_once_per_key_across_values() {
        let mut seen = SeenSegments::new();
        // One tensor object twice in a value, referenced three times.
        let a = [seg(7, 4), seg(7, 4), None];
        let t = measure(&a, Some(&[0, 1, 0, 2]), &mut seen);
        assert_eq!(
            t,
            Ok(SegmentTotals {
                physical_bytes: 4,
                physical_segments: 1,
                logical_bytes: 12,
                logical_segments: 3,
            })
        );
        // The next value shares key 7: only key 9 is new.
        let b = [seg(9, 2), seg(7, 4)];
        let t = measure(&b, None, &mut seen).unwrap_or_default();
        assert_eq!((t.physical_bytes, t.physical_segments), (2, 1));
        assert_eq!((t.logical_bytes, t.logical_segments), (6, 2));
        assert!(seen.contains(9) && seen.contains(7) && !seen.contains(0));
        assert_eq!(seen.len(), 2);
        assert!(matches!(
            measure(&[seg(1, u64::MAX), seg(2, 1)], None, &mut seen),
            Err(CoreError::IndexOverflow {
                what: "the physical byte count"
            })
        ));
    }
}
