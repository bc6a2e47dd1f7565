//! The kernel facts of docs/notify-semantics.md ("Measured on the real kernel"; figures in
//! docs/spec-notes.md), on a real RDMA device (soft-RoCE in the test VM: `cargo xtask vm`).
//! Without a device every test records a skip and returns.
//!
//! Addresses: `CMNOTIFY_ADDR_A` (listener side) and `CMNOTIFY_ADDR_B` (connecting side),
//! set by the VM's /init (10.77.1.1 and 10.77.1.2 on two soft-RoCE devices over a veth).
//! Every wait is bounded by [`common::WAIT`].

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use cm_core::{AsyncEventType, CmError, CmEventType, NotifyError, NotifyOutcome};
use cm_sys::{ConnParams, EventChannel, QpCaps};
use common::{
    addresses, expect_event, listener_on, resolved_id, resolved_to, wait_completion, CmMadRule,
    MadAction, RESOLVE_TIMEOUT, RTU, WAIT,
};

/// The nftables table of the lost-RTU test.
const RTU_DROP_TABLE: &str = "cmnotify_sys";

#[test]
fn notify_on_a_fresh_id_is_wrong_state() {
    let Some(_setup) = addresses("notify_on_a_fresh_id_is_wrong_state") else {
        return;
    };
    let channel = EventChannel::new().expect("channel");
    let id = channel.create_id().expect("id");
    assert_eq!(id.qp_num(), None);
    assert_eq!(id.local_addr(), None);
    assert_eq!(
        id.notify(AsyncEventType::CommEst),
        Err(NotifyError::WrongState)
    );
    assert!(matches!(
        id.async_events(),
        Err(CmError::InvalidArgument { .. })
    ));
}

#[test]
fn notify_on_a_bound_id_is_wrong_state() {
    let Some(setup) = addresses("notify_on_a_bound_id_is_wrong_state") else {
        return;
    };
    let channel = EventChannel::new().expect("channel");
    let id = channel.create_id().expect("id");
    id.bind_addr(SocketAddr::new(setup.addr_a, 0))
        .expect("bind");
    let local = id.local_addr().expect("bound address");
    assert_eq!(local.ip(), setup.addr_a);
    assert_ne!(local.port(), 0, "the CM picks a port");
    assert_eq!(
        id.notify(AsyncEventType::CommEst),
        Err(NotifyError::WrongState)
    );
}

#[test]
fn notify_on_a_listener_is_wrong_state() {
    let Some(setup) = addresses("notify_on_a_listener_is_wrong_state") else {
        return;
    };
    let channel = EventChannel::new().expect("channel");
    let id = channel.create_id().expect("id");
    id.bind_addr(SocketAddr::new(setup.addr_a, 0))
        .expect("bind");
    id.listen(4).expect("listen");
    assert_eq!(
        id.notify(AsyncEventType::CommEst),
        Err(NotifyError::WrongState)
    );
    // Nothing is pending on the channel: the non-blocking read answers None.
    channel.set_nonblocking(true).expect("O_NONBLOCK");
    assert!(channel.is_nonblocking().expect("flags"));
    assert!(channel.try_next_event().expect("read").is_none());
}

