//! Shared queues (simulated fabric): every connection on a device on one shared
//! receive queue, one receive and one send pool and one pair of completion queues
//! (`EndpointOptions::shared_queues`). Messages reach the connection their QP names,
//! the notify path still rescues a lost RTU from the shared receive queue, a peer that
//! sends past its receive depth is closed without touching the others, the send pool
//! is bounded, and a connection whose messages are larger than the pool's buffers
//! keeps queues of its own.

use std::collections::HashMap;

use cm_mock::sim::{
    FaultAction, FaultRule, MsgKind, SimConfig, SimFabric, SimTransport, SimTransports,
};
use cm_verbs::core::{AsyncEvent, AsyncEventType, EventElement};
use cm_verbs::{
    CloseReason, ConnError, ConnectOptions, ConnectionId, Endpoint, EndpointOptions,
    EstablishedVia, Event, ListenOptions, ListenerId, QpErrorDetail, QueueCaps, SharedCaps,
    Trigger,
};

const PORT: u16 = 7495;

type SimEndpoint = Endpoint<SimTransport>;

/// Small pools, so that a test can reach their bounds.
const POOL: SharedCaps = SharedCaps {
    recv_slots: 64,
    send_slots: 8,
    buffer_size: 256,
    limit: 0,
    ready_qps: 0,
};

const CAPS: QueueCaps = QueueCaps {
    recv_depth: 4,
    send_depth: 4,
    buffer_size: 256,
    work_depth: 0,
};

fn endpoints(config: SimConfig, seed: u64) -> (SimFabric, SimEndpoint, SimEndpoint) {
    let SimTransports {
        fabric,
        server,
        client,
    } = SimTransports::new(config, seed);
    let options = EndpointOptions::shared_queues(POOL);
    (
        fabric,
        Endpoint::with_options(server, options),
        Endpoint::with_options(client, options),
    )
}

fn listen(server: &mut SimEndpoint, caps: QueueCaps) -> ListenerId {
    let addr = server.transport().addr(PORT);
    let options = ListenOptions {
        caps,
        ..ListenOptions::default()
    };
    server.listen(addr, options).unwrap()
}

fn connect(server: &SimEndpoint, client: &mut SimEndpoint) -> ConnectionId {
    let addr = server.transport().addr(PORT);
    let options = ConnectOptions {
        caps: CAPS,
        ..ConnectOptions::default()
    };
    client.connect(addr, options).unwrap()
}

/// Steps the fabric until nothing is left, handing every event of each side to its
/// handler.
fn run(
    fabric: &SimFabric,
    server: &mut SimEndpoint,
    client: &mut SimEndpoint,
    mut on_server: impl FnMut(&mut SimEndpoint, Event),
    mut on_client: impl FnMut(&mut SimEndpoint, Event),
) {
    loop {
        while let Some(event) = server.poll().unwrap() {
            on_server(server, event);
        }
        while let Some(event) = client.poll().unwrap() {
            on_client(client, event);
        }
        if !fabric.step() {
            return;
        }
    }
}

/// Steps the fabric until nothing is left; how many connections the server saw
/// established. No client connection may close.
fn run_established(
    fabric: &SimFabric,
    server: &mut SimEndpoint,
    client: &mut SimEndpoint,
) -> usize {
    let mut established = 0;
    run(
        fabric,
        server,
        client,
        |_, event| established += usize::from(matches!(event, Event::Established { .. })),
        |_, event| assert!(!matches!(event, Event::Closed { .. }), "{event:?}"),
    );
    established
}

