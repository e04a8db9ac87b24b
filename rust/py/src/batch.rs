//! Bindings for `mmpack_core::batch`: one call builds a whole pack.
use mmpack_core::batch::{self, BatchOptions, MaskMode, SampleRef};
use mmpack_core::CoreError;
use numpy::{IntoPyArray, PyArray1, PyArrayMethods};
use pyo3::prelude::*;

use crate::errors::PyCoreError;
use crate::mask::MaskArr;

/// One pack in Megatron's THD layout (`mmpack_core::batch::ThdLayout`), as numpy arrays.
#[pyclass(frozen, module = "mmpack._native", get_all)]
pub struct ThdLayout {
    input_ids: Py<PyArray1<i64>>,
    labels: Py<PyArray1<i64>>,
    loss_mask: Py<PyArray1<bool>>,
    position_ids: Py<PyArray1<i64>>,
    cu_seqlens: Py<PyArray1<i32>>,
    cu_seqlens_padded: Py<PyArray1<i32>>,
    max_seqlen: usize,
}

/// Build one pack. The per-sample lists are parallel (`names[i]` names sample `i` in errors);
/// in precomputed mode `masks` is read, otherwise `message_lengths` and `message_roles`.
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
) -> PyResult<ThdLayout> {
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
    Ok(ThdLayout {
        input_ids: out.input_ids.into_pyarray(py).unbind(),
        labels: out.labels.into_pyarray(py).unbind(),
        loss_mask: out.loss_mask.into_pyarray(py).unbind(),
        position_ids: out.position_ids.into_pyarray(py).unbind(),
        cu_seqlens: out.cu_seqlens.into_pyarray(py).unbind(),
        cu_seqlens_padded: out.cu_seqlens_padded.into_pyarray(py).unbind(),
        max_seqlen: out.max_seqlen,
    })
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<ThdLayout>()?;
    m.add_function(wrap_pyfunction!(build_pack, m)?)?;
    Ok(())
}
