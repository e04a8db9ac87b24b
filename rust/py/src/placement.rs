//! Bindings for `mmpack_core::packing::place`: numpy arrays in (zero-copy, checked borrows),
//! flat numpy arrays out, the work done with the GIL released.
use mmpack_core::packing::{self, Placement, PlacementInput, PlacementOptions};
use numpy::{IntoPyArray, PyArray1, PyArrayMethods, PyReadonlyArray1};
use pyo3::prelude::*;
use pyo3::types::PyModule;

use crate::errors::PyCoreError;

/// Items placed on ranks: the rank of every item, what each rank costs, the groups.
#[pyclass(frozen, module = "mmpack._native", get_all)]
pub struct PlaceResult {
    /// The rank of every item (int64).
    item_ranks: Py<PyArray1<i64>>,
    /// Items' cost plus unique segments' cost, per rank (float64).
    rank_costs: Py<PyArray1<f64>>,
    /// Unique segments per rank (int64).
    rank_segments: Py<PyArray1<i64>>,
    /// Items per rank (int64).
    rank_items: Py<PyArray1<i64>>,
    /// The group of every item: items sharing a segment, numbered by first item (int64).
    item_groups: Py<PyArray1<i64>>,
    /// Groups whose items landed on more than one rank.
    split_groups: usize,
    /// The lower bound on the worst rank's cost.
    lower_bound: f64,
    /// Which candidate won: "groups", "split", "baseline", or "given" (`placement_costs`).
    kind: &'static str,
}

impl PlaceResult {
    fn new(py: Python<'_>, out: Placement) -> Self {
        Self {
            item_ranks: out.item_ranks.into_pyarray(py).unbind(),
            rank_costs: out.costs.rank_costs.into_pyarray(py).unbind(),
            rank_segments: out.costs.rank_segments.into_pyarray(py).unbind(),
            rank_items: out.costs.rank_items.into_pyarray(py).unbind(),
            item_groups: out.item_groups.into_pyarray(py).unbind(),
            split_groups: out.split_groups,
            lower_bound: out.lower_bound,
            kind: out.kind.name(),
        }
    }
}

struct Arrays<'py> {
    costs: PyReadonlyArray1<'py, f64>,
    offsets: PyReadonlyArray1<'py, i64>,
    segments: PyReadonlyArray1<'py, i64>,
    segment_costs: PyReadonlyArray1<'py, f64>,
}

impl<'py> Arrays<'py> {
    fn new(
        costs: &Bound<'py, PyArray1<f64>>,
        offsets: &Bound<'py, PyArray1<i64>>,
        segments: &Bound<'py, PyArray1<i64>>,
        segment_costs: &Bound<'py, PyArray1<f64>>,
    ) -> PyResult<Self> {
        Ok(Self {
            costs: costs.try_readonly()?,
            offsets: offsets.try_readonly()?,
            segments: segments.try_readonly()?,
            segment_costs: segment_costs.try_readonly()?,
        })
    }

    fn input(&self) -> PyResult<PlacementInput<'_>> {
        Ok(PlacementInput {
            item_costs: self.costs.as_slice()?,
            item_seg_offsets: self.offsets.as_slice()?,
            item_segments: self.segments.as_slice()?,
            segment_costs: self.segment_costs.as_slice()?,
        })
    }
}

/// Places items on ranks by cost, keeping items that share segments together.
#[pyfunction]
#[pyo3(
    name = "place",
    signature = (
        item_costs, item_seg_offsets, item_segments, segment_costs, num_ranks, *,
        tolerance, balance_counts, baseline = None
    )
)]
#[allow(clippy::too_many_arguments)]
fn py_place<'py>(
    py: Python<'py>,
    item_costs: &Bound<'py, PyArray1<f64>>,
    item_seg_offsets: &Bound<'py, PyArray1<i64>>,
    item_segments: &Bound<'py, PyArray1<i64>>,
    segment_costs: &Bound<'py, PyArray1<f64>>,
    num_ranks: usize,
    tolerance: f64,
    balance_counts: bool,
    baseline: Option<&Bound<'py, PyArray1<i64>>>,
) -> PyResult<PlaceResult> {
    let arrays = Arrays::new(item_costs, item_seg_offsets, item_segments, segment_costs)?;
    let input = arrays.input()?;
    let baseline = baseline.map(PyArrayMethods::try_readonly).transpose()?;
    let opts = PlacementOptions {
        num_ranks,
        tolerance,
        balance_counts,
        baseline: baseline.as_ref().map(|b| b.as_slice()).transpose()?,
    };
    let out = py
        .detach(|| packing::place(&input, &opts))
        .map_err(PyCoreError)?;
    Ok(PlaceResult::new(py, out))
}

/// What a given placement costs each rank (same inputs as `place`).
#[pyfunction]
#[pyo3(
    name = "placement_costs",
    signature = (item_costs, item_seg_offsets, item_segments, segment_costs, num_ranks, item_ranks)
)]
fn py_placement_costs<'py>(
    py: Python<'py>,
    item_costs: &Bound<'py, PyArray1<f64>>,
    item_seg_offsets: &Bound<'py, PyArray1<i64>>,
    item_segments: &Bound<'py, PyArray1<i64>>,
    segment_costs: &Bound<'py, PyArray1<f64>>,
    num_ranks: usize,
    item_ranks: &Bound<'py, PyArray1<i64>>,
) -> PyResult<PlaceResult> {
    let arrays = Arrays::new(item_costs, item_seg_offsets, item_segments, segment_costs)?;
    let input = arrays.input()?;
    let ranks = item_ranks.try_readonly()?;
    let ranks = ranks.as_slice()?;
    let out = py
        .detach(|| packing::placement_costs(&input, ranks, num_ranks))
        .map_err(PyCoreError)?;
    Ok(PlaceResult::new(py, out))
}

/// The group of every item: connected components over shared segments.
#[pyfunction]
#[pyo3(name = "segment_groups", signature = (item_seg_offsets, item_segments, num_segments))]
fn py_segment_groups<'py>(
    py: Python<'py>,
    item_seg_offsets: &Bound<'py, PyArray1<i64>>,
    item_segments: &Bound<'py, PyArray1<i64>>,
    num_segments: usize,
) -> PyResult<Bound<'py, PyArray1<i64>>> {
    let offsets = item_seg_offsets.try_readonly()?;
    let offsets = offsets.as_slice()?;
    let segments = item_segments.try_readonly()?;
    let segments = segments.as_slice()?;
    let out = py
        .detach(|| packing::segment_groups(offsets, segments, num_segments))
        .map_err(PyCoreError)?;
    Ok(out.into_pyarray(py))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PlaceResult>()?;
    m.add_function(wrap_pyfunction!(py_place, m)?)?;
    m.add_function(wrap_pyfunction!(py_placement_costs, m)?)?;
    m.add_function(wrap_pyfunction!(py_segment_groups, m)?)?;
    Ok(())
}
