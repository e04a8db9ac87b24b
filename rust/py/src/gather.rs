//! Byte-level gather of segments into one output buffer (parallel memcpy).
//!
//! Binds `mmpack_core::gather`. The output and the sources arrive as 1-D `uint8` numpy views of
//! torch tensors' memory (no copies); the sources are borrowed read-only and the output
//! read-write through rust-numpy's checked borrows (`try_readonly` / `try_readwrite`, never the
//! panicking variants), then the copy runs with the GIL released.
use mmpack_core::gather;
use numpy::{PyArray1, PyArrayMethods};
use pyo3::prelude::*;

use crate::errors::PyCoreError;

/// Copy `sources[order[j]]` for every `j` into `out`, back to back; with `outer > 1` every
/// source is `outer` equal blocks and the output is block `o` of every ordered source, for each
/// `o` in turn (packing along a non-leading dimension).
#[pyfunction]
#[pyo3(name = "gather_into", signature = (out, sources, order, outer = 1))]
fn py_gather_into(
    py: Python<'_>,
    out: &Bound<'_, PyArray1<u8>>,
    sources: Vec<Bound<'_, PyArray1<u8>>>,
    order: &Bound<'_, PyArray1<i64>>,
    outer: usize,
) -> PyResult<()> {
    let order = order.try_readonly()?;
    let order = order.as_slice()?;
    let guards = sources
        .iter()
        .map(|s| s.try_readonly())
        .collect::<Result<Vec<_>, _>>()?;
    let slices = guards
        .iter()
        .map(|g| g.as_slice())
        .collect::<Result<Vec<&[u8]>, _>>()?;
    let mut out = out.try_readwrite()?;
    let out = out.as_slice_mut()?;
    py.detach(|| gather::gather_into(out, &slices, order, outer))
        .map_err(PyCoreError)?;
    Ok(())
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(py_gather_into, m)?)?;
    Ok(())
}
