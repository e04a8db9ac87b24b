//! Bindings for `PackedTensor`'s row mapping and provenance (`mmpack_core::csr`).
//!
//! `PackedLayout` is an immutable handle: every operation returns a new one, so Python values
//! may share a handle (deepcopy of a dedup value is a new wrapper around the same handle).
//! Operations that select or merge physical segments also take the value's `tensors` list and
//! return the output list, built here while attached, so the Python layer does no per-segment
//! work. O(n) core work runs with the GIL released.
use mmpack_core::csr::{self, ConcatInput, ConcatMode, ConcatOutcome, PackedLayout, Selection};
use mmpack_core::intern::{self, prov_to_bytes, ProvId};
use mmpack_core::{alloc, CoreError};
use numpy::{IntoPyArray, PyArray1, PyArrayMethods};
use pyo3::exceptions::{PyAttributeError, PyTypeError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyString, PyTuple};

use crate::errors::PyCoreError;

/// What one shard costs as Python objects, at least (about 0.3 KiB traced by `tracemalloc`, plus
/// the native layout), rounded up.
const SHARD_OBJECT_BYTES: usize = 1024;

/// The row mapping and provenance of one `PackedTensor` (never the tensors themselves).
#[pyclass(frozen, module = "mmpack._native", name = "PackedLayout")]
pub struct PyPackedLayout {
    inner: PackedLayout,
}

fn layout_obj(py: Python<'_>, inner: PackedLayout) -> PyResult<Bound<'_, PyPackedLayout>> {
    Bound::new(py, PyPackedLayout { inner })
}

fn type_name(value: &Bound<'_, PyAny>) -> String {
    value
        .get_type()
        .name()
        .map_or_else(|_| "?".to_owned(), |n| n.to_string())
}

/// Provenance ids from a sequence of 16-byte `bytes` (NeMo-RL's list form).
fn parse_provenance(seq: &Bound<'_, PyAny>) -> PyResult<Vec<ProvId>> {
    let mut out = Vec::with_capacity(seq.len().unwrap_or(0));
    for (at, item) in seq.try_iter()?.enumerate() {
        let item = item?;
        let bytes = item.cast::<PyBytes>().map_err(|_| {
            PyTypeError::new_err(format!(
                "_segment_provenance entry {at} must be bytes (uuid.uuid4().bytes), got {}",
                type_name(&item)
            ))
        })?;
        out.push(intern::parse_id(at, bytes.as_bytes()).map_err(PyCoreError)?);
    }
    Ok(out)
}

fn prov_list<'py>(py: Python<'py>, ids: &[ProvId]) -> PyResult<Bound<'py, PyList>> {
    PyList::new(
        py,
        ids.iter().map(|&id| PyBytes::new(py, &prov_to_bytes(id))),
    )
}

fn list_items<'py>(tensors: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyList>> {
    match tensors.cast::<PyList>() {
        Ok(l) => Ok(l.clone()),
        Err(_) => PyList::new(
            tensors.py(),
            tensors.try_iter()?.collect::<PyResult<Vec<_>>>()?,
        ),
    }
}

/// The output list `[tensors[s] for s in physical]`.
fn pick<'py>(tensors: &Bound<'py, PyList>, physical: &[usize]) -> PyResult<Bound<'py, PyList>> {
    let items = physical
        .iter()
        .map(|&s| tensors.get_item(s))
        .collect::<PyResult<Vec<_>>>()?;
    PyList::new(tensors.py(), items)
}

fn selection_out<'py>(
    py: Python<'py>,
    tensors: &Bound<'py, PyList>,
    sel: Selection,
) -> PyResult<Bound<'py, PyTuple>> {
    let list = pick(tensors, &sel.physical)?;
    let lay = layout_obj(py, sel.layout)?;
    PyTuple::new(py, [lay.into_any(), list.into_any()])
}

