//! Row offsets / segment indices: validate, slice (compacting physical segments in
//! first-reference order), concat with provenance interning, repeat-interleave, shard, counts.
//!
//! A [`PackedLayout`] is the row mapping of one `PackedTensor` without its tensors: either the
//! legacy layout (row `r` is physical segment `r`) or a CSR layout (`offsets` over `indices`),
//! plus an optional provenance id per physical segment. It is valid by construction: its fields
//! are private and every constructor checks NeMo-RL's rules, so the operations below never
//! re-check them (they `debug_assert!` instead). Operations return the new mapping and, where
//! physical segments are selected or merged, which source segment lands at which output slot,
//! so the caller can build the output tensor list without looking at the tensors here.
use crate::alloc;
use crate::error::{CoreError, CoreResult};
use crate::intern::{mint, Interner, ProvId};

/// CSR row mapping: row `r` references `indices[offsets[r]..offsets[r + 1]]`. Only a
/// [`PackedLayout`] holds one, so it is always valid: `offsets` starts at 0, never decreases and
/// ends at `indices.len()`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Csr {
    offsets: Vec<i64>,
    indices: Vec<i64>,
}

/// The row mapping and provenance of one value, valid by construction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackedLayout {
    /// `None`: legacy layout, one row per physical segment.
    csr: Option<Csr>,
    /// One id per physical segment, or `None` when deduplication is not enabled.
    provenance: Option<Vec<ProvId>>,
    /// Number of physical segments the mapping was built for.
    n_physical: usize,
}

/// A selection of rows: the new mapping and, for each output physical segment, its source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Selection {
    pub layout: PackedLayout,
    pub physical: Vec<usize>,
}

/// Which of NeMo-RL's three concatenations [`concat_values`] performs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConcatMode {
    /// `PackedTensor.concat`: the rows of every input, in order.
    Concat,
    /// `PackedTensor.merge_segments`: one row holding every reference (legacy inputs keep
    /// their rows, like `concat`).
    MergeSegments,
    /// `PackedTensor.flattened_concat`: one row per input; inputs without a layout are each
    /// materialized into one row by the caller.
    FlattenedConcat,
}

impl ConcatMode {
    pub const ALL: [Self; 3] = [Self::Concat, Self::MergeSegments, Self::FlattenedConcat];

    /// The `PackedTensor` method name.
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Self::Concat => "concat",
            Self::MergeSegments => "merge_segments",
            Self::FlattenedConcat => "flattened_concat",
        }
    }

    /// The mode named like its `PackedTensor` method, if any.
    #[must_use]
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|m| m.name() == name)
    }
}

/// One input of [`concat_values`]: its layout (`None`: legacy without provenance) and its
/// current number of physical segments (the length of its tensor list, which the layout's
/// provenance and references must fit).
#[derive(Debug, Clone, Copy)]
pub struct ConcatInput<'a> {
    pub layout: Option<&'a PackedLayout>,
    pub n_physical: usize,
}

impl ConcatInput<'_> {
    /// Rows as the layout counts them (without a layout: one per segment).
    fn rows(&self) -> usize {
        self.layout.map_or(self.n_physical, PackedLayout::rows)
    }
}

/// A re-interned concatenation: the mapping and `(input, physical index)` per output segment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Concat {
    pub layout: PackedLayout,
    pub sources: Vec<(usize, usize)>,
}

/// What [`concat_values`] decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConcatOutcome {
    /// No input has a layout: the result is legacy, its segments the inputs' back to back.
    Legacy,
    /// `flattened_concat` of inputs without a layout: the caller materializes each input
    /// into one row (the result is legacy).
    MaterializeEach,
    /// Physical segments re-interned by provenance (see [`concat`]).
    Interned(Concat),
}

fn to_i64(n: usize, what: &'static str) -> CoreResult<i64> {
    i64::try_from(n).map_err(|_| CoreError::IndexOverflow { what })
}

