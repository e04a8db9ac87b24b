//! Bindings for `PackedTensor`'s row mapping and provenance (`mmpack_core::csr`).
//!
//! `PackedLayout` is an immutable handle: every operation returns a new one, so Python values
//! may share a handle (deepcopy of a dedup value is a new wrapper around the same handle).
//! Operations that select or merge physical segments also take the value's `tensors` list and
//! return the output list, built here while attached, so the Python layer does no per-segment
//! work. O(n) core work runs with the GIL released.
use mmpack_core::csr::{self, ConcatInput, Csr, Packed, Selection};
use mmpack_core::intern::{prov_from_bytes, prov_to_bytes, ProvId};
use mmpack_core::CoreError;
use numpy::{IntoPyArray, PyArray1, PyArrayMethods};
use pyo3::exceptions::{PyAssertionError, PyAttributeError, PyTypeError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PySet, PySetMethods, PyString, PyTuple};

use crate::errors::PyCoreError;

/// The row mapping and provenance of one `PackedTensor` (never the tensors themselves).
#[pyclass(frozen, module = "mmpack._native", name = "PackedLayout")]
pub struct PyPackedLayout {
    inner: Packed,
}

fn layout_obj(py: Python<'_>, inner: Packed) -> PyResult<Bound<'_, PyPackedLayout>> {
    Bound::new(py, PyPackedLayout { inner })
}

fn read_i64<'a>(arr: &'a numpy::PyReadonlyArray1<'_, i64>) -> PyResult<&'a [i64]> {
    Ok(arr.as_slice()?)
}

/// Provenance ids from a sequence of 16-byte `bytes` (NeMo-RL's list form).
fn parse_provenance(seq: &Bound<'_, PyAny>) -> PyResult<Vec<ProvId>> {
    let mut out = Vec::with_capacity(seq.len().unwrap_or(0));
    for (at, item) in seq.try_iter()?.enumerate() {
        let item = item?;
        let bytes = item.cast::<PyBytes>().map_err(|_| {
            PyTypeError::new_err(format!(
                "_segment_provenance entry {at} must be bytes (uuid.uuid4().bytes), got {}",
                item.get_type()
                    .name()
                    .map_or_else(|_| "?".to_owned(), |n| n.to_string())
            ))
        })?;
        let b = bytes.as_bytes();
        let id = prov_from_bytes(b)
            .ok_or(PyCoreError(CoreError::ProvenanceEntry { at, len: b.len() }))?;
        out.push(id);
    }
    Ok(out)
}

/// Provenance ids from one blob of `16 * n` bytes (the pickle form).
fn parse_blob(blob: &[u8]) -> PyResult<Vec<ProvId>> {
    let chunks = blob.chunks_exact(16);
    if !chunks.remainder().is_empty() {
        return Err(PyCoreError(CoreError::ProvenanceEntry {
            at: blob.len() / 16,
            len: chunks.remainder().len(),
        })
        .into());
    }
    Ok(chunks.filter_map(prov_from_bytes).collect())
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
    let lay = layout_obj(py, sel.packed)?;
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
        let csr = match (offsets, indices) {
            (Some(o), Some(i)) => {
                let (o, i) = (o.try_readonly()?, i.try_readonly()?);
                let (o, i) = (read_i64(&o)?, read_i64(&i)?);
                py.detach(|| csr::validate(o, i, n_physical))
                    .map_err(PyCoreError)?;
                Some(Csr {
                    offsets: o.to_vec(),
                    indices: i.to_vec(),
                })
            }
            (None, None) => None,
            _ => {
                return Err(pyo3::exceptions::PyValueError::new_err(
                    "_row_offsets and _segment_indices must either both be set or both be None",
                ))
            }
        };
        let provenance = match (provenance, provenance_blob) {
            (Some(seq), _) => {
                let len = seq.len()?;
                csr::validate_provenance_len(len, n_physical).map_err(PyCoreError)?;
                Some(parse_provenance(seq)?)
            }
            (None, Some(blob)) => {
                let ids = parse_blob(blob.as_bytes())?;
                csr::validate_provenance_len(ids.len(), n_physical).map_err(PyCoreError)?;
                Some(ids)
            }
            (None, None) => None,
        };
        Ok(Self {
            inner: Packed {
                csr,
                provenance,
                n_physical,
            },
        })
    }

    /// The legacy layout over `n_physical` segments with freshly minted provenance.
    #[staticmethod]
    fn legacy_dedup(n_physical: usize) -> PyResult<Self> {
        Ok(Self {
            inner: Packed::legacy_dedup(n_physical).map_err(PyCoreError)?,
        })
    }

    /// `n` fresh provenance ids (uuid4 bytes), unique within the process.
    #[staticmethod]
    fn mint<'py>(py: Python<'py>, n: usize) -> PyResult<Bound<'py, PyList>> {
        let ids = mmpack_core::intern::mint(n).map_err(PyCoreError)?;
        prov_list(py, &ids)
    }

    #[getter]
    fn num_rows(&self) -> usize {
        self.inner.rows()
    }

    #[getter]
    fn n_physical(&self) -> usize {
        self.inner.n_physical
    }

    #[getter]
    fn is_csr(&self) -> bool {
        self.inner.csr.is_some()
    }

    #[getter]
    fn has_provenance(&self) -> bool {
        self.inner.provenance.is_some()
    }

    /// Row offsets as a new int64 array, or None for the legacy layout.
    fn offsets<'py>(&self, py: Python<'py>) -> Option<Bound<'py, PyArray1<i64>>> {
        self.inner
            .csr
            .as_ref()
            .map(|c| PyArray1::from_slice(py, &c.offsets))
    }

    /// Segment indices as a new int64 array, or None for the legacy layout.
    fn indices<'py>(&self, py: Python<'py>) -> Option<Bound<'py, PyArray1<i64>>> {
        self.inner
            .csr
            .as_ref()
            .map(|c| PyArray1::from_slice(py, &c.indices))
    }

    /// Row offsets as a new `list[int]`, or None.
    fn offsets_list<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyList>>> {
        self.inner
            .csr
            .as_ref()
            .map(|c| PyList::new(py, &c.offsets))
            .transpose()
    }

    /// Segment indices as a new `list[int]`, or None.
    fn indices_list<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyList>>> {
        self.inner
            .csr
            .as_ref()
            .map(|c| PyList::new(py, &c.indices))
            .transpose()
    }

    /// Provenance as a new `list[bytes]`, or None.
    fn provenance_list<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyList>>> {
        self.inner
            .provenance
            .as_ref()
            .map(|p| prov_list(py, p))
            .transpose()
    }

    /// Provenance as one `bytes` of 16 bytes per segment, or None.
    fn provenance_blob<'py>(&self, py: Python<'py>) -> Option<Bound<'py, PyBytes>> {
        self.inner.provenance.as_ref().map(|p| {
            let mut buf = Vec::with_capacity(p.len().saturating_mul(16));
            for &id in p {
                buf.extend_from_slice(&prov_to_bytes(id));
            }
            PyBytes::new(py, &buf)
        })
    }

    /// The same layout with other provenance (a sequence of bytes) or none.
    #[pyo3(signature = (provenance))]
    fn with_provenance(&self, provenance: Option<&Bound<'_, PyAny>>) -> PyResult<Self> {
        let provenance = match provenance {
            Some(seq) => {
                csr::validate_provenance_len(seq.len()?, self.inner.n_physical)
                    .map_err(PyCoreError)?;
                Some(parse_provenance(seq)?)
            }
            None => None,
        };
        Ok(Self {
            inner: Packed {
                csr: self.inner.csr.clone(),
                provenance,
                n_physical: self.inner.n_physical,
            },
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
        let counts = counts
            .into_iter()
            .map(|c| {
                i64::try_from(c).map_err(|_| CoreError::IndexOverflow {
                    what: "a reference count",
                })
            })
            .collect::<Result<Vec<i64>, _>>()
            .map_err(PyCoreError)?;
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

    fn __copy__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __deepcopy__<'py>(slf: PyRef<'py, Self>, _memo: &Bound<'py, PyAny>) -> PyRef<'py, Self> {
        slf
    }

    fn __reduce__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        let build = py.get_type::<Self>().getattr(intern!(py, "build"))?;
        let args = (
            self.inner.n_physical,
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
            self.inner.n_physical,
            self.inner.csr.is_some(),
            self.inner.provenance.is_some()
        )
    }
}

/// One input value of `packed_concat`, read from its `__dict__`.
struct Input<'py> {
    tensors: Bound<'py, PyList>,
    layout: Option<Bound<'py, PyPackedLayout>>,
}

