//! `Endpoint::received`, the application's word for a receive on a QP of its own, on
//! the simulated fabric: typed errors where it means nothing, and no effect on a
//! connection the endpoint reads itself or one already established. (The application's
//! own QP is exercised on the real kernel: tests/endpoint_application_qp_rdma.rs.)

use cm_mock::sim::{SimConfig, SimTransports};
use cm_verbs::{ConnError, ConnectOptions, Endpoint, Event, ListenOptions};

#[test]
fn received_is_refused_before_a_qp_and_changes_nothing_once_established() {
    let SimTransports {
        fabric,
        server,
        client,
    } = SimTransports::new(SimConfig::default(), 51);
    let mut server = Endpoint::new(server);
    let mut client = Endpoint::new(client);
    let addr = server.transport().addr(7494);
    server.listen(addr, ListenOptions::default()).unwrap();
    let out = client.connect(addr, ConnectOptions::default()).unwrap();
    // Resolving: no QP yet.
    assert!(matches!(
        client.received(out),
        Err(ConnError::WrongState {
            what: "received",
            ..
        })
    ));
    let mut accepted = None;
    for _ in 0..10_000 {
        while let Some(event) = server.poll().unwrap() {
            if let Event::Established { conn, .. } = event {
                accepted = Some(conn);
            }
        }
        while client.poll().unwrap().is_some() {}
        if accepted.is_some() || !fabric.step() {
            break;
        }
    }
    let conn = accepted.expect("established");
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
