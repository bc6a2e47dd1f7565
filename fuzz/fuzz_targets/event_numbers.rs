//! Fuzz target: see [`cmnotify_fuzz::decode_checks::event_numbers`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| cmnotify_fuzz::decode_checks::event_numbers(data));