#[pymethods]
impl PyPackedLayout {
    /// Build and validate a layout with NeMo-RL's constructor rules and order. `provenance` is
    /// a sequence of 16-byte `bytes`; `provenance_blob` is the same ids as one `bytes`.
    #[staticmethod]
    #[pyo3(signature = (n_physical, offsets=None, indices=None, provenance=None, provenance_blob=None))]
    fn build(
        py: Python<'_>,
        n_physical: usize,
        offsets: Option<&Bound<'_, PyArray1<i64>>>,
        indices: Option<&Bound<'_, PyArray1<i64>>>,
        provenance: Option<&Bound<'_, PyAny>>,
        provenance_blob: Option<&Bound<'_, PyBytes>>,
    ) -> PyResult<Self> {
        let layout = match (offsets, indices) {
            (Some(o), Some(i)) => {
                let (o, i) = (o.try_readonly()?, i.try_readonly()?);
                let (o, i) = (o.as_slice()?, i.as_slice()?);
                py.detach(|| {
                    // Offsets may come from a count (`empty_rows_like`), not from held data.
                    let refused = || CoreError::IndexOverflow {
                        what: "the row layout (it cannot be allocated)",
                    };
                    let (o, i) = (
                        alloc::try_to_vec(o, refused)?,
                        alloc::try_to_vec(i, refused)?,
                    );
                    PackedLayout::from_csr(o, i, n_physical)
                })
                .map_err(PyCoreError)?
            }
            (None, None) => PackedLayout::legacy(n_physical),
            _ => {
                return Err(PyValueError::new_err(
                    "_row_offsets and _segment_indices must either both be set or both be None",
                ))
            }
        };
        let provenance = match (provenance, provenance_blob) {
            (Some(seq), _) => {
                // The length first, as NeMo-RL checks it, then each entry.
                csr::validate_provenance_len(seq.len()?, n_physical).map_err(PyCoreError)?;
                Some(parse_provenance(seq)?)
            }
            (None, Some(blob)) => Some(intern::decode_blob(blob.as_bytes()).map_err(PyCoreError)?),
            (None, None) => None,
        };
        Ok(Self {
            inner: layout.with_provenance(provenance).map_err(PyCoreError)?,
        })
    }

    /// The legacy layout over `n_physical` segments with freshly minted provenance.
    #[staticmethod]
    fn legacy_dedup(n_physical: usize) -> PyResult<Self> {
        Ok(Self {
            inner: PackedLayout::legacy_dedup(n_physical).map_err(PyCoreError)?,
        })
    }