/// A count or index of something already held in memory, as `i64` (always fits).
fn held_i64(n: usize) -> i64 {
    debug_assert!(i64::try_from(n).is_ok(), "{n} does not fit in i64");
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// An offset or reference of a valid mapping, as `usize` (never negative).
fn valid_usize(v: i64) -> usize {
    debug_assert!(
        v >= 0,
        "negative offset or reference {v} in a valid mapping"
    );
    usize::try_from(v).unwrap_or(usize::MAX)
}

/// Check a CSR mapping with NeMo-RL's rules, in NeMo-RL's order.
///
/// # Errors
/// `OffsetsStart`, `OffsetsDecreasing`, `OffsetsEnd` or `SegmentIndexOutOfRange`.
pub fn validate(offsets: &[i64], indices: &[i64], n_physical: usize) -> CoreResult<()> {
    if offsets.first() != Some(&0) {
        return Err(CoreError::OffsetsStart);
    }
    for (i, pair) in offsets.windows(2).enumerate() {
        if let [prev, value] = *pair {
            if value < prev {
                return Err(CoreError::OffsetsDecreasing {
                    at: i + 1,
                    prev,
                    value,
                });
            }
        }
    }
    let last = offsets.last().copied().unwrap_or(0);
    if i64::try_from(indices.len()).ok() != Some(last) {
        return Err(CoreError::OffsetsEnd {
            last,
            refs: indices.len(),
        });
    }
    check_indices(indices, n_physical)
}

fn check_indices(indices: &[i64], n_physical: usize) -> CoreResult<()> {
    for (at, &value) in indices.iter().enumerate() {
        let ok = usize::try_from(value).is_ok_and(|v| v < n_physical);
        if !ok {
            return Err(CoreError::SegmentIndexOutOfRange {
                at,
                value,
                n_physical,
            });
        }
    }
    Ok(())
}

/// Check that a provenance list of `len` entries fits `n_physical` segments.
///
/// # Errors
/// `ProvenanceLength`.
pub fn validate_provenance_len(len: usize, n_physical: usize) -> CoreResult<()> {
    if len == n_physical {
        Ok(())
    } else {
        Err(CoreError::ProvenanceLength {
            expected: n_physical,
            actual: len,
        })
    }
}

/// NeMo-RL's compatibility rule of the three concatenations: there is at least one value and
/// every value has the first one's `dim_to_pack`, then the first one's `pad_to_max_shape`.
/// The caller compares its values (`same_dim`, `same_pad`); the rule and its order live here.
///
/// # Errors
/// `ConcatIncompatible` naming the first field that differs.
pub fn check_compatible(n_values: usize, same_dim: bool, same_pad: bool) -> CoreResult<()> {
    if n_values == 0 || !same_dim {
        return Err(CoreError::ConcatIncompatible {
            field: "dim_to_pack",
        });
    }
    if !same_pad {
        return Err(CoreError::ConcatIncompatible {
            field: "pad_to_max_shape setting",
        });
    }
    Ok(())
}

/// The output of `PackedLayout::select` while it is built.
struct SelectOut<'a> {
    /// The source's references (`None`: the legacy layout, row r is segment r).
    all_refs: Option<&'a [i64]>,
    /// Output slot of each source physical segment (`usize::MAX`: not referenced yet).
    remap: Vec<usize>,
    physical: Vec<usize>,
    offsets: Vec<i64>,
    indices: Vec<i64>,
}

impl SelectOut<'_> {
    /// Copy the references of the last `starts.len()` rows (whose offsets are already
    /// pushed), renumbering physical segments in first-reference order.
    fn copy_refs(&mut self, starts: &[usize]) {
        debug_assert!(self.offsets.len() > starts.len());
        let first = self.offsets.len().saturating_sub(starts.len() + 1);
        let bounds = self.offsets.get(first..).unwrap_or_default();
        let mut legacy = [0i64];
        for (&start, w) in starts.iter().zip(bounds.windows(2)) {
            let refs: &[i64] = match self.all_refs {
                Some(all) => {
                    let len = valid_usize(w[1] - w[0]);
                    let refs = all.get(start..start.saturating_add(len));
                    debug_assert!(refs.is_some(), "row span outside the references");
                    refs.unwrap_or_default()
                }
                None => {
                    legacy[0] = held_i64(start);
                    &legacy
                }
            };
            for &src in refs {
                let s = valid_usize(src);
                let Some(slot) = self.remap.get_mut(s) else {
                    debug_assert!(false, "reference {src} outside the physical segments");
                    continue;
                };
                if *slot == usize::MAX {
                    *slot = self.physical.len();
                    self.physical.push(s);
                }
                self.indices.push(held_i64(*slot));
            }
        }
    }
}

impl Csr {
    /// Number of rows.
    #[must_use]
    pub fn rows(&self) -> usize {
        self.offsets.len().saturating_sub(1)
    }

    /// Row offsets (`rows() + 1` entries, starting at 0, ending at `indices().len()`).
    #[must_use]
    pub fn offsets(&self) -> &[i64] {
        &self.offsets
    }

    /// Segment references, row after row.
    #[must_use]
    pub fn indices(&self) -> &[i64] {
        &self.indices
    }

    /// Row `r`'s references as `(start, len)` into `indices`, `None` past the last row.
    #[must_use]
    pub fn span(&self, r: usize) -> Option<(usize, usize)> {
        let a = valid_usize(*self.offsets.get(r)?);
        let b = valid_usize(*self.offsets.get(r.checked_add(1)?)?);
        debug_assert!(a <= b, "decreasing offsets in a valid mapping");
        Some((a, b.saturating_sub(a)))
    }

    /// The references of row `r`, `None` past the last row.
    #[must_use]
    pub fn row(&self, r: usize) -> Option<&[i64]> {
        let (start, len) = self.span(r)?;
        self.indices.get(start..start.saturating_add(len))
    }
}

impl PackedLayout {
    /// The legacy layout over `n_physical` segments, without provenance.
    #[must_use]
    pub const fn legacy(n_physical: usize) -> Self {
        Self {
            csr: None,
            provenance: None,
            n_physical,
        }
    }

