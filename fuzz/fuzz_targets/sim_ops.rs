//! Fuzz target: see [`cmnotify_fuzz::sim_ops::run`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| cmnotify_fuzz::sim_ops::run(data));
