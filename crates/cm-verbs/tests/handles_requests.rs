//! Manual accept through the handles, on the simulated fabric, with either driver: a
//! listener with `auto_accept` off hands out each request as a `Request`, answered with
//! private data both ways (each side's connection keeps the other's after the peer
//! left, as an automatically accepted one does) or rejected (dropped: rejected too);
//! every RTU lost, the accepted connection is still rescued by notify; a request's
//! connection never comes out of `Listener::accept` a second time; a request nobody
//! answers in time leaves the queue; each kind of listener refuses the other's call.
#![cfg(all(feature = "tokio", feature = "sim"))]

#[path = "support/drivers.rs"]
mod drivers;

use std::time::Duration;

use cm_verbs::handle::{EndpointHandle, HandleStats, Listener};
use cm_verbs::sim::{
    FaultAction, FaultRule, MsgKind, SimConfig, SimFabric, SimTransport, SimTransports,
};
use cm_verbs::{
    CloseReason, ConnError, ConnectOptions, ConnectionId, Endpoint, EstablishedVia, ListenOptions,
    PrivateData, RejectReason,
};
use drivers::{runtime, Addr, Driver, DRIVERS, WAIT};

/// A server listening with `options` and a client, each with handles, on one fabric.
struct Pair {
    fabric: SimFabric,
    server: EndpointHandle<SimTransport>,
    client: EndpointHandle<SimTransport>,
    listener: Listener<SimTransport>,
    addr: Addr,
}

/// A server listening with `options` on a fabric, driven by `driver` (the tokio driver
/// as a task of the runtime this is called in: it takes turns with the test's tasks, as
/// with a server's), and the client's side of the fabric.
fn listening(
    driver: Driver,
    seed: u64,
    options: ListenOptions,
) -> (
    SimFabric,
    EndpointHandle<SimTransport>,
    Listener<SimTransport>,
    SimTransport,
    Addr,
) {
    let SimTransports {
        fabric,
        server,
        client,
    } = SimTransports::new(SimConfig::default(), seed);
    let addr = server.addr(7495);
    let server = spawn(driver, server);
    let listener = server.listen(addr, options).expect("listen");
    (fabric, server, listener, client, addr)
}

fn spawn(driver: Driver, transport: SimTransport) -> EndpointHandle<SimTransport> {
    match driver {
        Driver::Thread => EndpointHandle::spawn_thread(Endpoint::new(transport)),
        Driver::Tokio => EndpointHandle::spawn_tokio(Endpoint::new(transport)),
    }
    .expect("spawn")
}

/// Both sides with handles, driven by `driver`.
fn pair(driver: Driver, seed: u64, options: ListenOptions) -> Pair {
    let (fabric, server, listener, client, addr) = listening(driver, seed, options);
    Pair {
        fabric,
        server,
        client: spawn(driver, client),
        listener,
        addr,
    }
}

/// Runs `test` with each driver, on a runtime of the test's thread; `test` is given
/// what to say in its assertions.
fn with_each_driver<F, Fut>(seed: u64, options: &ListenOptions, test: F)
where
    F: Fn(Pair, String) -> Fut,
    Fut: std::future::Future<Output = Result<(), ConnError>>,
{
    for driver in DRIVERS {
        let context = format!("{driver:?}");
        let answer = runtime().block_on(async {
            let pair = pair(driver, seed, options.clone());
            test(pair, context.clone()).await
        });
        answer.unwrap_or_else(|e| panic!("{context}: {e}"));
    }
}

/// Requests wait for the application's answer; `request_timeout: None` so that only the
/// code under test answers them (the endpoint's timeout would reject them too).
fn manual() -> ListenOptions {
    ListenOptions {
        auto_accept: false,
        request_timeout: None,
        ..ListenOptions::default()
    }
}

fn with_data(data: &[u8]) -> ConnectOptions<Addr> {
    ConnectOptions {
        private_data: PrivateData::from(data),
        ..ConnectOptions::default()
    }
}

/// Whether `data` starts with `prefix` (the real kernel pads private data to the CM
/// message's room: a user compares a prefix).
fn starts_with(data: Option<&PrivateData>, prefix: &[u8]) -> bool {
    data.is_some_and(|d| d.as_bytes().starts_with(prefix))
}

/// The client's connect ended in a consumer reject whose private data starts with
/// `prefix`.
fn assert_rejected(answer: Result<EstablishedVia, ConnError>, prefix: &[u8], context: &str) {
    match answer {
        Err(ConnError::Closed {
            reason:
                CloseReason::Rejected {
                    reason,
                    private_data,
                },
            ..
        }) => {
            assert_eq!(reason, RejectReason::Consumer, "{context}");
            assert!(
                private_data.as_bytes().starts_with(prefix),
                "{context}: {private_data:?}"
            );
        }
        other => panic!("{context}: expected a consumer reject, got {other:?}"),
    }
}

