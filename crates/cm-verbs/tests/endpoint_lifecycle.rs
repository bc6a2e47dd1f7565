//! Lifecycle on the real kernel (soft-RoCE in the VM): a device nothing of the endpoint
//! uses any more is not held by it, a closed listener stops listening, and a lowered
//! descriptor budget loses no accepted connection.
//!
//! Each removal scenario runs `timeout 10 rdma link delete` while the endpoints live
//! (and are driven), checks that it returned in time with success, counts the kernel's
//! CM ids against their number before (0 leaked), prints its fault row and adds the
//! device back. The endpoints are driven by blocking calls, by an `AsyncEndpoint` and by
//! a tokio-driven `EndpointHandle` (which hear the kernel's removal announcement on the
//! reactor, not in `poll(2)`). Without a device every test records a skip.
#![cfg(all(feature = "tokio", feature = "rdma"))]

mod common;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::process::Command;
use std::sync::mpsc;
use std::time::Duration;

use cm_testkit::{addresses, kernel_cm_ids, leaked_cm_ids, report, skip, FaultRow};
use cm_verbs::async_endpoint::AsyncEndpoint;
use cm_verbs::handle::EndpointHandle;
use cm_verbs::rdma::RdmaTransport;
use cm_verbs::{ConnError, Endpoint, ListenOptions};

const WAIT: Option<Duration> = Some(Duration::from_secs(30));

/// The device and netdev named by the VM's environment variables, or a recorded skip.
fn device(test: &str, dev: &str, netdev: &str) -> Option<(String, String)> {
    match (std::env::var(dev), std::env::var(netdev)) {
        (Ok(device), Ok(netdev)) => Some((device, netdev)),
        _ => {
            skip(test, &format!("{dev}/{netdev} name no device to remove"));
            None
        }
    }
}

/// How long a removal may keep `rdma link delete` before the test gives up on it: the
/// kernel waits for the device context uninterruptibly, so `timeout` alone can hang.
const REMOVAL_LIMIT: Duration = Duration::from_secs(30);

/// Runs `timeout 10 rdma link delete <device>` while `drive` keeps the endpoints
/// working (each call waits a little on them); whether the removal returned, with
/// success, before its 10 s ran out. One still held after [`REMOVAL_LIMIT`] is
/// released by refreshing librdmacm's device list here (so that the test fails rather
/// than hangs, and the tests after it find the device added back).
fn removal_returns(device: &str, mut drive: impl FnMut()) -> bool {
    let limit = std::time::Instant::now() + REMOVAL_LIMIT;
    let (done, finished) = mpsc::channel();
    let device = device.to_string();
    std::thread::spawn(move || {
        let status = Command::new("timeout")
            .args(["10", "rdma", "link", "delete", &device])
            .status()
            .expect("run timeout rdma link delete");
        let _ = done.send(status);
    });
    loop {
        match finished.try_recv() {
            Ok(status) => {
                report(&format!(
                    "lifecycle: `timeout 10 rdma link delete`: {status}"
                ));
                return status.success();
            }
            Err(mpsc::TryRecvError::Empty) if std::time::Instant::now() >= limit => {
                report("lifecycle: the removal still waits for us: released by the test");
                let _ = cm_verbs::sys::refresh_devices();
                let _ = finished.recv();
                return false;
            }
            Err(mpsc::TryRecvError::Empty) => drive(),
            Err(mpsc::TryRecvError::Disconnected) => return false,
        }
    }
}

const BRIEFLY: Option<Duration> = Some(Duration::from_millis(100));

/// Drives an endpoint once: whatever it reports is logged.
fn drive_once(name: &str, endpoint: &mut Endpoint<RdmaTransport>) {
    match endpoint.next_event(BRIEFLY) {
        Ok(event) => report(&format!("lifecycle: {name} saw {event:?}")),
        Err(cm_verbs::ConnError::Timeout) => {}
        Err(error) => report(&format!("lifecycle: {name}: {error}")),
    }
}

/// Prints the fault row of a scenario that rescued nothing (`connections` attempted,
/// `established`, `failed`), with the kernel CM ids left above `baseline`, and asserts
/// that none were.
#[track_caller]
fn report_fault(fault: &str, connections: u64, established: u64, failed: u64, baseline: u64) {
    let row = FaultRow {
        fault: fault.into(),
        connections,
        established,
        rescued: 0,
        failed,
        leaked_ids: leaked_cm_ids(baseline),
    };
    row.report();
    assert_eq!(row.leaked_ids, 0);
}

