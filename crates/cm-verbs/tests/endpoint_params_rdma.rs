//! Connection parameters on the real kernel (soft-RoCE in the VM): what each side's QP
//! holds after ESTABLISHED, read back with `ibv_query_qp`, when both sides ask for
//! values other than the default. Without a device the test records a skip.
//!
//! What the kernel applies (`drivers/infiniband/core/cm.c`: `ib_send_cm_req`,
//! `cm_req_handler`, `ib_send_cm_rep`, `cm_rep_handler`, then `cm_init_qp_rtr_attr` /
//! `cm_init_qp_rts_attr`; librdmacm moves a user QP with those attributes, overriding
//! the depths only with the accepting side's explicit values): the read depths of both
//! QPs come from the REP (crossed over on the active side), the transport retry count
//! from the REQ, and each side's RNR retry count from the other side's message.
//!
//! The id options (`rdma_set_option`, `cma.c`: `rdma_set_service_type`,
//! `rdma_set_ack_timeout`, applied in `cma_resolve_iboe_route` and
//! `rdma_init_qp_attr`): the active side's type of service travels in the REQ's path and
//! becomes both QPs' traffic class; each side's ACK timeout is its own QP's.
#![cfg(feature = "rdma")]

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use cm_testkit::{addresses, report};
use cm_verbs::core::IdOptions;
use cm_verbs::sys::{PortCounters, QpAttributes, QpState};
use cm_verbs::{
    CloseReason, ConnError, ConnectOptions, ConnectionParams, Event, ListenOptions, QpErrorDetail,
    QueueCaps, WcStatus,
};

/// The active side's request. Depths are powers of two: soft-RoCE rounds a depth up
/// to one, and these must come back as set.
const ACTIVE: ConnectionParams = ConnectionParams {
    responder_resources: 4,
    initiator_depth: 4,
    retry_count: 5,
    rnr_retry_count: 3,
    min_rnr_timer: Some(12),
};

/// The accepting side's answer, each value distinct from the request's so that the
/// test tells whose value each QP holds.
const PASSIVE: ConnectionParams = ConnectionParams {
    responder_resources: 8,
    initiator_depth: 2,
    retry_count: 6,
    rnr_retry_count: 6,
    min_rnr_timer: Some(20),
};

/// Listens on `listen` with `listen_options`, connects to it with `connect_options`,
/// reads both QPs once established (the connection stays up until both are read: the
/// server reads its QP before it echoes), and answers (active QP, passive QP).
fn both_qps(
    listen: SocketAddr,
    listen_options: ListenOptions,
    connect_options: ConnectOptions<SocketAddr>,
) -> (QpAttributes, QpAttributes) {
    let mut server = common::endpoint();
    server.listen(listen, listen_options).expect("listen");
    let client = std::thread::spawn(move || -> QpAttributes {
        let mut client = common::endpoint();
        let conn = client.connect(listen, connect_options).expect("connect");
        client
            .established(conn, common::WAIT)
            .expect("client established");
        let attrs = client
            .cm_id(conn)
            .expect("the connection's id")
            .query_qp()
            .expect("ibv_query_qp, active side");
        client.send(conn, b"read").expect("send");
        client.recv(conn, common::WAIT).expect("echo");
        client.disconnect(conn).expect("disconnect");
        attrs
    });
    let conn = server.accept(common::WAIT).expect("accept");
    let passive = server
        .cm_id(conn)
        .expect("the connection's id")
        .query_qp()
        .expect("ibv_query_qp, passive side");
    let message = server.recv(conn, common::WAIT).expect("message");
    server.send(conn, &message).expect("echo");
    (client.join().expect("client thread"), passive)
}

