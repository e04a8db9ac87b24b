//! `mmpack._native`: thin bindings over `mmpack-core`. Converts, detaches, maps errors;
//! no algorithm lives here.
use pyo3::prelude::*;

mod batch;
mod errors;
mod gather;
mod mask;
mod packed;
mod packing;
mod payload;
mod placement;

#[pymodule(gil_used = false)]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    errors::register(m)?;
    packed::register(m)?;
    packing::register(m)?;
    placement::register(m)?;
    payload::register(m)?;
    mask::register(m)?;
    batch::register(m)?;
    gather::register(m)?;
    Ok(())
}