#[test]
fn an_idle_client_whose_last_connection_closed_lets_its_device_go() {
    const TEST: &str = "an_idle_client_whose_last_connection_closed_lets_its_device_go";
    let Some(addrs) = addresses(TEST) else {
        return;
    };
    let Some((device, netdev)) = device(TEST, "CMNOTIFY_DEV_B", "CMNOTIFY_NETDEV_B") else {
        return;
    };
    let baseline = kernel_cm_ids().expect("the rdma tool lists CM ids");
    let listen = SocketAddr::new(addrs.addr_a, 7531);
    // The server, in its own thread, accepts one connection, sees it closed, and lives
    // on (its listener open) until told to stop.
    let (listening, server_listening) = mpsc::channel();
    let (stop, server_stop) = mpsc::channel::<()>();
    let server = std::thread::spawn(move || {
        let mut server = common::endpoint();
        let listener = server
            .listen(listen, ListenOptions::default())
            .expect("listen");
        listening.send(()).expect("listening");
        let accepted = server.accept(WAIT).expect("accept");
        assert!(matches!(
            server.recv(accepted, WAIT),
            Err(ConnError::Closed { .. })
        ));
        server_stop.recv().expect("stop");
        server.close_listener(listener).expect("close listener");
    });
    server_listening.recv().expect("the server listens");
    let mut client = common::endpoint();
    let conn = common::connected(&mut client, addrs.addr_b, listen);
    client.disconnect(conn).expect("disconnect");
    // The client is idle, with nothing on its device.
    assert_eq!(
        client.device_count(),
        0,
        "the idle client holds no device reader"
    );

    let _add_back = common::AddBack {
        device: device.clone(),
        netdev,
    };
    let returned = removal_returns(&device, || drive_once("client", &mut client));
    assert!(returned, "rdma link delete {device} returned within 10 s");
    stop.send(()).expect("stop");
    server.join().expect("server thread");
    drop(client);
    report_fault(
        "device removed under an idle client (last connection closed)",
        1,
        1,
        0,
        baseline,
    );
}

#[test]
fn a_wildcard_listener_whose_first_connection_closed_lets_the_device_go() {
    const TEST: &str = "a_wildcard_listener_whose_first_connection_closed_lets_the_device_go";
    let Some(addrs) = addresses(TEST) else {
        return;
    };
    let Some((device, netdev)) = device(TEST, cm_testkit::env::DEV_A, cm_testkit::env::NETDEV_A)
    else {
        return;
    };
    let baseline = kernel_cm_ids().expect("the rdma tool lists CM ids");
    let wildcard = SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 7532);
    let mut server = common::endpoint();
    let listener = server
        .listen(wildcard, ListenOptions::default())
        .expect("listen");
    assert_eq!(
        server.device_count(),
        0,
        "a wildcard listener has no device"
    );
    let src = addrs.addr_b;
    let dst = SocketAddr::new(addrs.addr_a, 7532);
    let client = std::thread::spawn(move || {
        let mut client = common::endpoint();
        let conn = common::connected(&mut client, src, dst);
        client.disconnect(conn).expect("disconnect");
    });
    let conn = server.accept(WAIT).expect("accept");
    assert!(matches!(
        server.recv(conn, WAIT),
        Err(ConnError::Closed { .. })
    ));
    client.join().expect("client thread");
    assert_eq!(
        server.device_count(),
        0,
        "the device's reader closed with its connection"
    );

    let _add_back = common::AddBack {
        device: device.clone(),
        netdev,
    };
    let returned = removal_returns(&device, || drive_once("server", &mut server));
    assert!(returned, "rdma link delete {device} returned within 10 s");
    // The wildcard listener lives on.
    assert_eq!(server.listener_count(), 1);
    server.close_listener(listener).expect("close listener");
    drop(server);
    report_fault(
        "device removed under a wildcard listener (first connection closed)",
        1,
        1,
        0,
        baseline,
    );
}

#[test]
fn a_closed_device_bound_listener_lets_its_device_go() {
    const TEST: &str = "a_closed_device_bound_listener_lets_its_device_go";
    let Some(addrs) = addresses(TEST) else {
        return;
    };
    let Some((device, netdev)) = device(TEST, cm_testkit::env::DEV_A, cm_testkit::env::NETDEV_A)
    else {
        return;
    };
    let baseline = kernel_cm_ids().expect("the rdma tool lists CM ids");
    let mut server = common::endpoint();
    listen_and_close(&mut server, SocketAddr::new(addrs.addr_a, 7533));

    let _add_back = common::AddBack {
        device: device.clone(),
        netdev,
    };
    let returned = removal_returns(&device, || drive_once("server", &mut server));
    assert!(returned, "rdma link delete {device} returned within 10 s");
    drop(server);
    report_fault("device removed after close_listener", 0, 0, 0, baseline);
}

