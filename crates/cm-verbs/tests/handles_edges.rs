//! Connection handles at the edges, on the simulated fabric, with either driver: a
//! client that connects, sends and leaves before the server's driver looks (TCP's
//! answer: `accept` returns the connection, its message, then its close), how a
//! connection was established outlasting its close, every established connection
//! accepted or counted refused, and waiting calls that leave nothing behind when they
//! time out or are dropped.
#![cfg(all(feature = "tokio", feature = "sim"))]

#[path = "support/poll_once.rs"]
mod poll_once;

#[path = "support/drivers.rs"]
mod drivers;

use std::time::Duration;

use poll_once::poll_once_and_drop;

use cm_verbs::handle::{Connection, EndpointHandle, HandleStats, Listener};
use cm_verbs::sim::{
    FaultAction, FaultRule, MsgKind, SimConfig, SimFabric, SimTransport, SimTransports,
};
use cm_verbs::{
    CloseReason, ConnError, ConnState, ConnectOptions, ConnectionId, Endpoint, EstablishedVia,
    ListenOptions,
};
use drivers::{runtime, Addr, Driver, DRIVERS, WAIT};

/// A server handle listening on the fabric, and a client endpoint the test drives by
/// hand (stepping the fabric itself while it holds the server's endpoint).
struct Scene {
    fabric: SimFabric,
    server: EndpointHandle<SimTransport>,
    listener: Listener<SimTransport>,
    client: Endpoint<SimTransport>,
    addr: Addr,
}

fn scene(driver: Driver, seed: u64) -> Scene {
    let SimTransports {
        fabric,
        server,
        client,
    } = SimTransports::new(SimConfig::default(), seed);
    let addr = server.addr(7490);
    let server = match driver {
        Driver::Thread => EndpointHandle::spawn_thread(Endpoint::new(server)).expect("server"),
        Driver::Tokio => {
            // The driver's task runs on a runtime of its own thread, as a server's
            // would, while the test's thread makes blocking calls.
            let (handed, handle) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                runtime().block_on(async {
                    let spawned = EndpointHandle::spawn_tokio(Endpoint::new(server));
                    handed.send(spawned).expect("the test waits for it");
                    std::future::pending::<()>().await
                })
            });
            handle.recv().expect("spawned").expect("server")
        }
    };
    let listener = server
        .listen(addr, ListenOptions::default())
        .expect("listen");
    Scene {
        fabric,
        server,
        listener,
        client: Endpoint::new(client),
        addr,
    }
}

/// Moves the fabric and both endpoints until `done` says so or nothing moves.
fn drive(
    fabric: &SimFabric,
    server: &mut Endpoint<SimTransport>,
    client: &mut Endpoint<SimTransport>,
    mut done: impl FnMut(&Endpoint<SimTransport>) -> bool,
) {
    loop {
        server.process().expect("server pass");
        client.process().expect("client pass");
        if done(client) || !fabric.step() {
            return;
        }
    }
}

/// The client sends `message` on `out` and the fabric moves until it has landed.
fn send_all(
    fabric: &SimFabric,
    server: &mut Endpoint<SimTransport>,
    client: &mut Endpoint<SimTransport>,
    out: ConnectionId,
    message: &[u8],
) {
    client.send(out, message).expect("send");
    drive(fabric, server, client, |c| {
        c.info(out).is_ok_and(|info| info.sends_in_flight == 0)
    });
}

fn established(client: &Endpoint<SimTransport>, out: ConnectionId) -> bool {
    client
        .info(out)
        .is_ok_and(|info| info.state == ConnState::Established)
}

/// The client connects to `addr` and the fabric moves until it is established.
fn connect(
    fabric: &SimFabric,
    server: &mut Endpoint<SimTransport>,
    client: &mut Endpoint<SimTransport>,
    addr: Addr,
) -> ConnectionId {
    let out = client
        .connect(addr, ConnectOptions::default())
        .expect("connect");
    drive(fabric, server, client, |c| established(c, out));
    assert!(established(client, out), "the client got established");
    out
}

impl Scene {
    /// The client connects, sends `message` and disconnects, all while the server's
    /// endpoint is held: its driver sees the whole connection in one pass.
    fn connect_send_and_leave_unseen(&mut self, message: &[u8]) {
        let Scene {
            fabric,
            server,
            client,
            addr,
            ..
        } = self;
        server.with_endpoint(|ep| {
            let out = connect(fabric, ep, client, *addr);
            send_all(fabric, ep, client, out, message);
            client.disconnect(out).expect("disconnect");
            drive(fabric, ep, client, |_| false);
            assert_eq!(ep.connection_count(), 0, "the server saw the peer leave");
        });
    }

