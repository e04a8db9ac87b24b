#![no_main]
//! Fuzz target: see `mmpack_fuzz::gather_check`.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| mmpack_fuzz::gather_check::check(data));
