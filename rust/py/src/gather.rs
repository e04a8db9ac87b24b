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

/// Copy byte ranges of one source buffer into `out`: segment `k` is
/// `src[o * src_stride + starts[k]:][:lens[k]]` in outer block `o`; the output is, for each
/// `o` in turn, segment `order[j]` for every `j` (segments compacted into one buffer first).
#[pyfunction]
#[pyo3(
    name = "gather_ranges_into",
    signature = (out, src, starts, lens, order, outer = 1, src_stride = 0)
)]
#[allow(clippy::too_many_arguments)]
fn py_gather_ranges_into(
    py: Python<'_>,
    out: &Bound<'_, PyArray1<u8>>,
    src: &Bound<'_, PyArray1<u8>>,
    starts: &Bound<'_, PyArray1<i64>>,
    lens: &Bound<'_, PyArray1<i64>>,
    order: &Bound<'_, PyArray1<i64>>,
    outer: usize,
    src_stride: usize,
) -> PyResult<()> {
    let starts = starts.try_readonly()?;
    let lens = lens.try_readonly()?;
    let order = order.try_readonly()?;
    let src = src.try_readonly()?;
    let (starts, lens, order, src) = (
        starts.as_slice()?,
        lens.as_slice()?,
        order.as_slice()?,
        src.as_slice()?,
    );
    let mut out = out.try_readwrite()?;
    let out = out.as_slice_mut()?;
    py.detach(|| gather::gather_ranges_into(out, src, starts, lens, order, outer, src_stride))
        .map_err(PyCoreError)?;
    Ok(())
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(py_gather_into, m)?)?;
    m.add_function(wrap_pyfunction!(py_gather_ranges_into, m)?)?;
    Ok(())
}