/// The `TypeError` for an input of `packed_concat` that is not PackedTensor-like.
fn not_packed(value: &Bound<'_, PyAny>, at: usize, mode: u8, missing: &str) -> PyErr {
    let op = match mode {
        1 => "merge_segments",
        2 => "flattened_concat",
        _ => "concat",
    };
    let tp = value
        .get_type()
        .name()
        .map_or_else(|_| "?".to_owned(), |n| n.to_string());
    PyTypeError::new_err(format!(
        "PackedTensor.{op}: from_packed_tensors[{at}] must be a PackedTensor, got {tp} \
         (no attribute {missing:?})"
    ))
}

fn read_value<'py>(
    value: &Bound<'py, PyAny>,
    at: usize,
    mode: u8,
    fallback: &mut Option<Bound<'py, PyAny>>,
) -> PyResult<(Input<'py>, Bound<'py, PyAny>, Bound<'py, PyAny>)> {
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
    let tensors = field(intern!(py, "tensors"))?;
    let layout = match value.getattr(intern!(py, "_layout")) {
        Ok(v) if v.is_none() || v.is_instance_of::<PyPackedLayout>() => v,
        _ => {
            // No handle yet (raw NeMo-RL `__dict__`, a foreign class): ask Python.
            let f = match fallback {
                Some(f) => f.clone(),
                None => {
                    let f = py
                        .import(intern!(py, "mmpack.packed"))?
                        .getattr(intern!(py, "_layout_of"))?;
                    *fallback = Some(f.clone());
                    f
                }
            };
            f.call1((value,))?
        }
    };
    let layout = if layout.is_none() {
        None
    } else {
        Some(layout.cast_into::<PyPackedLayout>()?)
    };
    Ok((
        Input {
            tensors: list_items(&tensors)?,
            layout,
        },
        dim,
        pad,
    ))
}

