//! Fuzz target: see [`cmnotify_fuzz::decode_checks::errno_mapping`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| cmnotify_fuzz::decode_checks::errno_mapping(data));
