//! `Endpoint` on both nodes of the simulated fabric under random sequences of calls and
//! faults (connect, accept, reject, send, recv, disconnect, RTU loss, device removal…):
//! no panic, every queue within its documented bound, each connection established at
//! most once per side, a closed handle names nothing. The body is the `endpoint_ops`
//! fuzz target's (fuzz/src/endpoint_ops.rs), and its committed seed corpus replays here.

#[allow(unreachable_pub, dead_code)]
#[path = "../../../fuzz/src/corpus.rs"]
mod corpus;
#[allow(unreachable_pub, dead_code)]
#[path = "../../../fuzz/src/endpoint_ops.rs"]
mod endpoint_ops;
#[allow(unreachable_pub, dead_code)]
#[path = "../../../fuzz/src/input.rs"]
mod input;

use std::time::Duration;

use cm_mock::sim::{SimConfig, SimFabric, SimPair, SimTransport, SimTransports};
use cm_verbs::core::EventElement;
use cm_verbs::{
    AsyncEvent, AsyncEventType, ConnectOptions, Endpoint, Event, ListenOptions, ListenerId,
};
use proptest::prelude::*;

const PORT: u16 = 7471;

type SimEndpoint = Endpoint<SimTransport>;

proptest! {
    // 64 cases unless PROPTEST_CASES says otherwise (e.g. a long soak run).
    #![proptest_config(ProptestConfig::with_cases(
        std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(64)
    ))]

    /// Four bytes of set-up and four a call: shrinking drops whole calls.
    #[test]
    fn random_calls_and_faults_keep_the_endpoint_contract(
        setup in any::<[u8; 4]>(),
        ops in prop::collection::vec(any::<[u8; 4]>(), 0..96),
    ) {
        let data: Vec<u8> = setup.into_iter().chain(ops.into_iter().flatten()).collect();
        let (setup, ops) = endpoint_ops::decode(&data);
        let run = std::panic::catch_unwind(|| endpoint_ops::run_ops(&setup, &ops));
        prop_assert!(run.is_ok(), "{setup:?}\n{ops:#?}");
    }
}

/// The committed seed corpus, built into the test (it also runs in the VM, where the
/// source tree is not there to read); xtask's tidy test checks that it names every
/// file of fuzz/corpus/endpoint_ops.
const SEEDS: &[(&str, &[u8])] = &[
    (
        "device-fatal-then-waits",
        include_bytes!("../../../fuzz/corpus/endpoint_ops/device-fatal-then-waits"),
    ),
    (
        "manual-accept-and-reject",
        include_bytes!("../../../fuzz/corpus/endpoint_ops/manual-accept-and-reject"),
    ),
    (
        "one-sided-work-across-a-disconnect",
        include_bytes!("../../../fuzz/corpus/endpoint_ops/one-sided-work-across-a-disconnect"),
    ),
    (
        "one-sided-work-refused-after-successes",
        include_bytes!("../../../fuzz/corpus/endpoint_ops/one-sided-work-refused-after-successes"),
    ),
    (
        "removal-notify-off-relisten",
        include_bytes!("../../../fuzz/corpus/endpoint_ops/removal-notify-off-relisten"),
    ),
    (
        "rtu-late-comm-est",
        include_bytes!("../../../fuzz/corpus/endpoint_ops/rtu-late-comm-est"),
    ),
    (
        "rtu-lost-receive-trigger",
        include_bytes!("../../../fuzz/corpus/endpoint_ops/rtu-lost-receive-trigger"),
    ),
];

#[test]
fn committed_seed_corpus_replays_without_a_finding() {
    for (name, data) in SEEDS {
        corpus::replay("endpoint_ops", name, data, endpoint_ops::run);
    }
}

#[test]
fn empty_and_extreme_inputs_are_fine() {
    for (name, data) in [
        ("empty", &[][..]),
        ("all-ones", &[0xff; 64]),
        ("zeroes", &[0; 64]),
    ] {
        corpus::replay("endpoint_ops", name, data, endpoint_ops::run);
    }
}

/// Raises DEVICE_FATAL on `server`'s device and takes every event: the endpoint gives
/// the device's reader back.
fn fatal_error_taken(server: &mut Endpoint<SimTransport>) {
    server.transport().node().device().raise(AsyncEvent {
        event_type: AsyncEventType::DeviceFatal,
        element: EventElement::Port(1),
    });
    while server.poll().unwrap().is_some() {}
    assert_eq!(server.device_count(), 0);
}

