//! The connection API on the simulated fabric: the notify path needs no application
//! code, each connection is reported established exactly once with how it got there,
//! and nothing the peer sends is lost or reordered.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use cm_mock::sim::{
    DeviceKind, FaultAction, FaultRule, MsgKind, SimConfig, SimFabric, SimTransport, SimTransports,
};
use cm_verbs::{
    CloseReason, ConnError, ConnectOptions, ConnectionId, Endpoint, EstablishedVia, Event,
    ListenOptions, PrivateData, RejectReason, Role, Trigger,
};

const PORT: u16 = 7471;
const SECOND: Option<Duration> = Some(Duration::from_secs(1));

type SimEndpoint = Endpoint<SimTransport>;

/// A server node and a client node; the client endpoint is shared with the server's
/// wait hook, which drives it (sending `messages` once established) while the server
/// blocks.
struct Pair {
    fabric: SimFabric,
    server: SimEndpoint,
    client: Arc<Mutex<SimEndpoint>>,
    client_events: Arc<Mutex<Vec<Event>>>,
}

fn pair(config: SimConfig, seed: u64, messages: &'static [&'static [u8]]) -> Pair {
    let SimTransports {
        fabric,
        server: mut transport,
        client,
    } = SimTransports::new(config, seed);
    let client = Arc::new(Mutex::new(Endpoint::new(client)));
    let client_events = Arc::new(Mutex::new(Vec::new()));
    let (driven, seen) = (Arc::clone(&client), Arc::clone(&client_events));
    transport.on_step(move || {
        let mut client = driven.lock().unwrap();
        while let Some(event) = client.poll().expect("client poll") {
            if let Event::Established { conn, .. } = event {
                for message in messages {
                    client.send(conn, message).expect("client send");
                }
            }
            seen.lock().unwrap().push(event);
        }
    });
    Pair {
        fabric,
        server: Endpoint::new(transport),
        client,
        client_events,
    }
}

impl Pair {
    fn connect(&self, count: usize, private_data: &[u8]) -> Vec<ConnectionId> {
        let to = self.server.transport().addr(PORT);
        (0..count)
            .map(|_| {
                self.client
                    .lock()
                    .unwrap()
                    .connect(
                        to,
                        ConnectOptions {
                            private_data: PrivateData::from(private_data),
                            ..ConnectOptions::default()
                        },
                    )
                    .expect("connect")
            })
            .collect()
    }
}

impl Pair {
    /// Every RTU dropped, the server busy polling (5 ms) and listening on [`PORT`], and
    /// `count` connections started by the client (the handshakes not run yet).
    fn busy_poll_losing_every_rtu(&mut self, count: usize) {
        self.fabric
            .add_fault(FaultRule::new(MsgKind::Rtu, FaultAction::Drop));
        self.server.set_busy_poll(Some(Duration::from_millis(5)));
        self.server
            .listen(self.server.transport().addr(PORT), ListenOptions::default())
            .unwrap();
        self.connect(count, b"");
    }

    /// Listens on [`PORT`], connects once and accepts: the listener and the connection.
    fn one_accepted(&mut self) -> (cm_verbs::ListenerId, ConnectionId) {
        let listener = self
            .server
            .listen(self.server.transport().addr(PORT), ListenOptions::default())
            .unwrap();
        self.connect(1, b"");
        (listener, self.server.accept(SECOND).unwrap())
    }

    /// Listens with a 100 ms establish deadline, connects once, and checks that an
    /// accept waiting 50 ms times out and the connection then closes with
    /// `CloseReason::TimedOut`.
    fn expect_accept_deadline(&mut self) {
        let options = ListenOptions {
            establish_timeout: Some(Duration::from_millis(100)),
            ..ListenOptions::default()
        };
        self.server
            .listen(self.server.transport().addr(PORT), options)
            .unwrap();
        self.connect(1, b"");
        assert_eq!(
            self.server.accept(Some(Duration::from_millis(50))),
            Err(ConnError::Timeout)
        );
        let closed = self.server.next_event(SECOND);
        assert!(
            matches!(
                closed,
                Ok(Event::Closed {
                    reason: CloseReason::TimedOut,
                    ..
                })
            ),
            "{closed:?}"
        );
    }
}

fn soft_roce() -> SimConfig {
    SimConfig {
        comm_est: false,
        ..SimConfig::default()
    }
}

