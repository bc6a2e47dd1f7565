//! Shared parts of the notify-path benchmarks (`benches/notify_path.rs`, the
//! `cm-bench-real` binary and `cargo xtask bench`).
//!
//! - [`results`]: the figures criterion does not produce itself (allocation counts, peak
//!   memory per connection, scale outcomes, real-device ratios, skips), appended as
//!   tab-separated lines to one file that `cargo xtask bench` folds into its report.
//! - [`endpoint`]: the connection API at scale (an echo beside N idle connections).
//! - [`sim`]: ids and fixtures on the mock and simulated backends (an established
//!   simulated connection, an id answering like the kernel) and the scale runs.
//! - [`mod@reference`]: connection setup against rdma-core's `cmtime` server, with its own
//!   client (`cm-bench-setup`, run in the VM).
//! - [`cm_retries`]: the REQs and DREQs a client's device resent during a run (the
//!   kernel's IB CM counters), read beside each setup run.
//! - [`mod@server_instructions`]: the same servers' user-space instructions per
//!   connection, counted by callgrind in the VM.
//! - [`mod@shards`]: accepts per second of a `cmnotify` server with one endpoint and
//!   with two on their own threads.
//! - [`count`]: the scenarios whose instructions `cargo xtask bench --count` counts
//!   under callgrind (the `cm-bench-count` binary runs one).
//! - `real` (feature `rdma`): measurements on a real RDMA device: cm-sys notify, the
//!   lost-RTU trigger to ESTABLISHED through the pump, through the connection API
//!   (`Endpoint`) and through hand-written loops, and connection setup per step.
//!
//! ```
//! use cm_benches::sim::{scale_config, KernelLikeId};
//! use cm_core::{AsyncEventType, CmId, NotifyOutcome, QpNum};
//!
//! let id = KernelLikeId::new(QpNum(7));
//! assert_eq!(id.notify(AsyncEventType::CommEst), Ok(NotifyOutcome::Established));
//! assert_eq!(id.notify(AsyncEventType::CommEst), Ok(NotifyOutcome::AlreadyEstablished));
//! assert_eq!(scale_config(1000).rtu_loss, 0.1);
//! ```

#[cfg(feature = "rdma")]
pub mod real;

pub mod cm_retries;
pub mod count;
pub mod endpoint;
pub mod reference;
pub mod results;
pub mod server_instructions;
pub mod shards;
pub mod sim;

/// Whether the benches run in smoke mode (`CMNOTIFY_BENCH_SMOKE=1`, set by the CI smoke
/// step): small samples, and the largest scale point skipped.
pub fn smoke_mode() -> bool {
    std::env::var(cm_testkit::env::BENCH_SMOKE).is_ok_and(|v| v == "1")
}

/// What machine the figures come from, for the report: the VM (qemu TCG: absolute
/// times are emulation times) or the host's CPU.
pub fn machine_label() -> String {
    if std::env::var(cm_testkit::env::VM).is_ok_and(|v| v == "1") {
        // The build is named when `cargo xtask bench --vm` made it (the variable is
        // `cm_testkit::env::BENCH_BUILD`, read at compile time).
        return cm_testkit::vm_machine(option_env!("CMNOTIFY_BENCH_BUILD"));
    }
    format!("host ({})", cm_testkit::host_cpu())
}