#[test]
fn resolve_events_arrive_on_the_channel_an_id_migrated_to() {
    let Some(setup) = addresses("resolve_events_arrive_on_the_channel_an_id_migrated_to") else {
        return;
    };
    let first = EventChannel::new().expect("channel");
    let second = EventChannel::new().expect("channel");
    let listen_channel = EventChannel::new().expect("channel");
    let listener = listener_on(&listen_channel, setup.addr_a, 4);
    let target = listener.local_addr().expect("listener address");

    let (mut id, resolved) =
        common::addr_resolved_id(&first, setup.addr_b, target).expect("address resolution");
    assert_eq!(resolved.id(), Some(&id));
    assert_eq!(id.unacked_events(), 1);
    // librdmacm would wait for the unacknowledged event: refused instead.
    match id.migrate(&second) {
        Err(CmError::UnackedEvents { unacked: 1, .. }) => {}
        other => panic!("migrate with an unacked event: {other:?}"),
    }
    resolved.ack().expect("ack");
    assert_eq!(id.unacked_events(), 0);
    // Another handle could notify while librdmacm changes `id->channel`: refused too.
    let other_handle = id.clone();
    match id.migrate(&second) {
        Err(CmError::Busy { .. }) => {}
        other => panic!("migrate with another handle alive: {other:?}"),
    }
    drop(other_handle);
    id.migrate(&second).expect("migrate");

    id.resolve_route(RESOLVE_TIMEOUT).expect("resolve_route");
    let routed = expect_event(&second, CmEventType::RouteResolved);
    assert_eq!(routed.id(), Some(&id));
    assert!(first.try_next_event().expect("read").is_none());
    assert_eq!(id.peer_addr(), Some(target));
    // Address resolution bound the id to a device, but it is not connecting.
    assert_eq!(
        id.notify(AsyncEventType::CommEst),
        Err(NotifyError::WrongState)
    );
}

