//! Bindings for `mmpack_core::batch`: one call builds a whole pack, micro-batch or set of
//! padded rows from the samples and one `BatchOptions`; one call checks a layout built
//! elsewhere.
use mmpack_core::batch::{self, MaskMode, PaddedView, SampleRef, ThdView};
use mmpack_core::CoreError;
use numpy::{
    IntoPyArray, PyArray1, PyArray2, PyArrayMethods, PyReadonlyArray1, PyReadonlyArray2,
    PyUntypedArrayMethods,
};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::PyBool;
use pyo3::{intern, PyTypeInfo};

use crate::errors::PyCoreError;
use crate::mask::MaskArr;

/// Batch options (mmpack_core::batch::BatchOptions), checked when made: every build_pack,
/// build_padded and concat_packs call reads one.
#[pyclass(frozen, module = "mmpack._native", name = "BatchOptions")]
pub struct Options {
    inner: batch::BatchOptions,
}

#[pymethods]
impl Options {
    #[new]
    #[pyo3(signature = (
        *, precomputed, train_roles, pad_token_id, pad_to_multiple_of, ignore_index, cp_size,
        pad_to_length
    ))]
    fn py_new(
        precomputed: bool,
        train_roles: Vec<String>,
        pad_token_id: i64,
        pad_to_multiple_of: i64,
        ignore_index: i64,
        cp_size: i64,
        pad_to_length: Option<i64>,
    ) -> PyResult<Self> {
        let inner = batch::BatchOptions {
            mode: if precomputed {
                MaskMode::Precomputed
            } else {
                MaskMode::Derived
            },
            train_roles,
            pad_token_id,
            pad_to_multiple_of,
            ignore_index,
            cp_size,
            pad_to_length,
        };
        inner.validate().map_err(PyCoreError)?;
        Ok(Self { inner })
    }

    /// Whether each sample's own loss mask is used (else it is derived from roles).
    #[getter]
    fn precomputed(&self) -> bool {
        self.inner.mode == MaskMode::Precomputed
    }

    /// Roles whose messages are trained on.
    #[getter]
    fn train_roles(&self) -> Vec<String> {
        self.inner.train_roles.clone()
    }

    /// The token id of the padding.
    #[getter]
    fn pad_token_id(&self) -> i64 {
        self.inner.pad_token_id
    }

    /// Every sample is padded to a multiple of this.
    #[getter]
    fn pad_to_multiple_of(&self) -> i64 {
        self.inner.pad_to_multiple_of
    }

    /// The label of every position that is not trained on.
    #[getter]
    fn ignore_index(&self) -> i64 {
        self.inner.ignore_index
    }

    /// Context-parallel ranks: samples are also padded to a multiple of 2 * cp_size.
    #[getter]
    fn cp_size(&self) -> i64 {
        self.inner.cp_size
    }

    /// The total length of a pack, or the width of every padded row; None: as short as the
    /// samples allow.
    #[getter]
    fn pad_to_length(&self) -> Option<i64> {
        self.inner.pad_to_length
    }
}

/// One pack in Megatron's THD layout (mmpack_core::batch::ThdLayout), as numpy arrays: built
/// by build_pack and concat_packs, or made from a batch's fields for check_pack.
#[pyclass(frozen, module = "mmpack._native", get_all)]
pub struct ThdLayout {
    /// The tokens, pad_token_id on padding: int64 [T].
    input_ids: Py<PyArray1<i64>>,
    /// Shifted labels, ignore_index where nothing is trained: int64 [T].
    labels: Py<PyArray1<i64>>,
    /// Aligned with labels: the label at each position is trained on: bool [T].
    loss_mask: Py<PyArray1<bool>>,
    /// Aligned with input_ids: the token at each position is trainable: bool [T].
    token_mask: Py<PyArray1<bool>>,
    /// Positions, restarting at 0 per sample: int64 [T].
    position_ids: Py<PyArray1<i64>>,
    /// Sample offsets without padding: int32 [n + 1].
    cu_seqlens: Py<PyArray1<i32>>,
    /// Sample offsets with padding: int32 [n + 1].
    cu_seqlens_padded: Py<PyArray1<i32>>,
    /// The longest padded sample.
    max_seqlen: usize,
}

