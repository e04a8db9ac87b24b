//! Bindings for `mmpack_core::packing`: numpy `int64` arrays in (zero-copy, checked
//! borrows), flat numpy arrays out (moved, not copied), the work done with the GIL released.
use mmpack_core::packing::{self, Algorithm, OnOversize, PackOptions, RankCost};
use mmpack_core::CoreError;
use numpy::{IntoPyArray, PyArray1, PyArrayMethods};
use pyo3::prelude::*;
use pyo3::types::{PyList, PyModule};

use crate::errors::PyCoreError;

/// The bins of `pack`: CSR `bin_offsets` over `item_indices`, the load (and media, None
/// without media) of each bin, the oversize items and the packed total length.
#[pyclass(frozen, module = "mmpack._native", get_all)]
pub struct PackResult {
    /// Where each bin starts in `item_indices`, plus the end (`num_bins + 1` entries, int64).
    bin_offsets: Py<PyArray1<i64>>,
    /// The items of every bin, bin after bin (int64).
    item_indices: Py<PyArray1<i64>>,
    /// The summed (effective) length of each bin (int64).
    bin_loads: Py<PyArray1<i64>>,
    /// The summed media count of each bin (int64), or None without media.
    bin_media: Option<Py<PyArray1<i64>>>,
    /// The items over a budget, in input order, skipped or truncated per `on_oversize` (int64).
    oversize: Py<PyArray1<i64>>,
    /// The summed (effective) length of every packed item.
    total_length: i64,
}

/// Packs `lengths` into bins of `capacity`.
#[pyfunction]
#[pyo3(
    name = "pack",
    signature = (
        lengths, capacity, algorithm, *, media = None, media_capacity = None,
        max_items_per_bin = None, min_bins = None, bins_multiple_of = None,
        on_oversize = "error", order = None, allow_zero = false, search_budget = 256
    )
)]
#[allow(clippy::too_many_arguments)]
fn py_pack<'py>(
    py: Python<'py>,
    lengths: &Bound<'py, PyArray1<i64>>,
    capacity: i64,
    algorithm: &str,
    media: Option<&Bound<'py, PyArray1<i64>>>,
    media_capacity: Option<i64>,
    max_items_per_bin: Option<usize>,
    min_bins: Option<usize>,
    bins_multiple_of: Option<usize>,
    on_oversize: &str,
    order: Option<&Bound<'py, PyArray1<i64>>>,
    allow_zero: bool,
    search_budget: usize,
) -> PyResult<PackResult> {
    let mut opts = PackOptions::new(
        capacity,
        Algorithm::from_name(algorithm).map_err(PyCoreError)?,
    );
    opts.max_items_per_bin = max_items_per_bin;
    opts.media_capacity = media_capacity;
    opts.min_bins = min_bins;
    opts.bins_multiple_of = bins_multiple_of;
    opts.on_oversize = OnOversize::from_name(on_oversize).map_err(PyCoreError)?;
    opts.allow_zero = allow_zero;
    opts.search_budget = search_budget;
    let lengths = lengths.try_readonly()?;
    let lengths = lengths.as_slice()?;
    let media = media.map(PyArrayMethods::try_readonly).transpose()?;
    let media = media.as_ref().map(|m| m.as_slice()).transpose()?;
    let order = order.map(PyArrayMethods::try_readonly).transpose()?;
    opts.order = order.as_ref().map(|o| o.as_slice()).transpose()?;
    let out = py
        .detach(|| packing::pack(lengths, media, &opts))
        .map_err(PyCoreError)?;
    let has_media = media.is_some();
    Ok(PackResult {
        bin_offsets: out.bin_offsets.into_pyarray(py).unbind(),
        item_indices: out.item_indices.into_pyarray(py).unbind(),
        bin_loads: out.bin_loads.into_pyarray(py).unbind(),
        bin_media: has_media.then(|| out.bin_media.into_pyarray(py).unbind()),
        oversize: out.oversize.into_pyarray(py).unbind(),
        total_length: out.total_length,
    })
}

/// The result of `shuffle_permutation`: the permutation and the generator's new state.
#[pyclass(frozen, module = "mmpack._native", get_all)]
pub struct ShuffleResult {
    /// The shuffled `range(n)` (int64).
    permutation: Py<PyArray1<i64>>,
    /// The generator's 624 state words after the shuffle (uint32).
    state: Py<PyArray1<u32>>,
    /// The generator's position in `state` after the shuffle.
    pos: usize,
}

/// `random.shuffle(list(range(n)))` from a Mersenne Twister state (624 words + position).
#[pyfunction]
#[pyo3(name = "shuffle_permutation", signature = (state, pos, n))]
fn py_shuffle_permutation<'py>(
    py: Python<'py>,
    state: &Bound<'py, PyArray1<u32>>,
    pos: usize,
    n: usize,
) -> PyResult<ShuffleResult> {
    let mut words = state.try_readonly()?.as_slice()?.to_vec();
    let (perm, pos) = py
        .detach(|| packing::shuffle_permutation(&mut words, pos, n))
        .map_err(PyCoreError)?;
    Ok(ShuffleResult {
        permutation: perm.into_pyarray(py).unbind(),
        state: words.into_pyarray(py).unbind(),
        pos,
    })
}