    /// A CSR layout, validated with NeMo-RL's constructor rules and order.
    ///
    /// # Errors
    /// The layout errors of [`validate`].
    pub fn from_csr(offsets: Vec<i64>, indices: Vec<i64>, n_physical: usize) -> CoreResult<Self> {
        validate(&offsets, &indices, n_physical)?;
        Ok(Self {
            csr: Some(Csr { offsets, indices }),
            provenance: None,
            n_physical,
        })
    }

    /// The same mapping with `provenance` (one id per physical segment) or none.
    ///
    /// # Errors
    /// `ProvenanceLength`.
    pub fn with_provenance(self, provenance: Option<Vec<ProvId>>) -> CoreResult<Self> {
        if let Some(p) = &provenance {
            validate_provenance_len(p.len(), self.n_physical)?;
        }
        Ok(Self { provenance, ..self })
    }

    /// The legacy layout with freshly minted provenance (`enable_deduplication`).
    ///
    /// # Errors
    /// `IndexOverflow` if minting overflows.
    pub fn legacy_dedup(n_physical: usize) -> CoreResult<Self> {
        Ok(Self {
            csr: None,
            provenance: Some(mint(n_physical)?),
            n_physical,
        })
    }

    /// The same mapping with fresh provenance for every physical segment, if it had any
    /// (`to_dtype` with a real cast).
    ///
    /// # Errors
    /// `IndexOverflow` if minting overflows.
    pub fn reminted(&self) -> CoreResult<Self> {
        let provenance = match &self.provenance {
            Some(_) => Some(mint(self.n_physical)?),
            None => None,
        };
        Ok(Self {
            csr: self.csr.clone(),
            provenance,
            n_physical: self.n_physical,
        })
    }

    /// The CSR mapping, `None` for the legacy layout.
    #[must_use]
    pub const fn csr(&self) -> Option<&Csr> {
        self.csr.as_ref()
    }

    /// Whether the layout is CSR (not legacy).
    #[must_use]
    pub const fn is_csr(&self) -> bool {
        self.csr.is_some()
    }

    /// One provenance id per physical segment, `None` when deduplication is not enabled.
    #[must_use]
    pub fn provenance(&self) -> Option<&[ProvId]> {
        self.provenance.as_deref()
    }

    /// Number of physical segments.
    #[must_use]
    pub const fn n_physical(&self) -> usize {
        self.n_physical
    }

    /// Number of logical rows.
    #[must_use]
    pub fn rows(&self) -> usize {
        self.csr.as_ref().map_or(self.n_physical, Csr::rows)
    }

    /// Number of logical segment references.
    #[must_use]
    pub fn refs(&self) -> usize {
        self.csr
            .as_ref()
            .map_or(self.n_physical, |c| c.indices.len())
    }

    /// Rows `rows` (each below `self.rows()`, `hint` of them), compacted.
    fn select<I: IntoIterator<Item = usize>>(&self, rows: I, hint: usize) -> CoreResult<Selection> {
        let n_physical = self.n_physical;
        let ovf = |what| CoreError::IndexOverflow { what };
        // Two passes per chunk of rows: first each row's range of references, then the copy.
        // Rows selected at random hit `offsets` and `indices` at random; loops that do nothing
        // else let the CPU overlap those cache misses (random half of 10M rows: 0.92 s -> 0.66 s
        // measured), and a chunk's ranges stay in L1.
        const CHUNK: usize = 1024;
        let refs_hint = match &self.csr {
            Some(c) if c.rows() > 0 => (c.indices.len() / c.rows()).saturating_mul(hint),
            _ => hint,
        };
        let mut out = SelectOut {
            all_refs: self.csr.as_ref().map(|c| c.indices.as_slice()),
            remap: vec![usize::MAX; n_physical],
            physical: Vec::new(),
            offsets: Vec::with_capacity(hint.saturating_add(1)),
            indices: Vec::with_capacity(refs_hint),
        };
        out.offsets.push(0);
        let mut starts: Vec<usize> = Vec::with_capacity(CHUNK);
        let mut total = 0usize;
        for r in rows {
            let span = match &self.csr {
                Some(c) => c.span(r),
                None => (r < n_physical).then_some((r, 1)),
            };
            debug_assert!(span.is_some(), "row {r} out of range");
            let (start, len) = span.unwrap_or((0, 0));
            // A row may be selected any number of times: the total is input-derived.
            total = total.checked_add(len).ok_or(ovf("a row offset"))?;
            out.offsets.push(to_i64(total, "a row offset")?);
            starts.push(start);
            if starts.len() == CHUNK {
                out.copy_refs(&starts);
                starts.clear();
            }
        }
        out.copy_refs(&starts);
        let SelectOut {
            physical,
            offsets,
            indices,
            ..
        } = out;
        let provenance = self.provenance.as_ref().map(|p| {
            let picked: Vec<ProvId> = physical.iter().filter_map(|&s| p.get(s).copied()).collect();
            debug_assert_eq!(picked.len(), physical.len());
            picked
        });
        let n_out = physical.len();
        Ok(Selection {
            layout: Self {
                csr: Some(Csr { offsets, indices }),
                provenance,
                n_physical: n_out,
            },
            physical,
        })
    }

