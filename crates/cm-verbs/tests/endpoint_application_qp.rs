//! `Endpoint::received`, the application's word for a receive on a QP of its own, on
//! the simulated fabric: typed errors where it means nothing, and no effect on a
//! connection the endpoint reads itself or one already established. (The application's
//! own QP is exercised on the real kernel: tests/endpoint_application_qp_rdma.rs.)

#[path = "common/sim.rs"]
mod sim;

use cm_verbs::{CloseReason, ConnError, ConnState, ConnectOptions, EndpointOptions, Event};
use sim::{establish, listening, SimEndpoints};

#[test]
fn received_is_refused_before_a_qp_and_changes_nothing_once_established() {
    let SimEndpoints {
        fabric,
        mut server,
        mut client,
        addr,
    } = listening(51, 7494, EndpointOptions::default());
    let out = client.connect(addr, ConnectOptions::default()).unwrap();
    // Resolving: no QP yet.
    assert!(matches!(
        client.received(out),
        Err(ConnError::WrongState {
            what: "received",
            ..
        })
    ));
    let conn = establish(&fabric, &mut server, &mut client, 1)[0];
    assert!(!server.has_application_qp(conn).unwrap());
    let before = server.counters();
    server.received(conn).unwrap();
    assert_eq!(server.counters(), before, "nothing for the pump to do");
    assert_eq!(
        server.info(conn).unwrap().established,
        Some(cm_verbs::EstablishedVia::Handshake)
    );
    server.disconnect(conn).unwrap();
    assert!(matches!(
        server.received(conn),
        Err(ConnError::UnknownConnection(_))
    ));
}

/// Polls the client and steps the fabric until `wanted` says yes to one of its events.
fn client_event(
    fabric: &cm_mock::sim::SimFabric,
    client: &mut cm_verbs::Endpoint<cm_mock::sim::SimTransport>,
    wanted: impl Fn(&Event) -> bool,
) -> Event {
    loop {
        while let Some(event) = client.poll().expect("client poll") {
            if wanted(&event) {
                return event;
            }
        }
        assert!(fabric.step(), "the fabric ran out of work first");
    }
}

#[test]
fn an_active_connection_waits_for_the_application_s_qp_then_connects_over_it() {
    let SimEndpoints {
        fabric,
        mut server,
        mut client,
        addr,
    } = listening(52, 7495, EndpointOptions::default());
    let options = ConnectOptions {
        application_qp: true,
        ..ConnectOptions::default()
    };
    let out = client.connect(addr, options).unwrap();
    let too_early = client.connect_application_qp(out);
    assert!(
        matches!(
            too_early,
            Err(ConnError::WrongState {
                what: "connect_application_qp",
                ..
            })
        ),
        "{too_early:?}"
    );
    let resolved = client_event(&fabric, &mut client, |e| e.conn() == Some(out));
    assert_eq!(resolved, Event::RouteResolved { conn: out });
    assert_eq!(client.info(out).unwrap().state, ConnState::AwaitingQp);
    // Nothing is made for it while it waits: the endpoint made no QP.
    assert_eq!(client.info(out).unwrap().qp, None);
    let no_qp = client.connect_application_qp(out);
    assert!(
        matches!(&no_qp, Err(ConnError::WrongState { needs, .. }) if needs.contains("a QP")),
        "{no_qp:?}"
    );
    let qp = client.cm_id(out).unwrap().create_qp().unwrap();
    client.connect_application_qp(out).unwrap();
    assert!(
        client.connect_application_qp(out).is_err(),
        "the REQ went once"
    );
    let accepted = establish(&fabric, &mut server, &mut client, 1)[0];
    let info = client.info(out).unwrap();
    assert_eq!((info.state, info.qp), (ConnState::Established, Some(qp)));
    assert!(client.has_application_qp(out).unwrap());
    assert!(server.info(accepted).unwrap().qp.is_some());
    // Its data path is the application's: the endpoint has no buffers to send from.
    assert!(matches!(
        client.send(out, b"x"),
        Err(ConnError::WrongState { what: "send", .. })
    ));
    assert_eq!(client.stats().connections, 1);
}

#[test]
fn an_application_that_never_makes_its_qp_gets_the_connect_timeout() {
    let SimEndpoints {
        fabric,
        server: _server,
        mut client,
        addr,
    } = listening(53, 7496, EndpointOptions::default());
    let options = ConnectOptions {
        application_qp: true,
        timeout: Some(std::time::Duration::from_secs(1)),
        ..ConnectOptions::default()
    };
    let out = client.connect(addr, options).unwrap();
    let resolved = client_event(&fabric, &mut client, |e| e.conn() == Some(out));
    assert_eq!(resolved, Event::RouteResolved { conn: out });
    // The endpoint's wait moves the fabric's clock to the connection's deadline.
    let closed = client
        .next_event(Some(std::time::Duration::from_secs(5)))
        .expect("the deadline ends the wait");
    assert_eq!(
        closed,
        Event::Closed {
            conn: out,
            reason: CloseReason::TimedOut
        }
    );
    assert_eq!(client.stats().connections, 0, "nothing kept");
}

#[test]
fn handles_refuse_a_connection_over_the_application_s_qp() {
    let SimEndpoints { client, addr, .. } = listening(54, 7497, EndpointOptions::default());
    let handle = cm_verbs::handle::EndpointHandle::spawn_thread(client).unwrap();
    let options = ConnectOptions {
        application_qp: true,
        ..ConnectOptions::default()
    };
    assert!(matches!(
        handle.connect(addr, options),
        Err(ConnError::InvalidOptions(_))
    ));
}