/// `PackedTensor.concat` / `merge_segments` / `flattened_concat` over a whole list of values.
///
/// `mode`: 0 concat, 1 merge (one output row), 2 flattened (every input must have one row when
/// any is dedup-enabled or CSR). Returns `(dim_to_pack, pad_to_max_shape, layout, tensors)`;
/// `layout` is None for the legacy result, and `tensors` is None for a legacy flattened concat
/// (the caller materializes each input).
#[pyfunction]
#[pyo3(name = "packed_concat", signature = (values, mode = 0))]
fn py_packed_concat<'py>(
    py: Python<'py>,
    values: &Bound<'py, PyAny>,
    mode: u8,
) -> PyResult<Bound<'py, PyTuple>> {
    let mut fallback = None;
    let mut inputs = Vec::new();
    let mut first: Option<(Bound<'py, PyAny>, Bound<'py, PyAny>)> = None;
    let (mut same_dim, mut same_pad) = (true, true);
    for (at, value) in values.try_iter()?.enumerate() {
        let (input, dim, pad) = read_value(&value?, at, mode, &mut fallback)?;
        match &first {
            None => first = Some((dim, pad)),
            Some((d0, p0)) => {
                if same_dim && !dim.is(d0) && !dim.eq(d0)? {
                    same_dim = false;
                }
                if same_pad && !pad.is(p0) && !pad.eq(p0)? {
                    same_pad = false;
                }
            }
        }
        inputs.push(input);
    }
    let Some((dim, pad)) = first else {
        return Err(PyAssertionError::new_err(
            "All packed tensors must have the same dim_to_pack",
        ));
    };
    if !same_dim {
        return Err(PyAssertionError::new_err(
            "All packed tensors must have the same dim_to_pack",
        ));
    }
    if !same_pad {
        return Err(PyAssertionError::new_err(
            "All packed tensors must have the same pad_to_max_shape setting",
        ));
    }
    let none = || py.None().into_bound(py);
    if inputs.iter().all(|i| i.layout.is_none()) {
        if mode == 2 {
            return PyTuple::new(py, [dim, pad, none(), none()]);
        }
        let out = PyList::empty(py);
        for input in &inputs {
            for t in input.tensors.iter() {
                out.append(t)?;
            }
        }
        return PyTuple::new(py, [dim, pad, none(), out.into_any()]);
    }
    if mode == 2 {
        for input in &inputs {
            let rows = match &input.layout {
                Some(l) => l.get().inner.rows(),
                None => input.tensors.len(),
            };
            if rows != 1 {
                return Err(PyAssertionError::new_err(
                    "flattened_concat requires one logical row per input; \
                     merge_segments only collapses dedup-enabled values",
                ));
            }
        }
    }
    let core_inputs: Vec<ConcatInput<'_>> = inputs
        .iter()
        .map(|input| {
            let inner = input.layout.as_ref().map(|l| &l.get().inner);
            ConcatInput {
                csr: inner.and_then(|p| p.csr.as_ref()),
                provenance: inner.and_then(|p| p.provenance.as_deref()),
                n_physical: input.tensors.len(),
            }
        })
        .collect();
    let result = py
        .detach(|| {
            if mode == 1 {
                csr::merge(&core_inputs)
            } else {
                csr::concat(&core_inputs)
            }
        })
        .map_err(PyCoreError)?;
    let items = result
        .sources
        .iter()
        .map(|&(k, j)| match inputs.get(k) {
            Some(input) => input.tensors.get_item(j),
            None => Err(PyCoreError(CoreError::IndexOverflow {
                what: "a concat source",
            })
            .into()),
        })
        .collect::<PyResult<Vec<_>>>()?;
    let out = PyList::new(py, items)?;
    let lay = layout_obj(py, result.packed)?;
    PyTuple::new(py, [dim, pad, lay.into_any(), out.into_any()])
}