    /// Select rows (negative indices count from the end), compacting the physical segments
    /// to those referenced, in first-reference order. The result is always CSR.
    ///
    /// # Errors
    /// `RowOutOfRange` with the normalized index of the first bad row.
    pub fn slice(&self, rows: &[i64]) -> CoreResult<Selection> {
        let n = self.rows();
        let n64 = to_i64(n, "the number of rows")?;
        let mut normalized = Vec::with_capacity(rows.len());
        for &row in rows {
            let r = if row < 0 {
                row.saturating_add(n64)
            } else {
                row
            };
            match usize::try_from(r) {
                Ok(u) if u < n => normalized.push(u),
                _ => return Err(CoreError::RowOutOfRange { row: r }),
            }
        }
        self.select(normalized, rows.len())
    }

    /// Rows `start..end`, compacted like [`PackedLayout::slice`].
    ///
    /// # Errors
    /// `RowOutOfRange` if the range leaves the value.
    pub fn slice_range(&self, start: usize, end: usize) -> CoreResult<Selection> {
        let n = self.rows();
        if end > n || start > end {
            let row = to_i64(end.max(start), "a row index")?;
            return Err(CoreError::RowOutOfRange { row });
        }
        self.select(start..end, end - start)
    }

    /// `num_shards` contiguous shards with equal row counts, each compacted.
    ///
    /// # Errors
    /// `ShardCount` if `num_shards <= 0`, `ShardNotDivisible` if the rows do not split evenly.
    pub fn shard(&self, num_shards: i64) -> CoreResult<Vec<Selection>> {
        let shards = usize::try_from(num_shards)
            .ok()
            .filter(|&s| s > 0)
            .ok_or(CoreError::ShardCount { shards: num_shards })?;
        let rows = self.rows();
        if rows % shards != 0 {
            return Err(CoreError::ShardNotDivisible { rows, shards });
        }
        let per = rows / shards;
        // An empty value splits into any number of shards: refuse a count that cannot be held.
        let too_many = || CoreError::ShardsTooMany { shards };
        alloc::probe(alloc::bytes_of::<Selection>(shards), too_many)?;
        let mut out = alloc::vec_with_capacity(shards, too_many)?;
        for s in 0..shards {
            // s * per + per <= rows: cannot overflow
            let start = s * per;
            out.push(self.slice_range(start, start + per)?);
        }
        Ok(out)
    }

    /// Every row repeated `repeats` times in place (`[r0]*k + [r1]*k ...`), sharing physical
    /// segments. Like NeMo-RL's GRPO expansion (deep copies of each row, re-interned by
    /// `concat`): the physical segments are those referenced, in first-reference order, merged
    /// by provenance. The result is CSR with provenance (minted first if there was none).
    ///
    /// # Errors
    /// `Repeats` if `repeats < 0`, `IndexOverflow` if the result does not fit.
    pub fn repeat_interleave(&self, repeats: i64) -> CoreResult<Selection> {
        let k = usize::try_from(repeats).map_err(|_| CoreError::Repeats { repeats })?;
        let rows = self.rows();
        let n_physical = self.n_physical;
        let too_large = || CoreError::RepeatsTooLarge {
            repeats,
            rows,
            refs: self.refs(),
        };
        let out_rows = rows.checked_mul(k).ok_or_else(too_large)?;
        let out_refs = self.refs().checked_mul(k).ok_or_else(too_large)?;
        i64::try_from(out_refs).map_err(|_| too_large())?;
        // Both outputs in one request first (see `alloc::probe`).
        let bytes = alloc::total_bytes(&[(out_rows.saturating_add(1), 8), (out_refs, 8)]);
        alloc::probe(bytes, too_large)?;
        let minted;
        let provenance: &[ProvId] = match &self.provenance {
            Some(p) => p,
            None => {
                minted = mint(n_physical)?;
                &minted
            }
        };
        let mut table = Interner::with_capacity(if k == 0 { 0 } else { n_physical });
        let mut physical = Vec::new();
        let mut offsets: Vec<i64> =
            alloc::vec_with_capacity(out_rows.saturating_add(1), too_large)?;
        let mut indices: Vec<i64> = alloc::vec_with_capacity(out_refs, too_large)?;
        let mut row_out: Vec<i64> = Vec::new();
        offsets.push(0i64);
        if k > 0 {
            for r in 0..rows {
                let single;
                let refs: &[i64] = match &self.csr {
                    Some(c) => c.row(r).unwrap_or_default(),
                    None => {
                        single = [held_i64(r)];
                        &single
                    }
                };
                row_out.clear();
                for &src in refs {
                    let s = valid_usize(src);
                    let Some(&id) = provenance.get(s) else {
                        debug_assert!(false, "reference {src} outside the provenance");
                        continue;
                    };
                    let (out, new) = table.intern(id);
                    if new {
                        physical.push(s);
                    }
                    row_out.push(held_i64(out));
                }
                for _ in 0..k {
                    indices.extend_from_slice(&row_out);
                    offsets.push(held_i64(indices.len()));
                }
            }
        }
        let n_out = table.len();
        Ok(Selection {
            layout: Self {
                csr: Some(Csr { offsets, indices }),
                provenance: Some(table.into_ids()),
                n_physical: n_out,
            },
            physical,
        })
    }

