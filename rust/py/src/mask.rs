//! Bindings for `mmpack_core::mask`: loss-mask validation, derivation and turn spans.
use mmpack_core::mask::{self, MaskView};
use numpy::{IntoPyArray, PyArray1, PyArrayMethods, PyReadonlyArray1};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;

use crate::errors::PyCoreError;

/// A read-only borrow of a 1-D mask array in one of the dtypes the core reads directly.
/// Bool masks arrive as `uint8` views (`mmpack.masks.bools_as_bytes`): numpy can hold bytes
/// other than 0 and 1 in a bool array, which a `&[bool]` must never see.
pub enum MaskArr<'py> {
    U8(PyReadonlyArray1<'py, u8>),
    I8(PyReadonlyArray1<'py, i8>),
    I32(PyReadonlyArray1<'py, i32>),
    I64(PyReadonlyArray1<'py, i64>),
    F32(PyReadonlyArray1<'py, f32>),
    F64(PyReadonlyArray1<'py, f64>),
}

impl<'py> MaskArr<'py> {
    /// Borrow `obj`, a 1-D numpy array of uint8, int8, int32, int64, float32 or float64 (the
    /// Python layer converts other dtypes). Anything else is a `TypeError`.
    pub fn borrow(obj: &Bound<'py, PyAny>) -> PyResult<Self> {
        if let Ok(a) = obj.cast::<PyArray1<u8>>() {
            return Ok(Self::U8(a.try_readonly()?));
        }
        if let Ok(a) = obj.cast::<PyArray1<i8>>() {
            return Ok(Self::I8(a.try_readonly()?));
        }
        if let Ok(a) = obj.cast::<PyArray1<i32>>() {
            return Ok(Self::I32(a.try_readonly()?));
        }
        if let Ok(a) = obj.cast::<PyArray1<i64>>() {
            return Ok(Self::I64(a.try_readonly()?));
        }
        if let Ok(a) = obj.cast::<PyArray1<f32>>() {
            return Ok(Self::F32(a.try_readonly()?));
        }
        if let Ok(a) = obj.cast::<PyArray1<f64>>() {
            return Ok(Self::F64(a.try_readonly()?));
        }
        Err(PyTypeError::new_err(
            "a loss mask must be a 1-D numpy array of uint8 (bool masks as uint8 views), int8, \
             int32, int64, float32 or float64",
        ))
    }

    /// The borrowed slice; a non-contiguous array is a `TypeError`.
    pub fn view(&self) -> PyResult<MaskView<'_>> {
        Ok(match self {
            Self::U8(a) => MaskView::U8(a.as_slice()?),
            Self::I8(a) => MaskView::I8(a.as_slice()?),
            Self::I32(a) => MaskView::I32(a.as_slice()?),
            Self::I64(a) => MaskView::I64(a.as_slice()?),
            Self::F32(a) => MaskView::F32(a.as_slice()?),
            Self::F64(a) => MaskView::F64(a.as_slice()?),
        })
    }
}

/// Validate one loss mask (length, values in {0, 1}, optionally one trainable token).
#[pyfunction]
#[pyo3(signature = (mask, num_tokens, require_trainable, sample))]
fn validate_mask(
    py: Python<'_>,
    mask: &Bound<'_, PyAny>,
    num_tokens: usize,
    require_trainable: bool,
    sample: &str,
) -> PyResult<()> {
    let arr = MaskArr::borrow(mask)?;
    let view = arr.view()?;
    py.detach(|| mask::validate(view, num_tokens, require_trainable, sample))
        .map_err(PyCoreError)?;
    Ok(())
}

/// Mask from message lengths and roles (roles in `train_roles` are trained on).
#[pyfunction]
#[pyo3(signature = (lengths, roles, train_roles, num_tokens, sample))]
fn mask_from_roles<'py>(
    py: Python<'py>,
    lengths: &Bound<'py, PyArray1<i64>>,
    roles: Vec<String>,
    train_roles: Vec<String>,
    num_tokens: Option<usize>,
    sample: &str,
) -> PyResult<Bound<'py, PyArray1<bool>>> {
    let lengths = lengths.try_readonly()?;
    let lengths = lengths.as_slice()?;
    let out = py
        .detach(|| mask::from_roles(lengths, &roles, &train_roles, num_tokens, sample))
        .map_err(PyCoreError)?;
    Ok(out.into_pyarray(py))
}

/// Mask from fragment lengths and per-fragment trainable flags.
#[pyfunction]
#[pyo3(signature = (lengths, trainable, num_tokens, sample))]
fn mask_from_fragments<'py>(
    py: Python<'py>,
    lengths: &Bound<'py, PyArray1<i64>>,
    trainable: &Bound<'py, PyArray1<bool>>,
    num_tokens: Option<usize>,
    sample: &str,
) -> PyResult<Bound<'py, PyArray1<bool>>> {
    let lengths = lengths.try_readonly()?;
    let lengths = lengths.as_slice()?;
    let trainable = trainable.try_readonly()?;
    let trainable = trainable.as_slice()?;
    let out = py
        .detach(|| {
            let mut out = Vec::new();
            mask::extend_from_spans(lengths, trainable, num_tokens, sample, "fragment", &mut out)
                .map(|()| out)
        })
        .map_err(PyCoreError)?;
    Ok(out.into_pyarray(py))
}

/// Turn spans from marker tokens, flat: four entries per user/assistant pair.
#[pyfunction]
#[pyo3(signature = (token_ids, markers, sample))]
fn turn_spans<'py>(
    py: Python<'py>,
    token_ids: &Bound<'py, PyArray1<i64>>,
    markers: &Bound<'py, PyArray1<i64>>,
    sample: &str,
) -> PyResult<Bound<'py, PyArray1<i64>>> {
    let token_ids = token_ids.try_readonly()?;
    let token_ids = token_ids.as_slice()?;
    let markers = markers.try_readonly()?;
    let markers = markers.as_slice()?;
    let spans = py
        .detach(|| mask::turn_spans(token_ids, markers, sample))
        .map_err(PyCoreError)?;
    // Positions in `token_ids`, which is held in memory: they fit in int64.
    let flat: Vec<i64> = spans
        .iter()
        .flatten()
        .map(|&v| i64::try_from(v).unwrap_or(i64::MAX))
        .collect();
    Ok(flat.into_pyarray(py))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(validate_mask, m)?)?;
    m.add_function(wrap_pyfunction!(mask_from_roles, m)?)?;
    m.add_function(wrap_pyfunction!(mask_from_fragments, m)?)?;
    m.add_function(wrap_pyfunction!(turn_spans, m)?)?;
    Ok(())
}
