//! Bindings for `mmpack_core::batch`: one call builds a whole pack, micro-batch or set of
//! padded rows; one call checks a layout built elsewhere.
use mmpack_core::batch::{
    self, BatchOptions, ConcatOptions, MaskMode, PaddedView, SampleRef, ThdView,
};
use mmpack_core::CoreError;
use numpy::{IntoPyArray, PyArray1, PyArray2, PyArrayMethods, PyReadonlyArray1};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::PyBool;

use crate::errors::PyCoreError;
use crate::mask::MaskArr;

/// One pack in Megatron's THD layout (`mmpack_core::batch::ThdLayout`), as numpy arrays.
#[pyclass(frozen, module = "mmpack._native", get_all)]
pub struct ThdLayout {
    input_ids: Py<PyArray1<i64>>,
    labels: Py<PyArray1<i64>>,
    loss_mask: Py<PyArray1<bool>>,
    token_mask: Py<PyArray1<bool>>,
    position_ids: Py<PyArray1<i64>>,
    cu_seqlens: Py<PyArray1<i32>>,
    cu_seqlens_padded: Py<PyArray1<i32>>,
    max_seqlen: usize,
}

impl ThdLayout {
    fn new(py: Python<'_>, out: batch::ThdLayout) -> Self {
        Self {
            input_ids: out.input_ids.into_pyarray(py).unbind(),
            labels: out.labels.into_pyarray(py).unbind(),
            loss_mask: out.loss_mask.into_pyarray(py).unbind(),
            token_mask: out.token_mask.into_pyarray(py).unbind(),
            position_ids: out.position_ids.into_pyarray(py).unbind(),
            cu_seqlens: out.cu_seqlens.into_pyarray(py).unbind(),
            cu_seqlens_padded: out.cu_seqlens_padded.into_pyarray(py).unbind(),
            max_seqlen: out.max_seqlen,
        }
    }
}

/// Padded rows `[rows, width]` (`mmpack_core::batch::PaddedLayout`), as numpy arrays.
#[pyclass(frozen, module = "mmpack._native", get_all)]
pub struct PaddedLayout {
    input_ids: Py<PyArray2<i64>>,
    labels: Py<PyArray2<i64>>,
    loss_mask: Py<PyArray2<bool>>,
    token_mask: Py<PyArray2<bool>>,
    position_ids: Py<PyArray2<i64>>,
    attention_mask: Py<PyArray2<bool>>,
    lengths: Py<PyArray1<i64>>,
}

/// `v` (row-major, `rows * width` values) as a `[rows, width]` array, without a copy.
fn rows_of<'py, T: numpy::Element>(
    py: Python<'py>,
    v: Vec<T>,
    rows: usize,
    width: usize,
) -> PyResult<Py<PyArray2<T>>> {
    Ok(v.into_pyarray(py).reshape([rows, width])?.unbind())
}

/// The per-sample inputs of a build call, borrowed from Python while attached; `refs` views
/// them as core samples (valid while detached).
struct Samples<'py> {
    names: Vec<String>,
    tokens: Vec<PyReadonlyArray1<'py, i64>>,
    masks: Vec<Option<MaskArr<'py>>>,
    message_lengths: Vec<Option<Vec<i64>>>,
    message_roles: Vec<Option<Vec<String>>>,
}

/// A sample's message lengths as int64. A bool is an int to Python, so `[True, True]` would
/// read as two one-token messages: refused, naming the sample.
fn lengths_of(obj: &Bound<'_, PyAny>, sample: &str) -> PyResult<Vec<i64>> {
    let mut out = Vec::with_capacity(obj.len().unwrap_or(0));
    for item in obj.try_iter()? {
        let item = item?;
        if item.is_instance_of::<PyBool>() {
            return Err(PyTypeError::new_err(format!(
                "message_lengths of sample {sample} must be integers, got bool"
            )));
        }
        out.push(item.extract::<i64>()?);
    }
    Ok(out)
}

