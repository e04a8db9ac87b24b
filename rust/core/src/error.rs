//! The one error type of the core. Every variant maps to a typed Python exception
//! in `rust/py/src/errors.rs` (exhaustive match, so adding a variant forces a mapping).
//! Each area keeps its variants in its own section below.
use std::fmt;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CoreError {
    // --- shared ---
    /// Index arithmetic left the representable range.
    IndexOverflow { what: &'static str },
    // --- csr / intern ---
    /// `_row_offsets` is empty or does not start with 0.
    OffsetsStart,
    /// `_row_offsets[at] < _row_offsets[at - 1]`.
    OffsetsDecreasing { at: usize, prev: i64, value: i64 },
    /// The last row offset is not the number of segment references.
    OffsetsEnd { last: i64, refs: usize },
    /// A segment reference outside `[0, n_physical)`.
    SegmentIndexOutOfRange {
        at: usize,
        value: i64,
        n_physical: usize,
    },
    /// A provenance list whose length is not the number of physical segments.
    ProvenanceLength { expected: usize, actual: usize },
    /// A provenance entry that is not 16 bytes (`at`: its position; for a blob, the position
    /// of the incomplete trailing entry).
    ProvenanceEntry { at: usize, len: usize },
    /// A row index outside the value (already normalized for negatives).
    RowOutOfRange { row: i64 },
    /// A shard count that is not positive.
    ShardCount { shards: i64 },
    /// Rows that do not split into equal shards.
    ShardNotDivisible { rows: usize, shards: usize },
    /// More shards (of an empty value) than can be allocated.
    ShardsTooMany { shards: usize },
    /// A negative repeat count.
    Repeats { repeats: i64 },
    /// A repeat count whose result (`rows * repeats` rows, `refs * repeats` references) does
    /// not fit in int64 or cannot be allocated.
    RepeatsTooLarge {
        repeats: i64,
        rows: usize,
        refs: usize,
    },
    /// Values to concatenate that are none, or differ in `field` (NeMo-RL's assertion).
    ConcatIncompatible { field: &'static str },
    /// A `flattened_concat` input (position `at`) with other than one row.
    FlattenedRows { at: usize, rows: usize },
    // --- packing ---
    /// An item over a bin budget (`what` is "length" or "media").
    ItemTooLarge {
        index: usize,
        what: &'static str,
        size: i64,
        capacity: i64,
    },
    /// A zero / negative length or a negative media count; `rule` says what is allowed.
    InvalidItem {
        index: usize,
        what: &'static str,
        value: i64,
        rule: &'static str,
    },
    /// A packing argument out of range or inconsistent with the others.
    PackingArgument { name: &'static str, detail: String },
    /// `min_bins` / `bins_multiple_of` need more bins than there are items (NeMo-RL's message).
    BinCount { target: usize, total: usize },
    // --- mask / batch ---
    /// A loss mask whose length differs from the sample's token count.
    MaskLength {
        sample: String,
        expected: usize,
        actual: usize,
    },
    /// A loss-mask value outside {0, 1}; `position` is the first such value.
    MaskValue {
        sample: String,
        position: usize,
        value: String,
    },
    /// A loss mask with no trainable token where one is required.
    MaskNoTrainable { sample: String },
    /// Message / fragment spans inconsistent with each other or with the token count.
    SpanMismatch { sample: String, detail: String },
    /// Turn markers missing or not in user/assistant pairs.
    TurnMarkers { sample: String, count: usize },
    /// A sample lacks a field its loss-mask mode needs.
    MissingField {
        sample: String,
        field: &'static str,
        mode: &'static str,
    },
    /// A sample with no tokens.
    EmptySample { sample: String },
    /// A batch builder called with no samples (or no packs).
    EmptyBatch,
    /// A negative token id.
    InvalidToken {
        sample: String,
        position: usize,
        value: i64,
    },
    /// A batch-builder option out of range.
    BatchOption { name: &'static str, detail: String },
    /// The fields of a batch layout disagree with each other (`detail` names the field, the
    /// sample and the position).
    BatchLayout { detail: String },
    // --- gather ---
    /// `order[at]` names no source segment.
    GatherIndex {
        at: usize,
        index: i64,
        n_sources: usize,
    },
    /// A source segment does not split into `outer` equal blocks.
    GatherUneven {
        source: usize,
        len: usize,
        outer: usize,
    },
    /// The output buffer does not have the gathered length.
    GatherSize { expected: usize, actual: usize },
    /// A gather range `[start, start + len)` does not lie inside the source buffer.
    GatherRange {
        segment: usize,
        start: i64,
        len: i64,
        src_len: usize,
    },
}

impl fmt::Display for CoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Exhaustive on purpose: a new variant must be routed to its area's helper.
        match self {
            Self::IndexOverflow { what } => {
                write!(f, "index arithmetic overflowed while computing {what}")
            }
            Self::OffsetsStart
            | Self::OffsetsDecreasing { .. }
            | Self::OffsetsEnd { .. }
            | Self::SegmentIndexOutOfRange { .. }
            | Self::ProvenanceLength { .. }
            | Self::ProvenanceEntry { .. } => self.fmt_layout(f),
            Self::RowOutOfRange { .. }
            | Self::ShardCount { .. }
            | Self::ShardsTooMany { .. }
            | Self::ShardNotDivisible { .. }
            | Self::Repeats { .. }
            | Self::RepeatsTooLarge { .. }
            | Self::ConcatIncompatible { .. }
            | Self::FlattenedRows { .. } => self.fmt_row_op(f),
            Self::ItemTooLarge { .. }
            | Self::InvalidItem { .. }
            | Self::PackingArgument { .. }
            | Self::BinCount { .. } => self.fmt_packing(f),
            Self::MaskLength { .. }
            | Self::MaskValue { .. }
            | Self::MaskNoTrainable { .. }
            | Self::SpanMismatch { .. }
            | Self::TurnMarkers { .. }
            | Self::MissingField { .. }
            | Self::EmptySample { .. }
            | Self::EmptyBatch
            | Self::InvalidToken { .. }
            | Self::BatchOption { .. }
            | Self::BatchLayout { .. } => self.fmt_batch(f),
            Self::GatherIndex { .. }
            | Self::GatherUneven { .. }
            | Self::GatherSize { .. }
            | Self::GatherRange { .. } => self.fmt_gather(f),
        }
    }
}

// One helper per area (the sections of the enum), so each message table stays short.
impl CoreError {
    /// csr / intern: the PackedTensor layout arrays (offsets, segment references, provenance).
    fn fmt_layout(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::OffsetsStart => write!(f, "_row_offsets must start with 0"),
            Self::OffsetsDecreasing { at, prev, value } => write!(
                f,
                "_row_offsets must be non-decreasing (offset {at} is {value} after {prev})"
            ),
            Self::OffsetsEnd { last, refs } => write!(
                f,
                "_row_offsets must end at the number of logical segment references \
                 (last offset {last}, {refs} references)"
            ),
            Self::SegmentIndexOutOfRange {
                at,
                value,
                n_physical,
            } => write!(
                f,
                "_segment_indices cannot reference an out-of-range physical segment \
                 (reference {at} is {value}, {n_physical} physical segments)"
            ),
            Self::ProvenanceLength { expected, actual } => write!(
                f,
                "_segment_provenance must have one entry per physical segment \
                 ({actual} entries for {expected} physical segments)"
            ),
            Self::ProvenanceEntry { at, len } => write!(
                f,
                "_segment_provenance entry {at} has {len} bytes; provenance ids are 16 bytes \
                 (uuid.uuid4().bytes)"
            ),
            // `fmt` routes only this area's variants here.
            other => write!(f, "{other:?}"),
        }
    }

    /// csr: row operations (indexing, sharding, repeating, concatenating).
    fn fmt_row_op(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::RowOutOfRange { row } => {
                write!(f, "PackedTensor row index {row} is out of range")
            }
            Self::ShardCount { shards } => {
                write!(f, "num_shards must be a positive integer, got {shards}")
            }
            Self::ShardsTooMany { shards } => write!(
                f,
                "num_shards={shards} is too large: the list of {shards} shards cannot be allocated"
            ),
            Self::ShardNotDivisible { rows, shards } => write!(
                f,
                "cannot split {rows} rows into {shards} equal shards (num_shards={shards}): \
                 {rows} is not a multiple of {shards}"
            ),
            Self::Repeats { repeats } => {
                write!(f, "repeats must be a non-negative integer, got {repeats}")
            }
            Self::RepeatsTooLarge {
                repeats,
                rows,
                refs,
            } => write!(
                f,
                "repeats={repeats} is too large: {rows} rows and {refs} segment references \
                 repeated {repeats} times do not fit in int64 or cannot be allocated"
            ),
            Self::ConcatIncompatible { field } => {
                write!(f, "All packed tensors must have the same {field}")
            }
            Self::FlattenedRows { at, rows } => write!(
                f,
                "flattened_concat requires one logical row per input; merge_segments only \
                 collapses dedup-enabled values (from_packed_tensors[{at}] has {rows} rows)"
            ),
            // `fmt` routes only this area's variants here.
            other => write!(f, "{other:?}"),
        }
    }

    /// packing: items and arguments.
    fn fmt_packing(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::ItemTooLarge {
                index,
                what,
                size,
                capacity,
            } => write!(
                f,
                "item {index} has {what} {size}, which exceeds the bin {what} capacity {capacity} \
                 (on_oversize=\"skip\" leaves such items out and lists them in Packing.oversize)"
            ),
            Self::InvalidItem {
                index,
                what,
                value,
                rule,
            } => {
                write!(f, "item {index} has {what} {value}; {rule}")
            }
            Self::PackingArgument { name, detail } => {
                write!(f, "invalid packing argument {name}: {detail}")
            }
            Self::BinCount { target, total } => write!(
                f,
                "Cannot create {target} bins with only {total} sequences. Each bin must contain \
                 at least one sequence. Either reduce min_bin_count/bin_count_multiple or provide \
                 more sequences."
            ),
            // `fmt` routes only this area's variants here.
            other => write!(f, "{other:?}"),
        }
    }

    /// mask / batch: samples, masks and batch layouts.
    fn fmt_batch(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::MaskLength {
                sample,
                expected,
                actual,
            } => write!(
                f,
                "loss mask of sample {sample} has {actual} values but the sample has {expected} \
                 tokens (rule: mask length equals token count)"
            ),
            Self::MaskValue {
                sample,
                position,
                value,
            } => write!(
                f,
                "loss mask of sample {sample} has value {value} at position {position} \
                 (rule: values are only 0 and 1)"
            ),
            Self::MaskNoTrainable { sample } => write!(
                f,
                "loss mask of sample {sample} has no trainable token \
                 (rule: at least one value is 1)"
            ),
            Self::SpanMismatch { sample, detail } => {
                write!(
                    f,
                    "loss mask spans of sample {sample} are inconsistent: {detail}"
                )
            }
            Self::TurnMarkers { sample, count } => write!(
                f,
                "sample {sample} has {count} turn markers; turns must come in user/assistant \
                 pairs (an odd count means the conversation ends on a user turn)"
            ),
            Self::MissingField {
                sample,
                field,
                mode,
            } => {
                write!(
                    f,
                    "sample {sample} has no {field}, which loss_mask_mode={mode} needs"
                )
            }
            Self::EmptySample { sample } => write!(f, "sample {sample} has no tokens"),
            Self::EmptyBatch => write!(f, "a batch needs at least one sample, got none"),
            Self::InvalidToken {
                sample,
                position,
                value,
            } => {
                write!(
                    f,
                    "sample {sample} has negative token id {value} at position {position}"
                )
            }
            Self::BatchOption { name, detail } => write!(f, "invalid {name}: {detail}"),
            Self::BatchLayout { detail } => write!(f, "inconsistent batch: {detail}"),
            // `fmt` routes only this area's variants here.
            other => write!(f, "{other:?}"),
        }
    }

    /// gather: orders, sources and buffers.
    fn fmt_gather(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::GatherIndex { at, index, n_sources } => write!(
                f,
                "gather order[{at}] = {index} is out of range for {n_sources} source segments"
            ),
            Self::GatherUneven { source, len, outer } => write!(
                f,
                "gather source segment {source} has {len} bytes, which do not split into {outer} equal blocks"
            ),
            Self::GatherSize { expected, actual } => write!(
                f,
                "gather output buffer has {actual} bytes but the gathered segments need {expected}"
            ),
            Self::GatherRange { segment, start, len, src_len } => write!(
                f,
                "gather range of segment {segment} (start {start}, {len} bytes) does not lie inside the {src_len}-byte source"
            ),
            // `fmt` routes only this area's variants here.
            other => write!(f, "{other:?}"),
        }
    }
}

impl std::error::Error for CoreError {}

pub type CoreResult<T> = Result<T, CoreError>;
