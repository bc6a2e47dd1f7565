//! The connection API holds at scale and over time (simulated fabric): what a server
//! takes is consumed, what nobody takes does not pile up, a closed connection answers
//! at once, a peer that streams before the connection is established meets
//! backpressure, and a receive read with the RTU in one pass is no race.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use cm_mock::sim::{FaultAction, FaultRule, MsgKind, SimConfig, SimTransport, SimTransports};
use cm_verbs::{
    CloseReason, ConnError, ConnectOptions, ConnectionId, Endpoint, EndpointOptions,
    EstablishedVia, Event, ListenOptions, QueueCaps, CLOSED_BACKLOG,
};

const PORT: u16 = 7471;
const SECOND: Option<Duration> = Some(Duration::from_secs(1));

type SimEndpoint = Endpoint<SimTransport>;

/// What the driven side does with each of its events.
type Behaviour = Box<dyn FnMut(&mut SimEndpoint, Event) + Send>;

/// Two endpoints on one fabric: `main` is called by the test (and may block), `peer`
/// is driven on every simulation step with `behaviour`.
struct Sim {
    fabric: cm_mock::sim::SimFabric,
    main: SimEndpoint,
    peer: Arc<Mutex<SimEndpoint>>,
    behaviour: Arc<Mutex<Behaviour>>,
}

/// Lets `peer` handle everything ready, with `behaviour`.
fn drive(peer: &Mutex<SimEndpoint>, behaviour: &Mutex<Behaviour>) {
    let mut peer = peer.lock().unwrap();
    let mut behaviour = behaviour.lock().unwrap();
    while let Some(event) = peer.poll().expect("peer poll") {
        behaviour(&mut peer, event);
    }
}

/// `main` on the server node (listening on [`PORT`]) when `main_serves`, else on the
/// client node with the server driven.
fn sim(config: SimConfig, seed: u64, main_serves: bool, behaviour: Behaviour) -> Sim {
    sim_with(
        config,
        seed,
        main_serves,
        behaviour,
        EndpointOptions::default(),
    )
}

/// [`sim`] with `main` made with `options`.
fn sim_with(
    config: SimConfig,
    seed: u64,
    main_serves: bool,
    behaviour: Behaviour,
    options: EndpointOptions,
) -> Sim {
    let SimTransports {
        fabric,
        server,
        client,
    } = SimTransports::new(config, seed);
    let (mut transport, peer) = if main_serves {
        (server, client)
    } else {
        (client, server)
    };
    let peer = Arc::new(Mutex::new(Endpoint::new(peer)));
    let behaviour = Arc::new(Mutex::new(behaviour));
    let (driven, acting) = (Arc::clone(&peer), Arc::clone(&behaviour));
    transport.on_step(move || drive(&driven, &acting));
    let mut main = Endpoint::with_options(transport, options);
    if main_serves {
        listen(&mut main);
    } else {
        listen(&mut peer.lock().unwrap());
    }
    Sim {
        fabric,
        main,
        peer,
        behaviour,
    }
}

fn listen(server: &mut SimEndpoint) {
    let addr = server.transport().addr(PORT);
    // Some tests open thousands of connections at once: all of them in setup together.
    let options = ListenOptions {
        max_in_setup: u32::MAX,
        ..ListenOptions::default()
    };
    server.listen(addr, options).expect("listen");
}

impl Sim {
    /// Moves virtual time on by `by`, the peer handling what it brings.
    fn advance(&self, by: Duration) {
        let until = self.fabric.now() + by;
        loop {
            drive(&self.peer, &self.behaviour);
            match self.fabric.next_due() {
                Some(due) if due <= until => {
                    self.fabric.step();
                }
                _ => break,
            }
        }
        self.fabric.advance(until.saturating_sub(self.fabric.now()));
        drive(&self.peer, &self.behaviour);
    }

