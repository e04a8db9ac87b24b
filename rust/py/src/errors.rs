//! The native mmpack exception classes, declared once in `error_table!` below: those the
//! bindings raise, for a `CoreError` variant or from their own checks, and the area bases they
//! subclass. Errors raised only from Python are declared in `python/mmpack/errors.py`, where
//! changing one needs no rebuild; they subclass these classes.
//!
//! Each row gives a class's name, its bases (earlier rows of the table, or builtins such as
//! `ValueError`, or `module.Name`), its area and its docstring. Module init creates the classes
//! in table order with `type(name, bases, namespace)` under `mmpack._native`, so Rust raises any
//! of them (`ErrorClass::X.new_err`) and `mmpack.errors` re-exports them. The table is also
//! exported as data, `_native.ERROR_TABLE`, from which `python -m mmpack_dev.stubgen` writes the
//! native class lists of `mmpack/errors.py` and `_native.pyi`. A user catches a whole area
//! through its base; every class is an `MmpackError`, a `ValueError`.
//!
//! A new native class is one row here, then `make stubs`; a test fails if no Rust code raises a
//! row (or subclasses it). If Rust raises it for a core error, that error is a `CoreError`
//! variant, and the exhaustive match in `From<PyCoreError> for PyErr` names its class.
use mmpack_core::CoreError;
use pyo3::exceptions::{PyAssertionError, PyImportError, PyIndexError, PyRuntimeError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyList, PyTuple, PyType};

const MODULE: &str = "mmpack._native";

/// One row of the error table.
struct ErrorSpec {
    class: ErrorClass,
    name: &'static str,
    /// Names of earlier rows, or builtins: `ValueError` (module `builtins`) or `module.Name`.
    bases: &'static [&'static str],
    area: &'static str,
    doc: &'static str,
}

/// `Name("Base", ...) in "area": "doc";` rows.
macro_rules! error_table {
    ($($name:ident($($base:literal),+) in $area:literal: $doc:literal;)+) => {
        /// Every mmpack exception class, named as in Python, in table order.
        // The variants are the Python class names, which all end in `Error`.
        #[allow(clippy::enum_variant_names)]
        #[derive(Clone, Copy, Debug)]
        pub enum ErrorClass {
            $($name),+
        }

        const ERROR_TABLE: &[ErrorSpec] = &[$(ErrorSpec {
            class: ErrorClass::$name,
            name: stringify!($name),
            bases: &[$($base),+],
            area: $area,
            doc: $doc,
        }),+];
    };
}

error_table! {
    // --- shared ---
    MmpackError("ValueError") in "shared": "Base class of every mmpack error on bad input (a \
        ValueError); the message names the sample, argument or index at fault.";
    IndexOverflowError("MmpackError") in "shared": "A length, count, offset or token id does not \
        fit where it must go (int64, int32 cu_seqlens, or memory).";
    // --- PackedTensor ---
    PackedTensorError("MmpackError") in "PackedTensor": "Base class of the PackedTensor errors: \
        row layout, provenance, shards, segments and output buffers.";
    LayoutError("PackedTensorError") in "PackedTensor": "A PackedTensor row mapping breaks a rule: \
        row offsets start at 0, never decrease and end at the number of segment references; \
        segment indices name existing physical segments; one provenance id per physical segment; \
        repeat counts are non-negative.";
    ProvenanceError("LayoutError") in "PackedTensor": "A provenance entry is not a 16-byte id \
        (uuid.uuid4().bytes).";
    ShardError("PackedTensorError") in "PackedTensor": "Rows cannot be split into the requested \
        number of equal shards.";
    // --- packing ---
    PackingError("MmpackError") in "packing": "Base class of the sequence-packing errors: lengths, \
        bin budgets, bin counts and packing arguments.";
    ItemTooLargeError("PackingError") in "packing": "An item's length (or media count) exceeds the \
        bin capacity; the message names the item.";
    InvalidLengthError("PackingError") in "packing": "A length is zero or negative, or a media \
        count is negative; the message names the item.";
    PackingArgumentError("PackingError") in "packing": "A packing argument is out of range or \
        inconsistent with the others.";
    BinCountError("PackingError") in "packing": "min_bins / bins_multiple_of ask for more bins \
        than there are items.";
    // --- batch ---
    BatchError("MmpackError") in "batch": "Base class of the errors of building a packed batch: \
        samples, loss masks, turn markers, media and batch options.";
    LossMaskError("BatchError") in "batch": "A loss mask breaks a rule: length equals the token \
        count, values only 0 and 1, at least one trainable token when required.";
    MessageSpanError("LossMaskError") in "batch": "Message / fragment lengths and roles are \
        inconsistent with each other or with the token count.";
    TurnStructureError("BatchError") in "batch": "Turn markers are missing or not in \
        user/assistant pairs.";
    MissingFieldError("BatchError") in "batch": "A sample lacks a field its loss-mask mode \
        needs.";
    EmptySampleError("BatchError") in "batch": "A sample (or a batch) has no tokens.";
    InvalidTokenError("BatchError") in "batch": "A token id is negative.";
    BatchOptionError("BatchError") in "batch": "A batch-builder option is out of range or breaks \
        the batch's fields (a negative pad_token_id, an ignore_index that is a token id of the \
        batch, a pack longer than pad_to_length).";
    BatchLayoutError("BatchError") in "batch": "The fields of a batch disagree with each other (a \
        PackedBatch or PaddedBatch built by hand, or packs that cannot form one micro-batch); the \
        message names the field, the sample and the position.";
}

