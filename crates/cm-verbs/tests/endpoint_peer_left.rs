//! A one-shot client whose RTU is lost: it connects, sends one message and leaves at
//! once, so its DREQ reaches the server before the server has read the message that
//! would have forced the establish. The CM reports DISCONNECTED without ESTABLISHED;
//! the message proves the peer was established (it sends only after this side's REP),
//! so the server still gets the connection, the message, then the close.

use std::time::Duration;

use cm_mock::sim::{FaultAction, FaultRule, MsgKind, SimConfig, SimTransport, SimTransports};
use cm_verbs::{CloseReason, ConnectOptions, Endpoint, EstablishedVia, Event, ListenOptions, Role};

const PORT: u16 = 7471;

/// Runs the fabric with only the client's endpoint reading, until `done` says so.
fn drive_client(
    fabric: &cm_mock::sim::SimFabric,
    client: &mut Endpoint<SimTransport>,
    mut done: impl FnMut(&Event) -> bool,
) {
    for _ in 0..10_000 {
        while let Some(event) = client.poll().expect("client poll") {
            if done(&event) {
                return;
            }
        }
        fabric.advance(Duration::from_micros(10));
    }
    panic!("the client never got there");
}

/// A server that handled the REQ (REP sent), then a client that connects, sends one
/// message and disconnects while the server reads nothing, every RTU dropped.
fn one_shot_client_gone_before_the_server_reads(seed: u64) -> Endpoint<SimTransport> {
    let config = SimConfig {
        comm_est: false,
        ..SimConfig::default()
    };
    let SimTransports {
        fabric,
        server,
        client,
    } = SimTransports::new(config, seed);
    fabric.add_fault(FaultRule::new(MsgKind::Rtu, FaultAction::Drop));
    let mut server = Endpoint::new(server);
    let mut client = Endpoint::new(client);
    server
        .listen(server.transport().addr(PORT), ListenOptions::default())
        .unwrap();
    let to = server.transport().addr(PORT);
    let conn = client.connect(to, ConnectOptions::default()).unwrap();
    // The server answers the REQ (REP sent); the client is established by the REP.
    let mut established = false;
    for _ in 0..10_000 {
        server.poll().expect("server poll");
        while let Some(event) = client.poll().expect("client poll") {
            established |= matches!(event, Event::Established { .. });
        }
        if established {
            break;
        }
        fabric.advance(Duration::from_micros(10));
    }
    assert!(established, "the client is established by the REP");
    client.send(conn, b"one shot").unwrap();
    drive_client(&fabric, &mut client, |event| {
        matches!(event, Event::Sent { .. })
    });
    client.disconnect(conn).unwrap();
    // The DREQ reaches the server's CM; the client's end waits for the DREP.
    fabric.advance(Duration::from_millis(1));
    server
}

#[test]
fn a_one_shot_client_that_left_before_its_message_was_read_is_established_with_it() {
    for seed in 1..=5 {
        let mut server = one_shot_client_gone_before_the_server_reads(seed);
        let second = Some(Duration::from_secs(1));
        let mut events = Vec::new();
        while let Ok(event) = server.next_event(second) {
            let closed = matches!(event, Event::Closed { .. });
            events.push(event);
            if closed {
                break;
            }
        }
        let conn = match events.first() {
            Some(&Event::Established {
                conn,
                role: Role::Passive,
                via: EstablishedVia::PeerMessage,
                ..
            }) => conn,
            _ => panic!("seed {seed}: established first: {events:?}"),
        };
        assert_eq!(
            events[1..],
            [
                Event::Received {
                    conn,
                    data: b"one shot".to_vec()
                },
                Event::Closed {
                    conn,
                    reason: CloseReason::Disconnected
                }
            ],
            "seed {seed}"
        );
        let counters = server.counters();
        assert_eq!(counters.forced, 0, "the CM was not forced");
        assert_eq!(
            (counters.notify_failed, counters.notify_failed_retriable),
            (0, 0),
            "no notify once the CM reported the peer gone"
        );
        assert_eq!(server.connection_count(), 0, "nothing leaked");
        assert_eq!(server.stats().closed_unreported, 0);
    }
}