/// A current-thread runtime with I/O and time, for the tokio servers.
fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime")
}

/// A device-bound listener on `addr` opened and closed again, so that its device's
/// reader is closed while librdmacm still holds the device context, which only a
/// refresh after the kernel's removal announcement lets go.
fn listen_and_close<T: cm_verbs::core::Transport<Addr = SocketAddr>>(
    server: &mut Endpoint<T>,
    addr: SocketAddr,
) {
    let listener = server
        .listen(addr, ListenOptions::default())
        .expect("listen");
    assert_eq!(server.device_count(), 1);
    server.close_listener(listener).expect("close listener");
    assert_eq!(
        server.device_count(),
        0,
        "the reader closed with its only listener"
    );
}

#[test]
fn an_async_endpoint_lets_a_device_it_no_longer_uses_go() {
    const TEST: &str = "an_async_endpoint_lets_a_device_it_no_longer_uses_go";
    let Some(addrs) = addresses(TEST) else {
        return;
    };
    let Some((device, netdev)) = device(TEST, cm_testkit::env::DEV_A, cm_testkit::env::NETDEV_A)
    else {
        return;
    };
    let baseline = kernel_cm_ids().expect("the rdma tool lists CM ids");
    let runtime = runtime();
    let _in_runtime = runtime.enter();
    let mut server =
        AsyncEndpoint::new(RdmaTransport::new().expect("transport")).expect("register");
    listen_and_close(server.endpoint(), SocketAddr::new(addrs.addr_a, 7537));
    // A wildcard listener keeps the server serving, on no device.
    let wildcard = SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 7537);
    let listener = server
        .endpoint()
        .listen(wildcard, ListenOptions::default())
        .expect("listen");

    let _add_back = common::AddBack {
        device: device.clone(),
        netdev,
    };
    // Only the tokio wait drives the endpoint: the monitor is heard on the reactor.
    let returned = removal_returns(&device, || {
        runtime.block_on(async {
            match tokio::time::timeout(BRIEFLY.expect("a wait"), server.next_event()).await {
                Ok(Ok(event)) => report(&format!("lifecycle: async server saw {event:?}")),
                Ok(Err(error)) => report(&format!("lifecycle: async server: {error}")),
                Err(_elapsed) => {}
            }
        });
    });
    assert!(returned, "rdma link delete {device} returned within 10 s");
    assert_eq!(server.endpoint().device_count(), 0, "no reader held");
    assert_eq!(
        server.endpoint().listener_count(),
        1,
        "the wildcard lives on"
    );
    server
        .endpoint()
        .close_listener(listener)
        .expect("close listener");
    drop(server);
    report_fault(
        "device removed under a tokio AsyncEndpoint (its listener closed)",
        0,
        0,
        0,
        baseline,
    );
}

#[test]
fn a_tokio_driven_handle_lets_a_device_it_no_longer_uses_go() {
    const TEST: &str = "a_tokio_driven_handle_lets_a_device_it_no_longer_uses_go";
    let Some(addrs) = addresses(TEST) else {
        return;
    };
    let Some((device, netdev)) = device(TEST, cm_testkit::env::DEV_A, cm_testkit::env::NETDEV_A)
    else {
        return;
    };
    let baseline = kernel_cm_ids().expect("the rdma tool lists CM ids");
    let runtime = runtime();
    let _in_runtime = runtime.enter();
    let server = EndpointHandle::spawn_tokio(common::endpoint()).expect("server");
    server.with_endpoint(|ep| listen_and_close(ep, SocketAddr::new(addrs.addr_a, 7538)));
    // A wildcard listener keeps the server serving, on no device.
    let wildcard = SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 7538);
    let listener = server
        .listen(wildcard, ListenOptions::default())
        .expect("listen");

    let _add_back = common::AddBack {
        device: device.clone(),
        netdev,
    };
    // Only the driver task drives the endpoint, while the runtime runs.
    let returned = removal_returns(&device, || {
        runtime.block_on(tokio::time::sleep(BRIEFLY.expect("a wait")));
    });
    assert!(returned, "rdma link delete {device} returned within 10 s");
    assert_eq!(
        server.with_endpoint(|ep| ep.device_count()),
        0,
        "no reader held"
    );
    drop(listener);
    drop(server);
    report_fault(
        "device removed under a tokio-driven EndpointHandle (its listener closed)",
        0,
        0,
        0,
        baseline,
    );
}

