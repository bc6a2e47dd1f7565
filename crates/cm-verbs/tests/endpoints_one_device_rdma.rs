//! Several endpoints of one process on one device, each driven by its own thread (one
//! per core, as a server shards its listeners): each rescues its own connections whose
//! RTU nftables drops. The device's asynchronous events are one stream whoever reads
//! it; on the device that raises COMM_EST each endpoint must get the COMM_EST of each of
//! its own QPs, whichever endpoint read it, and none of another's. Without a device each
//! test records a skip.
#![cfg(feature = "rdma")]

mod common;

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use cm_testkit::{addresses, report, CmMadRule};
use cm_verbs::{EstablishedVia, Event, ListenOptions, PumpCounters};

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
        server
            .listen(
                listen,
                ListenOptions {
                    establish_timeout: Some(Duration::from_secs(40)),
                    ..ListenOptions::default()
                },
            )
            .expect("listen");
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
        let mut closed = 0;
        while closed < EACH {
            match server.next_event(WAIT).expect("a close within the wait") {
                Event::Closed { .. } => closed += 1,
                Event::Established { .. } => panic!("a second ESTABLISHED"),
                _ => {}
            }
        }
        assert_eq!(server.connection_count(), 0);
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
