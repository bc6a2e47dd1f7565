//! `Endpoint::received`, the application's word for a receive on a QP of its own, on
//! the simulated fabric: typed errors where it means nothing, and no effect on a
//! connection the endpoint reads itself or one already established. (The application's
//! own QP is exercised on the real kernel: tests/endpoint_application_qp_rdma.rs.)

#[path = "common/sim.rs"]
mod sim;

use cm_verbs::{ConnError, ConnectOptions, EndpointOptions};
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
