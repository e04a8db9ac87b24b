//! Bindings for `mmpack_core::payload`: one native call measures one `PackedTensor`-like value.
//!
//! The binding only reads each entry of the value's `tensors` (its identity, `id()`, and its
//! `nbytes`); which segments count as physical is decided by the core, against the keys in a
//! `SeenSegments` that the caller keeps for the whole payload.
use std::sync::{Mutex, MutexGuard, PoisonError};

use mmpack_core::payload::{self, Segment};
use numpy::{PyArray1, PyArrayMethods};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};

use crate::errors::PyCoreError;

/// The identities (`id()`) of the physical segments already counted in one payload.
/// `key in seen` and `seen.add(key)` work as on a `set[int]`.
#[pyclass(frozen, module = "mmpack._native")]
pub struct SeenSegments {
    inner: Mutex<payload::SeenSegments>,
}

impl SeenSegments {
    fn lock(&self) -> MutexGuard<'_, payload::SeenSegments> {
        // The set stays consistent even if a holder panicked: each insert is atomic.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[pymethods]
impl SeenSegments {
    /// An empty set.
    #[new]
    fn new() -> Self {
        Self {
            inner: Mutex::new(payload::SeenSegments::new()),
        }
    }

    /// Record `key` as counted.
    fn add(&self, key: usize) {
        self.lock().insert(key);
    }

    fn __contains__(&self, key: usize) -> bool {
        self.lock().contains(key)
    }

    fn __len__(&self) -> usize {
        self.lock().len()
    }
}

/// Bytes and counts of one value's segments (see `measure_segments`).
#[pyclass(frozen, module = "mmpack._native", get_all)]
pub struct SegmentTotals {
    /// Bytes of the segments new to `seen`, each counted once.
    physical_bytes: u64,
    /// The number of segments new to `seen`.
    physical_segments: usize,
    /// Bytes of every segment reference, shared segments once per reference.
    logical_bytes: u64,
    /// The number of segment references that are present.
    logical_segments: usize,
}

/// `payload.measure`'s step for one `PackedTensor`-like value, in one call.
///
/// An entry of `tensors` that is an instance of `array_types` is a segment of `nbytes` bytes
/// named by its `id()`; any other entry (`None` included) is absent. A segment counts as
/// physical only if its `id()` is new to `seen`, which records it. `indices` lists the physical
/// segment of each logical one (`None` for the legacy layout: every entry once).
#[pyfunction]
#[pyo3(name = "measure_segments", signature = (tensors, indices, seen, array_types))]
fn py_measure_segments(
    py: Python<'_>,
    tensors: &Bound<'_, PyList>,
    indices: Option<&Bound<'_, PyArray1<i64>>>,
    seen: &Bound<'_, SeenSegments>,
    array_types: &Bound<'_, PyTuple>,
) -> PyResult<SegmentTotals> {
    let nbytes = intern!(py, "nbytes");
    let mut segments = Vec::with_capacity(tensors.len());
    for item in tensors.iter() {
        if item.is_none() || !item.is_instance(array_types)? {
            segments.push(None);
            continue;
        }
        segments.push(Some(Segment {
            // `id(item)` in CPython
            key: item.as_ptr() as usize,
            nbytes: item.getattr(nbytes)?.extract()?,
        }));
    }
    let indices = indices.map(PyArrayMethods::try_readonly).transpose()?;
    let indices = indices.as_ref().map(|a| a.as_slice()).transpose()?;
    let seen = seen.get();
    let totals = py
        .detach(|| payload::measure(&segments, indices, &mut seen.lock()))
        .map_err(PyCoreError)?;
    Ok(SegmentTotals {
        physical_bytes: totals.physical_bytes,
        physical_segments: totals.physical_segments,
        logical_bytes: totals.logical_bytes,
        logical_segments: totals.logical_segments,
    })
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<SeenSegments>()?;
    m.add_class::<SegmentTotals>()?;
    m.add_function(wrap_pyfunction!(py_measure_segments, m)?)?;
    Ok(())
}
