//! Port spaces on the simulated fabric (`IdOptions::port_space`): a listener in
//! `RDMA_PS_IB` takes its own space's clients, a client of the other space meets no
//! listener (REJ, invalid service ID: `RejectReason::NoListener`), and the two spaces
//! listen on the same port side by side. (The same on the real kernel:
//! tests/endpoint_port_space_rdma.rs.)

#[path = "common/sim.rs"]
mod sim;

use cm_mock::sim::{SimConfig, SimTransports};
use cm_verbs::core::{IdOptions, PortSpace, RejectReason};
use cm_verbs::{CloseReason, ConnectOptions, Endpoint, EndpointOptions, Event, ListenOptions};

fn in_space(space: PortSpace) -> IdOptions {
    IdOptions {
        port_space: space,
        ..IdOptions::default()
    }
}

#[test]
fn each_port_space_reaches_only_its_own_listener() {
    let SimTransports {
        fabric,
        server,
        client,
    } = SimTransports::new(SimConfig::default(), 61);
    let mut server = Endpoint::with_options(server, EndpointOptions::default());
    let mut client = Endpoint::with_options(client, EndpointOptions::default());
    let addr = server.transport().addr(7498);
    let listen = |space| ListenOptions {
        id_options: in_space(space),
        ..ListenOptions::default()
    };
    let ib = server.listen(addr, listen(PortSpace::Ib)).unwrap();
    let connect = |space| ConnectOptions {
        id_options: in_space(space),
        ..ConnectOptions::default()
    };

    // TCP's space has no listener on the port yet: refused as no listener.
    let stray = client.connect(addr, connect(PortSpace::Tcp)).unwrap();
    let closed = loop {
        if let Some(event) = client.poll().unwrap() {
            if event.conn() == Some(stray) {
                break event;
            }
        }
        assert!(fabric.step(), "the fabric ran out of work first");
    };
    assert!(
        matches!(
            closed,
            Event::Closed {
                reason: CloseReason::Rejected {
                    reason: RejectReason::NoListener,
                    ..
                },
                ..
            }
        ),
        "{closed:?}"
    );

    // The IB space's client reaches the IB listener.
    client.connect(addr, connect(PortSpace::Ib)).unwrap();
    let accepted = sim::establish(&fabric, &mut server, &mut client, 1)[0];
    assert_eq!(server.info(accepted).unwrap().listener, Some(ib));

    // Both spaces listen on the same port, each taking its own clients.
    let tcp = server.listen(addr, listen(PortSpace::Tcp)).unwrap();
    client.connect(addr, connect(PortSpace::Tcp)).unwrap();
    let accepted = sim::establish(&fabric, &mut server, &mut client, 1)[0];
    assert_eq!(server.info(accepted).unwrap().listener, Some(tcp));
    // A second listener of one space on the port is refused.
    assert!(server.listen(addr, listen(PortSpace::Ib)).is_err());
}