#[pymethods]
impl ThdLayout {
    #[new]
    #[pyo3(signature = (
        *, input_ids, labels, loss_mask, token_mask, position_ids, cu_seqlens,
        cu_seqlens_padded, max_seqlen
    ))]
    #[allow(clippy::too_many_arguments)]
    fn py_new(
        input_ids: Py<PyArray1<i64>>,
        labels: Py<PyArray1<i64>>,
        loss_mask: Py<PyArray1<bool>>,
        token_mask: Py<PyArray1<bool>>,
        position_ids: Py<PyArray1<i64>>,
        cu_seqlens: Py<PyArray1<i32>>,
        cu_seqlens_padded: Py<PyArray1<i32>>,
        max_seqlen: usize,
    ) -> Self {
        Self {
            input_ids,
            labels,
            loss_mask,
            token_mask,
            position_ids,
            cu_seqlens,
            cu_seqlens_padded,
            max_seqlen,
        }
    }
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

/// Padded rows [rows, width] (mmpack_core::batch::PaddedLayout), as numpy arrays: built by
/// build_padded, or made from a batch's fields for check_padded.
#[pyclass(frozen, module = "mmpack._native", get_all)]
pub struct PaddedLayout {
    /// The tokens, pad_token_id on padding: int64 [rows, width].
    input_ids: Py<PyArray2<i64>>,
    /// Shifted labels, ignore_index where nothing is trained: int64 [rows, width].
    labels: Py<PyArray2<i64>>,
    /// Aligned with labels: the label at each position is trained on: bool [rows, width].
    loss_mask: Py<PyArray2<bool>>,
    /// Aligned with input_ids: the token at each position is trainable: bool [rows, width].
    token_mask: Py<PyArray2<bool>>,
    /// Positions, restarting at 0 in every row: int64 [rows, width].
    position_ids: Py<PyArray2<i64>>,
    /// Position < the row's length: bool [rows, width].
    attention_mask: Py<PyArray2<bool>>,
    /// Tokens per row: int64 [rows].
    lengths: Py<PyArray1<i64>>,
}

#[pymethods]
impl PaddedLayout {
    #[new]
    #[pyo3(signature = (
        *, input_ids, labels, loss_mask, token_mask, position_ids, attention_mask, lengths
    ))]
    fn py_new(
        input_ids: Py<PyArray2<i64>>,
        labels: Py<PyArray2<i64>>,
        loss_mask: Py<PyArray2<bool>>,
        token_mask: Py<PyArray2<bool>>,
        position_ids: Py<PyArray2<i64>>,
        attention_mask: Py<PyArray2<bool>>,
        lengths: Py<PyArray1<i64>>,
    ) -> Self {
        Self {
            input_ids,
            labels,
            loss_mask,
            token_mask,
            position_ids,
            attention_mask,
            lengths,
        }
    }
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

/// The samples of a build call, one list per field (`names[i]` names sample `i` in errors),
/// read from a dict with these keys. Columns rather than one tuple per sample: building a
/// tuple per sample in Python costs more than the lists.
#[derive(FromPyObject)]
#[pyo3(from_item_all)]
struct SampleColumns<'py> {
    names: Vec<String>,
    tokens: Vec<Bound<'py, PyArray1<i64>>>,
    masks: Vec<Option<Bound<'py, PyAny>>>,
    message_lengths: Vec<Option<Bound<'py, PyAny>>>,
    message_roles: Vec<Option<Vec<String>>>,
}