    /// Every RTU lost: the server answers the REQ, then the client sends `message` and
    /// disconnects while the server's endpoint reads nothing, so the server's CM
    /// reports DISCONNECTED before ESTABLISHED, the message still unread.
    fn one_shot_client_gone_before_its_rtu(&mut self, message: &[u8]) {
        let Scene {
            fabric,
            server,
            client,
            addr,
            ..
        } = self;
        fabric.add_fault(FaultRule::new(MsgKind::Rtu, FaultAction::Drop));
        server.with_endpoint(|ep| {
            let out = client
                .connect(*addr, ConnectOptions::default())
                .expect("connect");
            // The server's pass answers the REQ; the REP establishes the client.
            drive(fabric, ep, client, |c| established(c, out));
            assert!(established(client, out), "the client got established");
            client.send(out, message).expect("send");
            client.disconnect(out).expect("disconnect");
            while fabric.step() {
                client.process().expect("client pass");
            }
        });
    }

    /// Accepts the one connection, established `via`, whose peer sent `message` and
    /// left: the message, then the close.
    fn accept_message_then_close(
        &self,
        driver: Driver,
        via: EstablishedVia,
        message: &[u8],
    ) -> Connection<SimTransport> {
        let conn = self
            .listener
            .blocking_accept(WAIT)
            .unwrap_or_else(|e| panic!("{driver:?}: accepted: {e}"));
        assert_eq!(conn.established_via(), Some(via), "{driver:?}");
        assert_eq!(conn.blocking_recv(WAIT).as_deref(), Ok(message));
        let closed = conn.blocking_recv(WAIT);
        assert!(
            matches!(
                closed,
                Err(ConnError::Closed {
                    reason: CloseReason::Disconnected,
                    ..
                })
            ),
            "{driver:?}: then its close: {closed:?}"
        );
        conn
    }

    /// A connection established and handed to the listener's queue; its client end.
    fn connect_and_queue(&mut self) -> ConnectionId {
        let Scene {
            fabric,
            server,
            client,
            addr,
            ..
        } = self;
        let out = server.with_endpoint(|ep| connect(fabric, ep, client, *addr));
        // The driver routes the established connection to the listener's queue.
        while self.server.stats().accept_queued == 0 {
            std::thread::yield_now();
        }
        out
    }
}

#[test]
fn a_connection_that_came_and_went_in_one_pass_is_accepted_with_its_message_and_close() {
    for driver in DRIVERS {
        let mut scene = scene(driver, 71);
        scene.connect_send_and_leave_unseen(b"hello");
        let conn = scene.accept_message_then_close(driver, EstablishedVia::Handshake, b"hello");
        // Established is a fact about the past: it stays after the close is read.
        assert_eq!(conn.established_via(), Some(EstablishedVia::Handshake));
        assert_eq!(
            conn.blocking_established(WAIT),
            Ok(EstablishedVia::Handshake)
        );
        assert_eq!(scene.server.accepts_refused(), 0, "{driver:?}");
        drop(conn);
        let stats = scene.server.stats();
        assert_eq!(stats, HandleStats::default(), "{driver:?}: nothing kept");
        let endpoint = scene.server.with_endpoint(|ep| ep.stats());
        assert_eq!(endpoint.queued(), 0, "{driver:?}: {endpoint:?}");
    }
}

#[test]
fn an_accepted_connection_whose_peer_left_answers_established_and_gives_its_message() {
    // The tokio example's shape: `established().await?` first, then the messages.
    for driver in DRIVERS {
        let mut scene = scene(driver, 72);
        scene.connect_send_and_leave_unseen(b"fast client");
        let listener = &scene.listener;
        let (via, message) = runtime().block_on(async {
            let conn = listener.accept().await.expect("accept");
            let via = conn.established().await;
            (via, conn.recv().await)
        });
        assert_eq!(via, Ok(EstablishedVia::Handshake), "{driver:?}");
        assert_eq!(message.as_deref(), Ok(&b"fast client"[..]), "{driver:?}");
    }
}

#[test]
fn a_one_shot_client_whose_rtu_was_lost_is_accepted_with_its_message_then_its_close() {
    for driver in DRIVERS {
        let mut scene = scene(driver, 76);
        scene.one_shot_client_gone_before_its_rtu(b"one shot");
        scene.accept_message_then_close(driver, EstablishedVia::PeerMessage, b"one shot");
        assert_eq!(scene.server.accepts_refused(), 0, "{driver:?}");
    }
}

#[test]
fn a_connection_closed_while_it_waits_for_accept_is_accepted_then_reads_its_close() {
    for driver in DRIVERS {
        let mut scene = scene(driver, 73);
        let out = scene.connect_and_queue();
        let Scene {
            fabric,
            server,
            client,
            ..
        } = &mut scene;
        server.with_endpoint(|ep| {
            send_all(fabric, ep, client, out, b"before leaving");
            client.disconnect(out).expect("disconnect");
            drive(fabric, ep, client, |_| false);
        });
        let conn = scene.listener.blocking_accept(WAIT).expect("accept");
        assert_eq!(
            conn.blocking_recv(WAIT).as_deref(),
            Ok(&b"before leaving"[..]),
            "{driver:?}"
        );
        assert!(
            matches!(conn.blocking_recv(WAIT), Err(ConnError::Closed { .. })),
            "{driver:?}"
        );
    }
}