    /// The main endpoint's first event, virtual time moving `step` at a time; with
    /// the most messages it held meanwhile.
    fn first_event_watching_held(&mut self, step: Duration) -> (Event, usize) {
        let mut max_held = 0;
        loop {
            if let Some(event) = self.main.poll().unwrap() {
                return (event, max_held);
            }
            max_held = max_held.max(self.main.stats().held_messages);
            self.advance(step);
        }
    }

    /// The server's address.
    fn server_addr(&self, main_serves: bool) -> cm_mock::sim::SimAddr {
        if main_serves {
            self.main.transport().addr(PORT)
        } else {
            self.peer.lock().unwrap().transport().addr(PORT)
        }
    }

    /// The driven client connects `n` times.
    fn peer_connects(&self, n: usize) -> Vec<ConnectionId> {
        let to = self.server_addr(true);
        (0..n)
            .map(|_| {
                self.peer
                    .lock()
                    .unwrap()
                    .connect(to, ConnectOptions::default())
                    .expect("connect")
            })
            .collect()
    }
}

/// A client that sends `message` once established and leaves once it is echoed.
fn echo_once_then_leave(message: &'static [u8]) -> Behaviour {
    Box::new(move |client, event| match event {
        Event::Established { conn, .. } => client.send(conn, message).expect("send"),
        Event::Received { conn, .. } => client.disconnect(conn).expect("disconnect"),
        _ => {}
    })
}

fn soft_roce() -> SimConfig {
    SimConfig {
        comm_est: false,
        ..SimConfig::default()
    }
}

#[test]
fn the_readme_servers_pattern_leaves_nothing_queued() {
    const N: usize = 300;
    let mut sim = sim(soft_roce(), 1, true, echo_once_then_leave(b"echo me"));
    sim.fabric
        .add_fault(FaultRule::new(MsgKind::Rtu, FaultAction::Drop));
    sim.peer_connects(N);
    // The README's server, as written: accept, echo until the client leaves.
    let server = &mut sim.main;
    for _ in 0..N {
        let conn = server.accept(SECOND).expect("accept");
        assert!(matches!(
            server.established(conn, None),
            Ok(EstablishedVia::Notify(_))
        ));
        while let Ok(message) = server.recv(conn, SECOND) {
            server.send(conn, &message).ok();
        }
    }
    let stats = server.stats();
    assert_eq!(stats.queued(), 0, "{stats:?}");
    assert_eq!(stats.connections, 0, "{stats:?}");
    assert_eq!(stats.dropped_events, 0, "{stats:?}");
    assert!(stats.ready_entries <= 64, "{stats:?}");
    assert!(stats.accept_entries <= 64, "{stats:?}");
    // One connection at a time: at most twice that, plus 64, for busy polling's queue.
    assert!(stats.awaiting_entries <= 2 + 64, "{stats:?}");
    assert_eq!(server.poll().unwrap(), None, "nothing left to report");
    assert_eq!(server.counters().forced, N as u64);
}

#[test]
fn established_consumes_its_event_and_next_event_does_not_repeat_it() {
    let mut sim = sim(SimConfig::default(), 2, false, Box::new(|_, _| {}));
    let to = sim.server_addr(false);
    let client = &mut sim.main;
    let conns: Vec<_> = (0..3)
        .map(|_| client.connect(to, ConnectOptions::default()).unwrap())
        .collect();
    for &conn in &conns {
        assert_eq!(
            client.established(conn, SECOND),
            Ok(EstablishedVia::Handshake)
        );
        // Asking again answers from the connection's state.
        assert_eq!(
            client.established(conn, None),
            Ok(EstablishedVia::Handshake)
        );
    }
    sim.advance(Duration::from_millis(10));
    let client = &mut sim.main;
    while let Some(event) = client.poll().unwrap() {
        assert!(
            !matches!(event, Event::Established { .. }),
            "reported again: {event:?}"
        );
    }
}

