//! Fuzz checks for mmpack-core. Each `check` decodes raw fuzzer bytes (see [`bytes`]), calls
//! the public core API and asserts its invariants against a plain model. The same files are
//! compiled into `rust/core/tests/fuzz_regressions.rs`, which replays saved inputs in CI.
pub mod batch_check;
pub mod bytes;
pub mod csr_check;
pub mod gather_check;
pub mod mask_check;
pub mod pack_check;
