//! What the real-device tests of the connection API share: endpoints on the real
//! backend, a client connection from the VM's second address, and a guard that adds a
//! removed soft-RoCE device back.
#![allow(dead_code)] // each test binary uses its own part

use std::net::{IpAddr, SocketAddr};
use std::process::Command;
use std::time::Duration;

use cm_verbs::rdma::RdmaTransport;
use cm_verbs::{ConnectOptions, ConnectionId, Endpoint};

/// How long a device test waits for any one step.
pub(crate) const WAIT: Option<Duration> = Some(Duration::from_secs(60));

/// An endpoint on the real backend.
pub(crate) fn endpoint() -> Endpoint<RdmaTransport> {
    Endpoint::new(RdmaTransport::new().expect("an RDMA transport"))
}

/// An endpoint on the real backend whose connections have queues of their own.
pub(crate) fn endpoint_own_queues() -> Endpoint<RdmaTransport> {
    let transport = RdmaTransport::new().expect("an RDMA transport");
    Endpoint::with_options(transport, cm_verbs::EndpointOptions::own_queues())
}

/// Connect options resolving from `src` (any port).
pub(crate) fn from(src: IpAddr) -> ConnectOptions<SocketAddr> {
    ConnectOptions {
        source: Some(SocketAddr::new(src, 0)),
        ..ConnectOptions::default()
    }
}

/// Connects `client` from `src` to `dst` and waits until it is established.
pub(crate) fn connected(
    client: &mut Endpoint<RdmaTransport>,
    src: IpAddr,
    dst: SocketAddr,
) -> ConnectionId {
    let conn = client.connect(dst, from(src)).expect("connect");
    client.established(conn, WAIT).expect("client established");
    conn
}

/// Listens on `addr` with an establish timeout long enough for a lost RTU's rescue
/// under emulation (40 s).
pub(crate) fn listen_for_rescues(server: &mut Endpoint<RdmaTransport>, addr: SocketAddr) {
    let options = cm_verbs::ListenOptions {
        establish_timeout: Some(Duration::from_secs(40)),
        ..cm_verbs::ListenOptions::default()
    };
    server.listen(addr, options).expect("listen");
}

/// Waits until `n` connections of `server` have closed, each reported once and none
/// established again meanwhile; then none is left.
pub(crate) fn all_closed(server: &mut Endpoint<RdmaTransport>, n: usize) {
    let mut closed = 0;
    while closed < n {
        match server.next_event(WAIT).expect("a close within the wait") {
            cm_verbs::Event::Closed { .. } => closed += 1,
            cm_verbs::Event::Established { .. } => panic!("a second ESTABLISHED"),
            _ => {}
        }
    }
    assert_eq!(server.connection_count(), 0);
}

/// Runs the `rdma` tool with `args`.
pub(crate) fn rdma(args: &[&str]) -> std::process::Output {
    Command::new("rdma").args(args).output().expect("run rdma")
}

/// Adds the soft-RoCE device back on its netdev when the test ends, however it ends, and
/// waits until its port is active, so that later tests in the same VM still have it.
pub(crate) struct AddBack {
    pub(crate) device: String,
    pub(crate) netdev: String,
}