#[test]
fn a_lost_rtu_is_rescued_by_the_receive_trigger_with_no_application_code() {
    let mut pair = pair(soft_roce(), 1, &[b"first", b"second"]);
    pair.fabric
        .add_fault(FaultRule::new(MsgKind::Rtu, FaultAction::Drop));
    let listener = pair
        .server
        .listen(pair.server.transport().addr(PORT), ListenOptions::default())
        .unwrap();
    pair.connect(1, b"hello");

    let conn = pair
        .server
        .accept(SECOND)
        .expect("accepted and established");
    let info = pair.server.info(conn).unwrap();
    assert_eq!(info.role, Role::Passive);
    assert_eq!(info.listener, Some(listener));
    assert_eq!(
        info.established,
        Some(EstablishedVia::Notify(Trigger::ReceiveCompletion))
    );
    // The message that forced the establish is delivered, in order, after it.
    assert_eq!(pair.server.recv(conn, SECOND).unwrap(), b"first");
    assert_eq!(pair.server.recv(conn, SECOND).unwrap(), b"second");
    assert_eq!(pair.server.counters().forced, 1);
    // Exactly one ESTABLISHED reached the server: nothing else is queued for it.
    pair.fabric.advance(Duration::from_millis(10));
    while let Some(event) = pair.server.poll().unwrap() {
        assert!(!matches!(event, Event::Established { .. }), "{event:?}");
    }
}

#[test]
fn with_comm_est_the_async_event_forces_the_establish() {
    let mut pair = pair(SimConfig::default(), 2, &[b"data"]);
    pair.fabric
        .add_fault(FaultRule::new(MsgKind::Rtu, FaultAction::Drop));
    pair.server
        .listen(pair.server.transport().addr(PORT), ListenOptions::default())
        .unwrap();
    pair.connect(1, b"");
    let conn = pair.server.accept(SECOND).unwrap();
    assert_eq!(
        pair.server.info(conn).unwrap().established,
        Some(EstablishedVia::Notify(Trigger::AsyncEvent(
            cm_verbs::AsyncEventType::CommEst
        )))
    );
    assert_eq!(pair.server.recv(conn, SECOND).unwrap(), b"data");
}

#[test]
fn without_loss_the_handshake_establishes_and_private_data_travels() {
    let mut pair = pair(SimConfig::default(), 3, &[b"ping"]);
    let options = ListenOptions {
        private_data: PrivateData::from(b"welcome"),
        ..ListenOptions::default()
    };
    pair.server
        .listen(pair.server.transport().addr(PORT), options)
        .unwrap();
    pair.connect(1, b"hello");
    let conn = pair.server.accept(SECOND).unwrap();
    assert_eq!(
        pair.server.info(conn).unwrap().established,
        Some(EstablishedVia::Handshake)
    );
    assert_eq!(pair.server.recv(conn, SECOND).unwrap(), b"ping");
    pair.server.send(conn, b"pong").unwrap();
    pair.fabric.advance(Duration::from_millis(1));
    let mut client = pair.client.lock().unwrap();
    let mut got = Vec::new();
    while let Some(event) = client.poll().unwrap() {
        got.push(event);
    }
    let events = pair.client_events.lock().unwrap();
    let established = events
        .iter()
        .find_map(|e| match e {
            Event::Established {
                private_data, role, ..
            } => Some((private_data.clone(), *role)),
            _ => None,
        })
        .expect("client established");
    assert_eq!(established, (PrivateData::from(b"welcome"), Role::Active));
    assert!(
        got.iter()
            .any(|e| matches!(e, Event::Received { data, .. } if data == b"pong")),
        "{got:?}"
    );
}

#[test]
fn many_connections_each_established_exactly_once_at_full_rtu_loss() {
    let mut pair = pair(soft_roce(), 4, &[b"x"]);
    pair.fabric
        .add_fault(FaultRule::new(MsgKind::Rtu, FaultAction::Drop));
    pair.server
        .listen(pair.server.transport().addr(PORT), ListenOptions::default())
        .unwrap();
    pair.connect(50, b"");
    let mut accepted = Vec::new();
    for _ in 0..50 {
        accepted.push(pair.server.accept(SECOND).unwrap());
    }
    accepted.sort();
    accepted.dedup();
    assert_eq!(accepted.len(), 50, "each connection reported once");
    assert_eq!(pair.server.counters().forced, 50);
    for conn in accepted {
        assert_eq!(pair.server.recv(conn, SECOND).unwrap(), b"x");
    }
}