#[test]
fn recv_and_established_on_a_closed_connection_answer_at_once() {
    // The client leaves as soon as it is established.
    let leave: Behaviour = Box::new(|client, event| {
        if let Event::Established { conn, .. } = event {
            client.disconnect(conn).expect("disconnect");
        }
    });
    let mut sim = sim(SimConfig::default(), 3, true, leave);
    sim.peer_connects(2);
    let server = &mut sim.main;
    let both = [
        server.accept(SECOND).unwrap(),
        server.accept(SECOND).unwrap(),
    ];
    // One close is taken by next_event, the other left for recv.
    let first = loop {
        match server.next_event(SECOND).expect("a close") {
            Event::Closed { conn, reason } => {
                assert_eq!(reason, CloseReason::Disconnected);
                break conn;
            }
            other => assert!(matches!(other, Event::Sent { .. }), "{other:?}"),
        }
    };
    let second = if first == both[0] { both[1] } else { both[0] };
    sim.advance(Duration::from_millis(10));
    let server = &mut sim.main;
    server.process().unwrap();
    assert_eq!(server.connection_count(), 0, "both have closed");
    // `None`: a wait on this idle fabric would be an error, so any answer here is one
    // given at once.
    assert_eq!(
        server.recv(first, None),
        Err(ConnError::UnknownConnection(first))
    );
    assert_eq!(
        server.established(first, None),
        Err(ConnError::UnknownConnection(first))
    );
    // The second's close not yet taken: recv reports it once, then the handle is gone.
    assert_eq!(
        server.recv(second, None),
        Err(ConnError::Closed {
            conn: second,
            reason: CloseReason::Disconnected
        })
    );
    assert_eq!(
        server.recv(second, None),
        Err(ConnError::UnknownConnection(second))
    );
    assert_eq!(server.stats().queued(), 0);
}

/// A client that, once established, keeps `total` numbered messages flowing.
fn streamer(total: u32) -> Behaviour {
    let mut next = 0u32;
    Box::new(move |client, event| {
        let conn = match event {
            Event::Established { conn, .. } | Event::Sent { conn, .. } => conn,
            _ => return,
        };
        while next < total {
            match client.send(conn, &next.to_le_bytes()) {
                Ok(()) => next += 1,
                Err(ConnError::SendQueueFull(_)) => return,
                Err(e) => panic!("send: {e}"),
            }
        }
    })
}

/// A peer streaming `total` messages into a server (made with `options`) whose notify
/// is off and whose RTU is late: the peer streams for the whole delay while the server
/// cannot report the connection yet. The server's first event, and the most messages
/// it held meanwhile.
fn streaming_with_the_rtu_late(total: u32, options: EndpointOptions) -> (Sim, Event, usize) {
    let mut sim = sim_with(soft_roce(), 4, true, streamer(total), options);
    sim.main.set_notify(false);
    sim.fabric.add_fault(FaultRule::new(
        MsgKind::Rtu,
        FaultAction::Delay(Duration::from_millis(500)),
    ));
    sim.peer_connects(1);
    let (event, max_held) = sim.first_event_watching_held(Duration::from_millis(1));
    (sim, event, max_held)
}

/// With queues of its own, a connection's receives are posted again only as the
/// application takes its messages: the peer meets RNR and waits.
#[test]
fn a_peer_streaming_before_established_meets_backpressure_and_loses_nothing() {
    const TOTAL: u32 = 10_000;
    let depth = QueueCaps::default().recv_depth as usize;
    let (mut sim, event, max_held) =
        streaming_with_the_rtu_late(TOTAL, EndpointOptions::own_queues());
    let Event::Established { conn, .. } = event else {
        panic!("{event:?}");
    };
    let server = &mut sim.main;
    assert!(max_held <= depth, "held {max_held} > receive depth {depth}");
    assert!(max_held > 0, "the peer did send before the establish");
    for expected in 0..TOTAL {
        let message = server.recv(conn, SECOND).expect("every message, in order");
        assert_eq!(message, expected.to_le_bytes());
        assert!(server.stats().held_messages <= depth);
    }
}

