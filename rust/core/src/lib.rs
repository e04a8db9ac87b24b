//! mmpack-core: the pure-Rust core of mmpack. No Python here: plain slices in,
//! `Vec`s and `Result<_, CoreError>` out. The `mmpack-py` crate binds it.
#![forbid(unsafe_code)]

pub mod alloc;
pub mod batch;
pub mod csr;
pub mod error;
pub mod gather;
pub mod intern;
pub mod mask;
pub mod packing;
pub mod payload;

pub use error::{CoreError, CoreResult};