/// The samples of a build call, borrowed from Python while attached; `refs` views them as
/// core samples (valid while detached). A sample's mask is read in precomputed mode, its
/// messages otherwise.
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
    fn new(columns: SampleColumns<'py>) -> PyResult<Self> {
        let n = columns.names.len();
        if columns.tokens.len() != n
            || columns.masks.len() != n
            || columns.message_lengths.len() != n
            || columns.message_roles.len() != n
        {
            return Err(PyCoreError(CoreError::BatchOption {
                name: "samples",
                detail: "the per-sample lists differ in length".to_owned(),
            })
            .into());
        }
        Ok(Self {
            tokens: columns
                .tokens
                .iter()
                .map(|t| t.try_readonly())
                .collect::<Result<_, _>>()?,
            masks: columns
                .masks
                .iter()
                .map(|m| m.as_ref().map(MaskArr::borrow).transpose())
                .collect::<PyResult<_>>()?,
            message_lengths: columns
                .message_lengths
                .iter()
                .zip(&columns.names)
                .map(|(l, name)| l.as_ref().map(|l| lengths_of(l, name)).transpose())
                .collect::<PyResult<_>>()?,
            names: columns.names,
            message_roles: columns.message_roles,
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

/// Build one pack. samples: a dict of parallel lists, names, tokens, masks, message_lengths
/// and message_roles (masks are read in precomputed mode, the messages otherwise).
#[pyfunction]
fn build_pack<'py>(
    py: Python<'py>,
    samples: SampleColumns<'py>,
    options: &Options,
) -> PyResult<ThdLayout> {
    let inputs = Samples::new(samples)?;
    let refs = inputs.refs()?;
    // Build (detached), then hand the vectors to numpy without copying.
    let out = py
        .detach(|| batch::build(&refs, &options.inner))
        .map_err(PyCoreError)?;
    Ok(ThdLayout::new(py, out))
}

/// Build padded rows, one per sample (arguments as build_pack; pad_to_length is the width of
/// every row).
#[pyfunction]
fn build_padded<'py>(
    py: Python<'py>,
    samples: SampleColumns<'py>,
    options: &Options,
) -> PyResult<PaddedLayout> {
    let inputs = Samples::new(samples)?;
    let refs = inputs.refs()?;
    let out = py
        .detach(|| batch::build_padded(&refs, &options.inner))
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

/// A bool array as a `uint8` view of its bytes: numpy can hold bytes other than 0 and 1 in a
/// bool array, which a `&[bool]` must never see (the checks report them instead).
fn bytes_of<'py, A: PyTypeInfo>(array: &Bound<'py, PyAny>) -> PyResult<Bound<'py, A>> {
    let py = array.py();
    Ok(array
        .call_method1(intern!(py, "view"), (intern!(py, "uint8"),))?
        .cast_into::<A>()?)
}

/// The arrays of one THD layout, borrowed; masks as `uint8` views.
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

