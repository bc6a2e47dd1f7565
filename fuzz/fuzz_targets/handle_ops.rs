//! Fuzz target: see [`cmnotify_fuzz::handle_ops::run`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| cmnotify_fuzz::handle_ops::run(data));