#[test]
fn connections_a_closed_listener_never_handed_out_are_counted_refused() {
    for driver in DRIVERS {
        let mut scene = scene(driver, 74);
        scene.connect_and_queue();
        let Scene {
            server, listener, ..
        } = scene;
        drop(listener);
        assert_eq!(server.accepts_refused(), 1, "{driver:?}");
        assert_eq!(server.stats(), HandleStats::default(), "{driver:?}");
        assert_eq!(server.with_endpoint(|ep| ep.connection_count()), 0);
    }
}

#[test]
fn calls_that_time_out_or_are_dropped_leave_no_waiter_behind() {
    for driver in DRIVERS {
        let mut scene = scene(driver, 75);
        let out = scene.connect_and_queue();
        let conn = scene.listener.blocking_accept(WAIT).expect("accept");
        let short = Some(Duration::from_millis(1));
        for _ in 0..50 {
            assert_eq!(conn.blocking_recv(short), Err(ConnError::Timeout));
            assert!(matches!(
                scene.listener.blocking_accept(short),
                Err(ConnError::Timeout)
            ));
        }
        for _ in 0..50 {
            assert!(poll_once_and_drop(conn.recv()).is_pending());
            assert!(poll_once_and_drop(scene.listener.accept()).is_pending());
        }
        let stats = scene.server.stats();
        assert_eq!(stats.waiting_calls, 0, "{driver:?}: {stats:?}");
        assert_eq!(stats.timers, 0, "{driver:?}: {stats:?}");
        // What was given up is still delivered to the next call.
        let Scene {
            fabric,
            server,
            client,
            ..
        } = &mut scene;
        server.with_endpoint(|ep| send_all(fabric, ep, client, out, b"later"));
        assert_eq!(conn.blocking_recv(WAIT).as_deref(), Ok(&b"later"[..]));
        assert_eq!(scene.server.stats().waiting_calls, 0, "{driver:?}");
    }
}

#[test]
fn spawn_tokio_outside_a_runtime_answers_an_error() {
    let SimTransports { server, .. } = SimTransports::new(SimConfig::default(), 76);
    let answer = EndpointHandle::spawn_tokio(Endpoint::new(server));
    assert!(
        matches!(
            answer,
            Err(ConnError::Cm(cm_verbs::CmError::InvalidArgument { .. }))
        ),
        "{answer:?}"
    );
}

/// One connection through handles on both sides, each with its own driver, the first
/// RTU dropped: the client's first message must find the server still waiting for the
/// RTU (virtual time does not run ahead to the CM's retry while a party has something
/// to act on), so the notify path rescues it, in every run.
#[test]
fn a_first_rtu_lost_takes_the_notify_path_in_every_run_with_either_driver() {
    const RUNS: u64 = 100;
    for driver in DRIVERS {
        for seed in 1000..1000 + RUNS {
            let config = SimConfig {
                trace: true,
                ..SimConfig::default()
            };
            let SimTransports {
                fabric,
                server,
                client,
            } = SimTransports::new(config, seed);
            fabric.add_fault(FaultRule::new(MsgKind::Rtu, FaultAction::Drop).nth(0));
            let addr = server.addr(7491);
            let answer = runtime().block_on(async {
                let spawn = |transport| match driver {
                    Driver::Thread => EndpointHandle::spawn_thread(Endpoint::new(transport)),
                    Driver::Tokio => EndpointHandle::spawn_tokio(Endpoint::new(transport)),
                };
                let server = spawn(server)?;
                let client = spawn(client)?;
                let listener = server.listen(addr, ListenOptions::default())?;
                let out = client.connect(addr, ConnectOptions::default())?;
                out.established().await?;
                out.send(b"first").await?;
                let conn = listener.accept().await?;
                assert_eq!(conn.recv().await?, b"first");
                let forced = server.with_endpoint(|ep| ep.counters()).forced;
                Ok::<_, ConnError>((conn.established_via(), forced))
            });
            let trace = || fabric.trace().unwrap_or_default();
            let (via, forced) = answer.unwrap_or_else(|e| {
                panic!(
                    "{driver:?}, seed {seed}: {e} at {:?}\n{}",
                    fabric.now(),
                    trace()
                )
            });
            assert!(
                matches!(via, Some(EstablishedVia::Notify(_))) && forced == 1,
                "{driver:?}, seed {seed}: {via:?}, forced {forced}, at {:?}\n{}",
                fabric.now(),
                trace()
            );
        }
    }
}