#[test]
fn close_listener_then_listen_on_the_same_address() {
    const TEST: &str = "close_listener_then_listen_on_the_same_address";
    let Some(addrs) = addresses(TEST) else {
        return;
    };
    let baseline = kernel_cm_ids().expect("the rdma tool lists CM ids");
    let addr = SocketAddr::new(addrs.addr_a, 7534);
    let mut server = common::endpoint();
    let first = server
        .listen(addr, ListenOptions::default())
        .expect("listen");
    server.close_listener(first).expect("close listener");
    let (refused_tx, refused_rx) = mpsc::channel();
    let (again, listening_again) = mpsc::channel::<()>();
    let (checked, server_checked) = mpsc::channel::<()>();
    let src = addrs.addr_b;
    let client = std::thread::spawn(move || {
        let mut client = common::endpoint();
        // Nobody listens: the kernel refuses the request.
        let refused = client.connect(addr, common::from(src)).expect("connect");
        let refused = client.established(refused, WAIT);
        refused_tx.send(format!("{refused:?}")).expect("refused");
        assert!(
            matches!(refused, Err(ConnError::Closed { .. })),
            "{refused:?}"
        );
        listening_again.recv().expect("listening again");
        let conn = common::connected(&mut client, src, addr);
        server_checked.recv().expect("checked");
        client.disconnect(conn).expect("disconnect");
    });
    let refused = refused_rx.recv().expect("the refused request's end");
    report(&format!(
        "lifecycle: a request to the closed listener: {refused}"
    ));
    // The same address at once: no EADDRINUSE, and it serves.
    let second = server
        .listen(addr, ListenOptions::default())
        .expect("listening again on the same address");
    again.send(()).expect("again");
    let accepted = server.accept(WAIT).expect("accept");
    assert_eq!(server.info(accepted).expect("info").listener, Some(second));
    checked.send(()).expect("checked");
    let _ = server.recv(accepted, WAIT);
    client.join().expect("client thread");
    server.close_listener(second).expect("close listener");
    drop(server);
    report_fault(
        "close_listener, then listen on the same address",
        2,
        1,
        1,
        baseline,
    );
}

#[test]
fn an_async_accept_returns_its_connection_with_the_descriptor_limit_reached() {
    const TEST: &str = "an_async_accept_returns_its_connection_with_the_descriptor_limit_reached";
    let Some(addrs) = addresses(TEST) else {
        return;
    };
    let baseline = kernel_cm_ids().expect("the rdma tool lists CM ids");
    let runtime = runtime();
    let (ready, client_ready) = mpsc::channel();
    let (go, client_go) = mpsc::channel::<()>();
    let src = addrs.addr_b;
    let dst = SocketAddr::new(addrs.addr_a, 7535);
    // The client's endpoint opens its device's reader (a listener on its address)
    // before the descriptors run out, so that its connect needs none.
    let client = std::thread::spawn(move || {
        let mut client = common::endpoint();
        let warm = client
            .listen(SocketAddr::new(src, 7536), ListenOptions::default())
            .expect("client-side listener");
        ready.send(()).expect("ready");
        client_go.recv().expect("go");
        let conn = common::connected(&mut client, src, dst);
        client
            .send(conn, b"with no descriptor to spare")
            .expect("send");
        let _ = client.recv(conn, WAIT);
        client.close_listener(warm).expect("close listener");
    });
    runtime.block_on(async {
        let mut server =
            AsyncEndpoint::new(RdmaTransport::new().expect("transport")).expect("register");
        // A wildcard listener: the device's reader opens with the first request, and
        // the endpoint's descriptors change at that accept.
        server
            .endpoint()
            .listen(
                SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 7535),
                ListenOptions::default(),
            )
            .expect("listen");
        client_ready.recv().expect("client ready");
        // The process reaches its RLIMIT_NOFILE: two descriptors are left, enough for
        // the reader's completion channel (and librdmacm's device scan), not for the
        // duplicates the async endpoint watches.
        let mut hoard = Vec::new();
        while let Ok(file) = std::fs::File::open("/dev/null") {
            hoard.push(file);
        }
        hoard.truncate(hoard.len().saturating_sub(2));
        report(&format!(
            "lifecycle: {} descriptors taken up to the limit",
            hoard.len()
        ));
        go.send(()).expect("go");
        let conn = tokio::time::timeout(Duration::from_secs(30), server.accept())
            .await
            .expect("accepted in time")
            .expect("the accept returns its connection");
        let message = tokio::time::timeout(Duration::from_secs(30), server.recv(conn))
            .await
            .expect("received in time")
            .expect("message");
        assert_eq!(message, b"with no descriptor to spare");
        drop(hoard);
        server.endpoint().send(conn, b"ok").expect("send");
        client.join().expect("client thread");
        let _ = tokio::time::timeout(Duration::from_secs(30), server.recv(conn)).await;
    });
    report_fault(
        "RLIMIT_NOFILE reached before the first (async) accept",
        1,
        1,
        0,
        baseline,
    );
}
