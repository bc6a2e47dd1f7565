//! Several endpoints of one process on one device, each driven by its own thread (one
//! per core, as a server shards its listeners): each rescues its own connections whose
//! RTU nftables drops. The device's asynchronous events are one stream whoever reads
//! it; on the device that raises COMM_EST each endpoint must get the COMM_EST of each of
//! its own QPs, whichever endpoint read it, and none of another's. The device removed
//! under both: each closes what it has on it and lets go of the device, and the kernel's
//! removal completes. Without a device each test records a skip.
#![cfg(feature = "rdma")]

mod common;

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use cm_testkit::{addresses, kernel_cm_ids, leaked_cm_ids, report, CmMadRule, FaultRow};
use cm_verbs::{EstablishedVia, ListenOptions, PumpCounters};

const WAIT: Option<Duration> = Some(Duration::from_secs(60));
/// Connections per server endpoint.
const EACH: usize = 3;
/// Whether the loaded soft-RoCE raises COMM_EST (the patched module of the VM).
const COMM_EST_PARAM: &str = "/sys/module/rdma_rxe/parameters/comm_est";

/// A server endpoint on its own thread: listens on `listen`, accepts `EACH`
/// connections, echoes one message on each, and waits until each is closed; how each
/// was established and the pump's counters.
fn server(
    listen: SocketAddr,
    listening: std::sync::mpsc::Sender<()>,
) -> std::thread::JoinHandle<(Vec<EstablishedVia>, PumpCounters)> {
    std::thread::spawn(move || {
        let mut server = common::endpoint();
        common::listen_for_rescues(&mut server, listen);
        listening.send(()).expect("the test waits");
        let mut vias = Vec::new();
        for _ in 0..EACH {
            let conn = server.accept(WAIT).expect("accept");
            vias.push(
                server
                    .info(conn)
                    .expect("info")
                    .established
                    .expect("established"),
            );
            let message = server.recv(conn, WAIT).expect("the client's message");
            server.send(conn, &message).expect("echo");
        }
        common::all_closed(&mut server, EACH);
        (vias, server.counters())
    })
}

/// One client endpoint connecting from `src` to each address in turn, all at once.
fn clients(src: IpAddr, to: Vec<SocketAddr>) {
    let mut client = common::endpoint();
    let conns: Vec<_> = to
        .iter()
        .map(|dst| client.connect(*dst, common::from(src)).expect("connect"))
        .collect();
    for &conn in &conns {
        client.established(conn, WAIT).expect("client established");
        client.send(conn, b"hello").expect("send");
    }
    for &conn in &conns {
        assert_eq!(client.recv(conn, WAIT).expect("echo"), b"hello");
        client.disconnect(conn).expect("disconnect");
    }
}

#[test]
fn two_endpoints_on_one_device_each_rescue_their_own_connections() {
    const TEST: &str = "two_endpoints_on_one_device_each_rescue_their_own_connections";
    let Some(addrs) = addresses(TEST) else {
        return;
    };
    let Some(rule) = CmMadRule::drop_rtus(TEST, "endpoints_one_device", addrs.addr_a) else {
        return;
    };
    let raises_comm_est = std::fs::read_to_string(COMM_EST_PARAM)
        .map(|v| v.trim() == "Y")
        .unwrap_or(false);
    let listens = [
        SocketAddr::new(addrs.addr_a, 7530),
        SocketAddr::new(addrs.addr_a, 7531),
    ];
    let (listening, ready) = std::sync::mpsc::channel();
    let servers: Vec<_> = listens
        .iter()
        .map(|&listen| server(listen, listening.clone()))
        .collect();
    for _ in &listens {
        ready.recv().expect("a server listens");
    }
    // Interleaved: the two endpoints' QPs are made, raise COMM_EST and are read side by
    // side.
    let to: Vec<SocketAddr> = (0..EACH).flat_map(|_| listens).collect();
    clients(addrs.addr_b, to);
    let results: Vec<_> = servers
        .into_iter()
        .map(|s| s.join().expect("server thread"))
        .collect();
    let dropped = rule.hits().expect("rule counter");
    report(&format!(
        "two endpoints on one device (COMM_EST raised: {raises_comm_est}), RTUs dropped \
         {dropped}: {results:?}"
    ));
    assert!(dropped >= 2 * EACH as u64, "every RTU dropped ({dropped})");
    for (vias, counters) in &results {
        assert!(
            vias.iter()
                .all(|via| matches!(via, EstablishedVia::Notify(_))),
            "every connection rescued by notify: {vias:?}"
        );
        assert_eq!(counters.forced, EACH as u64, "{counters:?}");
        assert_eq!(
            counters.unrouted, 0,
            "no event of another's QP: {counters:?}"
        );
        // Each QP's COMM_EST reached the endpoint that owns it, whichever read it.
        let comm_est = if raises_comm_est { EACH as u64 } else { 0 };
        assert_eq!(counters.comm_est, comm_est, "{counters:?}");
    }
}