    /// Per row, how many referenced physical segments are not `None` (`is_none` has one entry
    /// per entry of the value's tensor list, which may differ from `n_physical`).
    ///
    /// # Errors
    /// `SegmentIndexOutOfRange` (with the reference's position) if a reference is outside
    /// `is_none`.
    pub fn logical_counts(&self, is_none: &[bool]) -> CoreResult<Vec<i64>> {
        let Some(c) = &self.csr else {
            return Ok(is_none.iter().map(|&none| i64::from(!none)).collect());
        };
        let mut out = Vec::with_capacity(c.rows());
        let mut at = 0usize;
        for r in 0..c.rows() {
            let mut count = 0i64;
            for &src in c.row(r).unwrap_or_default() {
                let none = usize::try_from(src).ok().and_then(|s| is_none.get(s));
                let Some(&none) = none else {
                    return Err(CoreError::SegmentIndexOutOfRange {
                        at,
                        value: src,
                        n_physical: is_none.len(),
                    });
                };
                count += i64::from(!none);
                at += 1;
            }
            out.push(count);
        }
        Ok(out)
    }

    /// How many logical references each of `n_physical` segments has (the length of the
    /// value's tensor list, which may differ from the layout's).
    ///
    /// # Errors
    /// `SegmentIndexOutOfRange` if a reference is outside `n_physical`.
    pub fn reference_counts(&self, n_physical: usize) -> CoreResult<Vec<u64>> {
        let mut out = vec![0u64; n_physical];
        match &self.csr {
            None => {
                out.iter_mut().take(self.n_physical).for_each(|c| *c = 1);
            }
            Some(c) => {
                for (at, &src) in c.indices.iter().enumerate() {
                    let slot = usize::try_from(src)
                        .ok()
                        .and_then(|s| out.get_mut(s))
                        .ok_or(CoreError::SegmentIndexOutOfRange {
                            at,
                            value: src,
                            n_physical,
                        })?;
                    *slot += 1;
                }
            }
        }
        Ok(out)
    }

    /// Total logical bytes: `sum over references of nbytes[physical]`.
    ///
    /// # Errors
    /// `SegmentIndexOutOfRange` or `IndexOverflow`.
    pub fn logical_nbytes(&self, nbytes: &[u64]) -> CoreResult<u64> {
        let counts = self.reference_counts(nbytes.len())?;
        counts.iter().zip(nbytes).try_fold(0u64, |acc, (&c, &b)| {
            c.checked_mul(b)
                .and_then(|x| acc.checked_add(x))
                .ok_or(CoreError::IndexOverflow {
                    what: "the logical byte count",
                })
        })
    }
}

