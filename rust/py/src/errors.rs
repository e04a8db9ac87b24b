//! Typed Python exceptions for `CoreError`, from one table.
//!
//! `exceptions!` below is the only list of the native exception classes: it defines each class
//! (`create_exception!`), registers it on the module and exports the names, in table order, as
//! `_native.ERROR_NAMES` (which `mmpack.errors` and its test check against). A user catches a
//! whole area through its base (`PackedTensorError`, `PackingError`, `BatchError`), all of them
//! `MmpackError`s, which are `ValueError`s. Adding an error touches the core enum, the mapping
//! in `From<PyCoreError> for PyErr` and, for a new class, this table.
use mmpack_core::CoreError;
use pyo3::create_exception;
use pyo3::exceptions::{PyAssertionError, PyIndexError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyTuple;

/// `Name(Base): "doc";` entries: the class, its base and its docstring.
macro_rules! exceptions {
    ($($name:ident($base:ty): $doc:literal;)+) => {
        $(create_exception!(mmpack._native, $name, $base, $doc);)+

        /// The names of the native exception classes, in table order.
        pub const ERROR_NAMES: &[&str] = &[$(stringify!($name)),+];

        pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
            let py = m.py();
            $(m.add(stringify!($name), py.get_type::<$name>())?;)+
            m.add("ERROR_NAMES", PyTuple::new(py, ERROR_NAMES)?)?;
            Ok(())
        }
    };
}

exceptions! {
    // --- shared ---
    MmpackError(PyValueError): "Base class of every mmpack error on bad input (a ValueError); \
        the message names the sample, argument or index at fault.";
    IndexOverflowError(MmpackError): "A length, count, offset or token id does not fit where it \
        must go (int64, int32 cu_seqlens, or memory).";
    // --- PackedTensor ---
    PackedTensorError(MmpackError): "Base class of the PackedTensor errors: row layout, \
        provenance, shards, segments and output buffers.";
    LayoutError(PackedTensorError): "A PackedTensor row mapping breaks a rule: row offsets \
        start at 0, never decrease and end at the number of segment references; segment \
        indices name existing physical segments; one provenance id per physical segment; \
        repeat counts are non-negative.";
    ProvenanceError(LayoutError): "A provenance entry is not a 16-byte id (uuid.uuid4().bytes).";
    ShardError(PackedTensorError): "Rows cannot be split into the requested number of equal \
        shards.";
    // --- packing ---
    PackingError(MmpackError): "Base class of the sequence-packing errors: lengths, bin \
        budgets, bin counts and packing arguments.";
    ItemTooLargeError(PackingError): "An item's length (or media count) exceeds the bin \
        capacity; the message names the item.";
    InvalidLengthError(PackingError): "A length is zero or negative, or a media count is \
        negative; the message names the item.";
    PackingArgumentError(PackingError): "A packing argument is out of range or inconsistent \
        with the others.";
    BinCountError(PackingError): "min_bins / bins_multiple_of ask for more bins than there are \
        items.";
    // --- batch ---
    BatchError(MmpackError): "Base class of the errors of building a packed batch: samples, \
        loss masks, turn markers, media and batch options.";
    LossMaskError(BatchError): "A loss mask breaks a rule: length equals the token count, \
        values only 0 and 1, at least one trainable token when required.";
    MessageSpanError(LossMaskError): "Message / fragment lengths and roles are inconsistent \
        with each other or with the token count.";
    TurnStructureError(BatchError): "Turn markers are missing or not in user/assistant pairs.";
    MissingFieldError(BatchError): "A sample lacks a field its loss-mask mode needs.";
    EmptySampleError(BatchError): "A sample (or a batch) has no tokens.";
    InvalidTokenError(BatchError): "A token id is negative.";
    BatchOptionError(BatchError): "A batch-builder option is out of range or breaks the \
        batch's fields (a negative pad_token_id, an ignore_index that is a token id of the \
        batch, a pack longer than pad_to_length).";
    BatchLayoutError(BatchError): "The fields of a batch disagree with each other (a \
        PackedBatch or PaddedBatch built by hand, or packs that cannot form one micro-batch); \
        the message names the field, the sample and the position.";
}

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
            // --- PackedTensor ---
            CoreError::OffsetsStart
            | CoreError::OffsetsDecreasing { .. }
            | CoreError::OffsetsEnd { .. }
            | CoreError::SegmentIndexOutOfRange { .. }
            | CoreError::ProvenanceLength { .. }
            | CoreError::Repeats { .. } => LayoutError::new_err(msg),
            CoreError::ProvenanceEntry { .. } => ProvenanceError::new_err(msg),
            // NeMo-RL raises the builtins here.
            CoreError::RowOutOfRange { .. } => PyIndexError::new_err(msg),
            CoreError::ConcatIncompatible { .. } | CoreError::FlattenedRows { .. } => {
                PyAssertionError::new_err(msg)
            }
            CoreError::ShardCount { .. } | CoreError::ShardNotDivisible { .. } => {
                ShardError::new_err(msg)
            }
            // Only a wrong call of the private gather functions reaches these.
            CoreError::GatherIndex { .. }
            | CoreError::GatherUneven { .. }
            | CoreError::GatherSize { .. }
            | CoreError::GatherRange { .. } => PackedTensorError::new_err(msg),
            // --- packing ---
            CoreError::ItemTooLarge { .. } => ItemTooLargeError::new_err(msg),
            CoreError::InvalidItem { .. } => InvalidLengthError::new_err(msg),
            CoreError::PackingArgument { .. } => PackingArgumentError::new_err(msg),
            CoreError::BinCount { .. } => BinCountError::new_err(msg),
            // --- batch ---
            CoreError::MaskLength { .. }
            | CoreError::MaskValue { .. }
            | CoreError::MaskNoTrainable { .. } => LossMaskError::new_err(msg),
            CoreError::SpanMismatch { .. } => MessageSpanError::new_err(msg),
            CoreError::TurnMarkers { .. } => TurnStructureError::new_err(msg),
            CoreError::MissingField { .. } => MissingFieldError::new_err(msg),
            CoreError::EmptySample { .. } | CoreError::EmptyBatch => EmptySampleError::new_err(msg),
            CoreError::InvalidToken { .. } => InvalidTokenError::new_err(msg),
            CoreError::BatchOption { .. } => BatchOptionError::new_err(msg),
            CoreError::BatchLayout { .. } => BatchLayoutError::new_err(msg),
        }
    }
}
