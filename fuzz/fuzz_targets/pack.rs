#![no_main]
//! Fuzz target: see `mmpack_fuzz::pack_check`.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| mmpack_fuzz::pack_check::check(data));