#[test]
fn loopback_connection_establishes_then_notify_is_already_established() {
    let Some(setup) =
        addresses("loopback_connection_establishes_then_notify_is_already_established")
    else {
        return;
    };
    let server_channel = EventChannel::new().expect("server channel");
    let client_channel = EventChannel::new().expect("client channel");

    let listener = listener_on(&server_channel, setup.addr_a, 4);
    let server_addr = listener.local_addr().expect("listener address");

    // Active side: resolve, QP, connect.
    let client = resolved_id(&client_channel, setup.addr_b, server_addr).expect("resolve");
    let client_qp = client.create_qp(&QpCaps::default()).expect("client QP");
    assert_eq!(client.qp_num(), Some(client_qp));
    let client_mem = client.register_memory(64).expect("client memory");
    client
        .post_recv(&client_mem, 32..64, 2)
        .expect("client post_recv");
    client
        .connect(&ConnParams {
            private_data: b"hello",
            ..ConnParams::default()
        })
        .expect("connect");

    // Passive side: the request carries a new id and the listener.
    let request = expect_event(&server_channel, CmEventType::ConnectRequest);
    assert_eq!(request.listener(), Some(&listener));
    // The CM hands over the REQ's whole private data field (56 bytes), zero-padded.
    let private_data = request.private_data();
    assert!(private_data.starts_with(b"hello"), "{private_data:?}");
    assert!(
        private_data[5..].iter().all(|&b| b == 0),
        "{private_data:?}"
    );
    let server = request.id().expect("new id").clone();
    assert_ne!(server, listener);
    // librdmacm accounts the request to the listener: migrating it now would wait.
    assert_eq!(listener.unacked_events(), 1);
    assert_eq!(server.unacked_events(), 0);
    let other_channel = EventChannel::new().expect("channel");
    assert!(matches!(
        listener.clone().migrate(&other_channel),
        Err(CmError::UnackedEvents { unacked: 1, .. })
    ));
    request.ack().expect("ack");
    assert_eq!(listener.unacked_events(), 0);
    let server_qp = server.create_qp(&QpCaps::default()).expect("server QP");
    let server_mem = server.register_memory(64).expect("server memory");
    server
        .post_recv(&server_mem, 0..32, 1)
        .expect("server post_recv");
    server.accept(&ConnParams::default()).expect("accept");

    // ESTABLISHED on both sides (the client's comes first: reading its REP sends the RTU).
    let established = expect_event(&client_channel, CmEventType::Established);
    assert_eq!(established.qp_num(), Some(client_qp));
    established.ack().expect("ack");
    let established = expect_event(&server_channel, CmEventType::Established);
    assert_eq!(established.qp_num(), Some(server_qp));
    assert_eq!(established.id(), Some(&server));
    established.ack().expect("ack");

    // Measured (docs/spec-notes.md): after ESTABLISHED, notify is EISCONN on either side.
    assert_eq!(
        server.notify(AsyncEventType::CommEst),
        Ok(NotifyOutcome::AlreadyEstablished)
    );
    assert_eq!(
        client.notify(AsyncEventType::CommEst),
        Ok(NotifyOutcome::AlreadyEstablished)
    );
    // From another thread, through a clone, as the notify pump does.
    let pump_handle = server.clone();
    let from_thread = std::thread::spawn(move || pump_handle.notify(AsyncEventType::CommEst))
        .join()
        .expect("notify thread");
    assert_eq!(from_thread, Ok(NotifyOutcome::AlreadyEstablished));
    // Through the trait object the pump uses.
    let handle: &dyn cm_core::CmId = &server;
    assert_eq!(
        handle.notify(AsyncEventType::CommEst),
        Ok(NotifyOutcome::AlreadyEstablished)
    );
    assert_eq!(handle.qp_num(), Some(server_qp));

    // Asynchronous events read without blocking: nothing pending (soft-RoCE raises no
    // COMM_EST), so EAGAIN answers None.
    let device_events = server.async_events().expect("async events");
    device_events.set_nonblocking(true).expect("O_NONBLOCK");
    assert!(device_events.is_nonblocking().expect("flags"));
    let mut drained = 0;
    while let Some(event) = device_events.try_next_event().expect("ibv_get_async_event") {
        assert_ne!(event.event_type, AsyncEventType::CommEst, "{event}");
        drained += 1;
        assert!(drained < 100, "async events never run dry");
    }
    assert!(device_events
        .next_event_timeout(Duration::from_millis(20))
        .expect("poll")
        .is_none());

    // Data both ways.
    client.write_memory(&client_mem, 0, b"ping").expect("write");
    client.post_send(&client_mem, 0..4, 10).expect("post_send");
    let sent = wait_completion("client send", || client.poll_send_cq(4));
    assert!(sent.is_success(), "{}", sent.status_str());
    assert_eq!(
        (sent.wr_id, sent.qp_num, sent.is_recv()),
        (10, client_qp, false)
    );
    let received = wait_completion("server receive", || server.poll_recv_cq(4));
    assert!(received.is_success(), "{}", received.status_str());
    assert_eq!(
        (
            received.wr_id,
            received.qp_num,
            received.byte_len,
            received.is_recv()
        ),
        (1, server_qp, 4, true)
    );
    assert_eq!(
        server.read_memory(&server_mem, 0..4).expect("read"),
        b"ping"
    );

    server
        .write_memory(&server_mem, 32, b"pong!")
        .expect("write");
    server
        .post_send(&server_mem, 32..37, 11)
        .expect("post_send");
    let sent = wait_completion("server send", || server.poll_send_cq(4));
    assert!(sent.is_success(), "{}", sent.status_str());
    let received = wait_completion("client receive", || client.poll_recv_cq(4));
    assert_eq!((received.wr_id, received.byte_len), (2, 5));
    assert_eq!(
        client.read_memory(&client_mem, 32..37).expect("read"),
        b"pong!"
    );
    // Out-of-range access is refused, not performed.
    assert!(matches!(
        server.read_memory(&server_mem, 60..70),
        Err(CmError::InvalidArgument { .. })
    ));
    assert_eq!(server_mem.len(), 64);
    // A region of one id is refused by another.
    assert!(matches!(
        server.post_recv(&client_mem, 0..4, 3),
        Err(CmError::InvalidArgument { .. })
    ));

    // Teardown: each side must see DISCONNECTED and answer with its own disconnect, or the
    // other side's destroy waits out the CM's DREQ timeout.
    client.disconnect().expect("client disconnect");
    expect_event(&server_channel, CmEventType::Disconnected)
        .ack()
        .expect("ack");
    server.disconnect().expect("server disconnect");
    expect_event(&client_channel, CmEventType::Disconnected)
        .ack()
        .expect("ack");
    // Disconnected: notify is refused again.
    assert_eq!(
        server.notify(AsyncEventType::CommEst),
        Err(NotifyError::WrongState)
    );
}