#[test]
fn each_qp_holds_what_the_cm_negotiated_from_both_sides_parameters() {
    const TEST: &str = "each_qp_holds_what_the_cm_negotiated_from_both_sides_parameters";
    let Some(addrs) = addresses(TEST) else {
        return;
    };
    let listen = ListenOptions {
        params: PASSIVE,
        ..ListenOptions::default()
    };
    let connect = ConnectOptions {
        params: ACTIVE,
        ..common::from(addrs.addr_b)
    };
    let (active, passive) = both_qps(SocketAddr::new(addrs.addr_a, 7521), listen, connect);
    report(&format!(
        "params: active QP {active:?}, passive QP {passive:?}"
    ));
    for (side, attrs) in [("active", &active), ("passive", &passive)] {
        assert_eq!(attrs.state, QpState::Rts, "{side}: {attrs:?}");
        assert!(attrs.path_mtu.is_some(), "{side}: a path MTU: {attrs:?}");
    }
    // The REP decides both QPs' read depths, crossed over on the active side.
    assert_eq!(
        (passive.max_rd_atomic, passive.max_dest_rd_atomic),
        (PASSIVE.initiator_depth, PASSIVE.responder_resources),
        "passive QP: its own depths"
    );
    assert_eq!(
        (active.max_rd_atomic, active.max_dest_rd_atomic),
        (PASSIVE.responder_resources, PASSIVE.initiator_depth),
        "active QP: the REP's depths, crossed"
    );
    // Each side's RNR NAK timer on its own QP, set once it was in RTS.
    assert_eq!(active.min_rnr_timer, 12, "active QP min_rnr_timer");
    assert_eq!(passive.min_rnr_timer, 20, "passive QP min_rnr_timer");
    // The REQ's transport retry count, on both QPs.
    assert_eq!(active.retry_cnt, ACTIVE.retry_count, "active QP retry_cnt");
    assert_eq!(
        passive.retry_cnt, ACTIVE.retry_count,
        "passive QP retry_cnt"
    );
    // Each side's RNR retry count bounds the other side's sends.
    assert_eq!(
        passive.rnr_retry, ACTIVE.rnr_retry_count,
        "passive QP: the REQ's RNR retries"
    );
    assert_eq!(
        active.rnr_retry, PASSIVE.rnr_retry_count,
        "active QP: the REP's RNR retries"
    );
}

/// A client endpoint with one connection to `listen` from `src`, established.
fn established_client(
    listen: SocketAddr,
    src: std::net::IpAddr,
) -> (
    cm_verbs::Endpoint<cm_verbs::rdma::RdmaTransport>,
    cm_verbs::ConnectionId,
) {
    let mut client = common::endpoint();
    let conn = client.connect(listen, common::from(src)).expect("connect");
    client
        .established(conn, common::WAIT)
        .expect("client established");
    (client, conn)
}

/// A reader with queues of its own that stops taking messages: its receives are not
/// posted again, so the peer's SENDs meet RNR NAKs. With the listener's RNR retry count
/// at 1 (what bounds the client's sends), the client's connection ends with a typed
/// completion error after a retry, instead of its sends stalling forever as with the
/// default (7). The ports' counters (`CmId::port_counters`) show what the verbs do not:
/// the RNR NAKs the reader's device sent and the writer's device received and gave up
/// on; the reader's connection counts the two messages it holds.
#[test]
fn a_reader_that_stops_ends_its_peers_sends_with_bounded_rnr_retries() {
    const TEST: &str = "a_reader_that_stops_ends_its_peers_sends_with_bounded_rnr_retries";
    let Some(addrs) = addresses(TEST) else {
        return;
    };
    let mut server = common::endpoint_own_queues();
    let listen = SocketAddr::new(addrs.addr_a, 7522);
    let options = ListenOptions {
        params: ConnectionParams {
            rnr_retry_count: 1,
            ..ConnectionParams::default()
        },
        caps: QueueCaps {
            recv_depth: 2,
            ..QueueCaps::default()
        },
        ..ListenOptions::default()
    };
    server.listen(listen, options).expect("listen");
    let src = addrs.addr_b;
    let client = std::thread::spawn(move || {
        let (mut client, conn) = established_client(listen, src);
        let id = client.cm_id(conn).expect("the client's id");
        let (device, port) = id.device_port().expect("the client's device and port");
        let before = id.port_counters().expect("the client port's counters");
        // The IB CM counts what it sent on the port: this connection's REQ at least.
        assert!(
            before.get("cm_tx_msgs/req").is_some_and(|reqs| reqs >= 1),
            "the client port's CM counters: {:?}",
            before.values
        );
        let mut sent = 0;
        for _ in 0..10_000 {
            let reason = match client.send(conn, &[7; 64]) {
                Ok(()) => {
                    sent += 1;
                    continue;
                }
                Err(ConnError::SendQueueFull(_)) => match client.next_event(common::WAIT) {
                    Ok(Event::Closed { reason, .. }) => reason,
                    Ok(_) => continue,
                    Err(error) => panic!("client, after {sent} sends: {error}"),
                },
                Err(ConnError::Closed { reason, .. }) => reason,
                Err(error) => panic!("client send, after {sent}: {error}"),
            };
            let after = PortCounters::read(&device, port).expect("the counters again");
            return (sent, reason, after.since(&before));
        }
        panic!("10,000 sends to a reader that reads nothing all went through");
    });
    // Accepted, then nothing read: the two receives are used up and stay so.
    let conn = server.accept(common::WAIT).expect("accept");
    let server_before = server
        .cm_id(conn)
        .and_then(|id| Ok(id.port_counters()?))
        .expect("the server port's counters");
    let (sent, reason, client_grew) = client.join().expect("the client thread");
    let server_grew = server
        .cm_id(conn)
        .and_then(|id| Ok(id.port_counters()?))
        .expect("the server port's counters")
        .since(&server_before);
    // Nothing taken still: `accept` runs the endpoint (the completions of the two
    // messages are read, the messages held) and finds no one to accept.
    assert!(matches!(
        server.accept(Some(Duration::from_millis(200))),
        Err(ConnError::Timeout)
    ));
    let traffic = server
        .traffic(conn)
        .expect("the server's side, live or closed");
    report(&format!(
        "{TEST}: the client's connection ended after {sent} sends: {reason:?}; client port \
         rcvd_rnr_err +{:?}, retry_rnr_exceeded_err +{:?}; server port send_rnr_err +{:?}; \
         the server's connection: {traffic:?}",
        client_grew.get("rcvd_rnr_err"),
        client_grew.get("retry_rnr_exceeded_err"),
        server_grew.get("send_rnr_err"),
    ));
    assert_eq!(
        reason,
        CloseReason::QpError {
            detail: QpErrorDetail::Completion(WcStatus::RnrRetryExcErr)
        },
        "after {sent} sends"
    );
    assert!(sent > 2, "more sends than the reader's receives: {sent}");
    assert!(
        client_grew.get("rcvd_rnr_err").is_some_and(|&n| n >= 1),
        "the writer's device counts the RNR NAKs it received: {client_grew:?}"
    );
    assert!(
        client_grew
            .get("retry_rnr_exceeded_err")
            .is_some_and(|&n| n >= 1),
        "and the retries it gave up: {client_grew:?}"
    );
    assert!(
        server_grew.get("send_rnr_err").is_some_and(|&n| n >= 1),
        "the reader's device counts the RNR NAKs it sent: {server_grew:?}"
    );
    assert_eq!(
        (traffic.messages_received, traffic.bytes_received),
        (2, 128),
        "the reader holds the two messages its receives took"
    );
    assert_eq!(traffic.messages_sent, 0);
    server.disconnect(conn).expect("the server's side");
}

