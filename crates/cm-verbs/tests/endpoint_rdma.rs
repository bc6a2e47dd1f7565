//! The connection API on the real kernel (soft-RoCE in the VM): a server written only
//! against `Endpoint` rescues connections whose RTU nftables drops, with no application
//! code on the notify path, and two listeners on one device share its one reader.
//! Without a device each test records a skip.
#![cfg(feature = "rdma")]

mod common;

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use cm_testkit::{addresses, report, CmMadRule};
use cm_verbs::rdma::RdmaTransport;
use cm_verbs::{Endpoint, EstablishedVia, ListenOptions, Role};

const WAIT: Option<Duration> = Some(Duration::from_secs(30));

/// A client endpoint on its own thread: connects from `src` to every address, sends
/// `hello` on each once established, waits for the echo, disconnects.
fn echo_clients(src: IpAddr, to: Vec<SocketAddr>) -> std::thread::JoinHandle<Vec<EstablishedVia>> {
    std::thread::spawn(move || {
        let mut client = common::endpoint();
        let conns: Vec<_> = to
            .iter()
            .map(|dst| client.connect(*dst, common::from(src)).expect("connect"))
            .collect();
        let mut vias = Vec::new();
        for &conn in &conns {
            vias.push(client.established(conn, WAIT).expect("client established"));
            client.send(conn, b"hello").expect("send");
        }
        for &conn in &conns {
            assert_eq!(client.recv(conn, WAIT).expect("echo"), b"hello");
            client.disconnect(conn).expect("disconnect");
        }
        vias
    })
}

/// Accepts `n` connections, echoes one message on each, and returns how each was
/// established.
fn serve(server: &mut Endpoint<RdmaTransport>, n: usize) -> Vec<EstablishedVia> {
    let mut vias = Vec::new();
    for _ in 0..n {
        let conn = server.accept(WAIT).expect("accept");
        let info = server.info(conn).expect("info");
        assert_eq!(info.role, Role::Passive);
        vias.push(info.established.expect("established"));
        let message = server.recv(conn, WAIT).expect("the client's message");
        server.send(conn, &message).expect("echo");
    }
    vias
}

fn rescued(via: &EstablishedVia) -> bool {
    matches!(via, EstablishedVia::Notify(_))
}

#[test]
fn a_server_on_the_api_rescues_lost_rtus_with_no_application_code() {
    const TEST: &str = "a_server_on_the_api_rescues_lost_rtus_with_no_application_code";
    let Some(addrs) = addresses(TEST) else {
        return;
    };
    let Some(rule) = CmMadRule::drop_rtus(TEST, "endpoint_rtu", addrs.addr_a) else {
        return;
    };
    let mut server = common::endpoint();
    let listen = SocketAddr::new(addrs.addr_a, 7511);
    common::listen_for_rescues(&mut server, listen);
    let client = echo_clients(addrs.addr_b, vec![listen; 3]);
    let vias = serve(&mut server, 3);
    let client_vias = client.join().expect("client thread");
    let dropped = rule.hits().expect("rule counter");
    report(&format!("endpoint: server established via {vias:?}, client via {client_vias:?}, RTUs dropped {dropped}"));
    assert!(
        dropped >= 3,
        "every RTU was dropped on the wire ({dropped})"
    );
    assert!(
        vias.iter().all(rescued),
        "every connection rescued by notify: {vias:?}"
    );
    assert_eq!(server.counters().forced, 3);
    // The clients disconnect: each connection closes exactly once, with nothing else
    // reported established.
    common::all_closed(&mut server, 3);
}