/// `payload.measure`'s step for one `PackedTensor`-like value, in one call:
/// `(physical_bytes, physical_segments, logical_bytes, logical_segments)`.
///
/// An entry of `tensors` that is an instance of `array_types` is a segment of `nbytes` bytes;
/// any other entry (`None` included) is absent. A segment counts as physical only if its `id()`
/// was not yet in `seen`, which it is added to. `indices` lists the physical segment of each
/// logical one (`None` for the legacy layout: every entry once).
#[pyfunction]
#[pyo3(name = "measure_segments", signature = (tensors, indices, seen, array_types))]
fn py_measure_segments(
    py: Python<'_>,
    tensors: &Bound<'_, PyList>,
    indices: Option<&Bound<'_, PyArray1<i64>>>,
    seen: &Bound<'_, PySet>,
    array_types: &Bound<'_, PyTuple>,
) -> PyResult<(u64, usize, u64, usize)> {
    let nbytes = intern!(py, "nbytes");
    let overflow = || {
        PyCoreError(CoreError::IndexOverflow {
            what: "the physical byte count",
        })
    };
    let mut sizes = Vec::with_capacity(tensors.len());
    let (mut physical_bytes, mut physical_segments) = (0u64, 0usize);
    for item in tensors.iter() {
        if item.is_none() || !item.is_instance(array_types)? {
            sizes.push(None);
            continue;
        }
        let size: u64 = item.getattr(nbytes)?.extract()?;
        sizes.push(Some(size));
        // `id(item)` in CPython; one hash operation tells whether it was new
        let before = seen.len();
        seen.add(item.as_ptr() as usize)?;
        if seen.len() > before {
            physical_bytes = physical_bytes.checked_add(size).ok_or_else(overflow)?;
            physical_segments += 1;
        }
    }
    let indices = indices.map(|a| a.try_readonly()).transpose()?;
    let indices = indices.as_ref().map(|a| a.as_slice()).transpose()?;
    let (logical_bytes, logical_segments) = py
        .detach(|| csr::logical_totals(&sizes, indices))
        .map_err(PyCoreError)?;
    Ok((
        physical_bytes,
        physical_segments,
        logical_bytes,
        logical_segments,
    ))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyPackedLayout>()?;
    m.add_function(wrap_pyfunction!(py_packed_concat, m)?)?;
    m.add_function(wrap_pyfunction!(py_measure_segments, m)?)?;
    Ok(())
}
