//! Typed Python exceptions for `CoreError`. The base `MmpackError` is a `ValueError`.
//! Each area keeps its exceptions, mappings and registrations in its own section.
use mmpack_core::CoreError;
use pyo3::create_exception;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

// --- shared ---
create_exception!(mmpack._native, MmpackError, PyValueError, "Base class of every mmpack error.");
create_exception!(mmpack._native, IndexOverflowError, MmpackError, "Index arithmetic overflowed.");
// --- csr / intern ---
// --- packing ---
// --- mask / batch ---
// --- gather ---

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
            // --- packing ---
            // --- mask / batch ---
            // --- gather ---
        }
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    // --- shared ---
    m.add("MmpackError", py.get_type::<MmpackError>())?;
    m.add("IndexOverflowError", py.get_type::<IndexOverflowError>())?;
    // --- csr / intern ---
    // --- packing ---
    // --- mask / batch ---
    // --- gather ---
    Ok(())
}