impl<'py> Samples<'py> {
    fn new(
        names: Vec<String>,
        tokens: &[Bound<'py, PyArray1<i64>>],
        masks: &[Option<Bound<'py, PyAny>>],
        message_lengths: &[Option<Bound<'py, PyAny>>],
        message_roles: Vec<Option<Vec<String>>>,
    ) -> PyResult<Self> {
        let n = names.len();
        if tokens.len() != n
            || masks.len() != n
            || message_lengths.len() != n
            || message_roles.len() != n
        {
            return Err(PyCoreError(CoreError::BatchOption {
                name: "samples",
                detail: "the per-sample lists differ in length".to_owned(),
            })
            .into());
        }
        Ok(Self {
            tokens: tokens
                .iter()
                .map(|t| t.try_readonly())
                .collect::<Result<_, _>>()?,
            masks: masks
                .iter()
                .map(|m| m.as_ref().map(MaskArr::borrow).transpose())
                .collect::<PyResult<_>>()?,
            message_lengths: message_lengths
                .iter()
                .zip(&names)
                .map(|(l, name)| l.as_ref().map(|l| lengths_of(l, name)).transpose())
                .collect::<PyResult<_>>()?,
            names,
            message_roles,
        })
    }

    fn refs(&self) -> PyResult<Vec<SampleRef<'_>>> {
        let per_sample = self
            .names
            .iter()
            .zip(&self.tokens)
            .zip(&self.masks)
            .zip(self.message_lengths.iter().zip(&self.message_roles));
        per_sample
            .map(|(((name, t), m), (l, r))| {
                Ok(SampleRef {
                    name,
                    tokens: t.as_slice()?,
                    mask: m.as_ref().map(MaskArr::view).transpose()?,
                    message_lengths: l.as_deref(),
                    message_roles: r.as_deref(),
                })
            })
            .collect()
    }
}

/// Build one pack. The per-sample lists are parallel (`names[i]` names sample `i` in errors);
/// in precomputed mode `masks` is read, otherwise `message_lengths` and `message_roles`.
#[pyfunction]
#[pyo3(signature = (
    names, tokens, masks, message_lengths, message_roles, *,
    precomputed, train_roles, pad_token_id, pad_to_multiple_of, ignore_index, cp_size,
    pad_to_length
))]
#[allow(clippy::too_many_arguments)]
fn build_pack<'py>(
    py: Python<'py>,
    names: Vec<String>,
    tokens: Vec<Bound<'py, PyArray1<i64>>>,
    masks: Vec<Option<Bound<'py, PyAny>>>,
    message_lengths: Vec<Option<Bound<'py, PyAny>>>,
    message_roles: Vec<Option<Vec<String>>>,
    precomputed: bool,
    train_roles: Vec<String>,
    pad_token_id: i64,
    pad_to_multiple_of: i64,
    ignore_index: i64,
    cp_size: i64,
    pad_to_length: Option<i64>,
) -> PyResult<ThdLayout> {
    let inputs = Samples::new(names, &tokens, &masks, &message_lengths, message_roles)?;
    let samples = inputs.refs()?;
    let opts = BatchOptions {
        mode: mode(precomputed),
        train_roles: &train_roles,
        pad_token_id,
        pad_to_multiple_of,
        ignore_index,
        cp_size,
        pad_to_length,
    };
    // Build (detached), then hand the vectors to numpy without copying.
    let out = py
        .detach(|| batch::build(&samples, &opts))
        .map_err(PyCoreError)?;
    Ok(ThdLayout::new(py, out))
}

