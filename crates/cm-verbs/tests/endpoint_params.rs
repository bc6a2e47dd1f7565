//! Connection parameters (simulated fabric): what `ConnectOptions::params` and
//! `ListenOptions::params` say reaches the CM's connect and accept, on both accept
//! paths, and an out-of-range value is refused with a typed error before anything is
//! created.

use cm_mock::sim::{SimFabric, SimTransport, SimTransports};
use cm_verbs::{
    CmError, ConnError, ConnectOptions, ConnectionId, ConnectionParams, Endpoint, Event,
    ListenOptions, PrivateData,
};

const PORT: u16 = 7490;

type SimEndpoint = Endpoint<SimTransport>;

fn endpoints(seed: u64) -> (SimFabric, SimEndpoint, SimEndpoint) {
    let SimTransports {
        fabric,
        server,
        client,
    } = SimTransports::new(Default::default(), seed);
    (fabric, Endpoint::new(server), Endpoint::new(client))
}

const CLIENT: ConnectionParams = ConnectionParams {
    responder_resources: 4,
    initiator_depth: 4,
    retry_count: 5,
    rnr_retry_count: 3,
};

const SERVER: ConnectionParams = ConnectionParams {
    responder_resources: 8,
    initiator_depth: 2,
    retry_count: 0,
    rnr_retry_count: 6,
};

/// Runs the fabric until nothing is left, accepting manual requests; returns the
/// server's established connections.
fn run(
    fabric: &SimFabric,
    server: &mut SimEndpoint,
    client: &mut SimEndpoint,
) -> Vec<ConnectionId> {
    let mut established = Vec::new();
    loop {
        while let Some(event) = server.poll().unwrap() {
            match event {
                Event::Request { conn, .. } => {
                    server.accept_request(conn, &PrivateData::empty()).unwrap();
                }
                Event::Established { conn, .. } => established.push(conn),
                Event::Closed { .. } => panic!("server: {event:?}"),
                _ => {}
            }
        }
        while let Some(event) = client.poll().unwrap() {
            assert!(!matches!(event, Event::Closed { .. }), "client: {event:?}");
        }
        if !fabric.step() {
            return established;
        }
    }
}

/// Both accept paths (automatic, and the application's `accept_request`) accept with
/// the listener's parameters; the connecting side connects with its own.
#[test]
fn each_side_hands_its_parameters_to_the_cm() {
    for auto_accept in [true, false] {
        let (fabric, mut server, mut client) = endpoints(90);
        let addr = server.transport().addr(PORT);
        let options = ListenOptions {
            auto_accept,
            params: SERVER,
            ..ListenOptions::default()
        };
        server.listen(addr, options).unwrap();
        let options = ConnectOptions {
            params: CLIENT,
            ..ConnectOptions::default()
        };
        let out = client.connect(addr, options).unwrap();
        let accepted = run(&fabric, &mut server, &mut client);
        assert_eq!(
            accepted.len(),
            1,
            "auto_accept {auto_accept}: one connection"
        );
        assert_eq!(
            client.cm_id(out).unwrap().conn_params(),
            Some(CLIENT),
            "auto_accept {auto_accept}: the REQ's"
        );
        assert_eq!(
            server.cm_id(accepted[0]).unwrap().conn_params(),
            Some(SERVER),
            "auto_accept {auto_accept}: the REP's"
        );
    }
}

/// Options left at their default connect and accept with librdmacm's usual values.
#[test]
fn the_default_is_one_read_each_way_and_rnr_retries_forever() {
    let (fabric, mut server, mut client) = endpoints(91);
    let addr = server.transport().addr(PORT);
    server.listen(addr, ListenOptions::default()).unwrap();
    let out = client.connect(addr, ConnectOptions::default()).unwrap();
    let accepted = run(&fabric, &mut server, &mut client);
    let default = ConnectionParams::default();
    assert_eq!((default.initiator_depth, default.rnr_retry_count), (1, 7));
    assert_eq!(client.cm_id(out).unwrap().conn_params(), Some(default));
    assert_eq!(
        server.cm_id(accepted[0]).unwrap().conn_params(),
        Some(default)
    );
}

/// A retry count above 7 is refused by `connect` and `listen` with a typed error, and
/// nothing is created: no connection, no listener, no message on the fabric.
#[test]
fn out_of_range_retry_counts_are_refused_and_create_nothing() {
    let (fabric, mut server, mut client) = endpoints(92);
    let addr = server.transport().addr(PORT);
    let bad_listen = ListenOptions {
        params: ConnectionParams {
            rnr_retry_count: 8,
            ..ConnectionParams::default()
        },
        ..ListenOptions::default()
    };
    let refused = server.listen(addr, bad_listen);
    assert!(
        matches!(refused, Err(ConnError::Cm(CmError::InvalidArgument { .. }))),
        "{refused:?}"
    );
    assert_eq!(server.listener_count(), 0);
    let bad_connect = ConnectOptions {
        params: ConnectionParams {
            retry_count: 200,
            ..ConnectionParams::default()
        },
        ..ConnectOptions::default()
    };
    let refused = client.connect(addr, bad_connect);
    assert!(
        matches!(refused, Err(ConnError::Cm(CmError::InvalidArgument { .. }))),
        "{refused:?}"
    );
    assert_eq!(client.stats().connections, 0);
    assert_eq!(fabric.stats().sent, [0; 8], "nothing reached the fabric");
    // The same endpoints still work with valid values.
    server.listen(addr, ListenOptions::default()).unwrap();
    client.connect(addr, ConnectOptions::default()).unwrap();
    assert_eq!(run(&fabric, &mut server, &mut client).len(), 1);
}