    /// `n` fresh provenance ids (uuid4 bytes), unique within the process.
    #[staticmethod]
    fn mint<'py>(py: Python<'py>, n: usize) -> PyResult<Bound<'py, PyList>> {
        let ids = intern::mint(n).map_err(PyCoreError)?;
        prov_list(py, &ids)
    }

    /// The number of rows.
    #[getter]
    fn num_rows(&self) -> usize {
        self.inner.rows()
    }

    /// The number of physical segments the rows refer to.
    #[getter]
    fn n_physical(&self) -> usize {
        self.inner.n_physical()
    }

    /// Whether rows are mapped by offsets and indices (False for the legacy layout: one
    /// segment per row).
    #[getter]
    fn is_csr(&self) -> bool {
        self.inner.is_csr()
    }

    /// Whether every physical segment carries a provenance id.
    #[getter]
    fn has_provenance(&self) -> bool {
        self.inner.provenance().is_some()
    }

    /// Row offsets as a new int64 array, or None for the legacy layout.
    fn offsets<'py>(&self, py: Python<'py>) -> Option<Bound<'py, PyArray1<i64>>> {
        self.inner
            .csr()
            .map(|c| PyArray1::from_slice(py, c.offsets()))
    }

    /// Segment indices as a new int64 array, or None for the legacy layout.
    fn indices<'py>(&self, py: Python<'py>) -> Option<Bound<'py, PyArray1<i64>>> {
        self.inner
            .csr()
            .map(|c| PyArray1::from_slice(py, c.indices()))
    }

    /// Row offsets as a new `list[int]`, or None.
    fn offsets_list<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyList>>> {
        self.inner
            .csr()
            .map(|c| PyList::new(py, c.offsets()))
            .transpose()
    }

    /// Segment indices as a new `list[int]`, or None.
    fn indices_list<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyList>>> {
        self.inner
            .csr()
            .map(|c| PyList::new(py, c.indices()))
            .transpose()
    }

    /// Provenance as a new `list[bytes]`, or None.
    fn provenance_list<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyList>>> {
        self.inner
            .provenance()
            .map(|p| prov_list(py, p))
            .transpose()
    }

    /// Provenance as one `bytes` of 16 bytes per segment, or None.
    fn provenance_blob<'py>(&self, py: Python<'py>) -> Option<Bound<'py, PyBytes>> {
        self.inner
            .provenance()
            .map(|p| PyBytes::new(py, &intern::encode_blob(p)))
    }

    /// The same layout with other provenance (a sequence of bytes) or none.
    #[pyo3(signature = (provenance))]
    fn with_provenance(&self, provenance: Option<&Bound<'_, PyAny>>) -> PyResult<Self> {
        let provenance = match provenance {
            Some(seq) => {
                csr::validate_provenance_len(seq.len()?, self.inner.n_physical())
                    .map_err(PyCoreError)?;
                Some(parse_provenance(seq)?)
            }
            None => None,
        };
        let inner = self.inner.clone().with_provenance(provenance);
        Ok(Self {
            inner: inner.map_err(PyCoreError)?,
        })
    }

    /// The same mapping with fresh provenance for every segment, if it had provenance.
    fn reminted(&self) -> PyResult<Self> {
        Ok(Self {
            inner: self.inner.reminted().map_err(PyCoreError)?,
        })
    }

    /// Per row, the number of referenced physical segments that are not None.
    fn counts<'py>(
        &self,
        py: Python<'py>,
        tensors: &Bound<'py, PyList>,
    ) -> PyResult<Bound<'py, PyList>> {
        let is_none: Vec<bool> = tensors.iter().map(|t| t.is_none()).collect();
        let inner = &self.inner;
        let counts = py
            .detach(|| inner.logical_counts(&is_none))
            .map_err(PyCoreError)?;
        PyList::new(py, counts)
    }

    /// `[0 if t is None else 1 for t in tensors]` (segment counts of the legacy layout).
    #[staticmethod]
    fn presence<'py>(
        py: Python<'py>,
        tensors: &Bound<'py, PyList>,
    ) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, tensors.iter().map(|t| i64::from(!t.is_none())))
    }

    /// Logical references per physical segment, as int64 (`n_physical` entries).
    fn reference_counts<'py>(
        &self,
        py: Python<'py>,
        n_physical: usize,
    ) -> PyResult<Bound<'py, PyArray1<i64>>> {
        let inner = &self.inner;
        let counts = py
            .detach(|| inner.reference_counts(n_physical))
            .map_err(PyCoreError)?;
        // A count is at most the number of references, which fits in int64.
        let counts: Vec<i64> = counts
            .into_iter()
            .map(|c| i64::try_from(c).unwrap_or(i64::MAX))
            .collect();
        Ok(counts.into_pyarray(py))
    }

    /// Total logical bytes given each physical segment's bytes.
    fn logical_nbytes(&self, py: Python<'_>, nbytes: Vec<u64>) -> PyResult<u64> {
        let inner = &self.inner;
        Ok(py
            .detach(|| inner.logical_nbytes(&nbytes))
            .map_err(PyCoreError)?)
    }

    /// Select rows (negatives count from the end): `(layout, tensors)`, compacted. `rows` is
    /// an int64 array or a list of ints (`TypeError` for other items, `OverflowError` for
    /// ints beyond int64).
    fn slice<'py>(
        &self,
        py: Python<'py>,
        tensors: &Bound<'py, PyList>,
        rows: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyTuple>> {
        let inner = &self.inner;
        let sel = if let Ok(arr) = rows.cast::<PyArray1<i64>>() {
            let arr = arr.try_readonly()?;
            let rows = arr.as_slice()?;
            py.detach(|| inner.slice(rows))
        } else {
            let rows: Vec<i64> = rows.cast::<PyList>()?.extract()?;
            py.detach(|| inner.slice(&rows))
        }
        .map_err(PyCoreError)?;
        selection_out(py, tensors, sel)
    }

    /// `num_shards` contiguous equal shards, each `(layout, tensors)`, compacted.
    fn shard<'py>(
        &self,
        py: Python<'py>,
        tensors: &Bound<'py, PyList>,
        num_shards: i64,
    ) -> PyResult<Bound<'py, PyList>> {
        let inner = &self.inner;
        // Each shard also becomes Python objects (its layout, a tuple, a list, and the caller's
        // PackedTensor): an empty value splits into any count, so charge them before building.
        if inner.rows() == 0 {
            if let Ok(n) = usize::try_from(num_shards) {
                alloc::probe(n.checked_mul(SHARD_OBJECT_BYTES), || {
                    CoreError::ShardsTooMany { shards: n }
                })
                .map_err(PyCoreError)?;
            }
        }
        let shards = py.detach(|| inner.shard(num_shards)).map_err(PyCoreError)?;
        let out = shards
            .into_iter()
            .map(|sel| selection_out(py, tensors, sel))
            .collect::<PyResult<Vec<_>>>()?;
        PyList::new(py, out)
    }

    /// Every row repeated `repeats` times in place: `(layout, tensors)`, sharing segments and
    /// provenance (minted if absent), compacted and merged by provenance.
    fn repeat_interleave<'py>(
        &self,
        py: Python<'py>,
        tensors: &Bound<'py, PyList>,
        repeats: i64,
    ) -> PyResult<Bound<'py, PyTuple>> {
        let inner = &self.inner;
        let sel = py
            .detach(|| inner.repeat_interleave(repeats))
            .map_err(PyCoreError)?;
        selection_out(py, tensors, sel)
    }

    /// The layout itself: it is immutable.
    fn __copy__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    /// The layout itself: it is immutable.
    fn __deepcopy__<'py>(slf: PyRef<'py, Self>, _memo: &Bound<'py, PyAny>) -> PyRef<'py, Self> {
        slf
    }

    /// Pickles as a call of `PackedLayout.build` with the offsets, indices and provenance.
    fn __reduce__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        let build = py.get_type::<Self>().getattr(intern!(py, "build"))?;
        let args = (
            self.inner.n_physical(),
            self.offsets(py),
            self.indices(py),
            py.None(),
            self.provenance_blob(py),
        );
        PyTuple::new(py, [build, args.into_pyobject(py)?.into_any()])
    }

    fn __repr__(&self) -> String {
        format!(
            "PackedLayout(rows={}, refs={}, physical={}, csr={}, provenance={})",
            self.inner.rows(),
            self.inner.refs(),
            self.inner.n_physical(),
            self.inner.is_csr(),
            self.inner.provenance().is_some()
        )
    }
}