/// Twenty clients, every RTU lost, both sides on shared queues: each server connection
/// is rescued by a receive read from the one shared receive queue, and every echo goes
/// back to the client that sent it.
#[test]
fn every_connection_on_one_shared_queue_is_rescued_and_answered_in_order() {
    let config = SimConfig {
        comm_est: false,
        ..SimConfig::default()
    };
    let (fabric, mut server, mut client) = endpoints(config, 11);
    fabric.add_fault(FaultRule::new(MsgKind::Rtu, FaultAction::Drop));
    listen(&mut server, CAPS);
    let mut sent: HashMap<ConnectionId, Vec<u8>> = HashMap::new();
    for _ in 0..20 {
        let conn = connect(&server, &mut client);
        sent.insert(conn, Vec::new());
    }
    let mut vias = Vec::new();
    let mut echoed: HashMap<ConnectionId, Vec<Vec<u8>>> = HashMap::new();
    run(
        &fabric,
        &mut server,
        &mut client,
        |server, event| match event {
            Event::Established { conn, via, .. } => vias.push((conn, via)),
            Event::Received { conn, data } => server.send(conn, &data).unwrap(),
            Event::Closed { conn, reason } => panic!("server {conn}: {reason:?}"),
            _ => {}
        },
        |client, event| match event {
            Event::Established { conn, .. } => {
                for n in 0..3u8 {
                    let message = [conn.slot() as u8, n];
                    client.send(conn, &message).unwrap();
                }
            }
            Event::Received { conn, data } => echoed.entry(conn).or_default().push(data),
            Event::Closed { conn, reason } => panic!("client {conn}: {reason:?}"),
            _ => {}
        },
    );
    assert_eq!(vias.len(), 20);
    for (conn, via) in &vias {
        assert_eq!(
            *via,
            EstablishedVia::Notify(Trigger::ReceiveCompletion),
            "{conn}"
        );
    }
    assert_eq!(server.counters().forced, 20);
    for conn in sent.keys() {
        let expected: Vec<Vec<u8>> = (0..3u8).map(|n| vec![conn.slot() as u8, n]).collect();
        assert_eq!(echoed.get(conn), Some(&expected), "{conn}");
    }
    let stats = server.stats();
    assert_eq!(stats.shared_queue_devices, 1);
    assert_eq!(stats.shared_sends_free, POOL.send_slots as usize);
    assert_eq!(client.stats().shared_queue_devices, 1);
}

/// A peer that sends past the receive depth while the application takes nothing is
/// closed with `ReceiveOverrun`; what it sent within the depth is still delivered, and
/// the other connection on the same queue is untouched.
#[test]
fn a_peer_past_its_receive_depth_is_closed_and_the_others_go_on() {
    let (fabric, mut server, mut client) = endpoints(SimConfig::default(), 12);
    listen(&mut server, CAPS);
    let flooder = connect(&server, &mut client);
    let polite = connect(&server, &mut client);
    // Set up both, without the server taking anything.
    while fabric.step() {
        server.process().unwrap();
        while client.poll().unwrap().is_some() {}
    }
    // The flooder sends one past the depth (sends go out as their completions free
    // the buffers), the polite one within it.
    for n in 0..=CAPS.recv_depth {
        loop {
            match client.send(flooder, &[b'f', n as u8]) {
                Ok(()) => break,
                Err(ConnError::SendQueueFull(_)) => {
                    fabric.step();
                    server.process().unwrap();
                    while client.poll().unwrap().is_some() {}
                }
                Err(error) => panic!("{error}"),
            }
        }
    }
    client.send(polite, b"p").unwrap();
    while fabric.step() {
        server.process().unwrap();
        while client.poll().unwrap().is_some() {}
    }
    let mut received: HashMap<ConnectionId, Vec<Vec<u8>>> = HashMap::new();
    let mut closed = Vec::new();
    while let Some(event) = server.poll().unwrap() {
        match event {
            Event::Received { conn, data } => received.entry(conn).or_default().push(data),
            Event::Closed { conn, reason } => closed.push((conn, reason)),
            _ => {}
        }
    }
    assert_eq!(closed.len(), 1, "{closed:?}");
    let (overrun, reason) = &closed[0];
    assert_eq!(
        *reason,
        CloseReason::ReceiveOverrun {
            depth: CAPS.recv_depth
        }
    );
    let within: Vec<Vec<u8>> = (0..CAPS.recv_depth).map(|n| vec![b'f', n as u8]).collect();
    assert_eq!(received.get(overrun), Some(&within));
    let others: Vec<_> = received.iter().filter(|(c, _)| *c != overrun).collect();
    assert_eq!(others.len(), 1);
    assert_eq!(others[0].1, &vec![b"p".to_vec()]);
}

/// Sends take buffers of the shared pool: with every buffer in flight the next send
/// answers `SendQueueFull`, and a completion gives one back.
#[test]
fn the_send_pool_is_bounded_and_completions_give_buffers_back() {
    let (fabric, mut server, mut client) = endpoints(SimConfig::default(), 13);
    let wide = QueueCaps {
        send_depth: 16,
        ..CAPS
    };
    listen(&mut server, wide);
    connect(&server, &mut client);
    let mut accepted = None;
    while fabric.step() {
        while let Some(event) = server.poll().unwrap() {
            if let Event::Established { conn, .. } = event {
                accepted = Some(conn);
            }
        }
        while client.poll().unwrap().is_some() {}
    }
    let conn = accepted.expect("established");
    for n in 0..POOL.send_slots {
        server.send(conn, &[n as u8]).unwrap();
    }
    assert_eq!(server.stats().shared_sends_free, 0);
    assert!(matches!(
        server.send(conn, b"one too many"),
        Err(ConnError::SendQueueFull(c)) if c == conn
    ));
    while fabric.step() {
        server.process().unwrap();
        while client.poll().unwrap().is_some() {}
    }
    server.process().unwrap();
    assert_eq!(server.stats().shared_sends_free, POOL.send_slots as usize);
    server.send(conn, b"again").unwrap();
}

