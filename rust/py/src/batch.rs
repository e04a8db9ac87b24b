//! Bindings for `mmpack_core::batch`: one call builds a whole pack.
use mmpack_core::batch::{self, BatchOptions, MaskMode, SampleRef};
use mmpack_core::CoreError;
use numpy::{IntoPyArray, PyArray1, PyArrayMethods};
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use crate::errors::PyCoreError;
use crate::mask::MaskArr;

type Layout<'py> = (
    Bound<'py, PyArray1<i64>>,
    Bound<'py, PyArray1<i64>>,
    Bound<'py, PyArray1<bool>>,
    Bound<'py, PyArray1<i64>>,
    Bound<'py, PyArray1<i32>>,
    Bound<'py, PyArray1<i32>>,
    usize,
);

/// Build one pack. The per-sample lists are parallel (`names[i]` names sample `i` in errors);
/// in precomputed mode `masks` is read, otherwise `message_lengths` and `message_roles`.
/// Returns `(input_ids, labels, loss_mask, position_ids, cu_seqlens, cu_seqlens_padded,
/// max_seqlen)`.
#[pyfunction]
#[pyo3(signature = (
    names, tokens, masks, message_lengths, message_roles, *,
    precomputed, train_roles, pad_token_id, pad_to_multiple_of, ignore_index, cp_size
))]
#[allow(clippy::too_many_arguments)]
fn build_pack<'py>(
    py: Python<'py>,
    names: Vec<String>,
    tokens: Vec<Bound<'py, PyArray1<i64>>>,
    masks: Vec<Option<Bound<'py, PyAny>>>,
    message_lengths: Vec<Option<Vec<i64>>>,
    message_roles: Vec<Option<Vec<String>>>,
    precomputed: bool,
    train_roles: Vec<String>,
    pad_token_id: i64,
    pad_to_multiple_of: i64,
    ignore_index: i64,
    cp_size: i64,
) -> PyResult<Bound<'py, PyTuple>> {
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
    // Extract (attached): read-only borrows that stay valid while detached.
    let tok_ro = tokens
        .iter()
        .map(|t| t.try_readonly())
        .collect::<Result<Vec<_>, _>>()?;
    let mask_ro = masks
        .iter()
        .map(|m| m.as_ref().map(MaskArr::borrow).transpose())
        .collect::<PyResult<Vec<_>>>()?;
    let mut samples = Vec::with_capacity(n);
    for (i, name) in names.iter().enumerate() {
        let (Some(t), Some(m), Some(l), Some(r)) = (
            tok_ro.get(i),
            mask_ro.get(i),
            message_lengths.get(i),
            message_roles.get(i),
        ) else {
            continue;
        };
        samples.push(SampleRef {
            name,
            tokens: t.as_slice()?,
            mask: m.as_ref().map(MaskArr::view).transpose()?,
            message_lengths: l.as_deref(),
            message_roles: r.as_deref(),
        });
    }
    let opts = BatchOptions {
        mode: if precomputed {
            MaskMode::Precomputed
        } else {
            MaskMode::Derived
        },
        train_roles: &train_roles,
        pad_token_id,
        pad_to_multiple_of,
        ignore_index,
        cp_size,
    };
    // Build (detached), then hand the vectors to numpy without copying.
    let out = py
        .detach(|| batch::build(&samples, &opts))
        .map_err(PyCoreError)?;
    let layout: Layout<'py> = (
        out.input_ids.into_pyarray(py),
        out.labels.into_pyarray(py),
        out.loss_mask.into_pyarray(py),
        out.position_ids.into_pyarray(py),
        out.cu_seqlens.into_pyarray(py),
        out.cu_seqlens_padded.into_pyarray(py),
        out.max_seqlen,
    );
    layout.into_pyobject(py)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(build_pack, m)?)?;
    Ok(())
}