/// The same reader on shared queues (the default): nothing holds one peer back on a
/// shared receive queue, so the server ends the connection once the peer sends past
/// the receive depth (`ReceiveOverrun`), and the client sees it disconnected; nothing
/// stalls and the shared pool stays whole.
#[test]
fn a_reader_that_stops_on_shared_queues_ends_the_connection_past_its_depth() {
    const TEST: &str = "a_reader_that_stops_on_shared_queues_ends_the_connection_past_its_depth";
    let Some(addrs) = addresses(TEST) else {
        return;
    };
    let mut server = common::endpoint();
    let listen = SocketAddr::new(addrs.addr_a, 7523);
    let depth = 2;
    let options = ListenOptions {
        caps: QueueCaps {
            recv_depth: depth,
            ..QueueCaps::default()
        },
        ..ListenOptions::default()
    };
    server.listen(listen, options).expect("listen");
    let src = addrs.addr_b;
    let client = std::thread::spawn(move || -> (usize, CloseReason) {
        let (mut client, conn) = established_client(listen, src);
        // The flood starts once the server has accepted: a peer that floods before the
        // server read its ESTABLISHED is closed in setup, never accepted (a simulated
        // test covers that order).
        let go = client.recv(conn, common::WAIT).expect("the server's go");
        assert_eq!(go, b"go");
        let mut sent = 0;
        loop {
            match client.send(conn, &[7; 64]) {
                Ok(()) => sent += 1,
                Err(ConnError::SendQueueFull(_)) => {}
                Err(ConnError::Closed { reason, .. }) => return (sent, reason),
                Err(error) => panic!("client send, after {sent}: {error}"),
            }
            match client.next_event(Some(std::time::Duration::from_millis(10))) {
                Ok(Event::Closed { reason, .. }) => return (sent, reason),
                Ok(_) | Err(ConnError::Timeout) => {}
                Err(error) => panic!("client, after {sent} sends: {error}"),
            }
        }
    });
    // Accepted, then only processed, no message taken: they wait, and past the depth
    // the connection ends.
    let conn = server.accept(common::WAIT).expect("accept");
    server.send(conn, b"go").expect("go");
    let until = std::time::Instant::now() + common::WAIT.expect("a bound");
    while server.stats().closed_unreported == 0 {
        assert!(std::time::Instant::now() < until, "never closed");
        server.process().expect("process");
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    // What it held within the depth is delivered, then the close.
    let mut held = 0;
    let reason = loop {
        match server.poll().expect("poll") {
            Some(Event::Received { conn: from, .. }) if from == conn => held += 1,
            Some(Event::Closed { conn: from, reason }) if from == conn => break reason,
            Some(_) => {}
            None => panic!("the close was counted but not reported"),
        }
    };
    assert_eq!(held, depth as usize);
    let (sent, client_reason) = client.join().expect("the client thread");
    report(&format!(
        "{TEST}: the server closed the connection ({reason:?}) after the client sent {sent}; the client's close: {client_reason:?}"
    ));
    assert_eq!(reason, CloseReason::ReceiveOverrun { depth });
    assert_eq!(client_reason, CloseReason::Disconnected);
    assert!(sent > depth as usize, "more sends than the depth: {sent}");
    assert_eq!(server.stats().shared_queue_devices, 1);
}

/// `IdOptions` on the real kernel: the active side's type of service becomes both QPs'
/// traffic class (it travels in the REQ's path; the listener's own is not used), and
/// each side's ACK timeout is its own QP's. Without options, the timeouts the CM
/// derives are reported beside them.
#[test]
fn id_options_reach_each_qp() {
    const TEST: &str = "id_options_reach_each_qp";
    let Some(addrs) = addresses(TEST) else {
        return;
    };
    const TOS: u8 = 0x68; // DSCP 26 (AF31), ECN 0
    let run = |port: u16, listen_ids: IdOptions, connect_ids: IdOptions| {
        let listen = ListenOptions {
            id_options: listen_ids,
            ..ListenOptions::default()
        };
        let connect = ConnectOptions {
            id_options: connect_ids,
            ..common::from(addrs.addr_b)
        };
        both_qps(SocketAddr::new(addrs.addr_a, port), listen, connect)
    };
    let (active, passive) = run(7522, IdOptions::default(), IdOptions::default());
    report(&format!(
        "id options: none: active timeout {} tc {} sl {}, passive timeout {} tc {} sl {}",
        active.timeout,
        active.traffic_class,
        active.service_level,
        passive.timeout,
        passive.traffic_class,
        passive.service_level
    ));
    let (default_active, default_passive) = (active, passive);
    let listen_ids = IdOptions {
        ack_timeout: Some(14),
        type_of_service: Some(0x20),
        ..IdOptions::default()
    };
    let connect_ids = IdOptions {
        ack_timeout: Some(20),
        type_of_service: Some(TOS),
        ..IdOptions::default()
    };
    let (active, passive) = run(7523, listen_ids, connect_ids);
    report(&format!(
        "id options: set: active {active:?}, passive {passive:?}"
    ));
    assert_eq!(active.timeout, 20, "the active QP: its own ACK timeout");
    assert_eq!(
        passive.timeout, 14,
        "the passive QP: its listener's ACK timeout"
    );
    assert_eq!(
        active.traffic_class, TOS,
        "the active QP: its type of service"
    );
    assert_eq!(
        passive.traffic_class, TOS,
        "the passive QP: the request's traffic class, not its listener's"
    );
    assert_ne!(
        (default_active.timeout, default_active.traffic_class),
        (active.timeout, active.traffic_class),
        "the options changed what the defaults give"
    );
    assert_ne!(default_passive.timeout, passive.timeout);
}

/// The address options on IPv4 ids (`ipv6_only` on the listener, `reuse_addr` on both
/// sides) are taken by the kernel before bind, and the connection is made as without
/// them.
#[test]
fn address_options_on_ipv4_ids_are_taken_and_connect_as_before() {
    const TEST: &str = "address_options_on_ipv4_ids_are_taken_and_connect_as_before";
    let Some(v4) = addresses(TEST) else {
        return;
    };
    let listen = ListenOptions {
        id_options: IdOptions {
            ipv6_only: Some(false),
            reuse_addr: true,
            ..IdOptions::default()
        },
        ..ListenOptions::default()
    };
    let connect = ConnectOptions {
        id_options: IdOptions {
            reuse_addr: true,
            ..IdOptions::default()
        },
        ..common::from(v4.addr_b)
    };
    let (active, passive) = both_qps(SocketAddr::new(v4.addr_a, 7534), listen, connect);
    assert_eq!((active.state, passive.state), (QpState::Rts, QpState::Rts));
}