impl Drop for AddBack {
    fn drop(&mut self) {
        let show = rdma(&["link", "show", &format!("{}/1", self.device)]);
        if show.status.success() {
            return;
        }
        let added = rdma(&[
            "link",
            "add",
            &self.device,
            "type",
            "rxe",
            "netdev",
            &self.netdev,
        ]);
        assert!(
            added.status.success(),
            "rdma link add: {}",
            String::from_utf8_lossy(&added.stderr)
        );
        for _ in 0..200 {
            let show = rdma(&["link", "show", &format!("{}/1", self.device)]);
            if String::from_utf8_lossy(&show.stdout).contains("state ACTIVE") {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!("{} did not come back ACTIVE", self.device);
    }
}

/// Asserts how a server connection whose every RTU was dropped got established: rescued
/// by notify on InfiniBand and RoCE; on iWARP by the handshake itself (the MPA exchange
/// has no RTU to lose, and notify is never called there).
pub(crate) fn assert_rescued(via: cm_verbs::EstablishedVia, what: &str) {
    if cm_testkit::iwarp() {
        assert_eq!(via, cm_verbs::EstablishedVia::Handshake, "{what} (iWARP)");
    } else {
        assert!(
            matches!(via, cm_verbs::EstablishedVia::Notify(_)),
            "{what}: rescued by notify, got {via:?}"
        );
    }
}

/// Asserts that `rule` dropped at least `rtus` RTUs; on iWARP, that it saw nothing (its
/// match is RoCE's CM MADs on UDP 4791; iWARP sets up over TCP).
pub(crate) fn assert_rtus_dropped(rule: &cm_testkit::CmMadRule, rtus: u64) {
    let hits = rule.hits().expect("the rule's counter");
    if cm_testkit::iwarp() {
        assert_eq!(hits, 0, "no RoCE CM MAD on iWARP");
    } else {
        assert!(
            hits >= rtus,
            "{hits} RTUs dropped, {rtus} expected at least"
        );
    }
}

/// How many connections the pump forced when `rescued` were rescued: all of them, or
/// none on iWARP (nothing to force).
pub(crate) fn forced(rescued: u64) -> u64 {
    if cm_testkit::iwarp() {
        0
    } else {
        rescued
    }
}

/// The device under `listener` and `conn` removed: waits until `server` reported both
/// closed with `DeviceRemoved` (other events are reported as seen).
pub(crate) fn closed_by_removal(
    server: &mut Endpoint<RdmaTransport>,
    listener: cm_verbs::ListenerId,
    conn: ConnectionId,
) {
    use cm_verbs::{CloseReason, Event};
    let (mut listener_closed, mut conn_closed) = (false, false);
    while !(listener_closed && conn_closed) {
        match server
            .next_event(WAIT)
            .expect("the removal within the wait")
        {
            Event::ListenerClosed {
                listener: l,
                reason,
            } => {
                assert_eq!((l, reason), (listener, CloseReason::DeviceRemoved));
                listener_closed = true;
            }
            Event::Closed { conn: c, reason } => {
                assert_eq!((c, reason), (conn, CloseReason::DeviceRemoved));
                conn_closed = true;
            }
            other => cm_testkit::report(&format!("removal: also saw {other:?}")),
        }
    }
}

/// `rdma link delete` of `device` on its own thread: its output once it returns.
pub(crate) fn remove_device(device: &str) -> std::thread::JoinHandle<std::process::Output> {
    let device = device.to_string();
    std::thread::spawn(move || rdma(&["link", "delete", &device]))
}

/// Asserts that the removal `remove_device` started returns, successfully, within 60 s:
/// the kernel's removal waits for every id and device context of ours on the device.
pub(crate) fn removal_completes(removal: std::thread::JoinHandle<std::process::Output>) {
    let (done, deleted) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = done.send(removal.join());
    });
    let output = deleted
        .recv_timeout(Duration::from_secs(60))
        .expect("rdma link delete returned: the removal did not hang on us")
        .expect("removal thread");
    assert!(
        output.status.success(),
        "rdma link delete: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// Device A and its netdev, to remove and add back; `None` (a skip recorded for `test`)
/// where the environment names none.
pub(crate) fn device_to_remove(test: &str) -> Option<(String, String)> {
    match (
        std::env::var(cm_testkit::env::DEV_A),
        std::env::var(cm_testkit::env::NETDEV_A),
    ) {
        (Ok(device), Ok(netdev)) => Some((device, netdev)),
        _ => {
            cm_testkit::skip(
                test,
                "CMNOTIFY_DEV_A/CMNOTIFY_NETDEV_A name no device to remove",
            );
            None
        }
    }
}