#[test]
fn a_peer_streaming_into_a_connection_that_never_establishes_is_bounded_and_closed() {
    let depth = QueueCaps::default().recv_depth as usize;
    let own = EndpointOptions::own_queues();
    let mut sim = sim_with(soft_roce(), 5, true, streamer(10_000), own);
    sim.main.set_notify(false);
    sim.fabric
        .add_fault(FaultRule::new(MsgKind::Rtu, FaultAction::Drop));
    sim.peer_connects(1);
    let (event, max_held) = sim.first_event_watching_held(Duration::from_millis(50));
    let Event::Closed { reason, .. } = event else {
        panic!("{event:?}");
    };
    let server = &mut sim.main;
    assert!(
        matches!(reason, CloseReason::Unreachable { .. }),
        "{reason:?}"
    );
    assert!(max_held <= depth && max_held > 0, "held {max_held}");
    assert_eq!(server.stats().queued(), 0);
}

/// On shared queues (the default) nothing holds one peer back: a peer streaming into a
/// connection not yet established is closed once it passes the receive depth, which
/// is all the connection ever held; the shared pool stays whole for the others.
#[test]
fn on_shared_queues_a_peer_streaming_before_established_is_closed_past_its_depth() {
    let depth = QueueCaps::default().recv_depth;
    let (mut sim, event, max_held) =
        streaming_with_the_rtu_late(10_000, EndpointOptions::default());
    let Event::Closed { reason, .. } = event else {
        panic!("{event:?}");
    };
    assert_eq!(reason, CloseReason::ReceiveOverrun { depth });
    assert!(max_held <= depth as usize, "held {max_held}");
    let server = &mut sim.main;
    assert_eq!(server.stats().queued(), 0);
    assert_eq!(server.stats().held_messages, 0);
    assert_eq!(server.stats().shared_queue_devices, 1);
}

#[test]
fn an_rtu_and_a_first_message_read_in_one_pass_are_no_race() {
    let mut sim = sim(soft_roce(), 6, true, echo_once_then_leave(b"first"));
    sim.peer_connects(1);
    // Nothing is read on the server until the RTU and the message have both arrived.
    sim.advance(Duration::from_millis(200));
    let server = &mut sim.main;
    let conn = server.accept(SECOND).unwrap();
    assert_eq!(
        server.established(conn, None),
        Ok(EstablishedVia::Handshake)
    );
    assert_eq!(server.recv(conn, SECOND).unwrap(), b"first");
    let counters = server.counters();
    assert_eq!(
        (counters.forced, counters.already_established),
        (0, 0),
        "notify was not called: {counters:?}"
    );
}

#[test]
fn a_fatal_device_leaves_no_periodic_wake_and_nothing_queued() {
    let mut sim = sim(SimConfig::default(), 7, true, Box::new(|_, _| {}));
    sim.peer_connects(1);
    let server = &mut sim.main;
    server.accept(SECOND).unwrap();
    let fatal = cm_verbs::AsyncEvent {
        event_type: cm_verbs::AsyncEventType::DeviceFatal,
        element: cm_verbs::core::EventElement::Port(1),
    };
    server.transport().node().device().raise(fatal);
    let events: Vec<Event> = std::iter::from_fn(|| server.poll().unwrap()).collect();
    assert_eq!(events.len(), 3, "{events:?}");
    assert_eq!(
        server.next_deadline(),
        None,
        "no periodic wake after a fatal error"
    );
    assert_eq!(server.stats().queued(), 0);
}

