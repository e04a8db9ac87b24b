#![no_main]
//! Fuzz target: see `mmpack_fuzz::batch_check`.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| mmpack_fuzz::batch_check::check(data));