#[test]
fn a_dropped_connect_request_rejects_the_connection() {
    let Some(setup) = addresses("a_dropped_connect_request_rejects_the_connection") else {
        return;
    };
    let server_channel = EventChannel::new().expect("server channel");
    let client_channel = EventChannel::new().expect("client channel");
    let listener = listener_on(&server_channel, setup.addr_a, 4);

    let client = resolved_to(&listener, &client_channel, setup.addr_b);
    client.create_qp(&QpCaps::default()).expect("client QP");
    client.connect(&ConnParams::default()).expect("connect");

    // The application ignores the request: the event (acked on drop) was the new id's
    // last owner, so the id is destroyed and the kernel rejects the REQ.
    drop(expect_event(&server_channel, CmEventType::ConnectRequest));
    let event = client_channel
        .next_event_timeout(WAIT)
        .expect("read")
        .expect("an answer to the REQ");
    assert!(
        event.event_type().is_connect_failure(),
        "{:?} (status {})",
        event.event_type(),
        event.status()
    );
}

#[test]
fn notify_forces_established_when_the_rtu_is_lost() {
    let Some(setup) = common::setup("notify_forces_established_when_the_rtu_is_lost") else {
        return;
    };
    let server_channel = EventChannel::new().expect("server channel");
    let client_channel = EventChannel::new().expect("client channel");
    let listener = listener_on(&server_channel, setup.addr_a, 4);
    let client = resolved_to(&listener, &client_channel, setup.addr_b);
    client.create_qp(&QpCaps::default()).expect("client QP");
    let client_mem = client.register_memory(16).expect("client memory");

    let rtu_drop = CmMadRule::install(
        &setup.nft,
        RTU_DROP_TABLE,
        setup.addr_a,
        RTU,
        MadAction::Drop,
    )
    .expect("install the RTU drop");
    client.connect(&ConnParams::default()).expect("connect");
    let request = expect_event(&server_channel, CmEventType::ConnectRequest);
    let server = request.id().expect("new id").clone();
    request.ack().expect("ack");
    let server_qp = server.create_qp(&QpCaps::default()).expect("server QP");
    let server_mem = server.register_memory(16).expect("server memory");
    server.post_recv(&server_mem, 0..16, 1).expect("post_recv");
    server.accept(&ConnParams::default()).expect("accept");

    // The active side is established (its RTU is sent, and dropped) and sends at once.
    expect_event(&client_channel, CmEventType::Established)
        .ack()
        .expect("ack");
    client
        .write_memory(&client_mem, 0, b"early")
        .expect("write");
    client.post_send(&client_mem, 0..5, 7).expect("post_send");

    // The passive QP (RTS since accept) completes the receive while its id is still in
    // REP_SENT: no ESTABLISHED has arrived.
    let received = wait_completion("server receive", || server.poll_recv_cq(4));
    assert!(received.is_success(), "{}", received.status_str());
    assert_eq!((received.qp_num, received.byte_len), (server_qp, 5));
    assert!(
        rtu_drop.hits().expect("read the RTU drop's counter") > 0,
        "the RTU was not dropped"
    );
    if let Some(event) = server_channel.try_next_event().expect("read") {
        panic!("the passive side got {event:?} without its RTU");
    }

    // Forwarding the trigger forces the connection to ESTABLISHED: exactly one event.
    assert_eq!(
        server.notify(AsyncEventType::CommEst),
        Ok(NotifyOutcome::Established)
    );
    let established = expect_event(&server_channel, CmEventType::Established);
    assert_eq!(established.id(), Some(&server));
    established.ack().expect("ack");
    assert_eq!(
        server.notify(AsyncEventType::CommEst),
        Ok(NotifyOutcome::AlreadyEstablished)
    );
    drop(rtu_drop);
    if let Some(event) = server_channel
        .next_event_timeout(Duration::from_millis(200))
        .expect("read")
    {
        panic!("a second event after the forced establish: {event:?}");
    }

    client.disconnect().expect("client disconnect");
    expect_event(&server_channel, CmEventType::Disconnected)
        .ack()
        .expect("ack");
    server.disconnect().expect("server disconnect");
    expect_event(&client_channel, CmEventType::Disconnected)
        .ack()
        .expect("ack");
}
