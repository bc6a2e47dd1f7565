//! Per-connection traffic counters (simulated fabric): `ConnectionInfo::traffic` counts
//! each message `send` posted and each one that arrived, with their bytes, on both
//! sides, on shared queues and on queues of each connection's own.

#[path = "common/sim.rs"]
mod sim;

use cm_mock::sim::{SimConfig, SimTransports};
use cm_verbs::{ConnectOptions, ConnectionId, Endpoint, EndpointOptions, Event, Traffic};
use sim::{listening, SimEndpoints};

const PORT: u16 = 7491;
/// Messages the client sends, one at a time, each echoed: sizes 1 to `MESSAGES`.
const MESSAGES: usize = 40;

fn echo_and_count(options: EndpointOptions, seed: u64) -> (Traffic, Traffic) {
    let SimEndpoints {
        fabric,
        mut server,
        mut client,
        addr,
    } = listening(seed, PORT, options);
    let out = client.connect(addr, ConnectOptions::default()).unwrap();
    let mut accepted: Option<ConnectionId> = None;
    let mut next = 1;
    let mut echoed = 0;
    for _ in 0..100_000 {
        while let Some(event) = server.poll().unwrap() {
            match event {
                Event::Established { conn, .. } => accepted = Some(conn),
                Event::Received { conn, data } => server.send(conn, &data).unwrap(),
                Event::Closed { .. } => panic!("server: {event:?}"),
                _ => {}
            }
        }
        while let Some(event) = client.poll().unwrap() {
            match event {
                Event::Established { .. } => {
                    client.send(out, &vec![7; next]).unwrap();
                }
                Event::Received { data, .. } => {
                    assert_eq!(data.len(), next, "the echo of message {next}");
                    echoed += 1;
                    if next < MESSAGES {
                        next += 1;
                        client.send(out, &vec![7; next]).unwrap();
                    }
                }
                Event::Closed { .. } => panic!("client: {event:?}"),
                _ => {}
            }
        }
        if echoed == MESSAGES {
            break;
        }
        fabric.step();
    }
    assert_eq!(echoed, MESSAGES, "every message echoed");
    let accepted = accepted.expect("the server established its connection");
    (
        client.info(out).unwrap().traffic,
        server.info(accepted).unwrap().traffic,
    )
}

fn check(options: EndpointOptions, seed: u64) {
    let (client, server) = echo_and_count(options, seed);
    let bytes = (MESSAGES * (MESSAGES + 1) / 2) as u64;
    let both_ways = Traffic {
        messages_sent: MESSAGES as u64,
        bytes_sent: bytes,
        messages_received: MESSAGES as u64,
        bytes_received: bytes,
    };
    assert_eq!(client, both_ways, "client");
    assert_eq!(server, both_ways, "server");
}

#[test]
fn each_message_and_its_bytes_are_counted_on_shared_queues() {
    check(EndpointOptions::shared_queues(Default::default()), 31);
}

#[test]
fn each_message_and_its_bytes_are_counted_on_own_queues() {
    check(EndpointOptions::own_queues(), 32);
}

/// A new connection starts at zero.
#[test]
fn a_connection_starts_with_nothing_counted() {
    let SimTransports { server, client, .. } = SimTransports::new(SimConfig::default(), 33);
    let server = Endpoint::new(server);
    let mut client = Endpoint::new(client);
    let addr = server.transport().addr(PORT);
    let out = client.connect(addr, ConnectOptions::default()).unwrap();
    assert_eq!(client.info(out).unwrap().traffic, Traffic::default());
}

/// The final counts stay readable after the close until it is reported
/// (`Endpoint::traffic`), then the connection is unknown.
#[test]
fn the_counts_outlive_the_close_until_it_is_reported() {
    let SimEndpoints {
        fabric,
        mut server,
        mut client,
        addr,
    } = listening(34, PORT, EndpointOptions::default());
    let out = client.connect(addr, ConnectOptions::default()).unwrap();
    let mut accepted = None;
    let mut sent = false;
    // The server takes its events until its connection is established; the client
    // sends one message and disconnects once it is sent.
    for _ in 0..10_000 {
        if accepted.is_none() {
            match server.poll().unwrap() {
                Some(Event::Established { conn, .. }) => accepted = Some(conn),
                Some(other) => panic!("server: {other:?}"),
                None => {}
            }
        }
        while let Some(event) = client.poll().unwrap() {
            if let Event::Established { conn, .. } = event {
                client.send(conn, b"last words").unwrap();
                sent = true;
            }
        }
        if sent && accepted.is_some() && client.info(out).unwrap().sends_in_flight == 0 {
            client.disconnect(out).unwrap();
            break;
        }
        fabric.step();
    }
    while fabric.step() {}
    let conn = accepted.expect("accepted");
    // The message comes first, then the close, reported after it.
    assert_eq!(
        server.poll().unwrap(),
        Some(Event::Received {
            conn,
            data: b"last words".to_vec()
        })
    );
    server.info(conn).expect_err("closed, not yet reported");
    let last = server.traffic(conn).unwrap();
    assert_eq!((last.messages_received, last.bytes_received), (1, 10));
    assert!(matches!(
        server.poll().unwrap(),
        Some(Event::Closed { conn: c, .. }) if c == conn
    ));
    assert!(matches!(
        server.traffic(conn),
        Err(cm_verbs::ConnError::UnknownConnection(_))
    ));
}
