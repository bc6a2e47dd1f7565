//! A server whose connection setup takes time (QP creation, memory registration) while
//! requests keep arriving: the endpoint reads the CM channel ahead of its setup work,
//! so requests wait in its own queue and never fill the kernel's listen backlog (past
//! it the kernel drops a REQ without a reply and the client resends it only after its
//! CM response timeout, seconds later).

use std::time::Duration;

use cm_mock::sim::{FaultOdds, MsgKind, SimConfig, SimPair, SimTransport};
use cm_verbs::{ConnError, Endpoint, Event, ListenOptions, PrivateData};

const PORT: u16 = 7471;
const CLIENTS: usize = 300;
const BACKLOG: u16 = 32;

/// A fabric where a QP costs 500 µs and a registration 100 µs of virtual time, a
/// server endpoint listening with [`BACKLOG`], and [`CLIENTS`] raw client ids whose
/// REQs arrive spread over 30 ms: about one per 100 µs, six per server setup.
fn flood(seed: u64, auto_accept: bool) -> (SimPair, Endpoint<SimTransport>) {
    let config = SimConfig {
        create_qp_cost: Duration::from_micros(500),
        register_cost: Duration::from_micros(100),
        ..SimConfig::default()
    };
    let mut pair = SimPair::new(config, seed);
    let mut server = Endpoint::new(SimTransport::on_side(pair.server.clone()));
    let options = ListenOptions {
        backlog: BACKLOG,
        auto_accept,
        ..ListenOptions::default()
    };
    server
        .listen(server.transport().addr(PORT), options)
        .unwrap();

    let to = pair.server.node.id();
    let clients: Vec<_> = (0..CLIENTS)
        .map(|_| {
            let id = pair.client.channel.create_id();
            id.resolve_addr(to, PORT).unwrap();
            id
        })
        .collect();
    pair.fabric.advance(SimPair::STEP);
    for id in &clients {
        id.resolve_route().unwrap();
    }
    pair.fabric.advance(SimPair::STEP);
    for id in &clients {
        id.create_qp().unwrap();
    }
    pair.client.drain();
    pair.fabric.set_fault_odds(
        MsgKind::Req,
        FaultOdds {
            delay: 1.0,
            max_delay: Duration::from_millis(30),
            ..FaultOdds::default()
        },
    );
    for id in &clients {
        id.connect(&[]).unwrap();
    }
    (pair, server)
}

#[test]
fn requests_arriving_faster_than_setups_wait_in_the_endpoint_not_the_kernel() {
    for seed in 1..=3 {
        let (pair, mut server) = flood(seed, true);
        let most_waiting = serve(seed, pair, &mut server, |server| {
            server.poll().expect("server poll")
        });
        assert!(
            most_waiting > usize::from(BACKLOG),
            "seed {seed}: the requests waited in the endpoint's queue ({most_waiting} at most)"
        );
        assert_eq!(server.stats().setup_entries, 0, "seed {seed}");
    }
}

#[test]
fn a_server_accepting_each_request_itself_keeps_the_backlog_empty_too() {
    for seed in 1..=3 {
        let (pair, mut server) = flood(seed, false);
        // As a server loop takes events: from the queue while it has some (no pass).
        serve(seed, pair, &mut server, |server| {
            match server.next_event(Some(Duration::ZERO)) {
                Ok(event) => {
                    if let Event::Request { conn, .. } = event {
                        server
                            .accept_request(conn, &PrivateData::empty())
                            .expect("accept");
                    }
                    Some(event)
                }
                Err(ConnError::Timeout) => None,
                Err(error) => panic!("seed {seed}: {error}"),
            }
        });
    }
}

/// Runs `next` (which takes one event, if any) until every request was answered with a
/// REP; the most requests that waited in the endpoint at once.
fn serve(
    seed: u64,
    mut pair: SimPair,
    server: &mut Endpoint<SimTransport>,
    mut next: impl FnMut(&mut Endpoint<SimTransport>) -> Option<Event>,
) -> usize {
    let mut requested = 0;
    let mut most_waiting = 0;
    // 300 setups of 600 µs: 180 ms, well within a second of virtual time.
    let give_up = pair.fabric.now() + Duration::from_secs(1);
    while pair.fabric.stats().sent_of(MsgKind::Rep) < CLIENTS as u64 {
        assert!(
            pair.fabric.now() < give_up,
            "seed {seed}: {} of {CLIENTS} requests answered after a second, {} REQs \
             dropped by a full backlog",
            pair.fabric.stats().sent_of(MsgKind::Rep),
            pair.fabric.stats().reqs_dropped_backlog
        );
        let mut any = false;
        while let Some(event) = next(server) {
            any = true;
            if let Event::AcceptFailed { error, .. } = event {
                panic!("seed {seed}: a setup failed: {error}");
            }
        }
        most_waiting = most_waiting.max(server.stats().setup_entries);
        requested = requested.max(pair.fabric.stats().delivered_of(MsgKind::Req));
        pair.client.drain();
        if !any {
            pair.fabric.advance(Duration::from_micros(10));
        }
    }
    let stats = pair.fabric.stats();
    assert_eq!(
        stats.reqs_dropped_backlog, 0,
        "seed {seed}: the kernel's backlog never overflowed"
    );
    assert_eq!(
        stats.sent_of(MsgKind::Req),
        CLIENTS as u64,
        "seed {seed}: no client resent its REQ"
    );
    assert_eq!(requested, CLIENTS as u64);
    assert_eq!(server.stats().requests_refused, 0, "seed {seed}");
    most_waiting
}