/// Found by the property test: once a fatal error made the endpoint give its device
/// reader back, the simulated transport counted the device's unread asynchronous events
/// as ready, so a wait with a timeout spun without virtual time moving. It waits on
/// what the endpoint reads only.
#[test]
fn a_wait_after_a_fatal_device_error_ends_at_its_timeout() {
    let SimPair { server, .. } = SimPair::new(SimConfig::default(), 1);
    let mut server = Endpoint::new(SimTransport::on_side(server));
    let addr = server.transport().addr(PORT);
    server.listen(addr, ListenOptions::default()).unwrap();
    fatal_error_taken(&mut server);
    server.transport().node().device().raise(AsyncEvent {
        event_type: AsyncEventType::PortActive,
        element: EventElement::Port(1),
    });
    assert_eq!(
        server.next_event(Some(Duration::from_millis(1))),
        Err(cm_verbs::ConnError::Timeout)
    );
}

/// The same with a send's completion unread when the fatal error comes.
#[test]
fn a_wait_after_a_send_and_a_fatal_device_error_ends_at_its_timeout() {
    let (_fabric, mut server, _client, listener) = connected(1, None);
    let conn = server.accept(Some(Duration::ZERO)).unwrap();
    server.close_listener(listener).unwrap();
    server.send(conn, b"unread completion").unwrap();
    fatal_error_taken(&mut server);
    assert_eq!(
        server.next_event(Some(Duration::from_millis(1))),
        Err(cm_verbs::ConnError::Timeout)
    );
}

/// A server listening on [`PORT`] and a client that connected `n` times (each with a
/// connect deadline of `timeout`), run until the fabric is idle: every connection
/// established on both sides.
fn connected(
    n: usize,
    timeout: Option<Duration>,
) -> (SimFabric, SimEndpoint, SimEndpoint, ListenerId) {
    let SimTransports {
        fabric,
        server,
        client,
    } = SimTransports::new(SimConfig::default(), 1);
    let mut server = Endpoint::new(server);
    let mut client = Endpoint::new(client);
    let addr = server.transport().addr(PORT);
    let listener = server.listen(addr, ListenOptions::default()).unwrap();
    let options = ConnectOptions {
        timeout,
        ..ConnectOptions::default()
    };
    for _ in 0..n {
        client.connect(addr, options.clone()).unwrap();
    }
    run_until_idle(&fabric, &mut [&mut server, &mut client]);
    (fabric, server, client, listener)
}

/// Steps the fabric until nothing is scheduled, every endpoint handling its inputs.
fn run_until_idle(fabric: &SimFabric, endpoints: &mut [&mut SimEndpoint]) {
    loop {
        for endpoint in endpoints.iter_mut() {
            endpoint.process().unwrap();
        }
        if !fabric.step() {
            break;
        }
    }
}

/// Takes every event of `endpoint`, disconnecting each connection reported established.
fn disconnect_all(endpoint: &mut SimEndpoint) {
    while let Some(event) = endpoint.poll().unwrap() {
        if let Event::Established { conn, .. } = event {
            endpoint.disconnect(conn).unwrap();
        }
    }
}

/// Found by the property test: a server that takes everything with `poll` and never
/// calls `accept` has an entry of accept's queue per connection it had; once those
/// connections are gone, the stale entries go too (the documented 2 x (live) + 64).
#[test]
fn accept_entries_nobody_took_go_with_their_connections() {
    let (fabric, mut server, mut client, _) = connected(72, None);
    disconnect_all(&mut client);
    run_until_idle(&fabric, &mut [&mut server, &mut client]);
    while server.poll().unwrap().is_some() {}
    let stats = server.stats();
    assert_eq!((stats.connections, stats.closed_unreported), (0, 0));
    assert!(stats.accept_entries <= 64, "{stats:?}");
}

/// Found by the property test: connections that end long before their connect
/// deadline do not leave it in the heap past the documented 2 x (connections) + 64.
#[test]
fn deadlines_of_closed_connections_do_not_pile_up() {
    let (_fabric, _server, mut client, _) = connected(72, Some(Duration::from_secs(60)));
    disconnect_all(&mut client);
    let stats = client.stats();
    assert_eq!(stats.connections, 0);
    assert!(stats.deadline_entries <= 64, "{stats:?}");
}
