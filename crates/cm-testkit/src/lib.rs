//! Test support shared by the workspace's real-device tests.
//!
//! - [`skip`]: the project's skip protocol. A test that needs an RDMA device and finds
//!   none appends `<test>: skipped: no RDMA device (<reason>)` to the file named by
//!   [`SKIP_LOG_VAR`] and says it on stderr; `cargo xtask ci` counts these lines, and
//!   inside the VM (where the devices exist) any such line fails the run.
//! - [`addresses`]: the VM's two soft-RoCE test addresses, or a recorded skip
//!   ([`probe_addresses`]: the same probe, returning the reason instead).
//! - [`report`]: a line on stderr that libtest does not capture, for the console log.
//! - [`Figure`]: a benchmark figure's line, written by the benches and by tests that
//!   measure inside the VM, read back by `cargo xtask bench`; [`host_cpu`] and
//!   [`vm_machine`] name the machine they were measured on.
//!
//! ```
//! // Outside the VM there is no device: the test records its skip and returns.
//! if let Some(addrs) = cm_testkit::addresses("my_device_test") {
//!     println!("listen on {}, connect from {}", addrs.addr_a, addrs.addr_b);
//! }
//! ```

mod figure;

pub use figure::{keys as figure_keys, Figure, FIGURE_PREFIX};

use std::io::Write as _;
pub mod env;

/// The connection counts of the scale curve: what the benches run and the bench
/// report reads.
pub const SCALE_POINTS: [u32; 3] = [1_000, 10_000, 100_000];

mod fault_row;
mod nft;

pub use fault_row::{kernel_cm_ids, leaked_cm_ids, FaultRow, FAULT_PREFIX};

pub use nft::{parse_hits, rule_args, run_tool, CmMadRule, MadAction, RTU_ATTRIBUTE};

use std::net::IpAddr;
use std::path::Path;

/// The environment variable naming the skip log.
pub const SKIP_LOG_VAR: &str = env::SKIP_LOG;

/// Records that `test` skipped for want of an RDMA device, and why.
pub fn skip(test: &str, reason: &str) {
    let line = format!("{test}: skipped: no RDMA device ({reason})");
    if let Ok(path) = std::env::var(SKIP_LOG_VAR) {
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .unwrap_or_else(|e| panic!("cannot open {SKIP_LOG_VAR} {path}: {e}"));
        writeln!(file, "{line}").expect("write the skip log");
    }
    eprintln!("{line}");
}

/// Writes one line straight to the process's stderr: libtest captures `eprintln!` of
/// passing tests, and these lines are what the VM console log is read for.
pub fn report(line: &str) {
    let mut stderr = std::io::stderr().lock();
    let _ = writeln!(stderr, "{line}");
}

/// The VM's two test addresses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Addresses {
    /// The listener side's address (`CMNOTIFY_ADDR_A`, on soft-RoCE device A).
    pub addr_a: IpAddr,
    /// The connecting side's address (`CMNOTIFY_ADDR_B`, on soft-RoCE device B).
    pub addr_b: IpAddr,
}

/// Whether the test devices are iWARP (device A's `node_type` in sysfs reads `4: RNIC`,
/// as soft-iWARP's does once `rdma-devices siw` ran in the VM): no RTU to drop, and
/// nothing for notify to force. False where no device is named or readable.
pub fn iwarp() -> bool {
    env::var(env::DEV_A)
        .and_then(|dev| {
            std::fs::read_to_string(format!("/sys/class/infiniband/{dev}/node_type")).ok()
        })
        .is_some_and(|kind| kind.trim_start().starts_with("4:"))
}

/// On iWARP ([`iwarp`]), records `test` as skipped, because it needs what only
/// InfiniBand and RoCE have (`needs`: an RTU to drop, a notify that forces), and
/// returns true; false elsewhere.
pub fn skip_on_iwarp(test: &str, needs: &str) -> bool {
    let on_iwarp = iwarp();
    if on_iwarp {
        skip(
            test,
            &format!("iWARP device: {needs} exists only on InfiniBand and RoCE"),
        );
    }
    on_iwarp
}

/// The two devices' addresses, or `None` after recording a skip for `test`.
pub fn addresses(test: &str) -> Option<Addresses> {
    match probe_addresses() {
        Ok(addrs) => Some(addrs),
        Err(reason) => {
            skip(test, &reason);
            None
        }
    }
}

/// The two devices' addresses, or why there are none (the reason [`addresses`] records
/// in its skip line), recording nothing: for a caller that reports the reason itself,
/// as the benches do in their figures.
pub fn probe_addresses() -> Result<Addresses, String> {
    if !Path::new("/dev/infiniband/rdma_cm").exists() {
        return Err("/dev/infiniband/rdma_cm does not exist".into());
    }
    let has_device = std::fs::read_dir("/sys/class/infiniband")
        .map(|mut entries| entries.next().is_some())
        .unwrap_or(false);
    if !has_device {
        return Err("/sys/class/infiniband is empty".into());
    }
    let addr = |name: &str| std::env::var(name).ok().and_then(|v| v.parse().ok());
    let (Some(addr_a), Some(addr_b)) = (addr(env::ADDR_A), addr(env::ADDR_B)) else {
        return Err(
            "a device exists but CMNOTIFY_ADDR_A/CMNOTIFY_ADDR_B name no test addresses".into(),
        );
    };
    Ok(Addresses { addr_a, addr_b })
}

/// The soft-RoCE VM for a report's machine column, with how the measured code was
/// built when that is known (see [`env::BENCH_BUILD`]).
pub fn vm_machine(build: Option<&str>) -> String {
    let vm = "VM (qemu TCG, soft-RoCE; absolute times are emulation";
    match build {
        Some(build) => format!("{vm}; built {build})"),
        None => format!("{vm})"),
    }
}

/// The host's CPU for a report's machine column: "`model name`, `N` cores", from `/proc/cpuinfo`.
pub fn host_cpu() -> String {
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|info| {
            info.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".to_string());
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    format!("{model}, {cores} cores")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_skip_is_one_line_in_the_log() {
        let log = std::env::temp_dir().join(format!("cm-testkit-skip-{}", std::process::id()));
        let _ = std::fs::remove_file(&log);
        // Only this test sets the variable, and it restores nothing else.
        std::env::set_var(SKIP_LOG_VAR, &log);
        skip("t1", "none here");
        skip("t2", "still none");
        std::env::remove_var(SKIP_LOG_VAR);
        let text = std::fs::read_to_string(&log).expect("the log was written");
        let _ = std::fs::remove_file(&log);
        assert_eq!(
            text,
            "t1: skipped: no RDMA device (none here)\nt2: skipped: no RDMA device (still none)\n"
        );
    }
}