/// The result of `packed_concat`: the fields of the new value. `layout` is None for a legacy
/// result; `tensors` is None for a legacy `flattened_concat` (the caller materializes each
/// input into one row).
#[pyclass(frozen, module = "mmpack._native", get_all)]
pub struct ConcatResult {
    /// The new value's `dim_to_pack`, taken from the inputs.
    dim_to_pack: Py<PyAny>,
    /// The new value's `pad_to_max_shape`, taken from the inputs.
    pad_to_max_shape: Py<PyAny>,
    /// The new value's layout, or None for a legacy result.
    layout: Option<Py<PyPackedLayout>>,
    /// The new value's segments, or None for a legacy `flattened_concat`.
    tensors: Option<Py<PyList>>,
}

/// The `TypeError` for an input of `packed_concat` that is not PackedTensor-like.
fn not_packed(value: &Bound<'_, PyAny>, at: usize, mode: ConcatMode, missing: &str) -> PyErr {
    PyTypeError::new_err(format!(
        "PackedTensor.{}: from_packed_tensors[{at}] must be a PackedTensor, got {} \
         (no attribute {missing:?})",
        mode.name(),
        type_name(value)
    ))
}

/// One input of `packed_concat`: its fields, read as attributes, and its layout.
struct Input<'py> {
    dim: Bound<'py, PyAny>,
    pad: Bound<'py, PyAny>,
    tensors: Bound<'py, PyList>,
    layout: Option<Bound<'py, PyPackedLayout>>,
}