/// The classes made at module init, indexed by `ErrorClass`.
static CLASSES: PyOnceLock<Vec<Py<PyType>>> = PyOnceLock::new();

impl ErrorClass {
    /// The exception of this class with message `msg`.
    pub fn new_err(self, msg: String) -> PyErr {
        Python::attach(
            |py| match CLASSES.get(py).and_then(|c| c.get(self as usize)) {
                Some(class) => PyErr::from_type(class.bind(py).clone(), msg),
                // Only reachable before module init has finished, which raises nothing.
                None => PyRuntimeError::new_err(format!(
                    "{self:?} raised before {MODULE} was initialised: {msg}"
                )),
            },
        )
    }
}

/// A base named in the table: an earlier row's class, or a builtin.
fn resolve_base<'py>(
    py: Python<'py>,
    name: &str,
    made: &[Bound<'py, PyType>],
) -> PyResult<Bound<'py, PyAny>> {
    if let Some(row) = ERROR_TABLE.iter().position(|spec| spec.name == name) {
        return made.get(row).map(|c| c.clone().into_any()).ok_or_else(|| {
            PyImportError::new_err(format!(
                "error table: {name} is used as a base before its row"
            ))
        });
    }
    let (module, attr) = name.rsplit_once('.').unwrap_or(("builtins", name));
    py.import(module)?.getattr(attr)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    let type_type = py.get_type::<PyType>();
    let mut made: Vec<Bound<'_, PyType>> = Vec::with_capacity(ERROR_TABLE.len());
    let rows = PyList::empty(py);
    for (row, spec) in ERROR_TABLE.iter().enumerate() {
        if spec.class as usize != row {
            return Err(PyImportError::new_err(format!(
                "error table: {} is out of order",
                spec.name
            )));
        }
        let bases = spec
            .bases
            .iter()
            .map(|base| resolve_base(py, base, &made))
            .collect::<PyResult<Vec<_>>>()?;
        let namespace = PyDict::new(py);
        namespace.set_item("__doc__", spec.doc)?;
        namespace.set_item("__module__", MODULE)?;
        let class = type_type
            .call1((spec.name, PyTuple::new(py, bases)?, namespace))?
            .cast_into::<PyType>()?;
        m.add(spec.name, &class)?;
        made.push(class);
        rows.append((
            spec.name,
            PyTuple::new(py, spec.bases)?,
            spec.area,
            spec.doc,
        ))?;
    }
    m.add("ERROR_TABLE", PyTuple::new(py, rows)?)?;
    CLASSES
        .set(py, made.into_iter().map(Bound::unbind).collect())
        .map_err(|_| PyImportError::new_err(format!("{MODULE} initialised twice")))
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
        use ErrorClass as E;
        let msg = err.0.to_string();
        match err.0 {
            // --- shared ---
            CoreError::IndexOverflow { .. } | CoreError::RepeatsTooLarge { .. } => {
                E::IndexOverflowError.new_err(msg)
            }
            // --- PackedTensor ---
            CoreError::OffsetsStart
            | CoreError::OffsetsDecreasing { .. }
            | CoreError::OffsetsEnd { .. }
            | CoreError::SegmentIndexOutOfRange { .. }
            | CoreError::ProvenanceLength { .. }
            | CoreError::Repeats { .. } => E::LayoutError.new_err(msg),
            CoreError::ProvenanceEntry { .. } => E::ProvenanceError.new_err(msg),
            // NeMo-RL raises the builtins here.
            CoreError::RowOutOfRange { .. } => PyIndexError::new_err(msg),
            CoreError::ConcatIncompatible { .. } | CoreError::FlattenedRows { .. } => {
                PyAssertionError::new_err(msg)
            }
            CoreError::ShardCount { .. }
            | CoreError::ShardNotDivisible { .. }
            | CoreError::ShardsTooMany { .. } => E::ShardError.new_err(msg),
            // Only a wrong call of the private gather functions reaches these.
            CoreError::GatherIndex { .. }
            | CoreError::GatherUneven { .. }
            | CoreError::GatherSize { .. }
            | CoreError::GatherRange { .. } => E::PackedTensorError.new_err(msg),
            // --- packing ---
            CoreError::ItemTooLarge { .. } => E::ItemTooLargeError.new_err(msg),
            CoreError::InvalidItem { .. } => E::InvalidLengthError.new_err(msg),
            CoreError::PackingArgument { .. } => E::PackingArgumentError.new_err(msg),
            CoreError::BinCount { .. } => E::BinCountError.new_err(msg),
            // --- batch ---
            CoreError::MaskLength { .. }
            | CoreError::MaskValue { .. }
            | CoreError::MaskNoTrainable { .. } => E::LossMaskError.new_err(msg),
            CoreError::SpanMismatch { .. } => E::MessageSpanError.new_err(msg),
            CoreError::TurnMarkers { .. } => E::TurnStructureError.new_err(msg),
            CoreError::MissingField { .. } => E::MissingFieldError.new_err(msg),
            CoreError::EmptySample { .. } | CoreError::EmptyBatch => {
                E::EmptySampleError.new_err(msg)
            }
            CoreError::InvalidToken { .. } => E::InvalidTokenError.new_err(msg),
            CoreError::BatchOption { .. } => E::BatchOptionError.new_err(msg),
            CoreError::BatchLayout { .. } => E::BatchLayoutError.new_err(msg),
        }
    }
}