/// A listener whose connections' messages are larger than the pool's buffers gives
/// them queues of their own: they are accepted and carry such messages, beside the
/// connections on the shared queues.
#[test]
fn messages_larger_than_the_pool_get_queues_of_their_own() {
    let (fabric, mut server, mut client) = endpoints(SimConfig::default(), 14);
    let large = QueueCaps {
        buffer_size: POOL.buffer_size * 2,
        ..CAPS
    };
    listen(&mut server, large);
    let addr = server.transport().addr(PORT);
    let options = ConnectOptions {
        caps: large,
        ..ConnectOptions::default()
    };
    client.connect(addr, options).unwrap();
    let big = vec![7u8; large.buffer_size as usize];
    let mut received = Vec::new();
    run(
        &fabric,
        &mut server,
        &mut client,
        |_, event| match event {
            Event::Received { data, .. } => received.push(data),
            Event::Closed { reason, .. } | Event::ListenerClosed { reason, .. } => {
                panic!("{reason:?}")
            }
            Event::AcceptFailed { error, .. } => panic!("{error}"),
            _ => {}
        },
        |client, event| {
            if let Event::Established { conn, .. } = event {
                client.send(conn, &big).unwrap();
            }
        },
    );
    assert_eq!(received, vec![big.clone()]);
    // Neither side made shared queues for it.
    assert_eq!(server.stats().shared_queue_devices, 0);
    assert_eq!(client.stats().shared_queue_devices, 0);
}

/// Connects `n` clients to a server and exchanges one message each; the fabric's
/// registered-byte figures at the end.
fn registered_with(shared: bool, n: usize) -> cm_mock::sim::SimStats {
    let SimTransports {
        fabric,
        server,
        client,
    } = SimTransports::new(SimConfig::default(), 15);
    let options = if shared {
        EndpointOptions::shared_queues(POOL)
    } else {
        EndpointOptions::own_queues()
    };
    let mut server = Endpoint::with_options(server, options);
    let mut client = Endpoint::with_options(client, options);
    listen(&mut server, CAPS);
    for _ in 0..n {
        connect(&server, &mut client);
    }
    let mut echoed = 0;
    run(
        &fabric,
        &mut server,
        &mut client,
        |server, event| {
            if let Event::Received { conn, data } = event {
                server.send(conn, &data).unwrap();
            }
        },
        |client, event| match event {
            Event::Established { conn, .. } => client.send(conn, b"hi").unwrap(),
            Event::Received { .. } => echoed += 1,
            _ => {}
        },
    );
    assert_eq!(echoed, n);
    fabric.stats()
}

/// Registered memory: per-connection buffers grow with every connection on both
/// sides; with shared queues nothing is registered per connection, and the pools (one
/// per side's device) are the same size for 20 connections as for 100.
#[test]
fn registered_memory_does_not_grow_with_connections_on_shared_queues() {
    let area = CAPS.area_len().unwrap() as u64;
    let own = registered_with(false, 100);
    assert_eq!(own.registered_buffers_peak, 2 * 100 * area);
    assert_eq!(own.registered_pools_peak, 0);
    let pool = POOL.pool_len().unwrap() as u64;
    for n in [20, 100] {
        let shared = registered_with(true, n);
        assert_eq!(shared.registered_buffers_peak, 0, "{n} connections");
        assert_eq!(shared.registered_pools_peak, 2 * pool, "{n} connections");
    }
}

/// A connection refused a send because the others hold the whole send pool is told
/// when a buffer comes free (an `Event::Sent` of 0 of its own completions), then sends:
/// nobody waits on a completion of its own that will never come.
#[test]
fn a_connection_refused_for_want_of_a_pool_buffer_is_told_when_one_frees() {
    let (fabric, mut server, mut client) = endpoints(SimConfig::default(), 16);
    let wide = QueueCaps {
        send_depth: 16,
        ..CAPS
    };
    listen(&mut server, wide);
    connect(&server, &mut client);
    connect(&server, &mut client);
    let mut accepted = Vec::new();
    while fabric.step() {
        while let Some(event) = server.poll().unwrap() {
            if let Event::Established { conn, .. } = event {
                accepted.push(conn);
            }
        }
        while client.poll().unwrap().is_some() {}
    }
    let [busy, refused] = accepted[..] else {
        panic!("{accepted:?}");
    };
    for n in 0..POOL.send_slots {
        server.send(busy, &[n as u8]).unwrap();
    }
    assert!(matches!(
        server.send(refused, b"mine"),
        Err(ConnError::SendQueueFull(c)) if c == refused
    ));
    // Refused again while waiting: still one place in the queue.
    assert!(server.send(refused, b"mine").is_err());
    let mut told = None;
    while told.is_none() && fabric.step() {
        while let Some(event) = server.poll().unwrap() {
            if let Event::Sent { conn, completed } = event {
                if conn == refused {
                    told = Some(completed);
                }
            }
        }
        while client.poll().unwrap().is_some() {}
    }
    assert_eq!(told, Some(0), "told, with none of its own completed");
    server.send(refused, b"mine").unwrap();
}

