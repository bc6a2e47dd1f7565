//! Port spaces on the real kernel (soft-RoCE in the VM): a listener made in
//! `RDMA_PS_IB` (`IdOptions::port_space`) is the kernel's (`rdma resource show cm_id`
//! says `ps IPoIB`, its name for both IB spaces, not `ps TCP`), a client in `RDMA_PS_TCP` meets no listener on its port (REJ, invalid
//! service ID: `RejectReason::NoListener`), a client in `RDMA_PS_IB` is accepted and
//! exchanges a message. Without a device the test records a skip.
#![cfg(feature = "rdma")]

mod common;

use std::net::SocketAddr;

use cm_testkit::{addresses, report};
use cm_verbs::core::{IdOptions, PortSpace, RejectReason};
use cm_verbs::{CloseReason, ConnError, ConnectOptions, ListenOptions};
use common::WAIT;

fn in_space(space: PortSpace) -> IdOptions {
    IdOptions {
        port_space: space,
        ..IdOptions::default()
    }
}

#[test]
fn a_listener_in_the_ib_port_space_takes_only_its_own_clients() {
    const TEST: &str = "a_listener_in_the_ib_port_space_takes_only_its_own_clients";
    let Some(addrs) = addresses(TEST) else {
        return;
    };
    let listen = SocketAddr::new(addrs.addr_a, 7535);
    let mut server = common::endpoint();
    let options = ListenOptions {
        id_options: in_space(PortSpace::Ib),
        ..ListenOptions::default()
    };
    server.listen(listen, options).expect("listen in PS_IB");
    let ids = common::rdma(&["resource", "show", "cm_id"]);
    let ids = String::from_utf8_lossy(&ids.stdout).into_owned();
    // iproute2's `rdma` names RDMA_PS_IB and RDMA_PS_IPOIB alike ("IPoIB"); not TCP.
    assert!(
        ids.lines()
            .any(|l| l.contains("LISTEN") && l.contains(":7535") && l.contains("ps IPoIB")),
        "the kernel's listener is not in PS_TCP: {ids}"
    );

    let src = addrs.addr_b;
    let client = std::thread::spawn(move || {
        let mut client = common::endpoint();
        let connect = |space| ConnectOptions {
            id_options: in_space(space),
            ..common::from(src)
        };
        let stray = client
            .connect(listen, connect(PortSpace::Tcp))
            .expect("connect in PS_TCP");
        let refused = client.established(stray, WAIT);
        assert!(
            matches!(
                refused,
                Err(ConnError::Closed {
                    reason: CloseReason::Rejected {
                        reason: RejectReason::NoListener,
                        ..
                    },
                    ..
                })
            ),
            "a PS_TCP client meets no listener: {refused:?}"
        );
        let conn = client
            .connect(listen, connect(PortSpace::Ib))
            .expect("connect in PS_IB");
        client
            .established(conn, WAIT)
            .expect("established in PS_IB");
        client.send(conn, b"ps ib").expect("send");
        let echo = client.recv(conn, WAIT).expect("the answer");
        client.disconnect(conn).expect("disconnect");
        echo
    });
    let conn = server.accept(WAIT).expect("the PS_IB client");
    let message = server.recv(conn, WAIT).expect("its message");
    server.send(conn, &message).expect("the answer");
    assert_eq!(client.join().expect("the client thread"), b"ps ib");
    report(&format!(
        "{TEST}: the PS_IB listener refused a PS_TCP client (no listener) and served a \
         PS_IB one ({} bytes each way)",
        message.len()
    ));
}
