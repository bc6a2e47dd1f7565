//! Fuzz target: see [`cmnotify_fuzz::decode_checks::async_event`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| cmnotify_fuzz::decode_checks::async_event(data));