#[test]
fn closes_nobody_takes_are_bounded_and_counted() {
    // Connections that close before the server takes anything: their closes are kept
    // up to the backlog, the rest counted.
    let leave: Behaviour = Box::new(|client, event| {
        if let Event::Established { conn, .. } = event {
            client.disconnect(conn).expect("disconnect");
        }
    });
    let mut sim = sim(SimConfig::default(), 8, true, leave);
    let n = CLOSED_BACKLOG + 100;
    sim.peer_connects(n);
    loop {
        sim.main.process().unwrap();
        drive(&sim.peer, &sim.behaviour);
        if !sim.fabric.step() && sim.main.connection_count() == 0 {
            break;
        }
    }
    let server = &mut sim.main;
    let stats = server.stats();
    assert_eq!(stats.closed_unreported, CLOSED_BACKLOG, "{stats:?}");
    assert_eq!(stats.dropped_events, 100, "{stats:?}");
    // Taking them all leaves nothing, and the tables hold no stale entry.
    let mut taken = 0;
    while let Some(event) = server.poll().unwrap() {
        if matches!(event, Event::Closed { .. }) {
            taken += 1;
        }
    }
    assert_eq!(taken, CLOSED_BACKLOG);
    let stats = server.stats();
    assert_eq!((stats.queued(), stats.ready_entries), (0, 0), "{stats:?}");
}

#[test]
fn a_closed_listeners_handle_never_names_the_listener_that_takes_its_place() {
    let mut sim = sim(SimConfig::default(), 9, false, Box::new(|_, _| {}));
    // `main` is the client here; listen on it as a second server.
    let endpoint = &mut sim.main;
    let addr = endpoint.transport().addr(PORT + 1);
    let old = endpoint.listen(addr, ListenOptions::default()).unwrap();
    endpoint.close_listener(old).unwrap();
    // The same slot, another port: what is under test is the handle, not the address.
    let other = endpoint.transport().addr(PORT + 2);
    let new = endpoint.listen(other, ListenOptions::default()).unwrap();
    assert_ne!(old, new);
    assert_eq!(
        endpoint.close_listener(old),
        Err(ConnError::UnknownListener(old))
    );
    assert_eq!(
        endpoint.listener_addr(old),
        Err(ConnError::UnknownListener(old))
    );
    assert!(endpoint.listener_addr(new).unwrap().is_some());
    assert_eq!(endpoint.listener_count(), 1);
}

#[test]
fn a_request_whose_setup_fails_is_rejected_and_reported_with_its_errno() {
    // The client notes how its connections end.
    let ends = Arc::new(Mutex::new(Vec::new()));
    let noted = Arc::clone(&ends);
    let note: Behaviour = Box::new(move |_, event| {
        if let Event::Closed { conn, reason } = event {
            noted.lock().unwrap().push((conn, reason));
        }
    });
    let mut sim = sim(SimConfig::default(), 10, true, note);
    // One QP left on the server node: the second request's QP creation fails, as it
    // does once pinned memory passes RLIMIT_MEMLOCK.
    sim.main.transport().node().set_qp_budget(Some(1)).unwrap();
    let second = sim.peer_connects(2)[1];
    let server = &mut sim.main;
    server.accept(SECOND).expect("the first is accepted");
    let failed = loop {
        match server.next_event(SECOND).expect("the failure is reported") {
            Event::AcceptFailed { error, .. } => break error,
            other => assert!(matches!(other, Event::Sent { .. }), "{other:?}"),
        }
    };
    assert_eq!(failed.errno(), 12, "ENOMEM: {failed}");
    assert_eq!(
        server.connection_count(),
        1,
        "nothing of the failed one is kept"
    );
    // The peer hears a reject, not silence.
    sim.advance(Duration::from_millis(10));
    let ends = ends.lock().unwrap();
    assert!(
        matches!(
            ends.as_slice(),
            [(conn, CloseReason::Rejected { .. })] if *conn == second
        ),
        "{ends:?}"
    );
}