impl<'py> ThdArrays<'py> {
    fn borrow(layout: &Bound<'py, ThdLayout>) -> PyResult<Self> {
        let py = layout.py();
        let l = layout.get();
        Ok(Self {
            input_ids: l.input_ids.bind(py).try_readonly()?,
            labels: l.labels.bind(py).try_readonly()?,
            loss_mask: bytes_of::<PyArray1<u8>>(l.loss_mask.bind(py).as_any())?.try_readonly()?,
            token_mask: bytes_of::<PyArray1<u8>>(l.token_mask.bind(py).as_any())?.try_readonly()?,
            position_ids: l.position_ids.bind(py).try_readonly()?,
            cu_seqlens: l.cu_seqlens.bind(py).try_readonly()?,
            cu_seqlens_padded: l.cu_seqlens_padded.bind(py).try_readonly()?,
            max_seqlen: l.max_seqlen,
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

/// Check a THD layout: every field against the others, pad_token_id and ignore_index.
#[pyfunction]
#[pyo3(signature = (layout, *, pad_token_id, ignore_index))]
fn check_pack(
    py: Python<'_>,
    layout: &Bound<'_, ThdLayout>,
    pad_token_id: i64,
    ignore_index: i64,
) -> PyResult<()> {
    let arrays = ThdArrays::borrow(layout)?;
    let view = arrays.view()?;
    py.detach(|| batch::check_thd(&view, pad_token_id, ignore_index))
        .map_err(PyCoreError)?;
    Ok(())
}

/// Several THD layouts as one micro-batch; each is checked against options (its
/// pad_token_id, ignore_index and padding multiple), whose pad_to_length is the total.
#[pyfunction]
fn concat_packs<'py>(
    py: Python<'py>,
    layouts: Vec<Bound<'py, ThdLayout>>,
    options: &Options,
) -> PyResult<ThdLayout> {
    let arrays = layouts
        .iter()
        .map(ThdArrays::borrow)
        .collect::<PyResult<Vec<_>>>()?;
    let views = arrays
        .iter()
        .map(ThdArrays::view)
        .collect::<PyResult<Vec<_>>>()?;
    let out = py
        .detach(|| batch::concat(&views, &options.inner))
        .map_err(PyCoreError)?;
    Ok(ThdLayout::new(py, out))
}

/// Row-major slices of `[rows, width]` arrays: any other memory order is a `TypeError` (a
/// Fortran-ordered array is contiguous too, but read flat its rows would be its columns).
fn flat<'a, T: numpy::Element>(a: &'a PyReadonlyArray2<'_, T>) -> PyResult<&'a [T]> {
    if !a.as_array().is_standard_layout() {
        return Err(PyTypeError::new_err(
            "padded rows must be C-contiguous (row-major) arrays; use np.ascontiguousarray",
        ));
    }
    Ok(a.as_slice()?)
}

/// Check padded rows: every field against the others, pad_token_id and ignore_index.
#[pyfunction]
#[pyo3(signature = (layout, *, pad_token_id, ignore_index))]
fn check_padded(
    py: Python<'_>,
    layout: &Bound<'_, PaddedLayout>,
    pad_token_id: i64,
    ignore_index: i64,
) -> PyResult<()> {
    let l = layout.get();
    let input_ids = l.input_ids.bind(py).try_readonly()?;
    let labels = l.labels.bind(py).try_readonly()?;
    let loss_mask = bytes_of::<PyArray2<u8>>(l.loss_mask.bind(py).as_any())?.try_readonly()?;
    let token_mask = bytes_of::<PyArray2<u8>>(l.token_mask.bind(py).as_any())?.try_readonly()?;
    let position_ids = l.position_ids.bind(py).try_readonly()?;
    let attention_mask =
        bytes_of::<PyArray2<u8>>(l.attention_mask.bind(py).as_any())?.try_readonly()?;
    let lengths = l.lengths.bind(py).try_readonly()?;
    let (rows, width) = match input_ids.shape() {
        &[rows, width] => (rows, width),
        _ => (0, 0),
    };
    let view = PaddedView {
        rows,
        width,
        input_ids: flat(&input_ids)?,
        labels: flat(&labels)?,
        loss_mask: flat(&loss_mask)?,
        token_mask: flat(&token_mask)?,
        position_ids: flat(&position_ids)?,
        attention_mask: flat(&attention_mask)?,
        lengths: lengths.as_slice()?,
    };
    py.detach(|| batch::check_padded(&view, pad_token_id, ignore_index))
        .map_err(PyCoreError)?;
    Ok(())
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Options>()?;
    m.add_class::<ThdLayout>()?;
    m.add_class::<PaddedLayout>()?;
    m.add_function(wrap_pyfunction!(build_pack, m)?)?;
    m.add_function(wrap_pyfunction!(build_padded, m)?)?;
    m.add_function(wrap_pyfunction!(check_pack, m)?)?;
    m.add_function(wrap_pyfunction!(check_padded, m)?)?;
    m.add_function(wrap_pyfunction!(concat_packs, m)?)?;
    Ok(())
}
