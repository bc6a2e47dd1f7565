//! Peer faults on the real kernel (soft-RoCE in the VM), against a server written only
//! against `Endpoint`: RTUs dropped at random at scale, and a peer killed mid-exchange
//! while another keeps being served. Without a device each test records a skip.
#![cfg(feature = "rdma")]

mod common;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use cm_testkit::{addresses, kernel_cm_ids, leaked_cm_ids, report, skip, CmMadRule, FaultRow};
use cm_verbs::{ConnectOptions, ConnectionId, EstablishedVia, Event, ListenOptions};

const WAIT: Option<Duration> = Some(Duration::from_secs(60));

#[test]
fn random_rtu_loss_over_200_connections_each_established_once() {
    const TEST: &str = "random_rtu_loss_over_200_connections_each_established_once";
    const N: usize = 200;
    let Some(addrs) = addresses(TEST) else {
        return;
    };
    let Some(nft) = CmMadRule::nft_from_env() else {
        return skip(TEST, "CMNOTIFY_NFT names no nft to drop RTUs with");
    };
    let baseline = kernel_cm_ids().expect("the rdma tool lists CM ids");
    // 30% of the RTUs to the passive side, chosen at random by the kernel.
    let rule = CmMadRule::install_with(
        &nft,
        "faults_random",
        addrs.addr_a,
        cm_testkit::RTU_ATTRIBUTE,
        "numgen random mod 10 < 3 counter drop",
    )
    .expect("install the random RTU drop");
    let listen = SocketAddr::new(addrs.addr_a, 7518);
    let mut server = common::endpoint();
    server
        .listen(
            listen,
            ListenOptions {
                backlog: 256,
                ..ListenOptions::default()
            },
        )
        .expect("listen");
    let src = SocketAddr::new(addrs.addr_b, 0);
    let client = std::thread::spawn(move || {
        let mut client = common::endpoint();
        let conns: Vec<ConnectionId> = (0..N)
            .map(|_| {
                let options = ConnectOptions {
                    source: Some(src),
                    ..ConnectOptions::default()
                };
                client.connect(listen, options).expect("connect")
            })
            .collect();
        for &conn in &conns {
            client.established(conn, WAIT).expect("client established");
            client.send(conn, b"x").expect("send");
        }
        for &conn in &conns {
            assert_eq!(client.recv(conn, WAIT).expect("echo"), b"x");
            client.disconnect(conn).expect("disconnect");
        }
    });
    let mut vias: HashMap<ConnectionId, EstablishedVia> = HashMap::new();
    let mut closed = 0;
    while closed < N {
        match server.next_event(WAIT).expect("progress within the wait") {
            Event::Established { conn, via, .. } => {
                assert!(vias.insert(conn, via).is_none(), "{conn} established twice");
            }
            Event::Received { conn, data } => server.send(conn, &data).expect("echo"),
            Event::Closed { conn, reason } => {
                assert!(
                    vias.contains_key(&conn),
                    "{conn} closed before established: {reason:?}"
                );
                closed += 1;
            }
            Event::Sent { .. } => {}
            other => report(&format!("random loss: also saw {other:?}")),
        }
    }
    client.join().expect("client thread");
    let dropped = rule.hits().expect("counter");
    let rescued = vias
        .values()
        .filter(|v| matches!(v, EstablishedVia::Notify(_)))
        .count();
    let raced = vias
        .values()
        .filter(|v| matches!(v, EstablishedVia::RtuWonRace(_)))
        .count();
    drop(server);
    let leaked = leaked_cm_ids(baseline);
    report(&format!(
        "random RTU loss: {raced} found established (EISCONN), {dropped} RTUs dropped"
    ));
    FaultRow {
        fault: "RTUs dropped at random (30%)".into(),
        connections: N as u64,
        established: vias.len() as u64,
        rescued: rescued as u64,
        failed: 0,
        leaked_ids: leaked,
    }
    .report();
    assert_eq!(vias.len(), N, "every connection established exactly once");
    assert!(dropped > 0, "the rule dropped RTUs");
    // Every dropped RTU left its connection to the notify path: rescued (or, when the
    // client's data and a retried REP's RTU crossed, found established: EISCONN).
    assert!(
        rescued > 0 && rescued + raced >= dropped.min(N as u64) as usize / 2,
        "{rescued} rescued, {raced} raced, {dropped} dropped"
    );
    assert_eq!(leaked, 0, "no CM id leaked");
}

#[test]
fn a_peer_killed_mid_exchange_is_one_closed_connection_and_the_other_is_served() {
    const TEST: &str =
        "a_peer_killed_mid_exchange_is_one_closed_connection_and_the_other_is_served";
    let Some(addrs) = addresses(TEST) else {
        return;
    };
    let baseline = kernel_cm_ids().expect("the rdma tool lists CM ids");
    let listen = SocketAddr::new(addrs.addr_a, 7519);
    let mut server = common::endpoint();
    server
        .listen(listen, ListenOptions::default())
        .expect("listen");
    let src = addrs.addr_b;
    // The peers, one after the other: the one that dies sends one message, then its
    // whole endpoint goes without a disconnect (ids destroyed, as when its process is
    // killed); the other is served as usual.
    let peers = std::thread::spawn(move || {
        let mut doomed = common::endpoint();
        let conn = common::connected(&mut doomed, src, listen);
        doomed.send(conn, b"last words").expect("send");
        doomed.recv(conn, WAIT).expect("echo");
        drop(doomed);

        let mut healthy = common::endpoint();
        let conn = common::connected(&mut healthy, src, listen);
        for i in 0..3u8 {
            healthy.send(conn, &[i]).expect("send");
            assert_eq!(healthy.recv(conn, WAIT).expect("echo"), [i]);
        }
        healthy.disconnect(conn).expect("disconnect");
    });
    let (mut established, mut closed, mut echoed) = (0u64, Vec::new(), 0);
    while closed.len() < 2 {
        match server.next_event(WAIT).expect("progress within the wait") {
            Event::Established { .. } => established += 1,
            Event::Received { conn, data } => {
                server.send(conn, &data).expect("echo");
                echoed += 1;
            }
            Event::Closed { conn, reason } => closed.push((conn, reason)),
            other => report(&format!("peer killed: also saw {other:?}")),
        }
    }
    peers.join().expect("the peers");
    report(&format!("peer killed: echoed {echoed}, closed {closed:?}"));
    let connections = server.connection_count();
    drop(server);
    FaultRow {
        fault: "a peer killed mid-exchange, another served".into(),
        connections: 2,
        established,
        rescued: 0,
        failed: 1,
        leaked_ids: leaked_cm_ids(baseline),
    }
    .report();
    assert_eq!(established, 2);
    assert_eq!(
        echoed, 4,
        "one message of the killed peer, three of the other"
    );
    assert_eq!(connections, 0, "the server ends on its own, nothing left");
}
