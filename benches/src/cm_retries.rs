//! The CM messages a client's device resent during one run: the kernel's IB CM counts
//! each retry of a REQ or a DREQ whose answer (REP, DREP) did not come within the CM
//! response timeout (`/sys/class/infiniband/DEV/ports/1/cm_tx_retries/{req,dreq}`).
//! cm-sys's `PortCounters` reads the same files (`cm_tx_retries/req`); this reader is
//! the setup bench's own because that bench is built without cm-sys, so without the
//! native libraries, and reads a device no process of its own has open.
//!
//! A retried REQ waits out a timeout of seconds: under the VM's emulation the connect
//! step of a few thousand connections is made of such waits as much as of either
//! server's work (about half of 5000 REQs were resent for rdma-core's `cmtime` server
//! and for a `cmnotify` server alike), which is why single runs of that step range
//! widely. Counted beside each run, the retries say whether a slower step was a slower
//! server or more requests waiting out a timeout.

use std::path::Path;

/// Retries counted on one device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CmRetries {
    /// REQs resent (no REP, REJ or MRA within the timeout).
    pub req: u64,
    /// DREQs resent (no DREP within the timeout).
    pub dreq: u64,
}

impl CmRetries {
    /// What was counted from `before` to `self` (a counter that went down, as after a
    /// device was re-added, counts 0).
    pub fn since(self, before: CmRetries) -> CmRetries {
        CmRetries {
            req: self.req.saturating_sub(before.req),
            dreq: self.dreq.saturating_sub(before.dreq),
        }
    }
}

/// The counters of port 1 of `device` under the sysfs `root` (`/sys` on a live system);
/// `None` where the device or its CM counters are not there (no IB CM on the device, or
/// not Linux).
pub fn read_in(root: &Path, device: &str) -> Option<CmRetries> {
    let dir = root
        .join("class/infiniband")
        .join(device)
        .join("ports/1/cm_tx_retries");
    let counter = |name: &str| -> Option<u64> {
        std::fs::read_to_string(dir.join(name))
            .ok()?
            .trim()
            .parse()
            .ok()
    };
    Some(CmRetries {
        req: counter("req")?,
        dreq: counter("dreq")?,
    })
}

/// The counters of the client's device in the VM (`CMNOTIFY_DEV_B`), if it has them.
pub fn client_device() -> Option<CmRetries> {
    let device = cm_testkit::env::var(cm_testkit::env::DEV_B)?;
    read_in(Path::new("/sys"), &device)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_are_read_from_the_ports_retry_files_and_differenced() {
        let root = std::env::temp_dir().join(format!("cm-retries-{}", std::process::id()));
        let dir = root.join("class/infiniband/rxeB/ports/1/cm_tx_retries");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("req"), "2658\n").unwrap();
        assert_eq!(read_in(&root, "rxeB"), None, "no dreq file: no figure");
        std::fs::write(dir.join("dreq"), "3\n").unwrap();
        let after = read_in(&root, "rxeB").unwrap();
        assert_eq!(after, CmRetries { req: 2658, dreq: 3 });
        assert_eq!(read_in(&root, "rxeA"), None);
        let before = CmRetries { req: 600, dreq: 5 };
        assert_eq!(after.since(before), CmRetries { req: 2058, dreq: 0 });
        std::fs::remove_dir_all(&root).unwrap();
    }
}