/// `IBV_EVENT_SRQ_ERR` on the server's device: every connection on its shared queues
/// ends with the event as cause (the client hears a disconnect), the queues are given
/// back, and the device's next connection gets queues of its own and works.
#[test]
fn a_shared_receive_queue_error_ends_its_connections_and_the_next_get_their_own() {
    let (fabric, mut server, mut client) = endpoints(SimConfig::default(), 16);
    listen(&mut server, CAPS);
    for _ in 0..3 {
        connect(&server, &mut client);
    }
    let established = run_established(&fabric, &mut server, &mut client);
    assert_eq!((established, server.stats().shared_queue_devices), (3, 1));
    let error = AsyncEvent {
        event_type: AsyncEventType::SrqErr,
        element: EventElement::Srq(1),
    };
    server.transport().node().device().raise(error);
    let (mut server_closed, mut client_closed) = (Vec::new(), 0);
    run(
        &fabric,
        &mut server,
        &mut client,
        |_, event| {
            if let Event::Closed { reason, .. } = event {
                server_closed.push(reason);
            }
        },
        |_, event| client_closed += usize::from(matches!(event, Event::Closed { .. })),
    );
    assert_eq!(server_closed.len(), 3, "{server_closed:?}");
    for reason in &server_closed {
        assert!(
            matches!(
                reason,
                CloseReason::QpError {
                    detail: QpErrorDetail::AsyncEvent(AsyncEvent {
                        event_type: AsyncEventType::SrqErr,
                        ..
                    })
                }
            ),
            "{reason:?}"
        );
    }
    assert_eq!(client_closed, 3, "each client told by the DREQ");
    assert_eq!(
        server.stats().shared_queue_devices,
        0,
        "the queues given back"
    );
    // The next connection works, on queues of its own.
    let conn = connect(&server, &mut client);
    let mut echoed = Vec::new();
    run(
        &fabric,
        &mut server,
        &mut client,
        |server, event| {
            if let Event::Received { conn, data } = event {
                server.send(conn, &data).unwrap();
            }
        },
        |client, event| match event {
            Event::Established { conn, .. } => client.send(conn, b"again").unwrap(),
            Event::Received { data, .. } => echoed.push(data),
            Event::Closed { reason, .. } => panic!("{reason:?}"),
            _ => {}
        },
    );
    assert_eq!(echoed, vec![b"again".to_vec()], "{conn}");
    assert_eq!(server.stats().shared_queue_devices, 0);
}

#[test]
fn a_listener_makes_its_devices_shared_queues_before_any_request() {
    let (fabric, mut server, mut client) = endpoints(SimConfig::default(), 31);
    let listener = listen(&mut server, CAPS);
    assert_eq!(
        server.stats().shared_queue_devices,
        1,
        "made at listen: the first request does not wait for them"
    );
    let conn = connect(&server, &mut client);
    let established = run_established(&fabric, &mut server, &mut client);
    assert_eq!(established, 1, "{conn}");
    assert_eq!(server.stats().shared_queue_devices, 1, "the same set");
    // The listener and the connection each hold the device: the queues stay until both
    // are gone.
    server.close_listener(listener).unwrap();
    assert_eq!(
        server.stats().shared_queue_devices,
        1,
        "the connection uses them"
    );
    client.disconnect(conn).unwrap();
    run(&fabric, &mut server, &mut client, |_, _| {}, |_, _| {});
    assert_eq!(
        server.stats().shared_queue_devices,
        0,
        "given back with the last user of the device"
    );
}

#[test]
fn a_listener_whose_messages_exceed_the_pool_makes_no_shared_queues() {
    let (_fabric, mut server, _client) = endpoints(SimConfig::default(), 32);
    listen(
        &mut server,
        QueueCaps {
            buffer_size: POOL.buffer_size * 2,
            ..CAPS
        },
    );
    assert_eq!(server.stats().shared_queue_devices, 0);
}