/// Bins distributed over ranks: CSR `rank_offsets` over `bin_indices`, and the cost of each
/// rank and of each bin.
#[pyclass(frozen, module = "mmpack._native", get_all)]
pub struct RankResult {
    /// Where each rank starts in `bin_indices`, plus the end (`num_ranks + 1` entries, int64).
    rank_offsets: Py<PyArray1<i64>>,
    /// The bins of every rank, rank after rank (int64).
    bin_indices: Py<PyArray1<i64>>,
    /// The summed cost of each rank's bins (int64).
    rank_costs: Py<PyArray1<i64>>,
    /// The cost of each bin (int64).
    bin_costs: Py<PyArray1<i64>>,
}

/// Distributes bins over ranks.
#[pyfunction]
#[pyo3(name = "assign_to_ranks", signature = (bin_offsets, item_indices, lengths, num_ranks, cost))]
fn py_assign_to_ranks<'py>(
    py: Python<'py>,
    bin_offsets: &Bound<'py, PyArray1<i64>>,
    item_indices: &Bound<'py, PyArray1<i64>>,
    lengths: &Bound<'py, PyArray1<i64>>,
    num_ranks: usize,
    cost: &str,
) -> PyResult<RankResult> {
    let cost = RankCost::from_name(cost).map_err(PyCoreError)?;
    let offsets = bin_offsets.try_readonly()?;
    let offsets = offsets.as_slice()?;
    let items = item_indices.try_readonly()?;
    let items = items.as_slice()?;
    let lengths = lengths.try_readonly()?;
    let lengths = lengths.as_slice()?;
    let out = py
        .detach(|| packing::assign_to_ranks(offsets, items, lengths, num_ranks, cost))
        .map_err(PyCoreError)?;
    Ok(RankResult {
        rank_offsets: out.rank_offsets.into_pyarray(py).unbind(),
        bin_indices: out.bin_indices.into_pyarray(py).unbind(),
        rank_costs: out.rank_costs.into_pyarray(py).unbind(),
        bin_costs: out.bin_costs.into_pyarray(py).unbind(),
    })
}

/// CSR bins as a list of lists of ints (what NeMo-RL's packers return), built in one call.
///
/// Python's cyclic garbage collector is paused while the lists are built: each new list counts
/// towards its collection threshold, and the collections it would run meanwhile (traversing
/// every list built so far) took more than half the time at a million items. Nothing runs
/// Python code in between (the GIL is held throughout), and the previous state is restored.
#[pyfunction]
#[pyo3(name = "csr_to_lists", signature = (offsets, items))]
fn py_csr_to_lists<'py>(
    py: Python<'py>,
    offsets: &Bound<'py, PyArray1<i64>>,
    items: &Bound<'py, PyArray1<i64>>,
) -> PyResult<Bound<'py, PyList>> {
    let offsets = offsets.try_readonly()?;
    let offsets = offsets.as_slice()?;
    let items = items.try_readonly()?;
    let items = items.as_slice()?;
    let mut ranges = Vec::with_capacity(offsets.len().saturating_sub(1));
    for w in offsets.windows(2) {
        match (usize::try_from(w[0]), usize::try_from(w[1])) {
            (Ok(a), Ok(b)) if a <= b && b <= items.len() => ranges.push(a..b),
            _ => {
                return Err(PyCoreError(CoreError::PackingArgument {
                    name: "bin_offsets",
                    detail: format!("bad bin range {}..{} for {} items", w[0], w[1], items.len()),
                })
                .into())
            }
        }
    }
    let _paused = GcPause::new(py)?;
    PyList::new(
        py,
        ranges
            .into_iter()
            .map(|r| PyList::new(py, items.get(r).unwrap_or(&[])))
            .collect::<PyResult<Vec<_>>>()?,
    )
}

/// Disables Python's cyclic GC until dropped, then re-enables it if it was enabled.
struct GcPause<'py> {
    gc: Option<Bound<'py, PyModule>>,
}

impl<'py> GcPause<'py> {
    fn new(py: Python<'py>) -> PyResult<Self> {
        let gc = py.import("gc")?;
        if gc.call_method0("isenabled")?.is_truthy()? {
            gc.call_method0("disable")?;
            return Ok(Self { gc: Some(gc) });
        }
        Ok(Self { gc: None })
    }
}

impl Drop for GcPause<'_> {
    fn drop(&mut self) {
        if let Some(gc) = &self.gc {
            // Cannot fail for the real `gc` module; nothing sensible to do if it did.
            let _ = gc.call_method0("enable");
        }
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PackResult>()?;
    m.add_class::<ShuffleResult>()?;
    m.add_class::<RankResult>()?;
    m.add_function(wrap_pyfunction!(py_csr_to_lists, m)?)?;
    m.add_function(wrap_pyfunction!(py_pack, m)?)?;
    m.add_function(wrap_pyfunction!(py_shuffle_permutation, m)?)?;
    m.add_function(wrap_pyfunction!(py_assign_to_ranks, m)?)?;
    Ok(())
}