#[test]
fn a_request_flood_against_manual_accept_holds_at_most_max_in_setup() {
    const BOUND: usize = 8;
    const FLOOD: usize = 100;
    let ends = Arc::new(Mutex::new(Vec::new()));
    let noted = Arc::clone(&ends);
    let note: Behaviour = Box::new(move |_, event| {
        if let Event::Closed { reason, .. } = event {
            noted.lock().unwrap().push(reason);
        }
    });
    let mut sim = sim(SimConfig::default(), 11, true, note);
    // The server's application never answers: every request waits for it.
    let options = ListenOptions {
        auto_accept: false,
        request_timeout: Some(Duration::from_secs(1)),
        max_in_setup: BOUND as u32,
        ..ListenOptions::default()
    };
    let addr = sim.main.transport().addr(PORT + 1);
    sim.main.listen(addr, options).unwrap();
    for _ in 0..FLOOD {
        sim.peer
            .lock()
            .unwrap()
            .connect(addr, ConnectOptions::default())
            .expect("connect");
    }
    let (mut requests, mut timed_out, mut most_held) = (0, 0, 0);
    for _ in 0..300 {
        sim.advance(Duration::from_millis(10));
        while let Some(event) = sim.main.poll().unwrap() {
            match event {
                Event::Request { .. } => requests += 1,
                Event::Closed {
                    reason: CloseReason::TimedOut,
                    ..
                } => timed_out += 1,
                other => panic!("unexpected {other:?}"),
            }
        }
        most_held = most_held.max(sim.main.connection_count());
    }
    assert_eq!(most_held, BOUND, "never more than the bound in setup");
    assert_eq!((requests, timed_out), (BOUND, BOUND));
    let stats = sim.main.stats();
    assert_eq!(stats.requests_refused, (FLOOD - BOUND) as u64, "{stats:?}");
    assert_eq!((stats.connections, stats.queued()), (0, 0), "{stats:?}");
    // Every client heard a REJ: the refused at once, the unanswered at the deadline.
    let ends = ends.lock().unwrap();
    assert_eq!(ends.len(), FLOOD);
    assert!(
        ends.iter()
            .all(|r| matches!(r, CloseReason::Rejected { .. })),
        "{ends:?}"
    );
    drop(ends);
    // The bound frees with its connections: the next request is reported again.
    sim.peer
        .lock()
        .unwrap()
        .connect(addr, ConnectOptions::default())
        .unwrap();
    let (event, _) = sim.first_event_watching_held(Duration::from_millis(10));
    assert!(matches!(event, Event::Request { .. }), "{event:?}");
}

#[test]
fn waiting_forever_on_an_idle_fabric_answers_idle_and_a_timeout_answers_none() {
    let mut sim = sim(SimConfig::default(), 12, true, Box::new(|_, _| {}));
    // Listening, nobody connecting: nothing can ever happen.
    let forever = sim.main.next_event(None);
    assert!(
        matches!(forever, Err(ConnError::Cm(cm_verbs::CmError::Idle { .. }))),
        "{forever:?}"
    );
    assert!(matches!(
        sim.main.next_event(SECOND),
        Err(ConnError::Timeout)
    ));
}

#[test]
fn a_wake_ends_the_next_wait_once() {
    let mut sim = sim(SimConfig::default(), 13, true, Box::new(|_, _| {}));
    let waker = sim.main.waker().unwrap();
    let from_another_thread = waker.clone();
    std::thread::spawn(move || from_another_thread.wake())
        .join()
        .unwrap();
    waker.wake();
    // Two wakes before a wait are one: the first wait returns at once, even without a
    // deadline on an idle fabric, and the second waits as usual.
    assert!(matches!(sim.main.accept(None), Err(ConnError::Woken)));
    let forever = sim.main.next_event(None);
    assert!(
        matches!(forever, Err(ConnError::Cm(cm_verbs::CmError::Idle { .. }))),
        "{forever:?}"
    );
    waker.wake();
    assert!(matches!(sim.main.next_event(None), Err(ConnError::Woken)));
    assert_eq!(
        std::io::Error::from(ConnError::Woken).kind(),
        std::io::ErrorKind::Interrupted
    );
}
