//! Criterion benchmarks of the notify path; see `benches/` and `cargo xtask bench`.