#[test]
fn busy_polling_rescues_every_lost_rtu_once_and_loses_no_message() {
    // Spinning, the server polls the queues of its accepted connections itself: each
    // receive forces its establish once, whichever of that poll and the completion
    // event sees it first, and the message is still delivered, in order.
    let mut pair = pair(soft_roce(), 9, &[b"one", b"two"]);
    pair.busy_poll_losing_every_rtu(20);
    let mut accepted = Vec::new();
    for _ in 0..20 {
        let conn = pair.server.accept(SECOND).unwrap();
        assert_eq!(
            pair.server.info(conn).unwrap().established,
            Some(EstablishedVia::Notify(Trigger::ReceiveCompletion))
        );
        accepted.push(conn);
    }
    let c = pair.server.counters();
    assert_eq!((c.forced, c.receive_triggers), (20, 20));
    for conn in &accepted {
        assert_eq!(pair.server.recv(*conn, SECOND).unwrap(), b"one");
        assert_eq!(pair.server.recv(*conn, SECOND).unwrap(), b"two");
    }
    accepted.sort();
    accepted.dedup();
    assert_eq!(accepted.len(), 20, "each connection reported once");
}

#[test]
fn busy_polling_takes_a_waiting_receive_from_the_queue_once() {
    // The peer's message is in the server's receive queue, its completion event not
    // read yet, when a busy-polling accept begins: the server polls the queue itself,
    // forces the establish, and the completion event read later finds the queue empty.
    // The message is delivered once.
    let mut pair = pair(soft_roce(), 3, &[]);
    pair.busy_poll_losing_every_rtu(1);
    let mut sent = false;
    for _ in 0..1000 {
        pair.fabric.advance(Duration::from_millis(1));
        if pair.server.connection_count() == 0 {
            pair.server.poll().unwrap();
        }
        let mut client = pair.client.lock().unwrap();
        while let Some(event) = client.poll().unwrap() {
            if let Event::Established { conn, .. } = event {
                client.send(conn, b"early").unwrap();
                sent = true;
            }
        }
        if sent {
            break;
        }
    }
    assert!(sent, "the client never got established");
    pair.fabric.advance(Duration::from_millis(10));
    let conn = pair.server.accept(SECOND).unwrap();
    assert_eq!(
        pair.server.info(conn).unwrap().established,
        Some(EstablishedVia::Notify(Trigger::ReceiveCompletion))
    );
    assert_eq!(pair.server.recv(conn, SECOND).unwrap(), b"early");
    assert_eq!(
        pair.server.recv(conn, Some(Duration::from_millis(50))),
        Err(ConnError::Timeout),
        "delivered once"
    );
    let c = pair.server.counters();
    assert_eq!((c.forced, c.receive_triggers), (1, 1));
}

#[test]
fn manual_accept_can_reject_with_a_typed_reason_and_private_data() {
    let mut pair = pair(SimConfig::default(), 5, &[]);
    let options = ListenOptions {
        auto_accept: false,
        ..ListenOptions::default()
    };
    pair.server
        .listen(pair.server.transport().addr(PORT), options)
        .unwrap();
    let client_conn = pair.connect(1, b"let me in")[0];
    let request = match pair.server.next_event(SECOND).expect("a request") {
        Event::Request {
            conn, private_data, ..
        } => {
            assert_eq!(private_data, PrivateData::from(b"let me in"));
            conn
        }
        other => panic!("unexpected {other:?}"),
    };
    let too_long = PrivateData::from(vec![0u8; PrivateData::MAX_REJ + 1]);
    assert!(matches!(
        pair.server.reject_request(request, &too_long),
        Err(ConnError::PrivateDataTooLong {
            max: PrivateData::MAX_REJ,
            ..
        })
    ));
    pair.server
        .reject_request(request, &PrivateData::from(b"full"))
        .unwrap();
    assert!(matches!(
        pair.server.accept_request(request, &PrivateData::empty()),
        Err(ConnError::UnknownConnection(_))
    ));
    let mut client = pair.client.lock().unwrap();
    match client.established(client_conn, SECOND) {
        Err(ConnError::Closed {
            reason:
                CloseReason::Rejected {
                    reason,
                    private_data,
                },
            ..
        }) => {
            assert_eq!(reason, RejectReason::Consumer);
            assert_eq!(private_data.as_bytes()[..4], *b"full");
        }
        other => panic!("expected a consumer reject, got {other:?}"),
    }
}

