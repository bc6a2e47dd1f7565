//! Real-kernel tests of the layers above cm-sys, kept apart so that dependencies point
//! one way: cm-sys tests only itself, and these tests (the notify pump forcing a lost
//! RTU's establish through COMM_EST or a receive completion, and the conformance suite's
//! real harness) depend on cm-sys, cm-verbs and cm-mock from above. They share cm-sys's
//! device-test fixtures (`crates/cm-sys/tests/common`). Outside the soft-RoCE VM every
//! test records a skip; `cargo xtask vm` runs them for real. Not published.
