//! ADDR_CHANGE on the real kernel (soft-RoCE in the VM): a soft-RoCE device on an
//! active-backup bond of two veths, a listener bound to the bond's address, then the
//! active port taken down. The bond fails over and takes the other port's hardware
//! address (`fail_over_mac active`), the kernel's RDMA CM tells every id bound to the
//! bond (`cma_netdev_callback` on NETDEV_BONDING_FAILOVER, `cma_netdev_change`: the
//! id's source hardware address differs from the device's now), and the endpoint
//! reports `Event::ListenerAddressChanged`. Without a device the test records a skip.
#![cfg(feature = "rdma")]

mod common;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::process::Command;
use std::time::{Duration, Instant};

use cm_testkit::{addresses, report};
use cm_verbs::{Event, ListenOptions};

const BOND_ADDR: Ipv4Addr = Ipv4Addr::new(10, 77, 2, 1);

/// Runs `ip` with `args` (iproute2's, named by the VM's environment), failing the test
/// if it fails.
fn ip(args: &[&str]) {
    let ip = std::env::var("CMNOTIFY_IP").unwrap_or_else(|_| "ip".into());
    let out = Command::new(&ip).args(args).output().expect("run ip");
    assert!(
        out.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The bond, its ports and its soft-RoCE device, removed when the test ends.
struct Bond;

impl Bond {
    fn new() -> Bond {
        let bond = Bond;
        ip(&[
            "link",
            "add",
            "bondT",
            "type",
            "bond",
            "mode",
            "active-backup",
            "fail_over_mac",
            "active",
            "miimon",
            "50",
        ]);
        for port in ["portC", "portE"] {
            let peer = format!("{port}p");
            ip(&["link", "add", port, "type", "veth", "peer", "name", &peer]);
            ip(&["link", "set", port, "master", "bondT"]);
            ip(&["link", "set", &peer, "up"]);
            ip(&["link", "set", port, "up"]);
        }
        ip(&["link", "set", "bondT", "up"]);
        ip(&["addr", "add", &format!("{BOND_ADDR}/24"), "dev", "bondT"]);
        let out = common::rdma(&["link", "add", "rxeT", "type", "rxe", "netdev", "bondT"]);
        assert!(out.status.success(), "rdma link add rxeT: {out:?}");
        bond
    }

    fn read(file: &str) -> String {
        std::fs::read_to_string(format!("/sys/class/net/{file}"))
            .unwrap_or_default()
            .trim()
            .to_string()
    }
}

impl Drop for Bond {
    fn drop(&mut self) {
        // librdmacm keeps every device context it opened until its device list is
        // refreshed, and the removal waits for that context: refresh until it is done.
        let (done, finished) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = done.send(common::rdma(&["link", "delete", "rxeT"]));
        });
        let limit = Instant::now() + Duration::from_secs(30);
        while finished.try_recv().is_err() && Instant::now() < limit {
            let _ = cm_verbs::sys::refresh_devices();
            std::thread::sleep(Duration::from_millis(100));
        }
        let ip = std::env::var("CMNOTIFY_IP").unwrap_or_else(|_| "ip".into());
        for link in ["portC", "portE", "bondT"] {
            let _ = Command::new(&ip).args(["link", "delete", link]).output();
        }
    }
}

#[test]
fn a_bond_failover_is_reported_to_the_listener_bound_to_the_bond() {
    const TEST: &str = "a_bond_failover_is_reported_to_the_listener_bound_to_the_bond";
    if addresses(TEST).is_none() {
        return;
    }
    let _bond = Bond::new();
    let mut server = common::endpoint();
    let addr = SocketAddr::new(IpAddr::V4(BOND_ADDR), 7541);
    // The device's address table fills in shortly after the device is added.
    let started = Instant::now();
    let listener = loop {
        match server.listen(addr, ListenOptions::default()) {
            Ok(listener) => break listener,
            Err(_) if started.elapsed() < Duration::from_secs(10) => {
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(error) => panic!("listen on the bond's address: {error}"),
        }
    };
    let active = Bond::read("bondT/bonding/active_slave");
    let mac_before = Bond::read("bondT/address");
    ip(&["link", "set", &active, "down"]);
    // The device may tell of its GID table first (GID_CHANGE, an endpoint-wide
    // device event): every event is kept until the listener's.
    let mut heard = Vec::new();
    let wanted = Event::ListenerAddressChanged { listener };
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline && !heard.contains(&wanted) {
        match server.next_event(Some(Duration::from_millis(500))) {
            Ok(event) => heard.push(event),
            Err(cm_verbs::ConnError::Timeout) => {}
            Err(error) => panic!("next_event: {error}"),
        }
    }
    let mac_after = Bond::read("bondT/address");
    let now_active = Bond::read("bondT/bonding/active_slave");
    report(&format!(
        "addr change: active port {active} -> {now_active}, bond address {mac_before} -> {mac_after}, endpoint heard {heard:?}"
    ));
    assert_ne!(
        mac_before, mac_after,
        "the bond took the other port's address"
    );
    assert!(heard.contains(&wanted), "{heard:?}");
}
