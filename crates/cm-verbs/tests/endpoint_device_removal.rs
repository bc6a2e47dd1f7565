//! Device removal on the real kernel (soft-RoCE in the VM): `rdma link delete` of the
//! device a server listens on, with one connection established on it. The endpoint
//! reports the listener and the connection closed with `DeviceRemoved` and drops all it
//! holds on the device, so the kernel's removal (which waits for every id on the device
//! to be destroyed) completes; the device is added back afterwards. Without a device the
//! test records a skip.
#![cfg(feature = "rdma")]

mod common;

use std::net::SocketAddr;
use std::sync::mpsc;
use std::time::Duration;

use cm_testkit::{addresses, kernel_cm_ids, leaked_cm_ids, report, FaultRow};
use cm_verbs::ListenOptions;

const WAIT: Option<Duration> = Some(Duration::from_secs(30));

#[test]
fn removing_the_device_closes_listener_and_connection_and_the_removal_completes() {
    const TEST: &str =
        "removing_the_device_closes_listener_and_connection_and_the_removal_completes";
    let Some(addrs) = addresses(TEST) else {
        return;
    };
    let Some((device, netdev)) = common::device_to_remove(TEST) else {
        return;
    };
    let baseline = kernel_cm_ids().expect("the rdma tool lists CM ids");
    let mut server = common::endpoint();
    let listen = SocketAddr::new(addrs.addr_a, 7517);
    let listener = server
        .listen(listen, ListenOptions::default())
        .expect("listen");
    let src = addrs.addr_b;
    let (client_done, client_end) = mpsc::channel();
    let client = std::thread::spawn(move || {
        let mut client = common::endpoint();
        let conn = common::connected(&mut client, src, listen);
        // Wait (bounded) for the peer's removal to reach this side in any form.
        let end = client.recv(conn, Some(Duration::from_secs(60)));
        let _ = client_done.send(format!("{end:?}"));
    });
    let conn = server.accept(WAIT).expect("accept");

    let _add_back = common::AddBack {
        device: device.clone(),
        netdev: netdev.clone(),
    };
    let removal = common::remove_device(&device);
    common::closed_by_removal(&mut server, listener, conn);
    assert_eq!(server.device_count(), 0, "the device's reader is closed");
    assert_eq!(server.connection_count(), 0);
    assert_eq!(server.listener_count(), 0);
    // The kernel's removal waits for our ids: it completes now that they are gone.
    common::removal_completes(removal);
    report(&format!(
        "removal: listener and connection closed, `rdma link delete {device}` returned; client saw {:?}",
        client_end.recv_timeout(Duration::from_secs(90)).ok()
    ));
    client.join().expect("client thread");
    drop(server);
    FaultRow {
        fault: "device removed under a listener and a connection".into(),
        connections: 1,
        established: 1,
        rescued: 0,
        failed: 1,
        leaked_ids: leaked_cm_ids(baseline),
    }
    .report();
}
