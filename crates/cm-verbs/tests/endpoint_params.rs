//! Connection parameters (simulated fabric): what `ConnectOptions::params` and
//! `ListenOptions::params` say reaches the CM's connect and accept, on both accept
//! paths, and an out-of-range value is refused with a typed error before anything is
//! created. The same for the id options (`rdma_set_option`).

use cm_mock::sim::{SimFabric, SimTransport, SimTransports};
use cm_verbs::core::{IdOption, IdOptions, Transport};
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
    min_rnr_timer: Some(9),
};

const SERVER: ConnectionParams = ConnectionParams {
    responder_resources: 8,
    initiator_depth: 2,
    retry_count: 0,
    rnr_retry_count: 6,
    min_rnr_timer: None,
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

/// A retry count above 7 (or an RNR NAK timer above 31) is refused by `connect` and
/// `listen` with a typed error, and nothing is created: no connection, no listener, no
/// message on the fabric.
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
    let bad_timer = ConnectOptions {
        params: ConnectionParams {
            min_rnr_timer: Some(32),
            ..ConnectionParams::default()
        },
        ..ConnectOptions::default()
    };
    let refused = client.connect(addr, bad_timer);
    assert!(
        matches!(
            refused,
            Err(ConnError::Cm(CmError::InvalidArgument {
                reason: "min_rnr_timer above 31",
                ..
            }))
        ),
        "{refused:?}"
    );
    assert_eq!(client.stats().connections, 0);
    assert_eq!(fabric.stats().sent, [0; 8], "nothing reached the fabric");
    // The same endpoints still work with valid values.
    server.listen(addr, ListenOptions::default()).unwrap();
    client.connect(addr, ConnectOptions::default()).unwrap();
    assert_eq!(run(&fabric, &mut server, &mut client).len(), 1);
}

/// `ConnectOptions::id_options` reach the connection's id and `ListenOptions::id_options`
/// the listening id's address options; each accepted id gets the listener's ACK
/// timeout (the kernel does not copy it from the listening id), and nothing else.
#[test]
fn id_options_reach_the_ids_they_are_for() {
    let (fabric, mut server, mut client) = endpoints(93);
    let addr = server.transport().addr(PORT);
    let listen_options = IdOptions {
        ack_timeout: Some(16),
        reuse_addr: true,
        ipv6_only: Some(false),
        type_of_service: Some(0x20),
        ..IdOptions::default()
    };
    let options = ListenOptions {
        id_options: listen_options,
        ..ListenOptions::default()
    };
    server.listen(addr, options).unwrap();
    let connect_options = IdOptions {
        type_of_service: Some(0x68),
        ack_timeout: Some(18),
        reuse_addr: true,
        ipv6_only: None,
        ..IdOptions::default()
    };
    let options = ConnectOptions {
        id_options: connect_options,
        ..ConnectOptions::default()
    };
    let out = client.connect(addr, options).unwrap();
    let accepted = run(&fabric, &mut server, &mut client);
    assert_eq!(accepted.len(), 1);
    assert_eq!(
        client.cm_id(out).unwrap().id_options(),
        Some(connect_options)
    );
    assert_eq!(
        server.cm_id(accepted[0]).unwrap().id_options(),
        Some(IdOptions {
            ack_timeout: Some(16),
            ..IdOptions::default()
        }),
        "the accepted id: the listener's ACK timeout only"
    );
}

/// An ACK timeout above 31 is refused by `connect` and `listen` with a typed error
/// before any id is made; the simulated CM refuses an address option on a bound id
/// (EINVAL), as the kernel does, which is why the endpoint sets them first.
#[test]
fn out_of_range_or_late_id_options_are_refused() {
    let SimTransports {
        fabric,
        mut server,
        client,
    } = SimTransports::new(Default::default(), 94);
    let addr = server.addr(PORT);
    let id = server.create_id().unwrap();
    server
        .set_option(&id, IdOption::TypeOfService(0x68))
        .unwrap();
    server.bind(&id, addr).unwrap();
    for late in [IdOption::ReuseAddr(true), IdOption::Ipv6Only(true)] {
        let refused = server.set_option(&id, late);
        assert_eq!(refused.map_err(|e| e.errno()), Err(22), "{late:?}");
    }
    // The ACK timeout and the type of service are taken at any time.
    server.set_option(&id, IdOption::AckTimeout(31)).unwrap();
    server.release_id(id);

    let (mut server, mut client) = (Endpoint::new(server), Endpoint::new(client));
    let too_long = IdOptions {
        ack_timeout: Some(32),
        ..IdOptions::default()
    };
    let refused = server.listen(
        addr,
        ListenOptions {
            id_options: too_long,
            ..ListenOptions::default()
        },
    );
    assert!(
        matches!(refused, Err(ConnError::Cm(CmError::InvalidArgument { .. }))),
        "{refused:?}"
    );
    let refused = client.connect(
        addr,
        ConnectOptions {
            id_options: too_long,
            ..ConnectOptions::default()
        },
    );
    assert!(
        matches!(refused, Err(ConnError::Cm(CmError::InvalidArgument { .. }))),
        "{refused:?}"
    );
    assert_eq!(
        (server.listener_count(), client.stats().connections),
        (0, 0)
    );
    assert_eq!(fabric.stats().sent, [0; 8], "nothing reached the fabric");
}

/// ADDR_CHANGE (a bond failing over, on the simulated fabric
/// `SimNode::change_address`): each connection on the device hears of it once however
/// many came before it looked (`ConnectionInfo::address_changes` counts them all), a
/// listener bound to the device as an endpoint-wide event; the connection stays up and
/// carries messages as before.
#[test]
fn an_address_change_is_reported_once_and_the_connection_carries_on() {
    let (fabric, mut server, mut client) = endpoints(95);
    let addr = server.transport().addr(PORT);
    let listener = server.listen(addr, ListenOptions::default()).unwrap();
    let out = client.connect(addr, ConnectOptions::default()).unwrap();
    let accepted = run(&fabric, &mut server, &mut client);
    assert_eq!(accepted.len(), 1);
    let conn = accepted[0];
    // Two changes before the server looks: the listener and the connection hear each.
    assert_eq!(server.transport().node().change_address(), 2);
    assert_eq!(server.transport().node().change_address(), 2);
    let mut events = Vec::new();
    while fabric.step() {}
    while let Some(event) = server.poll().unwrap() {
        events.push(event);
    }
    let about_conn: Vec<_> = events.iter().filter(|e| e.conn() == Some(conn)).collect();
    assert_eq!(about_conn, [&Event::AddressChanged { conn }], "{events:?}");
    let about_listener = events
        .iter()
        .filter(|e| **e == Event::ListenerAddressChanged { listener })
        .count();
    assert_eq!(about_listener, 2, "{events:?}");
    assert_eq!(server.info(conn).unwrap().address_changes, 2);
    assert_eq!(
        client.info(out).unwrap().address_changes,
        0,
        "the other node's"
    );
    // Still up: a message each way.
    client.send(out, b"after").unwrap();
    let mut echoed = false;
    for _ in 0..1000 {
        fabric.step();
        while let Some(event) = server.poll().unwrap() {
            if let Event::Received { conn: from, data } = event {
                assert_eq!(from, conn);
                server.send(conn, &data).unwrap();
            }
        }
        while let Some(event) = client.poll().unwrap() {
            assert!(!matches!(event, Event::Closed { .. }), "{event:?}");
            echoed |= matches!(event, Event::Received { conn: from, .. } if from == out);
        }
        if echoed {
            break;
        }
    }
    assert!(echoed, "the echo came back after the address change");
}