/// Nothing of the server's requests and connections is left.
fn assert_nothing_left(server: &EndpointHandle<SimTransport>, context: &str) {
    assert_eq!(server.stats(), HandleStats::default(), "{context}");
    let connections = server.with_endpoint(|ep| ep.connection_count());
    assert_eq!(connections, 0, "{context}");
}

/// No handle holds or waits on anything, and the server's endpoint forgot `conns`.
/// Narrower than [`assert_nothing_left`] where a client's REQ may come again: a client
/// driver that moved virtual time to its REQ's retry (seconds on) before the test's
/// thread answered (starved for the drivers' quiet turns) resends it, and a REQ that
/// comes after the answer is a new request.
fn assert_forgotten(server: &EndpointHandle<SimTransport>, conns: &[ConnectionId], context: &str) {
    let stats = server.stats();
    assert_eq!(
        (stats.held_connections, stats.waiting_calls, stats.timers),
        (0, 0, 0),
        "{context}: {stats:?}"
    );
    for &conn in conns {
        let info = server.with_endpoint(|ep| ep.info(conn));
        assert!(
            matches!(info, Err(ConnError::UnknownConnection(_))),
            "{context}: {info:?}"
        );
    }
}

#[test]
fn private_data_goes_both_ways_and_stays_after_the_peer_left() {
    with_each_driver(81, &manual(), |pair, context| async move {
        let out = pair.client.connect(pair.addr, with_data(b"credits 16"))?;
        let request = pair.listener.next_request().await?;
        assert!(
            request.private_data().as_bytes().starts_with(b"credits 16"),
            "{context}: {request:?}"
        );
        assert_eq!(request.listener(), pair.listener.id(), "{context}");
        let conn = request.accept(&PrivateData::from(b"rkey 0x1234"))?;
        out.established().await?;
        // The server's side is not asked how it got established: what it knows of its
        // peer comes from the request alone.
        out.send(b"ping").await?;
        assert_eq!(conn.recv().await?, b"ping");
        conn.send(b"pong").await?;
        assert_eq!(out.recv().await?, b"pong");
        // The client leaves: the server reads the close, and both endpoints forget the
        // connection; what each side was told stays with its handle, read only now (the
        // blocking test reads it while the connection lives).
        out.clone().close()?;
        assert!(matches!(conn.recv().await, Err(ConnError::Closed { .. })));
        assert!(matches!(
            conn.recv().await,
            Err(ConnError::UnknownConnection(_))
        ));
        assert!(
            starts_with(conn.peer_private_data(), b"credits 16"),
            "{context}: kept after the peer left"
        );
        assert!(
            starts_with(out.peer_private_data(), b"rkey 0x1234"),
            "{context}: kept after the close"
        );
        assert_eq!(pair.server.accepts_refused(), 0, "{context}");
        Ok(())
    });
}

#[test]
fn an_automatically_accepted_connection_keeps_the_peer_private_data_too() {
    let options = ListenOptions {
        private_data: PrivateData::from(b"auto rkey"),
        ..ListenOptions::default()
    };
    with_each_driver(92, &options, |pair, context| async move {
        let out = pair.client.connect(pair.addr, with_data(b"auto credits"))?;
        out.established().await?;
        out.send(b"bye").await?;
        let conn = pair.listener.accept().await?;
        assert_eq!(conn.recv().await?, b"bye");
        out.clone().close()?;
        assert!(matches!(conn.recv().await, Err(ConnError::Closed { .. })));
        // Read only after the peer left: `accept` kept it.
        assert!(
            starts_with(conn.peer_private_data(), b"auto credits"),
            "{context}"
        );
        assert!(
            starts_with(out.peer_private_data(), b"auto rkey"),
            "{context}"
        );
        Ok(())
    });
}

#[test]
fn a_rejected_client_sees_the_reason_and_the_private_data() {
    with_each_driver(82, &manual(), |pair, context| async move {
        let out = pair.client.connect(pair.addr, with_data(b"let me in"))?;
        let request = pair.listener.next_request().await?;
        assert!(request.private_data().as_bytes().starts_with(b"let me in"));
        let id = request.id();
        request.reject(&PrivateData::from(b"full, retry in 5 s"))?;
        assert_rejected(out.established().await, b"full, retry in 5 s", &context);
        assert_forgotten(&pair.server, &[id], &context);
        Ok(())
    });
}

