//! Fuzz target bodies for the notify path's decoders and the simulated fabric.
//!
//! Each target's body is a plain function of the input bytes, so that the committed
//! seed corpus (`fuzz/corpus/<target>/`) also runs as an ordinary test on the stable
//! toolchain (`crates/cm-mock/tests/fuzz_corpus.rs` and, for `endpoint_ops`,
//! `crates/cm-verbs/tests/endpoint_proptest.rs`, for `handle_ops`
//! `crates/cm-verbs/tests/handles_proptest.rs` include these files).

pub mod corpus;
pub mod decode_checks;
pub mod endpoint_ops;
pub mod handle_ops;
pub mod input;
pub mod sim_ops;
