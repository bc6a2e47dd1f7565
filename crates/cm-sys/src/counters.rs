//! A port's counters as the kernel publishes them in sysfs: the standard InfiniBand
//! port counters (`ports/<n>/counters/`, where the device keeps them) and the driver's
//! own (`ports/<n>/hw_counters/`: on soft-RoCE `rcvd_rnr_err`, `send_rnr_err`,
//! `retry_exceeded_err`, `retry_rnr_exceeded_err`, `sent_pkts`, ...; on mlx5
//! `rnr_nak_retry_err`, `local_ack_timeout_err`, ...). Verbs report RNR NAKs and
//! transport retries per QP only as the completion error once they are exhausted; how
//! many happened before is counted per port, by the device, under names of its own.
//! Beside them, on an InfiniBand or RoCE port, the kernel's IB CM counts the CM messages
//! of each kind it sent, resent, received and received twice (`ports/<n>/cm_tx_msgs/`,
//! `cm_tx_retries/`, `cm_rx_msgs/`, `cm_rx_duplicates/`): a REQ resent means no REP,
//! REJ or MRA came within the CM response timeout, a DREQ resent no DREP.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use cm_core::CmError;

/// Where the kernel publishes RDMA devices.
const SYSFS_DEVICES: &str = "/sys/class/infiniband";

/// The IB CM's counter groups of a port, one file per CM message kind (`req`, `rep`,
/// `rtu`, `dreq`, `drep`, ...).
const CM_GROUPS: [&str; 4] = [
    "cm_tx_msgs",
    "cm_tx_retries",
    "cm_rx_msgs",
    "cm_rx_duplicates",
];

/// A snapshot of one port's counters, by the names the kernel gives them. Counters
/// only grow (until the device is reset or removed): a rate is the difference of two
/// snapshots ([`PortCounters::since`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PortCounters {
    /// The device's name (`rxe0`, `mlx5_0`).
    pub device: String,
    /// The port (from 1).
    pub port: u8,
    /// Each counter the device publishes, by name; the driver's own (`hw_counters`)
    /// beside the standard ones (`counters`), a name in both keeping the driver's; the
    /// IB CM's named with their group (`cm_tx_retries/req`: REQs resent).
    pub values: BTreeMap<String, u64>,
}

impl PortCounters {
    /// Reads every counter of `device`'s `port`. [`CmError::InvalidArgument`] for a
    /// name that is not one device's (empty, `.`/`..`, or with a `/`); `ENODEV` when the
    /// device or port is not there; a counter file that cannot be read or parsed (some
    /// drivers publish write-only or text entries) is left out.
    pub fn read(device: &str, port: u8) -> Result<PortCounters, CmError> {
        Self::read_under(Path::new(SYSFS_DEVICES), device, port)
    }

    /// As [`PortCounters::read`], with the devices' directory given (tests).
    fn read_under(root: &Path, device: &str, port: u8) -> Result<PortCounters, CmError> {
        const OP: &str = "read port counters";
        if device.is_empty() || device == "." || device == ".." || device.contains('/') {
            return Err(CmError::InvalidArgument {
                op: OP,
                reason: "not a device name",
            });
        }
        let port_dir: PathBuf = root.join(device).join("ports").join(port.to_string());
        if !port_dir.is_dir() {
            return Err(CmError::from_errno(OP, libc::ENODEV));
        }
        let mut values = BTreeMap::new();
        for dir in ["counters", "hw_counters"] {
            read_group(&port_dir.join(dir), None, &mut values);
        }
        for group in CM_GROUPS {
            read_group(&port_dir.join(group), Some(group), &mut values);
        }
        Ok(PortCounters {
            device: device.to_owned(),
            port,
            values,
        })
    }

    /// One counter's value, if the device publishes it.
    pub fn get(&self, name: &str) -> Option<u64> {
        self.values.get(name).copied()
    }

    /// What each counter grew by since `earlier` (a counter that went back, the device
    /// having been reset, counts from zero); counters missing from `earlier` are taken
    /// whole.
    pub fn since(&self, earlier: &PortCounters) -> BTreeMap<String, u64> {
        self.values
            .iter()
            .map(|(name, &now)| {
                let before = earlier.get(name).unwrap_or(0);
                let grown = if now >= before { now - before } else { now };
                (name.clone(), grown)
            })
            .collect()
    }
}

/// Reads every counter file in `dir` into `values`, named `group/file` with a group;
/// a directory that is not there (a device without it) adds nothing, and a file that
/// cannot be read or is not a number is left out.
fn read_group(dir: &Path, group: Option<&str>, values: &mut BTreeMap<String, u64>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let Some(file) = entry.file_name().to_str().map(str::to_owned) else {
            continue;
        };
        let Ok(text) = std::fs::read_to_string(entry.path()) else {
            continue;
        };
        if let Ok(value) = text.trim().parse::<u64>() {
            let name = match group {
                Some(group) => format!("{group}/{file}"),
                None => file,
            };
            values.insert(name, value);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fake_device(root: &Path) {
        let port = root.join("rxe9/ports/1");
        std::fs::create_dir_all(port.join("hw_counters")).unwrap();
        std::fs::create_dir_all(port.join("counters")).unwrap();
        std::fs::write(port.join("hw_counters/rcvd_rnr_err"), "3\n").unwrap();
        std::fs::write(port.join("hw_counters/sent_pkts"), "120\n").unwrap();
        std::fs::write(port.join("hw_counters/lifespan"), "not a number\n").unwrap();
        std::fs::write(port.join("counters/port_xmit_data"), "4096\n").unwrap();
        std::fs::create_dir_all(port.join("cm_tx_retries")).unwrap();
        std::fs::write(port.join("cm_tx_retries/req"), "2\n").unwrap();
        std::fs::write(port.join("cm_tx_retries/dreq"), "0\n").unwrap();
    }

    #[test]
    fn both_directories_are_read_and_text_is_left_out() {
        let root = std::env::temp_dir().join(format!("cm-sys-counters-{}", std::process::id()));
        fake_device(&root);
        let counters = PortCounters::read_under(&root, "rxe9", 1).unwrap();
        assert_eq!(counters.get("rcvd_rnr_err"), Some(3));
        assert_eq!(counters.get("sent_pkts"), Some(120));
        assert_eq!(counters.get("port_xmit_data"), Some(4096));
        assert_eq!(counters.get("lifespan"), None);
        // The IB CM's, named with their group; a group the device lacks adds nothing.
        assert_eq!(counters.get("cm_tx_retries/req"), Some(2));
        assert_eq!(counters.get("cm_tx_retries/dreq"), Some(0));
        assert_eq!(counters.get("req"), None);
        assert!(!counters.values.keys().any(|k| k.starts_with("cm_rx_msgs")));
        let mut later = counters.clone();
        later.values.insert("sent_pkts".into(), 150);
        later.values.insert("rcvd_rnr_err".into(), 1); // reset since
        let grown = later.since(&counters);
        assert_eq!((grown["sent_pkts"], grown["rcvd_rnr_err"]), (30, 1));
        assert_eq!(
            PortCounters::read_under(&root, "rxe9", 2),
            Err(CmError::from_errno("read port counters", libc::ENODEV))
        );
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn a_path_is_not_a_device_name() {
        for name in ["", ".", "..", "../etc", "rxe0/ports"] {
            assert!(
                matches!(
                    PortCounters::read(name, 1),
                    Err(CmError::InvalidArgument { .. })
                ),
                "{name:?}"
            );
        }
    }
}