#[test]
fn an_accept_with_private_data_too_long_is_refused_and_the_request_rejected() {
    with_each_driver(83, &manual(), |pair, context| async move {
        let out = pair.client.connect(pair.addr, ConnectOptions::default())?;
        let request = pair.listener.next_request().await?;
        let id = request.id();
        let too_long = PrivateData::from(vec![7u8; PrivateData::MAX_REP + 1]);
        let accepted = request.accept(&too_long);
        assert!(
            matches!(
                accepted,
                Err(ConnError::PrivateDataTooLong {
                    max: PrivateData::MAX_REP,
                    ..
                })
            ),
            "{context}: {accepted:?}"
        );
        assert_rejected(out.established().await, b"", &context);
        assert_forgotten(&pair.server, &[id], &context);
        Ok(())
    });
}

#[test]
fn a_reject_with_private_data_too_long_is_refused_and_the_request_still_rejected() {
    with_each_driver(84, &manual(), |pair, context| async move {
        let out = pair.client.connect(pair.addr, ConnectOptions::default())?;
        let request = pair.listener.next_request().await?;
        let id = request.id();
        let too_long = PrivateData::from(vec![7u8; PrivateData::MAX_REJ + 1]);
        let rejected = request.reject(&too_long);
        assert!(
            matches!(
                rejected,
                Err(ConnError::PrivateDataTooLong {
                    max: PrivateData::MAX_REJ,
                    ..
                })
            ),
            "{context}: {rejected:?}"
        );
        assert_rejected(out.established().await, b"", &context);
        assert_forgotten(&pair.server, &[id], &context);
        Ok(())
    });
}

#[test]
fn a_request_dropped_unanswered_is_rejected() {
    with_each_driver(85, &manual(), |pair, context| async move {
        let out = pair.client.connect(pair.addr, ConnectOptions::default())?;
        let request = pair.listener.next_request().await?;
        let id = request.id();
        drop(request);
        // With no request timeout, only the drop answers the client.
        assert_rejected(out.established().await, b"", &context);
        assert_forgotten(&pair.server, &[id], &context);
        Ok(())
    });
}

#[test]
fn requests_a_dropped_listener_still_queues_are_rejected() {
    with_each_driver(86, &manual(), |pair, context| async move {
        let out = pair.client.connect(pair.addr, ConnectOptions::default())?;
        while pair.server.stats().requests_queued == 0 {
            tokio::task::yield_now().await;
        }
        drop(pair.listener);
        assert_rejected(out.established().await, b"", &context);
        // Nobody listens any more: a REQ sent again is refused before it is a request.
        assert_nothing_left(&pair.server, &context);
        Ok(())
    });
}

#[test]
fn with_every_rtu_lost_a_manually_accepted_connection_is_rescued_by_notify() {
    with_each_driver(87, &manual(), |pair, context| async move {
        pair.fabric
            .add_fault(FaultRule::new(MsgKind::Rtu, FaultAction::Drop));
        let out = pair.client.connect(pair.addr, with_data(b"hello"))?;
        let request = pair.listener.next_request().await?;
        let conn = request.accept(&PrivateData::from(b"welcome"))?;
        out.established().await?;
        // The first message is what rescues the server's side.
        out.send(b"first").await?;
        let via = conn.established().await?;
        assert!(
            matches!(via, EstablishedVia::Notify(_)),
            "{context}: {via:?}"
        );
        assert_eq!(conn.recv().await?, b"first");
        conn.send(b"reply").await?;
        assert_eq!(out.recv().await?, b"reply");
        let forced = pair.server.with_endpoint(|ep| ep.counters()).forced;
        assert_eq!(forced, 1, "{context}: rescued once");
        Ok(())
    });
}

#[test]
fn listener_accept_never_hands_out_a_manually_accepted_connection_again() {
    with_each_driver(88, &manual(), |pair, context| async move {
        let out = pair.client.connect(pair.addr, ConnectOptions::default())?;
        let conn = pair
            .listener
            .next_request()
            .await?
            .accept(&PrivateData::empty())?;
        out.established().await?;
        conn.established().await?;
        // Its connections come from requests: `accept` says so rather than hand one out.
        let accepted = pair.listener.accept().await;
        assert!(
            matches!(accepted, Err(ConnError::InvalidOptions(_))),
            "{context}: {accepted:?}"
        );
        let stats = pair.server.stats();
        assert_eq!(stats.accept_queued, 0, "{context}: {stats:?}");
        assert_eq!(stats.held_connections, 1, "{context}: {stats:?}");
        // A connection queued for `accept` would be refused (disconnected) here.
        drop(pair.listener);
        out.send(b"still here").await?;
        assert_eq!(conn.recv().await?, b"still here", "{context}");
        assert_eq!(pair.server.accepts_refused(), 0, "{context}");
        Ok(())
    });
}