#[test]
fn two_listeners_on_one_device_both_get_their_rescues() {
    const TEST: &str = "two_listeners_on_one_device_both_get_their_rescues";
    let Some(addrs) = addresses(TEST) else {
        return;
    };
    let Some(_rule) = CmMadRule::drop_rtus(TEST, "endpoint_two", addrs.addr_a) else {
        return;
    };
    let mut server = common::endpoint();
    let first = SocketAddr::new(addrs.addr_a, 7512);
    let second = SocketAddr::new(addrs.addr_a, 7513);
    let one = server
        .listen(first, ListenOptions::default())
        .expect("listen");
    let two = server
        .listen(second, ListenOptions::default())
        .expect("listen");
    assert_eq!(server.device_count(), 1, "one reader for the one device");
    let client = echo_clients(addrs.addr_b, vec![first, second]);
    let mut listeners = Vec::new();
    for _ in 0..2 {
        let conn = server.accept(WAIT).expect("accept");
        let info = server.info(conn).expect("info");
        assert!(rescued(&info.established.expect("established")), "{info:?}");
        listeners.push(info.listener.expect("a listener"));
        let message = server.recv(conn, WAIT).expect("message");
        server.send(conn, &message).expect("echo");
    }
    listeners.sort();
    assert_eq!(
        listeners,
        vec![one, two],
        "each listener got its connection rescued"
    );
    client.join().expect("client thread");
}

#[test]
fn a_waker_on_another_thread_ends_a_blocking_wait() {
    const TEST: &str = "a_waker_on_another_thread_ends_a_blocking_wait";
    let Some(addrs) = addresses(TEST) else {
        return;
    };
    let mut server = common::endpoint();
    server
        .listen(
            SocketAddr::new(addrs.addr_a, 7515),
            ListenOptions::default(),
        )
        .expect("listen");
    let waker = server.waker().expect("a waker");
    let stopper = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(200));
        waker.wake();
    });
    // No client: only the waker can end this wait before its 30 s.
    let woken = server.accept(WAIT);
    stopper.join().expect("waker thread");
    report(&format!("waker: accept answered {woken:?}"));
    assert!(
        matches!(woken, Err(cm_verbs::ConnError::Woken)),
        "{woken:?}"
    );
    // Consumed: the next wait waits (and times out) as usual.
    assert!(matches!(
        server.next_event(Some(Duration::from_millis(50))),
        Err(cm_verbs::ConnError::Timeout)
    ));
}

/// QPs made ahead of requests (`SharedCaps::ready_qps`) on the real kernel: a listener
/// on the device's address makes its shared queues and fills the pool before any
/// request (nothing taken yet); the next two accepts take ready QPs
/// (`EndpointStats::ready_qps_taken`), and their connections carry messages both ways
/// like any other.
#[test]
fn accepts_take_qps_made_ahead_of_their_requests() {
    const TEST: &str = "accepts_take_qps_made_ahead_of_their_requests";
    let Some(addrs) = addresses(TEST) else {
        return;
    };
    let options = cm_verbs::EndpointOptions::shared_queues(cm_verbs::SharedCaps {
        ready_qps: 2,
        ..cm_verbs::SharedCaps::default()
    });
    let transport = RdmaTransport::new().expect("an RDMA transport");
    let mut server = Endpoint::with_options(transport, options);
    let listen = SocketAddr::new(addrs.addr_a, 7513);
    server
        .listen(listen, ListenOptions::default())
        .expect("listen");
    assert_eq!(server.stats().shared_queue_devices, 1, "made at listen");
    let deadline = std::time::Instant::now() + WAIT.expect("a bound");
    while server.stats().ready_qps < 2 {
        assert!(
            std::time::Instant::now() < deadline,
            "the pool never filled: {:?}",
            server.stats()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(server.stats().ready_qps_taken, 0, "no request yet");
    let src = addrs.addr_b;
    let client = std::thread::spawn(move || {
        let mut client = common::endpoint();
        let two = [0, 1].map(|_| common::connected(&mut client, src, listen));
        for conn in two {
            client.send(conn, b"ahead").expect("send");
            assert_eq!(client.recv(conn, WAIT).expect("echo"), b"ahead");
        }
        for conn in two {
            client.disconnect(conn).expect("disconnect");
        }
    });
    let vias = serve(&mut server, 2);
    let taken = server.stats().ready_qps_taken;
    client.join().expect("client thread");
    report(&format!(
        "{TEST}: accepts on QPs made ahead {taken}, established via {vias:?}"
    ));
    assert_eq!(taken, 2);
}
