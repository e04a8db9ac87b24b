//! Typed Python exceptions for `CoreError`. The base `MmpackError` is a `ValueError`.
//! Each area keeps its exceptions, mappings and registrations in its own section.
use mmpack_core::CoreError;
use pyo3::create_exception;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

// --- shared ---
create_exception!(
    mmpack._native,
    MmpackError,
    PyValueError,
    "Base class of every mmpack error."
);
create_exception!(
    mmpack._native,
    IndexOverflowError,
    MmpackError,
    "Index arithmetic overflowed."
);
// --- csr / intern ---
create_exception!(
    mmpack._native,
    LayoutError,
    MmpackError,
    "A PackedTensor row mapping breaks a rule: row offsets start at 0, never decrease and end \
     at the number of segment references; segment indices name existing physical segments; \
     one provenance id per physical segment; repeat counts are non-negative."
);
create_exception!(
    mmpack._native,
    ProvenanceError,
    LayoutError,
    "A provenance entry is not a 16-byte id (uuid.uuid4().bytes)."
);
create_exception!(
    mmpack._native,
    ShardError,
    MmpackError,
    "Rows cannot be split into the requested number of equal shards."
);
// --- packing ---
create_exception!(
    mmpack._native,
    ItemTooLargeError,
    MmpackError,
    "An item's length (or media count) exceeds the bin capacity; the message names the item."
);
create_exception!(
    mmpack._native,
    InvalidLengthError,
    MmpackError,
    "A length is zero or negative, or a media count is negative; the message names the item."
);
create_exception!(
    mmpack._native,
    PackingArgumentError,
    MmpackError,
    "A packing argument is out of range or inconsistent with the others."
);
create_exception!(
    mmpack._native,
    BinCountError,
    MmpackError,
    "min_bins / bins_multiple_of ask for more bins than there are items."
);
// --- mask / batch ---
create_exception!(
    mmpack._native,
    LossMaskError,
    MmpackError,
    "A loss mask breaks a rule: length equals the token count, values only 0 and 1, \
     at least one trainable token when required."
);
create_exception!(
    mmpack._native,
    MessageSpanError,
    LossMaskError,
    "Message / fragment lengths and roles are inconsistent with each other or with the token count."
);
create_exception!(
    mmpack._native,
    TurnStructureError,
    MmpackError,
    "Turn markers are missing or not in user/assistant pairs."
);
create_exception!(
    mmpack._native,
    MissingFieldError,
    MmpackError,
    "A sample lacks a field its loss-mask mode needs."
);
create_exception!(
    mmpack._native,
    EmptySampleError,
    MmpackError,
    "A sample (or a batch) has no tokens."
);
create_exception!(
    mmpack._native,
    InvalidTokenError,
    MmpackError,
    "A token id is negative."
);
create_exception!(
    mmpack._native,
    BatchOptionError,
    MmpackError,
    "A batch-builder option is out of range."
);
// --- gather ---
create_exception!(
    mmpack._native,
    GatherIndexError,
    MmpackError,
    "A gather order names a source segment that does not exist."
);
create_exception!(
    mmpack._native,
    GatherSizeError,
    MmpackError,
    "A gather's output buffer or source segments have the wrong number of bytes."
);

/// Newtype so `?` turns a `CoreError` into the right Python exception.
pub struct PyCoreError(pub CoreError);

impl From<CoreError> for PyCoreError {
    fn from(err: CoreError) -> Self {
        Self(err)
    }
}

impl From<PyCoreError> for PyErr {
    fn from(err: PyCoreError) -> Self {
        let msg = err.0.to_string();
        match err.0 {
            // --- shared ---
            CoreError::IndexOverflow { .. } => IndexOverflowError::new_err(msg),
            // --- csr / intern ---
            CoreError::OffsetsStart
            | CoreError::OffsetsDecreasing { .. }
            | CoreError::OffsetsEnd { .. }
            | CoreError::SegmentIndexOutOfRange { .. }
            | CoreError::ProvenanceLength { .. }
            | CoreError::Repeats { .. } => LayoutError::new_err(msg),
            CoreError::ProvenanceEntry { .. } => ProvenanceError::new_err(msg),
            CoreError::RowOutOfRange { .. } => pyo3::exceptions::PyIndexError::new_err(msg),
            CoreError::ShardCount { .. } | CoreError::ShardNotDivisible { .. } => {
                ShardError::new_err(msg)
            }
            // --- packing ---
            CoreError::ItemTooLarge { .. } => ItemTooLargeError::new_err(msg),
            CoreError::InvalidItem { .. } => InvalidLengthError::new_err(msg),
            CoreError::PackingArgument { .. } => PackingArgumentError::new_err(msg),
            CoreError::BinCount { .. } => BinCountError::new_err(msg),
            // --- mask / batch ---
            CoreError::MaskLength { .. }
            | CoreError::MaskValue { .. }
            | CoreError::MaskNoTrainable { .. } => LossMaskError::new_err(msg),
            CoreError::SpanMismatch { .. } => MessageSpanError::new_err(msg),
            CoreError::TurnMarkers { .. } => TurnStructureError::new_err(msg),
            CoreError::MissingField { .. } => MissingFieldError::new_err(msg),
            CoreError::EmptySample { .. } | CoreError::EmptyBatch => EmptySampleError::new_err(msg),
            CoreError::InvalidToken { .. } => InvalidTokenError::new_err(msg),
            CoreError::BatchOption { .. } => BatchOptionError::new_err(msg),
            // --- gather ---
            CoreError::GatherIndex { .. } => GatherIndexError::new_err(msg),
            CoreError::GatherUneven { .. }
            | CoreError::GatherSize { .. }
            | CoreError::GatherRange { .. } => GatherSizeError::new_err(msg),
        }
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    // --- shared ---
    m.add("MmpackError", py.get_type::<MmpackError>())?;
    m.add("IndexOverflowError", py.get_type::<IndexOverflowError>())?;
    // --- csr / intern ---
    m.add("LayoutError", py.get_type::<LayoutError>())?;
    m.add("ProvenanceError", py.get_type::<ProvenanceError>())?;
    m.add("ShardError", py.get_type::<ShardError>())?;
    // --- packing ---
    m.add("ItemTooLargeError", py.get_type::<ItemTooLargeError>())?;
    m.add("InvalidLengthError", py.get_type::<InvalidLengthError>())?;
    m.add(
        "PackingArgumentError",
        py.get_type::<PackingArgumentError>(),
    )?;
    m.add("BinCountError", py.get_type::<BinCountError>())?;
    // --- mask / batch ---
    m.add("LossMaskError", py.get_type::<LossMaskError>())?;
    m.add("MessageSpanError", py.get_type::<MessageSpanError>())?;
    m.add("TurnStructureError", py.get_type::<TurnStructureError>())?;
    m.add("MissingFieldError", py.get_type::<MissingFieldError>())?;
    m.add("EmptySampleError", py.get_type::<EmptySampleError>())?;
    m.add("InvalidTokenError", py.get_type::<InvalidTokenError>())?;
    m.add("BatchOptionError", py.get_type::<BatchOptionError>())?;
    // --- gather ---
    m.add("GatherIndexError", py.get_type::<GatherIndexError>())?;
    m.add("GatherSizeError", py.get_type::<GatherSizeError>())?;
    Ok(())
}