/// Build padded rows, one per sample (arguments as `build_pack`; `pad_to_length` is the
/// width of every row).
#[pyfunction]
#[pyo3(signature = (
    names, tokens, masks, message_lengths, message_roles, *,
    precomputed, train_roles, pad_token_id, pad_to_multiple_of, ignore_index, cp_size,
    pad_to_length
))]
#[allow(clippy::too_many_arguments)]
fn build_padded<'py>(
    py: Python<'py>,
    names: Vec<String>,
    tokens: Vec<Bound<'py, PyArray1<i64>>>,
    masks: Vec<Option<Bound<'py, PyAny>>>,
    message_lengths: Vec<Option<Bound<'py, PyAny>>>,
    message_roles: Vec<Option<Vec<String>>>,
    precomputed: bool,
    train_roles: Vec<String>,
    pad_token_id: i64,
    pad_to_multiple_of: i64,
    ignore_index: i64,
    cp_size: i64,
    pad_to_length: Option<i64>,
) -> PyResult<PaddedLayout> {
    let inputs = Samples::new(names, &tokens, &masks, &message_lengths, message_roles)?;
    let samples = inputs.refs()?;
    let opts = BatchOptions {
        mode: mode(precomputed),
        train_roles: &train_roles,
        pad_token_id,
        pad_to_multiple_of,
        ignore_index,
        cp_size,
        pad_to_length,
    };
    let out = py
        .detach(|| batch::build_padded(&samples, &opts))
        .map_err(PyCoreError)?;
    let (r, w) = (out.rows, out.width);
    Ok(PaddedLayout {
        input_ids: rows_of(py, out.input_ids, r, w)?,
        labels: rows_of(py, out.labels, r, w)?,
        loss_mask: rows_of(py, out.loss_mask, r, w)?,
        token_mask: rows_of(py, out.token_mask, r, w)?,
        position_ids: rows_of(py, out.position_ids, r, w)?,
        attention_mask: rows_of(py, out.attention_mask, r, w)?,
        lengths: out.lengths.into_pyarray(py).unbind(),
    })
}

fn mode(precomputed: bool) -> MaskMode {
    if precomputed {
        MaskMode::Precomputed
    } else {
        MaskMode::Derived
    }
}

/// The arrays of one THD layout, borrowed; masks as `uint8` views of bool arrays.
struct ThdArrays<'py> {
    input_ids: PyReadonlyArray1<'py, i64>,
    labels: PyReadonlyArray1<'py, i64>,
    loss_mask: PyReadonlyArray1<'py, u8>,
    token_mask: PyReadonlyArray1<'py, u8>,
    position_ids: PyReadonlyArray1<'py, i64>,
    cu_seqlens: PyReadonlyArray1<'py, i32>,
    cu_seqlens_padded: PyReadonlyArray1<'py, i32>,
    max_seqlen: usize,
}

type ThdArgs<'py> = (
    Bound<'py, PyArray1<i64>>,
    Bound<'py, PyArray1<i64>>,
    Bound<'py, PyArray1<u8>>,
    Bound<'py, PyArray1<u8>>,
    Bound<'py, PyArray1<i64>>,
    Bound<'py, PyArray1<i32>>,
    Bound<'py, PyArray1<i32>>,
    usize,
);

impl<'py> ThdArrays<'py> {
    fn borrow(args: &ThdArgs<'py>) -> PyResult<Self> {
        Ok(Self {
            input_ids: args.0.try_readonly()?,
            labels: args.1.try_readonly()?,
            loss_mask: args.2.try_readonly()?,
            token_mask: args.3.try_readonly()?,
            position_ids: args.4.try_readonly()?,
            cu_seqlens: args.5.try_readonly()?,
            cu_seqlens_padded: args.6.try_readonly()?,
            max_seqlen: args.7,
        })
    }

    fn view(&self) -> PyResult<ThdView<'_>> {
        Ok(ThdView {
            input_ids: self.input_ids.as_slice()?,
            labels: self.labels.as_slice()?,
            loss_mask: self.loss_mask.as_slice()?,
            token_mask: self.token_mask.as_slice()?,
            position_ids: self.position_ids.as_slice()?,
            cu_seqlens: self.cu_seqlens.as_slice()?,
            cu_seqlens_padded: self.cu_seqlens_padded.as_slice()?,
            max_seqlen: self.max_seqlen,
        })
    }
}