/// Polls the client, never moving time (only the server's driver does, to its request
/// deadline: a client driver of its own could jump past it, to the REQ's retry seconds
/// later), until `out` closed; why it did.
async fn client_end(client: &mut Endpoint<SimTransport>, out: ConnectionId) -> CloseReason {
    loop {
        client.process().expect("client pass");
        if let Err(ConnError::Closed { reason, .. }) = client.info(out) {
            return reason;
        }
        std::thread::yield_now();
        tokio::task::yield_now().await;
    }
}

#[test]
fn a_request_not_answered_in_time_is_rejected_and_leaves_the_queue() {
    let options = ListenOptions {
        request_timeout: Some(Duration::from_millis(100)),
        ..manual()
    };
    for driver in DRIVERS {
        let context = format!("{driver:?}");
        runtime().block_on(async {
            let (_fabric, server, listener, client, addr) = listening(driver, 89, options.clone());
            let mut client = Endpoint::new(client);
            // Never taken: the endpoint rejects it, and the queue forgets it.
            let out = client
                .connect(addr, ConnectOptions::default())
                .expect("connect");
            let reason = client_end(&mut client, out).await;
            assert_rejected(Err(ConnError::Closed { conn: out, reason }), b"", &context);
            assert_nothing_left(&server, &context);

            // Taken, then answered too late: the answer says why.
            let out = client
                .connect(addr, ConnectOptions::default())
                .expect("connect");
            while server.stats().requests_queued == 0 {
                client.process().expect("client pass");
                std::thread::yield_now();
                tokio::task::yield_now().await;
            }
            let request = listener.next_request().await.expect("request");
            let reason = client_end(&mut client, out).await;
            assert_rejected(Err(ConnError::Closed { conn: out, reason }), b"", &context);
            let late = request.accept(&PrivateData::empty());
            assert!(
                matches!(
                    late,
                    Err(ConnError::Closed {
                        reason: CloseReason::TimedOut,
                        ..
                    })
                ),
                "{context}: {late:?}"
            );
            assert_nothing_left(&server, &context);
        });
    }
}

#[test]
fn each_kind_of_listener_refuses_the_other_kinds_call() {
    with_each_driver(90, &ListenOptions::default(), |pair, context| async move {
        let next = pair.listener.next_request().await;
        assert!(
            matches!(next, Err(ConnError::InvalidOptions(_))),
            "{context}: {next:?}"
        );
        let other = Addr {
            port: 7496,
            ..pair.addr
        };
        let manual = pair.server.listen(other, manual())?;
        let accepted = manual.accept().await;
        assert!(
            matches!(accepted, Err(ConnError::InvalidOptions(_))),
            "{context}: {accepted:?}"
        );
        Ok(())
    });
}

/// The blocking calls, on threads of their own as a thread-per-connection server's.
#[test]
fn blocking_calls_take_accept_and_reject_requests_on_threads() {
    let Pair {
        server,
        client,
        listener,
        addr,
        ..
    } = pair(Driver::Thread, 91, manual());
    // Nothing has come yet: a timed call says so.
    let next = listener.blocking_next_request(Some(Duration::from_millis(1)));
    assert!(matches!(next, Err(ConnError::Timeout)), "{next:?}");
    let serving = std::thread::spawn(move || {
        let request = listener.blocking_next_request(WAIT).expect("first request");
        let conn = request.accept(&PrivateData::from(b"yes")).expect("accept");
        let request = listener
            .blocking_next_request(WAIT)
            .expect("second request");
        let rejected = request.id();
        // A request moves to a thread of its own, as a connection does.
        std::thread::spawn(move || request.reject(&PrivateData::from(b"no")))
            .join()
            .expect("answering thread")
            .expect("reject");
        assert_eq!(conn.blocking_recv(WAIT).as_deref(), Ok(&b"hi"[..]));
        assert!(starts_with(conn.peer_private_data(), b"first"));
        [conn.id(), rejected]
    });
    let first = client.connect(addr, with_data(b"first")).expect("connect");
    first.blocking_established(WAIT).expect("accepted");
    assert!(starts_with(first.peer_private_data(), b"yes"));
    let second = client.connect(addr, with_data(b"second")).expect("connect");
    assert_rejected(second.blocking_established(WAIT), b"no", "second");
    first.blocking_send(b"hi", WAIT).expect("send");
    let conns = serving.join().expect("server thread");
    assert_forgotten(&server, &conns, "the server thread dropped everything");
}
