//! The one error type of the core. Every variant maps to a typed Python exception
//! in `rust/py/src/errors.rs` (exhaustive match, so adding a variant forces a mapping).
//! Each area keeps its variants in its own section below.
use std::fmt;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CoreError {
    // --- shared ---
    /// Index arithmetic left the representable range.
    IndexOverflow { what: &'static str },
    // --- csr / intern ---
    // --- packing ---
    // --- mask / batch ---
    // --- gather ---
}

impl fmt::Display for CoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            // --- shared ---
            Self::IndexOverflow { what } => {
                write!(f, "index arithmetic overflowed while computing {what}")
            }
            // --- csr / intern ---
            // --- packing ---
            // --- mask / batch ---
            // --- gather ---
        }
    }
}

impl std::error::Error for CoreError {}

pub type CoreResult<T> = Result<T, CoreError>;