/// Check a THD layout: `layout` is `(input_ids, labels, loss_mask, token_mask, position_ids,
/// cu_seqlens, cu_seqlens_padded, max_seqlen)`, the masks as `uint8` views.
#[pyfunction]
#[pyo3(signature = (layout, *, pad_token_id, ignore_index))]
fn check_pack(
    py: Python<'_>,
    layout: ThdArgs<'_>,
    pad_token_id: i64,
    ignore_index: i64,
) -> PyResult<()> {
    let arrays = ThdArrays::borrow(&layout)?;
    let view = arrays.view()?;
    py.detach(|| batch::check_thd(&view, pad_token_id, ignore_index))
        .map_err(PyCoreError)?;
    Ok(())
}

/// Several THD layouts (each as in `check_pack`) as one micro-batch.
#[pyfunction]
#[pyo3(signature = (
    layouts, *, pad_token_id, ignore_index, pad_to_multiple_of, cp_size, pad_to_length
))]
fn concat_packs<'py>(
    py: Python<'py>,
    layouts: Vec<ThdArgs<'py>>,
    pad_token_id: i64,
    ignore_index: i64,
    pad_to_multiple_of: i64,
    cp_size: i64,
    pad_to_length: Option<i64>,
) -> PyResult<ThdLayout> {
    let arrays = layouts
        .iter()
        .map(ThdArrays::borrow)
        .collect::<PyResult<Vec<_>>>()?;
    let views = arrays
        .iter()
        .map(ThdArrays::view)
        .collect::<PyResult<Vec<_>>>()?;
    let multiple = batch::pad_multiple(pad_to_multiple_of, cp_size).map_err(PyCoreError)?;
    let pad_to_length = pad_to_length
        .map(|l| {
            usize::try_from(l)
                .ok()
                .filter(|&l| l >= 1)
                .ok_or_else(|| CoreError::BatchOption {
                    name: "pad_to_length",
                    detail: format!("must be >= 1, got {l}"),
                })
        })
        .transpose()
        .map_err(PyCoreError)?;
    let opts = ConcatOptions {
        pad_token_id,
        ignore_index,
        multiple,
        pad_to_length,
    };
    let out = py
        .detach(|| batch::concat(&views, &opts))
        .map_err(PyCoreError)?;
    Ok(ThdLayout::new(py, out))
}

/// Check padded rows, given flat (row-major) 1-D views of the `[rows, width]` arrays.
#[pyfunction]
#[pyo3(signature = (
    rows, width, input_ids, labels, loss_mask, token_mask, position_ids, attention_mask,
    lengths, *, pad_token_id, ignore_index
))]
#[allow(clippy::too_many_arguments)]
fn check_padded(
    py: Python<'_>,
    rows: usize,
    width: usize,
    input_ids: PyReadonlyArray1<'_, i64>,
    labels: PyReadonlyArray1<'_, i64>,
    loss_mask: PyReadonlyArray1<'_, u8>,
    token_mask: PyReadonlyArray1<'_, u8>,
    position_ids: PyReadonlyArray1<'_, i64>,
    attention_mask: PyReadonlyArray1<'_, u8>,
    lengths: PyReadonlyArray1<'_, i64>,
    pad_token_id: i64,
    ignore_index: i64,
) -> PyResult<()> {
    let view = PaddedView {
        rows,
        width,
        input_ids: input_ids.as_slice()?,
        labels: labels.as_slice()?,
        loss_mask: loss_mask.as_slice()?,
        token_mask: token_mask.as_slice()?,
        position_ids: position_ids.as_slice()?,
        attention_mask: attention_mask.as_slice()?,
        lengths: lengths.as_slice()?,
    };
    py.detach(|| batch::check_padded(&view, pad_token_id, ignore_index))
        .map_err(PyCoreError)?;
    Ok(())
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<ThdLayout>()?;
    m.add_class::<PaddedLayout>()?;
    m.add_function(wrap_pyfunction!(build_pack, m)?)?;
    m.add_function(wrap_pyfunction!(build_padded, m)?)?;
    m.add_function(wrap_pyfunction!(check_pack, m)?)?;
    m.add_function(wrap_pyfunction!(check_padded, m)?)?;
    m.add_function(wrap_pyfunction!(concat_packs, m)?)?;
    Ok(())
}