fn read_value<'py>(
    value: &Bound<'py, PyAny>,
    layout: Option<Bound<'py, PyAny>>,
    at: usize,
    mode: ConcatMode,
) -> PyResult<Input<'py>> {
    let py = value.py();
    let field = |name: &Bound<'py, PyString>| {
        value.getattr(name).map_err(|e| {
            if e.is_instance_of::<PyAttributeError>(py) {
                not_packed(value, at, mode, &name.to_string_lossy())
            } else {
                e
            }
        })
    };
    let dim = field(intern!(py, "dim_to_pack"))?;
    let pad = field(intern!(py, "pad_to_max_shape"))?;
    let tensors = list_items(&field(intern!(py, "tensors"))?)?;
    let layout = layout.ok_or_else(|| {
        PyValueError::new_err("packed_concat: layouts must have one entry per value")
    })?;
    let layout = if layout.is_none() {
        None
    } else {
        Some(layout.cast_into::<PyPackedLayout>()?)
    };
    Ok(Input {
        dim,
        pad,
        tensors,
        layout,
    })
}

/// `PackedTensor.concat` / `merge_segments` / `flattened_concat` (`mode`, the method name)
/// over a whole list of values, whose layouts (`None` for the legacy layout without
/// provenance) the caller passes in `layouts`, in the same order.
#[pyfunction]
#[pyo3(name = "packed_concat", signature = (values, layouts, mode))]
fn py_packed_concat<'py>(
    py: Python<'py>,
    values: &Bound<'py, PyAny>,
    layouts: &Bound<'py, PyList>,
    mode: &str,
) -> PyResult<ConcatResult> {
    let mode = ConcatMode::from_name(mode).ok_or_else(|| {
        let known: Vec<&str> = ConcatMode::ALL.iter().map(|m| m.name()).collect();
        PyValueError::new_err(format!(
            "unknown concat mode {mode:?}; known: {}",
            known.join(", ")
        ))
    })?;
    let mut inputs: Vec<Input<'py>> = Vec::new();
    let (mut same_dim, mut same_pad) = (true, true);
    for (at, value) in values.try_iter()?.enumerate() {
        let input = read_value(&value?, layouts.get_item(at).ok(), at, mode)?;
        if let Some(first) = inputs.first() {
            // NeMo-RL compares with `==` (a set of the values); `is` first is cheaper.
            same_dim = same_dim && (input.dim.is(&first.dim) || input.dim.eq(&first.dim)?);
            same_pad = same_pad && (input.pad.is(&first.pad) || input.pad.eq(&first.pad)?);
        }
        inputs.push(input);
    }
    csr::check_compatible(inputs.len(), same_dim, same_pad).map_err(PyCoreError)?;
    let core_inputs: Vec<ConcatInput<'_>> = inputs
        .iter()
        .map(|input| ConcatInput {
            layout: input.layout.as_ref().map(|l| &l.get().inner),
            n_physical: input.tensors.len(),
        })
        .collect();
    let outcome = py
        .detach(|| csr::concat_values(mode, &core_inputs))
        .map_err(PyCoreError)?;
    let (layout, tensors) = match outcome {
        ConcatOutcome::MaterializeEach => (None, None),
        ConcatOutcome::Legacy => {
            let out = PyList::empty(py);
            for input in &inputs {
                for t in input.tensors.iter() {
                    out.append(t)?;
                }
            }
            (None, Some(out))
        }
        ConcatOutcome::Interned(result) => {
            debug_assert!(result.sources.iter().all(|&(k, _)| k < inputs.len()));
            let items = result
                .sources
                .iter()
                .filter_map(|&(k, j)| inputs.get(k).map(|input| input.tensors.get_item(j)))
                .collect::<PyResult<Vec<_>>>()?;
            let lay = layout_obj(py, result.layout)?;
            (Some(lay.unbind()), Some(PyList::new(py, items)?))
        }
    };
    let first = inputs.first();
    Ok(ConcatResult {
        dim_to_pack: first.map_or_else(|| py.None(), |i| i.dim.clone().unbind()),
        pad_to_max_shape: first.map_or_else(|| py.None(), |i| i.pad.clone().unbind()),
        layout,
        tensors: tensors.map(Bound::unbind),
    })
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyPackedLayout>()?;
    m.add_class::<ConcatResult>()?;
    m.add_function(wrap_pyfunction!(py_packed_concat, m)?)?;
    Ok(())
}