/// Concatenate rows of several values, re-interning physical segments by provenance: the
/// first occurrence of an id keeps its segment, inputs without provenance get fresh ids (so
/// they never merge), unreferenced segments are carried along. The result is CSR with
/// provenance.
///
/// # Errors
/// `ProvenanceLength` if an input's provenance does not match its segment count,
/// `SegmentIndexOutOfRange` if a reference is outside it, `IndexOverflow`.
pub fn concat(inputs: &[ConcatInput<'_>]) -> CoreResult<Concat> {
    let ovf = |what| CoreError::IndexOverflow { what };
    let mut total_phys = 0usize;
    let mut total_rows = 0usize;
    let mut total_refs = 0usize;
    let mut to_mint = 0usize;
    for input in inputs {
        total_phys = total_phys
            .checked_add(input.n_physical)
            .ok_or(ovf("the physical count"))?;
        let refs = match input.layout.and_then(PackedLayout::csr) {
            Some(c) => c.indices.len(),
            None => input.n_physical,
        };
        let rows = match input.layout.and_then(PackedLayout::csr) {
            Some(c) => c.rows(),
            None => input.n_physical,
        };
        total_rows = total_rows.checked_add(rows).ok_or(ovf("the row count"))?;
        total_refs = total_refs
            .checked_add(refs)
            .ok_or(ovf("the reference count"))?;
        // The tensor list may have changed length since the layout was built.
        match input.layout.and_then(PackedLayout::provenance) {
            Some(p) => validate_provenance_len(p.len(), input.n_physical)?,
            None => {
                to_mint = to_mint
                    .checked_add(input.n_physical)
                    .ok_or(ovf("minting"))?;
            }
        }
    }
    to_i64(total_refs, "the reference count")?;
    let minted = mint(to_mint)?;
    let mut fresh = minted.iter().copied();
    let mut table = Interner::with_capacity(total_phys);
    let mut sources: Vec<(usize, usize)> = Vec::with_capacity(total_phys);
    let mut offsets: Vec<i64> = Vec::with_capacity(total_rows.saturating_add(1));
    let mut indices: Vec<i64> = Vec::with_capacity(total_refs);
    offsets.push(0);
    let mut remap: Vec<i64> = Vec::new();
    for (k, input) in inputs.iter().enumerate() {
        remap.clear();
        match input.layout.and_then(PackedLayout::provenance) {
            Some(p) => {
                for (j, &id) in p.iter().enumerate() {
                    let (out, new) = table.intern(id);
                    if new {
                        sources.push((k, j));
                    }
                    remap.push(held_i64(out));
                }
            }
            None => {
                for j in 0..input.n_physical {
                    let id = fresh.next();
                    debug_assert!(id.is_some(), "one minted id per segment without provenance");
                    sources.push((k, j));
                    remap.push(held_i64(table.push_fresh(id.unwrap_or_default())));
                }
            }
        }
        match input.layout.and_then(PackedLayout::csr) {
            Some(c) => {
                let base = held_i64(indices.len());
                for (at, &src) in c.indices.iter().enumerate() {
                    let dst = usize::try_from(src).ok().and_then(|s| remap.get(s));
                    let Some(&dst) = dst else {
                        return Err(CoreError::SegmentIndexOutOfRange {
                            at,
                            value: src,
                            n_physical: input.n_physical,
                        });
                    };
                    indices.push(dst);
                }
                // within the reference total, which fits in i64
                offsets.extend(c.offsets.iter().skip(1).map(|&o| o.saturating_add(base)));
            }
            None => {
                for &dst in &remap {
                    indices.push(dst);
                    offsets.push(held_i64(indices.len()));
                }
            }
        }
    }
    let n_physical = table.len();
    Ok(Concat {
        layout: PackedLayout {
            csr: Some(Csr { offsets, indices }),
            provenance: Some(table.into_ids()),
            n_physical,
        },
        sources,
    })
}

/// [`concat`], collapsed to one row holding every reference (`merge_segments`).
///
/// # Errors
/// As [`concat`].
pub fn merge(inputs: &[ConcatInput<'_>]) -> CoreResult<Concat> {
    let mut out = concat(inputs)?;
    if let Some(c) = out.layout.csr.as_mut() {
        c.offsets = vec![0, held_i64(c.indices.len())];
    }
    Ok(out)
}

/// NeMo-RL's `concat` / `merge_segments` / `flattened_concat` rules over `inputs` (already
/// checked with [`check_compatible`]): without any layout the result is legacy (or, for
/// `flattened_concat`, one materialized row per input); otherwise physical segments are
/// re-interned by provenance, `flattened_concat` requiring one row per input.
///
/// # Errors
/// `FlattenedRows` for a `flattened_concat` input with other than one row, and those of
/// [`concat`].
pub fn concat_values(mode: ConcatMode, inputs: &[ConcatInput<'_>]) -> CoreResult<ConcatOutcome> {
    if inputs.iter().all(|i| i.layout.is_none()) {
        return Ok(match mode {
            ConcatMode::FlattenedConcat => ConcatOutcome::MaterializeEach,
            ConcatMode::Concat | ConcatMode::MergeSegments => ConcatOutcome::Legacy,
        });
    }
    let interned = match mode {
        ConcatMode::Concat => concat(inputs)?,
        ConcatMode::MergeSegments => merge(inputs)?,
        ConcatMode::FlattenedConcat => {
            if let Some(at) = inputs.iter().position(|i| i.rows() != 1) {
                let rows = inputs.get(at).map_or(0, ConcatInput::rows);
                return Err(CoreError::FlattenedRows { at, rows });
            }
            concat(inputs)?
        }
    };
    Ok(ConcatOutcome::Interned(interned))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn csr(offsets: &[i64], indices: &[i64]) -> Option<Csr> {
        Some(Csr {
            offsets: offsets.to_vec(),
            indices: indices.to_vec(),
        })
    }

    fn layout(offsets: &[i64], indices: &[i64], n: usize) -> PackedLayout {
        PackedLayout::from_csr(offsets.to_vec(), indices.to_vec(), n)
            .unwrap_or_else(|e| unreachable!("{e}"))
    }

    fn with_prov(l: PackedLayout, ids: &[ProvId]) -> PackedLayout {
        l.with_provenance(Some(ids.to_vec()))
            .unwrap_or_else(|e| unreachable!("{e}"))
    }

    /// `select` works in chunks of rows: a selection spanning several chunks (and rows without
    /// references) must equal the row-by-row result.
    #[test]
    fn slice_across_chunks_matches_row_by_row() {
        let n_rows = 3000usize;
        let n_physical = 7usize;
        let mut offsets = vec![0i64];
        let mut indices = Vec::new();
        for r in 0..n_rows {
            for j in 0..(r % 4) {
                indices.push(((r * 5 + j * 3) % n_physical) as i64);
            }
            offsets.push(indices.len() as i64);
        }
        let picks: Vec<i64> = (0..5000i64)
            .map(|i| (i * 7919 + 13) % 6000 - 3000)
            .collect();
        for legacy in [false, true] {
            let p = if legacy {
                PackedLayout::legacy(n_rows)
            } else {
                layout(&offsets, &indices, n_physical)
            };
            let sel = p.slice(&picks).unwrap_or_else(|_| unreachable!());
            let mut remap = vec![usize::MAX; p.n_physical()];
            let mut physical = Vec::new();
            let mut want_offsets = vec![0i64];
            let mut want_indices = Vec::new();
            for &pick in &picks {
                let r = usize::try_from(if pick < 0 { pick + 3000 } else { pick })
                    .unwrap_or_else(|_| unreachable!());
                let refs: Vec<i64> = match p.csr() {
                    Some(c) => c.row(r).unwrap_or_else(|| unreachable!()).to_vec(),
                    None => vec![r as i64],
                };
                for src in refs {
                    let s = usize::try_from(src).unwrap_or_else(|_| unreachable!());
                    if remap[s] == usize::MAX {
                        remap[s] = physical.len();
                        physical.push(s);
                    }
                    want_indices.push(remap[s] as i64);
                }
                want_offsets.push(want_indices.len() as i64);
            }
            assert_eq!(sel.physical, physical);
            let got = sel.layout.csr().unwrap_or_else(|| unreachable!());
            assert_eq!(got.offsets(), want_offsets);
            assert_eq!(got.indices(), want_indices);
        }
    }

    #[test]
    fn validate_order_and_messages() {
        assert_eq!(validate(&[], &[], 0), Err(CoreError::OffsetsStart));
        assert_eq!(validate(&[1], &[], 0), Err(CoreError::OffsetsStart));
        assert!(matches!(
            validate(&[0, 2, 1], &[0], 1),
            Err(CoreError::OffsetsDecreasing { at: 2, .. })
        ));
        assert!(matches!(
            validate(&[0, 2], &[0], 1),
            Err(CoreError::OffsetsEnd { .. })
        ));
        assert!(matches!(
            validate(&[0, 1], &[1], 1),
            Err(CoreError::SegmentIndexOutOfRange { .. })
        ));
        assert!(matches!(
            validate(&[0, 1], &[-1], 1),
            Err(CoreError::SegmentIndexOutOfRange { .. })
        ));
        assert_eq!(validate(&[0], &[], 0), Ok(()));
    }

    #[test]
    fn constructors_refuse_invalid_layouts() {
        assert_eq!(
            PackedLayout::from_csr(vec![0, 2], vec![0, 3], 2),
            Err(CoreError::SegmentIndexOutOfRange {
                at: 1,
                value: 3,
                n_physical: 2
            })
        );
        assert_eq!(
            PackedLayout::legacy(2).with_provenance(Some(vec![1])),
            Err(CoreError::ProvenanceLength {
                expected: 2,
                actual: 1
            })
        );
        let l = with_prov(layout(&[0, 1], &[1], 2), &[4, 5]);
        assert_eq!(l.provenance(), Some(&[4, 5][..]));
        assert_eq!(
            (l.rows(), l.refs(), l.n_physical(), l.is_csr()),
            (1, 1, 2, true)
        );
        assert_eq!(
            l.clone()
                .with_provenance(None)
                .map(|l| l.provenance().is_none()),
            Ok(true)
        );
        let r = l.reminted().unwrap_or_else(|_| unreachable!());
        assert_eq!(r.csr(), l.csr());
        assert_ne!(r.provenance(), l.provenance());
    }

    #[test]
    fn slice_compacts_in_first_reference_order() {
        // LD value [a, b] sliced [1, 1, 0] -> tensors [b, a], indices [0, 0, 1].
        let p = with_prov(PackedLayout::legacy(2), &[10, 11]);
        let s = p.slice(&[1, 1, 0]).unwrap_or_else(|_| unreachable!());
        assert_eq!(s.physical, vec![1, 0]);
        assert_eq!(s.layout.csr(), csr(&[0, 1, 2, 3], &[0, 0, 1]).as_ref());
        assert_eq!(s.layout.provenance(), Some(&[11, 10][..]));
        assert_eq!(p.slice(&[-5]), Err(CoreError::RowOutOfRange { row: -3 }));
        assert_eq!(p.slice(&[2]), Err(CoreError::RowOutOfRange { row: 2 }));
    }

    fn input(l: &PackedLayout) -> ConcatInput<'_> {
        ConcatInput {
            layout: Some(l),
            n_physical: l.n_physical(),
        }
    }

    #[test]
    fn concat_reinterns_first_wins() {
        let a = with_prov(PackedLayout::legacy(2), &[1, 2]);
        let b = with_prov(layout(&[0, 2], &[1, 0], 2), &[2, 3]);
        let inputs = [
            input(&a),
            input(&b),
            ConcatInput {
                layout: None,
                n_physical: 1,
            },
        ];
        let c = concat(&inputs).unwrap_or_else(|_| unreachable!());
        assert_eq!(c.sources, vec![(0, 0), (0, 1), (1, 1), (2, 0)]);
        assert_eq!(
            c.layout.csr(),
            csr(&[0, 1, 2, 4, 5], &[0, 1, 2, 1, 3]).as_ref()
        );
        assert_eq!(c.layout.n_physical(), 4);
        let m = merge(&inputs).unwrap_or_else(|_| unreachable!());
        assert_eq!(m.layout.csr(), csr(&[0, 5], &[0, 1, 2, 1, 3]).as_ref());
    }

    #[test]
    fn concat_checks_inputs_against_their_tensor_lists() {
        // The tensor list lost a segment since the layout was built.
        let a = layout(&[0, 2], &[0, 1], 2);
        let short = ConcatInput {
            layout: Some(&a),
            n_physical: 1,
        };
        assert_eq!(
            concat(&[short]),
            Err(CoreError::SegmentIndexOutOfRange {
                at: 1,
                value: 1,
                n_physical: 1
            })
        );
        let b = with_prov(PackedLayout::legacy(2), &[1, 2]);
        let long = ConcatInput {
            layout: Some(&b),
            n_physical: 3,
        };
        assert_eq!(
            concat(&[long]),
            Err(CoreError::ProvenanceLength {
                expected: 3,
                actual: 2
            })
        );
    }

    #[test]
    fn concat_modes_follow_nemo_rl() {
        for mode in ConcatMode::ALL {
            assert_eq!(ConcatMode::from_name(mode.name()), Some(mode));
        }
        assert_eq!(ConcatMode::from_name("stack"), None);
        assert_eq!(check_compatible(2, true, true), Ok(()));
        let dim = Err(CoreError::ConcatIncompatible {
            field: "dim_to_pack",
        });
        assert_eq!(check_compatible(0, true, true), dim);
        assert_eq!(check_compatible(2, false, false), dim);
        assert!(check_compatible(2, true, false)
            .is_err_and(|e| e.to_string()
                == "All packed tensors must have the same pad_to_max_shape setting"));

        let legacy = [
            ConcatInput {
                layout: None,
                n_physical: 2,
            },
            ConcatInput {
                layout: None,
                n_physical: 1,
            },
        ];
        use ConcatMode::{Concat as C, FlattenedConcat as F, MergeSegments as M};
        assert_eq!(concat_values(C, &legacy), Ok(ConcatOutcome::Legacy));
        assert_eq!(concat_values(M, &legacy), Ok(ConcatOutcome::Legacy));
        assert_eq!(
            concat_values(F, &legacy),
            Ok(ConcatOutcome::MaterializeEach)
        );

        let d = PackedLayout::legacy_dedup(1).unwrap_or_else(|_| unreachable!());
        let mixed = [input(&d), legacy[0]];
        assert_eq!(
            concat_values(F, &mixed),
            Err(CoreError::FlattenedRows { at: 1, rows: 2 })
        );
        let rows = |o: CoreResult<ConcatOutcome>| match o {
            Ok(ConcatOutcome::Interned(c)) => (c.layout.rows(), c.layout.refs()),
            other => unreachable!("{other:?}"),
        };
        assert_eq!(rows(concat_values(C, &mixed)), (3, 3));
        assert_eq!(rows(concat_values(M, &mixed)), (1, 3));
        assert_eq!(rows(concat_values(F, &[input(&d), legacy[1]])), (2, 2));
    }

    #[test]
    fn shard_and_repeat() {
        let p = layout(&[0, 1, 3], &[0, 1, 0], 2);
        let r = p.repeat_interleave(2).unwrap_or_else(|_| unreachable!());
        assert_eq!(r.physical, vec![0, 1]);
        let r = r.layout;
        assert_eq!(r.csr(), csr(&[0, 1, 2, 4, 6], &[0, 0, 1, 0, 1, 0]).as_ref());
        assert_eq!(r.provenance().map(<[ProvId]>::len), Some(2));
        let shards = r.shard(2).unwrap_or_else(|_| unreachable!());
        assert_eq!(shards[0].physical, vec![0]);
        assert_eq!(shards[1].physical, vec![1, 0]);
        assert_eq!(
            r.shard(3),
            Err(CoreError::ShardNotDivisible { rows: 4, shards: 3 })
        );
        assert_eq!(r.shard(0), Err(CoreError::ShardCount { shards: 0 }));
        assert_eq!(
            p.repeat_interleave(-1),
            Err(CoreError::Repeats { repeats: -1 })
        );
        // Duplicate provenance merges, unreferenced segments are dropped.
        let d = with_prov(layout(&[0, 2], &[2, 0], 3), &[5, 6, 5]);
        let r = d.repeat_interleave(1).unwrap_or_else(|_| unreachable!());
        assert_eq!(r.physical, vec![2]);
        assert_eq!(r.layout.csr(), csr(&[0, 2], &[0, 0]).as_ref());
        assert_eq!(p.logical_counts(&[false, true]), Ok(vec![1, 1]));
        assert_eq!(p.logical_nbytes(&[4, 8]), Ok(16));
    }

    #[test]
    fn counts_name_the_reference_outside_the_tensor_list() {
        let p = layout(&[0, 1, 3], &[0, 1, 0], 2);
        assert_eq!(
            p.logical_counts(&[false]),
            Err(CoreError::SegmentIndexOutOfRange {
                at: 1,
                value: 1,
                n_physical: 1
            })
        );
        assert_eq!(
            p.reference_counts(1),
            Err(CoreError::SegmentIndexOutOfRange {
                at: 1,
                value: 1,
                n_physical: 1
            })
        );
        assert_eq!(
            PackedLayout::legacy(2).reference_counts(3),
            Ok(vec![1, 1, 0])
        );
    }
}
