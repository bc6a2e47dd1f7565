//! Fuzz target bodies for the notify path's decoders and the simulated fabric.
//!
//! Each target's body is a plain function of the input bytes, so that the committed
//! seed corpus (`fuzz/corpus/<target>/`) also runs as an ordinary test on the stable
//! toolchain (`crates/cm-mock/tests/fuzz_corpus.rs` includes these files).

pub mod decode_checks;
pub mod input;
pub mod sim_ops;