/// A server endpoint on its own thread that accepts one connection on `listen`, says
/// so, then waits until the device's removal closed its listener and its connection;
/// how many devices, connections and listeners it still holds then.
fn removed_under(
    listen: SocketAddr,
    accepted: std::sync::mpsc::Sender<()>,
) -> std::thread::JoinHandle<(usize, usize, usize)> {
    std::thread::spawn(move || {
        let mut server = common::endpoint();
        let listener = server
            .listen(listen, ListenOptions::default())
            .expect("listen");
        let conn = server.accept(WAIT).expect("accept");
        accepted.send(()).expect("the test waits");
        common::closed_by_removal(&mut server, listener, conn);
        (
            server.device_count(),
            server.connection_count(),
            server.listener_count(),
        )
    })
}

#[test]
fn the_device_removed_under_two_endpoints_closes_both_and_the_removal_completes() {
    const TEST: &str =
        "the_device_removed_under_two_endpoints_closes_both_and_the_removal_completes";
    let Some(addrs) = addresses(TEST) else {
        return;
    };
    let Some((device, netdev)) = common::device_to_remove(TEST) else {
        return;
    };
    let baseline = kernel_cm_ids().expect("the rdma tool lists CM ids");
    let listens = [
        SocketAddr::new(addrs.addr_a, 7532),
        SocketAddr::new(addrs.addr_a, 7533),
    ];
    let (accepted, each_accepted) = std::sync::mpsc::channel();
    let servers: Vec<_> = listens
        .iter()
        .map(|&listen| removed_under(listen, accepted.clone()))
        .collect();
    let src = addrs.addr_b;
    let client = std::thread::spawn(move || {
        let mut client = common::endpoint();
        let conns: Vec<_> = listens
            .iter()
            .map(|&dst| common::connected(&mut client, src, dst))
            .collect();
        // Until the peer's removal reaches this side, in any form (bounded).
        for conn in conns {
            let _ = client.recv(conn, Some(Duration::from_secs(60)));
        }
    });
    for _ in &listens {
        each_accepted.recv().expect("a server accepted");
    }
    let _add_back = common::AddBack {
        device: device.clone(),
        netdev,
    };
    let removal = common::remove_device(&device);
    for server in servers {
        let held = server.join().expect("server thread");
        assert_eq!(
            held,
            (0, 0, 0),
            "devices, connections, listeners still held"
        );
    }
    // Both endpoints let go of the device: the kernel's removal completes.
    common::removal_completes(removal);
    client.join().expect("client thread");
    report(&format!(
        "removal under two endpoints: both closed their listener and connection, \
         `rdma link delete {device}` returned"
    ));
    FaultRow {
        fault: "device removed under two endpoints of one process".into(),
        connections: 2,
        established: 2,
        rescued: 0,
        failed: 2,
        leaked_ids: leaked_cm_ids(baseline),
    }
    .report();
}
