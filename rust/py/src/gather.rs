//! Byte-level gather of segments into one output buffer (parallel memcpy).
//!
//! Binds `mmpack_core::gather`. The output and the sources arrive as 1-D `uint8` numpy views of
//! torch tensors' memory (no copies); the sources are borrowed read-only and the output
//! read-write through rust-numpy's checked borrows (`try_readonly` / `try_readwrite`, never the
//! panicking variants), then the copy runs with the GIL released.
//!
//! rust-numpy's borrow tracking sees two arrays as aliased only when they share a base object;
//! two arrays made from different torch tensors over one buffer do not, so the output's byte
//! range is checked against every input's here, before any slice exists: overlapping ranges
//! would hand the core a `&mut` and a `&` to the same bytes.
use mmpack_core::gather;
use numpy::{Element, PyArray1, PyArrayMethods, PyUntypedArrayMethods};
use pyo3::prelude::*;

use crate::errors::{ErrorClass, PyCoreError};

/// The bytes an array's data covers, from its data pointer and length (contiguous arrays; a
/// non-contiguous one fails `as_slice` afterwards).
fn byte_range<T: Element>(a: &Bound<'_, PyArray1<T>>) -> (usize, usize) {
    let start = a.data() as usize;
    let len = PyUntypedArrayMethods::len(a).saturating_mul(std::mem::size_of::<T>());
    (start, start.saturating_add(len))
}

/// `PackedTensorError` unless the output's bytes are disjoint from every input's. Called once
/// every borrow is registered (so rust-numpy's own conflicts stay `TypeError`s) and before any
/// slice of the arrays exists.
fn check_disjoint(out: (usize, usize), inputs: &[(usize, usize)]) -> PyResult<()> {
    let (lo, hi) = out;
    if lo == hi {
        return Ok(());
    }
    for (k, &(s, e)) in inputs.iter().enumerate() {
        if s < e && s < hi && lo < e {
            return Err(ErrorClass::PackedTensorError.new_err(format!(
                "the gather output overlaps input array {k}: the output cannot overlap its inputs"
            )));
        }
    }
    Ok(())
}

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
    let order_guard = order.try_readonly()?;
    let guards = sources
        .iter()
        .map(|s| s.try_readonly())
        .collect::<Result<Vec<_>, _>>()?;
    let mut out_guard = out.try_readwrite()?;
    let mut inputs: Vec<(usize, usize)> = sources.iter().map(byte_range).collect();
    inputs.push(byte_range(order));
    check_disjoint(byte_range(out), &inputs)?;
    let order = order_guard.as_slice()?;
    let slices = guards
        .iter()
        .map(|g| g.as_slice())
        .collect::<Result<Vec<&[u8]>, _>>()?;
    let out = out_guard.as_slice_mut()?;
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
    let starts_guard = starts.try_readonly()?;
    let lens_guard = lens.try_readonly()?;
    let order_guard = order.try_readonly()?;
    let src_guard = src.try_readonly()?;
    let mut out_guard = out.try_readwrite()?;
    check_disjoint(
        byte_range(out),
        &[
            byte_range(src),
            byte_range(starts),
            byte_range(lens),
            byte_range(order),
        ],
    )?;
    let (starts, lens, order, src) = (
        starts_guard.as_slice()?,
        lens_guard.as_slice()?,
        order_guard.as_slice()?,
        src_guard.as_slice()?,
    );
    let out = out_guard.as_slice_mut()?;
    py.detach(|| gather::gather_ranges_into(out, src, starts, lens, order, outer, src_stride))
        .map_err(PyCoreError)?;
    Ok(())
}

/// Threads of this process's gather pool (built on first use, and again in a forked child);
/// 1 when the copy can only run on the calling thread.
#[pyfunction]
#[pyo3(name = "gather_threads", signature = ())]
fn py_gather_threads(py: Python<'_>) -> usize {
    py.detach(gather::parallel_threads)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(py_gather_threads, m)?)?;
    m.add_function(wrap_pyfunction!(py_gather_into, m)?)?;
    m.add_function(wrap_pyfunction!(py_gather_ranges_into, m)?)?;
    Ok(())
}
