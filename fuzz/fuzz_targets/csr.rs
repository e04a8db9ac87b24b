#![no_main]
//! Fuzz target: see `mmpack_fuzz::csr_check`.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| mmpack_fuzz::csr_check::check(data));