#[test]
fn connecting_to_a_port_nobody_listens_on_is_a_typed_reject() {
    let pair = pair(SimConfig::default(), 6, &[]);
    let conn = pair.connect(1, b"")[0];
    let mut client = pair.client.lock().unwrap();
    match client.established(conn, SECOND) {
        Err(ConnError::Closed { reason, .. }) => {
            assert!(
                matches!(
                    reason,
                    CloseReason::Rejected {
                        reason: RejectReason::NoListener,
                        ..
                    } | CloseReason::Unreachable { .. }
                ),
                "{reason:?}"
            );
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn an_accept_deadline_ends_in_a_typed_timeout_and_leaks_no_connection() {
    let mut pair = pair(soft_roce(), 7, &[]);
    pair.fabric
        .add_fault(FaultRule::new(MsgKind::Rtu, FaultAction::Drop));
    // The client sends nothing, so nothing can rescue the connection.
    pair.expect_accept_deadline();
    assert_eq!(pair.server.connection_count(), 0);
}

#[test]
fn sends_and_messages_are_checked() {
    let mut pair = pair(SimConfig::default(), 8, &[]);
    pair.server
        .listen(pair.server.transport().addr(PORT), ListenOptions::default())
        .unwrap();
    pair.connect(1, b"");
    let conn = pair.server.accept(SECOND).unwrap();
    let big = vec![0u8; cm_verbs::QueueCaps::default().buffer_size as usize + 1];
    assert!(matches!(
        pair.server.send(conn, &big),
        Err(ConnError::MessageTooLarge { .. })
    ));
    for _ in 0..cm_verbs::QueueCaps::default().send_depth {
        pair.server.send(conn, b"m").unwrap();
    }
    assert_eq!(
        pair.server.send(conn, b"m"),
        Err(ConnError::SendQueueFull(conn))
    );
    // Completions free the buffers again.
    pair.server.poll().unwrap();
    pair.server.send(conn, b"m").unwrap();
    let too_long = PrivateData::from(vec![1u8; PrivateData::MAX_REQ + 1]);
    let to = pair.server.transport().addr(PORT);
    let refused = pair.client.lock().unwrap().connect(
        to,
        ConnectOptions {
            private_data: too_long,
            ..ConnectOptions::default()
        },
    );
    assert!(matches!(refused, Err(ConnError::PrivateDataTooLong { .. })));
}

#[test]
fn completed_sends_are_reported_and_setup_steps_are_timed_in_order() {
    let mut pair = pair(SimConfig::default(), 7, &[b"ping"]);
    pair.server
        .listen(pair.server.transport().addr(PORT), ListenOptions::default())
        .unwrap();
    let client_conn = pair.connect(1, b"")[0];
    let conn = pair.server.accept(SECOND).unwrap();
    assert_eq!(pair.server.recv(conn, SECOND).unwrap(), b"ping");
    pair.server.send(conn, b"pong").unwrap();
    let mut sent = false;
    while let Some(event) = unless_timed_out(pair.server.next_event(SECOND)) {
        if matches!(event, Event::Sent { conn: c, completed } if c == conn && completed >= 1) {
            sent = true;
            break;
        }
    }
    assert!(sent, "the send's completion is reported");

    let times = pair.server.info(conn).unwrap().times;
    assert_eq!((times.addr_resolved, times.route_resolved), (None, None));
    let passive = [
        Some(times.started),
        times.create_qp_called,
        times.qp_created,
        times.connect_called,
        times.connect_returned,
        times.established,
    ];
    assert!(passive.iter().all(Option::is_some), "{times:?}");
    assert!(passive.windows(2).all(|w| w[0] <= w[1]), "{times:?}");

    let times = pair.client.lock().unwrap().info(client_conn).unwrap().times;
    let active = [
        Some(times.started),
        times.addr_resolved,
        times.route_resolved,
        times.create_qp_called,
        times.qp_created,
        times.connect_called,
        times.connect_returned,
        times.established,
    ];
    assert!(active.iter().all(Option::is_some), "{times:?}");
    assert!(active.windows(2).all(|w| w[0] <= w[1]), "{times:?}");
}

#[test]
fn with_notify_off_a_lost_rtu_is_not_rescued() {
    let mut pair = pair(soft_roce(), 8, &[b"data"]);
    pair.fabric
        .add_fault(FaultRule::new(MsgKind::Rtu, FaultAction::Drop));
    pair.server.set_notify(false);
    pair.expect_accept_deadline();
    assert_eq!(pair.server.counters().forced, 0);
    assert_eq!(pair.server.counters().receive_triggers, 0);
}

#[test]
fn two_listeners_on_one_device_share_its_reader_and_both_get_their_rescues() {
    let mut pair = pair(soft_roce(), 9, &[b"m"]);
    pair.fabric
        .add_fault(FaultRule::new(MsgKind::Rtu, FaultAction::Drop));
    let first = pair
        .server
        .listen(pair.server.transport().addr(PORT), ListenOptions::default())
        .unwrap();
    let second = pair
        .server
        .listen(
            pair.server.transport().addr(PORT + 1),
            ListenOptions::default(),
        )
        .unwrap();
    assert_eq!(
        pair.server.device_count(),
        1,
        "one reader for the node's device"
    );
    for port in [PORT, PORT + 1] {
        let to = pair.server.transport().addr(port);
        pair.client
            .lock()
            .unwrap()
            .connect(to, ConnectOptions::default())
            .unwrap();
    }
    let mut listeners = Vec::new();
    for _ in 0..2 {
        let conn = pair.server.accept(SECOND).unwrap();
        let info = pair.server.info(conn).unwrap();
        assert_eq!(
            info.established,
            Some(EstablishedVia::Notify(Trigger::ReceiveCompletion))
        );
        listeners.push(info.listener.unwrap());
        assert_eq!(pair.server.recv(conn, SECOND).unwrap(), b"m");
    }
    listeners.sort();
    assert_eq!(listeners, vec![first, second]);
}

#[test]
fn a_removed_device_closes_its_listener_and_connections_and_its_reader() {
    let mut pair = pair(SimConfig::default(), 10, &[]);
    let (listener, conn) = pair.one_accepted();
    let told = pair.server.transport().node().remove_device().unwrap();
    assert_eq!(told, 2, "the listener's id and the connection's");
    let mut ended = Vec::new();
    while let Some(event) = unless_timed_out(pair.server.next_event(SECOND)) {
        ended.push(event);
    }
    assert!(ended.contains(&Event::Closed {
        conn,
        reason: CloseReason::DeviceRemoved
    }));
    assert!(ended.contains(&Event::ListenerClosed {
        listener,
        reason: CloseReason::DeviceRemoved
    }));
    assert_eq!(
        ended
            .iter()
            .filter(|e| matches!(e, Event::Closed { .. } | Event::ListenerClosed { .. }))
            .count(),
        2,
        "each reported once: {ended:?}"
    );
    assert_eq!(
        (
            pair.server.connection_count(),
            pair.server.listener_count(),
            pair.server.device_count()
        ),
        (0, 0, 0)
    );
}

#[test]
fn a_fatal_device_error_ends_what_is_on_the_device_and_is_reported_first() {
    let mut pair = pair(SimConfig::default(), 11, &[]);
    let (listener, conn) = pair.one_accepted();
    let fatal = cm_verbs::AsyncEvent {
        event_type: cm_verbs::AsyncEventType::DeviceFatal,
        element: cm_verbs::core::EventElement::Port(1),
    };
    pair.server.transport().node().device().raise(fatal);
    let port_down = cm_verbs::AsyncEvent {
        event_type: cm_verbs::AsyncEventType::PortErr,
        element: cm_verbs::core::EventElement::Port(1),
    };
    let events: Vec<Event> = std::iter::from_fn(|| pair.server.poll().unwrap()).collect();
    assert_eq!(
        events,
        vec![
            Event::Device(fatal),
            Event::Closed {
                conn,
                reason: CloseReason::DeviceFatal
            },
            Event::ListenerClosed {
                listener,
                reason: CloseReason::DeviceFatal
            },
        ]
    );
    assert_eq!(pair.server.device_count(), 0);
    // A port event on a device still read reaches the application as it is.
    let mut other = pair_with_port_event(port_down);
    assert_eq!(other.server.poll().unwrap(), Some(Event::Device(port_down)));
}

/// A listening server whose device then reports `event`.
fn pair_with_port_event(event: cm_verbs::AsyncEvent) -> Pair {
    let mut pair = pair(SimConfig::default(), 12, &[]);
    pair.server
        .listen(pair.server.transport().addr(PORT), ListenOptions::default())
        .unwrap();
    pair.server.transport().node().device().raise(event);
    pair
}

#[test]
fn a_closed_listener_stops_listening_and_its_address_can_be_listened_on_again() {
    let mut pair = pair(soft_roce(), 21, &[]);
    let addr = pair.server.transport().addr(PORT);
    let first = pair.server.listen(addr, ListenOptions::default()).unwrap();
    pair.server.close_listener(first).unwrap();
    // A request to the closed address is refused: nobody listens there any more.
    let refused = pair.connect(1, b"")[0];
    let end = pair.client.lock().unwrap().established(refused, SECOND);
    assert!(matches!(end, Err(ConnError::Closed { .. })), "{end:?}");
    // The same address again, at once: no EADDRINUSE, and it serves.
    let second = pair.server.listen(addr, ListenOptions::default()).unwrap();
    assert_ne!(first, second);
    pair.connect(1, b"");
    let conn = pair.server.accept(SECOND).unwrap();
    assert_eq!(pair.server.info(conn).unwrap().listener, Some(second));
}

#[test]
fn a_device_reader_is_closed_with_the_last_listener_and_connection_on_it() {
    let mut pair = pair(soft_roce(), 22, &[]);
    let (listener, conn) = pair.one_accepted();
    assert_eq!(pair.server.device_count(), 1);
    // The connection still uses the device.
    pair.server.close_listener(listener).unwrap();
    assert_eq!(pair.server.device_count(), 1);
    pair.server.disconnect(conn).unwrap();
    assert_eq!(pair.server.device_count(), 0, "nothing uses the device");
    // The client's side: its connection ends with the server's disconnect.
    let mut client = pair.client.lock().unwrap();
    while client.connection_count() > 0 {
        client
            .next_event(SECOND)
            .expect("the close within the wait");
    }
    assert_eq!(client.device_count(), 0, "an idle client holds no device");
    drop(client);
    // A new listener opens the reader again.
    pair.server
        .listen(pair.server.transport().addr(PORT), ListenOptions::default())
        .unwrap();
    assert_eq!(pair.server.device_count(), 1);
}

/// A waiting call's event, `None` once its timeout passed (any other error fails).
fn unless_timed_out(next: Result<Event, ConnError>) -> Option<Event> {
    match next {
        Ok(event) => Some(event),
        Err(ConnError::Timeout) => None,
        Err(error) => panic!("{error}"),
    }
}

#[test]
fn a_spin_leaves_the_shared_queues_armed_for_the_next_wait() {
    // A busy-polling wait reads the device's shared completion queues itself and does
    // not arm them again on their completion event meanwhile (no event per message);
    // once it returns they are armed again, so a wait without busy polling still hears
    // the next message.
    let mut pair = pair(soft_roce(), 21, &[b"one", b"two", b"three"]);
    pair.server.set_busy_poll(Some(Duration::from_millis(5)));
    let (_, conn) = pair.one_accepted();
    for expected in [&b"one"[..], b"two", b"three"] {
        assert_eq!(pair.server.recv(conn, SECOND).unwrap(), expected);
    }
    pair.server.set_busy_poll(None);
    let client_conn = pair
        .client_events
        .lock()
        .unwrap()
        .iter()
        .find_map(|event| match event {
            Event::Established { conn, .. } => Some(*conn),
            _ => None,
        })
        .expect("the client's connection");
    for message in [&b"four"[..], b"five"] {
        pair.client
            .lock()
            .unwrap()
            .send(client_conn, message)
            .unwrap();
        assert_eq!(pair.server.recv(conn, SECOND).unwrap(), message);
    }
}

/// On iWARP nothing is lost for notify to rescue: with every RTU dropped (none is sent
/// there) each connection is established by the handshake, the message that reaches the
/// server before it reads its ESTABLISHED is held until then and delivered, and the
/// pump never calls notify.
#[test]
fn on_iwarp_every_connection_is_established_by_the_handshake_and_none_is_forced() {
    let config = SimConfig {
        device_kind: DeviceKind::Iwarp,
        comm_est: false,
        ..SimConfig::default()
    };
    let mut pair = pair(config, 12, &[b"first"]);
    pair.fabric
        .add_fault(FaultRule::new(MsgKind::Rtu, FaultAction::Drop));
    pair.server
        .listen(pair.server.transport().addr(PORT), ListenOptions::default())
        .unwrap();
    pair.connect(4, b"");
    for _ in 0..4 {
        let conn = pair.server.accept(SECOND).expect("established");
        let info = pair.server.info(conn).unwrap();
        assert_eq!(info.established, Some(EstablishedVia::Handshake));
        assert_eq!(pair.server.recv(conn, SECOND).unwrap(), b"first");
    }
    let counters = pair.server.counters();
    assert_eq!(counters.forced, 0, "{counters:?}");
    assert!(
        counters.not_forcible > 0,
        "an early message met no notify: {counters:?}"
    );
}
